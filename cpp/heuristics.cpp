// Picks a kernel family and configuration from what the host knows without reading the counts:
// the device's architecture, the average rows per expert (T / E), N and K.
#include "cutlass_moe/cutlass_moe.h"
#include "device_info.h"

namespace cutlass_moe {
namespace {

// On Ampere/Ada (no sm90 kernels): the sm80 MoE kernel, which needs no argument-building launch.
Backend select_sm80_backend(const MoeGemmProblem&) { return Backend::kSm80Moe; }

}  // namespace

Backend select_backend(const MoeGemmProblem& problem, int device) {
  if (device >= 0 && device_info(device).cc / 10 == 8) {
    return select_sm80_backend(problem);
  }
  // Measured on H200s over the public cases (benchmarks/NOTES.md): the MoE family, with the config
  // select_config picks, is faster than the grouped family on every case, and costs less host time
  // per call (no workspace, one launch).
  return Backend::kMoe;
}

KernelConfig select_config(const MoeGemmProblem& problem, Backend backend, int /*device*/) {
  if (backend == Backend::kSm80Grouped || backend == Backend::kSm80Moe) {
    // Same reasoning as sm90: a 64-row tile wastes less on each expert's partial last tile.
    return problem.num_tokens / (problem.num_experts > 0 ? problem.num_experts : 1) <= 64
               ? KernelConfig::kSm80_64x128x32_32x64_s4
               : KernelConfig::kSm80_128x128x32_64x64_s4;
  }
  const int64_t experts = problem.num_experts > 0 ? problem.num_experts : 1;
  const int64_t rows_per_expert = problem.num_tokens / experts;
  if (backend == Backend::kMoe) {
    // Measured on an H200 over the public cases, both tiles in one run (benchmarks/NOTES.md,
    // "TMA-store epilogue"): the 128x256 cooperative tile, which reads each weight tile once per 128
    // rows, is 1-10% faster with deep K and more than 64 rows per expert (dsv3-prefill, K = 7168;
    // gptoss-120b-prefill, K = 2880; llama4, K = 5120; mixtral-prefill, K = 4096) and with thousands
    // of rows per expert (seed000-g8, seed004-uniform). The 64x256 pingpong tile wins at K <= 2048
    // with hundreds of rows per expert (qwen3-30b-prefill 6%, seed000-g16/g32 2-7%), where its
    // smaller padding of each expert's last tile counts, and on decode (2-16%).
    if (rows_per_expert > 64 && (problem.k >= 2560 || rows_per_expert >= 2048)) {
      return KernelConfig::kSm90Cooperative_128x256x64_1x1x1;
    }
    return KernelConfig::kSm90Pingpong_64x256x64_1x1x1;
  }
  // Measured on an H200 over the public cases (bf16, all six sm90 configs; numbers in
  // benchmarks/NOTES.md): the 64x256 pingpong tile is fastest or within 3% from decode
  // (a few rows per expert) through a few hundred rows per expert, since a 64-row tile wastes
  // the least on each expert's last, partial tile and pingpong overlaps one tile's epilogue with
  // the next one's mainloop. Only with thousands of rows per expert does the 128x256 cooperative
  // tile with a 1x2 cluster (x tile multicast to both CTAs) win, by 3-7%.
  if (rows_per_expert >= 2048) {
    return KernelConfig::kSm90Cooperative_128x256x64_1x2x1;
  }
  return KernelConfig::kSm90Pingpong_64x256x64_1x1x1;
}

}  // namespace cutlass_moe
