"""The fused epilogue's cost: moe_gemm plain, with bias + activation + row scale fused in the sm90
moe kernel, and the same three as torch operations after the plain GEMM (the composite path), on
the public bench cases (bf16, (E, K, N) weights, the bench's counts). Times: do_bench medians,
the median over alternating rounds of all three.

To run on the GPU machine (after the build): python3 benchmarks/fused_bench.py [--rounds 3]
    [--backend moe|sm80_moe] [--cases name,...]
"""
import argparse
import math

import torch

import cutlass_moe
from cutlass_moe import bench
from cutlass_moe.fused import FusedArgs, _apply_epilogue


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--activation", default="silu")
    parser.add_argument("--backend", default="moe", help="the MoE family: moe (sm90) or sm80_moe")
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    args = parser.parse_args()
    cases = bench.load_cases()
    counts_by_case = bench.case_counts(cases)
    print(f"fused_bench on {torch.cuda.get_device_name()}, torch {torch.__version__}, activation {args.activation}, "
          f"backend {args.backend}")
    print(f"{'case':<22} {'plain ms':>9} {'fused ms':>9} {'composite ms':>12} {'fused/plain':>11} {'composite/fused':>15}")
    ratios, gains = [], []
    for case in cases:
        if args.cases and case["name"] not in args.cases.split(","):
            continue
        t, k, n, e = case["T"], case["K"], case["N"], case["E"]
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
        bias = torch.randn(e, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        scale = torch.rand(t, device="cuda", generator=gen)
        counts = counts_by_case[case["name"]].to("cuda", torch.int32)
        runners = {
            "plain": lambda: cutlass_moe.moe_gemm(x, w, counts, backend=args.backend),
            "fused": lambda: cutlass_moe.moe_gemm(x, w, counts, backend=args.backend, bias=bias,
                                                  activation=args.activation, row_scale=scale),
            "composite": lambda: _apply_epilogue(cutlass_moe.moe_gemm(x, w, counts, backend=args.backend), counts,
                                                 FusedArgs(bias, args.activation, scale)),
        }
        fused, composite = runners["fused"]().float(), runners["composite"]().float()
        err = float((fused - composite).norm() / composite.norm().clamp_min(1e-30))
        med = bench.median_of_rounds(runners, args.rounds)
        ratios.append(med["fused"] / med["plain"])
        gains.append(med["composite"] / med["fused"])
        print(f"{case['name']:<22} {med['plain']:9.3f} {med['fused']:9.3f} {med['composite']:12.3f} "
              f"{ratios[-1]:11.3f} {gains[-1]:15.2f}   (fused vs composite rel diff {err:.1e})")
    geo = lambda v: math.exp(sum(map(math.log, v)) / len(v))
    print(f"geomean fused/plain {geo(ratios):.3f} (max {max(ratios):.3f}); composite/fused {geo(gains):.2f}")


if __name__ == "__main__":
    main()
