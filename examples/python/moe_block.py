"""A Mixtral-style MoE block on cutlass_moe: the layer a model calls, from the router to the combine.

    python examples/python/moe_block.py                          # CPU: the float32 reference path
    python examples/python/moe_block.py --device cuda            # the kernels, bf16
    python examples/python/moe_block.py --device cuda --compile  # torch.compile(fullgraph=True) too
    python examples/python/moe_block.py --device cuda --aoti     # exported, compiled by AOTInductor

What it shows:
- Routing: the top k of the router's softmax, renormalized over the k chosen (Mixtral); the token
  copies sorted by expert with a stable argsort; each expert's count from a search of the sorted
  expert ids (E entries, no atomics). Nothing is read back to the host (torch.bincount would: on a
  GPU it reads the ids' maximum to size its output), so the block can sit in a CUDA graph while the
  routing changes.
- The experts in two calls:
  - ``moe_gemm_gated``: gate and up projections in one GEMM, SwiGLU in its epilogue;
  - ``moe_gemm`` with ``row_scale``: the down projection, each row scaled by its router weight in the
    epilogue.
- The combine: the expert outputs put back in token order (``index_copy``: a permutation, each
  row written once, no atomics, so the same bits on every run), then each token's k scaled rows
  summed.
- Hugging Face's expert weights taken as they are stored: per expert, ``w1`` (gate) and ``w3`` (up)
  are nn.Linear weights of shape (I, H), and ``w2`` (down) is (H, I). Gate and up are interleaved
  into one (E, 2I, H) tensor; every projection runs with ``trans_b=True``, with no transposed copy.
- Serving ahead of time (``--aoti``): the block exported with the number of tokens dynamic
  (``torch.export``), compiled by AOTInductor into a package, loaded back and run. The package calls
  cutlass_moe's ops through AOTInductor's proxy executor, from a process that has imported
  cutlass_moe (the ops are registered from Python; a process without Python cannot run them).
- Checks: the output and every gradient against a per-expert float32 loop (how Hugging Face's
  MixtralSparseMoeBlock computes the layer); the AOTInductor package's output too. On a GPU the
  script also times the block against that loop in bf16.
"""
import argparse
import pathlib
import tempfile

import torch
import torch.nn.functional as F

import cutlass_moe


class MoeBlock(torch.nn.Module):
    """Router, top-k, the experts' SwiGLU MLPs on cutlass_moe's fused ops, and the combine.

    Parameters: ``router`` (nn.Linear(H, E), no bias); ``gate_up`` (E, 2I, H), gate and up
    interleaved row by row (``cutlass_moe.interleave_gate_up(..., dim=1)``); ``down`` (E, H, I).
    Both expert weights are in nn.Linear's (out, in) layout.
    """

    def __init__(self, hidden, inter, experts, top_k, dtype=None, device=None):
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.experts, self.top_k = experts, top_k
        self.router = torch.nn.Linear(hidden, experts, bias=False, **factory)
        self.gate_up = torch.nn.Parameter(torch.randn(experts, 2 * inter, hidden, **factory) * hidden ** -0.5)
        self.down = torch.nn.Parameter(torch.randn(experts, hidden, inter, **factory) * inter ** -0.5)

    @classmethod
    def from_mixtral(cls, router_weight, w1, w2, w3, top_k):
        """A block holding copies of Hugging Face's Mixtral weights: router_weight (E, H); w1 and w3
        (E, I, H), w2 (E, H, I), each expert's nn.Linear weights stacked."""
        experts, inter, hidden = w1.shape
        block = cls(hidden, inter, experts, top_k, dtype=w1.dtype, device=w1.device)
        with torch.no_grad():
            block.router.weight.copy_(router_weight)
            block.gate_up.copy_(cutlass_moe.interleave_gate_up(w1, w3, dim=1))
            block.down.copy_(w2)
        return block

    def forward(self, x):
        tokens = x.shape[0]
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)          # Mixtral renormalizes the k chosen
        flat = chosen.flatten()                                     # token t's copies at t * k .. t * k + k - 1
        order = torch.argsort(flat, stable=True)                    # the copies sorted by expert
        ends = torch.searchsorted(flat[order], torch.arange(1, self.experts + 1, device=x.device), right=False)
        counts = torch.diff(ends, prepend=ends.new_zeros(1))         # tokens_per_expert, on x's device
        xs = x[order // self.top_k]
        h = cutlass_moe.moe_gemm_gated(xs, self.gate_up, counts, trans_b=True)       # silu(gate) * up
        ys = cutlass_moe.moe_gemm(h, self.down, counts, trans_b=True, row_scale=weights.flatten()[order])
        # ys's row i is copy order[i] (token order[i] // k, slot order[i] % k): back in copy order,
        # then the k copies of each token summed.
        return torch.zeros_like(ys).index_copy(0, order, ys).view(tokens, self.top_k, -1).sum(1)


def loop_reference(block, x):
    """The block's experts computed one by one in float32 on x's device, as Hugging Face's
    MixtralSparseMoeBlock loops over its experts. The router runs as in the block (in x's dtype), so
    both choose the same experts. Differentiable in x and the block's parameters."""
    probs = torch.softmax(block.router(x).float(), dim=-1)
    weights, chosen = torch.topk(probs, block.top_k, dim=-1)
    x = x.float()
    weights = weights / weights.sum(-1, keepdim=True)
    gate_up, down = block.gate_up.float(), block.down.float()
    out = torch.zeros_like(x)
    for e in range(block.experts):
        token, slot = torch.nonzero(chosen == e, as_tuple=True)
        h = x[token] @ gate_up[e].t()
        y = (F.silu(h[:, 0::2]) * h[:, 1::2]) @ down[e].t()
        out = out.index_add(0, token, y * weights[token, slot, None])
    return out


def relative_error(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def check(block, x, run, tolerance):
    """The output and the gradients of x and of every parameter, against loop_reference."""
    results = []
    for fn in (run, lambda t: loop_reference(block, t)):
        block.zero_grad(set_to_none=True)
        xg = x.detach().clone().requires_grad_()
        y = fn(xg)
        y.float().pow(2).sum().backward()
        results.append([y.detach()] + [xg.grad] + [p.grad for p in block.parameters()])
    names = ["output", "x's gradient"] + [f"{name}'s gradient" for name, _ in block.named_parameters()]
    for name, got, want in zip(names, *results):
        err = relative_error(got, want)
        print(f"  {name:<28} relative error {err:.2e}")
        assert err <= tolerance, f"{name}: relative error {err:.3e} > {tolerance:g}"


def check_aoti(block, make_x, tolerance):
    """The block exported under no_grad with a dynamic number of tokens, compiled by AOTInductor
    into a package, loaded back: its output against loop_reference at several token counts, called
    under torch.inference_mode() as a server would (there the registered ops' Python autograd layer
    is skipped: under no_grad alone it still runs on every call). Returns the loaded package (a
    callable)."""
    with torch.no_grad():
        tokens = torch.export.Dim("tokens", min=1, max=65536)
        program = torch.export.export(block, (make_x(16),), dynamic_shapes=({0: tokens},))
        with tempfile.TemporaryDirectory() as folder:
            path = torch._inductor.aoti_compile_and_package(
                program, package_path=str(pathlib.Path(folder) / "moe_block.pt2"))
            package = torch._inductor.aoti_load_package(path)  # loaded: the folder may go
        for count in (1, 16, 333):
            x = make_x(count)
            with torch.inference_mode():
                got = package(x)
            err = relative_error(got, loop_reference(block, x))
            print(f"  {f'output, {count} tokens':<28} relative error {err:.2e}")
            assert err <= tolerance, f"{count} tokens: relative error {err:.3e} > {tolerance:g}"
    return package


def median_ms(fn, repeats=50):
    """Median of `repeats` CUDA-event timings of fn, after a warm-up."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inter", type=int, default=384)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also check torch.compile(fullgraph=True)")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--aoti", action="store_true",
                        help="also export the block and run it compiled by AOTInductor (needs a C++ compiler)")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.manual_seed(0)
    e, i, h = args.experts, args.inter, args.hidden
    # Hugging Face's layout: each expert's w1, w3 (I, H) and w2 (H, I), stacked.
    w1, w3 = (torch.randn(e, i, h) * h ** -0.5 for _ in range(2))
    w2 = torch.randn(e, h, i) * i ** -0.5
    router = torch.randn(e, h) * h ** -0.5
    block = MoeBlock.from_mixtral(*(t.to(device, dtype) for t in (router, w1, w2, w3)), top_k=args.top_k)
    x = torch.randn(args.tokens, h).to(device, dtype)

    print(f"MoE block: {args.tokens} tokens, H={h}, I={i}, {e} experts, top {args.top_k}, {dtype} on {device}")
    print("eager, against the per-expert float32 loop:")
    check(block, x, block, tolerance)
    if args.compile:
        torch._dynamo.reset()
        print(f"torch.compile(fullgraph=True, backend={args.compile_backend!r}), against the same loop:")
        check(block, x, torch.compile(block, fullgraph=True, backend=args.compile_backend), tolerance)
    package = None
    if args.aoti:
        print("torch.export with a dynamic number of tokens, compiled by AOTInductor, against the same loop:")
        package = check_aoti(block, lambda count: torch.randn(count, h).to(device, dtype), tolerance)
    if device.type == "cuda":
        def hf_loop():  # Hugging Face's per-expert loop in the model's dtype
            with torch.no_grad():
                probs = torch.softmax(block.router(x).float(), dim=-1)
                weights, chosen = torch.topk(probs, block.top_k, dim=-1)
                weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
                out = torch.zeros_like(x)
                for expert in range(e):
                    token, slot = torch.nonzero(chosen == expert, as_tuple=True)
                    hh = x[token] @ block.gate_up[expert].t()
                    y = (F.silu(hh[:, 0::2]) * hh[:, 1::2]) @ block.down[expert].t()
                    out.index_add_(0, token, y * weights[token, slot, None])
                return out

        with torch.no_grad():
            ours = median_ms(lambda: block(x))
        loop = median_ms(hf_loop)
        print(f"forward, no grad: {ours:.3f} ms with cutlass_moe, {loop:.3f} ms as a per-expert loop "
              f"({loop / ours:.2f}x)")
        if package is not None:
            with torch.inference_mode():
                packaged = median_ms(lambda: package(x))
            print(f"forward from the AOTInductor package, under inference_mode: {packaged:.3f} ms")
    print("ok")


if __name__ == "__main__":
    main()
