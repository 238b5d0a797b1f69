"""Scratch: GroupPacer's lead (CUTLASS_MOE_PACE_LEAD, read per call) on the public cases, in
alternating rounds (bench._do_bench medians, the GPU heated first); outputs checked bitwise equal
across leads. Run from outside the source tree: python3 pace_probe.py CASES LEADS ROUNDS"""
import os
import statistics
import sys

import torch

import cutlass_moe
from cutlass_moe import bench
from probe_data import case_data

names, leads, rounds = sys.argv[1].split(","), [int(v) for v in sys.argv[2].split(",")], int(sys.argv[3])
for name in names:
    c, counts, x, w, cg = case_data(name)
    fn = lambda: cutlass_moe.moe_gemm(x, w, cg)
    ref = None
    for lead in leads:
        os.environ["CUTLASS_MOE_PACE_LEAD"] = str(lead)
        for _ in range(3):
            y = fn()
            torch.cuda.synchronize()
            if ref is None:
                ref = y.clone()
            assert torch.equal(y, ref), f"{name}: lead {lead} differs"
    del y, ref
    bench.heat(fn)
    samples = {lead: [] for lead in leads}
    for r in range(rounds):
        for lead in (leads if r % 2 == 0 else leads[::-1]):
            os.environ["CUTLASS_MOE_PACE_LEAD"] = str(lead)
            samples[lead].append(bench._do_bench(fn, 25, 100))
    med = {lead: statistics.median(v) for lead, v in samples.items()}
    base = med[leads[0]]
    print(f"{name:22s} " + "  ".join(f"lead {lead}: {m:.4f} ({m / base:.3f})" for lead, m in med.items()),
          cutlass_moe.select_config(c["T"], c["E"], c["N"], c["K"]), flush=True)
os.environ["CUTLASS_MOE_PACE_LEAD"] = "0"
