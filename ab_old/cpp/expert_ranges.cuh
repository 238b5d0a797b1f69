// The clamped row range of every expert, computed on the device by one CTA: the first kernel of the
// "grouped" families, which turns tokens_per_expert into CUTLASS's per-expert argument arrays.
// Clamping is expert_rows.hpp's rule.
#pragma once

#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "expert_rows.hpp"

namespace cutlass_moe {

constexpr int kExpertRangeThreads = 1024;

// Calls write(expert, start, rows) once per expert. Call from every thread of a one-CTA launch of
// kExpertRangeThreads threads; experts are scanned kExpertRangeThreads at a time.
template <class Count, class Writer>
__device__ void for_each_expert_range(const Count* __restrict__ tokens_per_expert, int64_t num_experts,
                                      int64_t num_tokens, Writer&& write) {
  using BlockScan = cub::BlockScan<int64_t, kExpertRangeThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int64_t chunk_base;
  if (threadIdx.x == 0) chunk_base = 0;
  __syncthreads();

  for (int64_t first = 0; first < num_experts; first += kExpertRangeThreads) {
    const int64_t e = first + threadIdx.x;
    const int64_t count = e < num_experts ? clamp_count(static_cast<int64_t>(tokens_per_expert[e]), num_tokens) : 0;
    int64_t prefix, chunk_total;
    BlockScan(scan_storage).ExclusiveSum(count, prefix, chunk_total);
    if (e < num_experts) {
      // chunk_base + prefix is at most E * T: no overflow for T, E < 2^31.
      const ExpertRows r = expert_rows(chunk_base + prefix, count, num_tokens);
      write(e, r.start, r.rows);
    }
    __syncthreads();  // everyone has read chunk_base and scan_storage
    if (threadIdx.x == 0) chunk_base += chunk_total;
    __syncthreads();
  }
}

}  // namespace cutlass_moe
