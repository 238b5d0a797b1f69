"""Temporary probe: which wgrad calls of the clustered MoE config fault (one call per process)."""
import sys
import torch
import cutlass_moe

t, k, n, e, kind, pad = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
config = sys.argv[7] if len(sys.argv) > 7 else "sm90_cooperative_128x256x64_2x1x1"
gen = torch.Generator(device="cuda").manual_seed(0)
xb = torch.randn(t + pad, k, device="cuda", dtype=torch.bfloat16, generator=gen)
db = torch.randn(t + pad, n, device="cuda", dtype=torch.bfloat16, generator=gen)
x, dy = xb[:t], db[:t]
if kind == "uniform64":
    counts = torch.full((e,), t // e // 64 * 64, dtype=torch.int64)
elif kind == "uniform":
    counts = torch.full((e,), t // e, dtype=torch.int64)
else:
    c = torch.rand(e, generator=torch.Generator().manual_seed(1))
    counts = (c / c.sum() * t).long()
    counts[-1] += t - int(counts.sum())
counts = counts.cuda()
dw = cutlass_moe.moe_gemm_wgrad(x, dy, counts, backend="moe", config=config)
torch.cuda.synchronize()
ref = torch._grouped_mm(x.t(), dy, offs=torch.cumsum(counts, 0, dtype=torch.int32))
err = max(float((dw[i].float() - ref[i].float()).norm() / ref[i].float().norm().clamp_min(1e-30)) for i in range(e))
print("ok", sys.argv[1:], f"max rel err {err:.2e}")
