// Launch of the sm90 MoE weight-gradient kernel (sm90_wgrad_kernel.hpp) for one MoeWgradProblem:
// one launch on the caller's stream, no workspace, counts read on the device (capturable in a CUDA
// graph; a replay picks up new counts).
#pragma once

#include "sm90/sm90_tma_encode.hpp"  // first: routes every TMA encode through a checked call

#include "check.h"
#include "kernel_families.h"
#include "launch_facts.h"
#include "sm90/sm90_launch.cuh"
#include "sm90/sm90_wgrad_kernel.hpp"
#include "wgrad_common.cuh"

namespace cutlass_moe::sm90 {

template <DType kDType, DType kOutDType, KernelConfig kConfig>
using WgradKernelOf =
    MoeWgradKernel<typename ElementOf<kDType>::type, typename ElementOf<kOutDType>::type, ConfigTraits<kConfig>>;

template <DType kDType, DType kOutDType, KernelConfig kConfig>
size_t WgradMoeInstance<kDType, kOutDType, kConfig>::workspace_size(int64_t, int) {
  return WgradKernelOf<kDType, kOutDType, kConfig>::get_workspace_size({});
}

template <DType kDType, DType kOutDType, KernelConfig kConfig>
void WgradMoeInstance<kDType, kOutDType, kConfig>::run(const MoeWgradProblem& p, void* workspace, size_t,
                                                       int sm_count, cudaStream_t stream) {
  using Kernel = WgradKernelOf<kDType, kOutDType, kConfig>;
  using Element = typename Kernel::Element;
  using ElementOut = typename Kernel::ElementOut;
  const WgradOperands op = wgrad_operands(p);
  int device = 0;
  CUTLASS_MOE_CHECK_CUDA(cudaGetDevice(&device));

  typename Kernel::Arguments args{};
  args.problem = {static_cast<int>(p.num_tokens), static_cast<int>(op.m), static_cast<int>(op.n),
                  static_cast<int>(p.num_experts)};
  // With T = 0 no operand row is ever read; dW's address stands in for the descriptors' base.
  args.ptr_a = static_cast<Element const*>(p.num_tokens > 0 ? op.a : p.out);
  args.lda = op.lda;
  args.ptr_b = static_cast<Element const*>(p.num_tokens > 0 ? op.b : p.out);
  args.ldb = op.ldb;
  const int64_t rows_per_expert = p.num_experts > 0 ? p.num_tokens / p.num_experts : 0;
  // With fewer rows per expert than one K block, a tile's MMAs take a quarter of its store's time
  // and the kernel is a stream of dW's writes: stored with EVICT_FIRST, dsv3-decode's wgrad (4 rows
  // per expert, 15 GB of dW) is 7% faster. Where the MMAs count (qwen3-30b-prefill's wgrad, 256
  // rows per expert) the hint was 2.4% slower, so it stays off there (benchmarks/NOTES.md,
  // thirty-eighth session).
  args.epilogue = {static_cast<ElementOut*>(p.out), p.ldw, p.expert_stride, p.accumulate,
                   /*evict_first=*/rows_per_expert < Kernel::kTileK};
  args.tokens_per_expert = p.tokens_per_expert;
  args.counts_are_int64 = p.count_type == IndexType::kInt64;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  // The tile order inside an expert. With m fastest (dW's rows first), the CTAs running together
  // share B's column tile and read all of A_e (M x the expert's rows); with n fastest, the reverse.
  // The operand read whole must stay in L2 until the next column (or row) of tiles comes back to
  // it, else each pass re-reads it from DRAM. Rows first unless A_e, at the average rows per
  // expert, outgrows half of L2 while B_e is the smaller one: Mixtral's wgrad with (E, N, K)
  // weights (A_e = grad_out_e, 58 MB) is 14% faster columns first; with (E, K, N) weights the same
  // shape is 15% slower columns first (benchmarks/NOTES.md).
  args.n_fastest = op.m > op.n && op.m * rows_per_expert * int64_t(sizeof(Element)) > device_facts(device).l2_bytes / 2;

  CUTLASS_MOE_CHECK(Kernel::can_implement(args), Status::kInvalidArgument,
                    "the sm90 MoE wgrad kernel cannot take T = " << p.num_tokens << ", M = " << op.m << ", N = "
                                                                 << op.n << ", E = " << p.num_experts
                                                                 << " with these strides");
  const typename Kernel::Params params = Kernel::to_underlying_arguments(args, workspace);
  launch_one_cta_per_sm<Kernel>(params, device, stream, "the sm90 MoE wgrad kernel");
}

}  // namespace cutlass_moe::sm90
