// Zero fills of whole output rows on the device, shared by the zero-fill kernels (zero_rows.cu) and
// the MoE kernels, which zero a new output's unowned rows in their own launch.
#pragma once

#include <cstdint>

#include <cutlass/cutlass.h>

namespace cutlass_moe {

// Zeros rows [first, last) of out (cols 2-byte elements per row, leading dimension ld; cols, ld
// and out in whole 16-byte vectors). Thread `worker` of `workers` writes every workers-th vector.
CUTLASS_DEVICE void zero_rows(void* out, int64_t cols, int64_t ld, int64_t first, int64_t last, int64_t worker,
                              int64_t workers) {
  const int64_t vectors_per_row = cols / 8;
  const int64_t vectors = (last - first) * vectors_per_row;
  auto* base = static_cast<uint16_t*>(out);
  for (int64_t v = worker; v < vectors; v += workers) {
    const int64_t row = first + v / vectors_per_row;
    *reinterpret_cast<uint4*>(base + row * ld + (v % vectors_per_row) * 8) = uint4{0, 0, 0, 0};  // +0.0
  }
}

}  // namespace cutlass_moe
