"""The weight gradient's sweep (issue 10): the sm90 wgrad families of this build, and torch's wgrad,
timed on the expert projections of real MoE models (sweep.py's models, rows per expert and splits).

For each shape: every built bf16 wgrad family's ms (dW in bf16, not accumulated), `backend="auto"`'s,
torch's `torch._grouped_mm(x.t(), dy, offs=offs)` where this PyTorch has it, and the floor of
training_bench.py (max(FLOPs / 790 TFLOP/s, x and dy at 4.36 TB/s + dW of the experts with rows at
the write bandwidth measured in the same run)). Every time is the median over alternating rounds. The summary gives, per family, how often it is within 5% of the best, and
auto's floor fraction and speedup over torch's.

benchmarks/wgrad_sweep_h200.json is the table of the default rows and splits (216 shapes; the
largest, past --max-tokens rows, are left out). auto's family choice (select_wgrad_backend in
cpp/heuristics.cpp) rests on it.

To run on the GPU machine (after the build):
  python3 benchmarks/wgrad_sweep.py [--models a,b] [--rows 128,1024] [--splits uniform,random]
                                    [--trans-b] [--out wgrad_sweep.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

import cutlass_moe
from cutlass_moe import bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep  # noqa: E402  (the models, shapes and splits of the forward's sweep)
import training_bench  # noqa: E402  (the wgrad floor and the write bandwidth)

ROWS = (128, 512, 1024, 2048, 4096)
SPLITS = ("uniform", "random")


def summarize(rows):
    if not rows:
        return {"shapes": 0}
    families = sorted({f for r in rows for f in r["times"]})
    out = {"shapes": len(rows)}
    for f in families:
        within = [r["times"][f] <= 1.05 * min(r["times"].values()) for r in rows if f in r["times"]]
        out[f"{f}_within_5pct"] = sum(within) / len(within)
    frac = [r["floor_ms"] / r["auto_ms"] for r in rows]
    out["auto_floor_fraction_geomean"] = math.exp(sum(map(math.log, frac)) / len(frac))
    out["auto_floor_fraction_min"] = min(frac)
    vs = [r["torch_ms"] / r["auto_ms"] for r in rows if r.get("torch_ms")]
    if vs:
        out["auto_over_torch_geomean"] = math.exp(sum(map(math.log, vs)) / len(vs))
        out["auto_over_torch_min"] = min(vs)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(sweep.MODELS))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="average rows per expert")
    parser.add_argument("--splits", default=",".join(SPLITS))
    parser.add_argument("--trans-b", action="store_true", help="dW as (E, N, K) instead of (E, K, N)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep-ms", type=float, default=40.0)
    parser.add_argument("--max-tokens", type=int, default=1 << 19, help="skip shapes with more rows than this")
    parser.add_argument("--out", default="wgrad_sweep.json")
    args = parser.parse_args()

    families = sorted(training_bench.wgrad_families())
    write_tbps = training_bench.write_bandwidth()
    todo = [s for s in sweep.shapes(args.models.split(","), [int(r) for r in args.rows.split(",")],
                                    args.splits.split(",")) if s["T"] <= args.max_tokens]
    print(f"wgrad sweep on {torch.cuda.get_device_name()}: {len(todo)} shapes, families {families}, "
          f"write bandwidth {write_tbps:.2f} TB/s", file=sys.stderr)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, started = [], time.time()
    for i, shape in enumerate(todo):
        t, k, n, e = shape["T"], shape["K"], shape["N"], shape["E"]
        counts = sweep.split_counts(e, t, shape["split"], seed=i).to("cuda", torch.int32)
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        runners = {f: (lambda f=f: cutlass_moe.moe_gemm_wgrad(x, dy, counts, trans_b=args.trans_b, backend=f))
                   for f in families}
        runners["auto"] = lambda: cutlass_moe.moe_gemm_wgrad(x, dy, counts, trans_b=args.trans_b)
        if hasattr(torch, "_grouped_mm") and not args.trans_b:
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            runners["torch"] = lambda: torch._grouped_mm(x.t(), dy, offs=offs)
        times = bench.median_of_rounds(runners, args.rounds, 5.0, args.rep_ms)
        active = int((counts > 0).sum())
        row = {**shape, "times": {f: times[f] for f in families}, "auto_ms": times["auto"],
               "torch_ms": times.get("torch"),
               "floor_ms": training_bench.wgrad_floor_ms(t, k, n, active, write_tbps)}
        rows.append(row)
        print(f"[{i + 1}/{len(todo)}] {shape['model']} {shape['proj']} E={e} T={t} K={k} N={n} {shape['split']}: "
              + " ".join(f"{f}={times[f]:.4f}" for f in runners)
              + f" floor={row['floor_ms']:.4f} ({time.time() - started:.0f} s)",
              file=sys.stderr, flush=True)
        del x, dy
        torch.cuda.empty_cache()
    summary = summarize(rows)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "trans_b": args.trans_b,
                   "write_tbps": write_tbps, "summary": summary, "shapes": rows}, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
