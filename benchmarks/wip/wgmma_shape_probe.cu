// WGMMA instruction forms timed at the power cap: does a 128 x 256 CTA tile computed as chunks of
// m64n64 or m64n32 (the tokens along the instruction's N) run as fast per MAC as one m64n256?
//
// The question behind it (benchmarks/NOTES.md, thirty-fifth session): with the problem swapped
// (out^T = W^T x^T, the weights as WGMMA's A operand and the tokens as its N), an expert's ragged
// tail could be padded to 32 or 64 tokens, not to the 64 or 128 rows of today's tiles, provided the
// instruction forms with a small N cost no more per MAC. Each variant below runs the same CTA tile
// (2 consumer warp groups, each 64 rows of A x 256 columns of B, fp32 accumulators, K blocks of 64
// in 4 stages of shared memory), only the instructions differ:
//   ss_nX: A and B from shared memory, 256 / X instructions per k16 step (A read again by each);
//   rs_nX: A loaded into registers (ldmatrix, as CUTLASS's RS mainloop) once per k16 step, then
//          256 / X instructions with A from registers and B from shared memory;
//   rs_n64_cK: rs_n64 with only the first K of the 4 chunks issued (a short tail), chunk count
//          known at compile time; rs_n64_gK: the same with a run-time count and a guard per chunk.
// With --tma a third warp group streams every stage from global memory (L2-resident) with bulk
// copies behind full/empty mbarriers, as the kernels' producer does: 48 KB per K block.
// Data is random bf16 (never zeros). Each variant runs back to back for --heat-s, then is timed for
// --seconds (CUDA events); variants alternate over --rounds. Prints TFLOP/s counting issued MACs.
//
// Build (on the GPU machine, CUTLASS headers from the wheel):
//   C=$(python3 -c "import cutlass_library,os;print(os.path.dirname(cutlass_library.__file__))")/source/include
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -I$C -o /tmp/probe benchmarks/wip/wgmma_shape_probe.cu
// Run: /tmp/probe [--tma] [--tiles] [--rounds 3] [--heat-s 1.0] [--seconds 1.0]
// The continuous and tiled SS loops share one K-block body since the thirty-fifth session's runs
// (the same instructions; compiled, not re-run): benchmarks/NOTES.md has the numbers.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/bfloat16.h>

using namespace cute;
using bf16 = cutlass::bfloat16_t;

constexpr int kStages = 4;
constexpr int kTileM = 128, kTileN = 256, kTileK = 64;
constexpr int kBytesA = kTileM * kTileK * 2, kBytesB = kTileN * kTileK * 2;
constexpr int kStageBytes = kBytesA + kBytesB;
constexpr int kSmemBytes = kStages * kStageBytes + 1024 + 2 * 16384;  // + barriers, + held tiles

using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16>{},
                                           make_shape(Int<kTileM>{}, Int<kTileK>{}, Int<kStages>{})));
using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16>{},
                                           make_shape(Int<kTileN>{}, Int<kTileK>{}, Int<kStages>{})));

template <int N, bool RS> struct AtomOf;
#define PROBE_ATOM(N)                                                                          \
  template <> struct AtomOf<N, false> {                                                        \
    using type = SM90_64x##N##x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>;              \
  };                                                                                           \
  template <> struct AtomOf<N, true> {                                                         \
    using type = SM90_64x##N##x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::K>;              \
  };
PROBE_ATOM(256)
PROBE_ATOM(128)
PROBE_ATOM(64)
PROBE_ATOM(32)
#undef PROBE_ATOM

struct Barriers {
  uint64_t full[kStages];
  uint64_t empty[kStages];
};

__device__ __forceinline__ uint32_t hash32(uint32_t x) {
  x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16;
  return x;
}

// kN: the instruction's N; kRS: A from registers; kChunks: how many of the 256 / kN chunks to issue
// (compile time); kGuard: issue chunk n only if n < chunks (run time). kTileBlocks (ss_n256 only):
// 0 runs one endless accumulation; otherwise the K blocks form tiles of kTileBlocks, and between
// tiles the consumers drain their MMAs (wait<0>) and restart from zero, as a persistent kernel
// does; kHold also converts the accumulators to bf16 pairs in registers and writes them to shared
// memory during the next tile's first K block (the deferred stores' shared-memory half).
template <int kN, bool kRS, int kChunks, bool kGuard, bool kTma, int kTileBlocks = 0, bool kHold = false,
          int kLagCycles = 0>
__global__ void __launch_bounds__(kTma ? 384 : 256, 1)
probe_kernel(long iters, int chunks, bf16 const* src, long src_blocks, float* sink, long long* cycles) {
  extern __shared__ __align__(1024) char smem[];
  bf16* smem_a = reinterpret_cast<bf16*>(smem);
  bf16* smem_b = reinterpret_cast<bf16*>(smem + kStages * kBytesA);
  Barriers* bars = reinterpret_cast<Barriers*>(smem + kStages * kStageBytes);
  const int tid = threadIdx.x;

  // Random bf16 in every stage (the TMA variant overwrites them with random data from src).
  for (int i = tid; i < kStages * kStageBytes / 2; i += blockDim.x) {
    uint32_t h = hash32(i * 2654435761u + blockIdx.x * 97u);
    reinterpret_cast<bf16*>(smem)[i] = bf16(float(int(h & 0xffff) - 32768) * (1.0f / 32768.0f));
  }
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&bars->full[s], 1);
      cutlass::arch::ClusterBarrier::init(&bars->empty[s], 2);  // one arrival per consumer warp group
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const long long t_start = clock64();

  if constexpr (kTma) {
    if (tid >= 256) {  // the producer warp group: one thread streams the stages
      cutlass::arch::warpgroup_reg_dealloc<40>();
      if (tid == 256) {
        for (long it = 0; it < iters; ++it) {
          const int s = it % kStages;
          const uint32_t phase = (it / kStages) & 1;
          if (it >= kStages) cutlass::arch::ClusterBarrier::wait(&bars->empty[s], phase ^ 1);
          cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&bars->full[s], kStageBytes);
          const long blk = (it * gridDim.x + blockIdx.x) % src_blocks;
          const char* g = reinterpret_cast<const char*>(src) + blk * kStageBytes;
          SM90_BULK_COPY_G2S::copy(g, &bars->full[s], smem_a + s * (kBytesA / 2), kBytesA);
          SM90_BULK_COPY_G2S::copy(g + kBytesA, &bars->full[s], smem_b + s * (kBytesB / 2), kBytesB);
        }
      }
      return;
    }
    cutlass::arch::warpgroup_reg_alloc<232>();  // as the kernels' consumers
  }

  using Atom = typename AtomOf<kN, kRS>::type;
  using TiledMma = decltype(make_tiled_mma(Atom{}, Layout<Shape<_2, _1, _1>>{}));
  TiledMma tiled_mma;
  Tensor sA = make_tensor(make_smem_ptr(smem_a), SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem_b), SmemLayoutB{});
  const int warp_group = __shfl_sync(0xffffffff, tid / 128, 0);
  auto wg_slice = tiled_mma.get_slice(warp_group * 128);
  auto thr_slice = tiled_mma.get_thread_slice(tid);
  Tensor tCrB = wg_slice.make_fragment_B(wg_slice.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)
  Tensor accum = partition_fragment_C(tiled_mma, Shape<Int<kTileM>, Int<kTileN>>{});  // (MMA, 1, MMA_N)
  static_assert(size<1>(tCrB) == 256 / kN, "chunks along N");

  auto wait_full = [&](long it) {
    if constexpr (kTma) cutlass::arch::ClusterTransactionBarrier::wait(&bars->full[it % kStages], (it / kStages) & 1);
  };
  auto release = [&](long it) {  // the stage of K block it is no longer read
    if constexpr (kTma) {
      if (tid % 128 == 0) cutlass::arch::ClusterBarrier::arrive(&bars->empty[it % kStages]);
    }
  };
  auto mma_step = [&](auto const& a, int k, int s) {
    CUTLASS_PRAGMA_UNROLL
    for (int n = 0; n < kChunks; ++n) {
      if constexpr (kGuard) {
        if (n < chunks) cute::gemm(tiled_mma, a, tCrB(_, n, k, s), accum(_, 0, n));
      } else {
        cute::gemm(tiled_mma, a, tCrB(_, n, k, s), accum(_, 0, n));
      }
    }
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  };

  tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  warpgroup_fence_operand(accum);
  if constexpr (!kRS) {
    static_assert(kTileBlocks == 0 || (kN == 256 && !kGuard), "tiles: the ss_n256 loop");
    Tensor tCrA = wg_slice.make_fragment_A(wg_slice.partition_A(sA));  // descriptors
    uint32_t held[kHold ? size(accum) / 2 : 1];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < int(sizeof(held) / sizeof(held[0])); ++i) held[i] = 0;
    uint32_t* epi = reinterpret_cast<uint32_t*>(smem + kStages * kStageBytes + 1024) + warp_group * 4096;
    // K block `it`, the tile's block `kb`: its MMAs, the held tile staged with them (kHold, first
    // block only), then the previous block's stage released (within the tile: the tile's last
    // block is released after its drain).
    auto k_block = [&](long it, long kb, bool store_held) {
      const int s = it % kStages;
      wait_full(it);
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < size<2>(tCrA); ++k) mma_step(tCrA(_, 0, k, s), k, s);
      warpgroup_commit_batch();
      if constexpr (kHold) {
        if (store_held) {  // compile-time true in the peeled first block only
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(accum) / 2; ++i) epi[(i % 32) * 128 + tid % 128] = held[i];
        }
      }
      warpgroup_wait<1>();
      warpgroup_fence_operand(accum);
      if (kb > 0) release(it - 1);
    };
    if constexpr (kTileBlocks == 0) {  // one endless tile
      CUTLASS_PRAGMA_NO_UNROLL
      for (long it = 0; it < iters; ++it) k_block(it, it, false);
    } else {
      if constexpr (kLagCycles > 0) {  // consumer 1 starts late, so that the two drain at different times
        if (warp_group == 1) {
          const long long t0 = clock64();
          while (clock64() - t0 < kLagCycles) {
          }
        }
      }
      long it = 0;
      CUTLASS_PRAGMA_NO_UNROLL
      for (long t = 0; t < iters / kTileBlocks; ++t) {
        tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
        k_block(it++, 0, true);
        CUTLASS_PRAGMA_NO_UNROLL
        for (int kb = 1; kb < kTileBlocks; ++kb) k_block(it++, kb, false);
        warpgroup_wait<0>();
        warpgroup_fence_operand(accum);
        release(it - 1);
        if constexpr (kHold) {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(accum) / 2; ++i) {
            __nv_bfloat162 v = __floats2bfloat162_rn(accum(2 * i), accum(2 * i + 1));
            held[i] = reinterpret_cast<uint32_t&>(v);
          }
        }
      }
    }
    if constexpr (kHold) {
      uint32_t x = 0;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum) / 2; ++i) x ^= held[i];
      if (x == 0x12345u) sink[blockIdx.x * blockDim.x + tid] = float(x);
    }
  } else {
    // A in registers: CUTLASS's RS mainloop's copy (ldmatrix) and its one-step-ahead order.
    Tensor tCsA = thr_slice.partition_A(sA);
    Tensor tCrA = thr_slice.partition_fragment_A(sA(_, _, Int<0>{}));  // (MMA, MMA_M, MMA_K)
    auto copy_a = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, bf16>{}, tiled_mma);
    auto thr_copy = copy_a.get_thread_slice(tid);
    Tensor tCrA_view = thr_copy.retile_D(tCrA);
    Tensor tCsA_view = thr_copy.partition_S(sA);
    constexpr int kSteps = size<2>(tCrA);
    wait_full(0);
    copy(copy_a, tCsA_view(_, _, 0, 0), tCrA_view(_, _, 0));
    CUTLASS_PRAGMA_NO_UNROLL
    for (long it = 0; it < iters; ++it) {
      const int s = it % kStages;
      warpgroup_fence_operand(accum);
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kSteps; ++k) {
        if (k + 1 < kSteps) {
          copy(copy_a, tCsA_view(_, _, k + 1, s), tCrA_view(_, _, k + 1));
        } else if (it + 1 < iters) {
          wait_full(it + 1);
          copy(copy_a, tCsA_view(_, _, 0, (it + 1) % kStages), tCrA_view(_, _, 0));
        }
        warpgroup_arrive();
        mma_step(tCrA(_, 0, k), k, s);
        warpgroup_commit_batch();
        warpgroup_wait<2>();
        if (k == 1 && it > 0) release(it - 1);
      }
      warpgroup_fence_operand(accum);
    }
  }
  warpgroup_wait<0>();
  float acc = 0.f;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(accum); ++i) acc += accum(i);
  if (acc == 1234.5f) sink[blockIdx.x * blockDim.x + tid] = acc;  // keeps the MMAs live
  if (tid == 0) cycles[blockIdx.x] = clock64() - t_start;
}

struct Variant {
  std::string name;
  void (*kernel)(long, int, bf16 const*, long, float*, long long*);
  int chunks;        // run-time chunk count (guarded variants)
  double mac_share;  // the issued MACs as a share of the full 128 x 256 x 64 per K block
  bool tma;
};

template <int kN, bool kRS, int kChunks, bool kGuard, bool kTma, int kTileBlocks = 0, bool kHold = false,
          int kLagCycles = 0>
Variant make_variant(const char* name, int chunks = 256 / kN) {
  auto k = probe_kernel<kN, kRS, kChunks, kGuard, kTma, kTileBlocks, kHold, kLagCycles>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  const int issued = kGuard ? chunks : kChunks;
  return {name, k, chunks, double(issued * kN) / 256.0, kTma};
}

int main(int argc, char** argv) {
  bool tma = false, tiles = false;
  int rounds = 3;
  double heat_s = 1.0, seconds = 1.0;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--tma")) tma = true;
    else if (!strcmp(argv[i], "--tiles")) tiles = true;
    else if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--heat-s")) heat_s = atof(argv[++i]);
    else if (!strcmp(argv[i], "--seconds")) seconds = atof(argv[++i]);
  }
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const long src_blocks = 256;  // 12 MB of random stages: L2-resident
  bf16* src = nullptr;
  float* sink = nullptr;
  cudaMalloc(&src, src_blocks * kStageBytes);
  cudaMalloc(&sink, sms * 384 * sizeof(float));
  long long* cycles = nullptr;
  cudaMalloc(&cycles, sms * sizeof(long long));
  {
    std::vector<uint16_t> h(src_blocks * kStageBytes / 2);
    for (size_t i = 0; i < h.size(); ++i) {
      bf16 v(float(int(((i * 2654435761u) >> 8) & 0xffff) - 32768) * (1.0f / 32768.0f));
      memcpy(&h[i], &v, 2);
    }
    cudaMemcpy(src, h.data(), h.size() * 2, cudaMemcpyHostToDevice);
  }
  std::vector<Variant> variants;
  if (tiles && !tma) {
    variants = {make_variant<256, false, 1, false, false>("ss_n256"),
                make_variant<256, false, 1, false, false, 4, false>("tile4_switch"),
                make_variant<256, false, 1, false, false, 4, true>("tile4_hold"),
                make_variant<256, false, 1, false, false, 16, false>("tile16_switch"),
                make_variant<256, false, 1, false, false, 16, true>("tile16_hold")};
  } else if (tiles) {
    variants = {make_variant<256, false, 1, false, true>("ss_n256+tma"),
                make_variant<256, false, 1, false, true, 4, false>("tile4_switch+tma"),
                make_variant<256, false, 1, false, true, 4, true>("tile4_hold+tma"),
                make_variant<256, false, 1, false, true, 16, false>("tile16_switch+tma"),
                make_variant<256, false, 1, false, true, 16, true>("tile16_hold+tma"),
                make_variant<256, false, 1, false, true, 4, true, 1000>("tile4_hold_lag1k+tma"),
                make_variant<256, false, 1, false, true, 4, true, 3000>("tile4_hold_lag3k+tma"),
                make_variant<256, false, 1, false, true, 16, true, 3000>("tile16_hold_lag3k+tma")};
  } else if (!tma) {
    variants = {make_variant<256, false, 1, false, false>("ss_n256"),
                make_variant<128, false, 2, false, false>("ss_n128"),
                make_variant<64, false, 4, false, false>("ss_n64"),
                make_variant<32, false, 8, false, false>("ss_n32"),
                make_variant<256, true, 1, false, false>("rs_n256"),
                make_variant<64, true, 4, false, false>("rs_n64"),
                make_variant<32, true, 8, false, false>("rs_n32"),
                make_variant<64, true, 2, false, false>("rs_n64_c2"),
                make_variant<64, true, 4, true, false>("rs_n64_g4", 4),
                make_variant<64, true, 4, true, false>("rs_n64_g2", 2)};
  } else {
    variants = {make_variant<256, false, 1, false, true>("ss_n256+tma"),
                make_variant<64, false, 4, false, true>("ss_n64+tma"),
                make_variant<256, true, 1, false, true>("rs_n256+tma"),
                make_variant<64, true, 4, false, true>("rs_n64+tma"),
                make_variant<32, true, 8, false, true>("rs_n32+tma"),
                make_variant<64, true, 2, false, true>("rs_n64_c2+tma"),
                make_variant<64, true, 4, true, true>("rs_n64_g4+tma", 4)};
  }
  const double macs_per_block = double(kTileM) * kTileN * kTileK;
  // Size one launch to about 20 ms at 600 TFLOP/s.
  // A multiple of 16 K blocks: every tile variant consumes exactly what the producer loads.
  const long iters = long(20e-3 * 600e12 / 2 / (macs_per_block * sms)) / 16 * 16;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  auto launch = [&](const Variant& v) {
    v.kernel<<<sms, v.tma ? 384 : 256, kSmemBytes>>>(iters, v.chunks, src, src_blocks, sink, cycles);
  };
  for (const auto& v : variants) {  // one launch each: correctness of the launch itself
    launch(v);
    cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      printf("%s: %s\n", v.name.c_str(), cudaGetErrorString(err));
      return 1;
    }
  }
  printf("iters per launch %ld, %d CTAs\n", iters, sms);
  printf("round variant tflops_issued tflops_full_tile ms_per_launch unix_start unix_end mean_cycles\n");
  for (int r = 0; r < rounds; ++r) {
    for (const auto& v : variants) {
      auto t0 = std::chrono::steady_clock::now();
      while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < heat_s) {
        launch(v);
        cudaDeviceSynchronize();
      }
      const double start = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
      int launches = 0;
      float total_ms = 0.f;
      auto t1 = std::chrono::steady_clock::now();
      while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count() < seconds) {
        cudaEventRecord(e0);
        for (int i = 0; i < 5; ++i) launch(v);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms = 0.f;
        cudaEventElapsedTime(&ms, e0, e1);
        total_ms += ms;
        launches += 5;
      }
      const double end = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
      const double ms = total_ms / launches;
      std::vector<long long> cyc(sms);
      cudaMemcpy(cyc.data(), cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost);
      double mean_cycles = 0;
      for (long long c : cyc) mean_cycles += double(c) / sms;
      const double full = 2.0 * macs_per_block * sms * iters / (ms * 1e-3) / 1e12;
      printf("%d %s %.1f %.1f %.3f %.3f %.3f %.0f\n", r, v.name.c_str(), full * v.mac_share, full, ms, start, end,
             mean_cycles);
      fflush(stdout);
    }
  }
  return 0;
}
