"""The public cases against a floor measured at the card's power cap (issue 12's floor fractions).

The bench's floor is max(FLOPs / 790 TFLOP/s, bytes / 4.36 TB/s): it lets the MMAs and the DRAM
traffic overlap for free. At the H200's 700 W cap they share one power budget instead
(benchmarks/NOTES.md, twenty-fourth and twenty-eighth sessions), so a call's time is close to its
energy over the cap's power. This script measures, in one run, what each part costs in time there,
with the vendor's kernels:
- alpha, ms per FLOP: dense torch.mm runs whose bytes are small beside their FLOPs;
- beta, ms per GB read from DRAM: torch.bmm over even groups with distinct weights against the same
  bmm with one weight shared by all groups (a stride-0 expand: same FLOPs, no weight traffic), on two
  compute-heavy shapes (qwen3-30b's projection and Mixtral's).
The energy floor of a case is then max(alpha x FLOPs + beta x bytes, bytes / 4.36 TB/s), with the
bench's FLOPs (no padding) and bytes (x, the weights of experts with rows, out). It is not a hard
limit: a kernel that spends less energy per FLOP or per byte than cuBLAS does passes it. It is what
the vendor's GEMM gets from this card for the same work, and floor / energy floor is the fraction of
the bench's floor such a kernel would read.

Each runner is timed as energy_per_call.py times it: back to back for --heat-s (the card reaches its
cap), then --seconds with CUDA events around the window (no L2 flush, so sustained times run a little
slower than the bench's do_bench medians). moe_gemm and torch._grouped_mm run on the bench's counts.

To run (on the GPU machine, from outside the source tree): python3 energy_floor.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

import cutlass_moe
from cutlass_moe import bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from energy_per_call import window  # noqa: E402  (the same sustained timing)

H200_TBPS = 4.36  # the bench's fixed DRAM ceiling


def calibrate(heat_s: float, seconds: float) -> dict:
    """alpha (ms per FLOP) and beta (ms per GB), each runner's reading beside them."""
    dev, dt = "cuda", torch.bfloat16
    rnd = lambda *s: torch.randn(*s, device=dev, dtype=dt)
    readings = {}
    # beta: distinct against shared weights, on shapes whose FLOPs outweigh their weights' reads.
    betas = []
    for name, (e, t, k, n) in {"qwen3-30b (128 x 256 rows, K 2048, N 1536)": (128, 32768, 2048, 1536),
                               "mixtral (8 x 1024 rows, K 4096, N 28672)": (8, 8192, 4096, 28672)}.items():
        x, w = rnd(e, t // e, k), rnd(e, k, n) * k ** -0.5
        distinct = window(lambda: torch.bmm(x, w), heat_s, seconds)["ms"]
        shared = window(lambda: torch.bmm(x, w[0].expand(e, k, n)), heat_s, seconds)["ms"]
        weight_gb = 2.0 * e * k * n / 1e9
        betas.append((distinct - shared) / weight_gb)
        readings[f"bmm {name}: distinct / shared weights ms"] = (distinct, shared)
        del x, w
    beta = min(betas)
    # alpha: dense GEMMs; their own bytes (read once, written once) charged at beta.
    alphas = []
    for m, k, n in ((32768, 2048, 1536), (30720, 1024, 3072), (16384, 8192, 8192)):
        a, b = rnd(m, k), rnd(k, n) * k ** -0.5
        ms = window(lambda: torch.mm(a, b), heat_s, seconds)["ms"]
        flops, gb = 2.0 * m * k * n, 2.0 * (m * k + k * n + m * n) / 1e9
        alphas.append((ms - beta * gb) / flops)
        readings[f"mm {m} x {k} x {n} ms"] = ms
        del a, b
    torch.cuda.empty_cache()
    return {"alpha_ms_per_flop": min(alphas), "beta_ms_per_gb": beta, "alphas": alphas, "betas": betas,
            "readings": readings}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heat-s", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--cases", help="comma-separated case names (default: every public case)")
    parser.add_argument("--json", help="write the calibration and the table here")
    args = parser.parse_args()
    torch.manual_seed(0)
    cases = bench.load_cases()
    counts_all = bench.case_counts(cases)
    if args.cases:
        cases = [c for c in cases if c["name"] in args.cases.split(",")]

    with torch.no_grad():
        cal = calibrate(args.heat_s, args.seconds)
        alpha, beta = cal["alpha_ms_per_flop"], cal["beta_ms_per_gb"]
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.heat_s} s heat, {args.seconds} s timed")
        for key, value in cal["readings"].items():
            print(f"  {key}: {value if isinstance(value, float) else ' / '.join(f'{v:.4f}' for v in value)}")
        print(f"alpha: {1e-9 / alpha:.0f} TFLOP/s at the cap (the best of {', '.join(f'{1e-9 / a:.0f}' for a in cal['alphas'])}); "
              f"beta: {beta:.4f} ms per GB ({1 / beta:.1f} TB/s-equivalent; "
              f"estimates {', '.join(f'{b:.4f}' for b in cal['betas'])})")

        rows = []
        print(f"\n{'case':<22}{'floor':>8}{'energy':>8}{'reach':>7}{'ours ms':>9}{'of E':>7}{'of floor':>9}"
              f"{'gmm ms':>9}{'of E':>7}")
        for case in cases:
            counts = counts_all[case["name"]]
            e, t, k, n = case["E"], case["T"], case["K"], case["N"]
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16) * k ** -0.5
            counts_gpu = counts.to("cuda", torch.int32)
            flops, nbytes = bench.case_work(case, counts)
            gb = nbytes / 1e9
            floor = bench.floor_ms(case, counts, 790, H200_TBPS)
            energy = max(alpha * flops + beta * gb, gb / H200_TBPS)
            ours = window(lambda: cutlass_moe.moe_gemm(x, w, counts_gpu), args.heat_s, args.seconds)["ms"]
            gmm_peer = bench.grouped_mm_peer(x, w, counts_gpu)
            gmm = window(gmm_peer, args.heat_s, args.seconds)["ms"] if gmm_peer else float("nan")
            row = {"case": case["name"], "floor_ms": floor, "energy_floor_ms": energy, "reachable": floor / energy,
                   "ours_ms": ours, "ours_of_energy": energy / ours, "ours_of_floor": floor / ours,
                   "grouped_mm_ms": gmm, "grouped_mm_of_energy": energy / gmm}
            rows.append(row)
            print(f"{case['name']:<22}{floor:8.3f}{energy:8.3f}{row['reachable']:7.3f}{ours:9.4f}"
                  f"{row['ours_of_energy']:7.3f}{row['ours_of_floor']:9.3f}{gmm:9.4f}{row['grouped_mm_of_energy']:7.3f}",
                  flush=True)
            del x, w
            torch.cuda.empty_cache()

    geo = lambda key: math.exp(sum(math.log(r[key]) for r in rows) / len(rows))
    print(f"\nfloor / energy floor (what the vendor's efficiency reads against the bench's floor): "
          f"geomean {geo('reachable'):.3f}, min {min(r['reachable'] for r in rows):.3f}")
    print(f"ours: {geo('ours_of_energy'):.3f} of the energy floor in geomean (min {min(r['ours_of_energy'] for r in rows):.3f}), "
          f"{geo('ours_of_floor'):.3f} of the bench's floor (sustained)")
    print(f"torch._grouped_mm: {geo('grouped_mm_of_energy'):.3f} of the energy floor in geomean")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "calibration": cal,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
