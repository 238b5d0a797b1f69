"""Scratch: is dsv3-prefill's time bimodal by where its output lies? Times moe_gemm(..., out=view)
with the output at several offsets into one pool, in alternating rounds (bench._do_bench medians),
beside a fresh allocation per call (the bench's way). Run from outside the source tree:
python3 out_offset_probe.py [CASE] [ROUNDS]"""
import statistics
import sys

import torch

import cutlass_moe
from cutlass_moe import bench
from probe_data import case_data

name = sys.argv[1] if len(sys.argv) > 1 else "dsv3-prefill"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
c, counts, x, w, cg = case_data(name)
size = c["T"] * c["N"]
offsets_mb = [0, 2, 32, 64, 96, 130, 192, 256]
pool = torch.empty(size + max(offsets_mb) * 2**19 + 4096, dtype=torch.bfloat16, device="cuda")
runners = {"fresh": lambda: cutlass_moe.moe_gemm(x, w, cg)}
for mb in offsets_mb:
    view = pool[mb * 2**19: mb * 2**19 + size].view(c["T"], c["N"])
    runners[f"+{mb}MB"] = lambda view=view: cutlass_moe.moe_gemm(x, w, cg, out=view)
samples = {k: [] for k in runners}
bench.heat(runners["fresh"])
for r in range(rounds):
    for k in (list(runners) if r % 2 == 0 else list(reversed(runners))):
        samples[k].append(bench._do_bench(runners[k], 25, 100))
for k, v in samples.items():
    print(f"{name} {k:8s} median {statistics.median(v):.4f}  rounds " + " ".join(f"{t:.3f}" for t in v), flush=True)
