// The sm90 (Hopper) MoE weight-gradient kernel: dW[e] = A_e . B_e, reduced over expert e's rows, in
// one launch with no per-expert arrays (the forward's idea, sm90_moe_kernel.hpp, turned on its
// side: the counts set each tile's reduction length instead of its rows).
//
// What the wgrad families share (wgrad_common.cuh): A is x^T or grad_out^T, B is grad_out or x, so
// both operands run along T in memory (MN-major), and D = dW[e] is row-major M x N, (E, M, N).
// The kernel's parts:
//   - tiles: E x ceil(M / kTileM) x ceil(N / kTileN), a static set; ExpertTileScheduler with
//     FixedRowTiles numbers them expert-major and finds each tile's expert rows on the device, so
//     the CTAs reading one expert's rows of x and grad_out run together (L2 reuse). Inside an
//     expert the host picks the order (Arguments::n_fastest, sm90_wgrad_moe.cuh). The producer
//     warp walks the scheduler and hands each tile to the consumers (TileRecords);
//   - mainloop: CUTLASS's sm90 warp-specialized collective (its pipeline, shared memory and mma()).
//     Each operand is read through one ragged TMA view along T (below), so a K block loads exactly
//     its expert's rows and zero-fills the rest without reading it; the producer issues the boxes
//     itself (load_boxes);
//   - epilogue: WgradTmaStoreEpilogue stages the whole tile in shared memory (4 slices per
//     consumer) and stores it with asynchronous TMA copies while the next tile's mainloop runs:
//     dW is most of the bytes when experts have few rows (95% on DeepSeek-V3's shapes), so the
//     stores must stream. A 16-bit dW also defers the staging: each tile's outputs wait in
//     registers and are staged during the next tile's K blocks, one slice per block and the rest
//     with its last block, so the tensor cores do not wait for them (4-6% on the public shapes,
//     benchmarks/NOTES.md). The consumers only write the staging buffers: two otherwise idle warps
//     of the producer's warp group, one per consumer, issue the TMA stores and wait for them
//     (WgradTmaStoreEpilogue::store_warp; 1-5% on the prefill shapes), with an L2 EVICT_FIRST
//     policy where experts have under one K block of rows (dW is then all of the traffic).
//     Accumulating (fp32 only) uses TMA reduce-add: one add per element, in a fixed order, no
//     atomics, bitwise reproducible.
// An expert with no rows has no mainloop: its tiles store zeros, or nothing when accumulating.
//
// Ragged view along T: element (m, i, j) of an operand's view is A[m, j + i - kTileK] (the row
// j + i - kTileK of x or grad_out), with i < kTileK and j <= T. The K block of rows [end - r, end)
// (r <= kTileK) is the box at (m0, kTileK - r, end): those rows are the box's first r, the rest of
// the box has i >= kTileK, outside the view. Both operands zero-fill the same positions, so the
// padding adds exact zeros (never 0 x NaN from another expert's rows). The MMA steps (16 rows each
// in 16 bits) of the last block that hold only padding are not issued (mma_pipelined's kTrimLast:
// that block's MMAs are issued apart from the loop's, whose MMAs stay unguarded), bitwise the same
// (benchmarks/NOTES.md).
#pragma once

#include "sm90/sm90_tma_encode.hpp"  // first: routes every TMA encode through a checked call

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/kernel_hardware_info.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "moe_tile_scheduler.hpp"
#include "sm90/sm90_common.cuh"
#include "sm90/sm90_mma_loop.hpp"
#include "sm90/sm90_moe_epilogue.hpp"
#include "sm90/sm90_tile_records.hpp"

namespace cutlass_moe::sm90 {

// Sizes of one weight gradient as the kernel sees them: dW[e] is m x n, reduced over the expert's
// rows of T.
struct WgradProblemShape {
  int num_tokens;  // T
  int m;
  int n;
  int num_experts;  // E
};

// Stores (or, accumulating, adds) each consumer's rows of a tile of dW[e] with TMA. The consumers
// only stage: each consumer hands every staged slice to a store warp of its own (store_warp(), run by
// warps of the producer's warp group that have nothing else to do), which issues the TMA store and
// waits for it. So a consumer's per-slice work while its next K block's MMAs run is the buffer
// handshake and the shared memory writes; the store's issue and its wait no longer hold back the
// next block's MMAs (a slice took 450-850 cycles of a K block's 1,024 before, benchmarks/NOTES.md).
//
// The handshake, per consumer, on two named barriers of kHandoffThreads (the consumer's 128 threads
// and its store warp's 32): the consumer arrives on `staged` once a slice's buffer and its box are
// written; the store warp syncs on it, reads the box, waits until the store of the slice kBuffers - 1
// before it has read its buffer (the one the consumer writes next), arrives on `taken`, and then
// issues the store; the consumer syncs on `taken` before staging its next slice. The two sides
// alternate, so neither barrier ever holds arrivals of two generations.
template <class ElementOut, class TiledMma, int kTileM, int kTileN>
class WgradTmaStoreEpilogue {
 public:
  // The whole tile stays in flight (4 slices of 64 columns in 16 bits, half of it in fp32).
  static constexpr int kBuffers = 4;
  using Staging = CooperativeSliceStaging<ElementOut, TiledMma, kTileM, kTileN, kBuffers>;
  static constexpr int kRows = Staging::kRows;
  static constexpr int kStoreCols = Staging::kStoreCols;
  using SmemLayout = typename Staging::SmemLayout;
  static constexpr int kConsumers = Staging::kConsumers;

  // Where a staged slice goes: dW[expert](row.., col..). expert < 0: no slice, the consumer is done.
  struct Box {
    int row;
    int col;
    int expert;
  };
  struct SharedStorage {
    typename Staging::SharedStorage staging;
    Box boxes[kConsumers][kBuffers];
  };

  // dW as (M, N, E): row stride ldd, unit column stride, expert stride.
  template <class Op>
  using TmaOf = decltype(cute::make_tma_copy(
      Op{},
      cute::make_tensor(cute::make_gmem_ptr<ElementOut>(nullptr),
                        cute::make_layout(cute::make_shape(0, 0, 0), cute::make_stride(int64_t(0), cute::_1{}, int64_t(0)))),
      SmemLayout{}));
  using TmaStore = TmaOf<cute::SM90_TMA_STORE>;
  using TmaReduceAdd = TmaOf<cute::SM90_TMA_REDUCE_ADD>;

  struct Arguments {
    ElementOut* ptr_out;
    int64_t ldd;
    int64_t expert_stride;
    bool accumulate;
    bool evict_first = false;  // stores with an L2 EVICT_FIRST policy (store_evict_first); not reduce-adds
  };
  struct Params {
    TmaStore store;
    TmaReduceAdd reduce_add;
    int m;
    int n;
    int num_experts;
    bool accumulate;
    bool evict_first;
  };

  static Params to_underlying_arguments(WgradProblemShape const& p, Arguments const& args) {
    using namespace cute;
    // A batch stride of 0 is no valid tensor map stride; any 16-byte multiple serves a batch of 1.
    const int64_t batch_stride = p.num_experts > 1 ? args.expert_stride : args.ldd * p.m;
    auto dw = make_tensor(make_gmem_ptr(args.ptr_out), make_layout(make_shape(p.m, p.n, p.num_experts),
                                                                   make_stride(args.ldd, _1{}, batch_stride)));
    Params params{};
    if (args.accumulate) {
      params.reduce_add = make_tma_copy(SM90_TMA_REDUCE_ADD{}, dw, SmemLayout{});
    } else {
      params.store = make_tma_copy(SM90_TMA_STORE{}, dw, SmemLayout{});
    }
    params.m = p.m;
    params.n = p.n;
    params.num_experts = p.num_experts;
    params.accumulate = args.accumulate;
    params.evict_first = args.evict_first;
    return params;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.accumulate ? params.reduce_add.get_tma_descriptor()
                                                    : params.store.get_tma_descriptor());
  }

  CUTLASS_DEVICE WgradTmaStoreEpilogue(Params const& params, SharedStorage& storage, int consumer, int mma_thread,
                                       int thread)
      : params_(params),
        staging_(storage.staging, consumer, mma_thread, thread),
        boxes_(storage.boxes[consumer]),
        consumer_(consumer) {}

  // 16-bit dW (stored, never added) defers its stores: each tile's outputs wait in registers and
  // are stored while the next tile's K blocks run (the kernel's deferred loop). fp32 dW, half of it
  // staged per slice and possibly accumulated, is stored after each tile's mainloop.
  static constexpr bool kDefers = sizeof(ElementOut) == 2;

  // After a tile's mainloop: the consumer's rows of the tile, slice after slice.
  template <class Accumulators>
  CUTLASS_DEVICE void store(MoeTile const& tile, Accumulators const& accum) {
    CUTLASS_PRAGMA_UNROLL
    for (int slice = 0; slice < Staging::kSlices; ++slice) {
      store_slice(tile, slice, [&](int i, int, int) {
        return cutlass::NumericArrayConverter<ElementOut, float, 2>{}({accum(i), accum(i + 1)});
      });
    }
  }

  // Deferred stores (kDefers): the registers hold() fills (Held::make_registers), one 32-bit word
  // per accumulator pair, the pair's two outputs.
  using Held = HeldTile<ElementOut, Staging::kSlices>;

  // Takes `tile`'s outputs out of its accumulators. The previous held tile must have been stored.
  template <class Accumulators, class Registers>
  CUTLASS_DEVICE void hold(MoeTile const& tile, Accumulators const& accum, Registers& held) {
    using namespace cute;
    static_assert(2 * decltype(size(held))::value == decltype(size(accum))::value);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); i += 2) {
      held(i / 2) = Held::pack(cutlass::NumericArrayConverter<ElementOut, float, 2>{}({accum(i), accum(i + 1)}));
    }
    held_.hold(tile);
  }

  // Holds an expert with no rows: its tile of dW is zeros.
  template <class Registers>
  CUTLASS_DEVICE void hold_zeros(MoeTile const& tile, Registers& held) {
    using namespace cute;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(held); ++i) held(i) = 0u;
    held_.hold(tile);
  }

  // Stores slice k of the held tile, and with `rest` every slice after it as well; once its last
  // slice is stored, no tile is held.
  template <class Registers>
  CUTLASS_DEVICE void store_held(int k, bool rest, Registers const& held) {
    held_.store(k, rest, [&](int slice) {
      store_slice(held_.tile(), slice, [&](int i, int, int) { return Held::unpack(held(i / 2)); });
    });
  }

  template <class Registers>
  CUTLASS_DEVICE void store_all(Registers const& held) { store_held(0, /*rest=*/true, held); }

  // After the consumer's last slice: tells its store warp that no slice is left.
  CUTLASS_DEVICE void store_tail() {
    hand_over(Box{0, 0, -1}, [](ElementOut*) {});
  }

  // The store warp of consumer `consumer` (a whole warp, outside the consumers): stores the slices
  // the consumer stages, in order, until it says it is done; then waits for the stores to have read
  // shared memory, which must stay until then.
  CUTLASS_DEVICE static void store_warp(Params const& params, SharedStorage& storage, int consumer) {
    using namespace cute;
    const bool leader = cute::elect_one_sync();
    auto shape = make_shape(params.m, params.n, params.num_experts);
    for (int buffer = 0;; buffer = buffer + 1 == kBuffers ? 0 : buffer + 1) {
      cutlass::arch::NamedBarrier::sync(kHandoffThreads, kStagedBarrier + consumer);
      const Box box = storage.boxes[consumer][buffer];
      if (box.expert < 0) break;
      // The consumer's next slice goes to the buffer of the slice kBuffers - 1 before this one: once
      // that slice's store has read it, the consumer may go on while this one is issued.
      if (leader) tma_store_wait<kBuffers - 2>();
      __syncwarp();
      cutlass::arch::NamedBarrier::arrive(kHandoffThreads, kTakenBarrier + consumer);
      if (leader) {
        Tensor sD = make_tensor(make_smem_ptr(storage.staging.buffer[consumer][buffer].data()), SmemLayout{});
        // The box in shared memory and its place in dW, partitioned for `tma`.
        auto partition = [&](auto const& tma) {
          Tensor gD = domain_offset(make_coord(box.row, box.col, box.expert), tma.get_tma_tensor(shape));
          Tensor dst = local_tile(gD(_, _, 0), Shape<Int<kRows>, Int<kStoreCols>>{}, make_coord(0, 0));
          auto tma_slice = tma.get_slice(Int<0>{});
          return make_tuple(tma_slice.partition_S(sD), tma_slice.partition_D(dst));
        };
        if (params.accumulate) {
          auto parts = partition(params.reduce_add);
          copy(params.reduce_add, get<0>(parts), get<1>(parts));
        } else {
          auto parts = partition(params.store);
          if (params.evict_first) {
            store_evict_first(params.store.get_tma_descriptor(), get<0>(parts), get<1>(parts));
          } else {
            copy(params.store, get<0>(parts), get<1>(parts));
          }
        }
        tma_store_arrive();
      }
    }
    if (leader) tma_store_wait<0>();
  }

 private:
  // A TMA store of one box (src: the box in shared memory, dst: its partitioned TMA coordinates) with
  // an L2 EVICT_FIRST policy, which CUTLASS's SM90_TMA_STORE does not take. dW is written once and
  // read by nothing in the kernel. The same bits as the plain store; the launch picks it where dW is
  // all of the traffic (sm90_wgrad_moe.cuh).
  template <class SrcTensor, class DstTensor>
  CUTLASS_DEVICE static void store_evict_first(void const* descriptor, SrcTensor const& src, DstTensor const& dst) {
    using namespace cute;
    auto coord = dst.data().coord_;  // as Copy_Traits<SM90_TMA_STORE>::copy_unpack reads it
    static_assert(decltype(rank(coord))::value == 3, "dW's tensor map has 3 dimensions");
    const uint32_t smem = cast_smem_ptr_to_uint(raw_pointer_cast(src.data()));
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%2, %3, %4}], [%1], %5;"
        :
        : "l"(reinterpret_cast<uint64_t>(descriptor)), "r"(smem), "r"(int32_t(get<0>(coord))),
          "r"(int32_t(get<1>(coord))), "r"(int32_t(get<2>(coord))),
          "l"(static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_FIRST))
        : "memory");
  }

  static constexpr int kHandoffThreads = cutlass::NumThreadsPerWarpGroup + cutlass::NumThreadsPerWarp;
  // Named barriers (user ids, after CUTLASS's reserved ones): the consumers' own staging syncs take
  // ids 0 and 1 (unused here), the handshakes the next four.
  static constexpr int kStagedBarrier = kConsumers;
  static constexpr int kTakenBarrier = 2 * kConsumers;

  // Stages slice `slice` of the consumer's rows [consumer * kRows, +kRows) of `tile`, value(i, row,
  // col) as in CooperativeSliceStaging::stage, and hands it to the store warp; TMA clips the box at
  // M and N.
  template <class Value>
  CUTLASS_DEVICE void store_slice(MoeTile const& tile, int slice, Value&& value) {
    const int first_row = tile.m_tile * kTileM + consumer_ * kRows;
    const int first_col = tile.n_tile * kTileN + slice * kStoreCols;
    // No box wholly outside dW; no columns left: the same for the whole consumer.
    if (first_row >= params_.m || first_col >= params_.n) return;
    hand_over(Box{first_row, first_col, tile.expert}, [&](ElementOut* buffer) {
      staging_.template write</*kPack=*/1, /*kMatrices=*/sizeof(ElementOut) == 2, /*kParts=*/1>(buffer, slice, 0,
                                                                                                   value);
    });
  }

  // Once the store warp has taken the previous slice (and so the store that last read this buffer
  // is done), writes the next buffer and its box, and hands them over.
  template <class Write>
  CUTLASS_DEVICE void hand_over(Box const& box, Write&& write) {
    if (handed_any_) cutlass::arch::NamedBarrier::sync(kHandoffThreads, kTakenBarrier + consumer_);
    write(staging_.buffer(buffer_));
    if (staging_.thread() == 0) boxes_[buffer_] = box;
    cute::tma_store_fence();  // the buffer's writes are visible to the TMA (async proxy)
    cutlass::arch::NamedBarrier::arrive(kHandoffThreads, kStagedBarrier + consumer_);
    buffer_ = buffer_ + 1 == kBuffers ? 0 : buffer_ + 1;
    handed_any_ = true;
  }

  Params const& params_;
  Staging staging_;
  Box* boxes_;
  int consumer_;
  int buffer_ = 0;  // the buffer of the consumer's next slice
  bool handed_any_ = false;
  Held held_;  // deferred stores: the held tile
};

// Element: x and grad_out. ElementOut: dW (Element or float). Config: tile shape (cooperative
// schedules only: the epilogue splits each tile between the two consumers).
template <class Element_, class ElementOut_, class Config>
class MoeWgradKernel {
 public:
  using Element            = Element_;
  using ElementOut         = ElementOut_;
  using ElementAccumulator = float;
  using LayoutA            = cutlass::layout::ColumnMajor;  // M contiguous: A(m, t) at a[t * lda + m]
  using LayoutB            = cutlass::layout::RowMajor;     // N contiguous: B(t, n) at b[t * ldb + n]
  using TileShape          = typename Config::TileShape;
  static_assert(!Config::kWide, "the wide tile is the MoE forward's only");
  using ClusterShape       = cute::Shape<cute::_1, cute::_1, cute::_1>;
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;  // 16 bytes, for TMA
  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileN = cute::size<1>(TileShape{});
  static constexpr int kTileK = cute::size<2>(TileShape{});
  static_assert(!Config::kPingpong, "the wgrad kernel's epilogue is the cooperative one");
  static_assert(cute::size(typename Config::ClusterShape{}) == 1, "the MoE kernels run without clusters");

  static constexpr int kConsumers = 2;
  static constexpr int kProducerRegs = 40;  // setmaxnreg budgets, as CUTLASS's cooperative kernel
  static constexpr int kConsumerRegs = 232;
  static constexpr uint32_t MaxThreadsPerBlock = (1 + kConsumers) * cutlass::NumThreadsPerWarpGroup;
  static constexpr uint32_t MinBlocksPerMultiprocessor = 1;

  using TiledMma = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, LayoutA, kAlignment, Element, LayoutB, kAlignment, ElementAccumulator,
      TileShape, ClusterShape, cutlass::gemm::collective::StageCount<2>,
      typename Config::MoeMainloopSchedule>::CollectiveOp::TiledMma;
  using CollectiveEpilogue = WgradTmaStoreEpilogue<ElementOut, TiledMma, kTileM, kTileN>;
  // The tiles, from the producer warp to both consumers. An expert's tiles of dW take one stage per
  // K block and none without rows, so the ring holds the producer back only across empty experts.
  using Records = TileRecords<MoeTile, /*kRecords=*/8, kConsumers * cutlass::NumWarpsPerWarpGroup>;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, LayoutA, kAlignment,
      Element, LayoutB, kAlignment,
      ElementAccumulator,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage) + sizeof(typename Records::SharedStorage))>,
      typename Config::MoeMainloopSchedule
    >::CollectiveOp;
  static_assert(std::is_same_v<TiledMma, typename CollectiveMainloop::TiledMma>);
  static_assert(Records::kCapacity > CollectiveMainloop::DispatchPolicy::Stages);
  using Pipeline      = typename CollectiveMainloop::MainloopPipeline;
  using PipelineState = typename CollectiveMainloop::PipelineState;
  using Scheduler     = ExpertTileScheduler<FixedRowTiles>;

  struct SharedStorage {
    typename CollectiveMainloop::TensorStorage tensors;
    typename CollectiveEpilogue::SharedStorage epilogue;
    alignas(16) typename CollectiveMainloop::PipelineStorage pipeline;
    typename Records::SharedStorage records;
  };
  static constexpr int SharedStorageSize = static_cast<int>(sizeof(SharedStorage));

  // What the host knows. Leading dimensions and strides are in elements; a and b are A's and B's
  // first row of T.
  struct Arguments {
    WgradProblemShape problem;
    Element const* ptr_a;
    int64_t lda;
    Element const* ptr_b;
    int64_t ldb;
    typename CollectiveEpilogue::Arguments epilogue;
    void const* tokens_per_expert;
    bool counts_are_int64;
    cutlass::KernelHardwareInfo hw_info;  // device_id and sm_count
    bool n_fastest = false;  // the tile order inside an expert (ExpertTileScheduler::Params)
  };

  struct Params {
    typename CollectiveMainloop::Params mainloop;
    typename CollectiveEpilogue::Params epilogue;
    typename Scheduler::Params scheduler;
    WgradProblemShape problem;
    int max_ctas;
  };

  // Both operands' ragged views: the collective's (M or N, K, L) tensors with K = kTileK rows and
  // L = T + 1 end rows, base kTileK rows before the operand.
  static typename CollectiveMainloop::Arguments mainloop_arguments(Arguments const& args) {
    using Mainloop = CollectiveMainloop;
    auto ragged = [](Element const* ptr, int64_t ld) {  // never dereferenced below ptr
      return reinterpret_cast<Element const*>(reinterpret_cast<uintptr_t>(ptr) - uintptr_t(kTileK) * ld * sizeof(Element));
    };
    return {ragged(args.ptr_a, args.lda), leading_stride<typename Mainloop::StrideA>(args.lda, args.lda),
            ragged(args.ptr_b, args.ldb), leading_stride<typename Mainloop::StrideB>(args.ldb, args.ldb)};
  }

  static auto view_shape(WgradProblemShape const& p) {
    return cute::make_shape(p.m, p.n, int{kTileK}, p.num_tokens + 1);
  }

  static bool can_implement(Arguments const& args) {
    WgradProblemShape const& p = args.problem;
    if (p.num_tokens < 0 || p.m <= 0 || p.n <= 0 || p.num_experts <= 0) return false;
    if (int64_t(p.num_tokens) + kTileK >= (int64_t{1} << 31)) return false;
    if (args.tokens_per_expert == nullptr || args.epilogue.ptr_out == nullptr) return false;
    if (args.epilogue.accumulate && !std::is_same_v<ElementOut, float>) return false;
    constexpr int kOutAlignment = 128 / cutlass::sizeof_bits<ElementOut>::value;
    return CollectiveMainloop::can_implement(view_shape(p), mainloop_arguments(args)) &&
           args.lda % kAlignment == 0 && args.ldb % kAlignment == 0 && p.m % kAlignment == 0 &&
           p.n % kAlignment == 0 && args.epilogue.ldd % kOutAlignment == 0 &&
           args.epilogue.expert_stride % kOutAlignment == 0;
  }

  static size_t get_workspace_size(Arguments const&) { return 0; }

  static Params to_underlying_arguments(Arguments const& args, void* /*workspace*/) {
    WgradProblemShape const& p = args.problem;
    const int tiles_m = (p.m + kTileM - 1) / kTileM;
    const int tiles_n = (p.n + kTileN - 1) / kTileN;
    return {CollectiveMainloop::to_underlying_arguments(view_shape(p), mainloop_arguments(args), nullptr),
            CollectiveEpilogue::to_underlying_arguments(p, args.epilogue),
            {args.tokens_per_expert, args.counts_are_int64, p.num_experts, p.num_tokens, tiles_n,
             FixedRowTiles{tiles_m}, /*group_rows=*/0, args.n_fastest},
            p,
            args.hw_info.sm_count};
  }

  // Persistent: min(max_ctas, tiles).
  static dim3 get_grid_shape(Params const& params) {
    const int64_t tiles = int64_t(params.problem.num_experts) * params.scheduler.row_tiles.tiles *
                          params.scheduler.tiles_n;
    return dim3(static_cast<unsigned>(tiles < params.max_ctas ? tiles : params.max_ctas));
  }

  static dim3 get_block_shape() { return dim3(MaxThreadsPerBlock); }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem);

 private:
  // Issues one K block of an operand, box by box (the collective's load() does it in one copy). The
  // partitions are ((box, boxes), 1, 1): the boxes run along M (A) or N (B). A box that lies wholly
  // past the operand's extent there (the last tile when M or N is not a multiple of the tile) is
  // loaded from the tile's first box instead. TMA would zero-fill it without reading, but the H200
  // faulted on such boxes when the operand ended at the end of mapped memory. Those shared memory
  // rows only feed accumulator rows (or columns) past M (or N), which are never stored, and the
  // transaction bytes stay those of the full tile.
  template <class Tma, class TensorG, class TensorS, class TensorC>
  CUTLASS_DEVICE static void load_boxes(Tma const& tma, TensorG const& g, TensorS const& s, TensorC const& c,
                                        int extent) {
    using namespace cute;
    static_assert(decltype(size<1>(g) * size<2>(g))::value == 1, "one K box per block");
    constexpr int kBoxes = decltype(size<1>(get<0>(g.shape())))::value;
    CUTLASS_PRAGMA_UNROLL
    for (int box = 0; box < kBoxes; ++box) {
      const bool outside = get<0>(c(make_coord(0, box), 0, 0)) >= extent;
      copy(tma, g(make_coord(_, outside ? 0 : box), _, _), s(make_coord(_, box), _, _));
    }
  }
};

template <class Element, class ElementOut, class Config>
CUTLASS_DEVICE void MoeWgradKernel<Element, ElementOut, Config>::operator()(Params const& params, char* smem) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Mainloop = CollectiveMainloop;
  auto& storage = *reinterpret_cast<SharedStorage*>(smem);

  const int warp_group = cutlass::canonical_warp_group_idx();
  const int warp_in_group = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
  const int group_thread = threadIdx.x % cutlass::NumThreadsPerWarpGroup;
  const bool is_producer = warp_group == 0 && warp_in_group == 0;

  if (is_producer && cute::elect_one_sync()) {
    Mainloop::prefetch_tma_descriptors(params.mainloop);
    CollectiveEpilogue::prefetch_tma_descriptors(params.epilogue);
  }

  typename Pipeline::Params pipeline_params;
  pipeline_params.role = is_producer      ? Pipeline::ThreadCategory::Producer
                         : warp_group > 0 ? Pipeline::ThreadCategory::Consumer
                                          : Pipeline::ThreadCategory::NonParticipant;
  pipeline_params.is_leader = group_thread == 0;
  pipeline_params.num_consumers = kConsumers * cutlass::NumThreadsPerWarpGroup;
  pipeline_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
  Pipeline pipeline(storage.pipeline, pipeline_params, ClusterShape{});
  Records records(storage.records, is_producer, warp_group > 0);

  __syncthreads();  // barrier initialization is visible to every warp

  Mainloop mainloop;
  const WgradProblemShape& p = params.problem;
  auto k_blocks = [](MoeTile const& tile) { return (tile.rows + kTileK - 1) / kTileK; };
  // MMA steps of the tile's last K block that reach its rows (the block's first rows, zeros after).
  auto last_k_steps = [](MoeTile const& tile, int blocks) {
    constexpr int kStepK = cute::size<2>(typename TiledMma::AtomShape_MNK{});
    return (tile.rows - (blocks - 1) * kTileK + kStepK - 1) / kStepK;
  };

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (warp_in_group == 1 || warp_in_group == 2) {  // the consumers' store warps
      CollectiveEpilogue::store_warp(params.epilogue, storage.epilogue, warp_in_group - 1);
      return;
    }
    if (!is_producer) return;
    // CTA c of G takes tiles c, c + G, ...
    Scheduler scheduler(params.scheduler);
    const int64_t first = blockIdx.x;
    const int64_t grid = gridDim.x;
    Tensor mA = params.mainloop.tma_load_a.get_tma_tensor(make_shape(p.m, Int<kTileK>{}, p.num_tokens + 1));
    Tensor mB = params.mainloop.tma_load_b.get_tma_tensor(make_shape(p.n, Int<kTileK>{}, p.num_tokens + 1));
    Tensor sA = make_tensor(make_smem_ptr(storage.tensors.smem_A.data()), typename Mainloop::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(storage.tensors.smem_B.data()), typename Mainloop::SmemLayoutB{});
    auto tma_a = params.mainloop.tma_load_a.get_slice(Int<0>{});
    auto tma_b = params.mainloop.tma_load_b.get_slice(Int<0>{});
    Tensor tAsA = tma_a.partition_D(sA);  // (TMA, TMA_M, TMA_K, PIPE)
    Tensor tBsB = tma_b.partition_D(sB);  // (TMA, TMA_N, TMA_K, PIPE)
    const bool elected = cute::elect_one_sync();
    auto write_state = cutlass::make_producer_start_state<Pipeline>();
    for (int64_t index = first;; index += grid) {
      const MoeTile tile = scheduler.tile(index);
      records.put(tile);  // the invalid one after the last, too: it ends the consumers' loops
      if (!tile.valid) break;
      // Each box's first row (A) or column (B) of dW, to spot the boxes wholly past M or N.
      Tensor tAcA = tma_a.partition_S(local_tile(make_identity_tensor(make_shape(p.m, Int<kTileK>{})),
                                                 select<0, 2>(TileShape{}), make_coord(tile.m_tile, 0)));
      Tensor tBcB = tma_b.partition_S(local_tile(make_identity_tensor(make_shape(p.n, Int<kTileK>{})),
                                                 select<1, 2>(TileShape{}), make_coord(tile.n_tile, 0)));
      const int blocks = k_blocks(tile);
      for (int block = 0; block < blocks; ++block) {
        // Rows [end - r, end) are the box at (m0, kTileK - r, end) of both views.
        const int r = min(int{kTileK}, tile.rows - block * kTileK);
        const int end = tile.row_start + block * kTileK + r;
        Tensor gA = local_tile(domain_offset(make_coord(0, kTileK - r, end), mA), select<0, 2>(TileShape{}),
                               make_coord(tile.m_tile, 0, 0));  // (BLK_M, BLK_K)
        Tensor gB = local_tile(domain_offset(make_coord(0, kTileK - r, end), mB), select<1, 2>(TileShape{}),
                               make_coord(tile.n_tile, 0, 0));  // (BLK_N, BLK_K)
        pipeline.producer_acquire(write_state);
        if (elected) {
          auto* barrier = pipeline.producer_get_barrier(write_state);
          const int stage = write_state.index();
          load_boxes(params.mainloop.tma_load_a.with(*barrier), tma_a.partition_S(gA), tAsA(_, _, _, stage), tAcA,
                     p.m);
          load_boxes(params.mainloop.tma_load_b.with(*barrier), tma_b.partition_S(gB), tBsB(_, _, _, stage), tBcB,
                     p.n);
        }
        ++write_state;
      }
    }
    mainloop.load_tail(pipeline, write_state);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    const int consumer = warp_group - 1;
    const int mma_thread = threadIdx.x - cutlass::NumThreadsPerWarpGroup;  // both consumers: 0..255
    TiledMma tiled_mma;
    PipelineState read_state;
    CollectiveEpilogue epilogue(params.epilogue, storage.epilogue, consumer, mma_thread, group_thread);
    if constexpr (CollectiveEpilogue::kDefers) {
      // Each tile's outputs are held in registers and stored while the next tile's K blocks run,
      // one slice per block, the slices left with the last block (so a tile of one or two blocks
      // stores them all during its MMAs).
      auto held = CollectiveEpilogue::Held::make_registers(partition_fragment_C(tiled_mma, take<0, 2>(TileShape{})));
      while (true) {
        const MoeTile tile = records.take();
        if (!tile.valid) break;
        const int blocks = k_blocks(tile);
        if (blocks == 0) {  // an expert with no rows: dW[e] = 0
          epilogue.store_all(held);
          epilogue.hold_zeros(tile, held);
          continue;
        }
        Tensor accum = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));
        mma_pipelined<CollectiveMainloop, 0, /*kHookAfterRelease=*/true, /*kTrimLast=*/true>(
            pipeline, read_state, accum, blocks, mma_thread, storage.tensors, /*accumulate=*/false, [](int) {},
            [&](int block) { epilogue.store_held(block, /*rest=*/block == blocks - 1, held); },
            last_k_steps(tile, blocks));
        mainloop.mma_tail(pipeline, read_state, blocks);
        read_state.advance(blocks);
        epilogue.hold(tile, accum, held);
      }
      epilogue.store_all(held);
    } else {
      while (true) {
        const MoeTile tile = records.take();
        if (!tile.valid) break;
        const int blocks = k_blocks(tile);
        if (blocks == 0 && params.epilogue.accumulate) continue;  // adds nothing: dW[e] is left as it is
        Tensor accum = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));
        if (blocks > 0) {
          mma_pipelined<CollectiveMainloop, 0, /*kHookAfterRelease=*/true, /*kTrimLast=*/true>(
              pipeline, read_state, accum, blocks, mma_thread, storage.tensors, /*accumulate=*/false, [](int) {},
              [](int) {}, last_k_steps(tile, blocks));
          mainloop.mma_tail(pipeline, read_state, blocks);
          read_state.advance(blocks);
        } else {
          clear(accum);  // an expert with no rows: dW[e] = 0
        }
        epilogue.store(tile, accum);
      }
    }
    epilogue.store_tail();
  }
#else
  if (threadIdx.x == 0 && blockIdx.x == 0) printf("cutlass_moe: the sm90 wgrad kernel needs an sm_90a build\n");
  __trap();
#endif
}

}  // namespace cutlass_moe::sm90
