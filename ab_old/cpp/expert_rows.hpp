// The one rule that turns tokens_per_expert into the rows each expert owns. Every kernel (the MoE
// tile scheduler, the grouped families' argument builder, the K == 0 zero fill) and the host-side
// mirror that the Python tests compare with the reference (expert_row_ranges in moe_gemm.cpp) call
// these functions; cutlass_moe.h states the rule:
//   count'[e] = clamp(tokens_per_expert[e], 0, T)
//   start[e]  = min(count'[0] + ... + count'[e-1], T)
//   rows[e]   = min(count'[e], T - start[e])
// so no count vector places a row outside [0, T).
#pragma once

#include <cstdint>

#include <cutlass/cutlass.h>

namespace cutlass_moe {

struct ExpertRows {
  int64_t start;  // first row of x and out the expert owns
  int64_t rows;   // how many
};

// A raw count, clamped to [0, T].
CUTLASS_HOST_DEVICE int64_t clamp_count(int64_t count, int64_t num_tokens) {
  return count < 0 ? 0 : (count > num_tokens ? num_tokens : count);
}

// The rows of an expert whose clamped count is `count`, after experts whose clamped counts sum to
// `rows_before` (any value >= 0 whose min with T is the true sum's: a running sum capped at T works).
CUTLASS_HOST_DEVICE ExpertRows expert_rows(int64_t rows_before, int64_t count, int64_t num_tokens) {
  const int64_t start = rows_before < num_tokens ? rows_before : num_tokens;
  return {start, count < num_tokens - start ? count : num_tokens - start};
}

}  // namespace cutlass_moe
