// SplitGate's rule (cutlass_moe.h), per count: a split of whole kAlignedSplitRows tiles has every
// count a multiple of the tile's rows, and some expert holding two tiles or more. The MoE kernel
// reduces these tests over its experts (sm90_moe_kernel.hpp, counts_aligned); the host mirror
// (split_of_whole_tiles, moe_gemm.cpp) folds them the same way for the Python bookkeeping
// (cutlass_moe.ops.runs_aligned_config). Counts are read raw, as the device reads them.
#pragma once

#include <cstdint>

#include <cutlass/cutlass.h>

#include "cutlass_moe/cutlass_moe.h"

namespace cutlass_moe {

CUTLASS_HOST_DEVICE bool count_in_whole_tiles(int64_t count) { return count % kAlignedSplitRows == 0; }

CUTLASS_HOST_DEVICE bool count_spans_two_tiles(int64_t count) { return count >= 2 * kAlignedSplitRows; }

}  // namespace cutlass_moe
