"""Energy per call under sustained load: why a kernel's idle cycles stop costing time at the power cap.

Each runner runs back to back for --heat-s (the card reaches its power cap), then for --seconds with
CUDA events around the whole window, while `nvidia-smi -lms 50` samples the SM clock and the board
power. The table gives ms per call, the mean clock and power over the window, and the energy per
call (mean power x time per call), in joules and in joules per TFLOP of useful work (2 x rows x K x
N, no padding).

At the cap (H200: 700 W), time per call = energy per call / power: a change that removes idle cycles
but not work (no fewer bytes, instructions or MMAs) leaves the energy, and so the time, where it was,
and the clock falls instead (benchmarks/NOTES.md, twenty-fourth session).

Runners (bf16): on qwen3-30b-prefill's shape (E=128, T=32768, K=2048, N=1536) moe_gemm on the bench's
random split, on an even split, and on the random split with x all zeros (MMAs on zeros); torch.mm
of the same FLOPs (one (T, K) x (K, N)), and torch.bmm over E even groups (the same FLOPs and weight
bytes), the same bmm with one weight shared by all groups (stride 0: no weight traffic), and a read
of the weights alone (no FLOPs: its J/TFLOP and TFLOP/s read "-"); on
seed004-uniform's (PR #263's) shape moe_gemm and torch.mm.

To run (on the GPU machine, from outside the source tree): python3 energy_per_call.py [--seconds 1.5]
"""
from __future__ import annotations

import argparse
import subprocess
import time

import torch

import cutlass_moe
from cutlass_moe import bench


def window(fn, heat_s: float, seconds: float) -> dict:
    """ms per call, mean SM clock (MHz) and power (W) over `seconds` of fn back to back after heat_s."""
    bench.heat(fn, heat_s * 1e3)
    smi = subprocess.Popen(["nvidia-smi", "-i", str(torch.cuda.current_device()), "--query-gpu=clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.2)  # nvidia-smi's first sample
    begin, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 0
    begin.record()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            fn()
        calls += 8
        torch.cuda.synchronize()
    stop.record()
    torch.cuda.synchronize()
    smi.terminate()
    out, _ = smi.communicate()
    samples = [tuple(float(v) for v in line.split(",")) for line in out.strip().splitlines() if "," in line]
    samples = samples[2:-1] or samples  # drop the edges of the window
    clock = sum(s[0] for s in samples) / len(samples)
    power = sum(s[1] for s in samples) / len(samples)
    ms = begin.elapsed_time(stop) / calls
    return {"ms": ms, "mhz": clock, "w": power, "j": power * ms / 1e3, "samples": len(samples)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heat-s", type=float, default=1.5)
    parser.add_argument("--seconds", type=float, default=1.5)
    args = parser.parse_args()
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=dev, dtype=dt, generator=gen)
    counts_all = bench.case_counts(bench.load_cases())  # the bench's counts, drawn in its case order
    runners = []
    # qwen3-30b-prefill's shape
    e, t, k, n = 128, 32768, 2048, 1536
    x, w = rnd(t, k), rnd(e, k, n) * k ** -0.5
    random_counts = counts_all["qwen3-30b-prefill"].to(dev, torch.int32)
    even_counts = torch.full((e,), t // e, device=dev, dtype=torch.int32)
    zeros = torch.zeros_like(x)
    flops = 2 * t * k * n
    runners += [
        ("qwen3 moe_gemm, random split", flops, lambda: cutlass_moe.moe_gemm(x, w, random_counts)),
        ("qwen3 moe_gemm, even split", flops, lambda: cutlass_moe.moe_gemm(x, w, even_counts)),
        ("qwen3 moe_gemm, random, x = 0", flops, lambda: cutlass_moe.moe_gemm(zeros, w, random_counts)),
        ("qwen3 torch.mm, same FLOPs", flops, lambda: torch.mm(x, w[0])),
        ("qwen3 torch.bmm, even groups", flops, lambda: torch.bmm(x.view(e, t // e, k), w)),
        # The same batched GEMM with one weight for all groups (stride 0): the 805 MB of weights
        # leave DRAM's traffic, the FLOPs and the split stay. The difference is what reading them costs.
        ("qwen3 torch.bmm, one shared weight", flops,
         lambda: torch.bmm(x.view(e, t // e, k), w[0].expand(e, k, n))),
        # The weights read once and nothing computed: DRAM's own power and time.
        ("qwen3 weights read (w.sum)", None, lambda: w.sum(dtype=torch.float32)),
    ]
    # seed004-uniform (PR #263's shape)
    e2, t2, k2, n2 = 12, 30720, 1024, 3072
    x2, w2 = rnd(t2, k2), rnd(e2, k2, n2) * k2 ** -0.5
    c2 = torch.full((e2,), t2 // e2, device=dev, dtype=torch.int32)
    flops2 = 2 * t2 * k2 * n2
    runners += [
        ("seed004 moe_gemm", flops2, lambda: cutlass_moe.moe_gemm(x2, w2, c2)),
        ("seed004 torch.mm, same FLOPs", flops2, lambda: torch.mm(x2, w2[0])),
    ]
    print(f"energy per call on {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"{args.heat_s} s heat, then {args.seconds} s timed")
    print(f"{'runner':<34}{'ms/call':>9}{'MHz':>7}{'W':>6}{'J/call':>8}{'J/TFLOP':>9}{'TFLOP/s':>9}")
    with torch.no_grad():
        for name, fl, fn in runners:
            r = window(fn, args.heat_s, args.seconds)
            per_flop = f"{r['j'] / (fl / 1e12):9.3f}{fl / r['ms'] / 1e9:9.0f}" if fl else f"{'-':>9}{'-':>9}"
            print(f"{name:<34}{r['ms']:9.4f}{r['mhz']:7.0f}{r['w']:6.0f}{r['j']:8.4f}{per_flop}", flush=True)


if __name__ == "__main__":
    main()
