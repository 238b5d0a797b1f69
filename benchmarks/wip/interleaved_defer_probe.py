"""Scratch A/B: interleaved groups (GroupedLinear) with a bf16 bias, whose bias seeds the accumulators,
with deferred stores (the new rule) against stores after each tile (CUTLASS_MOE_SCRATCH_OLD_RULE=1,
the rule before). Each biased call against the same kernel's call without a bias; alternating
rounds (default 5); the two rules' outputs checked bitwise equal. The switch is a scratch line in
sm90_moe_gemm.cuh, not on main. Run from outside the source tree:
python3 interleaved_defer_probe.py [ROUNDS]"""
import sys

import torch

from cutlass_moe.grouped_linear import _interleaved_linear, _interleaved_takes, grouped_linear
from probe_data import switch_ab

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
torch.manual_seed(0)
SWITCH = "CUTLASS_MOE_SCRATCH_OLD_RULE"


def shape(b, g, k, n):
    x = torch.randn(b, g, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, k, n, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    bias = torch.randn(g, n, device="cuda", dtype=torch.bfloat16) * 0.1
    return x, w, bias


runs = {}
x, w, b = shape(2560, 12, 1024, 3072)  # PR #263's config
assert _interleaved_takes(x, w, b)
runs["PR263 linear, plain"] = lambda: _interleaved_linear(x, w, None)
runs["PR263 linear, bias (grouped_linear)"] = lambda: grouped_linear(x, w, b)
x2, w2, b2 = shape(2560, 12, 1024, 6144)  # GroupedMLP's gate/up, hidden 3072, with a bias
runs["PR263 gate/up, plain"] = lambda: _interleaved_linear(x2, w2, None)
runs["PR263 gate/up, gated silu + bias"] = lambda: _interleaved_linear(x2, w2, b2, activation="silu", gated=True)
x3, w3, b3 = shape(512, 32, 2048, 2048)
runs["B512 G32 linear, plain"] = lambda: _interleaved_linear(x3, w3, None)
runs["B512 G32 linear, bias"] = lambda: _interleaved_linear(x3, w3, b3)

switch_ab(runs, SWITCH, rounds)
