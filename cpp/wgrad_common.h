// What the wgrad families share: the problem as one GEMM per expert, D[e] = A_e . B_e with the
// reduction over the expert's rows, whatever the output layout.
//
// dW[e] = x_e^T . grad_out_e. Stored (E, K, N) (N contiguous) it is A = x^T (K x rows, K
// contiguous: column-major), B = grad_out (rows x N, row-major), D row-major K x N. Stored (E, N, K)
// it is the transpose, dW[e]^T = grad_out_e^T . x_e: A = grad_out^T, B = x, D row-major N x K. So
// one kernel type (A column-major, B row-major, D row-major) serves both layouts.
#pragma once

#include <cstdint>

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

}  // namespace cutlass_moe
