// sm80 MoE-specialized GEMM: CUTLASS 2.x's GemmGrouped kernel with our tile scheduler in place of
// its problem visitor. One launch, no per-expert arrays.
//
// MoeGemmKernel follows cutlass::gemm::kernel::GemmGrouped (Arguments, Params, SharedStorage,
// can_implement, get_workspace_size, operator()) and takes its Mma and Epilogue from
// DefaultGemmGrouped for the same config. Where GemmGrouped's problem visitor reads per-expert
// problem sizes and pointers from arrays, MoeTileScheduler (moe_tile_scheduler.hpp) finds each
// tile's expert, row offset and row count from tokens_per_expert on the device, and the expert's
// A/B/D pointers come from the base pointers: x + row_start * ldx, weights + expert * expert_stride,
// out + row_start * ldout. CUTLASS's predicated tile iterators clip A and D at the expert's rows, so
// nothing outside them is read or written.
#pragma once

#include <cutlass/device_kernel.h>

#include "check.h"
#include "fused_epilogue.hpp"
#include "kernel_families.h"
#include "launch_facts.h"
#include "moe_tile_scheduler.hpp"
#include "sm80/sm80_common.cuh"
#include "zero_fill.cuh"

namespace cutlass_moe::sm80 {

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
struct MoeGemmKernel {
  using Types            = KernelTypes<kDType, kLayout, kConfig>;
  using GroupedKernel    = typename Types::GroupedKernel;  // CUTLASS's GemmGrouped for this config
  using Mma              = typename GroupedKernel::Mma;
  using Epilogue         = typename GroupedKernel::Epilogue;
  using EpilogueOutputOp = typename GroupedKernel::EpilogueOutputOp;
  using Element          = typename Types::Element;
  using LayoutA          = typename Types::LayoutA;
  using LayoutB          = typename Types::LayoutB;
  using LayoutC          = typename Types::LayoutC;
  static constexpr int kTileM = Types::ThreadblockShape::kM;
  static constexpr int kTileN = Types::ThreadblockShape::kN;
  static constexpr int kTileK = Types::ThreadblockShape::kK;
  static constexpr int kThreadCount = GroupedKernel::kThreadCount;
  using Scheduler = MoeTileScheduler<kTileM>;
  using Fused = FusedEpilogue<Element>;

  // The warp-level accumulator layout (CUTLASS 2.x MmaTensorOp, mma.sync m16n8k16, accumulators
  // not in row-major order): the fragment is MmaIterations (kRow x kColumn) 16x8 tiles, tile
  // (m, n) at m + n kRow, each 4 values c0..c3 at rows lane / 4 (+8 for c2, c3) and columns
  // 2 (lane % 4) (+1 for c1, c3) of the tile; warps are placed kM-major in the threadblock tile.
  using WarpMma = typename Mma::Operator;
  using WarpShape = typename WarpMma::Shape;
  using InstructionShape = typename WarpMma::Policy::Operator::Shape;
  static constexpr int kIterRows = WarpShape::kM / InstructionShape::kM;
  static constexpr int kWarpsM = kTileM / WarpShape::kM;
  static constexpr int kWarpsN = kTileN / WarpShape::kN;
  static constexpr int kValues = Mma::FragmentC::kElements;
  static constexpr int kPairs = kValues / 2;
  static_assert(InstructionShape::kM == 16 && InstructionShape::kN == 8 &&
                    kValues == kIterRows * (WarpShape::kN / InstructionShape::kN) * 4,
                "the fused epilogue's fragment layout is mma.sync m16n8's");

  struct Arguments {
    int num_tokens;
    int n;
    int k;
    int num_experts;
    Element const* ptr_A;  // x
    int64_t lda;
    Element const* ptr_B;  // weights
    int64_t ldb;
    int64_t expert_stride;
    Element* ptr_D;        // out
    int64_t ldd;
    void const* tokens_per_expert;
    bool counts_are_int64;
    typename EpilogueOutputOp::Params output_op;
    int threadblock_count;  // persistent CTAs
    Fused fused;
    bool zero_unowned;  // a new output: also zero the rows no expert owns (after the tiles)
  };

  struct Params {
    typename Scheduler::Params scheduler;
    typename Mma::IteratorA::Params params_A;
    typename Mma::IteratorB::Params params_B;
    typename Epilogue::OutputTileIterator::Params params_D;
    typename EpilogueOutputOp::Params output_op;
    Element const* ptr_A;
    int64_t lda;
    Element const* ptr_B;
    int64_t expert_stride;
    Element* ptr_D;
    int64_t ldd;
    int n;
    int k;
    int threadblock_count;
    Fused fused;
    int num_tokens;
    int out_cols;        // N, or N / 2 when gated
    bool zero_unowned;

    Params() = default;
    explicit Params(Arguments const& args)
        : scheduler{args.tokens_per_expert, args.counts_are_int64, args.num_experts, args.num_tokens,
                    (args.n + kTileN - 1) / kTileN, {}},
          params_A(LayoutA(args.lda)),
          params_B(LayoutB(args.ldb)),
          params_D(LayoutC(args.ldd)),
          output_op(args.output_op),
          ptr_A(args.ptr_A),
          lda(args.lda),
          ptr_B(args.ptr_B),
          expert_stride(args.expert_stride),
          ptr_D(args.ptr_D),
          ldd(args.ldd),
          n(args.n),
          k(args.k),
          threadblock_count(args.threadblock_count),
          fused(args.fused),
          num_tokens(args.num_tokens),
          out_cols(args.fused.gated ? args.n / 2 : args.n),
          zero_unowned(args.zero_unowned) {}
  };

  union SharedStorage {
    typename Mma::SharedStorage main_loop;
    typename Epilogue::SharedStorage epilogue;
  };

  static cutlass::Status can_implement(Arguments const& args) {
    constexpr int kAlignment = Types::kAlignment;
    if (args.num_tokens <= 0 || args.n <= 0 || args.k <= 0 || args.num_experts <= 0) {
      return cutlass::Status::kErrorInvalidProblem;
    }
    if (int64_t(args.num_tokens) + kTileM >= (int64_t{1} << 31) || args.tokens_per_expert == nullptr) {
      return cutlass::Status::kErrorInvalidProblem;
    }
    if (args.n % kAlignment || args.k % kAlignment || args.lda % kAlignment || args.ldb % kAlignment ||
        args.expert_stride % kAlignment || args.ldd % kAlignment) {
      return cutlass::Status::kErrorMisalignedOperand;
    }
    return cutlass::Status::kSuccess;
  }

  static size_t get_workspace_size(Arguments const&) { return 0; }

  // Persistent: min(threadblock_count, most tiles any count vector can make).
  static dim3 get_grid_shape(Params const& params) {
    return dim3(persistent_grid(params.threadblock_count, params.scheduler.num_tokens, params.scheduler.num_experts,
                                params.scheduler.tiles_n, kTileM));
  }

  CUTLASS_DEVICE void operator()(Params const& params, SharedStorage& shared_storage) {
    const int thread_idx = threadIdx.x;
    const int warp_idx = cutlass::canonical_warp_idx_sync();
    const int lane_idx = threadIdx.x % 32;
    const int gemm_k_iterations = (params.k + kTileK - 1) / kTileK;
    Scheduler scheduler(params.scheduler);  // every warp walks the experts itself

    for (int64_t index = blockIdx.x;; index += gridDim.x) {
      const MoeTile tile = scheduler.tile(index);
      if (!tile.valid) break;
      const cutlass::gemm::GemmCoord problem_size(tile.rows, params.n, params.k);
      const cutlass::gemm::GemmCoord threadblock_offset(tile.m_tile * kTileM, tile.n_tile * kTileN, 0);

      // A and D are the expert's rows only: the iterators predicate off rows >= tile.rows.
      Element* ptr_A = const_cast<Element*>(params.ptr_A) + int64_t(tile.row_start) * params.lda;
      Element* ptr_B = const_cast<Element*>(params.ptr_B) + tile.expert * params.expert_stride;
      typename Mma::IteratorA iterator_A(params.params_A, ptr_A, {problem_size.m(), problem_size.k()}, thread_idx,
                                         {threadblock_offset.m(), 0});
      typename Mma::IteratorB iterator_B(params.params_B, ptr_B, {problem_size.k(), problem_size.n()}, thread_idx,
                                         {0, threadblock_offset.n()});
      typename Mma::FragmentC accumulators;
      accumulators.clear();
      const auto coords = [&](int i) { return fragment_coord(i, warp_idx, lane_idx); };
      typename Fused::template Operands<kPairs> fused;
      if (params.fused.enabled) {
        fused = params.fused.template load<kPairs>(coords, tile.expert, tile.row_start + threadblock_offset.m(),
                                                   threadblock_offset.n());
      }

      __syncthreads();  // the previous tile's epilogue is done with shared memory
      Mma mma(shared_storage.main_loop, thread_idx, warp_idx, lane_idx);
      mma(gemm_k_iterations, accumulators, iterator_A, iterator_B, accumulators);

      Element* ptr_D = params.ptr_D + int64_t(tile.row_start) * params.ldd;
      if (params.fused.enabled) {
        auto accum = [&](int i) -> float& { return accumulators[i]; };
        params.fused.apply(accum, coords, fused, tile.expert, threadblock_offset.n());
        if (params.fused.gated) {
          store_gated(params, accumulators, coords, ptr_D, tile.rows - threadblock_offset.m(), threadblock_offset);
          continue;
        }
      }
      typename Epilogue::OutputTileIterator iterator_D(params.params_D, ptr_D, problem_size.mn(), thread_idx,
                                                       threadblock_offset.mn());
      EpilogueOutputOp output_op(params.output_op);
      Epilogue epilogue(shared_storage.epilogue, thread_idx, warp_idx, lane_idx);
      epilogue(output_op, iterator_D, accumulators, iterator_D);  // source unused (alpha-only op)
    }
    // A new output: this CTA's share of the rows past the owned rows (from this warp's scheduler walk).
    if (params.zero_unowned) {
      const int end = scheduler.owned_rows_end();
      zero_rows(params.ptr_D, params.out_cols, params.ldd, end, params.num_tokens,
                int64_t(blockIdx.x) * kThreadCount + thread_idx, int64_t(gridDim.x) * kThreadCount);
    }
  }

 private:
  // Value i of the thread's accumulators: its (row, column) in the threadblock tile.
  CUTLASS_DEVICE static cute::tuple<int, int> fragment_coord(int i, int warp_idx, int lane_idx) {
    const int warp_mn = warp_idx % (kWarpsM * kWarpsN);
    const int mma_tile = i / 4, value = i % 4;
    const int row = (warp_mn % kWarpsM) * WarpShape::kM + (mma_tile % kIterRows) * 16 + lane_idx / 4 + (value / 2) * 8;
    const int col = (warp_mn / kWarpsM) * WarpShape::kN + (mma_tile / kIterRows) * 8 + (lane_idx % 4) * 2 + value % 2;
    return cute::make_tuple(row, col);
  }

  // A gated tile: each (gate, up) pair's output, in its first value, to out's column col / 2 (out
  // has N / 2 columns; ptr_D: the expert's first row), for the tile's rows < rows_left.
  template <class Coords>
  CUTLASS_DEVICE static void store_gated(Params const& params, typename Mma::FragmentC const& accumulators,
                                         Coords const& coords, Element* ptr_D, int rows_left,
                                         cutlass::gemm::GemmCoord const& offset) {
    CUTLASS_PRAGMA_UNROLL
    for (int p = 0; p < kPairs; ++p) {
      const auto c = coords(2 * p);
      const int row = cute::get<0>(c), col = offset.n() + cute::get<1>(c);
      if (row < rows_left && col < params.n) {
        ptr_D[int64_t(offset.m() + row) * params.ldd + col / 2] = Element(accumulators[2 * p]);
      }
    }
  }
};

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
size_t MoeGemmInstance<kDType, kLayout, kConfig>::workspace_size(int64_t, int) {
  return MoeGemmKernel<kDType, kLayout, kConfig>::get_workspace_size({});
}

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
void MoeGemmInstance<kDType, kLayout, kConfig>::run(const MoeGemmProblem& p, void*, size_t, int sm_count,
                                                    cudaStream_t stream) {
  using Kernel = MoeGemmKernel<kDType, kLayout, kConfig>;
  using Element = typename Kernel::Element;
  constexpr int kSmemBytes = static_cast<int>(sizeof(typename Kernel::SharedStorage));

  int device = 0;
  CUTLASS_MOE_CHECK_CUDA(cudaGetDevice(&device));
  const void* kernel = reinterpret_cast<const void*>(&cutlass::Kernel<Kernel>);
  const int ctas_per_sm = resident_ctas_per_sm(kernel, Kernel::kThreadCount, kSmemBytes, device);

  typename Kernel::Arguments args{static_cast<int>(p.num_tokens), static_cast<int>(p.n), static_cast<int>(p.k),
                                  static_cast<int>(p.num_experts),
                                  static_cast<Element const*>(p.x), p.ldx,
                                  static_cast<Element const*>(p.weights), p.ldw, p.expert_stride,
                                  static_cast<Element*>(p.out), p.ldout,
                                  p.tokens_per_expert, p.count_type == IndexType::kInt64,
                                  typename Kernel::EpilogueOutputOp::Params(1.0f),
                                  sm_count * ctas_per_sm,
                                  {static_cast<Element const*>(p.bias), p.bias_stride, p.row_scale,
                                   static_cast<int>(p.activation), static_cast<int>(p.num_tokens),
                                   static_cast<int>(p.n), has_fused_epilogue(p), p.gated, p.alpha, p.limit},
                                  p.zero_unowned};
  const cutlass::Status status = Kernel::can_implement(args);
  CUTLASS_MOE_CHECK(status == cutlass::Status::kSuccess, Status::kInvalidArgument,
                    "the sm80 MoE kernel cannot take this problem: " << cutlassGetStatusString(status));
  const typename Kernel::Params params(args);
  cutlass::Kernel<Kernel><<<Kernel::get_grid_shape(params), Kernel::kThreadCount, kSmemBytes, stream>>>(params);
  CUTLASS_MOE_CHECK_CUDA(cudaGetLastError());
}

}  // namespace cutlass_moe::sm80
