"""Can Inductor swap the registered ops for their launch-only twins when it compiles, so that a
package called under no_grad alone skips the ops' autograd layer too (forty-sixth session's lead)?

A decomposition in Inductor's table applies below autograd: AOTAutograd runs each op's autograd
kernel first, then traces what lies under it, where the table is consulted. So a program's module
would keep training through the registered ops while compiled code calls the twins. This probe
checks, on the CPU (the float32 reference path):
  1. a package of the example's block compiled with the decomposition calls the twin (its generated
     code names moe_gemm_fused_launch), and gives eager's output;
  2. torch.compile of a function that calls the registered op directly, with gradients: the same
     output and gradients as eager (the autograd formula still applied);
  3. host µs per call of the package under no_grad with and without the decomposition.

    python3 benchmarks/wip/inductor_twin_decomp_probe.py
"""
import tempfile
import time
import zipfile

import torch

from aoti_twins_probe import TWINS  # each registered op and its twin (also puts the example on the path)
from moe_block import MoeBlock

OPS = torch.ops.cutlass_moe


def install_twins():
    """Each registered op decomposes into its twin in Inductor's decomposition table."""
    from torch._inductor import decomposition
    for op, twin in TWINS.items():
        decomposition.decompositions[op] = twin


def uninstall_twins():
    from torch._inductor import decomposition
    for op in TWINS:
        decomposition.decompositions.pop(op, None)


def package(block, x, folder, name):
    with torch.no_grad():
        dim = torch.export.Dim("tokens", min=1, max=4096)
        program = torch.export.export(block, (x,), dynamic_shapes=({0: dim},))
        path = torch._inductor.aoti_compile_and_package(program, package_path=f"{folder}/{name}.pt2")
    code = ""
    with zipfile.ZipFile(path) as archive:
        for member in archive.namelist():
            if member.endswith((".cpp", ".json", ".py")):
                code += archive.read(member).decode(errors="replace")
    return torch._inductor.aoti_load_package(path), code


def host_us(fn, x, calls=300):
    for _ in range(20):
        fn(x)
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls * 1e6


def main():
    torch.manual_seed(0)
    block = MoeBlock(64, 96, 4, 2)
    x = torch.randn(16, 64)
    with tempfile.TemporaryDirectory() as folder:
        plain, plain_code = package(block, x, folder, "plain")
        install_twins()
        try:
            twinned, twinned_code = package(block, x, folder, "twins")
        finally:
            uninstall_twins()
        print("1. the plain package names the op:", "cutlass_moe::moe_gemm_fused" in plain_code,
              "the twin:", "moe_gemm_fused_launch" in plain_code,
              "| with the decomposition, the twin:", "moe_gemm_fused_launch" in twinned_code)
        for count in (1, 7, 33):
            xs = torch.randn(count, 64)
            with torch.no_grad():
                want = block(xs)
                print(f"   {count} tokens: max |twinned - eager| {float((twinned(xs) - want).abs().max()):.2e}, "
                      f"max |plain - eager| {float((plain(xs) - want).abs().max()):.2e}")

        # 2. training through the registered op under torch.compile, with the decomposition installed
        def fn(a, w, counts):
            return OPS.moe_gemm(a, w, counts, False, "auto", "auto").square().sum()
        a = torch.randn(10, 8, requires_grad=True)
        w = torch.randn(3, 8, 6, requires_grad=True)
        counts = torch.tensor([4, 0, 6])
        eager = torch.autograd.grad(fn(a, w, counts), (a, w))
        install_twins()
        try:
            torch._dynamo.reset()
            compiled = torch.autograd.grad(torch.compile(fn, fullgraph=True)(a, w, counts), (a, w))
        finally:
            uninstall_twins()
        print("2. compiled gradients through the registered op, with the decomposition:",
              [float((c - e).abs().max()) for c, e in zip(compiled, eager)])

        with torch.no_grad():
            xs = torch.randn(1, 64)
            for _ in range(3):
                print(f"3. host us per call under no_grad, 1 token: plain {host_us(plain, xs):.1f}, "
                      f"twins {host_us(twinned, xs):.1f}")
    print("ok")


if __name__ == "__main__":
    main()
