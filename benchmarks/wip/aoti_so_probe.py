"""AOTInductor through the .so loader (torch._export.aot_compile / aot_load) instead of the package
loader: a model without our ops, then the fused MoE MLP (tests/conftest.FusedMoeMLP).

    python3 benchmarks/wip/aoti_so_probe.py {cpu,cuda} plain
    python3 benchmarks/wip/aoti_so_probe.py {cpu,cuda} {index_add,bincount} tests
"""
import sys, tempfile, torch
dev = sys.argv[1]
what = sys.argv[2]
dt = torch.float32 if dev == "cpu" else torch.bfloat16
d = tempfile.mkdtemp()
if what == "plain":
    class M(torch.nn.Module):
        def forward(self, x):
            return x.sin() + 1
    m = M(); mk = lambda t: torch.randn(t, 8, device=dev)
else:
    import cutlass_moe
    sys.path.insert(0, sys.argv[3])
    from conftest import FusedMoeMLP
    torch.manual_seed(0)
    m = FusedMoeMLP(8, 256, 128, 2, what, dtype=dt, device=dev); mk = lambda t: torch.randn(t, 256, device=dev, dtype=dt)
tokens = torch.export.Dim("tokens", min=1, max=4096)
with torch.no_grad():
    path = torch._export.aot_compile(m, (mk(40),), dynamic_shapes=({0: tokens},), options={"aot_inductor.output_path": d + "/m.so"})
    print(what, dev, "compiled", path, flush=True)
    import glob, shutil
    for j in glob.glob(d + "/*.wrapper.json"):  # the proxy executor's node list, next to the .so
        shutil.copy(j, path[:-3] + ".json")
    r = torch._export.aot_load(path, device=dev)
    print(what, dev, "loaded", flush=True)
    for t in (40, 1, 7, 333):
        x = mk(t)
        got, want = r(x), m(x)
        print(what, dev, t, float((got.float() - want.float()).norm() / want.float().norm()), flush=True)
