// Launch of a persistent sm90 kernel class (the MoE forward and wgrad kernels): one CTA per SM,
// which takes all of shared memory, started by cutlass::device_kernel on the caller's stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cutlass/device_kernel.h>

#include "check.h"
#include "launch_facts.h"

namespace cutlass_moe::sm90 {

// `name` is the kernel as error messages call it. programmatic: launch as a programmatic dependent
// of the stream's previous kernel (PDL): its CTAs may start once that kernel's CTAs have all
// triggered (griddepcontrol.launch_dependents) or exited, so the kernel must griddepcontrol.wait
// before it touches anything the previous kernel writes and before it exits.
template <class Kernel>
void launch_one_cta_per_sm(typename Kernel::Params const& params, int device, cudaStream_t stream, const char* name,
                           bool programmatic = false) {
  const void* kernel = reinterpret_cast<const void*>(&cutlass::device_kernel<Kernel>);
  const int ctas_per_sm = resident_ctas_per_sm(kernel, Kernel::MaxThreadsPerBlock, Kernel::SharedStorageSize, device);
  CUTLASS_MOE_CHECK(ctas_per_sm == 1, Status::kNotSupported, name << " expects one CTA per SM, got " << ctas_per_sm);
  cudaLaunchConfig_t config{};
  config.gridDim = Kernel::get_grid_shape(params);
  config.blockDim = Kernel::get_block_shape();
  config.dynamicSmemBytes = Kernel::SharedStorageSize;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = programmatic ? 1 : 0;
  CUTLASS_MOE_CHECK_CUDA(cudaLaunchKernelEx(&config, cutlass::device_kernel<Kernel>, params));
}

}  // namespace cutlass_moe::sm90
