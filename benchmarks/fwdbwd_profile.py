"""Where one forward + backward of a single grouped GEMM spends its GPU time (issue 10's fwdbwd part):
every kernel that `moe_gemm(x, w, counts).backward(dy)` and `torch._grouped_mm(x, w, offs=offs).backward(dy)`
launch, with its duration (torch.profiler, CUDA activity), the sum of those durations, and the
step's time between two CUDA events around it, for the training shapes (training_bench.SHAPES).
A step whose event time exceeds its kernels' sum by much has gaps (host-bound launches, syncs);
a kernel that is not one of the three GEMMs is work the step could drop.

To run (on the GPU machine, the package installed): python3 benchmarks/fwdbwd_profile.py [--steps 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from cutlass_moe import bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from training_bench import SHAPES, fwdbwd_steps, shape_data  # noqa: E402


def kernels_of(step, steps: int):
    """(name, us) of each kernel of the first profiled step, and the event ms of every profiled step."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    event_ms = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            event_ms.append(start.elapsed_time(end))
    kernels = [(e.name, e.device_time) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0]
    per_step = len(kernels) // steps if steps else 0
    return kernels[:per_step], event_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    cases = bench.load_cases()
    counts_by_case = bench.case_counts(cases)
    print(f"fwdbwd_profile on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in args.shapes.split(","):
        _, counts, x, w, dy = shape_data(name, cases, counts_by_case)
        counts_gpu = counts.to("cuda", torch.int32)
        offs = torch.cumsum(counts_gpu, 0, dtype=torch.int32)
        ours, theirs = fwdbwd_steps(x, w, counts_gpu, offs, dy)
        del x, w  # the steps hold their own copies

        for label, step in (("ours", ours), ("torch", theirs)):
            bench.heat(step)
            kernels, event_ms = kernels_of(step, args.steps)
            total_us = sum(us for _, us in kernels)
            print(f"\n{name} {label}: step {statistics.median(event_ms):.3f} ms (events, median of {args.steps}), "
                  f"kernels {total_us / 1e3:.3f} ms in {len(kernels)} launches")
            for kname, us in kernels:
                print(f"  {us / 1e3:8.3f} ms  {kname[:110]}")
        del ours, theirs, dy
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
