// sm90 (Hopper) weight gradient of moe_gemm on CUTLASS's persistent ptr-array grouped GEMM: one
// group per expert, whose reduction length (the GEMM's K) is the expert's row count, read on the
// device. Both operands run along T in memory (x is T x K, grad_out T x N), so A is MN-major
// (wgrad_common.cuh); TMA clips each expert's last K block at its rows.
//
// One call is up to three launches on the caller's stream:
//   1. build_wgrad_arguments: one CTA reads tokens_per_expert on the device, clamps the counts
//      (expert_ranges.cuh), and writes each expert's shape (m, n, rows), A/B/C/D pointers and
//      strides into the workspace. An expert with no rows gets m = 0: no tiles (wgrad_common.cuh);
//   2. zero_empty_experts (unless accumulating): zeros dW of the experts with no rows;
//   3. the CUTLASS grouped GEMM, D = A . B (+ D when accumulating: beta = 1, C = D).
// The host never reads the counts: capturable in a CUDA graph, and a replay picks up new counts.
#pragma once

#include "sm90/sm90_tma_encode.hpp"  // first: routes every TMA encode through a checked call

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "check.h"
#include "expert_ranges.cuh"
#include "kernel_families.h"
#include "launch.h"
#include "sm90/sm90_common.cuh"
#include "wgrad_common.cuh"
#include "workspace.h"

namespace cutlass_moe::sm90 {

template <DType kDType, DType kOutDType, KernelConfig kConfig>
struct WgradGroupedKernel {
  using Config = ConfigTraits<kConfig>;
  static_assert(!Config::kWide, "the wide tile is the MoE forward's only");

  using Element            = typename ElementOf<kDType>::type;
  using ElementOut         = typename ElementOf<kOutDType>::type;
  using ElementAccumulator = float;
  using LayoutA            = cutlass::layout::ColumnMajor;                      // M contiguous (along K or N of dW)
  using LayoutB            = cutlass::layout::RowMajor;                         // N contiguous
  using LayoutD            = cutlass::layout::RowMajor;
  static constexpr int kAlignment    = 128 / cutlass::sizeof_bits<Element>::value;     // 16 bytes, for TMA
  static constexpr int kOutAlignment = 128 / cutlass::sizeof_bits<ElementOut>::value;
  using ProblemShape       = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // per expert (M, N, rows)

  // D = A . B + beta * C, beta = 1 with C = D when accumulating, else 0 (C is then not read).
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      typename Config::TileShape, typename Config::ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto,
      ElementAccumulator, ElementAccumulator,
      ElementOut, LayoutD*, kOutAlignment,
      ElementOut, LayoutD*, kOutAlignment,
      typename Config::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, ElementAccumulator, ElementOut>
    >::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, LayoutA*, kAlignment,
      Element, LayoutB*, kAlignment,
      ElementAccumulator,
      typename Config::TileShape, typename Config::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Config::KernelSchedule
    >::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm   = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using Shape   = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
};

// Per-expert argument arrays, carved from the front of the caller's workspace.
template <class K>
struct WgradArrays {
  typename K::Shape* shapes;
  const typename K::Element** ptr_a;
  const typename K::Element** ptr_b;
  const typename K::ElementOut** ptr_c;
  typename K::ElementOut** ptr_d;
  typename K::StrideA* stride_a;
  typename K::StrideB* stride_b;
  typename K::StrideC* stride_c;
  typename K::StrideD* stride_d;
  int64_t* rows;  // each expert's clamped rows, for zero_empty_experts
};

template <class K>
WgradArrays<K> carve_wgrad_arrays(WorkspaceCarver& carver, int64_t num_experts) {
  WgradArrays<K> arrays;
  arrays.shapes   = carver.take<typename K::Shape>(num_experts);
  arrays.ptr_a    = carver.take<const typename K::Element*>(num_experts);
  arrays.ptr_b    = carver.take<const typename K::Element*>(num_experts);
  arrays.ptr_c    = carver.take<const typename K::ElementOut*>(num_experts);
  arrays.ptr_d    = carver.take<typename K::ElementOut*>(num_experts);
  arrays.stride_a = carver.take<typename K::StrideA>(num_experts);
  arrays.stride_b = carver.take<typename K::StrideB>(num_experts);
  arrays.stride_c = carver.take<typename K::StrideC>(num_experts);
  arrays.stride_d = carver.take<typename K::StrideD>(num_experts);
  arrays.rows     = carver.take<int64_t>(num_experts);
  return arrays;
}

// One CTA: turns the counts into per-expert shapes, pointers and strides.
template <class K, class Count>
__global__ void __launch_bounds__(kExpertRangeThreads)
build_wgrad_arguments(WgradArrays<K> arrays, const Count* __restrict__ tokens_per_expert, int64_t num_experts,
                      int64_t num_tokens, int m, int n, const typename K::Element* a, int64_t lda,
                      const typename K::Element* b, int64_t ldb, typename K::ElementOut* out, int64_t ldd,
                      int64_t expert_stride) {
  for_each_expert_range(tokens_per_expert, num_experts, num_tokens, [&](int64_t e, int64_t start, int64_t rows) {
    typename K::ElementOut* d = out + e * expert_stride;
    arrays.shapes[e]   = typename K::Shape{rows > 0 ? m : 0, n, static_cast<int>(rows)};
    arrays.ptr_a[e]    = a + start * lda;
    arrays.ptr_b[e]    = b + start * ldb;
    arrays.ptr_c[e]    = d;
    arrays.ptr_d[e]    = d;
    arrays.stride_a[e] = leading_stride<typename K::StrideA>(lda);
    arrays.stride_b[e] = leading_stride<typename K::StrideB>(ldb);
    arrays.stride_c[e] = leading_stride<typename K::StrideC>(ldd);
    arrays.stride_d[e] = leading_stride<typename K::StrideD>(ldd);
    arrays.rows[e]     = rows;
  });
}

template <class K>
typename K::Gemm::Arguments make_wgrad_arguments(const WgradArrays<K>& arrays, int64_t num_experts, bool accumulate,
                                                 int device, int sm_count) {
  typename K::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(num_experts), arrays.shapes, /*host_problem_shapes=*/nullptr};
  args.mainloop = {arrays.ptr_a, arrays.stride_a, arrays.ptr_b, arrays.stride_b};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = accumulate ? 1.0f : 0.0f;
  args.epilogue.ptr_C = arrays.ptr_c;
  args.epilogue.dC = arrays.stride_c;
  args.epilogue.ptr_D = arrays.ptr_d;
  args.epilogue.dD = arrays.stride_d;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  return args;
}

template <DType kDType, DType kOutDType, KernelConfig kConfig>
size_t WgradGroupedInstance<kDType, kOutDType, kConfig>::workspace_size(int64_t num_experts, int sm_count) {
  using K = WgradGroupedKernel<kDType, kOutDType, kConfig>;
  WorkspaceCarver carver(nullptr);
  auto args = make_wgrad_arguments<K>(carve_wgrad_arrays<K>(carver, num_experts), num_experts, false, 0, sm_count);
  return carver.bytes() + align_up(K::Gemm::get_workspace_size(args));
}

template <DType kDType, DType kOutDType, KernelConfig kConfig>
void WgradGroupedInstance<kDType, kOutDType, kConfig>::run(const MoeWgradProblem& p, void* workspace, size_t,
                                                           int sm_count, cudaStream_t stream) {
  using K = WgradGroupedKernel<kDType, kOutDType, kConfig>;
  using Element = typename K::Element;
  using ElementOut = typename K::ElementOut;
  const WgradOperands op = wgrad_operands(p);
  auto* out = static_cast<ElementOut*>(p.out);

  WorkspaceCarver carver(workspace);
  WgradArrays<K> arrays = carve_wgrad_arrays<K>(carver, p.num_experts);
  with_typed_counts(p.count_type, p.tokens_per_expert, [&](auto const* counts) {
    build_wgrad_arguments<K><<<1, kExpertRangeThreads, 0, stream>>>(
        arrays, counts, p.num_experts, p.num_tokens, static_cast<int>(op.m), static_cast<int>(op.n),
        static_cast<const Element*>(op.a), op.lda, static_cast<const Element*>(op.b), op.ldb, out, p.ldw,
        p.expert_stride);
  });
  CUTLASS_MOE_CHECK_CUDA(cudaGetLastError());
  if (!p.accumulate) launch_zero_empty_experts<ElementOut>(arrays.rows, p, op, stream);
  int device = 0;
  CUTLASS_MOE_CHECK_CUDA(cudaGetDevice(&device));
  run_device_gemm<typename K::Gemm>(make_wgrad_arguments<K>(arrays, p.num_experts, p.accumulate, device, sm_count),
                                    carver.rest(), stream);
}

}  // namespace cutlass_moe::sm90
