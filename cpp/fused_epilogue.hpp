// The MoE kernels' fused epilogue (MoeGemmProblem's bias, activation, row_scale and gated), on a
// thread's accumulators. Arch-neutral: the sm90 and sm80 MoE kernels call it with their own
// fragment layouts.
#pragma once

#include <cstdint>

#include <cute/container/tuple.hpp>
#include <cutlass/array.h>
#include <cutlass/cutlass.h>

#include "activations.hpp"
#include "cutlass_moe/cutlass_moe.h"

namespace cutlass_moe {

// The fused epilogue, out = row_scale[row] * act(acc + bias[e][col]) (gated: act(gate + bias) *
// (up + bias) from the accumulator pair (gate, up), into the pair's first value), applied to a
// tile's accumulators before the epilogue stores them, by both MoE kernels (sm90, sm80). A kernel
// gives it the thread's accumulators as accum(i) and their (row, column) in the tile as coords(i),
// a cute tuple whose value offsets are compile-time constants once the loops unroll. A launch without it pays one uniform branch
// per tile: the per-element work sits in its own unrolled loops, one per activation (a fragment
// indexed at run time would live in local memory), never in the epilogue's store loops (a
// per-element switch there once made every call 1.36x slower, benchmarks/NOTES.md). Two exceptions,
// in the sm90 cooperative tiles: they multiply a plain tile's rows by their scale as they convert
// the outputs (CooperativeTmaStoreEpilogue::hold and store) and skip apply() when the row scale is
// all there is (needs_pass_besides_row_scale); and a gated tile whose activation is its whole
// fusion (gated_alone) runs it in a loop of the kernel's own (MoeGemmKernel::cooperative_tile).
//
// Its per-row and per-column reads are unconditional (indices clamped into the tensors; the rows
// and columns past T and N belong to a partial tile and are never stored), so that the repeats in
// the unrolled loops (a thread's 128 values share 2 rows and 32 column pairs) have the same address
// in one basic block and fold into one load each (conditional loads did not fold: 128 loads of
// each per thread in the PTX). The row scales are loaded before the tile's mainloop (load), hiding
// their latency; the bias is prefetched into L1 then and read after it (32 more registers across
// the mainloop spill).
template <class Element>
struct FusedEpilogue {
  const Element* bias;  // E x N, row stride bias_stride (even, 4-byte aligned); null: none
  int64_t bias_stride;
  const float* row_scale;  // T factors; null: none
  int activation;          // Activation
  int num_tokens;
  int n;
  bool enabled;  // any part, gated included
  bool gated;    // columns (2j, 2j + 1) are (gate, up): the epilogue stores N/2 columns
  float alpha;   // Activation::kSwigluOai
  float limit;
  bool seed_bias = false;  // the kernel seeds the accumulators with the bias (seed); load and apply skip it
  // A gated launch whose whole per-element work is act(gate) * up (no bias left to add: none, or
  // seeded; no row scale): its activation, else kNone. Set on the host, so that the sm90 kernel's
  // test of it at each tile is one parameter read (its cooperative_tile).
  int gated_alone = 0;

  // Whether apply() has work other than the row scale: a bias not seeded, an activation, a gated pair.
  CUTLASS_DEVICE bool needs_pass_besides_row_scale() const {
    return (bias != nullptr && !seed_bias) || activation != static_cast<int>(Activation::kNone) || gated;
  }

  template <int kPairs>
  struct Operands {
    float scale[kPairs];  // of each accumulator pair's row
  };

  // coords: the thread's fragment coordinates (row, column) in the tile whose first row of out is
  // `first_row`.
  template <int kPairs, class Coords>
  CUTLASS_DEVICE Operands<kPairs> load(Coords const& coords, int expert, int first_row, int first_col) const {
    using cute::get;
    Operands<kPairs> operands;
    if (bias != nullptr && !seed_bias) {
      // Into L1 without registers: apply() reads them after the mainloop (TMA and cp.async.cg
      // bypass L1, so the lines stay).
      const Element* bias_row = bias + int64_t(expert) * bias_stride;
      CUTLASS_PRAGMA_UNROLL
      for (int p = 0; p < kPairs; ++p) {
        const Element* address = bias_row + min(first_col + int(get<1>(coords(2 * p))), n - 2);
        asm volatile("prefetch.global.L1 [%0];" : : "l"(address));
      }
    }
    if (row_scale != nullptr) {
      CUTLASS_PRAGMA_UNROLL
      for (int p = 0; p < kPairs; ++p) {
        operands.scale[p] = row_scale[min(first_row + int(get<0>(coords(2 * p))), num_tokens - 1)];
      }
    }
    return operands;
  }

  // Where the kernel seeds (seed_bias): the accumulators start as the bias of their columns, and
  // the mainloop adds the products onto them, so no pass over them is left for the bias.
  template <int kPairs, class Accumulators, class Coords>
  CUTLASS_DEVICE void seed(Accumulators& accum, Coords const& coords, int expert, int first_col) const {
    using cute::get;
    const Element* bias_row = bias + int64_t(expert) * bias_stride;
    CUTLASS_PRAGMA_UNROLL
    for (int p = 0; p < kPairs; ++p) {
      const int col = min(first_col + int(get<1>(coords(2 * p))), n - 2);  // even: a 4-byte pair
      const auto pair = *reinterpret_cast<cutlass::Array<Element, 2> const*>(bias_row + col);
      accum(2 * p) = float(pair[0]);
      accum(2 * p + 1) = float(pair[1]);
    }
  }

  // act(gate) * up on every (gate, up) pair (i, i + 1), i even, into the pair's first value; gpt-oss's
  // swiglu_oai with its alpha and clamp. apply()'s gated loop, and the sm90 kernel's own where the
  // activation is the whole fusion (gated_alone).
  template <Activation kActivation, int kValues, class Accumulators>
  CUTLASS_DEVICE void gated_pairs(Accumulators& accum) const {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kValues; i += 2) {
      if constexpr (kActivation == Activation::kSwigluOai) {
        accum(i) = swiglu_oai(accum(i), accum(i + 1), alpha, limit);
      } else {
        accum(i) = cutlass_moe::activate<kActivation>(accum(i)) * accum(i + 1);
      }
    }
  }

  // accum: the thread's fragment, 2 kPairs values accum(i) in (even column, odd column) pairs; the
  // tile's expert `expert`, its first column `first_col`. with_row_scale: false where the kernel
  // scales the rows as it converts the outputs (operands.scale then goes to the epilogue's hold()).
  template <class Accumulators, class Coords, int kPairs>
  CUTLASS_DEVICE void apply(Accumulators& accum, Coords const& coords, Operands<kPairs> const& operands, int expert,
                            int first_col, bool with_row_scale = true) const {
    using cute::get;
    if (bias != nullptr && !seed_bias) {
      const Element* bias_row = bias + int64_t(expert) * bias_stride;
      CUTLASS_PRAGMA_UNROLL
      for (int p = 0; p < kPairs; ++p) {
        const int col = min(first_col + int(get<1>(coords(2 * p))), n - 2);  // even: a 4-byte pair
        const auto pair = *reinterpret_cast<cutlass::Array<Element, 2> const*>(bias_row + col);
        accum(2 * p) += float(pair[0]);
        accum(2 * p + 1) += float(pair[1]);
      }
    }
    switch (static_cast<Activation>(activation)) {
      case Activation::kRelu: activate<Activation::kRelu, 2 * kPairs>(accum); break;
      case Activation::kGeluTanh: activate<Activation::kGeluTanh, 2 * kPairs>(accum); break;
      case Activation::kGelu: activate<Activation::kGelu, 2 * kPairs>(accum); break;
      case Activation::kSilu: activate<Activation::kSilu, 2 * kPairs>(accum); break;
      case Activation::kSwigluOai: gated_pairs<Activation::kSwigluOai, 2 * kPairs>(accum); break;  // gated only
      default: activate<Activation::kNone, 2 * kPairs>(accum); break;
    }
    if (row_scale != nullptr && with_row_scale) {
      CUTLASS_PRAGMA_UNROLL
      for (int p = 0; p < kPairs; ++p) {
        accum(2 * p) *= operands.scale[p];
        accum(2 * p + 1) *= operands.scale[p];
      }
    }
  }

 private:
  // act on every value, or (gated) act(gate) * up on every (gate, up) pair. The accumulator pairs
  // are (i, i + 1), i even: two adjacent columns, the first even.
  template <Activation kActivation, int kValues, class Accumulators>
  CUTLASS_DEVICE void activate(Accumulators& accum) const {
    if (gated) {
      gated_pairs<kActivation, kValues>(accum);
    } else if constexpr (kActivation != Activation::kNone) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kValues; ++i) accum(i) = cutlass_moe::activate<kActivation>(accum(i));
    }
  }
};

}  // namespace cutlass_moe
