"""Scratch A/B of a seeded bf16 bias's two remaining costs, per call against the same kernel's call
without fusions, seven alternating rounds (CUTLASS_MOE_SCRATCH_FUSED, a scratch field of
FusedEpilogue set on the host: `git apply benchmarks/wip/seed_pass_scratch.patch`, not on main):
  0  the change: a tile whose only fusion is its seeded bias skips apply() (the fused pass);
  1  the rule before: such a tile enters apply(), which has nothing to do;
  2  as 0, but every tile seeds from expert 0's first columns, which stay in L1: wrong outputs,
     the seed's load latency taken away (a bound on what hiding it could gain).
Outputs of 0 and 1 are asserted bitwise equal. Run from outside the source tree:
python3 seed_pass_probe.py [ROUNDS]"""
import os
import sys

import torch

import cutlass_moe
from cutlass_moe import bench
from cutlass_moe.grouped_linear import _interleaved_linear, grouped_linear

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
torch.manual_seed(0)
SWITCH = "CUTLASS_MOE_SCRATCH_FUSED"
BF16 = torch.bfloat16


def moe(t, e, k, n):
    x = torch.randn(t, k, device="cuda", dtype=BF16)
    w = torch.randn(e, k, n, device="cuda", dtype=BF16) * k ** -0.5
    b = torch.randn(e, n, device="cuda", dtype=BF16) * 0.1
    counts = bench.case_counts([{"name": "s", "E": e, "T": t, "dist": "random"}])["s"].to("cuda", torch.int32)
    scale = torch.rand(t, device="cuda", dtype=torch.float32)
    return x, w, b, counts, scale


cases = {}  # name -> (plain, fused, modes)
xg = torch.randn(2560, 12, 1024, device="cuda", dtype=BF16)
wg = torch.randn(12, 1024, 3072, device="cuda", dtype=BF16) * 1024 ** -0.5
bg = torch.randn(12, 3072, device="cuda", dtype=BF16) * 0.1
cases["PR263 linear + bias"] = (lambda: _interleaved_linear(xg, wg, None), lambda: grouped_linear(xg, wg, bg), "012")
x, w, b, c, s = moe(65536, 128, 2880, 2880)
cases["gpt-oss down 512 rows + bias"] = (lambda: cutlass_moe.moe_gemm(x, w, c),
                                         lambda: cutlass_moe.moe_gemm(x, w, c, bias=b), "012")
x2, w2, b2, c2, s2 = moe(16384, 128, 2880, 2880)
cases["gpt-oss down 128 rows + bias"] = (lambda: cutlass_moe.moe_gemm(x2, w2, c2),
                                         lambda: cutlass_moe.moe_gemm(x2, w2, c2, bias=b2), "012")
cases["gpt-oss down 128 rows + bias + scale"] = (lambda: cutlass_moe.moe_gemm(x2, w2, c2),
                                                 lambda: cutlass_moe.moe_gemm(x2, w2, c2, bias=b2, row_scale=s2), "02")
x3, w3, b3, c3, s3 = moe(16384, 128, 2880, 5760)
cases["gpt-oss gate/up 128 rows, gated oai + bias"] = (
    lambda: cutlass_moe.moe_gemm(x3, w3, c3),
    lambda: cutlass_moe.moe_gemm_gated(x3, w3, c3, activation="swiglu_oai", bias=b3), "02")


def with_mode(mode, fn):
    def run():
        os.environ[SWITCH] = mode
        return fn()
    return run


runners = {}
for name, (plain, fused, modes) in cases.items():
    os.environ[SWITCH] = "0"
    new = fused().clone()
    if "1" in modes:
        os.environ[SWITCH] = "1"
        old = fused()
        torch.cuda.synchronize()
        assert torch.equal(new, old), name
    runners[f"{name} | plain"] = with_mode("0", plain)
    for m in modes:
        runners[f"{name} | mode {m}"] = with_mode(m, fused)
os.environ[SWITCH] = "0"

med = bench.median_of_rounds(runners, rounds)
for k, v in med.items():
    plain = med[k.split(" | ")[0] + " | plain"]
    print(f"{k:64s} {v:.4f} ms  / plain {v / plain:.3f}", flush=True)
