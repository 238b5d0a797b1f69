"""How a kernel's time per call moves as a paused GPU heats up: why bench.heat runs before any timing.

For each case, after a pause (the card cools and boosts its clock, as after the bench's float32
checks), the kernel runs back to back for --seconds with CUDA events around every call; the table
gives the median call time in windows of time since the start. On an H200 the first 50-100 ms run
8-15% faster than the rest: the card boosts until it reaches its 700 W cap, then settles
(benchmarks/NOTES.md, "The bench flattered whichever runner it timed first").

Runners per case: moe_gemm and torch._grouped_mm on the bench's data and counts, and with --wgrad
moe_gemm_wgrad too.

To run (on the GPU machine): python3 benchmarks/clock_ramp.py [--cases a,b] [--pause 1.5] [--seconds 1.5] [--wgrad]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import cutlass_moe
from cutlass_moe import bench

WINDOWS_MS = (25, 50, 100, 200, 300, 500, 800, 1200)


def ramp(fn, pause_s: float, seconds: float) -> list:
    """[(window end in ms, median ms per call in it)] of fn run back to back after a pause of pause_s."""
    fn()
    torch.cuda.synchronize()
    time.sleep(pause_s)
    events = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        events.append((begin, end))
        if len(events) % 8 == 0:  # keep the host a few calls ahead, not seconds
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    windows, current, elapsed = [], [], 0.0
    bounds = iter(WINDOWS_MS + (float("inf"),))
    bound = next(bounds)
    for begin, end in events:
        ms = begin.elapsed_time(end)
        elapsed += ms
        current.append(ms)
        if elapsed >= bound:
            windows.append((bound, statistics.median(current)))
            current, bound = [], next(bounds)
    if current:
        windows.append((float("inf"), statistics.median(current)))
    return windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="qwen3-30b-prefill,seed001-llama4,dsv3-prefill")
    parser.add_argument("--pause", type=float, default=1.5, help="seconds idle before each ramp")
    parser.add_argument("--seconds", type=float, default=1.5, help="seconds of back-to-back calls")
    parser.add_argument("--wgrad", action="store_true", help="also moe_gemm_wgrad(x, dy, counts)")
    args = parser.parse_args()
    cases = {c["name"]: c for c in bench.load_cases()}
    counts = bench.case_counts(list(cases.values()))
    print(f"clock_ramp on {torch.cuda.get_device_name()}, torch {torch.__version__}: median ms per call by window "
          f"of time since the start, after {args.pause} s idle")
    print(f"{'case, runner':<40} " + " ".join(f"{'<' + str(w) + 'ms':>8}" for w in WINDOWS_MS) + f" {'later':>8}")
    for name in args.cases.split(","):
        case = cases[name]
        t, k, n, e = case["T"], case["K"], case["N"], case["E"]
        counts_gpu = counts[name].to("cuda", torch.int32)
        offs = torch.cumsum(counts_gpu, 0, dtype=torch.int32)
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
        runners = {"moe_gemm": lambda: cutlass_moe.moe_gemm(x, w, counts_gpu),
                   "torch._grouped_mm": lambda: torch._grouped_mm(x, w, offs=offs)}
        dy = None
        if args.wgrad:
            dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen)
            runners["moe_gemm_wgrad"] = lambda: cutlass_moe.moe_gemm_wgrad(x, dy, counts_gpu)
        for label, fn in runners.items():
            cells = dict(ramp(fn, args.pause, args.seconds))
            print(f"{name + ', ' + label:<40} "
                  + " ".join(f"{cells[b]:8.4f}" if b in cells else f"{'-':>8}" for b in WINDOWS_MS + (float('inf'),)))
        x = w = dy = runners = None  # dy too (--wgrad), before the next case's data
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
