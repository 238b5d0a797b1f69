// Zero fills over the rows the count rule (expert_rows.hpp) assigns, read on the device:
//   - K == 0: every computed row of out is zero. CUTLASS's mainloop does not take an empty K, so
//     zero_owned_rows writes the zeros instead, over the rows the GEMM would have written;
//   - a new output: zero_unowned_rows writes zeros to the rows no expert owns, so that the result
//     is fully defined at the cost of the tail alone.
// Both need where the owned rows end: min(sum of clamped counts, T), the last expert's end by the
// rule, which every CTA computes with one block-wide reduction.
#include "zero_rows.h"

#include <algorithm>

#include <cub/block/block_reduce.cuh>

#include "check.h"
#include "expert_rows.hpp"
#include "launch.h"

namespace cutlass_moe {
namespace {

constexpr int kThreads = 256;

template <class Count>
__device__ int64_t owned_rows_end(const Count* __restrict__ tokens_per_expert, int64_t num_experts, int64_t num_tokens) {
  using BlockReduce = cub::BlockReduce<int64_t, kThreads>;
  __shared__ typename BlockReduce::TempStorage storage;
  __shared__ int64_t end;
  int64_t sum = 0;  // at most E * T: no overflow for E, T < 2^31
  for (int64_t e = threadIdx.x; e < num_experts; e += kThreads) {
    sum += clamp_count(static_cast<int64_t>(tokens_per_expert[e]), num_tokens);
  }
  sum = BlockReduce(storage).Sum(sum);
  if (threadIdx.x == 0) end = sum < num_tokens ? sum : num_tokens;
  __syncthreads();
  return end;
}

// Zeros rows [first, last) of out (n columns, 2-byte elements, 16-byte vectors: n and ldout are
// multiples of 8, out 16-byte aligned).
__device__ void zero_rows(uint16_t* out, int64_t n, int64_t ldout, int64_t first, int64_t last) {
  const int64_t vectors_per_row = n / 8;
  const int64_t vectors = (last - first) * vectors_per_row;
  for (int64_t v = blockIdx.x * int64_t(kThreads) + threadIdx.x; v < vectors; v += int64_t(gridDim.x) * kThreads) {
    const int64_t row = first + v / vectors_per_row;
    *reinterpret_cast<uint4*>(out + row * ldout + (v % vectors_per_row) * 8) = uint4{0, 0, 0, 0};  // +0.0
  }
}

// owned: zero [0, end), else [end, T).
template <class Count>
__global__ void __launch_bounds__(kThreads)
zero_rows_kernel(const Count* __restrict__ tokens_per_expert, int64_t num_experts, int64_t num_tokens, uint16_t* out,
                 int64_t n, int64_t ldout, bool owned) {
  const int64_t end = owned_rows_end(tokens_per_expert, num_experts, num_tokens);
  zero_rows(out, n, ldout, owned ? 0 : end, owned ? end : num_tokens);
}

void launch_zero_rows(const MoeGemmProblem& p, bool owned, cudaStream_t stream) {
  const int64_t n = out_columns(p);
  if (p.num_tokens == 0 || n == 0) return;
  // Enough CTAs to stream the rows; each first reads the E counts (a few KB, from L2).
  const int64_t vectors = p.num_tokens * (n / 8);
  const int blocks = static_cast<int>(std::min<int64_t>((vectors + kThreads - 1) / kThreads, 1024));
  with_typed_counts(p.count_type, p.tokens_per_expert, [&](auto const* counts) {
    zero_rows_kernel<<<blocks, kThreads, 0, stream>>>(counts, p.num_experts, p.num_tokens,
                                                      static_cast<uint16_t*>(p.out), n, p.ldout, owned);
  });
  CUTLASS_MOE_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

void launch_zero_computed_rows(const MoeGemmProblem& p, cudaStream_t stream) { launch_zero_rows(p, true, stream); }

void zero_unowned_rows(const MoeGemmProblem& p, cudaStream_t stream) {
  check_problem(p);
  launch_zero_rows(p, false, stream);
}

}  // namespace cutlass_moe
