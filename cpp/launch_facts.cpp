#include "launch_facts.h"

#include <map>
#include <mutex>
#include <tuple>

#include <cuda_runtime_api.h>

#include "check.h"

namespace cutlass_moe {
namespace {

std::mutex& facts_mutex() {
  static std::mutex mutex;
  return mutex;
}

}  // namespace

DeviceFacts device_facts(int device) {
  static std::map<int, DeviceFacts> cache;
  {
    std::lock_guard<std::mutex> lock(facts_mutex());
    auto it = cache.find(device);
    if (it != cache.end()) return it->second;
  }
  int count = 0;
  CUTLASS_MOE_CHECK_CUDA(cudaGetDeviceCount(&count));
  CUTLASS_MOE_CHECK_ARG(device >= 0 && device < count, "device " << device << " out of range (" << count << " devices)");
  int sms = 0, major = 0, minor = 0;
  CUTLASS_MOE_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CUTLASS_MOE_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUTLASS_MOE_CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  int memory_khz = 0, bus_bits = 0;
  CUTLASS_MOE_CHECK_CUDA(cudaDeviceGetAttribute(&memory_khz, cudaDevAttrMemoryClockRate, device));
  CUTLASS_MOE_CHECK_CUDA(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device));
  const double dram_tbps = 2.0 * memory_khz * 1e3 * (bus_bits / 8) / 1e12;
  int l2_bytes = 0;
  CUTLASS_MOE_CHECK_CUDA(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  const DeviceFacts facts{sms, 10 * major + minor, dram_tbps, l2_bytes};
  std::lock_guard<std::mutex> lock(facts_mutex());
  cache.emplace(device, facts);
  return facts;
}

int resident_ctas_per_sm(const void* kernel, int threads, int smem_bytes, int device) {
  using Key = std::tuple<int, const void*, int, int>;
  static std::map<Key, int> cache;
  const Key key{device, kernel, threads, smem_bytes};
  {
    std::lock_guard<std::mutex> lock(facts_mutex());
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  if (smem_bytes >= 48 * 1024) {
    CUTLASS_MOE_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  }
  int ctas = 0;
  CUTLASS_MOE_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, threads, smem_bytes));
  CUTLASS_MOE_CHECK(ctas > 0, Status::kNotSupported,
                    "a kernel with " << threads << " threads and " << smem_bytes
                                     << " bytes of shared memory does not fit on device " << device);
  std::lock_guard<std::mutex> lock(facts_mutex());
  cache.emplace(key, ctas);
  return ctas;
}

}  // namespace cutlass_moe
