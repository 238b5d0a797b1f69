// Host helpers for launching the persistent kernels.
#pragma once

#include <mutex>

#include <cuda_runtime_api.h>

#include "check.h"

namespace cutlass_moe {

// CTAs of `kernel` that fit on one SM of `device` with `smem_bytes` of dynamic shared memory. The
// first call per device raises the kernel's dynamic shared memory limit and queries occupancy;
// later calls cost a lookup.
template <class KernelFn>
int persistent_blocks_per_sm(KernelFn* kernel, int threads, int smem_bytes, int device) {
  constexpr int kMaxDevices = 64;
  static std::once_flag flags[kMaxDevices];
  static int blocks[kMaxDevices];
  static cudaError_t errors[kMaxDevices];
  CUTLASS_MOE_CHECK_ARG(device >= 0 && device < kMaxDevices, "device " << device << " out of range");
  std::call_once(flags[device], [&] {
    cudaError_t status = cudaSuccess;
    if (smem_bytes >= 48 * 1024) {
      status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    }
    if (status == cudaSuccess) {
      status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks[device], kernel, threads, smem_bytes);
    }
    errors[device] = status;
  });
  CUTLASS_MOE_CHECK_CUDA(errors[device]);
  CUTLASS_MOE_CHECK(blocks[device] > 0, Status::kNotSupported,
                    "kernel with " << smem_bytes << " bytes of shared memory does not fit on device " << device);
  return blocks[device];
}

// Calls fn(counts) with tokens_per_expert as a typed device pointer.
template <class Fn>
void with_typed_counts(const MoeGemmProblem& p, Fn&& fn) {
  if (p.count_type == IndexType::kInt32) {
    fn(static_cast<const int32_t*>(p.tokens_per_expert));
  } else {
    fn(static_cast<const int64_t*>(p.tokens_per_expert));
  }
}

}  // namespace cutlass_moe
