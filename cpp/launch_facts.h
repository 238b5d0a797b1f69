// Per-device facts the dispatcher and the launchers need, queried once and kept in one cache keyed
// by device (and by kernel, for occupancy): the attribute and occupancy calls cost microseconds
// that a decode step cannot spare. A failed query throws and is not cached, so the next call asks
// again.
#pragma once

#include <cstdint>

namespace cutlass_moe {

struct DeviceFacts {
  int sm_count;
  int cc;              // 10 * major + minor
  double dram_tbps;    // peak DRAM bandwidth, 2 x memory clock x bus width (H100 SXM 3.35, H200 4.9)
  int64_t l2_bytes;    // L2 cache size (H100, H200: 50 MB)
};

DeviceFacts device_facts(int device);

// CTAs of `kernel` resident on one SM of `device` with `threads` threads and `smem_bytes` of
// dynamic shared memory. The first call per (device, kernel) raises the kernel's dynamic shared
// memory limit (on the current device, which must be `device`) and queries the occupancy. Throws
// kNotSupported if not even one CTA fits.
int resident_ctas_per_sm(const void* kernel, int threads, int smem_bytes, int device);

}  // namespace cutlass_moe
