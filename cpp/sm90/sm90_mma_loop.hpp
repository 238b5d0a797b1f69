// The WGMMA mainloop of the sm90 MoE kernels where they need more than the collective's mma():
// accumulating onto seeded accumulators (the forward's bias), and work done while the MMAs run (the
// deferred stores of both kernels' cooperative tiles).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

namespace cutlass_moe::sm90 {

// The collective's pipelined loop, as CollectiveMainloop::mma() runs it: one K block's MMAs in
// flight, each stage released once the next block's MMAs are issued and the block's own are done,
// the last stage by the collective's mma_tail. The loop:
//   - accumulates onto accum as it is (accumulate) or from zero: the first MMA's scale-d is a
//     run-time predicate, so both start through the same instructions, and no other instruction
//     writes the accumulators in between (ptxas would serialize the WGMMAs: C7515, seen where the
//     zeros came from a clear() instead);
//   - calls hook(k_tile) while K block k_tile's MMAs run: right after they are issued, or with
//     kHookAfterRelease once the previous block's MMAs are done and its stage released, so that
//     the producer refills the stage meanwhile. Measured (H200, benchmarks/NOTES.md): the forward's
//     deferred stores (4 stages, long K) are 1-2% faster right after the issue, the wgrad's (3
//     stages, a few K blocks per tile) 5% faster after the release. The first kPeeled K blocks are
//     unrolled and call peeled_hook(k_tile) with k_tile known at compile time, so that the
//     registers it reads are dead in the rest of the loop; they run unconditionally (a path where
//     some of them may not run drew C7515, and so did a second path for such tiles): the caller
//     ensures k_tiles >= kPeeled. The others call loop_hook(k_tile). Neither may touch accum.
// mma_thread: the thread's index in the tiled MMA (both consumers: 0..255; pingpong: 0..127).
// last_k_steps (kTrimLast only): how many of the last K block's MMA steps (k-slices of the
// instruction's K) to issue (at least 1); the others are skipped. The wgrad's last block of an
// expert holds its last rows first and zeros after them, so the steps past those rows would add
// exact zeros. Only the last block's WGMMAs are guarded: ptxas adds a warpgroup.arrive around each
// guarded WGMMA (C7519, noted for the last block alone now), and with the guards in every block of
// the loop the wgrad ran 6-17% slower, bitwise the same (benchmarks/NOTES.md, "The wgrad's guarded
// MMAs").
template <class CollectiveMainloop, int kPeeled, bool kHookAfterRelease, bool kTrimLast = false, class Pipeline,
          class PipelineState, class Accumulators, class PeeledHook, class LoopHook>
CUTLASS_DEVICE void mma_pipelined(Pipeline& pipeline, PipelineState read_state, Accumulators& accum, int k_tiles,
                                  int mma_thread, typename CollectiveMainloop::TensorStorage& tensors,
                                  bool accumulate, PeeledHook&& peeled_hook, LoopHook&& loop_hook,
                                  int last_k_steps = 1 << 30) {
  using namespace cute;
  using TiledMma = typename CollectiveMainloop::TiledMma;
  static_assert(CollectiveMainloop::K_PIPE_MMAS == 1, "one K block in flight, as the collective");
  static_assert(!kTrimLast || kPeeled == 0, "the trimmed last block is not a peeled one");
  Tensor sA = make_tensor(make_smem_ptr(tensors.smem_A.data()), typename CollectiveMainloop::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(tensors.smem_B.data()), typename CollectiveMainloop::SmemLayoutB{});
  TiledMma tiled_mma;
  // The shared memory descriptors depend on the warp group alone: warp-uniform, as the collective.
  const int warp_group = __shfl_sync(0xffffffff, mma_thread / cutlass::NumThreadsPerWarpGroup, 0);
  auto thread_mma = tiled_mma.get_slice(warp_group * cutlass::NumThreadsPerWarpGroup);
  Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
  Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)
  tiled_mma.accumulate_ = accumulate ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero;
  PipelineState release_state = read_state;
  auto k_block = [&](int k_tile, auto&& hook, auto trimmed) {
    pipeline.consumer_wait(read_state, pipeline.consumer_try_wait(read_state));
    const int stage = read_state.index();
    warpgroup_fence_operand(accum);
    warpgroup_arrive();
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < size<2>(tCrA); ++k) {
      if constexpr (decltype(trimmed)::value) {
        if (k < last_k_steps) {  // warp-uniform
          cute::gemm(tiled_mma, tCrA(_, _, k, stage), tCrB(_, _, k, stage), accum);
          tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        }
      } else {
        cute::gemm(tiled_mma, tCrA(_, _, k, stage), tCrB(_, _, k, stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
    }
    warpgroup_commit_batch();
    if constexpr (!kHookAfterRelease) hook(k_tile);
    warpgroup_wait<1>();  // the previous K block's MMAs are done: release its stage
    warpgroup_fence_operand(accum);
    if (k_tile > 0) {
      pipeline.consumer_release(release_state);
      ++release_state;
    }
    if constexpr (kHookAfterRelease) hook(k_tile);
    ++read_state;
  };
  warpgroup_fence_operand(accum);
  CUTLASS_PRAGMA_UNROLL
  for (int k_tile = 0; k_tile < kPeeled; ++k_tile) k_block(k_tile, peeled_hook, false_type{});
  CUTLASS_PRAGMA_NO_UNROLL
  for (int k_tile = kPeeled; k_tile < k_tiles - int{kTrimLast}; ++k_tile) k_block(k_tile, loop_hook, false_type{});
  if constexpr (kTrimLast) k_block(k_tiles - 1, loop_hook, true_type{});  // the caller ensures k_tiles >= 1
  warpgroup_fence_operand(accum);
}

// mma_pipelined's stage walk without its MMAs: each K block's stage is waited for and the previous
// one released, in the same order (the last one by the collective's mma_tail, as after
// mma_pipelined). A consumer whose rows of a tile are all padding (the cooperative forward's half
// tiles) takes part in the pipeline this way; a separate function, not a flag inside mma_pipelined,
// because a branch around the WGMMAs made ptxas serialize them (C7520).
template <class Pipeline, class PipelineState>
CUTLASS_DEVICE void stages_without_mma(Pipeline& pipeline, PipelineState read_state, int k_tiles) {
  PipelineState release_state = read_state;
  CUTLASS_PRAGMA_NO_UNROLL
  for (int k_tile = 0; k_tile < k_tiles; ++k_tile) {
    pipeline.consumer_wait(read_state, pipeline.consumer_try_wait(read_state));
    if (k_tile > 0) {
      pipeline.consumer_release(release_state);
      ++release_state;
    }
    ++read_state;
  }
}

}  // namespace cutlass_moe::sm90
