// sm90 (Hopper) MoE GEMM on CUTLASS's persistent ptr-array grouped GEMM
// (KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong}, TMA + WGMMA).
//
// One call is two launches on the caller's stream:
//   1. build_grouped_arguments: one CTA reads tokens_per_expert on the device, clamps the counts
//      (expert_ranges.cuh), and writes each expert's problem shape, A/B/D pointers and strides
//      into the workspace;
//   2. the CUTLASS grouped GEMM, with device-only problem shapes (host_problem_shapes = nullptr).
// The host never reads the counts, so the call is capturable in a CUDA graph and a replay picks up
// new counts.
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
#include "sm90/sm90_common.cuh"
#include "expert_ranges.cuh"
#include "kernel_families.h"
#include "launch.h"
#include "workspace.h"

namespace cutlass_moe::sm90 {

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
struct GroupedGemmKernel {
  using Config = ConfigTraits<kConfig>;
  static_assert(!Config::kWide, "the wide tile is the MoE forward's only");

  using Element            = typename ElementOf<kDType>::type;
  using ElementAccumulator = float;                                             // fp32 accumulation
  using LayoutA            = cutlass::layout::RowMajor;                         // x: T x K, K contiguous
  using LayoutB            = typename LayoutBOf<kLayout>::type;                 // weights[e]: K x N
  using LayoutD            = cutlass::layout::RowMajor;                         // out: T x N, N contiguous
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;  // 16 bytes, for TMA
  using ProblemShape       = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // per expert (M, N, K)

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      typename Config::TileShape, typename Config::ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto,
      ElementAccumulator, ElementAccumulator,
      void, LayoutD*, kAlignment,                                               // no C: out is not read
      Element, LayoutD*, kAlignment,
      typename Config::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Element, ElementAccumulator, void>
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
  using StrideD = typename Kernel::InternalStrideD;
};

// Per-expert argument arrays, carved from the front of the caller's workspace.
template <class K>
struct GroupedArrays {
  typename K::Shape* shapes;
  const typename K::Element** ptr_a;
  const typename K::Element** ptr_b;
  typename K::Element** ptr_d;
  typename K::StrideA* stride_a;
  typename K::StrideB* stride_b;
  typename K::StrideD* stride_d;
};

// Lays the arrays out from the carver's base (a null base only counts the bytes).
template <class K>
GroupedArrays<K> carve_arrays(WorkspaceCarver& carver, int64_t num_experts) {
  GroupedArrays<K> arrays;
  arrays.shapes   = carver.take<typename K::Shape>(num_experts);
  arrays.ptr_a    = carver.take<const typename K::Element*>(num_experts);
  arrays.ptr_b    = carver.take<const typename K::Element*>(num_experts);
  arrays.ptr_d    = carver.take<typename K::Element*>(num_experts);
  arrays.stride_a = carver.take<typename K::StrideA>(num_experts);
  arrays.stride_b = carver.take<typename K::StrideB>(num_experts);
  arrays.stride_d = carver.take<typename K::StrideD>(num_experts);
  return arrays;
}

// One CTA: turns the counts into per-expert shapes, pointers and strides.
template <class K, class Count>
__global__ void __launch_bounds__(kExpertRangeThreads)
build_grouped_arguments(GroupedArrays<K> arrays, const Count* __restrict__ tokens_per_expert,
                        int64_t num_experts, int64_t num_tokens, int n, int k,
                        const typename K::Element* x, int64_t ldx,
                        const typename K::Element* weights, int64_t ldw, int64_t expert_stride,
                        typename K::Element* out, int64_t ldout) {
  for_each_expert_range(tokens_per_expert, num_experts, num_tokens, [&](int64_t e, int64_t start, int64_t rows) {
    arrays.shapes[e]   = typename K::Shape{static_cast<int>(rows), n, k};
    arrays.ptr_a[e]    = x + start * ldx;
    arrays.ptr_b[e]    = weights + e * expert_stride;
    arrays.ptr_d[e]    = out + start * ldout;
    arrays.stride_a[e] = leading_stride<typename K::StrideA>(ldx);
    arrays.stride_b[e] = leading_stride<typename K::StrideB>(ldw);
    arrays.stride_d[e] = leading_stride<typename K::StrideD>(ldout);
  });
}

template <class K>
typename K::Gemm::Arguments make_arguments(const GroupedArrays<K>& arrays, int64_t num_experts,
                                           int device, int sm_count) {
  typename K::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(num_experts), arrays.shapes, /*host_problem_shapes=*/nullptr};
  args.mainloop = {arrays.ptr_a, arrays.stride_a, arrays.ptr_b, arrays.stride_b};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = arrays.ptr_d;
  args.epilogue.dD = arrays.stride_d;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  return args;
}

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
size_t GroupedGemmInstance<kDType, kLayout, kConfig>::workspace_size(int64_t num_experts, int sm_count) {
  using K = GroupedGemmKernel<kDType, kLayout, kConfig>;
  WorkspaceCarver carver(nullptr);
  auto args = make_arguments<K>(carve_arrays<K>(carver, num_experts), num_experts, /*device=*/0, sm_count);
  return carver.bytes() + align_up(K::Gemm::get_workspace_size(args));
}

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
void GroupedGemmInstance<kDType, kLayout, kConfig>::run(const MoeGemmProblem& p, void* workspace,
                                                        size_t workspace_bytes, int sm_count,
                                                        cudaStream_t stream) {
  using K = GroupedGemmKernel<kDType, kLayout, kConfig>;
  using Element = typename K::Element;

  WorkspaceCarver carver(workspace);
  GroupedArrays<K> arrays = carve_arrays<K>(carver, p.num_experts);

  with_typed_counts(p.count_type, p.tokens_per_expert, [&](auto const* counts) {
    build_grouped_arguments<K><<<1, kExpertRangeThreads, 0, stream>>>(
        arrays, counts, p.num_experts, p.num_tokens, static_cast<int>(p.n), static_cast<int>(p.k),
        static_cast<const Element*>(p.x), p.ldx, static_cast<const Element*>(p.weights), p.ldw,
        p.expert_stride, static_cast<Element*>(p.out), p.ldout);
  });
  CUTLASS_MOE_CHECK_CUDA(cudaGetLastError());

  int device = 0;
  CUTLASS_MOE_CHECK_CUDA(cudaGetDevice(&device));
  run_device_gemm<typename K::Gemm>(make_arguments<K>(arrays, p.num_experts, device, sm_count), carver.rest(),
                                    stream);
}

}  // namespace cutlass_moe::sm90
