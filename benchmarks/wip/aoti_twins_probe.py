"""Do AOTInductor packages gain from calling the launch-only twins instead of the registered ops?

The example's MoE block (examples/python/moe_block.py) exported under no_grad with a dynamic token
count, then compiled twice: as exported (the package calls cutlass_moe::moe_gemm_fused through the
dispatcher, which runs the custom op's Python autograd layer on every call), and after
`run_decompositions` swapped each registered op for its launch-only twin (same schema, no autograd
kernel). Each runner also under torch.inference_mode(), which excludes the autograd dispatch keys,
so a registered op's autograd layer is skipped there. Per token count, three figures per runner:
  - host: µs per call as the host sees it, 200 calls back to back with no sync in between;
  - gpu: CUDA-event median of single calls (ms), which includes host time where the host is slower;
  - the largest relative difference from eager.

    CXX=/usr/bin/g++ python3 benchmarks/wip/aoti_twins_probe.py [--dims qwen3|mixtral|small] [tokens ...]
"""
import argparse
import pathlib
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"))
import cutlass_moe  # noqa: E402,F401  (registers the ops)
from moe_block import MoeBlock  # noqa: E402

DIMS = {"qwen3": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2), "small": (256, 384, 8, 2)}
TWINS = {
    torch.ops.cutlass_moe.moe_gemm.default: torch.ops.cutlass_moe.moe_gemm_launch.default,
    torch.ops.cutlass_moe.moe_gemm_fused.default: torch.ops.cutlass_moe.moe_gemm_fused_launch.default,
    torch.ops.cutlass_moe.grouped_linear.default: torch.ops.cutlass_moe.grouped_linear_launch.default,
}


def targets(program):
    return sorted({str(n.target) for n in program.graph.nodes
                   if n.op == "call_function" and str(n.target).startswith("cutlass_moe.")})


def host_us(fn, x, calls=200):
    for _ in range(10):
        fn(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    total = (time.perf_counter() - start) / calls * 1e6
    return host, total


def event_ms(fn, x, repeats=100):
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def under_inference_mode(fn):
    def run(x):
        with torch.inference_mode():
            return fn(x)
    return run


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", default="qwen3", choices=sorted(DIMS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("tokens", type=int, nargs="*", default=[1, 8, 64, 512])
    args = parser.parse_args()
    hidden, inter, experts, top_k = DIMS[args.dims]
    torch.manual_seed(0)
    block = MoeBlock(hidden, inter, experts, top_k, dtype=torch.bfloat16, device="cuda").eval()
    print(f"{args.dims}: H={hidden}, I={inter}, E={experts}, top {top_k}; torch {torch.__version__}; "
          f"cxx {torch._inductor.config.cpp.cxx}")
    runners = {"eager": block}
    with torch.no_grad(), tempfile.TemporaryDirectory() as folder:
        dim = torch.export.Dim("tokens", min=1, max=65536)
        program = torch.export.export(block, (torch.randn(16, hidden, device="cuda", dtype=torch.bfloat16),),
                                      dynamic_shapes=({0: dim},))
        twinned = program.run_decompositions({op: twin for op, twin in TWINS.items()})
        for name, prog in (("package", program), ("package+twins", twinned)):
            print(f"{name}: {targets(prog)}")
            path = torch._inductor.aoti_compile_and_package(prog, package_path=f"{folder}/{name}.pt2")
            runners[name] = torch._inductor.aoti_load_package(path)
        runners.update({name + " (inf)": under_inference_mode(fn) for name, fn in list(runners.items())})
        print(f"{'tokens':>6} {'runner':<20} {'host us':>8} {'wall us':>8} {'event ms':>9} {'max rel':>8}")
        for count in args.tokens:
            x = torch.randn(count, hidden, device="cuda", dtype=torch.bfloat16)
            want = block(x).float()
            for _ in range(args.rounds):  # alternating rounds
                for name, fn in runners.items():
                    got = fn(x).float()
                    rel = float((got - want).abs().max() / want.abs().max())
                    host, wall = host_us(fn, x)
                    print(f"{count:>6} {name:<20} {host:8.1f} {wall:8.1f} {event_ms(fn, x):9.4f} {rel:8.1e}")
    print("ok")


if __name__ == "__main__":
    main()
