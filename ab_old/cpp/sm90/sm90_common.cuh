// Pieces both sm90 families share: configs, strides.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/layout/matrix.h>
#include <cutlass/numeric_types.h>

#include "cutlass_moe/cutlass_moe.h"
#include "cutlass_types.cuh"
#include "sm90/sm90_configs.cuh"

namespace cutlass_moe::sm90 {

// A rank-2 or rank-3 CuTe stride whose one dynamic mode among the first two is the leading
// dimension `ld` (the other is the static unit stride) and whose third mode, if dynamic, is `batch`.
template <class Stride>
CUTE_HOST_DEVICE Stride leading_stride(int64_t ld, int64_t batch = 0) {
  Stride stride{};
  if constexpr (cute::is_static_v<cute::tuple_element_t<0, Stride>>) {
    cute::get<1>(stride) = ld;
  } else {
    cute::get<0>(stride) = ld;
  }
  if constexpr (cute::tuple_size_v<Stride> > 2) {
    if constexpr (!cute::is_static_v<cute::tuple_element_t<2, Stride>>) {
      cute::get<2>(stride) = batch;
    }
  }
  return stride;
}

}  // namespace cutlass_moe::sm90
