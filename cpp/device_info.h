// What the dispatcher and the heuristics need to know about a device, queried once per device:
// the attribute calls cost microseconds that a decode step cannot spare.
#pragma once

#include <array>
#include <atomic>

#include <cuda_runtime_api.h>

#include "check.h"

namespace cutlass_moe {

struct DeviceInfo {
  int sm_count;
  int cc;  // 10 * major + minor
};

inline DeviceInfo device_info(int device) {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<int>, kMaxDevices> sm_counts{};
  static std::array<std::atomic<int>, kMaxDevices> ccs{};
  CUTLASS_MOE_CHECK_ARG(device >= 0 && device < kMaxDevices, "device " << device << " out of range");
  if (sm_counts[device].load() == 0) {
    int sms = 0, major = 0, minor = 0;
    CUTLASS_MOE_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    CUTLASS_MOE_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    CUTLASS_MOE_CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    ccs[device].store(10 * major + minor);
    sm_counts[device].store(sms);  // last: a non-zero sm_count means both are set
  }
  return {sm_counts[device].load(), ccs[device].load()};
}

}  // namespace cutlass_moe
