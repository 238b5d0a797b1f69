"""Which custom-op schema makes AOTInductor's package loader crash? One op per process (benchmarks/wip/README.md).

    python3 benchmarks/wip/aoti_probe.py {none,plain,str,opt_none,opt_tensor,float_bool,scalartype,int} {cpu,cuda}
"""
import sys, torch
case, dev = sys.argv[1], sys.argv[2]
SCHEMAS = {
    "none": "(Tensor x) -> Tensor",
    "plain": "(Tensor x) -> Tensor",
    "str": "(Tensor x, str s) -> Tensor",
    "opt_none": "(Tensor x, Tensor? b) -> Tensor",
    "opt_tensor": "(Tensor x, Tensor? b) -> Tensor",
    "float_bool": "(Tensor x, float a, bool f) -> Tensor",
    "scalartype": "(Tensor x, ScalarType? d) -> Tensor",
    "int": "(Tensor x, int i) -> Tensor",
}
lib = torch.library.Library("probe", "DEF")
lib.define("op" + SCHEMAS[case])
def impl(x, *rest):
    return x * 2
for key in ("CPU", "CUDA"):
    lib.impl("op", impl, key)
torch.library.register_fake("probe::op", lambda x, *rest: torch.empty_like(x), lib=lib)
ARGS = {"none": (), "plain": (), "str": ("auto",), "opt_none": (None,), "opt_tensor": ("T",), "float_bool": (1.5, True),
        "scalartype": (None,), "int": (3,)}
class M(torch.nn.Module):
    def forward(self, x, y):
        if case == "none":
            return (x + 1) @ y.t()
        extra = tuple(y if a == "T" else a for a in ARGS[case])
        return torch.ops.probe.op(x + 1, *extra) + 1
x = torch.randn(4, 8, device=dev); y = torch.randn(4, 8, device=dev)
ep = torch.export.export(M(), (x, y))
path = torch._inductor.aoti_compile_and_package(ep, package_path=f"/tmp/probe_{case}_{dev}.pt2")
print(case, dev, "compiled", flush=True)
r = torch._inductor.aoti_load_package(path)
print(case, dev, "loaded", flush=True)
print(case, dev, "ok" if torch.allclose(r(x, y), M()(x, y)) else "WRONG", flush=True)
