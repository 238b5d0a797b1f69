// Every TMA descriptor an sm90 translation unit encodes (ours for the MoE family's ragged views, and
// CUTLASS's own in the grouped family) goes through checked_cuTensorMapEncodeTiled below, which
// throws cutlass_moe::Error with the descriptor's parameters when the driver rejects them. cute's
// make_tma_copy otherwise prints to stderr and goes on, in a release build, with a zeroed descriptor.
//
// The hook is CUTLASS's own indirection for driver calls (cutlass/cuda_host_adapter.hpp,
// CUTLASS_CUDA_DRIVER_WRAPPER_CALL), redefined here. It only takes effect if this header comes
// before every CUTLASS and CuTe header of the translation unit, which the #error enforces.
#pragma once

#if defined(CUTLASS_CUDA_DRIVER_WRAPPER_CALL)
#error "include sm90/sm90_tma_encode.hpp before any CUTLASS or CuTe header"
#endif

#include <cutlass/cuda_host_adapter.hpp>

#include "check.h"

namespace cutlass_moe::detail {

inline CUresult checked_cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank,
                                               void* address, const cuuint64_t* dims, const cuuint64_t* strides,
                                               const cuuint32_t* box, const cuuint32_t* element_strides,
                                               CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                               CUtensorMapL2promotion l2_promotion, CUtensorMapFloatOOBfill fill) {
  // The driver encodes in the calling thread's current context. A thread that has made no runtime
  // call that binds one (PyTorch's autograd engine runs backward on such threads) has none, and the
  // encode fails with CUDA_ERROR_INVALID_CONTEXT: bind the current device's primary context first.
  int device = 0;
  CUTLASS_MOE_CHECK_CUDA(cudaGetDevice(&device));
  CUTLASS_MOE_CHECK_CUDA(cudaSetDevice(device));
  const CUresult result = cutlass::call_cuTensorMapEncodeTiled(map, type, rank, address, dims, strides, box,
                                                               element_strides, interleave, swizzle, l2_promotion, fill);
  if (result != CUDA_SUCCESS) {
    std::ostringstream os;
    os << "TMA descriptor encode failed (CUresult " << static_cast<int>(result) << "): address " << address
       << ", dims (";
    for (cuuint32_t i = 0; i < rank; ++i) os << (i ? ", " : "") << dims[i];
    os << "), byte strides (";
    for (cuuint32_t i = 0; i + 1 < rank; ++i) os << (i ? ", " : "") << strides[i];
    os << "), box (";
    for (cuuint32_t i = 0; i < rank; ++i) os << (i ? ", " : "") << box[i];
    os << ")";
    CUTLASS_MOE_CHECK(false, Status::kCudaError, os.str());
  }
  return result;
}

}  // namespace cutlass_moe::detail

#undef CUTLASS_CUDA_DRIVER_WRAPPER_CALL
#define CUTLASS_CUDA_DRIVER_WRAPPER_CALL(func) ::cutlass_moe::detail::checked_##func
