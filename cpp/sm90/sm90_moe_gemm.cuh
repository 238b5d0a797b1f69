// Launch of the sm90 MoE kernel (sm90_moe_kernel.hpp) for one MoeGemmProblem: CUTLASS's host
// sequence can_implement -> to_underlying_arguments -> launch, each step checked.
#pragma once

#include "sm90/sm90_tma_encode.hpp"  // first: routes every TMA encode through a checked call

#include "check.h"
#include "kernel_families.h"
#include "sm90/sm90_launch.cuh"
#include "sm90/sm90_moe_kernel.hpp"

namespace cutlass_moe::sm90 {

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
using MoeKernelOf = MoeGemmKernel<typename ElementOf<kDType>::type, typename LayoutBOf<kLayout>::type,
                                  ConfigTraits<kConfig>>;

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
size_t MoeGemmInstance<kDType, kLayout, kConfig>::workspace_size(int64_t, int) {
  return MoeKernelOf<kDType, kLayout, kConfig>::get_workspace_size({});
}

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
void MoeGemmInstance<kDType, kLayout, kConfig>::run(const MoeGemmProblem& p, void* workspace, size_t, int sm_count,
                                                    cudaStream_t stream) {
  using Kernel = MoeKernelOf<kDType, kLayout, kConfig>;
  using Element = typename Kernel::Element;
  int device = 0;
  CUTLASS_MOE_CHECK_CUDA(cudaGetDevice(&device));

  typename Kernel::Arguments args{};
  args.problem = {static_cast<int>(p.num_tokens), static_cast<int>(p.n), static_cast<int>(p.k),
                  static_cast<int>(p.num_experts)};
  args.ptr_x = static_cast<Element const*>(p.x);
  args.ldx = p.ldx;
  args.ptr_weights = static_cast<Element const*>(p.weights);
  args.ldw = p.ldw;
  args.expert_stride = p.expert_stride;
  args.epilogue.ptr_out = static_cast<Element*>(p.out);
  args.epilogue.ldout = p.ldout;
  args.epilogue.gated = p.gated;
  args.fused = {static_cast<Element const*>(p.bias), p.bias_stride, p.row_scale, static_cast<int>(p.activation),
                static_cast<int>(p.num_tokens), static_cast<int>(p.n), has_fused_epilogue(p), p.gated,
                p.alpha, p.limit};
  args.fused.seed_bias = Kernel::kSeedsBias && p.bias != nullptr;
  args.fused.gated_alone = p.gated && p.row_scale == nullptr && (p.bias == nullptr || args.fused.seed_bias)
                               ? static_cast<int>(p.activation)
                               : static_cast<int>(Activation::kNone);
  const bool interleaved = has_interleaved_groups(p);
  args.tokens_per_expert = interleaved ? nullptr : p.tokens_per_expert;
  args.counts_are_int64 = p.count_type == IndexType::kInt64;
  args.zero_unowned = p.zero_unowned && !interleaved;  // interleaved groups own every row
  if (interleaved) args.groups = {static_cast<int>(p.group_rows), p.x_group_stride, p.out_group_stride};
  // A seeded bf16 bias keeps the deferred stores, sorted rows and interleaved groups alike
  // (GroupedLinear with a bias at PR #263's shape: 1.071x -> 1.062x its call without a bias;
  // benchmarks/NOTES.md, thirty-fourth session).
  args.defer_stores = defer_cooperative_stores(p);
  args.split_gate = interleaved ? SplitGate::kAlways : p.split_gate;
  // The cooperative tile halves a short last round (sm90_moe_kernel.hpp, CooperativeUnits): 1-3%
  // faster at 800-1100 tiles of few experts (benchmarks/NOTES.md). It costs each role a walk over
  // the counts before its first tile, 32 experts per step, and can save at most half a tile's time:
  // only where the tiles fill a few rounds (each expert adds at most one partial row tile) and one
  // step covers the experts (64 experts measured 1% slower for the walk alone).
  constexpr int64_t kHalvedRoundsAtMost = 16;
  const int64_t tiles = most_tiles(p.num_tokens, p.num_experts, (p.n + Kernel::kTileN - 1) / Kernel::kTileN,
                                   Kernel::kTileM);
  args.halve_last_round = !Kernel::kPingpong && !Kernel::kWide && p.num_experts <= 32 && tiles <= kHalvedRoundsAtMost * sm_count;
  // One CTA per SM: the kernel takes all of shared memory (checked below).
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;

  CUTLASS_MOE_CHECK(Kernel::can_implement(args), Status::kInvalidArgument,
                    "the sm90 MoE kernel cannot take T = " << p.num_tokens << ", N = " << p.n << ", K = " << p.k
                                                           << ", E = " << p.num_experts << " with these strides");
  const typename Kernel::Params params = Kernel::to_underlying_arguments(args, workspace);
  launch_one_cta_per_sm<Kernel>(params, device, stream, "the sm90 MoE kernel");
}

}  // namespace cutlass_moe::sm90
