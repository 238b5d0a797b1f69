// What the wgrad families share: the problem as one GEMM per expert, D[e] = A_e . B_e with the
// reduction over the expert's rows, whatever the output layout.
//
// dW[e] = x_e^T . grad_out_e. Stored (E, K, N) (N contiguous) it is A = x^T (K x rows, K
// contiguous: column-major), B = grad_out (rows x N, row-major), D row-major K x N. Stored (E, N, K)
// it is the transpose, dW[e]^T = grad_out_e^T . x_e: A = grad_out^T, B = x, D row-major N x K. So
// one kernel type (A column-major, B row-major, D row-major) serves both layouts.
//
// An expert with no rows is no GEMM at all (m = 0 in its group: no tiles): a K = 0 tile would leave
// CUTLASS 3's accumulators undefined and makes CUTLASS 2.x's multistage prologue load past the
// operands. Its dW is zeroed by zero_empty_experts instead (or left as it is when accumulating).
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "check.h"
#include "cutlass_moe/cutlass_moe.h"

namespace cutlass_moe {

struct WgradOperands {
  const void* a;  // expert e's A starts at a + row_start * lda (column-major, M contiguous)
  int64_t lda;
  const void* b;  // expert e's B starts at b + row_start * ldb (row-major, N contiguous)
  int64_t ldb;
  int64_t m;      // rows of D
  int64_t n;      // columns of D
};

inline WgradOperands wgrad_operands(const MoeWgradProblem& p) {
  if (p.weight_layout == WeightLayout::kKN) return {p.x, p.ldx, p.grad_out, p.ld_grad_out, p.k, p.n};
  return {p.grad_out, p.ld_grad_out, p.x, p.ldx, p.n, p.k};
}

// Zeros D[e] (m x n, row-major, leading dimension ldd) of every expert with no rows (rows[e], written
// by the family's argument-building kernel). Grid: (CTAs per expert, experts at a time); 16-byte
// stores (rows are whole 16-byte vectors: check_wgrad_layout).
template <class Element>
__global__ void zero_empty_experts(const int64_t* __restrict__ rows, int64_t num_experts, Element* out, int64_t m,
                                   int64_t n, int64_t ldd, int64_t expert_stride) {
  constexpr int kVector = 16 / sizeof(Element);
  const int64_t vectors_per_row = n / kVector;
  for (int64_t e = blockIdx.y; e < num_experts; e += gridDim.y) {
    if (rows[e] != 0) continue;
    Element* d = out + e * expert_stride;
    for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < m * vectors_per_row;
         v += int64_t(gridDim.x) * blockDim.x) {
      *reinterpret_cast<uint4*>(d + (v / vectors_per_row) * ldd + (v % vectors_per_row) * kVector) = uint4{0, 0, 0, 0};
    }
  }
}

template <class Element>
void launch_zero_empty_experts(const int64_t* rows, const MoeWgradProblem& p, const WgradOperands& op,
                               cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t vectors = op.m * (op.n * int64_t(sizeof(Element)) / 16);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((vectors + kThreads - 1) / kThreads, 64)),
                  static_cast<unsigned>(std::min<int64_t>(p.num_experts, 65535)));
  zero_empty_experts<<<grid, kThreads, 0, stream>>>(rows, p.num_experts, static_cast<Element*>(p.out), op.m, op.n,
                                                     p.ldw, p.expert_stride);
  CUTLASS_MOE_CHECK_CUDA(cudaGetLastError());
}

}  // namespace cutlass_moe
