// sm80 (Ampere/Ada, and sm90 as fallback) MoE GEMM on CUTLASS 2.x GemmGrouped with device-only
// scheduling (GroupScheduleMode::kDeviceOnly): its problem visitor reads each group's shape on the
// device, so the host never reads the counts.
//
// One call is two launches on the caller's stream: build_sm80_grouped_arguments (one CTA: clamped
// counts -> per-expert GemmCoord, pointers and leading dimensions in the workspace), then the
// grouped GEMM. CUTLASS pitfalls guarded here or before dispatch: K == 0 never reaches the kernel
// (moe_gemm.cpp writes zeros instead), empty experts get M = 0 (zero tiles), and C aliases D
// (GemmGrouped reads ptr_C[i] even when beta is unused; the epilogue never loads it).
#pragma once

#include <cutlass/gemm/device/gemm_grouped.h>

#include "check.h"
#include "expert_ranges.cuh"
#include "kernel_families.h"
#include "launch.h"
#include "launch_facts.h"
#include "sm80/sm80_common.cuh"
#include "workspace.h"

namespace cutlass_moe::sm80 {

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
struct GroupedGemmKernel : KernelTypes<kDType, kLayout, kConfig> {
  using Gemm = cutlass::gemm::device::GemmGrouped<typename KernelTypes<kDType, kLayout, kConfig>::GroupedKernel>;
};

struct GroupedArrays {
  cutlass::gemm::GemmCoord* shapes;
  void** ptr_a;
  void** ptr_b;
  void** ptr_d;
  int64_t* lda;
  int64_t* ldb;
  int64_t* ldd;
};

inline GroupedArrays carve_arrays(WorkspaceCarver& carver, int64_t num_experts) {
  GroupedArrays arrays;
  arrays.shapes = carver.take<cutlass::gemm::GemmCoord>(num_experts);
  arrays.ptr_a  = carver.take<void*>(num_experts);
  arrays.ptr_b  = carver.take<void*>(num_experts);
  arrays.ptr_d  = carver.take<void*>(num_experts);
  arrays.lda    = carver.take<int64_t>(num_experts);
  arrays.ldb    = carver.take<int64_t>(num_experts);
  arrays.ldd    = carver.take<int64_t>(num_experts);
  return arrays;
}

template <class Count>
__global__ void __launch_bounds__(kExpertRangeThreads)
build_sm80_grouped_arguments(GroupedArrays arrays, const Count* __restrict__ tokens_per_expert, int64_t num_experts,
                             int64_t num_tokens, int n, int k, const char* x, int64_t ldx, const char* weights,
                             int64_t ldw, int64_t expert_stride, char* out, int64_t ldout, int element_bytes) {
  for_each_expert_range(tokens_per_expert, num_experts, num_tokens, [&](int64_t e, int64_t start, int64_t rows) {
    arrays.shapes[e] = cutlass::gemm::GemmCoord(static_cast<int>(rows), n, k);
    arrays.ptr_a[e]  = const_cast<char*>(x + start * ldx * element_bytes);
    arrays.ptr_b[e]  = const_cast<char*>(weights + e * expert_stride * element_bytes);
    arrays.ptr_d[e]  = out + start * ldout * element_bytes;
    arrays.lda[e]    = ldx;
    arrays.ldb[e]    = ldw;
    arrays.ldd[e]    = ldout;
  });
}

template <class K>
typename K::Gemm::Arguments make_arguments(const GroupedArrays& a, int64_t num_experts, int threadblock_count) {
  using Element = typename K::Element;
  typename K::EpilogueOp::Params epilogue(1.0f);  // alpha = 1; no beta: C is never read
  auto** ptr_d = reinterpret_cast<Element**>(a.ptr_d);
  return typename K::Gemm::Arguments(a.shapes, static_cast<int>(num_experts), threadblock_count, epilogue,
                                     reinterpret_cast<Element**>(a.ptr_a), reinterpret_cast<Element**>(a.ptr_b),
                                     /*ptr_C=*/ptr_d, ptr_d, a.lda, a.ldb, /*ldc=*/a.ldd, a.ldd);
}

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
size_t GroupedGemmInstance<kDType, kLayout, kConfig>::workspace_size(int64_t num_experts, int sm_count) {
  using K = GroupedGemmKernel<kDType, kLayout, kConfig>;
  WorkspaceCarver carver(nullptr);
  auto args = make_arguments<K>(carve_arrays(carver, num_experts), num_experts, sm_count);
  return carver.bytes() + align_up(K::Gemm::get_workspace_size(args));
}

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
void GroupedGemmInstance<kDType, kLayout, kConfig>::run(const MoeGemmProblem& p, void* workspace,
                                                        size_t workspace_bytes, int sm_count,
                                                        cudaStream_t stream) {
  using K = GroupedGemmKernel<kDType, kLayout, kConfig>;
  WorkspaceCarver carver(workspace);
  GroupedArrays arrays = carve_arrays(carver, p.num_experts);

  with_typed_counts(p.count_type, p.tokens_per_expert, [&](auto const* counts) {
    build_sm80_grouped_arguments<<<1, kExpertRangeThreads, 0, stream>>>(
        arrays, counts, p.num_experts, p.num_tokens, static_cast<int>(p.n), static_cast<int>(p.k),
        static_cast<const char*>(p.x), p.ldx, static_cast<const char*>(p.weights), p.ldw, p.expert_stride,
        static_cast<char*>(p.out), p.ldout, static_cast<int>(sizeof(typename K::Element)));
  });
  CUTLASS_MOE_CHECK_CUDA(cudaGetLastError());

  int device = 0;
  CUTLASS_MOE_CHECK_CUDA(cudaGetDevice(&device));
  using GemmKernel = typename K::Gemm::GemmKernel;
  const int blocks = resident_ctas_per_sm(reinterpret_cast<const void*>(&cutlass::Kernel<GemmKernel>),
                                          GemmKernel::kThreadCount,
                                          static_cast<int>(sizeof(typename GemmKernel::SharedStorage)), device);
  run_device_gemm<typename K::Gemm>(make_arguments<K>(arrays, p.num_experts, sm_count * blocks), carver.rest(),
                                    stream);
}

}  // namespace cutlass_moe::sm80
