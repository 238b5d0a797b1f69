// K == 0: every computed row of out is zero. CUTLASS's mainloop does not take an empty K, so this
// kernel writes the zeros instead, over the same clamped rows the GEMM would have written.
#include "zero_rows.h"

#include "check.h"
#include "expert_rows.hpp"
#include "launch.h"

namespace cutlass_moe {
namespace {

template <class Count>
__global__ void zero_computed_rows(const Count* __restrict__ tokens_per_expert, int64_t num_experts,
                                   int64_t num_tokens, uint16_t* out, int64_t n, int64_t ldout) {
  // The rows written end where the last expert's rows end; one thread walks the experts (E is
  // small next to T * N).
  __shared__ int64_t rows;
  if (threadIdx.x == 0) {
    ExpertRows last{0, 0};
    for (int64_t e = 0; e < num_experts && last.start + last.rows < num_tokens; ++e) {
      last = expert_rows(last.start + last.rows, clamp_count(tokens_per_expert[e], num_tokens), num_tokens);
    }
    rows = last.start + last.rows;
  }
  __syncthreads();
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
      out[r * ldout + c] = 0;  // +0.0 in both fp16 and bf16
    }
  }
}

}  // namespace

void launch_zero_computed_rows(const MoeGemmProblem& p, cudaStream_t stream) {
  int64_t blocks = p.num_tokens < 1024 ? p.num_tokens : 1024;
  if (blocks == 0 || p.n == 0) return;
  auto* out = static_cast<uint16_t*>(p.out);
  with_typed_counts(p, [&](auto const* counts) {
    zero_computed_rows<<<blocks, 256, 0, stream>>>(counts, p.num_experts, p.num_tokens, out, p.n, p.ldout);
  });
  CUTLASS_MOE_CHECK_CUDA(cudaGetLastError());
}

}  // namespace cutlass_moe
