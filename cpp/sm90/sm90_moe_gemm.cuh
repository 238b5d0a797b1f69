// sm90 (Hopper) MoE-specialized GEMM: one launch, no per-expert arrays.
//
// The kernel gets the base pointers of x, weights and out, E, N, K and the device pointer to
// tokens_per_expert. A persistent tile scheduler (moe_tile_scheduler.hpp) finds each tile's expert
// and row offset on the device. Operands move as follows:
//   - x (A) has one TMA descriptor, over a "ragged" view of x (see run()) in which a box can start
//     at any row and stop at the expert's last row: a tile loads exactly its expert's rows, and TMA
//     zero-fills the rest of the box without reading it. No per-expert descriptors, no rows of
//     another expert read.
//   - weights (B) have one TMA descriptor over all experts, with the expert as the batch mode: no
//     per-expert tensor-map rewrites.
//   - out (D), pingpong: each consumer stages its tile in shared memory, 64 columns at a time, then
//     writes whole 16-byte vectors, coalesced along rows, clipped to the expert's rows and to N
//     (store_tile). The other consumer's mainloop runs meanwhile.
//   - out (D), cooperative: both consumers finish a tile together, so a synchronous epilogue would
//     idle the tensor cores (5-16% of the kernel's time, benchmarks/NOTES.md). Each consumer writes
//     64-column slices into shared memory and a TMA store, issued by one thread, copies them out
//     asynchronously while the consumer goes on to its next tile (store_tile_tma). The store goes
//     through a ragged view of out, like x's: it stops at the expert's last row.
// The mainloop (TMA loads into a multistage smem pipeline, WGMMA) is CUTLASS's sm90 warp-
// specialized collective, composed here with our own kernel, scheduler and epilogue.
//
// Warp group 0 produces (one warp issues the TMA loads); warp groups 1 and 2 consume:
//   - pingpong: they take alternate tiles; an order barrier lets only one of them issue WGMMAs at a
//     time, so one tile's epilogue overlaps the other's mainloop;
//   - cooperative: both work on every tile, each on half of its rows.
#pragma once

#include <algorithm>
#include <array>
#include <mutex>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "check.h"
#include "sm90/sm90_common.cuh"
#include "kernel_families.h"
#include "launch.h"
#include "moe_tile_scheduler.hpp"

namespace cutlass_moe::sm90 {

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
struct MoeGemmKernel {
  using Config = ConfigTraits<kConfig>;
  // Clusters along M only: the CTAs of a cluster take row tiles of one expert and one weight tile,
  // which TMA multicasts to all of them (each CTA issues its share of the copy).
  static_assert(cute::size<1>(typename Config::ClusterShape{}) == 1, "MoE clusters run along M only");
  static constexpr int kClusterM = cute::size<0>(typename Config::ClusterShape{});
  static constexpr bool kPingpong = Config::kPingpong;

  using Element            = typename ElementOf<kDType>::type;
  using ElementAccumulator = float;
  using LayoutA            = cutlass::layout::RowMajor;                          // x: T x K
  using LayoutB            = typename LayoutBOf<kLayout>::type;                  // weights[e]: K x N, expert = batch
  using TileShape          = typename Config::TileShape;
  using ClusterShape       = typename Config::ClusterShape;
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;  // 16 bytes, for TMA
  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileN = cute::size<1>(TileShape{});
  static constexpr int kTileK = cute::size<2>(TileShape{});

  static constexpr int kConsumers       = 2;                                     // math warp groups
  static constexpr int kThreads         = (1 + kConsumers) * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kProducerRegs    = 40;                                    // setmaxnreg budgets, as
  static constexpr int kConsumerRegs    = 232;                                   // CUTLASS's pingpong kernel

  using MathOrderBarrier = cutlass::OrderedSequenceBarrier<1, kConsumers>;       // one WGMMA issuer at a time

  // Pingpong epilogue staging per consumer: its kEpiRows x kEpiN part of the tile, rows padded by 16
  // bytes so that both the fragment writes (8 rows x 4 adjacent words per warp) and the 16-byte row
  // reads are free of bank conflicts. A 64-column slice keeps it small (2 x 9 KB): 5 stages at 64x256x64.
  static constexpr int kEpiRows = kPingpong ? kTileM : kTileM / kConsumers;
  static constexpr int kEpiN = 64;
  static constexpr int kEpiPitch = kEpiN + 8;
  static_assert(kTileN % kEpiN == 0);
  using EpilogueTile = cute::array_aligned<Element, kEpiRows * kEpiPitch, 128>;
  struct StagingStorage {
    EpilogueTile tile[kConsumers];
  };

  // Cooperative TMA-store epilogue: per consumer, kStoreBuffers slices of kEpiRows x kStoreCols in
  // the 128-byte swizzle TMA reads (the fragment writes, 8 rows x 16 bytes per warp, land in 8
  // different bank groups), so one slice is written while the previous one is being stored.
  // 2 x 2 x 8 KB: 4 stages at 128x256x64.
  static constexpr bool kTmaStore = !kPingpong;
  static constexpr int kStoreCols = 128 / static_cast<int>(sizeof(Element));  // one 128-byte swizzle row
  static constexpr int kStoreBuffers = 2;
  static_assert(kTileN % kStoreCols == 0);
  using SmemLayoutD = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::Shape<cute::Int<kEpiRows>, cute::Int<kStoreCols>>{}));
  using StoreBuffer = cute::array_aligned<Element, kEpiRows * kStoreCols, 1024>;
  struct StoreStorage {
    StoreBuffer buffer[kConsumers][kStoreBuffers];
  };
  // out as the ragged view (kEpiRows, N, T + 1) of run(); one box is one slice of one consumer.
  using TmaStoreD = decltype(cute::make_tma_copy(
      cute::SM90_TMA_STORE{},
      cute::make_tensor(cute::make_gmem_ptr<Element>(nullptr),
                        cute::make_layout(cute::make_shape(0, 0, 0), cute::make_stride(int64_t(0), cute::_1{}, int64_t(0)))),
      SmemLayoutD{}));

  using EpilogueStorage = std::conditional_t<kTmaStore, StoreStorage, StagingStorage>;
  static constexpr int kEpilogueSmemBytes = static_cast<int>(sizeof(EpilogueStorage));

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, LayoutA, kAlignment,
      Element, LayoutB, kAlignment,
      ElementAccumulator,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          kEpilogueSmemBytes + static_cast<int>(sizeof(typename MathOrderBarrier::SharedStorage))>,
      typename Config::MoeMainloopSchedule
    >::CollectiveOp;

  using TiledMma      = typename Mainloop::TiledMma;
  using Pipeline      = typename Mainloop::MainloopPipeline;
  using PipelineState = typename Mainloop::PipelineState;
  using Scheduler     = MoeTileScheduler<kTileM, kClusterM>;

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    EpilogueStorage epilogue;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
    alignas(16) typename MathOrderBarrier::SharedStorage math_order;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));

  struct Params {
    typename Mainloop::Params mainloop;  // the two TMA descriptors and transaction sizes
    typename Scheduler::Params scheduler;
    TmaStoreD tma_store_d;  // cooperative configs only
    Element* out;
    int64_t ldout;
    int num_tokens;
    int n;
    int k;
    int num_experts;
  };
};

// Pingpong configs: stores a consumer's accumulators for `tile` (the whole tile), clipped to the
// expert's rows and to N, one kEpiN-column slice at a time: the slice's fragments go to the
// consumer's staging buffer in shared memory (the GMMA accumulator layout gives each thread pairs
// of adjacent columns, one 32-bit store each), then the consumer's threads write 16-byte vectors
// along rows. group_thread is the thread's index in the consumer (and in its one-warp-group tiled
// MMA), `barrier_id` the consumer's named barrier.
template <class K, class Accumulators>
CUTLASS_DEVICE void store_tile(typename K::Params const& params, MoeTile const& tile, Accumulators const& accum,
                               typename K::Element* staging, int group_thread, int barrier_id) {
  static_assert(K::kPingpong, "cooperative configs store through store_tile_tma");
  using namespace cute;
  using Element = typename K::Element;
  constexpr int kThreads = cutlass::NumThreadsPerWarpGroup;
  constexpr int kVector = 16 / sizeof(Element);  // elements per 16-byte store
  constexpr int kVectorsPerRow = K::kEpiN / kVector;
  typename K::TiledMma tiled_mma;
  auto thread_mma = tiled_mma.get_thread_slice(group_thread);
  Tensor coords = thread_mma.partition_C(make_identity_tensor(make_shape(Int<K::kTileM>{}, Int<K::kTileN>{})));
  static_assert(decltype(size(coords))::value == decltype(size(accum))::value);
  cutlass::NumericArrayConverter<Element, float, 2> convert;

  const int rows_left = tile.rows - tile.m_tile * K::kTileM;
  const int cols_left = params.n - tile.n_tile * K::kTileN;  // a multiple of 8: vectors are all in or all out
  Element* out = params.out + int64_t(tile.row_start + tile.m_tile * K::kTileM) * params.ldout +
                 tile.n_tile * K::kTileN;

  CUTLASS_PRAGMA_UNROLL
  for (int slice = 0; slice < K::kTileN / K::kEpiN; ++slice) {
    const int first_col = slice * K::kEpiN;
    cutlass::arch::NamedBarrier::sync(kThreads, barrier_id);  // the previous slice has been read out
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); i += 2) {
      const int row = get<0>(coords(i));
      const int col = get<1>(coords(i)) - first_col;  // coords(i + 1) is (row, col + 1)
      if (col >= 0 && col < K::kEpiN) {
        cutlass::Array<float, 2> pair{accum(i), accum(i + 1)};
        *reinterpret_cast<cutlass::Array<Element, 2>*>(staging + row * K::kEpiPitch + col) = convert(pair);
      }
    }
    cutlass::arch::NamedBarrier::sync(kThreads, barrier_id);
    CUTLASS_PRAGMA_UNROLL
    for (int v = group_thread; v < K::kEpiRows * kVectorsPerRow; v += kThreads) {
      const int row = v / kVectorsPerRow;
      const int col = v % kVectorsPerRow * kVector;
      if (row < rows_left && first_col + col < cols_left) {
        *reinterpret_cast<uint4*>(out + int64_t(row) * params.ldout + first_col + col) =
            *reinterpret_cast<uint4 const*>(staging + row * K::kEpiPitch + col);
      }
    }
  }
}

// Cooperative configs: stores a consumer's accumulators for `tile` by TMA, clipped to the expert's
// rows and to N by the ragged view of out. The consumer owns tile rows [first_row, first_row +
// kEpiRows). Per kStoreCols-column slice: its fragments go to one of the consumer's swizzled
// buffers, and thread 0 of the consumer stores it with one TMA copy. The copy is asynchronous: a
// buffer is only waited for when it comes round again (two slices later, possibly in the next
// tile), and the consumer goes on to its next mainloop right after issuing the last slice.
// Before the kernel ends, thread 0 waits for its stores to have read shared memory (end of the
// cooperative consumer loop).
template <class K, class Accumulators>
CUTLASS_DEVICE void store_tile_tma(typename K::Params const& params, MoeTile const& tile, Accumulators const& accum,
                                   typename K::StoreBuffer* buffers, int mma_thread_idx, int group_thread,
                                   int first_row, int barrier_id) {
  using namespace cute;
  using Element = typename K::Element;
  constexpr int kThreads = cutlass::NumThreadsPerWarpGroup;
  const int rows = min(int{K::kEpiRows}, tile.rows - tile.m_tile * K::kTileM - first_row);
  if (rows <= 0) return;  // no rows of the expert in this consumer's part (and no box wholly outside the view)
  const int row_start = tile.row_start + tile.m_tile * K::kTileM + first_row;
  const int cols_left = params.n - tile.n_tile * K::kTileN;

  // Fragment coordinates: the thread's offset plus the value's offset (cute layouts are linear in
  // thread and value); the value offsets are thread 0's coordinates, compile-time constants once the
  // loops unroll. In the GMMA accumulator layout a thread's offset is < 8 in columns (2 x (thread %
  // 4)), thread 0's values sit in rows 0 and 8 and in columns 8j, 8j + 1, so a value's row mod 8 is
  // the thread's, and its 16-byte chunk of a 128-byte row is the value's. The swizzled element
  // offset, row * 64 + ((chunk ^ row % 8) * 8) + column % 8 (SmemLayoutD), then costs one XOR per
  // store, with no per-value index math the compiler would keep in registers (cute's generic
  // swizzled indexing here spilled 2.7 KB per thread and made the kernel 3x slower).
  typename K::TiledMma tiled_mma;
  auto identity = make_identity_tensor(make_shape(Int<K::kTileM>{}, Int<K::kTileN>{}));
  Tensor offsets = tiled_mma.get_thread_slice(0).partition_C(identity);
  static_assert(decltype(size(offsets))::value == decltype(size(accum))::value);
  const auto thread_coord = tiled_mma.get_thread_slice(mma_thread_idx).partition_C(identity)(0);
  const int thread_row = get<0>(thread_coord) - get<0>(offsets(0)) - first_row;
  const int thread_col = get<1>(thread_coord) - get<1>(offsets(0));
  const int swizzle = thread_row % 8;
  static_assert(K::kStoreCols == 64, "the swizzle arithmetic below is for 64-element (128-byte) rows");
  // The box at (kEpiRows - rows, col, row_start + rows) of the ragged view holds out[row_start, +rows)
  // in its first rows; its other rows are past the view's first mode, and TMA does not write them.
  Tensor mD = params.tma_store_d.get_tma_tensor(make_shape(int{K::kEpiRows}, params.n, params.num_tokens + 1));
  Tensor gD = domain_offset(make_coord(K::kEpiRows - rows, tile.n_tile * K::kTileN, row_start + rows), mD)(_, _, 0);
  auto tma_store = params.tma_store_d.get_slice(Int<0>{});
  cutlass::NumericArrayConverter<Element, float, 2> convert;

  CUTLASS_PRAGMA_UNROLL
  for (int slice = 0; slice < K::kTileN / K::kStoreCols; ++slice) {
    const int first_col = slice * K::kStoreCols;
    if (first_col >= cols_left) break;  // the same for the whole consumer
    Element* buffer = buffers[slice % K::kStoreBuffers].data();
    Tensor sD = make_tensor(make_smem_ptr(buffer), typename K::SmemLayoutD{});
    if (group_thread == 0) tma_store_wait<K::kStoreBuffers - 1>();  // this buffer's last store has read it
    cutlass::arch::NamedBarrier::sync(kThreads, barrier_id);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); i += 2) {
      const int row = get<0>(offsets(i));
      const int col = get<1>(offsets(i)) - first_col;  // offsets(i + 1) is (row, col + 1)
      if (col >= 0 && col < K::kStoreCols) {
        cutlass::Array<float, 2> pair{accum(i), accum(i + 1)};
        const int offset = (thread_row + row) * K::kStoreCols + (((col / 8) ^ swizzle) * 8) + thread_col;
        *reinterpret_cast<cutlass::Array<Element, 2>*>(buffer + offset) = convert(pair);
      }
    }
    tma_store_fence();  // these shared memory writes are visible to the TMA (async proxy)
    cutlass::arch::NamedBarrier::sync(kThreads, barrier_id);
    if (group_thread == 0) {
      Tensor gD_slice = local_tile(gD, Shape<Int<K::kEpiRows>, Int<K::kStoreCols>>{}, make_coord(0, slice));
      copy(params.tma_store_d, tma_store.partition_S(sD), tma_store.partition_D(gD_slice));
      tma_store_arrive();
    }
  }
}

template <class K>
__global__ void __launch_bounds__(K::kThreads, 1)
moe_gemm_kernel(CUTLASS_GRID_CONSTANT typename K::Params const params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Mainloop = typename K::Mainloop;
  using Pipeline = typename K::Pipeline;

  extern __shared__ char smem[];
  auto& storage = *reinterpret_cast<typename K::SharedStorage*>(smem);

  const int warp_group = cutlass::canonical_warp_group_idx();
  const int warp_in_group = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
  const int group_thread = threadIdx.x % cutlass::NumThreadsPerWarpGroup;
  const bool is_producer = warp_group == 0 && warp_in_group == 0;

  if (is_producer && cute::elect_one_sync()) {
    Mainloop::prefetch_tma_descriptors(params.mainloop);
    if constexpr (K::kTmaStore) cute::prefetch_tma_descriptor(params.tma_store_d.get_tma_descriptor());
  }

  typename Pipeline::Params pipeline_params;
  pipeline_params.role = is_producer      ? Pipeline::ThreadCategory::Producer
                         : warp_group > 0 ? Pipeline::ThreadCategory::Consumer
                                          : Pipeline::ThreadCategory::NonParticipant;
  pipeline_params.is_leader = group_thread == 0;
  // Pingpong: one warp group consumes each stage; cooperative: both do.
  pipeline_params.num_consumers = K::kPingpong ? cutlass::NumThreadsPerWarpGroup
                                               : K::kConsumers * cutlass::NumThreadsPerWarpGroup;
  pipeline_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
  Pipeline pipeline(storage.pipeline, pipeline_params, typename K::ClusterShape{});

  typename K::MathOrderBarrier::Params order_params;
  order_params.group_id = warp_group > 0 ? warp_group - 1 : 0;
  order_params.group_size = cutlass::NumThreadsPerWarpGroup;
  typename K::MathOrderBarrier math_order(storage.math_order, order_params);

  // Barrier initialization is visible to every warp (of every CTA of the cluster).
  if constexpr (K::kClusterM > 1) {
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  } else {
    __syncthreads();
  }

  typename K::Scheduler scheduler(params.scheduler);
  Mainloop mainloop;
  const int k_tiles = (params.k + K::kTileK - 1) / K::kTileK;
  // Work is handed out per cluster: cluster c takes groups c, c + clusters, ...
  const int rank = K::kClusterM > 1 ? static_cast<int>(cute::block_rank_in_cluster()) : 0;
  const int64_t first = blockIdx.x / K::kClusterM;
  const int64_t grid = gridDim.x / K::kClusterM;

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<K::kProducerRegs>();
    if (!is_producer) return;
    // TMA coordinate tensors: x as the ragged view (kTileM, K, T + 1) of run(), weights as (N, K, E).
    Tensor mA =
        params.mainloop.tma_load_a.get_tma_tensor(make_shape(Int<K::kTileM>{}, params.k, params.num_tokens + 1));
    Tensor mB = params.mainloop.tma_load_b.get_tma_tensor(make_shape(params.n, params.k, params.num_experts));
    auto write_state = cutlass::make_producer_start_state<Pipeline>();
    for (int64_t index = first;; index += grid) {
      MoeTile tile = scheduler.tile(index, rank);
      if (!tile.valid) break;
      // x: the tile's rows of the expert are [first, first + rows). In the ragged view, the box at
      // (kTileM - rows, k, first + rows) holds exactly them, then kTileM - rows rows past the view's
      // first mode, which TMA zero-fills without reading them. A cluster's spare CTA (rows = 0)
      // loads the expert's first row instead, so that no box lies wholly outside the view: the 2x1
      // config, whose spare CTAs did that, hit illegal addresses on the H200 (seed000-g8,
      // gptoss-120b-prefill). Weights: the batch mode is the expert.
      const int first_row = tile.row_start + tile.m_tile * K::kTileM;
      const int rows = max(0, min(int{K::kTileM}, tile.rows - tile.m_tile * K::kTileM));
      const int box_rows = max(rows, 1);
      const int box_end = rows > 0 ? first_row + rows : tile.row_start + 1;
      Tensor gA = local_tile(domain_offset(make_coord(K::kTileM - box_rows, 0, box_end), mA), typename K::TileShape{},
                             make_coord(_, _, _), Step<_1, X, _1>{});  // (BLK_M, BLK_K, 1, k, l)
      Tensor gB = local_tile(domain_offset(make_coord(0, 0, tile.expert), mB), typename K::TileShape{},
                             make_coord(_, _, _), Step<X, _1, _1>{});  // (BLK_N, BLK_K, n, k, l)
      mainloop.load(params.mainloop, pipeline, write_state, cute::make_tuple(gA, gB),
                    make_coord(0, tile.n_tile, _, 0), cute::make_coord_iterator(k_tiles), k_tiles,
                    threadIdx.x % 32, rank, storage.tensors);
      write_state.advance(k_tiles);
    }
    mainloop.load_tail(pipeline, write_state);
  } else {
    cutlass::arch::warpgroup_reg_alloc<K::kConsumerRegs>();
    const int consumer = warp_group - 1;
    typename K::TiledMma tiled_mma;
    typename K::PipelineState read_state;
    if constexpr (K::kPingpong) {
      if (consumer == 1) read_state.advance(k_tiles);  // consumer 0 takes the first tile's stages
      for (int64_t index = first + consumer * grid;; index += K::kConsumers * grid) {
        MoeTile tile = scheduler.tile(index, rank);
        if (!tile.valid) break;
        Tensor accum = partition_fragment_C(tiled_mma, take<0, 2>(typename K::TileShape{}));
        math_order.wait();
        mainloop.mma(pipeline, read_state, accum, k_tiles, group_thread, storage.tensors, params.mainloop);
        math_order.arrive();
        mainloop.mma_tail(pipeline, read_state, k_tiles);
        read_state.advance(k_tiles * K::kConsumers);
        store_tile<K>(params, tile, accum, storage.epilogue.tile[consumer].data(), group_thread, consumer);
      }
    } else {
      const int mma_thread = threadIdx.x - cutlass::NumThreadsPerWarpGroup;  // both consumers: 0..255
      for (int64_t index = first;; index += grid) {
        MoeTile tile = scheduler.tile(index, rank);
        if (!tile.valid) break;
        Tensor accum = partition_fragment_C(tiled_mma, take<0, 2>(typename K::TileShape{}));
        mainloop.mma(pipeline, read_state, accum, k_tiles, mma_thread, storage.tensors, params.mainloop);
        mainloop.mma_tail(pipeline, read_state, k_tiles);
        read_state.advance(k_tiles);
        store_tile_tma<K>(params, tile, accum, storage.epilogue.buffer[consumer], mma_thread, group_thread,
                          /*first_row=*/consumer * K::kEpiRows, consumer);
      }
      if (group_thread == 0) tma_store_wait<0>();  // shared memory stays until the stores have read it
    }
  }
#endif
}

// Recently built TMA descriptors, keyed by everything a descriptor depends on (pointer, sizes,
// strides). Weights rarely change between calls, and x often lives in a fixed buffer (CUDA graphs,
// serving), so most calls encode no tensor map at all.
template <class Value, int kEntries = 8>
class DescriptorCache {
 public:
  using Key = std::array<int64_t, 6>;

  template <class Make>
  Value get(Key const& key, Make&& make) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int i = 0; i < used_; ++i) {
      if (keys_[i] == key) return values_[i];
    }
    const int slot = next_;
    next_ = (next_ + 1) % kEntries;
    used_ = used_ < kEntries ? used_ + 1 : kEntries;
    keys_[slot] = key;
    values_[slot] = make();
    return values_[slot];
  }

 private:
  std::mutex mutex_;
  std::array<Key, kEntries> keys_{};
  std::array<Value, kEntries> values_{};
  int used_ = 0;
  int next_ = 0;
};

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
size_t MoeGemmInstance<kDType, kLayout, kConfig>::workspace_size(int64_t, int) {
  return 0;
}

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
void MoeGemmInstance<kDType, kLayout, kConfig>::run(const MoeGemmProblem& p, void*, size_t, int sm_count,
                                                    cudaStream_t stream) {
  using namespace cute;
  using K = MoeGemmKernel<kDType, kLayout, kConfig>;
  using Mainloop = typename K::Mainloop;
  using TmaA = decltype(Mainloop::Params::tma_load_a);
  using TmaB = decltype(Mainloop::Params::tma_load_b);
  using InternalA = typename Mainloop::InternalElementA;
  using InternalB = typename Mainloop::InternalElementB;
  static DescriptorCache<TmaA> a_cache;
  static DescriptorCache<TmaB> b_cache;

  const int t = static_cast<int>(p.num_tokens), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
  const int e = static_cast<int>(p.num_experts);
  // Batch strides of 0 are not valid in a tensor map; any 16-byte multiple works for a batch of 1.
  const int64_t expert_stride = e > 1 ? p.expert_stride : p.ldw * (kLayout == WeightLayout::kKN ? k : n);

  typename K::Params params;
  int device = 0;
  CUTLASS_MOE_CHECK_CUDA(cudaGetDevice(&device));
  // x as a ragged view: element (i, k, j) is x[j + i - kTileM, k], i < kTileM, j <= T (rows
  // stride both i and j). A tile with r rows of its expert starting at row s loads the box at
  // (kTileM - r, k, s + r): x[s, s + r) lands in the box's first r rows, and the rest of the box has
  // i >= kTileM, out of the view, so TMA zero-fills it without a read. No row of another expert is
  // read, and the rows not loaded are zeros, as in the grouped family (zeros measured faster than
  // other data there, benchmarks/NOTES.md). Every element the kernel touches has j + i - kTileM in
  // [s, s + r), inside x; the base address itself, kTileM rows before x, is never dereferenced.
  params.mainloop.tma_load_a = a_cache.get(
      {reinterpret_cast<int64_t>(p.x), t, k, p.ldx, device, 0}, [&] {
        const auto base = reinterpret_cast<uintptr_t>(p.x) - uintptr_t(K::kTileM) * p.ldx * sizeof(InternalA);
        auto tensor = make_tensor(reinterpret_cast<InternalA const*>(base),
                                  make_layout(make_shape(K::kTileM, k, t + 1),
                                              leading_stride<typename Mainloop::StrideA>(p.ldx, p.ldx)));
        return make_tma_copy_A_sm90(typename Mainloop::GmemTiledCopyA{}, tensor,
                                    typename Mainloop::SmemLayoutA{}(_, _, Int<0>{}), typename K::TileShape{},
                                    typename K::ClusterShape{});
      });
  params.mainloop.tma_load_b = b_cache.get(
      {reinterpret_cast<int64_t>(p.weights), e, int64_t(n) << 32 | k, p.ldw, expert_stride, device}, [&] {
        auto tensor = make_tensor(static_cast<InternalB const*>(p.weights),
                                  make_layout(make_shape(n, k, e),
                                              leading_stride<typename Mainloop::StrideB>(p.ldw, expert_stride)));
        return make_tma_copy_B_sm90(typename Mainloop::GmemTiledCopyB{}, tensor,
                                    typename Mainloop::SmemLayoutB{}(_, _, Int<0>{}), typename K::TileShape{},
                                    typename K::ClusterShape{});
      });
  if constexpr (K::kTmaStore) {
    static DescriptorCache<typename K::TmaStoreD> d_cache;
    // out as a ragged view, like x: element (i, n, j) is out[j + i - kEpiRows, n], i < kEpiRows,
    // j <= T. The base itself, kEpiRows rows before out, is never written: store_tile_tma's boxes
    // write only their rows with i < kEpiRows, which are rows of out.
    params.tma_store_d = d_cache.get({reinterpret_cast<int64_t>(p.out), t, n, p.ldout, device, 1}, [&] {
      const auto base = reinterpret_cast<uintptr_t>(p.out) -
                        uintptr_t(K::kEpiRows) * p.ldout * sizeof(typename K::Element);
      auto tensor = make_tensor(make_gmem_ptr(reinterpret_cast<typename K::Element*>(base)),
                                make_layout(make_shape(int{K::kEpiRows}, n, t + 1), make_stride(p.ldout, _1{}, p.ldout)));
      return make_tma_copy(SM90_TMA_STORE{}, tensor, typename K::SmemLayoutD{});
    });
  }
  params.mainloop.tma_transaction_bytes = Mainloop::TmaTransactionBytes;
  params.mainloop.tma_transaction_bytes_mk = Mainloop::TmaTransactionBytesMK;
  params.mainloop.tma_transaction_bytes_nk = Mainloop::TmaTransactionBytesNK;

  const int tiles_n = (n + K::kTileN - 1) / K::kTileN;
  params.scheduler = {p.tokens_per_expert, p.count_type == IndexType::kInt64, e, t, tiles_n};
  params.out = static_cast<typename K::Element*>(p.out);
  params.ldout = p.ldout;
  params.num_tokens = t;
  params.n = n;
  params.k = k;
  params.num_experts = e;

  persistent_blocks_per_sm(moe_gemm_kernel<K>, K::kThreads, K::kSmemBytes, device);  // 1: all of shared memory
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = K::kClusterM;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.blockDim = dim3(K::kThreads);
  config.dynamicSmemBytes = K::kSmemBytes;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = K::kClusterM > 1 ? 1 : 0;  // no cluster launch without a cluster
  // Persistent grid: one CTA per SM (all of shared memory); with clusters, as many whole clusters
  // as can be resident at once.
  static int max_ctas[64];
  static std::once_flag max_ctas_flags[64];
  cudaError_t occupancy_status = cudaSuccess;
  std::call_once(max_ctas_flags[device % 64], [&] {
    max_ctas[device % 64] = sm_count;
    if constexpr (K::kClusterM > 1) {
      config.gridDim = dim3(sm_count / K::kClusterM * K::kClusterM);
      int clusters = 0;
      occupancy_status = cudaOccupancyMaxActiveClusters(&clusters, moe_gemm_kernel<K>, &config);
      max_ctas[device % 64] = std::min(clusters * K::kClusterM, sm_count / K::kClusterM * K::kClusterM);
    }
  });
  config.gridDim = dim3(persistent_grid(max_ctas[device % 64], t, e, tiles_n, K::kTileM, K::kClusterM));
  CUTLASS_MOE_CHECK_CUDA(cudaLaunchKernelEx(&config, moe_gemm_kernel<K>, params));
  CUTLASS_MOE_CHECK_CUDA(cudaGetLastError());
}

}  // namespace cutlass_moe::sm90
