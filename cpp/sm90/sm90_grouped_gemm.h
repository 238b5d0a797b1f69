// The sm90 ptr-array grouped GEMM family, as the dispatcher sees it: no CUTLASS types here, so the
// dispatcher compiles without CUTLASS. Each (dtype, layout, config) instance is explicitly
// instantiated in its own generated .cu file (see CMakeLists.txt).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cutlass_moe/cutlass_moe.h"

namespace cutlass_moe::sm90 {

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
struct GroupedGemmInstance {
  static size_t workspace_size(int64_t num_experts, int sm_count);
  static void run(const MoeGemmProblem& problem, void* workspace, size_t workspace_bytes,
                  int sm_count, cudaStream_t stream);
};

}  // namespace cutlass_moe::sm90
