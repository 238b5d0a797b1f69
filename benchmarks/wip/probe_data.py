"""Scratch, for the probes in this folder: a public case's data as cutlass_moe.bench.run_case makes
it (seeded x, weights scaled by K**-0.5, the bench's counts), and an A/B of a scratch switch read
from the environment on every call."""
import os
from typing import Callable, Dict

import torch

from cutlass_moe import bench


def case_data(name: str):
    """(case, counts on the host, x, w, counts on the GPU as int32), bf16."""
    case = {c["name"]: c for c in bench.load_cases()}[name]
    counts = bench.case_counts([case])[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(case["T"], case["K"], device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(case["E"], case["K"], case["N"], device="cuda", dtype=torch.bfloat16, generator=gen) * case["K"] ** -0.5
    return case, counts, x, w, counts.to("cuda", torch.int32)


def switch_ab(runs: Dict[str, Callable[[], torch.Tensor]], switch: str, rounds: int) -> None:
    """Times each run of `runs` in alternating rounds (bench.median_of_rounds) and prints its median
    over its group's plain run. A run whose name holds "plain" is timed once with `switch` unset;
    every other run twice, as "[old]" (switch=1, the rule before) and "[new]" (unset), after its
    outputs under both were asserted bitwise equal. A run's group is its name up to the first ",".
    """
    timed = {}
    for name, fn in runs.items():
        if "plain" in name:
            timed[name] = fn
            continue
        os.environ.pop(switch, None)
        new = fn().clone()
        os.environ[switch] = "1"
        old = fn()
        torch.cuda.synchronize()
        assert torch.equal(new, old), name
        timed[name + " [old]"] = fn
        timed[name + " [new]"] = fn
    os.environ.pop(switch, None)

    def runner(name, fn):
        def run():
            if name.endswith("[old]"):
                os.environ[switch] = "1"
            else:
                os.environ.pop(switch, None)
            return fn()
        return run

    med = bench.median_of_rounds({k: runner(k, f) for k, f in timed.items()}, rounds)
    for k, v in med.items():
        plain = [p for p in med if p.startswith(k.split(",")[0]) and "plain" in p][0]
        print(f"{k:52s} {v:.4f} ms  / plain {v / med[plain]:.3f}", flush=True)
