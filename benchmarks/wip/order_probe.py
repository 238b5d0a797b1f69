"""Scratch: does a runner's place in bench.median_of_rounds move its time? Times the bench's runners
for each case three times: in the bench's order (ours = auto first), with auto and moe:auto (the
same launch where the plans agree) swapped, and in the bench's order again, five rounds each. Run from outside the source tree:
python3 order_probe.py CASES [ROUNDS]"""
import sys

import cutlass_moe
from cutlass_moe import bench
from probe_data import case_data

names = sys.argv[1].split(",")
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
for name in names:
    _, counts, x, w, cg = case_data(name)
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
