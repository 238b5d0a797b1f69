"""Runs one public case (or a shape of your own) a few times with one backend, for profilers (ncu,
nsys, compute-sanitizer).

To run:
  python benchmarks/profile_case.py --case dsv3-prefill --backend moe
  ncu --clock-control none --kernel-name regex:'moe_gemm_kernel|device_kernel' --launch-skip 2 \
      --launch-count 1 --metrics dram__bytes_read.sum,gpu__time_duration.sum \
      python benchmarks/profile_case.py --case dsv3-prefill --backend moe
With --wgrad it runs the case's weight gradient instead, moe_gemm_wgrad(x, dy, counts) with dy (T, N);
with --gated ACT the fused gated projection, moe_gemm_gated(x, w, counts, activation=ACT), with a
bias (E, N) unless --no-bias. --down runs the MoE down projection of the case instead of its gate/up
projection: x (T, N / 2) times weights (E, N / 2, K), as benchmarks/mlp_bench.py does. --bias and
--row-scale add those fused epilogues to the plain call. --shape E,T,K,N runs that shape on a
uniform split (T / E rows per expert) instead of a public case; --dtype fp16 runs it in fp16.

Cycles: ncu's gpc__cycles_elapsed.max of the kernel (add `--metrics gpc__cycles_elapsed.max` and
`--launch-skip 1`) does not move with the clock, which the power cap sets anew from one timed round
to the next. Two builds, or a fused call and its plain GEMM, one process each, differ in cycles
by as little as 1% reproducibly, where timed rounds spread 2-4% (benchmarks/NOTES.md, twenty-first
session). Use it to find a kernel change's effect; the timed rounds stay the measure of speed.

Tensor pipe busy: with `--metrics sm__inst_executed_pipe_tensor_op_gmma.sum`, each m64n256k16 WGMMA
counts once per warp (4 per warpgroup) and keeps an SM's tensor cores busy 128 cycles (4096
FLOP/clock/SM in 16 bits), so busy = inst / 4 / SMs * 128 for the 256-column tiles. Elapsed minus
busy over the tiles a CTA runs is the time per tile when the tensor cores wait (benchmarks/NOTES.md,
twenty-third session: about 3,600 cycles per tile in the forward's deferred cooperative tile).
"""
import argparse

import torch

import cutlass_moe
from cutlass_moe import bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--case", help="a public case (cutlass_moe.bench's cases.json), with its split")
    where.add_argument("--shape", help="E,T,K,N: that shape on a uniform split (T / E rows per expert)")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--config", default="auto")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--wgrad", action="store_true", help="run moe_gemm_wgrad on the case's shape instead")
    parser.add_argument("--gated", default=None, help="run moe_gemm_gated with this activation (and a bias) instead")
    parser.add_argument("--down", action="store_true",
                        help="the case's down projection: K and N become the case's N / 2 and K")
    parser.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None,
                        help="a per-expert bias (default: with --gated only)")
    parser.add_argument("--row-scale", action="store_true", help="a float32 row scale (the router weights)")
    args = parser.parse_args()
    if args.shape:
        e, t, k, n = (int(v) for v in args.shape.split(","))
        counts = torch.full((e,), t // e, dtype=torch.int32)
    else:
        cases = bench.load_cases()
        counts = bench.case_counts(cases)[args.case]
        case = next(c for c in cases if c["name"] == args.case)
        t, e, k, n = case["T"], case["E"], case["K"], case["N"]
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    if args.down:
        k, n = n // 2, k
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, k, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(e, k, n, device="cuda", dtype=dtype, generator=gen) * k ** -0.5
    counts = counts.to("cuda", torch.int32)
    if args.wgrad:
        dy = torch.randn(t, n, device="cuda", dtype=dtype, generator=gen)
        dw = torch.empty_like(w)
        for _ in range(args.calls):
            cutlass_moe.moe_gemm_wgrad(x, dy, counts, out=dw, backend=args.backend)
        torch.cuda.synchronize()
        return
    with_bias = args.bias if args.bias is not None else args.gated is not None
    bias = torch.randn(e, n, device="cuda", dtype=dtype, generator=gen) * 0.1 if with_bias else None
    scale = torch.rand(t, device="cuda", generator=gen) if args.row_scale else None
    if args.gated:
        out = torch.empty(t, n // 2, device="cuda", dtype=dtype)
        for _ in range(args.calls):
            cutlass_moe.moe_gemm_gated(x, w, counts, activation=args.gated, bias=bias, row_scale=scale, out=out,
                                       backend=args.backend, config=args.config)
        torch.cuda.synchronize()
        return
    out = torch.empty(t, n, device="cuda", dtype=dtype)
    for _ in range(args.calls):
        cutlass_moe.moe_gemm(x, w, counts, out=out, bias=bias, row_scale=scale, backend=args.backend,
                             config=args.config)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
