// sm80 (Ampere/Ada, and sm90 as fallback) weight gradient of moe_gemm on CUTLASS 2.x GemmGrouped
// with device-only scheduling: one group per expert, whose reduction length (the GEMM's K) is the
// expert's row count, read on the device (wgrad_common.cuh for the operands).
//
// One call is up to three launches on the caller's stream: build_sm80_wgrad_arguments (one CTA:
// clamped counts -> per-expert GemmCoord, pointers and leading dimensions in the workspace; an
// expert with no rows gets m = 0, no tiles: wgrad_common.cuh), zero_empty_experts (unless
// accumulating), then the grouped GEMM, D = A . B (+ D when accumulating: beta = 1, C = D).
#pragma once

#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/device/gemm_grouped.h>
#include <cutlass/gemm/kernel/default_gemm_grouped.h>

#include "check.h"
#include "expert_ranges.cuh"
#include "kernel_families.h"
#include "launch.h"
#include "launch_facts.h"
#include "sm80/sm80_common.cuh"
#include "wgrad_common.cuh"
#include "workspace.h"

namespace cutlass_moe::sm80 {

template <DType kDType, DType kOutDType, KernelConfig kConfig>
struct WgradGroupedKernel {
  using Element            = typename ElementOf<kDType>::type;
  using ElementOut         = typename ElementOf<kOutDType>::type;
  using ElementAccumulator = float;
  using LayoutA            = cutlass::layout::ColumnMajor;  // M contiguous (along K or N of dW)
  using LayoutB            = cutlass::layout::RowMajor;     // N contiguous
  using LayoutC            = cutlass::layout::RowMajor;
  static constexpr int kAlignment    = 128 / cutlass::sizeof_bits<Element>::value;     // 16-byte cp.async
  static constexpr int kOutAlignment = 128 / cutlass::sizeof_bits<ElementOut>::value;
  using ThreadblockShape   = typename ConfigTraits<kConfig>::ThreadblockShape;
  using WarpShape          = typename ConfigTraits<kConfig>::WarpShape;
  using InstructionShape   = cutlass::gemm::GemmShape<16, 8, 16>;
  // D = alpha * acc + beta * C; C is read only when beta != 0.
  using EpilogueOp = cutlass::epilogue::thread::LinearCombination<ElementOut, kOutAlignment, ElementAccumulator,
                                                                  ElementAccumulator>;
  using GemmKernel = typename cutlass::gemm::kernel::DefaultGemmGrouped<
      Element, LayoutA, cutlass::ComplexTransform::kNone, kAlignment,
      Element, LayoutB, cutlass::ComplexTransform::kNone, kAlignment,
      ElementOut, LayoutC,
      ElementAccumulator,
      cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      ThreadblockShape, WarpShape, InstructionShape,
      EpilogueOp,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>,
      ConfigTraits<kConfig>::kStages,
      cutlass::gemm::kernel::GroupScheduleMode::kDeviceOnly
    >::GemmKernel;
  using Gemm = cutlass::gemm::device::GemmGrouped<GemmKernel>;
};

struct WgradArrays {
  cutlass::gemm::GemmCoord* shapes;
  void** ptr_a;
  void** ptr_b;
  void** ptr_d;
  int64_t* lda;
  int64_t* ldb;
  int64_t* ldd;
  int64_t* rows;  // each expert's clamped rows, for zero_empty_experts
};

inline WgradArrays carve_wgrad_arrays(WorkspaceCarver& carver, int64_t num_experts) {
  WgradArrays arrays;
  arrays.shapes = carver.take<cutlass::gemm::GemmCoord>(num_experts);
  arrays.ptr_a  = carver.take<void*>(num_experts);
  arrays.ptr_b  = carver.take<void*>(num_experts);
  arrays.ptr_d  = carver.take<void*>(num_experts);
  arrays.lda    = carver.take<int64_t>(num_experts);
  arrays.ldb    = carver.take<int64_t>(num_experts);
  arrays.ldd    = carver.take<int64_t>(num_experts);
  arrays.rows   = carver.take<int64_t>(num_experts);
  return arrays;
}

template <class Count>
__global__ void __launch_bounds__(kExpertRangeThreads)
build_sm80_wgrad_arguments(WgradArrays arrays, const Count* __restrict__ tokens_per_expert, int64_t num_experts,
                           int64_t num_tokens, int m, int n, const char* a, int64_t lda, const char* b, int64_t ldb,
                           int element_bytes, char* out, int64_t ldd, int64_t expert_stride, int out_bytes) {
  for_each_expert_range(tokens_per_expert, num_experts, num_tokens, [&](int64_t e, int64_t start, int64_t rows) {
    arrays.shapes[e] = cutlass::gemm::GemmCoord(rows > 0 ? m : 0, n, static_cast<int>(rows));
    arrays.ptr_a[e]  = const_cast<char*>(a + start * lda * element_bytes);
    arrays.ptr_b[e]  = const_cast<char*>(b + start * ldb * element_bytes);
    arrays.ptr_d[e]  = out + e * expert_stride * out_bytes;
    arrays.lda[e]    = lda;
    arrays.ldb[e]    = ldb;
    arrays.ldd[e]    = ldd;
    arrays.rows[e]   = rows;
  });
}

template <class K>
typename K::Gemm::Arguments make_wgrad_arguments(const WgradArrays& a, int64_t num_experts, bool accumulate,
                                                 int threadblock_count) {
  using Element = typename K::Element;
  using ElementOut = typename K::ElementOut;
  typename K::EpilogueOp::Params epilogue(1.0f, accumulate ? 1.0f : 0.0f);
  auto** ptr_d = reinterpret_cast<ElementOut**>(a.ptr_d);
  return typename K::Gemm::Arguments(a.shapes, static_cast<int>(num_experts), threadblock_count, epilogue,
                                     reinterpret_cast<Element**>(a.ptr_a), reinterpret_cast<Element**>(a.ptr_b),
                                     /*ptr_C=*/ptr_d, ptr_d, a.lda, a.ldb, /*ldc=*/a.ldd, a.ldd);
}

template <DType kDType, DType kOutDType, KernelConfig kConfig>
size_t WgradGroupedInstance<kDType, kOutDType, kConfig>::workspace_size(int64_t num_experts, int sm_count) {
  using K = WgradGroupedKernel<kDType, kOutDType, kConfig>;
  WorkspaceCarver carver(nullptr);
  auto args = make_wgrad_arguments<K>(carve_wgrad_arrays(carver, num_experts), num_experts, false, sm_count);
  return carver.bytes() + align_up(K::Gemm::get_workspace_size(args));
}

template <DType kDType, DType kOutDType, KernelConfig kConfig>
void WgradGroupedInstance<kDType, kOutDType, kConfig>::run(const MoeWgradProblem& p, void* workspace, size_t,
                                                           int sm_count, cudaStream_t stream) {
  using K = WgradGroupedKernel<kDType, kOutDType, kConfig>;
  const WgradOperands op = wgrad_operands(p);
  WorkspaceCarver carver(workspace);
  WgradArrays arrays = carve_wgrad_arrays(carver, p.num_experts);
  with_typed_counts(p.count_type, p.tokens_per_expert, [&](auto const* counts) {
    build_sm80_wgrad_arguments<<<1, kExpertRangeThreads, 0, stream>>>(
        arrays, counts, p.num_experts, p.num_tokens, static_cast<int>(op.m), static_cast<int>(op.n),
        static_cast<const char*>(op.a), op.lda, static_cast<const char*>(op.b), op.ldb,
        static_cast<int>(sizeof(typename K::Element)), static_cast<char*>(p.out), p.ldw, p.expert_stride,
        static_cast<int>(sizeof(typename K::ElementOut)));
  });
  CUTLASS_MOE_CHECK_CUDA(cudaGetLastError());
  if (!p.accumulate) launch_zero_empty_experts<typename K::ElementOut>(arrays.rows, p, op, stream);

  int device = 0;
  CUTLASS_MOE_CHECK_CUDA(cudaGetDevice(&device));
  using GemmKernel = typename K::GemmKernel;
  const int blocks = resident_ctas_per_sm(reinterpret_cast<const void*>(&cutlass::Kernel<GemmKernel>),
                                          GemmKernel::kThreadCount,
                                          static_cast<int>(sizeof(typename GemmKernel::SharedStorage)), device);
  run_device_gemm<typename K::Gemm>(make_wgrad_arguments<K>(arrays, p.num_experts, p.accumulate, sm_count * blocks),
                                    carver.rest(), stream);
}

}  // namespace cutlass_moe::sm80
