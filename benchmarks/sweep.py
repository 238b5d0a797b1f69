"""The heuristic's sweep (issue 12): every built forward config timed on MoE shapes beyond the 14
public cases, and how close the heuristic's choice (config="auto" without a tuning file) comes to
the best built config on each.

Shapes: the expert projections of real MoE models (gate/up: K = hidden, N = 2 x intermediate;
down: K = intermediate, N = hidden), at several average rows per expert, with three splits of the
rows: uniform, random (the bench's recipe: torch.rand(E) normalized) and skewed (one expert holds
half of the rows, the rest random). bf16, (E, K, N) weights, or (E, N, K) with --trans-b (the
layout of nn.Linear-style weights, and the dgrad's view of (E, K, N) weights).

For each shape the table (JSON) holds every config's ms, the heuristic's choice and ms, and the
floor (max(FLOPs / 790 TFLOP/s, bytes / 4.36 TB/s), the bytes being x, the weights of experts with
rows and out). The summary, over the shapes whose floor is at least --min-floor-us (shorter ones
are bound by the launch), gives the share of shapes where the heuristic is within 5% of the best,
the lowest floor fractions, how many shapes are under 0.7 of the floor, and the worst five.

To run on the GPU machine (after the build):
  python3 benchmarks/sweep.py [--models a,b] [--rows 16,128,1024] [--splits uniform,random,skewed,aligned] [--draws 3]
                              [--out sweep.json] [--start N] [--limit N] [--families moe,grouped]
To judge a stored table with the installed heuristic (no GPU): python3 benchmarks/sweep.py --judge
benchmarks/sweep_h200.json (the heuristic in cpp/heuristics.cpp was fitted on that table, and its
slower-DRAM exceptions on benchmarks/sweep_h100.json: judge that one on an H100 with --judge-device 0;
benchmarks/sweep_h200_nk.json holds the same shapes with (E, N, K) weights, timed with --trans-b).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Dict, Iterable, Iterator, List, Optional

import torch

from cutlass_moe import bench  # the floor, as the bench computes it

# name -> (experts, hidden, intermediate): the routed experts of each model.
MODELS = {
    "mixtral-8x7b": (8, 4096, 14336),
    "mixtral-8x22b": (8, 6144, 16384),
    "dsv3": (256, 7168, 2048),
    "dsv2-lite": (64, 2048, 1408),
    "qwen3-30b-a3b": (128, 2048, 768),
    "qwen3-235b-a22b": (128, 4096, 1536),
    "gptoss-20b": (32, 2880, 2880),
    "gptoss-120b": (128, 2880, 2880),
    "llama4-scout": (16, 5120, 8192),
    "olmoe": (64, 2048, 1024),
    "qwen1.5-moe": (60, 2048, 1408),
}
ROWS = (16, 64, 96, 128, 192, 256, 384, 512, 1024, 4096)  # average rows per expert
SPLITS = ("uniform", "random", "skewed")  # the stored tables' splits (the default)
# Also drawn on request (--splits): "aligned", random counts in whole 128-row tiles, as a layout that
# pads each expert to 128 rows makes them (where auto may run the plan's aligned config); and "hotP",
# P percent of the rows (1-99) to one expert and the rest random, as "skewed" does with half ("hot50"),
# to find the share of one hot expert from which another config leads.
EXTRA_SPLITS = ("aligned", "hotP")


def hot_percent(split: str) -> Optional[int]:
    """The hot expert's percent of the rows: 50 for "skewed", P for "hotP" (1-99), 0 for "random",
    None for the other splits."""
    if split in ("random", "skewed"):
        return 0 if split == "random" else 50
    if not split.startswith("hot"):
        return None
    percent = split[3:]
    if not percent.isdigit() or not 1 <= int(percent) <= 99:
        raise ValueError(f"split: expected hotP with P a percent from 1 to 99, got {split!r}")
    return int(percent)


def split_counts(num_experts: int, num_tokens: int, split: str, seed: int) -> torch.Tensor:
    """Counts summing to num_tokens: even, random (the bench's recipe), one expert with half
    ("skewed") or with P percent ("hotP") and the rest random, or random in whole 128-row tiles (the
    remainder of T / 128 to the last expert)."""
    gen = torch.Generator().manual_seed(seed)
    percent = hot_percent(split)
    if split == "uniform":
        counts = torch.full((num_experts,), num_tokens // num_experts, dtype=torch.int64)
    elif split == "aligned":
        tiles = torch.multinomial(torch.ones(num_experts), num_tokens // 128, replacement=True, generator=gen)
        counts = torch.bincount(tiles, minlength=num_experts).to(torch.int64) * 128
    elif percent is not None:
        hot = num_tokens * percent // 100
        share = torch.rand(num_experts, generator=gen)
        counts = (share / share.sum() * (num_tokens - hot)).to(torch.int64)
        if hot:
            counts[int(torch.randint(num_experts, (1,), generator=gen))] += hot
    else:
        raise ValueError(f"split: expected one of {SPLITS + EXTRA_SPLITS}, got {split!r}")
    counts[-1] += num_tokens - int(counts.sum())
    return counts


PROJS = ("gate_up", "down")


def shapes(models: List[str], rows: List[int], splits: List[str], draws: int = 1,
           projs: Iterable[str] = PROJS) -> Iterator[dict]:
    """The sweep's rows in order; `draws` rows for each drawn split (all but "uniform"),
    which the row's index seeds apart (main: split_counts(..., seed=i)). `projs`: the projections
    to keep, gate_up (K = hidden, N = 2 x intermediate) and down (K = intermediate, N = hidden)."""
    for name in projs:
        if name not in PROJS:
            raise ValueError(f"projs: expected gate_up or down, got {name!r}")
    for model in models:
        experts, hidden, inter = MODELS[model]
        for proj, k, n in (("gate_up", hidden, 2 * inter), ("down", inter, hidden)):
            if proj not in projs:
                continue
            for per_expert in rows:
                for split in splits:
                    for _ in range(1 if split == "uniform" else draws):
                        yield {"model": model, "proj": proj, "E": experts, "T": experts * per_expert, "K": k,
                               "N": n, "rows_per_expert": per_expert, "split": split}


def auto_pick(shape: dict, counts: torch.Tensor, device: Optional[int] = None, trans_b: bool = False) -> str:
    """"backend:config" that a config="auto" call runs on these counts: the heuristic's pick, or its
    aligned config where the plan holds one and the counts are a split of whole 128-row tiles (read on
    the device; cutlass_moe.aligned_config)."""
    import cutlass_moe
    from cutlass_moe.ops import runs_aligned_config
    t, e, n, k = shape["T"], shape["E"], shape["N"], shape["K"]
    backend, config = cutlass_moe.select_config(t, e, n, k, device=device, trans_b=trans_b)
    aligned = cutlass_moe.aligned_config(t, e, n, k, device=device, trans_b=trans_b)
    if aligned is not None and runs_aligned_config(counts):
        config = aligned
    return f"{backend}:{config}"


def floor_us(shape: dict, counts: torch.Tensor) -> float:
    return bench.floor_ms(shape, counts, bench.H200_TFLOPS, bench.H200_TBPS) * 1e3


def summarize(rows: List[dict], min_floor_us: float) -> Dict[str, object]:
    """The heuristic against the best built config, over the rows whose floor is >= min_floor_us."""
    kept = [r for r in rows if r["floor_us"] >= min_floor_us and r["times"] and r.get("heuristic_ms")]
    if not kept:
        return {"shapes": 0}
    for r in kept:
        r["best_ms"] = min(r["times"].values())
        r["heuristic_over_best"] = r["heuristic_ms"] / r["best_ms"]
        r["heuristic_floor_fraction"] = r["floor_us"] / (r["heuristic_ms"] * 1e3)
    within = sum(r["heuristic_over_best"] <= 1.05 for r in kept)
    worst = sorted(kept, key=lambda r: r["heuristic_floor_fraction"])[:5]
    geo = math.exp(sum(math.log(r["heuristic_floor_fraction"]) for r in kept) / len(kept))
    return {"shapes": len(kept), "heuristic_within_5pct": within / len(kept),
            "floor_fraction_geomean": geo, "floor_fraction_min": worst[0]["heuristic_floor_fraction"],
            "shapes_under_0.7_of_floor": sum(r["heuristic_floor_fraction"] < 0.7 for r in kept),
            "worst_five": [{k: r[k] for k in ("model", "proj", "E", "T", "K", "N", "split", "heuristic",
                                              "heuristic_ms", "best_ms", "heuristic_floor_fraction")} for r in worst]}


# The configs of the default build (CMakeLists.txt): "the best built config" of the summary. A table
# may hold more (timed from a build with extra configs, to see what they would give).
DEFAULT_CONFIGS = ("moe:sm90_pingpong_64x256x64_1x1x1", "moe:sm90_cooperative_128x256x64_1x1x1",
                   "moe:sm90_cooperative_wide_64x512x32_1x1x1", "grouped:sm90_cooperative_128x256x64_1x2x1")


def judge(rows: List[dict], configs, device: int = -1, trans_b: bool = False) -> List[dict]:
    """The rows with the installed heuristic's pick and its time, and only the given configs' times:
    a stored table judged again after the heuristic changed. The pick is auto_pick's on `device`
    (-1, the default, takes the H200's rule and needs no GPU), on each row's counts drawn again as
    the sweep drew them (from the row's "seed", or in older tables its index)."""
    judged = []
    for i, r in enumerate(rows):
        pick = auto_pick(r, split_counts(r["E"], r["T"], r["split"], seed=r.get("seed", i)), device, trans_b)
        times = {c: t for c, t in r["times"].items() if c in configs}
        judged.append({**r, "times": times, "heuristic": pick, "heuristic_ms": times.get(pick)})
    return judged


def write(path: str, pairs, rows: List[dict], summary, trans_b: bool) -> None:
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "trans_b": trans_b,
                   "configs": [f"{b}:{c}" for b, c in pairs], "summary": summary, "shapes": rows}, f, indent=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="average rows per expert")
    parser.add_argument("--splits", default=",".join(SPLITS))
    parser.add_argument("--projs", default=",".join(PROJS), help="projections to sweep: gate_up, down")
    parser.add_argument("--draws", type=int, default=1,
                        help="rows per drawn split (random, skewed, aligned, hotP), each with its own counts: one draw "
                             "can favour a config by a few percent")
    parser.add_argument("--out", default="sweep.json")
    parser.add_argument("--limit", type=int, default=0, help="stop after this many shapes (0: all)")
    parser.add_argument("--start", type=int, default=0, help="skip this many shapes (to resume a cut run)")
    parser.add_argument("--min-floor-us", type=float, default=50.0)
    parser.add_argument("--families", default="moe,grouped",
                        help="the forward families to time (the sm80 ones are Hopper's fallback, never auto's)")
    parser.add_argument("--warmup-ms", type=float, default=5.0)
    parser.add_argument("--rep-ms", type=float, default=25.0)
    parser.add_argument("--rounds", type=int, default=3,
                        help="timings of each config per shape, in alternating order (median)")
    parser.add_argument("--trans-b", action="store_true",
                        help="weights stored (E, N, K), K contiguous (moe_gemm's trans_b; the dgrad's view of "
                             "(E, K, N) weights) instead of (E, K, N)")
    parser.add_argument("--judge", metavar="TABLE",
                        help="no timing: judge a stored table (e.g. benchmarks/sweep_h200.json) with the "
                             "installed heuristic, against the default build's configs")
    parser.add_argument("--judge-device", type=int, default=-1,
                        help="the CUDA device whose rule --judge applies (-1: the H200's, no GPU needed; "
                             "benchmarks/sweep_h100.json is judged on an H100 with 0)")
    args = parser.parse_args()

    if args.judge:
        with open(args.judge) as f:
            table = json.load(f)
        summary = summarize(judge(table["shapes"], DEFAULT_CONFIGS, args.judge_device, table.get("trans_b", False)),
                            args.min_floor_us)
        print(json.dumps(summary, indent=1))
        return 0

    from cutlass_moe import tuning
    os.environ["CUTLASS_MOE_TUNING"] = "0"  # the heuristic's own choices, whatever was tuned here
    families = args.families.split(",")
    pairs = [(b, c) for b, c in tuning.candidates(torch.bfloat16, trans_b=args.trans_b) if b in families]
    todo = list(shapes(args.models.split(","), [int(r) for r in args.rows.split(",")], args.splits.split(","),
                       args.draws, args.projs.split(",")))
    todo = todo[args.start:]
    if args.limit:
        todo = todo[:args.limit]
    print(f"sweep on {torch.cuda.get_device_name()}: {len(todo)} shapes x {len(pairs)} configs", file=sys.stderr)
    rows, started = [], time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for i, shape in enumerate(todo, start=args.start):
            counts = split_counts(shape["E"], shape["T"], shape["split"], seed=i)
            x = torch.randn(shape["T"], shape["K"], device="cuda", dtype=torch.bfloat16, generator=gen)
            dims = (shape["N"], shape["K"]) if args.trans_b else (shape["K"], shape["N"])
            w = torch.randn(shape["E"], *dims, device="cuda", dtype=torch.bfloat16, generator=gen) * shape["K"] ** -0.5
            times = tuning.time_configs(x, w, counts.cuda(), args.trans_b, pairs, args.warmup_ms, args.rep_ms,
                                        args.rounds)
            heuristic = auto_pick(shape, counts, trans_b=args.trans_b)
            row = {**shape, "seed": i, "floor_us": floor_us(shape, counts), "times": times, "heuristic": heuristic,
                   "heuristic_ms": times.get(heuristic)}
            rows.append(row)
            best = min(times, key=times.get) if times else "-"
            print(f"[{i + 1}/{args.start + len(todo)}] {shape['model']} {shape['proj']} T={shape['T']} {shape['split']}: "
                  f"best {best} {times.get(best, float('nan')):.4f} ms, heuristic {heuristic} "
                  f"{row['heuristic_ms'] or float('nan'):.4f} ms, floor {row['floor_us']:.1f} us "
                  f"({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
            del x, w
            torch.cuda.empty_cache()
            if i % 10 == 9:  # a run cut short still leaves its table
                write(args.out, pairs, rows, None, args.trans_b)
    summary = summarize(rows, args.min_floor_us)
    write(args.out, pairs, rows, summary, args.trans_b)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
