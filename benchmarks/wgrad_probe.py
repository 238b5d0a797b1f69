"""Temporary probe: the clustered MoE wgrad config against the 1x1 one (one shape per process)."""
import sys
import torch
import cutlass_moe
from cutlass_moe import bench

name = sys.argv[1]
cases = bench.load_cases()
case = next(c for c in cases if c["name"] == name)
counts = bench.case_counts(cases)[name].cuda()
t, k, n = case["T"], case["K"], case["N"]
gen = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen)
res = {}
for config in sys.argv[2:]:
    fn = lambda: cutlass_moe.moe_gemm_wgrad(x, dy, counts, backend="moe", config=config)
    dw = fn()
    torch.cuda.synchronize()
    res[config] = dw
    ms = min(bench._do_bench(fn, 25, 100) for _ in range(2))
    print(f"{name} {config}: {ms:.3f} ms", flush=True)
vals = list(res.values())
print(name, "bitwise equal:", all(torch.equal(vals[0], v) for v in vals[1:]))
