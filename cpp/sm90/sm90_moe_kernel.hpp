// The sm90 (Hopper) MoE GEMM kernel: one launch, no per-expert arrays.
//
// A CUTLASS 3 kernel class (Arguments, Params, to_underlying_arguments, can_implement,
// get_workspace_size, get_grid_shape, operator()), launched by cutlass::device_kernel. It takes the
// base pointers of x, weights and out, T, N, K, E and the device pointer to tokens_per_expert. Its
// parts:
//   - mainloop: CUTLASS's sm90 warp-specialized collective (TMA loads into a multistage shared
//     memory pipeline, WGMMA), built by the CollectiveBuilder and filled by its own
//     to_underlying_arguments (sm90_moe_descriptors.hpp): x through one ragged TMA view, so a tile
//     loads exactly its expert's rows, weights through one descriptor with the expert as batch;
//   - scheduler: MoeTileScheduler (moe_tile_scheduler.hpp), which finds each tile's expert and row
//     offset on the device: the producer warp walks it, and the cooperative and wide tiles'
//     consumers take its units from shared memory (UnitRecords; the pingpong's walk their own);
//   - epilogue: sm90_moe_epilogue.hpp, with the fusion interface both epilogues call.
//
// Warp group 0 produces (one warp issues the TMA loads); warp groups 1 and 2 consume:
//   - pingpong: they take alternate tiles; an order barrier lets only one of them issue WGMMAs at a
//     time, so one tile's epilogue overlaps the other's mainloop;
//   - cooperative: both work on every tile, each on half of its rows; in bf16 from 256 rows per
//     expert, each tile's stores run while the next tile's first K blocks do (cooperative_tiles).
#pragma once

#include "sm90/sm90_tma_encode.hpp"  // first: routes every TMA encode through a checked call

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/kernel_hardware_info.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "fused_epilogue.hpp"
#include "moe_tile_scheduler.hpp"
#include "sm90/sm90_common.cuh"
#include "sm90/sm90_moe_descriptors.hpp"
#include "sm90/sm90_moe_epilogue.hpp"
#include "sm90/sm90_mma_loop.hpp"
#include "sm90/sm90_tile_records.hpp"
#include "split_gate.hpp"
#include "zero_fill.cuh"

namespace cutlass_moe::sm90 {

// Element: x, weights and out. LayoutB: weights[e] as a K x N matrix. Config: tile shape and
// schedule (sm90_configs.cuh). Fusion: what the epilogue applies (sm90_moe_epilogue.hpp).
template <class Element_, class LayoutB_, class Config, template <class> class Fusion_ = LinearFusion>
class MoeGemmKernel {
 public:
  using Element            = Element_;
  using ElementAccumulator = float;
  using LayoutA            = cutlass::layout::RowMajor;                          // x: T x K
  using LayoutB            = LayoutB_;                                           // weights[e]: K x N, expert = batch
  using TileShape          = typename Config::TileShape;
  using ClusterShape       = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Fusion             = Fusion_<Element>;
  static constexpr bool kPingpong = Config::kPingpong;
  static constexpr bool kWide = Config::kWide;  // both consumers on the same rows (wide_tiles)
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;  // 16 bytes, for TMA
  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileN = cute::size<1>(TileShape{});
  static constexpr int kTileK = cute::size<2>(TileShape{});
  static_assert(cute::size(typename Config::ClusterShape{}) == 1, "the MoE kernel runs without clusters");

  // bf16 seeds the accumulators with the fused bias (FusedEpilogue::seed_bias, set on the host):
  // the mainloop adds the products onto it, and no bias pass is left after the mainloop, which
  // cost 28% at PR #263's grouped-linear shape and 2% on gpt-oss (benchmarks/NOTES.md). fp16 does
  // not: its seeded instances made ptxas serialize the WGMMAs (C7515), whatever moved the
  // converted bias into the accumulators; it adds the bias after the mainloop.
  static constexpr bool kSeedsBias = std::is_same_v<Element, cutlass::bfloat16_t>;
  // Cooperative tiles: bf16 stores each tile while the next tile's first K blocks run, seeded or
  // not. fp16 stores each tile after its mainloop: its deferred stores drew C7515 as well.
  static constexpr bool kDefersStores = std::is_same_v<Element, cutlass::bfloat16_t>;

  static constexpr int kConsumers    = 2;                                        // math warp groups
  static constexpr int kProducerRegs = 40;                                       // setmaxnreg budgets, as
  static constexpr int kConsumerRegs = 232;                                      // CUTLASS's pingpong kernel
  static constexpr uint32_t MaxThreadsPerBlock = (1 + kConsumers) * cutlass::NumThreadsPerWarpGroup;
  static constexpr uint32_t MinBlocksPerMultiprocessor = 1;

  using MathOrderBarrier = cutlass::OrderedSequenceBarrier<1, kConsumers>;       // one WGMMA issuer at a time
  // The producer warp's tile of the halved last round (CooperativeUnits): in shared memory, not in
  // one of the producer's 40 registers. Only the producer warp walks the units (the consumers take
  // them from it: UnitRecords).
  struct HalfTileSlot {
    int tile;
  };
  // The cooperative and wide tiles' units, as the producer warp finds them, for both consumers
  // (UnitRecords).
  struct alignas(16) UnitRecord {
    MoeTile tile;
    int half;            // CooperativeUnit::half
    int owned_rows_end;  // the last record (tile not valid): the scheduler's owned_rows_end()
  };
  // The ring that hands them over (sm90_tile_records.hpp): it took 2.3% of the cycles and 1.7% of the
  // sustained time off PR #263's shape (benchmarks/NOTES.md, "The producer hands the units to the
  // consumers"). The last record has no valid tile and carries the end of the owned rows.
  static constexpr int kUnitRecords = 8;  // more than any stage count: the ring never holds the producer back
  using UnitRecords = TileRecords<UnitRecord, kUnitRecords, kConsumers * cutlass::NumWarpsPerWarpGroup>;
  using UnitStorage = typename UnitRecords::SharedStorage;
  // The pingpong tile's consumers take alternate tiles and walk them themselves: no records.
  struct NoUnitStorage {};
  using UnitsStorage = std::conditional_t<kPingpong, NoUnitStorage, UnitStorage>;
  // CUTLASS's collective builder for a tile, schedule and stage count. As a class template, it is
  // instantiated only where a kernel uses its `type`: std::conditional_t below picks between such
  // types without instantiating the one not taken (the wide tile's shapes are no builder's).
  template <class Tile, class Schedule, class Stages>
  struct Built {
    using type = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlignment, Element, LayoutB,
        kAlignment, ElementAccumulator, Tile, ClusterShape, Stages, Schedule>::CollectiveOp;
  };
  template <class Tile, class Schedule>
  struct BuiltTiledMma {
    using type = typename Built<Tile, Schedule, cutlass::gemm::collective::StageCount<2>>::type::TiledMma;
  };
  template <class T>
  struct Given {
    using type = T;
  };

  // The tiled MMA depends only on the tile and schedule; the epilogue needs it before the mainloop's
  // stage count, which needs the epilogue's shared memory.
  static constexpr auto kMajorA = cutlass::gemm::collective::detail::gmma_ss_tag_to_major_A<Element, LayoutA>();
  static constexpr auto kMajorB = cutlass::gemm::collective::detail::gmma_ss_tag_to_major_B<Element, LayoutB>();
  // The wide tile (wide_tiles): each warp group's 64 x kTileN/2 MMA, the two side by side along N.
  // CUTLASS's builder takes a cooperative tile of at least 128 rows only, so the wide tile's tiled
  // MMA and collective mainloop are put together here from the parts the builder would pick.
  using WideTiledMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, ElementAccumulator,
                                 cute::Shape<cute::Int<kTileM>, cute::Int<kTileN / 2>, cute::Int<kTileK>>, kMajorA,
                                 kMajorB>(),
      cute::Layout<cute::Shape<cute::_1, cute::_2, cute::_1>>{}));
  using TiledMma = typename std::conditional_t<kWide, Given<WideTiledMma>,
                                               BuiltTiledMma<TileShape, typename Config::MoeMainloopSchedule>>::type;
  // The wide tile's consumers store their 64 x kTileN/2 parts as the two row halves of a cooperative
  // 128 x kTileN/2 tile would be stored (epilogue_part).
  using CollectiveEpilogue = std::conditional_t<
      kPingpong, PingpongStagedEpilogue<Element, TiledMma, kTileM, kTileN, Fusion>,
      std::conditional_t<kWide,
                         CooperativeTmaStoreEpilogue<
                             Element,
                             typename BuiltTiledMma<cute::Shape<cute::_128, cute::Int<kTileN / 2>, cute::_64>,
                                                    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::type,
                             2 * kTileM, kTileN / 2, Fusion>,
                         CooperativeTmaStoreEpilogue<Element, TiledMma, kTileM, kTileN, Fusion>>>;
  static constexpr int kCarveout = static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage) +
                                                    sizeof(typename MathOrderBarrier::SharedStorage) +
                                                    sizeof(HalfTileSlot) + sizeof(UnitsStorage));
  // As StageCountAutoCarveout: what shared memory holds besides the carve-out, a stage's operands
  // and its pipeline barriers (32 bytes) each.
  static constexpr int kWideStages =
      (cutlass::gemm::collective::detail::sm90_smem_capacity_bytes - kCarveout) /
      ((kTileM + kTileN) * kTileK * int(sizeof(Element)) + 32);
  using WideMainloop = cutlass::gemm::collective::CollectiveMma<
      cutlass::gemm::MainloopSm90TmaGmmaWarpSpecialized<kWideStages, ClusterShape,
                                                        cutlass::gemm::KernelTmaWarpSpecializedCooperative>,
      TileShape, Element, cutlass::detail::TagToStrideA_t<LayoutA>, Element, cutlass::detail::TagToStrideB_t<LayoutB>,
      TiledMma, cute::SM90_TMA_LOAD,
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<kMajorA, Element, cute::Int<kTileM>,
                                                                   cute::Int<kTileK>>()),
      void, cute::identity, cute::SM90_TMA_LOAD,
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<kMajorB, Element, cute::Int<kTileN>,
                                                                   cute::Int<kTileK>>()),
      void, cute::identity>;
  using CollectiveMainloop = typename std::conditional_t<
      kWide, Given<WideMainloop>,
      Built<TileShape, typename Config::MoeMainloopSchedule,
            cutlass::gemm::collective::StageCountAutoCarveout<kCarveout>>>::type;
  static_assert(std::is_same_v<TiledMma, typename CollectiveMainloop::TiledMma>);
  using Pipeline      = typename CollectiveMainloop::MainloopPipeline;
  using PipelineState = typename CollectiveMainloop::PipelineState;
  using Scheduler     = MoeTileScheduler<kTileM>;

  struct SharedStorage {
    typename CollectiveMainloop::TensorStorage tensors;
    typename CollectiveEpilogue::SharedStorage epilogue;
    alignas(16) typename CollectiveMainloop::PipelineStorage pipeline;
    alignas(16) typename MathOrderBarrier::SharedStorage math_order;
    HalfTileSlot half_tile;
    UnitsStorage units;
  };
  static_assert(UnitRecords::kCapacity > CollectiveMainloop::DispatchPolicy::Stages);
  static constexpr int SharedStorageSize = static_cast<int>(sizeof(SharedStorage));

  // What the host knows. Leading dimensions and strides are in elements.
  struct Arguments {
    MoeProblemShape problem;
    Element const* ptr_x;
    int64_t ldx;
    Element const* ptr_weights;
    int64_t ldw;            // between rows (K x N layout) or columns (N x K) of one expert
    int64_t expert_stride;
    typename CollectiveEpilogue::Arguments epilogue;  // out and the fusion's arguments
    FusedEpilogue<Element> fused;
    void const* tokens_per_expert;  // null: interleaved groups (groups)
    bool counts_are_int64;
    bool zero_unowned;  // a new output: also zero the rows no expert owns (after the tiles)
    MoeGroupLayout groups;  // where the experts' rows lie: sorted by expert, or interleaved groups
    bool defer_stores = true;  // cooperative tiles: store each tile during the next one's mainloop
                               // (the host's choice: defer_cooperative_stores)
    bool halve_last_round = true;  // cooperative tiles: a short last round in 64-row halves (CooperativeUnits)
    SplitGate split_gate = SplitGate::kAlways;  // one of a plan's two launches: run only for its kind of split
    cutlass::KernelHardwareInfo hw_info;  // device_id and sm_count
  };

  // A new output's rows past the owned rows (out null: none to zero).
  struct UnownedRows {
    Element* out;
    int64_t ldout;
    int cols;
  };

  // What the device reads.
  struct Params {
    typename CollectiveMainloop::Params mainloop;
    typename CollectiveEpilogue::Params epilogue;
    typename Scheduler::Params scheduler;
    MoeProblemShape problem;
    int max_ctas;  // persistent CTAs: SMs x resident CTAs per SM
    FusedEpilogue<Element> fused;
    UnownedRows unowned;
    MoeGroupLayout groups;
    bool defer_stores;
    bool halve_last_round;
    SplitGate split_gate;
  };

  // Sizes and strides the kernel takes: TMA wants 16-byte multiples; the ragged views keep row and
  // tile arithmetic in 32 bits (T <= kMaxTokens, checked with the other arguments in moe_gemm.cpp).
  // Interleaved groups: K and out's columns in whole K blocks and stored slices (64 columns), so
  // that no box reaches the next group's columns, and no row scale (its rows are sorted rows).
  static bool can_implement(Arguments const& args) {
    MoeProblemShape const& p = args.problem;
    MoeGroupLayout const& groups = args.groups;
    if (p.num_tokens <= 0 || p.n <= 0 || p.k <= 0 || p.num_experts <= 0) return false;
    if (int64_t(p.num_tokens) + kTileM >= (int64_t{1} << 31)) return false;
    if ((args.tokens_per_expert == nullptr) != groups.interleaved()) return false;
    if (groups.interleaved()) {
      const int out_cols = args.epilogue.gated ? p.n / 2 : p.n;
      if (int64_t(groups.group_rows) * p.num_experts != p.num_tokens || p.k % kTileK != 0 || out_cols % 64 != 0 ||
          args.fused.row_scale != nullptr || args.zero_unowned || groups.x_group_stride < p.k ||
          groups.out_group_stride < out_cols || groups.x_group_stride % kAlignment != 0 ||
          groups.out_group_stride % kAlignment != 0 ||
          args.ldx < int64_t(p.num_experts - 1) * groups.x_group_stride + p.k ||
          args.epilogue.ldout < int64_t(p.num_experts - 1) * groups.out_group_stride + out_cols ||
          int64_t(p.num_experts - 1) * groups.x_group_stride + p.k >= (int64_t{1} << 31) ||
          int64_t(p.num_experts - 1) * groups.out_group_stride + out_cols >= (int64_t{1} << 31)) {
        return false;
      }
    }
    const int64_t batch = p.num_experts > 1 ? args.expert_stride : 0;
    using Mainloop = CollectiveMainloop;
    typename Mainloop::Arguments mainloop{args.ptr_x, leading_stride<typename Mainloop::StrideA>(args.ldx, args.ldx),
                                          args.ptr_weights, leading_stride<typename Mainloop::StrideB>(args.ldw, batch)};
    const int x_rows = groups.view_rows(p.num_tokens);
    const int x_cols = groups.x_view_cols(p.k, p.num_experts);
    return Mainloop::can_implement(cute::make_shape(kTileM, p.n, x_cols, x_rows + 1), mainloop) &&
           Mainloop::can_implement(cute::make_shape(kTileM, p.n, p.k, p.num_experts), mainloop) &&
           args.ldx % kAlignment == 0 && args.ldw % kAlignment == 0 && args.expert_stride % kAlignment == 0 &&
           args.epilogue.ldout % kAlignment == 0 && p.n % kAlignment == 0;
  }

  static size_t get_workspace_size(Arguments const&) { return 0; }

  static Params to_underlying_arguments(Arguments const& args, void* /*workspace*/) {
    MoeProblemShape const& p = args.problem;
    const int device = args.hw_info.device_id;
    const int tiles_n = (p.n + kTileN - 1) / kTileN;
    MoeGroupLayout const& groups = args.groups;
    return {make_mainloop_params<CollectiveMainloop, kTileM>(
                p, args.ptr_x, args.ldx, groups.view_rows(p.num_tokens), groups.x_view_cols(p.k, p.num_experts),
                args.ptr_weights, args.ldw, args.expert_stride, device),
            CollectiveEpilogue::to_underlying_arguments(p, groups, args.epilogue, device),
            {args.tokens_per_expert, args.counts_are_int64, p.num_experts, p.num_tokens, tiles_n, {},
             groups.group_rows},
            p,
            args.hw_info.sm_count,
            args.fused,
            {args.zero_unowned ? args.epilogue.ptr_out : nullptr, args.epilogue.ldout,
             args.epilogue.gated ? p.n / 2 : p.n},
            groups,
            args.defer_stores,
            args.halve_last_round,
            args.split_gate};
  }

  // Persistent: min(max_ctas, most tiles any count vector can make).
  static dim3 get_grid_shape(Params const& params) {
    MoeProblemShape const& p = params.problem;
    return dim3(persistent_grid(params.max_ctas, p.num_tokens, p.num_experts, params.scheduler.tiles_n, kTileM));
  }

  static dim3 get_block_shape() { return dim3(MaxThreadsPerBlock); }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem);

 private:
  using Fused = FusedEpilogue<Element>;

  // Whether the counts are a split of whole kAlignedSplitRows tiles (SplitGate; split_gate.hpp's
  // rule), read by the whole CTA for a plan's two launches: a thread per expert.
  CUTLASS_DEVICE static bool counts_aligned(typename Scheduler::Params const& s) {
    bool aligned = true, multi_tile = false;
    for (int e = threadIdx.x; e < s.num_experts; e += blockDim.x) {
      const int64_t count = s.counts_are_int64 ? static_cast<const int64_t*>(s.tokens_per_expert)[e]
                                               : static_cast<const int32_t*>(s.tokens_per_expert)[e];
      aligned = aligned && count_in_whole_tiles(count);
      multi_tile = multi_tile || count_spans_two_tiles(count);
    }
    // Both barriers are reached by every thread (no early exit between them).
    const bool all_aligned = __syncthreads_and(aligned) != 0;
    return __syncthreads_or(multi_tile) != 0 && all_aligned;
  }

  // After a consumer's last tile: its share of the unowned rows (both consumers of every CTA split
  // them). owned_rows_end: from the scheduler's walk to its end (Scheduler::owned_rows_end()).
  CUTLASS_DEVICE static void zero_unowned(Params const& params, int owned_rows_end, int consumer, int group_thread) {
    if (params.unowned.out == nullptr) return;
    constexpr int64_t kThreads = cutlass::NumThreadsPerWarpGroup;
    zero_rows(params.unowned.out, params.unowned.cols, params.unowned.ldout, owned_rows_end,
              params.problem.num_tokens,
              (int64_t(blockIdx.x) * kConsumers + consumer) * kThreads + group_thread,
              int64_t(gridDim.x) * kConsumers * kThreads);
  }

  // The cooperative tiles as units of work, CTA by CTA: CTA c of G takes tiles c, c + G, ... in the
  // scheduler's order, except in a short last round. A last round of L <= G / 2 tiles (after at
  // least one full round) would leave G - L CTAs idle for a whole tile's time, so each of its tiles
  // is cut into two halves of 64 rows: CTA c takes the first half of tile c of the round, CTA L + c
  // the second half. A half holds at most 64 rows, moved to the top of the tile (consumer 0's part),
  // so consumer 1 has no rows in it and issues no MMAs. The round then takes less time, though not
  // half: a half tile still loads all of the weights' columns (benchmarks/NOTES.md).
  // Where the launch halves (the host's choice: a few rounds of few experts), the producer warp walks
  // the counts to the end for the tile count before its first tile (plan()), then takes the units in
  // order, loads them and hands them to both consumers (UnitRecords). It keeps its half tile in
  // shared memory (HalfTileSlot).
  struct CooperativeUnit {
    MoeTile tile;
    bool half;  // a 64-row half: consumer 1 has no rows
  };
  class CooperativeUnits {
   public:
    CUTLASS_DEVICE explicit CooperativeUnits(HalfTileSlot& slot) : index_(blockIdx.x) {
      set_slot(slot, kNoTile);
    }

    // Finds this CTA's half tile, if the last round is halved: before the first unit. The scheduler
    // first finds that unit's tile itself, so the walk starts from the counts it loaded (with up to
    // 32 experts, the walk then loads nothing).
    CUTLASS_DEVICE void plan(Scheduler& scheduler, HalfTileSlot& slot) {
      scheduler.tile(index_);
      set_slot(slot, half_tile(scheduler));
    }

    CUTLASS_DEVICE CooperativeUnit next(Scheduler& scheduler, HalfTileSlot& slot) {
      int64_t index = index_;
      int half = 0;  // 0: the whole tile; 1, 2: its first or second 64 rows
      // CTA c < L meets its half tile as its own last tile; CTA L + c in the step after its last tile.
      const int halved = slot.tile;
      if (index_ >= halved) {
        half = index_ == halved ? 1 : 2;
        index = halved;
        set_slot(slot, kNoTile);
      }
      index_ += gridDim.x;
      MoeTile tile = scheduler.tile(index);
      if (half == 1) {
        tile.rows = min(tile.rows, tile.m_tile * kTileM + kTileM / 2);
      } else if (half == 2) {
        tile.row_start += kTileM / 2;
        tile.rows -= kTileM / 2;
        if (tile.rows <= tile.m_tile * kTileM) tile = scheduler.tile(index_);  // no second half: done
      }
      return {tile, half != 0};
    }

   private:
    static constexpr int kNoTile = 1 << 30;

    // This CTA's tile in the halved last round, or kNoTile: from a walk of a copy of the scheduler to
    // the end, so that the scheduler's own walk still only moves forward.
    CUTLASS_DEVICE static int half_tile(Scheduler const& scheduler) {
      Scheduler walk = scheduler;
      walk.tile(int64_t{1} << 62);  // past the last tile: the walk reaches the last expert
      const int64_t tiles = walk.total_tiles();
      const int grid = gridDim.x, cta = blockIdx.x;
      const int partial = static_cast<int>(tiles % grid);  // tiles in the last round
      // (The host halves only where the tiles fill a few rounds: their count fits an int.)
      if (tiles >= grid && tiles < kNoTile && partial > 0 && 2 * partial <= grid && cta < 2 * partial) {
        return static_cast<int>(tiles) - partial + cta % partial;
      }
      return kNoTile;
    }
    CUTLASS_DEVICE static void set_slot(HalfTileSlot& slot, int tile) {  // every lane the same value
      __syncwarp();
      slot.tile = tile;
      __syncwarp();
    }

    int64_t index_;
  };

  // The pingpong tile's stand-in for UnitRecords: no shared memory, no barriers.
  struct NoUnitRecords {
    CUTLASS_DEVICE NoUnitRecords(NoUnitStorage&, bool, bool) {}
  };
  using Units = std::conditional_t<kPingpong, NoUnitRecords, UnitRecords>;

  static constexpr int kPairs = decltype(cute::size(cute::partition_fragment_C(
      TiledMma{}, cute::take<0, 2>(TileShape{}))))::value / 2;  // accumulator pairs per thread
  using FusedOperands = typename Fused::template Operands<kPairs>;

  // The thread's fragment coordinates in a tile; mma_thread: its index in its tiled MMA.
  CUTLASS_DEVICE static auto fragment_coords(int mma_thread) {
    using namespace cute;
    return TiledMma{}.get_thread_slice(mma_thread).partition_C(
        make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{})));
  }
  CUTLASS_DEVICE static FusedOperands load_fused(Fused const& fused, MoeTile const& tile, int mma_thread) {
    return fused.template load<kPairs>(fragment_coords(mma_thread), tile.expert, tile.row_start + tile.m_tile * kTileM,
                                       tile.n_tile * kTileN);
  }
  template <class Accumulators>
  CUTLASS_DEVICE static void apply_fused(Fused const& fused, Accumulators& accum, FusedOperands const& operands,
                                         MoeTile const& tile, int mma_thread, bool with_row_scale = true) {
    fused.apply(accum, fragment_coords(mma_thread), operands, tile.expert, tile.n_tile * kTileN, with_row_scale);
  }

  // Seeds the tile's accumulators with its bias where the kernel does (kSeedsBias, seed_bias);
  // returns whether it did. Called before the mainloop's turn (pingpong: before the order
  // barrier), so that the loads overlap what runs meanwhile.
  template <class Accumulators>
  CUTLASS_DEVICE static bool seed_accumulators(Params const& params, Accumulators& accum, MoeTile const& tile,
                                               int mma_thread) {
    if constexpr (kSeedsBias) {
      if (params.fused.seed_bias) {
        params.fused.template seed<kPairs>(accum, fragment_coords(mma_thread), tile.expert, tile.n_tile * kTileN);
        return true;
      }
    }
    return false;
  }

  // A tile's mainloop where the stores are not deferred. Where the kernel seeds, mma_pipelined,
  // which adds onto the seeded accumulators (or starts from zero); otherwise the collective's mma().
  template <class Accumulators>
  CUTLASS_DEVICE static void mainloop_mma(Params const& params, Pipeline& pipeline, PipelineState read_state,
                                          Accumulators& accum, bool seeded, int k_tiles, int mma_thread,
                                          typename CollectiveMainloop::TensorStorage& tensors) {
    if constexpr (kSeedsBias) {
      mma_pipelined<CollectiveMainloop, 0, /*kHookAfterRelease=*/false>(
          pipeline, read_state, accum, k_tiles, mma_thread, tensors, seeded, [](int) {}, [](int) {});
    } else {
      CollectiveMainloop mainloop;
      mainloop.mma(pipeline, read_state, accum, k_tiles, mma_thread, tensors, params.mainloop);
    }
  }

  // The wide tile's consumers (kWide): both run every tile's K blocks, each on its own kTileN / 2
  // columns of the same kTileM rows, so the tile pads an expert's rows to 64 as the pingpong tile
  // does, while its two consumers share each stage's x box as the cooperative tile's share the
  // weights' (benchmarks/NOTES.md, "The wide tile"). The epilogue stores consumer c's part as the
  // cooperative epilogue stores row half c of a 2 kTileM x kTileN / 2 tile (epilogue_part), with the
  // same fusions and deferred stores. The tiles are cooperative_tile's, in cooperative_tiles' order
  // without its half tiles (CooperativeUnits): one loop for both spilled 4 bytes in the bf16 wide
  // instance.
  CUTLASS_DEVICE static MoeTile epilogue_part(MoeTile tile, int consumer) {
    const int skip = (tile.m_tile - consumer) * kTileM;  // the part's rows start at m_tile * kTileM
    tile.row_start += skip;
    tile.rows -= skip;
    tile.m_tile = 0;
    tile.n_tile = tile.n_tile * 2 + consumer;
    return tile;
  }
  // Returns the end of the owned rows (zero_unowned).
  template <bool kDeferStores>
  CUTLASS_DEVICE static int wide_tiles(Params const& params, SharedStorage& storage, Pipeline& pipeline,
                                       UnitRecords& units, CollectiveEpilogue& epilogue, int k_tiles, int consumer,
                                       int mma_thread) {
    using namespace cute;
    PipelineState read_state;
    auto held = CollectiveEpilogue::Held::make_registers(partition_fragment_C(TiledMma{}, take<0, 2>(TileShape{})));
    UnitRecord unit = units.take();
    for (; unit.tile.valid; unit = units.take()) {
      cooperative_tile<kDeferStores>(params, storage, pipeline, read_state, epilogue, held, unit.tile, k_tiles,
                                     consumer, mma_thread);
    }
    if constexpr (kDeferStores) epilogue.store_all(held);
    return unit.owned_rows_end;
  }

  // One tile of cooperative_tiles or wide_tiles: its mainloop, fusion and store (kDeferStores: the
  // previous tile's slices stored during the first K blocks, this one's outputs held), with the
  // wide tile's part of it (epilogue_part) where the kernel has one.
  template <bool kDeferStores, class Held>
  CUTLASS_DEVICE static void cooperative_tile(Params const& params, SharedStorage& storage, Pipeline& pipeline,
                                              PipelineState& read_state, CollectiveEpilogue& epilogue, Held& held,
                                              MoeTile const& tile, int k_tiles, int consumer, int mma_thread) {
    using namespace cute;
    constexpr int kSlices = CollectiveEpilogue::kSlices;
    CollectiveMainloop mainloop;
    Tensor accum = partition_fragment_C(TiledMma{}, take<0, 2>(TileShape{}));
    FusedOperands fused;  // loaded before the mainloop, which hides the loads' latency
    if (params.fused.enabled) fused = load_fused(params.fused, tile, mma_thread);
    const bool seeded = seed_accumulators(params, accum, tile, mma_thread);
    if constexpr (kDeferStores) {
      mma_pipelined<CollectiveMainloop, kSlices, /*kHookAfterRelease=*/false>(
          pipeline, read_state, accum, k_tiles, mma_thread, storage.tensors, seeded,
          [&](int k_tile) { epilogue.store_slice(k_tile, held); }, [](int) {});
    } else {
      mainloop_mma(params, pipeline, read_state, accum, seeded, k_tiles, mma_thread, storage.tensors);
    }
    mainloop.mma_tail(pipeline, read_state, k_tiles);
    read_state.advance(k_tiles);
    // A plain tile's row scale is applied as the epilogue converts its outputs (hold() where the
    // stores are deferred, store() otherwise), in the same loop, and with nothing else to fuse (the
    // MoE down projection, its bias seeded or absent) the fused pass is not entered: its code (every
    // activation's unrolled loops) lies apart from the code every tile runs, and the jump there and
    // back cost instruction-cache misses. qwen3-30b's down projection with its row scale went from
    // 1.046x to 1.028x its plain GEMM, gpt-oss's with its bias from 1.023x to 1.019x (benchmarks/
    // NOTES.md, twenty-second and twenty-third sessions). A gated tile whose fusion is the activation
    // alone gets it here, in a loop of its own, for the two that MoE layers use: SwiGLU where the
    // stores are deferred, gpt-oss's (its bias seeded) on both paths.
    const bool scale_in_epilogue = !params.fused.gated && params.fused.row_scale != nullptr;
    const int gated_alone = params.fused.gated_alone;
    if (kDeferStores && gated_alone == static_cast<int>(Activation::kSilu)) {
      params.fused.template gated_pairs<Activation::kSilu, 2 * kPairs>(accum);
    } else if (gated_alone == static_cast<int>(Activation::kSwigluOai)) {
      params.fused.template gated_pairs<Activation::kSwigluOai, 2 * kPairs>(accum);
    } else if (params.fused.enabled && (!scale_in_epilogue || params.fused.needs_pass_besides_row_scale())) {
      apply_fused(params.fused, accum, fused, tile, mma_thread, /*with_row_scale=*/!scale_in_epilogue);
    }
    if constexpr (kDeferStores) {
      epilogue.hold(kWide ? epilogue_part(tile, consumer) : tile, accum, held, fused.scale, scale_in_epilogue);
    } else {
      epilogue.store(kWide ? epilogue_part(tile, consumer) : tile, accum, fused.scale, scale_in_epilogue);
    }
  }

  // A cooperative consumer's tiles. kDeferStores: each tile's outputs wait in registers (`held`)
  // and are stored while the next tile's first K blocks run, one slice per block
  // (sm90_moe_epilogue.hpp). Otherwise each tile is stored right after its mainloop. Either way the
  // accumulators may be seeded with a bf16 bias: seeding where the stores are deferred took gpt-oss's
  // projections at 512 rows per expert from 1.05-1.06x their plain GEMM to 1.005-1.02x
  // (benchmarks/NOTES.md, thirty-third session). The units are the producer's (UnitRecords). Returns
  // the end of the owned rows (zero_unowned).
  template <bool kDeferStores>
  CUTLASS_DEVICE static int cooperative_tiles(Params const& params, SharedStorage& storage, Pipeline& pipeline,
                                              UnitRecords& units, CollectiveEpilogue& epilogue, int k_tiles,
                                              int mma_thread) {
    using namespace cute;
    CollectiveMainloop mainloop;
    PipelineState read_state;
    auto held = CollectiveEpilogue::Held::make_registers(partition_fragment_C(TiledMma{}, take<0, 2>(TileShape{})));
    UnitRecord unit = units.take();
    for (; unit.tile.valid; unit = units.take()) {
      if (unit.half && mma_thread >= cutlass::NumThreadsPerWarpGroup) {
        // Consumer 1 has no rows in a half tile, the CTA's last unit: its stages, without MMAs.
        if constexpr (kDeferStores) epilogue.store_all(held);
        stages_without_mma(pipeline, read_state, k_tiles);
        mainloop.mma_tail(pipeline, read_state, k_tiles);
        return units.take().owned_rows_end;  // the last record
      }
      cooperative_tile<kDeferStores>(params, storage, pipeline, read_state, epilogue, held, unit.tile, k_tiles,
                                     /*consumer=*/0, mma_thread);
    }
    if constexpr (kDeferStores) epilogue.store_all(held);
    return unit.owned_rows_end;
  }
};

template <class Element, class LayoutB, class Config, template <class> class Fusion>
CUTLASS_DEVICE void MoeGemmKernel<Element, LayoutB, Config, Fusion>::operator()(Params const& params, char* smem) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Mainloop = CollectiveMainloop;
  auto& storage = *reinterpret_cast<SharedStorage*>(smem);
  // One of a plan's two launches (run_moe_gemm): leave before any other work unless the counts are
  // the split this launch is for. Every CTA reads them alike, so exactly one of the two runs.
  if (params.split_gate != SplitGate::kAlways &&
      counts_aligned(params.scheduler) != (params.split_gate == SplitGate::kAlignedOnly)) {
    return;
  }

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
  // Pingpong: one warp group consumes each stage; cooperative: both do.
  pipeline_params.num_consumers =
      kPingpong ? cutlass::NumThreadsPerWarpGroup : kConsumers * cutlass::NumThreadsPerWarpGroup;
  pipeline_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
  Pipeline pipeline(storage.pipeline, pipeline_params, ClusterShape{});

  typename MathOrderBarrier::Params order_params;
  order_params.group_id = warp_group > 0 ? warp_group - 1 : 0;
  order_params.group_size = cutlass::NumThreadsPerWarpGroup;
  MathOrderBarrier math_order(storage.math_order, order_params);

  Units units(storage.units, is_producer, warp_group > 0);  // the cooperative and wide tiles' records

  __syncthreads();  // barrier initialization is visible to every warp

  Scheduler scheduler(params.scheduler);
  Mainloop mainloop;
  const MoeProblemShape& p = params.problem;
  const int k_tiles = (p.k + kTileK - 1) / kTileK;
  const int64_t first = blockIdx.x;
  const int64_t grid = gridDim.x;

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (!is_producer) return;
    // TMA coordinate tensors: x as the ragged view (kTileM, K, T + 1), weights as (N, K, E).
    // Interleaved groups: x's view is (kTileM, every group's columns, group rows + 1).
    MoeGroupLayout const& groups = params.groups;
    Tensor mA = params.mainloop.tma_load_a.get_tma_tensor(
        make_shape(Int<kTileM>{}, groups.x_view_cols(p.k, p.num_experts), groups.view_rows(p.num_tokens) + 1));
    Tensor mB = params.mainloop.tma_load_b.get_tma_tensor(make_shape(p.n, p.k, p.num_experts));
    auto write_state = cutlass::make_producer_start_state<Pipeline>();
    // Pingpong: tiles first, first + grid, ...; cooperative: the same, or half tiles at the end.
    CooperativeUnits walk(storage.half_tile);
    if (!kPingpong && !kWide && params.halve_last_round) walk.plan(scheduler, storage.half_tile);
    while (true) {
      const CooperativeUnit unit = walk.next(scheduler, storage.half_tile);
      // The last record (no valid tile) carries the end of the owned rows (a warp-wide read).
      if constexpr (!kPingpong) units.put({unit.tile, unit.half, unit.tile.valid ? 0 : scheduler.owned_rows_end()});
      MoeTile const& tile = unit.tile;
      if (!tile.valid) break;
      // x: the tile's rows [first_row, first_row + rows) are the box at (kTileM - rows, k,
      // first_row + rows) of the ragged view; TMA zero-fills its other rows without reading them.
      // Interleaved groups: the expert's columns start at expert * x_group_stride (row_start is 0).
      // Weights: the batch mode is the expert.
      const int first_row = tile.row_start + tile.m_tile * kTileM;
      const int rows = min(int{kTileM}, tile.rows - tile.m_tile * kTileM);
      const int first_col = static_cast<int>(tile.expert * groups.x_group_stride);
      Tensor gA = local_tile(domain_offset(make_coord(kTileM - rows, first_col, first_row + rows), mA), TileShape{},
                             make_coord(_, _, _), Step<_1, X, _1>{});  // (BLK_M, BLK_K, 1, k, l)
      Tensor gB = local_tile(domain_offset(make_coord(0, 0, tile.expert), mB), TileShape{}, make_coord(_, _, _),
                             Step<X, _1, _1>{});  // (BLK_N, BLK_K, n, k, l)
      mainloop.load(params.mainloop, pipeline, write_state, cute::make_tuple(gA, gB),
                    make_coord(0, tile.n_tile, _, 0), cute::make_coord_iterator(k_tiles), k_tiles,
                    threadIdx.x % 32, /*block_rank_in_cluster=*/0, storage.tensors);
      write_state.advance(k_tiles);
    }
    mainloop.load_tail(pipeline, write_state);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    const int consumer = warp_group - 1;
    if constexpr (kPingpong) {
      TiledMma tiled_mma;
      PipelineState read_state;
      CollectiveEpilogue epilogue(params.epilogue, storage.epilogue, consumer, group_thread);
      if (consumer == 1) read_state.advance(k_tiles);  // consumer 0 takes the first tile's stages
      for (int64_t index = first + consumer * grid;; index += kConsumers * grid) {
        MoeTile tile = scheduler.tile(index);
        if (!tile.valid) break;
        Tensor accum = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));
        FusedOperands fused;
        if (params.fused.enabled) fused = load_fused(params.fused, tile, group_thread);
        const bool seeded = seed_accumulators(params, accum, tile, group_thread);
        math_order.wait();
        mainloop_mma(params, pipeline, read_state, accum, seeded, k_tiles, group_thread, storage.tensors);
        math_order.arrive();
        mainloop.mma_tail(pipeline, read_state, k_tiles);
        read_state.advance(k_tiles * kConsumers);
        if (params.fused.enabled) apply_fused(params.fused, accum, fused, tile, group_thread);
        epilogue.store(tile, accum);
      }
      epilogue.store_tail();
      zero_unowned(params, scheduler.owned_rows_end(), consumer, group_thread);
    } else if constexpr (kWide) {
      const int mma_thread = threadIdx.x - cutlass::NumThreadsPerWarpGroup;  // both consumers: 0..255
      CollectiveEpilogue epilogue(params.epilogue, storage.epilogue, consumer, mma_thread, group_thread);
      int owned_rows_end;
      if (kDefersStores && params.defer_stores && k_tiles >= CollectiveEpilogue::kSlices) {
        owned_rows_end = wide_tiles</*kDeferStores=*/true>(params, storage, pipeline, units, epilogue, k_tiles,
                                                           consumer, mma_thread);
      } else {
        owned_rows_end = wide_tiles</*kDeferStores=*/false>(params, storage, pipeline, units, epilogue, k_tiles,
                                                            consumer, mma_thread);
      }
      epilogue.store_tail();
      zero_unowned(params, owned_rows_end, consumer, group_thread);
    } else {
      const int mma_thread = threadIdx.x - cutlass::NumThreadsPerWarpGroup;  // both consumers: 0..255
      CollectiveEpilogue epilogue(params.epilogue, storage.epilogue, consumer, mma_thread, group_thread);
      int owned_rows_end;
      // Two loops, so that each has the registers to itself: one defers each tile's stores into the
      // next tile's mainloop (bf16: defer_cooperative_stores), the other stores after the mainloop.
      // Deferred stores need a K block per slice (kSlices), which every MoE layer has (K >= 256).
      if (kDefersStores && params.defer_stores && k_tiles >= CollectiveEpilogue::kSlices) {
        owned_rows_end = cooperative_tiles</*kDeferStores=*/true>(params, storage, pipeline, units, epilogue, k_tiles,
                                                                  mma_thread);
      } else {
        owned_rows_end = cooperative_tiles</*kDeferStores=*/false>(params, storage, pipeline, units, epilogue,
                                                                   k_tiles, mma_thread);
      }
      epilogue.store_tail();
      zero_unowned(params, owned_rows_end, consumer, group_thread);
    }
  }
#else
  // Built without sm90a features (e.g. for sm_90 instead of sm_90a): never run silently.
  if (threadIdx.x == 0 && blockIdx.x == 0) printf("cutlass_moe: the sm90 MoE kernel needs an sm_90a build\n");
  __trap();
#endif
}

}  // namespace cutlass_moe::sm90
