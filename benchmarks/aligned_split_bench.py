"""The split read on the device: auto (both configs launched, the counts pick one) against each config
forced, on the sweep's even, 128-aligned, random and skewed splits (benchmarks/sweep.py,
split_counts) of shapes where the plan holds two (heuristics.cpp, select_aligned_config: the wide
tile for few experts with 256+ rows each, the pingpong tile for many experts with 65-255 rows each
in calls of 2^37 MACs or more).

Each time is the median over --rounds alternating rounds (do_bench medians, L2 flushed), outputs
checked bitwise against the config the split should run. The auto / best-forced ratio shows what
the second launch costs where it returns at once (on uneven splits) and what the cooperative tile
gains on splits of whole 128-row tiles.

To run (on the GPU machine, from outside the source tree):
  python3 aligned_split_bench.py [--rounds 5] [--shapes dsv3,llama4] [--trans-b] [--seeds 3] [--pick CONFIG]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

import cutlass_moe
from cutlass_moe import bench
from cutlass_moe.ops import runs_aligned_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep import split_counts  # noqa: E402  (the sweep's splits, "aligned" included)

COOPERATIVE = "sm90_cooperative_128x256x64_1x1x1"
# (name, T, E, K, N): Llama 4 Scout's and Mixtral's gate/up projections (the wide tile's picks), then
# down projections among many experts (the pingpong tile's), then three calls of that kind under 2^37
# MACs, which plan one config (kept to time the second launch where a build lowers that bound),
# seed000-g128 among them (a public case).
SHAPES = [("llama4-scout gate/up, 256 rows", 4096, 16, 5120, 16384),
          ("llama4-scout gate/up, 384 rows", 6144, 16, 5120, 16384),
          ("mixtral-8x7b gate/up, 256 rows", 2048, 8, 4096, 28672),
          ("mixtral-8x7b gate/up, 384 rows", 3072, 8, 4096, 28672),
          ("mixtral-8x22b gate/up, 256 rows", 2048, 8, 6144, 32768),
          ("mixtral-8x22b gate/up, 384 rows", 3072, 8, 6144, 32768),
          ("mixtral-8x7b gate/up, 512 rows", 4096, 8, 4096, 28672),
          ("dsv3 down, 128 rows", 32768, 256, 2048, 7168),
          ("dsv3 down, 96 rows", 24576, 256, 2048, 7168),
          ("qwen3-235b down, 192 rows", 24576, 128, 1536, 4096),
          ("seed000-g128, 192 rows", 24576, 128, 1024, 1024),
          ("qwen3-30b gate/up, 192 rows", 24576, 128, 2048, 1536),
          ("olmoe down, 128 rows", 8192, 64, 1024, 2048)]


def label(config: str) -> str:
    return "coop" if config == COOPERATIVE else "wide" if "wide" in config else "pp"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", default="", help="comma-separated substrings of the shapes' names to run")
    parser.add_argument("--trans-b", action="store_true", help="weights stored (E, N, K) (moe_gemm's trans_b)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="random and skewed splits drawn per shape (a single draw judges the configs on one split)")
    parser.add_argument("--pick", default="",
                        help="time this config as 'pick' instead of the heuristic's, also on shapes planned with "
                             "one config (e.g. sm90_pingpong_64x256x64_1x1x1 against the cooperative tile)")
    args = parser.parse_args()
    layout = "(E, N, K)" if args.trans_b else "(E, K, N)"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 {layout}; ms, median of "
          f"{args.rounds} alternating rounds")
    print(f"{'shape':<34}{'split':<9}{'runs':<6}{'auto':>8}{'coop':>8}{'pick':>8}{'auto/best':>10}{'coop/pick':>10}"
          f"  (pick: {args.pick or 'the heuristic config for the shape'}; runs: what auto runs on the split)")
    wanted = [w for w in args.shapes.split(",") if w]
    for name, t, e, k, n in SHAPES:
        if wanted and not any(w in name for w in wanted):
            continue
        tb = args.trans_b
        heuristic = cutlass_moe.select_config(t, e, n, k, trans_b=tb)[1]
        two_configs = cutlass_moe.aligned_config(t, e, n, k, trans_b=tb) == COOPERATIVE
        if not two_configs and not args.pick:
            print(f"{name:<34}plans {heuristic} alone: skipped", flush=True)
            continue
        pick = args.pick or heuristic
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(e, *((n, k) if tb else (k, n)), device="cuda", dtype=torch.bfloat16) * k ** -0.5
        draws = [("uniform", 0), ("aligned", 1)] + [(split, 4 * j + index) for j in range(args.seeds)
                                                    for index, split in ((2, "random"), (3, "skewed"))]
        uneven = []  # coop / pick on the random and skewed draws
        for split, seed in draws:
            counts = split_counts(e, t, split, seed=seed)
            c = counts.to("cuda", torch.int32)
            runs = COOPERATIVE if two_configs and runs_aligned_config(counts) else heuristic  # what auto runs
            y = cutlass_moe.moe_gemm(x, w, c, trans_b=tb)
            assert torch.equal(y, cutlass_moe.moe_gemm(x, w, c, trans_b=tb, backend="moe", config=runs)), (name, split)
            times = bench.median_of_rounds({
                "auto": lambda: cutlass_moe.moe_gemm(x, w, c, trans_b=tb),
                "coop": lambda: cutlass_moe.moe_gemm(x, w, c, trans_b=tb, backend="moe", config=COOPERATIVE),
                "pick": lambda: cutlass_moe.moe_gemm(x, w, c, trans_b=tb, backend="moe", config=pick)},
                args.rounds)
            best = min(times["coop"], times["pick"])
            print(f"{name:<34}{split:<9}{label(runs):<6}{times['auto']:8.4f}"
                  f"{times['coop']:8.4f}{times['pick']:8.4f}{times['auto'] / best:10.3f}"
                  f"{times['coop'] / times['pick']:10.3f}", flush=True)
            if split in ("random", "skewed"):
                uneven.append(times["coop"] / times["pick"])
        if args.seeds > 1:
            print(f"{name:<34}coop/pick over {len(uneven)} random and skewed draws: geomean "
                  f"{statistics.geometric_mean(uneven):.3f}, {min(uneven):.3f}-{max(uneven):.3f}", flush=True)
        del x, w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
