"""What a dense GEMM of the same FLOPs reaches: an attainable-efficiency reference for issue 12's
floor bar on the compute-bound public cases.

For each compute-bound case (floor set by FLOPs: T x K x N at 790 TFLOP/s), three things are timed
side by side in alternating rounds:
  ours         cutlass_moe.moe_gemm(x, w, counts) with its defaults (the bench's case and counts);
  dense        torch.mm(x, w[0]) on the whole (T, K) x (K, N): the same FLOPs as one expert holding
               every row, through cuBLAS: no ragged tiles, no per-expert padding, no expert switches;
  dense bmm    torch.bmm over E equal groups of T / E rows (where E divides T): the same FLOPs split
               evenly, through cuBLAS's batched GEMM.
The floor fractions of the dense runs bound what tiling these FLOPs on this GPU reaches in
practice: where cuBLAS's dense GEMM itself sits well under 0.85 of the floor, the gap is the
GPU's (clocks under sustained tensor load, wave quantization, ramp-up), not the ragged split's.

With --wgrad, the same for issue 10's weight gradient on the four training shapes
(training_bench.py's SHAPES), dW in bf16:
  ours         cutlass_moe.moe_gemm_wgrad(x, dy, counts) on the bench's random split;
  ours even    the same on an even split (T / E rows per expert);
  torch        torch._grouped_mm(x.t(), dy, offs=offs), the call torch's autograd makes;
  dense bmm    torch.bmm(x_e^T, dy_e) over E equal groups: the same FLOPs and the same dW bytes,
               through cuBLAS's batched GEMM with the same MN-major operands.
Floor as training_bench.py's: max(FLOPs / 790 TFLOP/s, (x + dy) / 4.36 TB/s + dW / the write
bandwidth measured in the same run).

To run (on the GPU machine): python3 benchmarks/dense_reference.py [--rounds 5] [--cases a,b] [--wgrad]
"""
from __future__ import annotations

import argparse
import statistics

import torch

import cutlass_moe
from cutlass_moe import bench

PEAK_TFLOPS = 790.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: the compute-bound ones)")
    parser.add_argument("--wgrad", action="store_true", help="the weight gradient on issue 10's training shapes")
    args = parser.parse_args()
    if args.wgrad:
        wgrad_reference(args.rounds)
        return
    cases = bench.load_cases()
    counts_by_case = bench.case_counts(cases)
    wanted = set(args.cases.split(",")) if args.cases else None
    print(f"dense_reference on {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"floor = 2TKN / {PEAK_TFLOPS:.0f} TFLOP/s; medians of {args.rounds} alternating rounds")
    print(f"{'case':<20} {'floor ms':>8} {'ours ms':>8} {'dense ms':>8} {'bmm ms':>8} "
          f"{'ours %':>7} {'dense %':>7} {'bmm %':>7} {'ours/dense':>10}")
    fractions = {"ours": [], "dense": []}
    for case in cases:
        t, k, n, e = case["T"], case["K"], case["N"], case["E"]
        flops_ms = 2.0 * t * k * n / (PEAK_TFLOPS * 1e12) * 1e3
        # Compute-bound cases only: elsewhere the dense GEMM reads one expert's weights, not E.
        # (cases.json rounds floor_ms to the microsecond.)
        if (wanted is not None and case["name"] not in wanted) or case["floor_ms"] > flops_ms * 1.01:
            continue
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
        counts = counts_by_case[case["name"]].to("cuda", torch.int32)
        runners = {"ours": lambda: cutlass_moe.moe_gemm(x, w, counts),
                   "dense": lambda: torch.mm(x, w[0])}
        if t % e == 0:
            xb = x.view(e, t // e, k)
            runners["bmm"] = lambda: torch.bmm(xb, w)
        med = bench.median_of_rounds(runners, args.rounds)
        fractions["ours"].append(flops_ms / med["ours"])
        fractions["dense"].append(flops_ms / med["dense"])
        bmm = med.get("bmm")
        print(f"{case['name']:<20} {flops_ms:8.3f} {med['ours']:8.3f} {med['dense']:8.3f} "
              f"{bmm if bmm else float('nan'):8.3f} {100 * flops_ms / med['ours']:6.1f}% "
              f"{100 * flops_ms / med['dense']:6.1f}% "
              f"{100 * flops_ms / bmm if bmm else float('nan'):6.1f}% {med['dense'] / med['ours']:10.3f}",
              flush=True)
        del x, w, runners
        torch.cuda.empty_cache()
    print_fractions(fractions)


def print_fractions(fractions) -> None:
    """Each provider's floor fractions over the shapes: geomean and min."""
    for name, values in fractions.items():
        if values:
            print(f"{name}: floor fraction geomean {statistics.geometric_mean(values):.3f}, min {min(values):.3f}")


def wgrad_reference(rounds: int) -> None:
    from training_bench import SHAPES, shape_data, wgrad_floor_ms, write_bandwidth

    cases = bench.load_cases()
    counts_by_case = bench.case_counts(cases)
    write_tbps = write_bandwidth()
    print(f"dense_reference --wgrad on {torch.cuda.get_device_name()}, torch {torch.__version__}; dW bf16; "
          f"write bandwidth {write_tbps:.2f} TB/s; medians of {rounds} alternating rounds")
    names = ["ours", "ours even", "torch", "dense bmm"]
    print(f"{'shape':<20} {'floor ms':>8} " + " ".join(f"{n + ' ms':>12}" for n in names) + " "
          + " ".join(f"{n + ' %':>11}" for n in names))
    fractions = {n: [] for n in names}
    for name in SHAPES:
        case, counts, x, w, dy = shape_data(name, cases, counts_by_case)
        del w
        t, k, n, e = case["T"], case["K"], case["N"], case["E"]
        assert t % e == 0, name
        counts_gpu = counts.to("cuda", torch.int32)
        even = torch.full((e,), t // e, dtype=torch.int32, device="cuda")
        offs = torch.cumsum(counts_gpu, 0, dtype=torch.int32)
        xb, dyb = x.view(e, t // e, k), dy.view(e, t // e, n)
        runners = {"ours": lambda: cutlass_moe.moe_gemm_wgrad(x, dy, counts_gpu),
                   "ours even": lambda: cutlass_moe.moe_gemm_wgrad(x, dy, even),
                   "torch": lambda: torch._grouped_mm(x.t(), dy, offs=offs),
                   "dense bmm": lambda: torch.bmm(xb.transpose(1, 2), dyb)}
        # The even split's dW against the batched GEMM's: the two compute the same thing.
        got, ref = runners["ours even"](), runners["dense bmm"]()
        err = max(float((got[i].float() - ref[i].float()).norm() / ref[i].float().norm()) for i in range(e))
        assert err < 2e-2, (name, err)
        del got, ref
        med = bench.median_of_rounds(runners, rounds)
        active = int((counts > 0).sum())
        floors = {"ragged": wgrad_floor_ms(t, k, n, active, write_tbps),
                  "even": wgrad_floor_ms(t, k, n, e, write_tbps)}
        fr = {nm: (floors["ragged"] if nm in ("ours", "torch") else floors["even"]) / med[nm] for nm in names}
        for nm in names:
            fractions[nm].append(fr[nm])
        print(f"{name:<20} {floors['ragged']:8.3f} " + " ".join(f"{med[nm]:12.3f}" for nm in names) + " "
              + " ".join(f"{100 * fr[nm]:10.1f}%" for nm in names), flush=True)
        del x, dy, xb, dyb, runners
        torch.cuda.empty_cache()
    print_fractions(fractions)


if __name__ == "__main__":
    main()
