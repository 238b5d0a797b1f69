// Host helpers shared by the kernel launchers.
#pragma once

#include <cstdint>

#include "cutlass_moe/cutlass_moe.h"

namespace cutlass_moe {

// Calls fn(counts) with tokens_per_expert as a typed device pointer.
template <class Fn>
void with_typed_counts(IndexType type, const void* tokens_per_expert, Fn&& fn) {
  if (type == IndexType::kInt32) {
    fn(static_cast<const int32_t*>(tokens_per_expert));
  } else {
    fn(static_cast<const int64_t*>(tokens_per_expert));
  }
}

}  // namespace cutlass_moe
