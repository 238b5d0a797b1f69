"""Host time per call: 1000 back-to-back calls of a tiny problem on the host clock, then one
synchronize (shared/GPU.md). Compares moe_gemm with torch._grouped_mm in the same run.

To run: python benchmarks/host_overhead.py [--calls 1000]
"""
import argparse
import time

import torch

import cutlass_moe


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    e, t, k, n = 8, 64, 128, 128
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16)
    counts = torch.full((e,), t // e, device="cuda", dtype=torch.int32)
    out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = {
        "moe_gemm (auto, new out)": lambda: cutlass_moe.moe_gemm(x, w, counts),  # allocates, as torch does
        "moe_gemm grouped": lambda: cutlass_moe.moe_gemm(x, w, counts, out=out, backend="grouped"),
        "moe_gemm moe": lambda: cutlass_moe.moe_gemm(x, w, counts, out=out, backend="moe"),
        "torch._grouped_mm": lambda: torch._grouped_mm(x, w, offs=offs),
    }
    print(f"host us/call over {args.calls} calls (E={e} T={t} K={k} N={n}, bf16) on {torch.cuda.get_device_name()}")
    for name, fn in rows.items():
        print(f"  {name:<26} {per_call_us(fn, args.calls):7.1f}")


if __name__ == "__main__":
    main()
