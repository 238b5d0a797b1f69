// Persistent tile scheduler of the MoE families (sm90 and sm80): it sees only tokens_per_expert, T
// and the tile grid, and finds each tile's expert, row offset and row count on the device.
//
// Tiles are numbered expert-major; inside an expert, m (rows) runs fastest, then n (the weight
// gradient may ask for n first: Params::n_fastest). CTA c of a grid of G takes tiles c, c + G,
// c + 2G, ...; at any moment the whole grid works on one run of consecutive tiles, i.e. on one or
// two experts, so CTAs that read the same weight columns run together and the weights are read from
// DRAM about once (L2 reuse).
//
// Each role (the producer warp, each consumer warp) walks the experts itself, 32 at a time: lane l
// reads expert base + l's count, and two warp-wide inclusive scans give every lane its expert's
// row start and its running tile total (the CUTLASS sm90 group scheduler's scheme). Tile indices
// only grow, so the window only moves forward: O(E / 32) scans per role over the whole kernel.
//
// Counts are clamped by expert_rows.hpp's rule, so no count vector places a tile outside x or out.
//
// Interleaved groups (MoeGemmProblem::group_rows, the forward only): with no count vector, every
// expert has `group_rows` rows, each starting at row 0 of its own group (row_start 0); the kernel
// finds the group's columns from the expert.
//
// How many row tiles an expert has is the RowTiles policy: the forward tiles the expert's rows
// (RaggedRowTiles); the weight gradient tiles dW[e], whose size does not depend on the count
// (FixedRowTiles), and the count is the tile's reduction length instead.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cutlass/cutlass.h>

#include "expert_rows.hpp"

namespace cutlass_moe {

struct MoeTile {
  int expert;
  int m_tile;     // tile row inside the expert (the forward's rows; dW[e]'s rows in the wgrad)
  int n_tile;
  int row_start;  // first row of x / out the expert owns
  int rows;       // rows the expert owns (forward: > m_tile * kTileM; wgrad: the reduction length)
  bool valid;
};

// Row tiles that cover an expert's `rows` (rows + kTileM - 1 fits in an int: T <= kMaxTokens).
template <int kTileM>
struct RaggedRowTiles {
  CUTLASS_HOST_DEVICE int operator()(int rows) const { return (rows + kTileM - 1) / kTileM; }
};

// The same row tiles for every expert, whatever its rows.
struct FixedRowTiles {
  int tiles;
  CUTLASS_HOST_DEVICE int operator()(int /*rows*/) const { return tiles; }
};

template <class RowTiles>
class ExpertTileScheduler {
 public:
  struct Params {
    const void* tokens_per_expert;
    bool counts_are_int64;
    int num_experts;
    int num_tokens;
    int tiles_n;
    RowTiles row_tiles;
    int group_rows = 0;  // tokens_per_expert null: interleaved groups of this many rows each
    bool n_fastest = false;  // FixedRowTiles only: inside an expert, n runs fastest, then m
  };

  CUTLASS_DEVICE explicit ExpertTileScheduler(Params const& params)
      : params_(params), lane_(threadIdx.x % 32) {
    load_window(0, 0, 0);
  }

  // The tile with linear index `index`; indices passed in must not decrease.
  CUTLASS_DEVICE MoeTile tile(int64_t index) {
    if constexpr (std::is_same_v<RowTiles, FixedRowTiles>) {
      return fixed_tile(index);
    } else {
      return ragged_tile(index);
    }
  }

  // Where the owned rows end, min(sum of clamped counts, T): valid once tile() has returned an
  // invalid tile (the walk has then loaded the window of the last expert; RaggedRowTiles). The whole
  // warp calls it.
  CUTLASS_DEVICE int owned_rows_end() const { return __shfl_sync(0xffffffff, row_start_ + rows_, 31); }

  // How many tiles there are; valid, as owned_rows_end(), once tile() has returned an invalid tile
  // (RaggedRowTiles).
  CUTLASS_DEVICE int64_t total_tiles() const {
    return window_first_tile_ + __shfl_sync(0xffffffff, tiles_incl_, 31);
  }

 private:
  // RaggedRowTiles: the walk counts each expert's tiles to find the one holding `index`.
  CUTLASS_DEVICE MoeTile ragged_tile(int64_t index) {
    while (true) {
      const int64_t window_tiles = __shfl_sync(0xffffffff, tiles_incl_, 31);
      if (index < window_first_tile_ + window_tiles) break;
      if (window_base_ + 32 >= params_.num_experts) return MoeTile{0, 0, 0, 0, 0, false};
      const int64_t rows_next = __shfl_sync(0xffffffff, row_start_ + rows_, 31);
      load_window(window_base_ + 32, window_first_tile_ + window_tiles, rows_next);
    }
    const int64_t local = index - window_first_tile_;
    const uint32_t hit = __ballot_sync(0xffffffff, tiles_incl_ > local);
    const int lane = __ffs(hit) - 1;
    const int64_t tiles_incl = __shfl_sync(0xffffffff, tiles_incl_, lane);
    const int row_start = __shfl_sync(0xffffffff, row_start_, lane);
    const int rows = __shfl_sync(0xffffffff, rows_, lane);
    const int m_tiles = params_.row_tiles(rows);
    const int64_t in_expert = local - (tiles_incl - int64_t(m_tiles) * params_.tiles_n);
    MoeTile t;
    t.expert = window_base_ + lane;
    t.m_tile = static_cast<int>(in_expert % m_tiles);
    t.n_tile = static_cast<int>(in_expert / m_tiles);
    t.row_start = params_.tokens_per_expert == nullptr ? 0 : row_start;  // interleaved: the group's row 0
    t.rows = rows;
    t.valid = true;
    return t;
  }

  // FixedRowTiles: every expert has the same tiles, so the tile's expert follows from its index
  // alone, and the walk only finds that expert's rows (row_start, and rows as the reduction length).
  CUTLASS_DEVICE MoeTile fixed_tile(int64_t index) {
    const int m_tiles = params_.row_tiles(0);
    const int64_t per_expert = int64_t(m_tiles) * params_.tiles_n;
    const int64_t expert = index / per_expert;
    if (expert >= params_.num_experts) return MoeTile{0, 0, 0, 0, 0, false};
    const int in_expert = static_cast<int>(index - expert * per_expert);
    while (expert >= window_base_ + 32) {
      const int64_t rows_next = __shfl_sync(0xffffffff, row_start_ + rows_, 31);
      load_window(window_base_ + 32, 0, rows_next);
    }
    const int lane = static_cast<int>(expert) - window_base_;
    MoeTile t;
    t.expert = static_cast<int>(expert);
    t.m_tile = params_.n_fastest ? in_expert / params_.tiles_n : in_expert % m_tiles;
    t.n_tile = params_.n_fastest ? in_expert % params_.tiles_n : in_expert / m_tiles;
    t.row_start = __shfl_sync(0xffffffff, row_start_, lane);
    t.rows = __shfl_sync(0xffffffff, rows_, lane);
    t.valid = true;
    return t;
  }

  template <class T>
  CUTLASS_DEVICE static T warp_inclusive_sum(T value, int lane) {
    CUTLASS_PRAGMA_UNROLL
    for (int offset = 1; offset < 32; offset *= 2) {
      T other = __shfl_up_sync(0xffffffff, value, offset);
      if (lane >= offset) value += other;
    }
    return value;
  }

  // Experts [base, base + 32): rows_before = clamped rows of the experts before base.
  CUTLASS_DEVICE void load_window(int base, int64_t first_tile, int64_t rows_before) {
    window_base_ = base;
    window_first_tile_ = first_tile;
    const int expert = base + lane_;
    const bool interleaved = params_.tokens_per_expert == nullptr;
    int64_t count = 0;
    if (expert < params_.num_experts) {
      if (interleaved) {
        count = params_.group_rows;
      } else {
        count = params_.counts_are_int64 ? static_cast<const int64_t*>(params_.tokens_per_expert)[expert]
                                         : static_cast<const int32_t*>(params_.tokens_per_expert)[expert];
      }
      count = clamp_count(count, params_.num_tokens);
    }
    const int64_t incl = warp_inclusive_sum(count, lane_);
    const ExpertRows r = expert_rows(rows_before + incl - count, count, params_.num_tokens);
    row_start_ = static_cast<int>(r.start);
    rows_ = static_cast<int>(r.rows);
    // Lanes past the last expert have no tiles (FixedRowTiles would give them some).
    const int64_t tiles = expert < params_.num_experts ? int64_t(params_.row_tiles(rows_)) * params_.tiles_n : 0;
    tiles_incl_ = warp_inclusive_sum(tiles, lane_);
  }

  Params params_;
  int lane_;
  int window_base_ = 0;
  int64_t window_first_tile_ = 0;
  // This lane's expert (window_base_ + lane_):
  int row_start_ = 0;
  int rows_ = 0;
  int64_t tiles_incl_ = 0;  // tiles of the window's experts up to and including this lane's
};

// The forward's scheduler: row tiles of kTileM rows of the expert's rows.
template <int kTileM>
using MoeTileScheduler = ExpertTileScheduler<RaggedRowTiles<kTileM>>;

// The most tiles any count vector can make: each expert adds at most one partial row tile.
inline int64_t most_tiles(int64_t num_tokens, int64_t num_experts, int64_t tiles_n, int tile_m) {
  return ((num_tokens + tile_m - 1) / tile_m + num_experts) * tiles_n;
}

// CTAs of a persistent MoE kernel: `slots` CTAs (SMs x CTAs per SM), or fewer when there are fewer
// tiles.
inline int persistent_grid(int64_t slots, int64_t num_tokens, int64_t num_experts, int64_t tiles_n, int tile_m) {
  const int64_t max_tiles = most_tiles(num_tokens, num_experts, tiles_n, tile_m);
  return static_cast<int>(max_tiles < slots ? max_tiles : slots);
}

}  // namespace cutlass_moe
