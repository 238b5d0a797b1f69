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
  // Measured on H200s over the public cases (benchmarks/NOTES.md): the MoE kernel is faster on
  // most cases (by 2-14%: every seed000 case, qwen3-30b-decode, mixtral-decode, mixtral-prefill)
  // and costs less host time per call (no workspace, one launch). The one regime where the grouped
  // family was ahead in three of four runs (by 2-8%) is deep K with a few hundred rows per expert
  // over many experts (dsv3-prefill: K = 7168, T/E = 128, E = 256).
  const int64_t rows_per_expert = problem.num_tokens / (problem.num_experts > 0 ? problem.num_experts : 1);
  if (problem.k >= 6144 && rows_per_expert > 64 && rows_per_expert <= 512 && problem.num_experts >= 64) {
    return Backend::kGrouped;
  }
  return Backend::kMoe;
}

KernelConfig select_config(const MoeGemmProblem& problem, Backend backend, int /*device*/) {
  if (backend == Backend::kSm80Grouped || backend == Backend::kSm80Moe) {
    // Same reasoning as sm90: a 64-row tile wastes less on each expert's partial last tile.
    return problem.num_tokens / (problem.num_experts > 0 ? problem.num_experts : 1) <= 64
               ? KernelConfig::kSm80_64x128x32_32x64_s4
               : KernelConfig::kSm80_128x128x32_64x64_s4;
  }
  if (backend == Backend::kMoe) {
    return KernelConfig::kSm90Pingpong_64x256x64_1x1x1;  // the one config the MoE family implements
  }
  const int64_t experts = problem.num_experts > 0 ? problem.num_experts : 1;
  const int64_t rows_per_expert = problem.num_tokens / experts;
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
