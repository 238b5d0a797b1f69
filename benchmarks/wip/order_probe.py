"""Scratch: does a runner's place in bench.median_of_rounds move its time? Times the bench's runners
for each case twice: in the bench's order (ours = auto first) and with auto and moe:auto (the same
launch where the plans agree) swapped, five rounds each. Run from outside the source tree:
python3 order_probe.py CASES [ROUNDS]"""
import statistics
import sys

import torch

import cutlass_moe
from cutlass_moe import bench

names = sys.argv[1].split(",")
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
cases = {c["name"]: c for c in bench.load_cases()}
counts_all = bench.case_counts(list(cases.values()))
for name in names:
    c, counts = cases[name], counts_all[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(c["T"], c["K"], device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(c["E"], c["K"], c["N"], device="cuda", dtype=torch.bfloat16, generator=gen) * c["K"] ** -0.5
    cg = counts.to("cuda", torch.int32)
    w_nk = w.transpose(1, 2).contiguous()
    auto = lambda: cutlass_moe.moe_gemm(x, w, cg)
    moe = lambda: cutlass_moe.moe_gemm(x, w, cg, backend="moe", config="auto")
    grouped = lambda: cutlass_moe.moe_gemm(x, w, cg, backend="grouped", config="auto")
    peers = {"gmm": bench.grouped_mm_peer(x, w, counts), "gmm_nk": bench.grouped_mm_peer(x, w_nk.transpose(1, 2), counts),
             "loop": bench.loop_peer(x, w, counts), "streams": bench.multistream_peer(x, w, counts)}
    first = {"auto": auto, "grouped": grouped, "moe": moe, **peers}
    swapped = {"moe": moe, "grouped": grouped, "auto": auto, **peers}
    a = bench.median_of_rounds(first, rounds)
    b = bench.median_of_rounds(swapped, rounds)
    c2 = bench.median_of_rounds(first, rounds)
    print(f"{name:20s} bench order: auto {a['auto']:.4f} moe {a['moe']:.4f} ({a['auto'] / a['moe']:.3f}) | "
          f"swapped: auto {b['auto']:.4f} moe {b['moe']:.4f} ({b['auto'] / b['moe']:.3f}) | "
          f"bench order again: auto {c2['auto']:.4f} moe {c2['moe']:.4f} ({c2['auto'] / c2['moe']:.3f}) | "
          f"gmm {a['gmm']:.4f} / {b['gmm']:.4f} streams {a['streams']:.4f} / {b['streams']:.4f}", flush=True)
