"""Scratch A/B: bf16 with a bias at 256+ rows per expert, where the bias seeds the accumulators and
the stores are now deferred too (CUTLASS_MOE_SEED_NO_DEFER=1: the old rule, not deferred). gpt-oss's
projections at 512 rows per expert (T = 65536, E = 128), and Mixtral's down projection with a bias.
Each fused op against the same kernel's plain GEMM, alternating rounds; outputs of the two rules
checked bitwise equal. Run from outside the source tree: python3 seed_defer_probe.py [ROUNDS]. The switch was a scratch
line in sm90_moe_gemm.cuh (args.defer_stores = false where a bias seeds), not on main: without it
both rules run the new one."""
import sys

import torch

import cutlass_moe
from cutlass_moe import bench
from probe_data import switch_ab

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
torch.manual_seed(0)


def shape(t, e, k, n):
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    b = torch.randn(e, n, device="cuda", dtype=torch.bfloat16) * 0.1
    counts = bench.case_counts([{"name": "s", "E": e, "T": t, "dist": "random"}])["s"].to("cuda", torch.int32)
    scale = torch.rand(t, device="cuda", dtype=torch.float32)
    return x, w, b, counts, scale


runs = {}
x, w, b, c, s = shape(65536, 128, 2880, 5760)
runs["gpt-oss gate/up, plain"] = lambda: cutlass_moe.moe_gemm(x, w, c)
runs["gpt-oss gate/up, gated swiglu_oai + bias"] = lambda: cutlass_moe.moe_gemm_gated(x, w, c, activation="swiglu_oai", bias=b)
x2, w2, b2, c2, s2 = shape(65536, 128, 2880, 2880)
runs["gpt-oss down, plain"] = lambda: cutlass_moe.moe_gemm(x2, w2, c2)
runs["gpt-oss down, bias + row scale"] = lambda: cutlass_moe.moe_gemm(x2, w2, c2, bias=b2, row_scale=s2)
x3, w3, b3, c3, s3 = shape(8192, 8, 14336, 4096)
runs["mixtral down, plain"] = lambda: cutlass_moe.moe_gemm(x3, w3, c3)
runs["mixtral down, bias"] = lambda: cutlass_moe.moe_gemm(x3, w3, c3, bias=b3)

switch_ab(runs, "CUTLASS_MOE_SEED_NO_DEFER", rounds)
