// sm80 MoE-specialized GEMM: the MoE idea on CUTLASS 2.x parts. One launch, no per-expert arrays.
//
// A persistent grid (SMs x occupancy CTAs) walks the tiles with the same device-side scheduler as
// the sm90 MoE kernel (moe_tile_scheduler.hpp), which turns tokens_per_expert into each tile's
// expert, row offset and row count. Each expert's A/B/D pointers come from the base pointers:
// x + row_start * ldx, weights + expert * expert_stride, out + row_start * ldout. CUTLASS's
// predicated tile iterators clip A and D at the expert's rows, so nothing outside the expert's rows
// is read or written. The mainloop (cp.async multistage, mma.sync) and the epilogue are the
// kernel-level Mma and Epilogue of CUTLASS's DefaultGemmGrouped for the same config.
#pragma once

#include <cutlass/device_kernel.h>

#include "check.h"
#include "kernel_families.h"
#include "launch.h"
#include "moe_tile_scheduler.hpp"
#include "sm80/sm80_common.cuh"

namespace cutlass_moe::sm80 {

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
struct MoeGemmKernel : KernelTypes<kDType, kLayout, kConfig> {
  using T = KernelTypes<kDType, kLayout, kConfig>;
  // Only the Mma and Epilogue of CUTLASS's grouped kernel are used: the tile loop below replaces its.
  using GroupedKernel = typename T::GroupedKernel;
  using Mma      = typename GroupedKernel::Mma;
  using Epilogue = typename GroupedKernel::Epilogue;
  using Element  = typename T::Element;
  static constexpr int kTileM   = T::ThreadblockShape::kM;
  static constexpr int kTileN   = T::ThreadblockShape::kN;
  static constexpr int kTileK   = T::ThreadblockShape::kK;
  static constexpr int kThreads = GroupedKernel::kThreadCount;
  using Scheduler = MoeTileScheduler<kTileM>;

  struct Params {
    typename Scheduler::Params scheduler;
    typename Mma::IteratorA::Params params_a;  // from the leading dimensions, built on the host
    typename Mma::IteratorB::Params params_b;
    typename Epilogue::OutputTileIterator::Params params_d;
    typename T::EpilogueOp::Params output_op;
    const Element* x;
    int64_t ldx;
    const Element* weights;
    int64_t expert_stride;
    Element* out;
    int64_t ldout;
    int n;
    int k;
  };

  union SharedStorage {
    typename Mma::SharedStorage main_loop;
    typename Epilogue::SharedStorage epilogue;
  };

  CUTLASS_DEVICE void operator()(Params const& params, SharedStorage& shared) {
    const int thread_idx = threadIdx.x;
    const int warp_idx = cutlass::canonical_warp_idx_sync();
    const int lane_idx = threadIdx.x % 32;
    const int k_iterations = (params.k + kTileK - 1) / kTileK;
    Scheduler scheduler(params.scheduler);  // every warp walks the experts itself

    for (int64_t index = blockIdx.x;; index += gridDim.x) {
      const MoeTile tile = scheduler.tile(index);
      if (!tile.valid) break;
      const int row_offset = tile.m_tile * kTileM;
      const int col_offset = tile.n_tile * kTileN;

      // A and D are the expert's rows only: the iterators predicate off rows >= tile.rows.
      typename Mma::IteratorA iterator_a(params.params_a,
                                         const_cast<Element*>(params.x) + int64_t(tile.row_start) * params.ldx,
                                         {tile.rows, params.k}, thread_idx, {row_offset, 0});
      typename Mma::IteratorB iterator_b(params.params_b,
                                         const_cast<Element*>(params.weights) + tile.expert * params.expert_stride,
                                         {params.k, params.n}, thread_idx, {0, col_offset});
      typename Mma::FragmentC accumulators;
      accumulators.clear();

      __syncthreads();  // the previous tile's epilogue is done with shared memory
      Mma mma(shared.main_loop, thread_idx, warp_idx, lane_idx);
      mma(k_iterations, accumulators, iterator_a, iterator_b, accumulators);

      Element* out = params.out + int64_t(tile.row_start) * params.ldout;
      typename Epilogue::OutputTileIterator iterator_d(params.params_d, out, {tile.rows, params.n}, thread_idx,
                                                       {row_offset, col_offset});
      typename T::EpilogueOp output_op(params.output_op);
      Epilogue epilogue(shared.epilogue, thread_idx, warp_idx, lane_idx);
      epilogue(output_op, iterator_d, accumulators, iterator_d);  // source unused (alpha-only op)
    }
  }
};

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
size_t MoeGemmInstance<kDType, kLayout, kConfig>::workspace_size(int64_t, int) {
  return 0;
}

template <DType kDType, WeightLayout kLayout, KernelConfig kConfig>
void MoeGemmInstance<kDType, kLayout, kConfig>::run(const MoeGemmProblem& p, void*, size_t, int sm_count,
                                                    cudaStream_t stream) {
  using K = MoeGemmKernel<kDType, kLayout, kConfig>;
  using Element = typename K::Element;
  constexpr int kSmemBytes = static_cast<int>(sizeof(typename K::SharedStorage));

  int device = 0;
  CUTLASS_MOE_CHECK_CUDA(cudaGetDevice(&device));
  const int blocks_per_sm = persistent_blocks_per_sm(cutlass::Kernel<K>, K::kThreads, kSmemBytes, device);

  const int t = static_cast<int>(p.num_tokens), n = static_cast<int>(p.n);
  const int e = static_cast<int>(p.num_experts);
  const int tiles_n = (n + K::kTileN - 1) / K::kTileN;
  typename K::Params params{
      {p.tokens_per_expert, p.count_type == IndexType::kInt64, e, t, tiles_n},
      typename K::Mma::IteratorA::Params(typename K::LayoutA(p.ldx)),
      typename K::Mma::IteratorB::Params(typename K::LayoutB(p.ldw)),
      typename K::Epilogue::OutputTileIterator::Params(typename K::LayoutC(p.ldout)),
      typename K::EpilogueOp::Params(1.0f),
      static_cast<const Element*>(p.x), p.ldx,
      static_cast<const Element*>(p.weights), p.expert_stride,
      static_cast<Element*>(p.out), p.ldout,
      n, static_cast<int>(p.k)};

  const int grid = persistent_grid(int64_t(sm_count) * blocks_per_sm, t, e, tiles_n, K::kTileM);
  cutlass::Kernel<K><<<grid, K::kThreads, kSmemBytes, stream>>>(params);
  CUTLASS_MOE_CHECK_CUDA(cudaGetLastError());
}

}  // namespace cutlass_moe::sm80
