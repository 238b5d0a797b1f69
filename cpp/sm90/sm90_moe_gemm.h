// The sm90 MoE-specialized family, as the dispatcher sees it (no CUTLASS types). Same interface as
// GroupedGemmInstance; each instance is explicitly instantiated in its own generated .cu file.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cutlass_moe/cutlass_moe.h"

namespace cutlass_moe::sm90 {

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
struct MoeGemmInstance {
  static size_t workspace_size(int64_t num_experts, int sm_count);  // always 0: no per-expert arrays
  static void run(const MoeGemmProblem& problem, void* workspace, size_t workspace_bytes,
                  int sm_count, cudaStream_t stream);
};

}  // namespace cutlass_moe::sm90
