"""Is qwen3-30b's wgrad held at the power cap? Clock, power and energy per call of the bf16 MoE wgrad
on qwen3-30b-prefill's shape (E=128, T=32768, K=2048, N=1536, the bench's random split) in the modes
of the scratch switches (wgrad_direct_stores.patch and wgrad_half_b.patch applied together), beside
a fill of a dW-sized tensor (805 MB written, nothing read) and one dense GEMM of the same FLOPs
(x^T dy, a 6 MB output). Sustained windows as energy_per_call.py takes them (heat, then timed with
nvidia-smi sampling), the runners alternating over --rounds; medians per runner.

  python3 wgrad_energy_probe.py [--rounds 2] [--heat-s 1.0] [--seconds 1.0]   (from outside the tree;
  energy_per_call.py is found through $R/benchmarks, R being the repository root)
"""
import argparse
import os
import statistics
import sys

import torch

from cutlass_moe import bench, moe_gemm_wgrad

sys.path.insert(0, os.path.join(os.environ.get("R", "."), "benchmarks"))
from energy_per_call import window  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--heat-s", type=float, default=1.0)
parser.add_argument("--seconds", type=float, default=1.0)
args = parser.parse_args()

e, t, k, n = 128, 32768, 2048, 1536
gen = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen)
counts = bench.case_counts(bench.load_cases())["qwen3-30b-prefill"].to("cuda", torch.int32)
dw = torch.empty(e, k, n, device="cuda", dtype=torch.bfloat16)
flops = 2 * t * k * n


def wgrad(half_b, direct):
    def run():
        os.environ["CUTLASS_MOE_SCRATCH_WGRAD_HALFB"] = half_b
        os.environ["CUTLASS_MOE_SCRATCH_WGRAD_DIRECT"] = direct
        return moe_gemm_wgrad(x, dy, counts, out=dw, backend="moe")
    return run


runners = {
    "wgrad today": wgrad("0", "0"),
    "wgrad, no stores (wrong dW)": wgrad("0", "3"),
    "wgrad, half of B loaded (wrong dW)": wgrad("1", "0"),
    "wgrad, handshake only (wrong dW)": wgrad("0", "6"),
    "fill of dW (805 MB)": lambda: dw.fill_(1.0),
    "torch.mm x^T dy (same FLOPs)": lambda: torch.mm(x.t(), dy),
}
results = {name: [] for name in runners}
with torch.no_grad():
    for _ in range(args.rounds):
        for name, fn in runners.items():
            results[name].append(window(fn, args.heat_s, args.seconds))
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.rounds} rounds of {args.heat_s} s heat "
      f"+ {args.seconds} s timed; medians")
print(f"{'runner':<38}{'ms/call':>9}{'MHz':>7}{'W':>6}{'J/call':>8}{'TFLOP/s':>9}")
for name, rs in results.items():
    med = {key: statistics.median(r[key] for r in rs) for key in ("ms", "mhz", "w", "j")}
    rate = f"{flops / med['ms'] / 1e9:9.0f}" if "fill" not in name else f"{dw.numel() * 2 / med['ms'] / 1e9:7.2f}TB"
    print(f"{name:<38}{med['ms']:9.4f}{med['mhz']:7.0f}{med['w']:6.0f}{med['j']:8.4f}{rate}")
