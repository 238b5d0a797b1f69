// The kernel families as the dispatcher (moe_gemm.cpp) sees them: no CUTLASS types here, so the
// dispatcher compiles without CUTLASS. Each (dtype, layout, config) instance of a family is
// explicitly instantiated in its own generated .cu file (CMakeLists.txt).
//
//   sm90::GroupedGemmInstance  CUTLASS 3 ptr-array grouped GEMM    sm90/sm90_grouped_gemm.cuh
//   sm90::MoeGemmInstance      our MoE kernel on CUTLASS 3 parts    sm90/sm90_moe_gemm.cuh
//   sm80::GroupedGemmInstance  CUTLASS 2 GemmGrouped (device-only)  sm80/sm80_grouped_gemm.cuh
//   sm80::MoeGemmInstance      our MoE kernel on CUTLASS 2 parts    sm80/sm80_moe_gemm.cuh
//   sm90::WgradMoeInstance     weight gradient, our MoE kernel       sm90/sm90_wgrad_moe.cuh
//   sm90::WgradGroupedInstance weight gradient, CUTLASS 3 ptr-array  sm90/sm90_wgrad_grouped.cuh
//   sm80::WgradGroupedInstance weight gradient, CUTLASS 2 grouped    sm80/sm80_wgrad_grouped.cuh
#pragma once

#include <cstddef>
#include <cstdint>

#include "cutlass_moe/cutlass_moe.h"

#define CUTLASS_MOE_DECLARE_FAMILY(NAME)                                                         \
  template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>                            \
  struct NAME {                                                                                  \
    /* Bytes of caller workspace one call needs (per-expert arrays, CUTLASS's own workspace). */ \
    static size_t workspace_size(int64_t num_experts, int sm_count);                             \
    static void run(const MoeGemmProblem& problem, void* workspace, size_t workspace_bytes,      \
                    int sm_count, cudaStream_t stream);                                          \
  };

// The weight-gradient families: one instance per (input dtype, output dtype, config); both dW
// layouts share it (wgrad_common.cuh).
#define CUTLASS_MOE_DECLARE_WGRAD_FAMILY(NAME)                                                   \
  template <DType kDType, DType kOutDType, KernelConfig kConfig>                                 \
  struct NAME {                                                                                  \
    static size_t workspace_size(int64_t num_experts, int sm_count);                             \
    static void run(const MoeWgradProblem& problem, void* workspace, size_t workspace_bytes,      \
                    int sm_count, cudaStream_t stream);                                          \
  };

namespace cutlass_moe {
// Whether the sm90 MoE kernel's cooperative tiles store each tile while the next one's mainloop
// runs (bf16, K >= 256; heuristics.cpp): where experts own a few hundred rows or more.
bool defer_cooperative_stores(const MoeGemmProblem& problem);
}  // namespace cutlass_moe

namespace cutlass_moe::sm90 {
CUTLASS_MOE_DECLARE_FAMILY(GroupedGemmInstance)
CUTLASS_MOE_DECLARE_FAMILY(MoeGemmInstance)
CUTLASS_MOE_DECLARE_WGRAD_FAMILY(WgradMoeInstance)
CUTLASS_MOE_DECLARE_WGRAD_FAMILY(WgradGroupedInstance)
}  // namespace cutlass_moe::sm90

namespace cutlass_moe::sm80 {
CUTLASS_MOE_DECLARE_FAMILY(GroupedGemmInstance)
CUTLASS_MOE_DECLARE_FAMILY(MoeGemmInstance)
CUTLASS_MOE_DECLARE_WGRAD_FAMILY(WgradGroupedInstance)
}  // namespace cutlass_moe::sm80

#undef CUTLASS_MOE_DECLARE_WGRAD_FAMILY
#undef CUTLASS_MOE_DECLARE_FAMILY
