// Picks a kernel family and configuration from what the host knows without reading the counts:
// the device's architecture, the average rows per expert (T / E), N and K.
#include "cutlass_moe/cutlass_moe.h"
#include "kernel_families.h"
#include "launch_facts.h"

namespace cutlass_moe {
namespace {

// Rows per expert (T / E), or an interleaved group's rows.
int64_t expert_rows(const MoeGemmProblem& problem) {
  if (problem.group_rows > 0) return problem.group_rows;
  return problem.num_tokens / (problem.num_experts > 0 ? problem.num_experts : 1);
}

// DRAM fast enough for the H200's rule (peak 4.9 TB/s; an H100's 3.35 is not). Planning without a device
// (device < 0) takes the H200's rule.
bool has_fast_dram(int device) { return device < 0 || device_facts(device).dram_tbps >= 4.0; }

// On Ampere/Ada (no sm90 kernels): the sm80 MoE kernel, which needs no argument-building launch.
Backend select_sm80_backend(const MoeGemmProblem&) { return Backend::kSm80Moe; }

}  // namespace

Backend select_fused_backend(const MoeGemmProblem& problem, int device) {
  if (device >= 0 && device_facts(device).cc / 10 == 8) {
    return select_sm80_backend(problem);
  }
  return Backend::kMoe;
}

// Fitted on benchmarks/sweep_h200.json (11 models' expert projections x 5 rows per expert x 3
// splits, every built config timed; benchmarks/NOTES.md, "The heuristic fitted on the sweep").
Backend select_backend(const MoeGemmProblem& problem, int device) {
  if (has_fused_epilogue(problem) || (device >= 0 && device_facts(device).cc / 10 == 8)) {
    return select_fused_backend(problem, device);
  }
  // Thousands of rows per expert and K >= 1536: the grouped family's 128x256 cooperative tile with a
  // 1x2 cluster (x's tile multicast to both CTAs) reads x from L2 half as often as the MoE family's
  // 1x1 tiles, and wins there. Elsewhere the MoE family (no workspace, one launch, a new output's
  // unowned rows zeroed in the same launch).
  // Where the MoE family's cooperative tile defers its stores (bf16), it takes those shapes too
  // (57 of the 66 with 4096 rows per expert in the 2026-11-23 tenth session's sweep).
  const int64_t experts = problem.num_experts > 0 ? problem.num_experts : 1;
  if (problem.num_tokens / experts >= 2048 && problem.k >= 1536 && !defer_cooperative_stores(problem)) {
    return Backend::kGrouped;
  }
  return Backend::kMoe;
}

// Deferred stores take the cooperative tile's epilogue off the tensor cores' path (bf16; the kernel
// also needs a K block per stored slice): 3-12% faster from 256 rows per expert on, on both GPUs
// (benchmarks/NOTES.md, "Deferred cooperative stores"). With fewer rows they gain nothing, and cost
// 7% on gpt-oss's uneven prefill on the H100: tiles that store take longer than tiles that do not,
// and CTAs that drift apart re-read weight tiles from DRAM.
bool defer_cooperative_stores(const MoeGemmProblem& problem) {
  return problem.dtype == DType::kBFloat16 && problem.k >= 256 && expert_rows(problem) >= 256;
}

KernelConfig select_config(const MoeGemmProblem& problem, Backend backend, int device) {
  if (backend == Backend::kSm80Grouped || backend == Backend::kSm80Moe) {
    // Same reasoning as sm90: a 64-row tile wastes less on each expert's partial last tile.
    return problem.num_tokens / (problem.num_experts > 0 ? problem.num_experts : 1) <= 64
               ? KernelConfig::kSm80_64x128x32_32x64_s4
               : KernelConfig::kSm80_128x128x32_64x64_s4;
  }
  const int64_t experts = problem.num_experts > 0 ? problem.num_experts : 1;
  const int64_t rows_per_expert = problem.num_tokens / experts;
  if (backend == Backend::kMoe) {
    // The 64x256 pingpong tile pads each expert's last tile less and overlaps one tile's epilogue
    // with the next one's mainloop: it wins on decode, at K < 2560 below 256 rows per expert, and
    // with few experts (< 32: Mixtral, Llama 4 Scout) below 768 rows (their (E, K, N) down
    // projections below 1536), whose wide weights give every CTA many column tiles. The 128x256
    // cooperative tile reads each weight tile once per 128 rows: it wins with deep K among many
    // experts, and from a few hundred rows per expert on.
    // Measurements: benchmarks/sweep_h200.json.
    // The few-experts exception holds only where DRAM is fast: the pingpong tile reads each weight
    // tile twice as often, and on an H100 (3.35 TB/s) the cooperative tile is 8-20% faster there
    // (Mixtral and Llama 4 Scout prefill; benchmarks/NOTES.md, "The H100"). Planning without a
    // device (device < 0) takes the H200's rule.
    // Where the cooperative tile defers its stores (defer_cooperative_stores), its epilogue no
    // longer idles the tensor cores. It is then the pick from 768 rows per expert, and from 256
    // with 32 or more experts. Below 768 rows few experts favour the pingpong tile (or the wide
    // tile, below) on uneven splits: their CTAs share each expert's many column tiles, and the
    // cooperative CTAs drift apart.
    // Fitted on benchmarks/sweep_h200.json (eighteenth session: 11 models x 10 rows per expert from
    // 16 to 4096 x 3 splits, 660 shapes, the wide tile timed too): within 5% of the best config on
    // 94.4% of the shapes, against 85.0% for the previous rule judged on the same table, which had
    // asked also for weights of 8M elements or more (fitted before the cooperative tile halved its
    // short last round; benchmarks/NOTES.md, "The heuristic refitted on the sweep with the wide tile").
    // Both H200 tables were timed again at the code of 2026-11-28: within 5% on 95.3% of the shapes,
    // 96.7% with (E, N, K) weights (sweep_h200_nk.json).
    const bool fast_dram = has_fast_dram(device);
    // (E, N, K) weights have no wide tile (below), and with few experts and N >= 16384 (Mixtral's and
    // Llama 4 Scout's gate/up projections) the cooperative tile is already the faster from 256 rows
    // per expert, on every kind of split: at 256 and 384 rows 0.91-0.94 of the pingpong tile's time
    // on even splits, 0.91-0.98 in geomean over three random and three skewed draws of each of six
    // shapes (one draw of 36 slower, 1.023), medians of five alternating rounds
    // (benchmarks/aligned_split_bench.py --trans-b --seeds 3; benchmarks/NOTES.md, "The cooperative
    // tile from 256 rows with (E, N, K) weights"). At 192 rows it pads every expert's second tile
    // (1.21-1.24x on even splits; sweep_h200_nk.json).
    const bool few_experts_fast_dram = fast_dram && problem.num_experts < 32;
    const bool few_experts_wide_n_nk =
        few_experts_fast_dram && problem.weight_layout == WeightLayout::kNK && problem.n >= 16384;
    // With (E, K, N) weights, few experts, N < 16384 and deep K (Mixtral's and Llama 4 Scout's down
    // projections) the pingpong tile still leads up to 1535 rows per expert: the cooperative tile
    // takes 1.017x its time at 768 rows and 1.025x at 1024 (geomean over even splits and two random
    // and two skewed draws of each of three shapes), 1.001x at 1536, 0.982x at 2048 and 0.970x at
    // 3072 (sweep.py --models mixtral-8x7b,mixtral-8x22b,llama4-scout --projs down --draws 2;
    // benchmarks/NOTES.md, "The sweep tables re-timed at the current code"). With (E, N, K) weights
    // the same shapes lean that way by less than 1% at 768-1024 rows, within the draws' spread.
    const bool few_experts_narrow_n_kn = few_experts_fast_dram && problem.weight_layout == WeightLayout::kKN &&
                                         problem.n < 16384 && problem.k >= 2560;
    // Rows per expert from which the cooperative tile wins where it defers its stores (which it
    // does from 256 rows on: defer_cooperative_stores).
    const int64_t deferred_from_rows =
        problem.num_experts >= 32 || few_experts_wide_n_nk ? 0 : few_experts_narrow_n_kn ? 1536 : 768;
    const bool deferred_wins = defer_cooperative_stores(problem) && rows_per_expert >= deferred_from_rows;
    // Slower DRAM favours the cooperative tile's single read of each weight tile at shallower K too:
    // on an H100 from K = 1408 (benchmarks/sweep_h100.json: 72 shapes of 96-192 rows per expert
    // among 60-256 experts, 2.5% faster in geomean, up to 21% on uneven splits, 1-4% slower on even
    // ones; the same shapes on the H200 run 5% slower).
    const int64_t deep_k = fast_dram ? 2560 : 1408;
    const bool cooperative = deferred_wins || (rows_per_expert >= 2048
                                              ? problem.k >= 1536
                                              : rows_per_expert > 64 && problem.k >= deep_k &&
                                                    (problem.num_experts >= 32 || !fast_dram));
    // The wide tile (64 rows, 512 columns, its two consumers sharing each x box) pads each expert as
    // the pingpong tile does and reads each x box once per 512 columns. On fast DRAM, with (E, K, N)
    // weights (the only layout it is built for; CMakeLists.txt), and where its 512-column tiles pad
    // N no more than 256-column tiles do, it takes two places:
    // - the cooperative tile's below 256 rows per expert among 32 or more experts, where 128-row
    //   tiles pad half of a typical expert's last tile (DeepSeek-V3's and Qwen3-235B's gate/up,
    //   gpt-oss's down projection at prefill; dsv3-prefill 11% faster);
    // - the pingpong tile's between 64 and 768 rows per expert among fewer experts with N of 16384
    //   or more (Mixtral's and Llama 4 Scout's gate/up projections: 3% faster in geomean over 42
    //   shapes of the sweep).
    // It reads each weight tile once per 64 rows, as the pingpong tile does, which an H100's DRAM
    // makes costly: on the 90 shapes of benchmarks/sweep_h100.json where the H200 takes it, it is
    // 2.5% slower in geomean than the H100's best other config (dsv3-prefill: 45% behind the
    // cooperative tile; benchmarks/NOTES.md, "The heuristic refitted on the sweep with the wide tile").
    const bool pads_n_as_256 = (problem.n + 511) / 512 * 2 == (problem.n + 255) / 256;  // 512-column tiles
    const bool wide_fits = fast_dram && problem.weight_layout == WeightLayout::kKN && pads_n_as_256;
    const bool wide_for_cooperative = cooperative && rows_per_expert < 256 && problem.num_experts >= 32;
    const bool wide_for_pingpong = !cooperative && problem.num_experts < 32 && problem.n >= 16384 &&
                                   rows_per_expert > 64 && rows_per_expert < 768;
    if (wide_fits && (wide_for_cooperative || wide_for_pingpong)) {
      return KernelConfig::kSm90CooperativeWide_64x512x32_1x1x1;
    }
    return cooperative ? KernelConfig::kSm90Cooperative_128x256x64_1x1x1 : KernelConfig::kSm90Pingpong_64x256x64_1x1x1;
  }
  // The 64x256 pingpong tile wastes the least on each expert's last, partial tile and overlaps one
  // tile's epilogue with the next one's mainloop: it is the pick from decode through a few hundred
  // rows per expert. With thousands of rows per expert the 128x256 cooperative tile with a 1x2
  // cluster (x tile multicast to both CTAs) wins. Measurements: benchmarks/NOTES.md (sm90 grouped
  // family: tile configs). The default build has only the latter (CMakeLists.txt): auto takes this
  // family at thousands of rows alone, and a forced backend="grouped" below them gets the built tile.
  if (rows_per_expert >= 2048) {
    return KernelConfig::kSm90Cooperative_128x256x64_1x2x1;
  }
  return KernelConfig::kSm90Pingpong_64x256x64_1x1x1;
}

// The cooperative 128x256 tile, held by the plan beside the pick (MoeGemmPlan::aligned_instance)
// and run by the device instead on a split of whole 128-row tiles (SplitGate: every count a multiple
// of 128, some expert holding two tiles or more: an even split of 256, 384, ... rows, or a layout
// that pads each expert to such tiles). Only the counts tell such splits from others of the same
// T / E, so the plan holds both and the device picks. Two places (benchmarks/sweep_h200.json and
// sweep_h200_aligned.json, both layouts; benchmarks/NOTES.md, "The split read on the device"):
// - the wide tile's picks for few experts (< 32) with 256 or more rows each (Mixtral's and Llama 4
//   Scout's gate/up projections): 1-6% faster on splits of whole tiles, where the cooperative tile
//   pads nothing and reads each weight tile half as often; up to 10% slower on random and skewed
//   splits of the same averages. With (E, N, K) weights, which have no wide tile, the same shapes
//   pick the cooperative tile outright (select_config);
// - the pingpong tile's picks for 32 or more experts with 65-255 rows each on fast DRAM, where the
//   call multiplies 2^37 or more MACs (DeepSeek-V3's down projection at prefill, Qwen3-235B's):
//   4-8% faster on random splits of whole tiles at 96, 128 and 192 rows per expert, both layouts,
//   while an even split of one tile per expert keeps the pingpong tile, 1-3% faster there in
//   geomean.
//   The launch that returns at once costs 3-8 us whatever the shape, so smaller calls, whose gain is
//   of that size (OLMoE's, Qwen3-30B's, DeepSeek-V2-Lite's projections: 1-25 us), keep one launch;
//   above 2^37 MACs (about 0.4 ms) it is under 1% of a call on other splits.
//   Few experts' pingpong picks (Mixtral's and Llama 4 Scout's down projections) gain nothing
//   consistent (0.89-1.25), nor do 64 rows per expert.
// T must be a multiple of 128 for the counts to be whole tiles: elsewhere the plan keeps one launch.
KernelConfig select_aligned_config(const MoeGemmProblem& problem, KernelConfig picked, int device) {
  if (has_interleaved_groups(problem) || problem.num_tokens % kAlignedSplitRows != 0 ||
      (device >= 0 && device_facts(device).cc / 10 != 9)) {
    return KernelConfig::kAuto;
  }
  const int64_t rows_per_expert = expert_rows(problem);
  const bool wide_few = picked == KernelConfig::kSm90CooperativeWide_64x512x32_1x1x1 &&
                        problem.num_experts < 32 && rows_per_expert >= 256;
  const double macs = static_cast<double>(problem.num_tokens) * problem.n * problem.k;
  const bool pingpong_many = picked == KernelConfig::kSm90Pingpong_64x256x64_1x1x1 && has_fast_dram(device) &&
                             problem.num_experts >= 32 && rows_per_expert > 64 && rows_per_expert < 256 &&
                             macs >= 0x1p37;
  return wide_few || pingpong_many ? KernelConfig::kSm90Cooperative_128x256x64_1x1x1 : KernelConfig::kAuto;
}

// The MoE kernel everywhere but when accumulating: it adds with TMA reduce-add, 1.3-1.4x slower than
// the grouped family's read-add-write epilogue on the public prefill shapes. Without accumulation it
// is the faster family on benchmarks/wgrad_sweep_h200.json (11 models' expert projections, 128 to
// 4096 rows per expert, 216 shapes): within 5% of the better family on 215 of them; the grouped
// family's time over its own is 1.37 in geomean at 128 rows per expert, 1.12 at 1024 and 1.04 at
// 4096 (benchmarks/NOTES.md, "The wgrad's guarded MMAs"). Before its loop issued the last K block's
// MMAs apart, the grouped family was ahead from 1024 rows per expert on.
Backend select_wgrad_backend(const MoeWgradProblem& problem) {
  return problem.accumulate ? Backend::kGrouped : Backend::kMoe;
}

}  // namespace cutlass_moe
