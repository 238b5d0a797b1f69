// Launch of a persistent sm90 kernel class (the MoE forward and wgrad kernels): one CTA per SM,
// which takes all of shared memory, started by cutlass::device_kernel on the caller's stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cutlass/device_kernel.h>

#include "check.h"
#include "launch_facts.h"

namespace cutlass_moe::sm90 {

// `name` is the kernel as error messages call it.
template <class Kernel>
void launch_one_cta_per_sm(typename Kernel::Params const& params, int device, cudaStream_t stream, const char* name) {
  const void* kernel = reinterpret_cast<const void*>(&cutlass::device_kernel<Kernel>);
  const int ctas_per_sm = resident_ctas_per_sm(kernel, Kernel::MaxThreadsPerBlock, Kernel::SharedStorageSize, device);
  CUTLASS_MOE_CHECK(ctas_per_sm == 1, Status::kNotSupported, name << " expects one CTA per SM, got " << ctas_per_sm);
  cutlass::device_kernel<Kernel>
      <<<Kernel::get_grid_shape(params), Kernel::get_block_shape(), Kernel::SharedStorageSize, stream>>>(params);
  CUTLASS_MOE_CHECK_CUDA(cudaGetLastError());
}

}  // namespace cutlass_moe::sm90
