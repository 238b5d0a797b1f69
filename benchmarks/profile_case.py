"""Runs one public case a few times with one backend, for profilers (ncu, nsys, compute-sanitizer).

To run:
  python benchmarks/profile_case.py --case dsv3-prefill --backend moe
  ncu --clock-control none --kernel-name regex:'moe_gemm_kernel|device_kernel' --launch-skip 2 \
      --launch-count 1 --metrics dram__bytes_read.sum,gpu__time_duration.sum \
      python benchmarks/profile_case.py --case dsv3-prefill --backend moe
With --wgrad it runs the case's weight gradient instead, moe_gemm_wgrad(x, dy, counts) with dy (T, N);
with --gated ACT the fused gated projection, moe_gemm_gated(x, w, counts, activation=ACT, bias=(E, N)).
"""
import argparse

import torch

import cutlass_moe
from cutlass_moe import bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", required=True)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--config", default="auto")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--wgrad", action="store_true", help="run moe_gemm_wgrad on the case's shape instead")
    parser.add_argument("--gated", default=None, help="run moe_gemm_gated with this activation and a bias instead")
    args = parser.parse_args()
    cases = bench.load_cases()
    counts = bench.case_counts(cases)[args.case]
    case = next(c for c in cases if c["name"] == args.case)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(case["T"], case["K"], device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(case["E"], case["K"], case["N"], device="cuda", dtype=torch.bfloat16, generator=gen)
    counts = counts.to("cuda", torch.int32)
    if args.wgrad:
        dy = torch.randn(case["T"], case["N"], device="cuda", dtype=torch.bfloat16, generator=gen)
        dw = torch.empty_like(w)
        for _ in range(args.calls):
            cutlass_moe.moe_gemm_wgrad(x, dy, counts, out=dw, backend=args.backend)
        torch.cuda.synchronize()
        return
    if args.gated:
        bias = torch.randn(case["E"], case["N"], device="cuda", dtype=torch.bfloat16, generator=gen) * 0.1
        out = torch.empty(case["T"], case["N"] // 2, device="cuda", dtype=torch.bfloat16)
        for _ in range(args.calls):
            cutlass_moe.moe_gemm_gated(x, w, counts, activation=args.gated, bias=bias, out=out, backend=args.backend,
                                       config=args.config)
        torch.cuda.synchronize()
        return
    out = torch.empty(case["T"], case["N"], device="cuda", dtype=torch.bfloat16)
    for _ in range(args.calls):
        cutlass_moe.moe_gemm(x, w, counts, out=out, backend=args.backend, config=args.config)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
