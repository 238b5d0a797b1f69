#pragma once

#include "cutlass_moe/cutlass_moe.h"

namespace cutlass_moe {

// Writes zeros to the rows of out that a K == 0 GEMM computes (see cutlass_moe.h for the rows).
void launch_zero_computed_rows(const MoeGemmProblem& problem, cudaStream_t stream);

}  // namespace cutlass_moe
