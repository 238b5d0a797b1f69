// Picks a kernel configuration from what the host knows without reading the counts: the average
// rows per expert (T / E), N and K.
#include "cutlass_moe/cutlass_moe.h"

namespace cutlass_moe {

KernelConfig select_config(const MoeGemmProblem& problem, int /*device*/) {
  const int64_t experts = problem.num_experts > 0 ? problem.num_experts : 1;
  const int64_t rows_per_expert = problem.num_tokens / experts;
  // Decode: a few rows per expert, so the GEMM streams weights. A 64-row tile wastes less of the
  // MMA on padding rows, and pingpong overlaps one tile's epilogue with the next one's mainloop.
  if (rows_per_expert <= 64) {
    return KernelConfig::kSm90Pingpong_64x128x64_1x1x1;
  }
  // Prefill: large tiles for operand reuse; the 1x2 cluster multicasts the x tile to both CTAs.
  return KernelConfig::kSm90Cooperative_128x256x64_1x2x1;
}

}  // namespace cutlass_moe
