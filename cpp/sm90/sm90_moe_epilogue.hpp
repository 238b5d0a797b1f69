// Epilogues of the sm90 MoE kernel, and the fusion interface both call.
//
// A consumer warp group finishes a tile with its accumulators in registers, in the GMMA layout:
// each thread holds pairs of adjacent columns of some rows. Both epilogues walk those pairs and
// hand each one to the Fusion, which returns what to store; only then do they differ in how the
// values reach out:
//   - PingpongStagedEpilogue (pingpong configs): the consumer stages its tile in shared memory 64
//     columns at a time, then writes whole 16-byte vectors, coalesced along rows and clipped to the
//     expert's rows and to N. The other consumer's mainloop runs meanwhile.
//   - CooperativeTmaStoreEpilogue (cooperative configs): both consumers finish each tile together,
//     so a synchronous epilogue would idle the tensor cores. Each consumer writes 64-column slices
//     into swizzled shared memory, and one of its threads stores each slice with an asynchronous TMA
//     copy through the ragged view of out (sm90_moe_descriptors.hpp). The kernel may defer the
//     slices into the next tile's first K blocks, holding the tile's outputs in registers.
//
// The fusion interface (LinearFusion is the identity):
//   Arguments, Params, to_underlying_arguments(Arguments)  host -> device parameters
//   kOutputsPerPair     2: one output per accumulator column; 1: a gated fusion combining a
//                       (gate, up) pair into one output, so the output has half the columns
//   kReadsOutput        whether visit() needs out's current values (accumulating into out)
//   begin_tile(expert)  once per tile and thread, before its visits (per-expert state: a bias row)
//   visit(acc, row, col) the accumulators of out[row][col], out[row][col + 1] (row and col index
//                       out and the accumulator columns), returning kOutputsPerPair values. Rows
//                       past the expert's last row (a partial tile) are visited too and their
//                       values never stored: a fusion that reads per-row data must bound the row.
// These epilogues implement kOutputsPerPair == 2 and kReadsOutput == false. The kernel's runtime
// fused epilogue (FusedEpilogue in fused_epilogue.hpp: bias, activation, row scale) works on the
// accumulators before store(); when it is gated, it leaves each (gate, up) pair's output in the
// pair's first value, and store() writes those alone (Params::gated, out with N/2 columns).
#pragma once

#include "sm90/sm90_tma_encode.hpp"  // first: routes every TMA encode through a checked call

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_conversion.h>

#include "moe_tile_scheduler.hpp"
#include "sm90/sm90_moe_descriptors.hpp"

namespace cutlass_moe::sm90 {

// out = accumulators, converted to the output type.
template <class ElementOut>
struct LinearFusion {
  struct Arguments {};
  struct Params {};
  static constexpr int kOutputsPerPair = 2;
  static constexpr bool kReadsOutput = false;

  static Params to_underlying_arguments(Arguments const&) { return {}; }

  CUTLASS_DEVICE explicit LinearFusion(Params const&) {}
  CUTLASS_DEVICE void begin_tile(int /*expert*/) {}
  CUTLASS_DEVICE cutlass::Array<ElementOut, 2> visit(cutlass::Array<float, 2> const& acc, int /*row*/,
                                                     int /*col*/) const {
    return cutlass::NumericArrayConverter<ElementOut, float, 2>{}(acc);
  }
};

template <class Fusion>
constexpr void check_supported_fusion() {
  static_assert(Fusion::kOutputsPerPair == 2, "the MoE epilogues store one output per accumulator column");
  static_assert(!Fusion::kReadsOutput, "the MoE epilogues do not read out");
}

// Pingpong: a consumer owns whole tiles (kTileM x kTileN) and stores them through its own staging
// buffer, kCols columns at a time. Rows are padded by 16 bytes so that both the fragment writes (8
// rows x 4 adjacent words per warp) and the 16-byte row reads are free of bank conflicts.
template <class Element, class TiledMma, int kTileM, int kTileN, class Fusion>
class PingpongStagedEpilogue {
 public:
  static constexpr int kConsumers = 2;
  static constexpr int kRows = kTileM;
  static constexpr int kCols = 64;
  static constexpr int kPitch = kCols + 8;
  static_assert(kTileN % kCols == 0);

  struct SharedStorage {
    cute::array_aligned<Element, kRows * kPitch, 128> tile[kConsumers];
  };
  struct Arguments {
    Element* ptr_out;
    int64_t ldout;
    bool gated;  // out has N/2 columns (kernel's FusedEpilogue)
    typename Fusion::Arguments fusion;
  };
  struct Params {
    Element* out;
    int64_t ldout;
    int64_t group_stride;  // interleaved groups: between the groups' first columns; else 0
    int out_cols;          // N, or N/2 when gated
    bool gated;
    typename Fusion::Params fusion;
  };

  static Params to_underlying_arguments(MoeProblemShape const& problem, MoeGroupLayout const& groups,
                                        Arguments const& args, int /*device*/) {
    return {args.ptr_out, args.ldout, groups.out_group_stride, args.gated ? problem.n / 2 : problem.n, args.gated,
            Fusion::to_underlying_arguments(args.fusion)};
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const&) {}

  // `consumer` is the warp group's index among the consumers, `thread` its thread's index in it
  // (and in its one-warp-group tiled MMA); the consumer's named barrier is `consumer`.
  CUTLASS_DEVICE PingpongStagedEpilogue(Params const& params, SharedStorage& storage, int consumer, int thread)
      : params_(params), staging_(storage.tile[consumer].data()), consumer_(consumer), thread_(thread) {
    check_supported_fusion<Fusion>();
  }

  template <class Accumulators>
  CUTLASS_DEVICE void store(MoeTile const& tile, Accumulators const& accum) {
    if (params_.gated) {
      store<2>(tile, accum);
    } else {
      store<1>(tile, accum);
    }
  }

  CUTLASS_DEVICE void store_tail() {}

 private:
  // kPack accumulator columns per output column: 1, or 2 for a gated tile, whose (gate, up) pairs
  // the fused epilogue has combined into their first values. Each slice covers kCols output
  // columns, kCols * kPack accumulator columns.
  template <int kPack, class Accumulators>
  CUTLASS_DEVICE void store(MoeTile const& tile, Accumulators const& accum) {
    using namespace cute;
    constexpr int kThreads = cutlass::NumThreadsPerWarpGroup;
    constexpr int kVector = 16 / sizeof(Element);  // elements per 16-byte store
    constexpr int kVectorsPerRow = kCols / kVector;
    static_assert(kTileN % (kCols * kPack) == 0);
    TiledMma tiled_mma;
    Tensor coords = tiled_mma.get_thread_slice(thread_).partition_C(make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{})));
    static_assert(decltype(size(coords))::value == decltype(size(accum))::value);

    Fusion fusion(params_.fusion);
    fusion.begin_tile(tile.expert);
    const int first_row = tile.row_start + tile.m_tile * kTileM;
    const int first_col = tile.n_tile * kTileN;  // of the accumulators
    const int first_out_col = first_col / kPack;
    const int rows_left = tile.rows - tile.m_tile * kTileM;
    const int cols_left = params_.out_cols - first_out_col;  // a multiple of 8: vectors are all in or all out
    Element* out = params_.out + int64_t(first_row) * params_.ldout + tile.expert * params_.group_stride + first_out_col;

    CUTLASS_PRAGMA_UNROLL
    for (int slice = 0; slice < kTileN / (kCols * kPack); ++slice) {
      const int slice_col = slice * kCols;  // of out, in the tile
      cutlass::arch::NamedBarrier::sync(kThreads, consumer_);  // the previous slice has been read out
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); i += 2) {
        const int row = get<0>(coords(i));
        const int col = get<1>(coords(i)) - slice_col * kPack;  // coords(i + 1) is (row, col + 1)
        if (col >= 0 && col < kCols * kPack) {
          if constexpr (kPack == 1) {
            *reinterpret_cast<cutlass::Array<Element, 2>*>(staging_ + row * kPitch + col) =
                fusion.visit({accum(i), accum(i + 1)}, first_row + row, first_col + slice_col + col);
          } else {
            staging_[row * kPitch + col / 2] = Element(accum(i));
          }
        }
      }
      cutlass::arch::NamedBarrier::sync(kThreads, consumer_);
      CUTLASS_PRAGMA_UNROLL
      for (int v = thread_; v < kRows * kVectorsPerRow; v += kThreads) {
        const int row = v / kVectorsPerRow;
        const int col = v % kVectorsPerRow * kVector;
        if (row < rows_left && slice_col + col < cols_left) {
          *reinterpret_cast<uint4*>(out + int64_t(row) * params_.ldout + slice_col + col) =
              *reinterpret_cast<uint4 const*>(staging_ + row * kPitch + col);
        }
      }
    }
  }

  Params const& params_;
  Element* staging_;
  int consumer_;
  int thread_;
};

// The cooperative tiles' staging for TMA stores: the two consumers split each kTileM x kTileN tile
// by rows, kRows each. Per consumer, kBuffers slices of kRows x kStoreCols in the 128-byte swizzle
// TMA reads (the fragment writes, 8 rows x 16 bytes per warp, land in 8 different bank groups).
// A slice's buffer is written while earlier slices are still being stored, and waited for only
// when it comes round again (kBuffers slices later, possibly in a later tile).
//
// Fragment coordinates: the thread's offset plus the value's offset (cute layouts are linear in
// thread and value); the value offsets are thread 0's coordinates, compile-time constants once the
// loops unroll. In the GMMA accumulator layout a thread's offset is < 8 in columns
// (2 x (thread % 4)), thread 0's values sit in rows 0 and 8 and in columns 8j, 8j + 1, so a value's
// row mod 8 is the thread's. With kChunk elements per 16-byte chunk, the swizzled element offset,
// row * kStoreCols + ((chunk ^ row % 8) * kChunk) + column % kChunk (SmemLayout), then costs one XOR
// per store, with no per-value index math kept in registers (cute's generic swizzled indexing
// spills here).
template <class Element, class TiledMma, int kTileM, int kTileN, int kBuffers>
class CooperativeSliceStaging {
 public:
  static constexpr int kConsumers = 2;
  static constexpr int kRows = kTileM / kConsumers;
  static constexpr int kStoreCols = 128 / static_cast<int>(sizeof(Element));  // one 128-byte swizzle row
  static constexpr int kChunk = 16 / static_cast<int>(sizeof(Element));       // elements per 16 bytes
  static constexpr int kSlices = kTileN / kStoreCols;
  static_assert(kTileN % kStoreCols == 0);
  static_assert(kChunk <= 8, "a thread's column offset (< 8) spans whole 16-byte chunks");

  using SmemLayout = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                  cute::Shape<cute::Int<kRows>, cute::Int<kStoreCols>>{}));
  using Buffer = cute::array_aligned<Element, kRows * kStoreCols, 1024>;
  struct SharedStorage {
    Buffer buffer[kConsumers][kBuffers];
  };

  // `consumer` is the warp group's index among the consumers, `mma_thread` the thread's index in the
  // two consumers' tiled MMA (0..255), `thread` its index in its own warp group; the consumer's
  // named barrier is `consumer`.
  CUTLASS_DEVICE CooperativeSliceStaging(SharedStorage& storage, int consumer, int mma_thread, int thread)
      : buffers_(storage.buffer[consumer]), consumer_(consumer), thread_(thread) {
    using namespace cute;
    TiledMma tiled_mma;
    auto identity = make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{}));
    const auto offset0 = tiled_mma.get_thread_slice(0).partition_C(identity)(0);
    const auto coord = tiled_mma.get_thread_slice(mma_thread).partition_C(identity)(0);
    thread_row_ = get<0>(coord) - get<0>(offset0) - consumer * kRows;
    thread_col_ = get<1>(coord) - get<1>(offset0);
  }

  // The thread's index in its warp group.
  CUTLASS_DEVICE int thread() const { return thread_; }
  // The thread's first row in its consumer's part and first column, to add to value offsets.
  CUTLASS_DEVICE int thread_row() const { return thread_row_; }
  CUTLASS_DEVICE int thread_col() const { return thread_col_; }

  // Stages slice `slice` (output columns [slice * kStoreCols, +kStoreCols)) of the consumer's
  // part of the tile, from values given per accumulator pair (i even: accumulators i and i + 1,
  // which sit at (row, col), (row, col + 1) of the consumer's part). kPack == 1: value(i, row, col)
  // returns the pair's two outputs. kPack == 2 (gated): each pair is one output, value(i, row, col)
  // returns it, and the slice covers 2 kStoreCols accumulator columns. Then thread 0 of the
  // consumer calls issue(sD) on the staged slice, to start its TMA store and commit it as one bulk
  // group. kParts == 2: the slice is staged in two calls, part 0 then part 1, each writing the pairs
  // of one half of the rows (a value's row mod 16 below 8, then the others: each thread's two
  // rows), so that a deferred gated tile spreads its kSlices / 2 slices over kSlices K blocks as a
  // plain tile does; part 0 takes the buffer, part 1 issues the store. The writes are one 32-bit
  // store per pair: stmatrix (write()'s kMatrices) needs a register more than the forward's
  // cooperative consumers' 168 and spills there.
  template <int kPack, int kParts, class Value, class Issue>
  CUTLASS_DEVICE void stage(int slice, int part, Value&& value, Issue&& issue) {
    using namespace cute;
    constexpr int kThreads = cutlass::NumThreadsPerWarpGroup;
    // Buffers alternate over the consumer's whole sequence of slices, across tiles: a tile may
    // store an odd number of slices (N's last tile), and restarting at buffer 0 would then
    // overwrite a buffer whose store the wait below lets run on.
    if (part == 0) {
      next_buffer_ = (next_buffer_ + 1) % kBuffers;
      if (thread_ == 0) tma_store_wait<kBuffers - 1>();  // this buffer's last store has read it
      cutlass::arch::NamedBarrier::sync(kThreads, consumer_);
    }
    Element* buffer = buffers_[(next_buffer_ + kBuffers - 1) % kBuffers].data();
    write<kPack, /*kMatrices=*/false, kParts>(buffer, slice, part, value);
    if (part == kParts - 1) {
      tma_store_fence();  // these shared memory writes are visible to the TMA (async proxy)
      cutlass::arch::NamedBarrier::sync(kThreads, consumer_);
      if (thread_ == 0) {
        issue(make_tensor(make_smem_ptr(buffer), SmemLayout{}));
        tma_store_arrive();
      }
    }
  }

  // stage()'s shared memory writes alone, into `buffer` (one of buffer(i)): for a kernel that hands
  // the staged slice to another warp to store (the wgrad's store warps) instead of storing it here.
  // kMatrices (16-bit outputs, kPack == 1): through stmatrix, four pairs per instruction, instead of
  // one 32-bit store per pair; the wgrad takes it (about 1% faster, benchmarks/NOTES.md).
  template <int kPack, bool kMatrices, int kParts, class Value>
  CUTLASS_DEVICE void write(Element* buffer, int slice, int part, Value&& value) {
    static_assert(!kMatrices || (kPack == 1 && sizeof(Element) == 2), "stmatrix stages 16-bit pairs");
    static_assert(kParts == 1 || (kParts == 2 && !kMatrices), "row halves: the per-pair stores only");
    using namespace cute;
    TiledMma tiled_mma;
    Tensor offsets = tiled_mma.get_thread_slice(0).partition_C(
        make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{})));
    const int slice_col = slice * kStoreCols;
    if constexpr (kMatrices) {
      stage_matrices(offsets, slice_col, buffer, value);
    } else {
      // Opaque to the compiler here, so that it computes the stores' offsets at each slice instead of
      // keeping up to 16 of them in registers across the kernel's mainloop (the cooperative kernel
      // stages slices while its next tile's MMAs run, where registers are short).
      int swizzle = (thread_row_ % 8) ^ (thread_col_ / kChunk);
      int thread_offset = thread_row_ * kStoreCols + thread_col_ % kChunk;
      asm volatile("" : "+r"(swizzle), "+r"(thread_offset));
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(offsets); i += 2) {
        const int row = get<0>(offsets(i));
        const int col = get<1>(offsets(i)) - slice_col * kPack;  // offsets(i + 1) is (row, col + 1)
        if (col >= 0 && col < kStoreCols * kPack && (kParts == 1 || (row % 16 >= 8) == (part == 1))) {
          if constexpr (kPack == 1) {
            const int offset = thread_offset + row * kStoreCols + (((col / kChunk) ^ swizzle) * kChunk);
            *reinterpret_cast<cutlass::Array<Element, 2>*>(buffer + offset) =
                value(i, thread_row_ + row, slice_col + col + thread_col_);
          } else {
            // The pair's output column is (col + thread_col_) / 2: col / 2 is a multiple of 4 (values
            // sit at columns 8j, 8j + 1) and thread_col_ / 2 < 4, so the sum stays in col / 2's chunk.
            static_assert(kChunk == 8, "a gated pair's column offset (< 4) stays inside its 8-element chunk");
            const int out_col = col / 2;
            const int offset = thread_offset - thread_col_ % kChunk + row * kStoreCols +
                               (((out_col / kChunk) ^ swizzle) * kChunk) + out_col % kChunk + thread_col_ / 2;
            buffer[offset] = value(i, thread_row_ + row, slice_col + out_col + thread_col_ / 2);
          }
        }
      }
    }
  }

  CUTLASS_DEVICE Element* buffer(int i) const { return buffers_[i].data(); }

  // Before the kernel ends: shared memory must stay until the stores have read it.
  CUTLASS_DEVICE void wait_all() {
    if (thread_ == 0) cute::tma_store_wait<0>();
  }

 private:
  // stage()'s stores through stmatrix.x4. In the GMMA accumulator layout, pairs i, i + 2, i + 4 and
  // i + 6 (i a multiple of 8) are the thread's words of four 8x8 matrices: rows +0 and +8 of column
  // group j (even), then of group j + 1, all in one slice. Lane l gives the address of row l % 8 of
  // matrix l / 8, in the 128-byte swizzle: 16-byte chunk (j + l / 16) XOR (row mod 8), where the row
  // mod 8 is l % 8 (a warp's rows and an M atom's start at multiples of 16).
  template <class Offsets, class Value>
  CUTLASS_DEVICE void stage_matrices(Offsets const& offsets, int slice_col, Element* buffer, Value& value) {
    using namespace cute;
    const int lane = thread_ % 32;
    const int warp_row = thread_row_ - lane / 4;  // the warp's first row in the consumer's part
    int lane_offset = (warp_row + (lane / 8) % 2 * 8 + lane % 8) * kStoreCols;
    int lane_chunk = lane / 16;
    int swizzle = lane % 8;
    asm volatile("" : "+r"(lane_offset), "+r"(lane_chunk), "+r"(swizzle));  // as in stage()'s other path
    auto word = [&](int i) {
      const auto pair = value(i, thread_row_ + get<0>(offsets(i)), get<1>(offsets(i)) + thread_col_);
      return reinterpret_cast<uint32_t const&>(pair);
    };
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(offsets); i += 8) {
      const int col = get<1>(offsets(i)) - slice_col;  // thread 0's column of group j
      if (col >= 0 && col < kStoreCols) {
        const int offset =
            lane_offset + get<0>(offsets(i)) * kStoreCols + (((col / kChunk + lane_chunk) ^ swizzle) * kChunk);
        SM90_U32x4_STSM_N::copy(word(i), word(i + 2), word(i + 4), word(i + 6),
                                *reinterpret_cast<uint128_t*>(buffer + offset));
      }
    }
  }

  Buffer* buffers_;
  int next_buffer_ = 0;  // the buffer of the consumer's next slice
  int consumer_;
  int thread_;
  int thread_row_;
  int thread_col_;
};

// A finished tile held for deferred stores (both sm90 MoE kernels' cooperative tiles): its 16-bit
// outputs wait in registers, one 32-bit word per accumulator pair (make_registers, pack, unpack),
// and its slices are stored while the next tile's K blocks run (store). Which tile is held and
// whether slices of it are left live here.
template <class Element, int kSlices>
class HeldTile {
 public:
  using Pair = cutlass::Array<Element, 2>;

  template <class Accumulators>
  CUTLASS_DEVICE static auto make_registers(Accumulators const&) {
    using namespace cute;
    static_assert(sizeof(Pair) == sizeof(uint32_t), "two 16-bit outputs per register");
    return make_tensor<uint32_t>(Int<decltype(size(Accumulators{}))::value / 2>{});
  }
  CUTLASS_DEVICE static uint32_t pack(Pair const& pair) { return reinterpret_cast<uint32_t const&>(pair); }
  CUTLASS_DEVICE static Pair unpack(uint32_t word) { return reinterpret_cast<Pair const&>(word); }

  // From now on `tile` is held, with all its slices left. The previous one must have been stored.
  CUTLASS_DEVICE void hold(MoeTile const& tile) {
    tile_ = tile;
    pending_ = true;
  }
  CUTLASS_DEVICE MoeTile const& tile() const { return tile_; }

  // Calls store_slice(slice) for slice `first` of the held tile, and with `rest` for every slice
  // after it, if a tile is held; once its last slice is stored, none is. `first` is a run-time
  // index: the unrolled loop gives each slice its own code, with its registers and columns known
  // at compile time.
  template <class StoreSlice>
  CUTLASS_DEVICE void store(int first, bool rest, StoreSlice&& store_slice) {
    if (!pending_) return;
    CUTLASS_PRAGMA_UNROLL
    for (int slice = 0; slice < kSlices; ++slice) {
      if (slice == first || (rest && slice > first)) store_slice(slice);
    }
    if (rest || first == kSlices - 1) pending_ = false;
  }

 private:
  MoeTile tile_{};
  bool pending_ = false;  // whether the held tile has slices left to store
};

// Cooperative MoE tiles: each consumer stores its rows of the tile through the ragged view of out,
// two slices in flight. The stores may be deferred, so that the tensor cores do not wait for them:
//   - hold() turns a finished tile's accumulators into its outputs, in registers (`held`, in the
//     accumulators' layout), which frees the accumulators for the next tile;
//   - store_slice(k, held) stages and stores slice k of the held tile; the kernel calls it right
//     after issuing each of the next tile's first kSlices K blocks, so slice k is written while K
//     block k's WGMMAs run;
//   - store_all(held) stores every slice of the consumer's last held tile.
// A gated tile has half as many slices, and stores each in two steps, one row half per K block, so
// that its stores spread over as many K blocks as a plain tile's: a whole gated slice per K block
// outlasted the block's WGMMAs (2% more cycles on qwen3-30b's gated projection, benchmarks/NOTES.md).
// Where the kernel does not defer, store(tile, accum) stores each tile straight from its
// accumulators after its mainloop.
template <class Element, class TiledMma, int kTileM, int kTileN, class Fusion>
class CooperativeTmaStoreEpilogue {
 public:
  using Staging = CooperativeSliceStaging<Element, TiledMma, kTileM, kTileN, /*kBuffers=*/2>;
  static constexpr int kRows = Staging::kRows;
  static constexpr int kStoreCols = Staging::kStoreCols;
  static constexpr int kSlices = Staging::kSlices;  // per tile (a gated tile: half as many, two steps each)
  using Store = RaggedStore<Element, kRows, typename Staging::SmemLayout>;
  using SharedStorage = typename Staging::SharedStorage;

  struct Arguments {
    Element* ptr_out;
    int64_t ldout;
    bool gated;  // out has N/2 columns (kernel's FusedEpilogue)
    typename Fusion::Arguments fusion;
  };
  struct Params {
    typename Store::Tma tma_store;  // out: view_rows x view_cols
    int out_cols;                   // N, or N/2 when gated
    int view_rows;                  // T, or an interleaved group's rows
    int view_cols;                  // out_cols, or every interleaved group's columns
    int64_t group_stride;           // interleaved groups: between the groups' first columns; else 0
    bool gated;
    typename Fusion::Params fusion;
  };

  static Params to_underlying_arguments(MoeProblemShape const& problem, MoeGroupLayout const& groups,
                                        Arguments const& args, int device) {
    const int out_cols = args.gated ? problem.n / 2 : problem.n;
    const int view_rows = groups.view_rows(problem.num_tokens);
    const int view_cols = groups.out_view_cols(out_cols, problem.num_experts);
    return {Store::make(view_rows, view_cols, args.ptr_out, args.ldout, device), out_cols, view_rows, view_cols,
            groups.out_group_stride, args.gated, Fusion::to_underlying_arguments(args.fusion)};
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_store.get_tma_descriptor());
  }

  CUTLASS_DEVICE CooperativeTmaStoreEpilogue(Params const& params, SharedStorage& storage, int consumer,
                                             int mma_thread, int thread)
      : params_(params), staging_(storage, consumer, mma_thread, thread), consumer_(consumer) {
    check_supported_fusion<Fusion>();
  }

  // The registers hold() fills (Held::make_registers): one 32-bit word per accumulator pair,
  // holding the pair's two outputs (a gated tile: its one output, in the low half).
  using Held = HeldTile<Element, kSlices>;

  // Takes `tile`'s outputs out of the accumulators: the fusion's values, or for a gated tile each
  // pair's combined first value (the kernel's FusedEpilogue has made it). Every slice of the
  // previous held tile must have been stored. With `scaled` (a plain tile's), each accumulator pair
  // i / 2 is multiplied by row_scales[i / 2], its row's factor, as it is converted.
  template <class Accumulators, class Registers, int kScales>
  CUTLASS_DEVICE void hold(MoeTile const& tile, Accumulators const& accum, Registers& held,
                           float const (&row_scales)[kScales], bool scaled) {
    using namespace cute;
    Tensor offsets = TiledMma{}.get_thread_slice(0).partition_C(
        make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{})));
    static_assert(decltype(size(offsets))::value == decltype(size(accum))::value);
    static_assert(2 * decltype(size(held))::value == decltype(size(accum))::value);
    cutlass::Array<Element, 2> out;
    if (params_.gated) {
      out[1] = Element(0.f);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); i += 2) {
        out[0] = Element(accum(i));
        held(i / 2) = Held::pack(out);
      }
    } else {
      static_assert(kScales == decltype(size(held))::value, "a factor per accumulator pair");
      with_fused_values(tile, accum, row_scales, scaled, [&](auto const& value) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); i += 2) {
          out = value(i, staging_.thread_row() + get<0>(offsets(i)), staging_.thread_col() + get<1>(offsets(i)));
          held(i / 2) = Held::pack(out);
        }
      });
    }
    held_.hold(tile);
  }

  // Stores slice k of the held tile, if it has one; after the last slice, no tile is held.
  template <class Registers>
  CUTLASS_DEVICE void store_slice(int k, Registers const& held) {
    held_.store(k, /*rest=*/false, [&](int slice) { store_slice_of(slice, held); });
  }

  // Stores every slice of the held tile, if there is one; then none is held.
  template <class Registers>
  CUTLASS_DEVICE void store_all(Registers const& held) {
    held_.store(0, /*rest=*/true, [&](int slice) { store_slice_of(slice, held); });
  }

  // Stores `tile` straight from its accumulators, slice after slice (where the kernel does not
  // defer): the fusion's values, or a gated tile's combined first values. With `scaled` (a plain
  // tile's), each pair i / 2 is multiplied by row_scales[i / 2] as in hold().
  template <class Accumulators, int kScales>
  CUTLASS_DEVICE void store(MoeTile const& tile, Accumulators const& accum, float const (&row_scales)[kScales],
                            bool scaled) {
    if (params_.gated) {
      CUTLASS_PRAGMA_UNROLL
      for (int slice = 0; slice < kSlices / 2; ++slice) {
        store_slice_from<2>(tile, slice, 0, [&](int i, int, int) { return Element(accum(i)); });
      }
    } else {
      with_fused_values(tile, accum, row_scales, scaled, [&](auto const& value) {
        CUTLASS_PRAGMA_UNROLL
        for (int slice = 0; slice < kSlices; ++slice) store_slice_from<1>(tile, slice, 0, value);
      });
    }
  }

  CUTLASS_DEVICE void store_tail() { staging_.wait_all(); }

 private:
  // Step `step` (0 .. kSlices - 1, one per hooked K block) of the held tile: slice `step`, or for
  // a gated tile, which has half as many slices, row half step % 2 of slice step / 2.
  template <class Registers>
  CUTLASS_DEVICE void store_slice_of(int step, Registers const& held) {
    if (params_.gated) {
      static_assert(kSlices % 2 == 0, "a gated tile's slices in two steps each");
      store<2, 2>(step / 2, step % 2, held);
    } else {
      store<1, 1>(step, 0, held);
    }
  }

  // Calls use(value) with the fusion's values (fused_values), each pair i / 2 multiplied by
  // row_scales[i / 2] where `scaled`: hold()'s and store()'s two forms, each unrolled on its own.
  template <class Accumulators, int kScales, class Use>
  CUTLASS_DEVICE void with_fused_values(MoeTile const& tile, Accumulators const& accum,
                                        float const (&row_scales)[kScales], bool scaled, Use&& use) const {
    if (scaled) {
      use(fused_values(tile, accum, [&](int i) { return row_scales[i / 2]; }));
    } else {
      use(fused_values(tile, accum));
    }
  }

  // The fusion's outputs of `tile`'s accumulators, as value(i, row, col) for the pair i at (row, col)
  // of the consumer's part (CooperativeSliceStaging::stage's form).
  // scale_of(i): the factor of pair i's row (the row scale of hold() and store()); One: none.
  struct One {};
  template <class Accumulators, class ScaleOf = One>
  CUTLASS_DEVICE auto fused_values(MoeTile const& tile, Accumulators const& accum, ScaleOf scale_of = {}) const {
    Fusion fusion(params_.fusion);
    fusion.begin_tile(tile.expert);
    return [fusion, &accum, scale_of, row_start = part_row_start(tile), first_col = tile.n_tile * kTileN](
               int i, int row, int col) {
      if constexpr (std::is_same_v<ScaleOf, One>) {
        return fusion.visit({accum(i), accum(i + 1)}, row_start + row, first_col + col);
      } else {
        const float scale = scale_of(i);
        return fusion.visit({accum(i) * scale, accum(i + 1) * scale}, row_start + row, first_col + col);
      }
    };
  }

  // The row of out where this consumer's part of `tile` starts (its rows [consumer * kRows, +kRows)).
  CUTLASS_DEVICE int part_row_start(MoeTile const& tile) const {
    return tile.row_start + tile.m_tile * kTileM + consumer_ * kRows;
  }

  // Stores slice `slice` of the held tile, or with kParts == 2 its row half `part`.
  template <int kPack, int kParts, class Registers>
  CUTLASS_DEVICE void store(int slice, int part, Registers const& held) {
    store_slice_from<kPack, kParts>(held_.tile(), slice, part, [&](int i, int, int) {
      const auto pair = Held::unpack(held(i / 2));
      if constexpr (kPack == 1) {
        return pair;
      } else {
        return pair[0];
      }
    });
  }

  // Stores slice `slice` of the consumer's rows [consumer * kRows, +kRows) of `tile`, clipped to the
  // expert's rows and to out's columns by the ragged view, with one TMA copy; value(i, row, col) as
  // in CooperativeSliceStaging::stage. kPack accumulator columns per output column: 1, or 2 for a
  // gated tile. Interleaved groups: the view holds every group's columns, so a group's own columns
  // end on a slice boundary (a multiple of 64, checked on the host) and no slice reaches the next
  // group. kParts == 2: row half `part` of the slice, the store issued with part 1
  // (CooperativeSliceStaging::stage).
  template <int kPack, int kParts = 1, class Value>
  CUTLASS_DEVICE void store_slice_from(MoeTile const& tile, int slice, int part, Value&& value) {
    using namespace cute;
    const int rows = min(int{kRows}, tile.rows - tile.m_tile * kTileM - consumer_ * kRows);
    const int first_col = tile.n_tile * kTileN / kPack;  // of out (of the expert's group)
    // No rows of the expert in this part (and no box wholly outside the view), or no columns of out
    // left: the same for the whole consumer.
    if (rows <= 0 || slice * kStoreCols >= params_.out_cols - first_col) return;
    const int row_start = part_row_start(tile);
    // The box at (kRows - rows, col, row_start + rows) of the ragged view holds out[row_start, +rows)
    // in its first rows; its other rows are outside the view, and TMA does not write them.
    // Interleaved groups: the group's columns start at expert * group_stride of the view.
    Tensor mD = params_.tma_store.get_tma_tensor(make_shape(int{kRows}, params_.view_cols, params_.view_rows + 1));
    const int view_col = static_cast<int>(tile.expert * params_.group_stride) + first_col;
    Tensor gD = domain_offset(make_coord(kRows - rows, view_col, row_start + rows), mD)(_, _, 0);
    auto tma_store = params_.tma_store.get_slice(Int<0>{});
    staging_.template stage<kPack, kParts>(slice, part, value, [&](auto const& sD) {
      Tensor gD_slice = local_tile(gD, Shape<Int<kRows>, Int<kStoreCols>>{}, make_coord(0, slice));
      copy(params_.tma_store, tma_store.partition_S(sD), tma_store.partition_D(gD_slice));
    });
  }

  Params const& params_;
  Staging staging_;
  int consumer_;
  Held held_;  // deferred stores: the held tile
};

}  // namespace cutlass_moe::sm90
