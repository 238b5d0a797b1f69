"""GroupedLinear without a bias: our MoE kernel over interleaved groups against cuBLAS's bmm on the
strided views, over a grid of (B, G, K, N), to choose grouped_linear's no-bias path by measurement
(issue 11: "the fastest correct kernel ... chosen by measurement").

Per shape (bf16, x (B, G, K), weight (G, K, N), out (B, G, N), no copies): both forward calls are
checked against a float32 bmm (relative error), then timed two ways:
  paired   cutlass_moe.bench.paired_ratio(bmm, moe): call by call, L2 flushed, order alternating;
           the ratio moe/bmm of each pair, median (the power cap's clock moves both alike);
  rounds   cutlass_moe.bench.median_of_rounds({bmm, moe}, --rounds): each call's do_bench median in
           alternating rounds, the median over rounds.
The table (--json) keeps both, per shape; the summary counts where the MoE kernel wins by both.

To run (on the GPU machine, from outside the source tree):
  python3 grouped_linear_sweep.py [--rounds 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from cutlass_moe import bench
from cutlass_moe.grouped_linear import _interleaved_linear, _interleaved_takes

BATCH_GROUPS = [(512, 32), (1024, 8), (1024, 16), (2048, 8), (2048, 16), (2560, 12), (4096, 4), (4096, 8),
                (8192, 4), (16384, 2)]
KS = [1024, 2048, 4096]
NS = [1024, 3072, 4096]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    rows = []
    print(f"grouped_linear_sweep on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'B':>6}{'G':>4}{'K':>6}{'N':>6}{'bmm ms':>9}{'moe ms':>9}{'rounds':>8}{'paired':>8}  winner")
    for (b, g), k, n in itertools.product(BATCH_GROUPS, KS, NS):
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(b, g, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(g, k, n, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
        if not _interleaved_takes(x, w, None):
            continue
        out = torch.empty(b, g, n, device="cuda", dtype=torch.bfloat16)

        def bmm():
            torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))  # (B, G, N) through its (G, B, N) view
            return out

        moe = lambda: _interleaved_linear(x, w, None)
        ref = torch.bmm(x.float().transpose(0, 1), w.float()).transpose(0, 1)
        errors = {name: float((fn().float() - ref).norm() / ref.norm()) for name, fn in (("bmm", bmm), ("moe", moe))}
        del ref
        assert max(errors.values()) < 1e-2, errors
        with torch.no_grad():
            paired = bench.paired_ratio(bmm, moe)
            rounds = bench.median_of_rounds({"bmm": bmm, "moe": moe}, args.rounds, 25.0, 100.0)
        r_rounds = rounds["moe"] / rounds["bmm"]
        winner = "moe" if paired["ratio"] < 1 and r_rounds < 1 else "bmm" if paired["ratio"] > 1 and r_rounds > 1 else "-"
        rows.append({"B": b, "G": g, "K": k, "N": n, "bmm_ms": rounds["bmm"], "moe_ms": rounds["moe"],
                     "moe_over_bmm_rounds": r_rounds, "moe_over_bmm_paired": paired["ratio"],
                     "paired_p25": paired["ratio_p25"], "paired_p75": paired["ratio_p75"], "errors": errors})
        print(f"{b:6d}{g:4d}{k:6d}{n:6d}{rounds['bmm']:9.4f}{rounds['moe']:9.4f}{r_rounds:8.3f}{paired['ratio']:8.3f}"
              f"  {winner}", flush=True)
    wins = sum(r["moe_over_bmm_paired"] < 1 and r["moe_over_bmm_rounds"] < 1 for r in rows)
    losses = sum(r["moe_over_bmm_paired"] > 1 and r["moe_over_bmm_rounds"] > 1 for r in rows)
    print(f"{len(rows)} shapes: the MoE kernel faster by both measures on {wins}, slower by both on {losses}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": args.rounds,
                       "shapes": rows}, f, indent=1)


if __name__ == "__main__":
    main()
