"""Training: autograd of moe_gemm (dgrad through the forward kernels, wgrad through the K-grouped
kernels), moe_gemm_wgrad on its own, the torch.library ops (opcheck, torch.compile, CUDA graphs),
the grouped_gemm / torch._grouped_mm drop-ins, and exported programs (saved and loaded, compiled by
AOTInductor). The CPU tests run everywhere; the GPU tests need kernels for the GPU (conftest)."""
import os
import subprocess
import sys

import pytest
import torch

import cutlass_moe
from cutlass_moe import moe_gemm, moe_gemm_wgrad
from cutlass_moe.reference import assert_close_per_expert, moe_gemm_reference

from conftest import (DTYPE_NAMES, HAS_CUDA, FusedMoeMLP, backend_param, check_aoti_package, check_dw, check_dx,
                      check_reduce_overhead, graph_recorder, random_counts, requires_kernels, runs_here,
                      wgrad_backend_param)

BF16 = torch.bfloat16


def make_weights(e, k, n, dtype, variant, device, gen):
    """(weights, trans_b) for one of the four ways a user hands over K x N matrices."""
    if variant == "kn":
        return torch.randn(e, k, n, device=device, dtype=dtype, generator=gen), False
    if variant == "nk":
        return torch.randn(e, n, k, device=device, dtype=dtype, generator=gen), True
    if variant == "nk_view":
        return torch.randn(e, n, k, device=device, dtype=dtype, generator=gen).transpose(1, 2), False
    if variant == "kn_view":
        return torch.randn(e, k, n, device=device, dtype=dtype, generator=gen).transpose(1, 2), True
    raise ValueError(variant)


def reference_grads(x, w, counts, trans_b, dy):
    """dx, dW of sum(moe_gemm(x, w) * dy) by float32 autograd through the reference loop."""
    x32 = x.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    y = moe_gemm_reference(x32, w32, counts, trans_b=trans_b)
    (y * dy.float()).sum().backward()
    return x32.grad, w32.grad


# ---- CPU: runs everywhere -------------------------------------------------------------------------

@pytest.mark.parametrize("trans_b", [False, True])
def test_gradcheck_cpu(trans_b):
    gen = torch.Generator().manual_seed(0)
    t, k, n, e = 13, 8, 16, 4
    x = torch.randn(t, k, dtype=torch.float64, generator=gen, requires_grad=True)
    shape = (e, n, k) if trans_b else (e, k, n)
    w = torch.randn(*shape, dtype=torch.float64, generator=gen, requires_grad=True)
    counts = torch.tensor([5, 0, 6, 0])  # a zero-token expert, 2 rows no expert owns
    assert torch.autograd.gradcheck(lambda a, b: moe_gemm(a, b, counts, trans_b=trans_b), (x, w))


def test_wgrad_gradcheck_cpu():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(11, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    dy = torch.randn(11, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    counts = torch.tensor([4, 0, 5])
    for trans_b in (False, True):
        assert torch.autograd.gradcheck(lambda a, b: moe_gemm_wgrad(a, b, counts, trans_b=trans_b), (x, dy))


def test_cpu_output_has_grad_fn_and_zero_tail():
    x = torch.randn(10, 8, dtype=BF16, requires_grad=True)
    w = torch.randn(2, 8, 16, dtype=BF16, requires_grad=True)
    y = moe_gemm(x, w, torch.tensor([3, 4]))
    assert y.grad_fn is not None
    assert bool((y[7:] == 0).all()), "rows no expert owns are zeros in a new output"
    y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert bool((x.grad[7:] == 0).all())


def test_wgrad_cpu_matches_reference_and_accumulates():
    gen = torch.Generator().manual_seed(2)
    t, k, n = 40, 16, 24
    counts = torch.tensor([10, 0, 25])  # 5 rows no expert owns
    x = torch.randn(t, k, dtype=BF16, generator=gen)
    dy = torch.randn(t, n, dtype=BF16, generator=gen)
    ref = cutlass_moe.moe_gemm_wgrad_reference(x, dy, counts)
    dw = moe_gemm_wgrad(x, dy, counts)
    assert dw.dtype == BF16 and dw.shape == (3, k, n)
    check_dw(dw, ref, counts, t)
    main_grad = torch.full((3, n, k), 1.0)
    moe_gemm_wgrad(x, dy, counts, trans_b=True, out=main_grad, accumulate=True)
    torch.testing.assert_close(main_grad, ref.transpose(1, 2) + 1.0, rtol=1e-5, atol=1e-4)


def _wgrad_bad_cases():
    x, dy, c = torch.randn(8, 16, dtype=BF16), torch.randn(8, 24, dtype=BF16), torch.tensor([3, 5])
    yield "grad_out rows", dict(grad_out=dy[:7]), ValueError, "grad_out: expected 8 rows"
    yield "grad_out dtype", dict(grad_out=dy.half()), TypeError, "grad_out: dtype"
    yield "grad_out rank", dict(grad_out=dy[None]), ValueError, "grad_out: expected 2 dimensions"
    yield "accumulate without out", dict(accumulate=True), ValueError, "out: accumulate=True adds into out"
    yield "accumulate into bf16", dict(accumulate=True, out=torch.zeros(2, 16, 24, dtype=BF16)), TypeError, \
        "out: accumulate=True adds into a torch.float32"
    yield "out shape", dict(out=torch.zeros(2, 24, 16)), ValueError, "out: expected shape (2, 16, 24)"
    yield "out dtype", dict(out=torch.zeros(2, 16, 24, dtype=torch.float64)), TypeError, "out: expected dtype"
    yield "counts dtype", dict(tokens_per_expert=c.float()), TypeError, "tokens_per_expert: expected dtype"
    yield "accumulate type", dict(accumulate=1), TypeError, "accumulate: expected a bool"
    # Same signature as the good call (checked once per signature): the counts' values still are.
    yield "negative counts", dict(tokens_per_expert=torch.tensor([-1, 9])), ValueError, \
        "tokens_per_expert: counts must be >= 0"
    yield "counts past T", dict(tokens_per_expert=torch.tensor([4, 5])), ValueError, "tokens_per_expert: counts sum to 9"


@pytest.mark.parametrize("label,override,exc,match", list(_wgrad_bad_cases()), ids=[c[0] for c in _wgrad_bad_cases()])
def test_wgrad_bad_arguments_raise_naming_the_argument(label, override, exc, match):
    kwargs = dict(x=torch.randn(8, 16, dtype=BF16), grad_out=torch.randn(8, 24, dtype=BF16),
                  tokens_per_expert=torch.tensor([3, 5]))
    moe_gemm_wgrad(kwargs["x"], kwargs["grad_out"], kwargs["tokens_per_expert"])  # a good call first
    kwargs.update(override)
    with pytest.raises(exc) as info:
        moe_gemm_wgrad(kwargs.pop("x"), kwargs.pop("grad_out"), kwargs.pop("tokens_per_expert"), **kwargs)
    assert match in str(info.value)


def _op_samples(device):
    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(40, 16, dtype=BF16, device=device, generator=gen, requires_grad=True)
    w = torch.randn(3, 16, 24, dtype=BF16, device=device, generator=gen, requires_grad=True)
    counts = torch.tensor([10, 0, 25], device=device)
    dy = torch.randn(40, 24, dtype=BF16, device=device, generator=gen, requires_grad=True)
    return x, w, counts, dy


def _opcheck(device):
    x, w, counts, dy = _op_samples(device)
    torch.library.opcheck(torch.ops.cutlass_moe.moe_gemm.default, (x, w, counts, False, "auto", "auto"))
    torch.library.opcheck(torch.ops.cutlass_moe.moe_gemm.default,
                          (x, w.detach().transpose(1, 2).contiguous().requires_grad_(), counts, True, "auto", "auto"))
    torch.library.opcheck(torch.ops.cutlass_moe.moe_gemm_wgrad.default, (x, dy, counts, False, None, "auto", "auto"))
    torch.library.opcheck(torch.ops.cutlass_moe.moe_gemm_wgrad.default, (x, dy, counts, True, torch.float32, "auto", "auto"))
    # The launch-only twins that compiled graphs call (no autograd kernel: inputs without grad).
    x, w, dy = x.detach(), w.detach(), dy.detach()
    torch.library.opcheck(torch.ops.cutlass_moe.moe_gemm_launch.default, (x, w, counts, False, "auto", "auto"))
    torch.library.opcheck(torch.ops.cutlass_moe.moe_gemm_wgrad_launch.default,
                          (x, dy, counts, True, torch.float32, "auto", "auto"))


def test_opcheck_cpu():
    _opcheck("cpu")


class MoeMLP(torch.nn.Module):
    """Route, gate and up projections, SiLU, down projection, per-token combine: the MoE layer of a
    Mixtral-style model, written with one grouped-GEMM function for all three projections."""

    def __init__(self, experts, hidden, inter, top_k, gemm, dtype, device):
        super().__init__()
        self.top_k, self.gemm, self.experts = top_k, gemm, experts
        self.router = torch.nn.Linear(hidden, experts, bias=False, dtype=dtype, device=device)
        scale = hidden ** -0.5
        self.w_gate = torch.nn.Parameter(torch.randn(experts, hidden, inter, dtype=dtype, device=device) * scale)
        self.w_up = torch.nn.Parameter(torch.randn(experts, hidden, inter, dtype=dtype, device=device) * scale)
        self.w_down = torch.nn.Parameter(torch.randn(experts, inter, hidden, dtype=dtype, device=device) * inter ** -0.5)

    def forward(self, x):
        probs, chosen = torch.topk(torch.softmax(self.router(x).float(), dim=-1), self.top_k, dim=-1)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.experts, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
        xs = x[order // self.top_k]
        h = torch.nn.functional.silu(self.gemm(xs, self.w_gate, counts)) * self.gemm(xs, self.w_up, counts)
        ys = self.gemm(h, self.w_down, counts)
        out = torch.zeros(x.shape[0] * self.top_k, x.shape[1], dtype=ys.dtype, device=x.device)
        out = out.index_copy(0, order, ys)
        return (out.view(x.shape[0], self.top_k, -1) * probs.to(ys.dtype).unsqueeze(-1)).sum(1)


def ours(xs, w, counts):
    return moe_gemm(xs, w, counts)


def test_compile_fullgraph_cpu():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MoeMLP(4, 32, 16, 2, ours, torch.float32, "cpu")
    x = torch.randn(24, 32)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    torch.testing.assert_close(y, eager)
    y.sum().backward()
    assert model.w_gate.grad is not None and model.w_down.grad is not None


def _checkpointed_grads_are_the_same_bits(device, dtype, tokens, hidden, inter, compile_backend):
    """Activation checkpointing (torch.utils.checkpoint, non-reentrant, as torchtitan and Megatron
    recompute a layer) over the MoE MLP: the recomputed forward gives the same bits, so every
    gradient equals the one without checkpointing bitwise (the kernels are deterministic)."""
    torch.manual_seed(0)
    model = MoeMLP(8, hidden, inter, 2, ours, dtype, device)
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)

    def grads(run):
        model.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        run(xg).float().pow(2).sum().backward()
        return [xg.grad] + [p.grad for p in model.parameters()]

    def checkpointed(v):
        return torch.utils.checkpoint.checkpoint(model, v, use_reentrant=False)

    plain = grads(model)
    names = ["x"] + [n for n, _ in model.named_parameters()]
    for name, a, b in zip(names, plain, grads(checkpointed)):
        assert a is not None and torch.equal(a, b), f"{name}: the checkpointed gradient differs"
    # Under torch.compile(fullgraph=True) too (the checkpoint becomes a higher-order op around the
    # launch ops). Inductor fuses the SiLU and the products in float32 where eager rounds in between:
    # the gradients agree to the dtype's rounding as a whole.
    torch._dynamo.reset()
    compiled = torch.compile(checkpointed, fullgraph=True, backend=compile_backend)
    for name, a, b in zip(names, plain, grads(compiled)):
        err = (b.float() - a.float()).norm() / a.float().norm()
        assert err < 2e-2, f"{name}: the compiled checkpointed gradient's relative error is {err:.3e}"


def _counts_as_views(device):
    """tokens_per_expert as a strided view (a column of a 2-D table) or an expanded one (stride 0, one
    element of storage): the forward, the fused epilogue, the backward and the weight gradient read the
    counts the view holds, the same bits as from a contiguous copy."""
    gen = torch.Generator().manual_seed(35)
    t, k, n, e = 300, 64, 32, 4
    x = torch.randn(t, k, generator=gen).to(device, BF16)
    w = (torch.randn(e, k, n, generator=gen) * k ** -0.5).to(device, BF16)
    dy = torch.randn(t, n, generator=gen).to(device, BF16)
    table = torch.tensor([[100, 7], [0, 7], [150, 7], [40, 7]], device=device)
    views = [table[:, 0], torch.tensor([70], device=device).expand(e)]
    for view in views:
        dense = view.contiguous()
        assert not view.is_contiguous()

        def run(counts):
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = moe_gemm(xg, wg, counts)
            y.backward(dy)
            with torch.no_grad():
                fused = moe_gemm(x, w, counts, activation="relu", row_scale=torch.ones(t, device=device))
            return y.detach(), fused, xg.grad, wg.grad, moe_gemm_wgrad(x, dy, counts, out_dtype=torch.float32)

        for i, (a, b) in enumerate(zip(run(view), run(dense))):
            assert torch.equal(a, b), f"{tuple(view.stride())}-strided counts: result {i} differs"


def test_counts_as_strided_views_cpu():
    _counts_as_views("cpu")


def test_activation_checkpointing_cpu():
    # aot_eager: the same graphs without Inductor's C++ build (a minute on a cold 2-core machine)
    _checkpointed_grads_are_the_same_bits("cpu", torch.float32, 40, 32, 16, "aot_eager")


def test_compiled_graphs_call_the_launch_ops_cpu():
    # Compiled graphs call the launch-only ops (no Python autograd layer per call): the forward and
    # the dgrad through cutlass_moe::moe_gemm_launch, the wgrad through moe_gemm_wgrad_launch.
    torch._dynamo.reset()
    backend, targets = graph_recorder()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(24, 32, generator=gen, requires_grad=True)
    w = torch.randn(3, 32, 16, generator=gen, requires_grad=True)
    counts = torch.tensor([10, 0, 14])
    loss = torch.compile(lambda x, w: moe_gemm(x, w, counts).pow(2).sum(), fullgraph=True, backend=backend)(x, w)
    loss.backward()
    assert targets == {"forward": [["cutlass_moe.moe_gemm_launch.default"]],
                       "backward": [["cutlass_moe.moe_gemm_launch.default",
                                     "cutlass_moe.moe_gemm_wgrad_launch.default"]]}, targets
    # moe_gemm_wgrad differentiated under torch.compile: the launch ops both ways too.
    torch._dynamo.reset()
    backend, targets = graph_recorder()
    dy = torch.randn(24, 16, generator=gen, requires_grad=True)
    xw = x.detach().requires_grad_()
    fn = lambda x, dy: moe_gemm_wgrad(x, dy, counts).pow(2).sum()
    torch.compile(fn, fullgraph=True, backend=backend)(xw, dy).backward()
    assert targets == {"forward": [["cutlass_moe.moe_gemm_wgrad_launch.default"]],
                       "backward": [["cutlass_moe.moe_gemm_launch.default"] * 2]}, targets
    xw2, dy2 = x.detach().requires_grad_(), dy.detach().requires_grad_()
    fn(xw2, dy2).backward()
    torch.testing.assert_close(xw.grad, xw2.grad)
    torch.testing.assert_close(dy.grad, dy2.grad)
    gx, gw = x.grad, w.grad
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    moe_gemm(x2, w2, counts).pow(2).sum().backward()
    torch.testing.assert_close(gx, x2.grad)
    torch.testing.assert_close(gw, w2.grad)


def _compile_dynamic_token_counts(device, dtype, backend):
    """An MoE layer sees a new T (routed rows) on every batch: with dynamic shapes one compiled graph
    serves them all (no recompile after the first call), forward and backward, for moe_gemm,
    moe_gemm_wgrad and the fused gated op (no gradient: the fused kernel on the GPU)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(3, 32, 16, generator=gen).to(device, dtype).requires_grad_()
    w_gated, bias = (torch.randn(3, 32, 16, generator=gen) / 4).to(device, dtype), torch.randn(3, 16).to(device, dtype)
    calls = {
        "moe_gemm": lambda x, dy, counts: moe_gemm(x, w, counts).float().pow(2).sum(),
        "moe_gemm_wgrad": lambda x, dy, counts: moe_gemm_wgrad(x, dy, counts).float().pow(2).sum(),
        "moe_gemm_gated": lambda x, dy, counts: cutlass_moe.moe_gemm_gated(x, w_gated, counts, bias=bias).float().sum(),
    }
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for name, fn in calls.items():
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=counter)
        frames = None
        for t in (24, 40, 57):
            x = torch.randn(t, 32, generator=gen).to(device, dtype).requires_grad_(name != "moe_gemm_gated")
            dy = torch.randn(t, 16, generator=gen).to(device, dtype)  # no size equal to a T (duck sizing)
            counts = torch.tensor([t // 3, 0, t - t // 3 - 2], device=device)  # two rows no expert owns
            with torch.set_grad_enabled(name != "moe_gemm_gated"):
                loss = compiled(x, dy, counts)
                want_x = x.detach().requires_grad_(x.requires_grad)
                want = fn(want_x, dy, counts)
            frames = frames or counter.frame_count
            torch.testing.assert_close(loss, want, **tol)
            if x.requires_grad:
                loss.backward()
                want.backward()
                torch.testing.assert_close(x.grad, want_x.grad, **tol)
        assert counter.frame_count == frames, (name, counter.frame_count, frames)


def _compile_counts_from_bincount(device, dtype, backend):
    """Counts from torch.bincount(expert_ids, minlength=E), as routing code often builds them: under
    torch.compile their length is known only at run time. Every entry point compiles in one graph
    (the length asserted at run time, not guarded while tracing) and computes what eager does,
    gradients included; counts of the wrong length still fail, naming the argument."""
    gen = torch.Generator().manual_seed(12)
    t, k, n, e = 40, 32, 16, 4
    x = torch.randn(t, k, generator=gen).to(device, dtype).requires_grad_()
    w = torch.randn(e, k, n, generator=gen).to(device, dtype).requires_grad_()
    bias, scale = torch.randn(e, n, generator=gen).to(device, dtype), torch.rand(t, generator=gen).to(device)
    dy = torch.randn(t, n, generator=gen).to(device, dtype)
    ids = torch.tensor([0] * 11 + [2] * 20 + [3] * 7, device=device)  # expert 1 empty, two rows no expert owns

    def fn(x, w, ids):
        counts = torch.bincount(ids, minlength=e)
        y = moe_gemm(x, w, counts, bias=bias, activation="silu", row_scale=scale)
        gated = cutlass_moe.moe_gemm_gated(x, w, counts)
        return y.float().pow(2).sum() + gated.float().sum() + moe_gemm_wgrad(x, dy, counts).float().sum()

    want = fn(x, w, ids)
    want_grads = torch.autograd.grad(want, (x, w))
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend=backend)(x, w, ids)
    grads = torch.autograd.grad(got, (x, w))
    for name, a, b in (("loss", got, want), ("dx", *[g[0] for g in (grads, want_grads)]),
                       ("dw", *[g[1] for g in (grads, want_grads)])):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, msg=name)
        else:  # Inductor keeps fp32 between the fused elementwise ops where eager rounds to bf16
            err = (a.float() - b.float()).norm() / b.float().norm()
            assert err < 2e-2, f"{name}: relative error {err:.3e}"
    # An expert id past E makes the counts longer: the compiled graph stops at run time, at the
    # assertion the length check put in the graph (aot_eager on torch 2.13: "Runtime assertion
    # failed"), at Inductor's size check of the counts (torch 2.11: "expected size 6==4"), or at the
    # op's own check. A wrong static length fails the trace, naming the argument.
    torch._dynamo.reset()
    with pytest.raises(Exception, match="tokens_per_expert: expected|Runtime assertion failed|expected size 6==4"):
        torch.compile(fn, fullgraph=True, backend=backend)(x, w, torch.tensor([0, 5], device=device))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="tokens_per_expert: expected one entry per expert"):
        torch.compile(lambda x, counts: moe_gemm(x, w, counts), fullgraph=True, backend=backend)(
            x, torch.tensor([10, 10, 10], device=device))


def test_compile_counts_from_bincount_cpu():
    _compile_counts_from_bincount("cpu", torch.float32, "aot_eager")


def test_compile_dynamic_token_counts_cpu():
    _compile_dynamic_token_counts("cpu", torch.float32, "aot_eager")


def test_export_holds_the_registered_op_cpu():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 32, 16, generator=torch.Generator().manual_seed(6)))

        def forward(self, x, counts):
            return moe_gemm(x, self.w, counts)

    x, counts = torch.randn(24, 32, generator=torch.Generator().manual_seed(7)), torch.tensor([10, 0, 14])
    layer = Layer()
    for strict in (True, False):
        program = torch.export.export(layer, (x, counts), strict=strict)
        targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
        assert targets == ["cutlass_moe.moe_gemm.default"], (strict, targets)
        torch.testing.assert_close(program.module()(x, counts), layer(x, counts))


def test_exported_program_saved_loaded_and_trained_through_cpu(tmp_path):
    """torch.export.save of the fused MoE MLP (the number of tokens dynamic), loaded by a fresh process
    that imports cutlass_moe and run at a new token count: eager's bits. The loaded program's module
    is differentiable: trained through, it gives eager's output and gradients (float64)."""
    torch.manual_seed(0)
    model = FusedMoeMLP(4, 32, 24, 2, "index_add", dtype=torch.float64)
    tokens = torch.export.Dim("tokens", min=1, max=4096)
    program = torch.export.export(model, (torch.randn(40, 32, dtype=torch.float64),), dynamic_shapes=({0: tokens},))
    torch.export.save(program, tmp_path / "moe.pt2")
    x = torch.randn(7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    torch.save(x, tmp_path / "x.pt")
    with torch.no_grad():
        torch.save(model(x), tmp_path / "want.pt")
    code = ("import sys, torch, cutlass_moe\n"
            "folder = sys.argv[1]\n"
            "y = torch.export.load(folder + '/moe.pt2').module()(torch.load(folder + '/x.pt'))\n"
            "assert torch.equal(y, torch.load(folder + '/want.pt')), (y - torch.load(folder + '/want.pt')).abs().max()\n"
            "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.rstrip().endswith("ok"), result.stderr[-2000:]

    loaded = torch.export.load(tmp_path / "moe.pt2").module()
    grads = []
    for run, params in ((loaded, list(loaded.parameters())), (model, list(model.parameters()))):
        xg = x.clone().requires_grad_()
        y = run(xg)
        torch.autograd.backward(y.pow(2).sum())
        grads.append([y.detach(), xg.grad] + [p.grad for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_aoti_package_cpu(tmp_path):
    """The MoE MLP on the fused ops, exported and compiled ahead of time by AOTInductor: the package
    holds the registered fused op (the float32 reference path on the CPU)."""
    torch.manual_seed(0)
    model = FusedMoeMLP(4, 32, 24, 2, "index_add")
    gen = torch.Generator().manual_seed(1)
    targets = check_aoti_package(model, lambda t: torch.randn(t, 32, generator=gen), tmp_path / "moe.pt2", rel=1e-5)
    assert targets == ["cutlass_moe.moe_gemm_fused.default"] * 2, targets


def test_aoti_compiler_falls_back_where_torch_s_fails_cpu():
    """conftest.aoti_compiler, which the AOTI tests compile with: where torch's own C++ compiler
    ($CXX) cannot build a package that loads, it finds one on PATH that can (on the H200 machine $CXX
    builds packages that crash at load), so those tests run instead of skipping."""
    import pathlib
    import shutil
    from conftest import AOTI_COMPILER_ENV, aoti_compiler
    compiler, reason = aoti_compiler()
    if reason:
        pytest.skip(reason)
    found = [shutil.which(name) for name in ("g++", "clang++") if shutil.which(name)]
    code = "import conftest; compiler, reason = conftest.aoti_compiler(); print(compiler, reason)"
    env = {name: value for name, value in os.environ.items() if name != AOTI_COMPILER_ENV}  # probe, not recall
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800,
                            cwd=pathlib.Path(__file__).parent, env={**env, "CXX": "/nonexistent/g++"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[0] in found, (found, result.stdout)


def test_aoti_compiler_takes_a_handed_down_answer_cpu():
    """benchmarks/run_tests.sh probes once and hands conftest.aoti_compiler's answer to its pytest
    processes in $CUTLASS_MOE_TEST_AOTI_COMPILER: each form of aoti_compiler_answer() must come back
    from aoti_compiler() as it went in, without a probe (a probe compiles a package: minutes here)."""
    import pathlib
    from conftest import AOTI_COMPILER_ENV
    code = ("import conftest\n"
            "compiler, why = conftest.aoti_compiler()\n"
            "print(repr((compiler, why, conftest.aoti_compiler_answer())))")
    for answer, want in (("default", (None, None)), ("/usr/bin/g++", ("/usr/bin/g++", None)),
                         ("none: no compiler here", (None, "no compiler here"))):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                cwd=pathlib.Path(__file__).parent, env={**os.environ, AOTI_COMPILER_ENV: answer})
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip().splitlines()[-1] == repr((*want, answer)), (answer, result.stdout)


def test_gmm_cpu_is_moe_gemm():
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(30, 16, dtype=BF16, generator=gen)
    b = torch.randn(3, 24, 16, dtype=BF16, generator=gen)
    sizes = torch.tensor([10, 0, 20])
    torch.testing.assert_close(cutlass_moe.gmm(a, b, sizes, trans_b=True), moe_gemm(a, b, sizes, trans_b=True))


def _autocast_checks(device, dtype=BF16):
    """Under torch.autocast(device, dtype): moe_gemm, moe_gemm_gated and gmm compute from fp32 leaves
    exactly what they compute from the leaves cast by hand, in the autocast dtype, and the leaves get
    fp32 gradients; with out= nothing is cast; row_scale is not cast."""
    gen = torch.Generator().manual_seed(30)
    t, k, n, e = 96, 64, 32, 4
    counts = torch.tensor([40, 0, 30, 20], device=device)  # 6 rows no expert owns
    x = torch.randn(t, k, generator=gen).to(device).requires_grad_()
    w = (torch.randn(e, k, n, generator=gen) * k ** -0.5).to(device).requires_grad_()
    bias = (torch.randn(e, n, generator=gen) * 0.1).to(device)
    probs = torch.rand(t, generator=gen).to(device)
    dy = torch.randn(t, n, generator=gen).to(device, dtype)
    with torch.autocast(device, dtype=dtype):
        y = moe_gemm(x, w, counts)
        via_gmm = cutlass_moe.gmm(x, w, counts)
        with torch.no_grad():  # the fused kernel (a recorded gradient takes the composite path)
            gated = cutlass_moe.moe_gemm_gated(x, w, counts, bias=bias, row_scale=probs)
    xc, wc, bc = (v.detach().to(dtype) for v in (x, w, bias))
    assert y.dtype == gated.dtype == via_gmm.dtype == dtype
    assert torch.equal(y, moe_gemm(xc, wc, counts))
    assert torch.equal(via_gmm, y)
    assert torch.equal(gated, cutlass_moe.moe_gemm_gated(xc, wc, counts, bias=bc, row_scale=probs))
    y.backward(dy)
    assert x.grad.dtype == w.grad.dtype == torch.float32
    ref_dx, ref_dw = reference_grads(xc, wc, counts.cpu(), False, dy)
    check_dx(x.grad.cpu(), ref_dx.cpu(), counts.cpu(), t)
    check_dw(w.grad.cpu(), ref_dw.cpu(), counts.cpu(), t)
    if device == "cpu":  # float32 x and out= (the reference path): a cast x would not match out
        out = torch.empty(t, n)
        with torch.autocast(device, dtype=dtype):
            assert moe_gemm(x.detach(), w.detach(), counts, out=out) is out
            assert torch.equal(out[:90], moe_gemm_reference(x.detach(), w.detach(), counts)[:90])


def test_autocast_casts_like_nn_linear_cpu():
    _autocast_checks("cpu")


# ---- GPU --------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@gpu
@pytest.mark.parametrize("backend", [backend_param("auto"), backend_param("sm80_moe")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["kn", "nk", "nk_view", "kn_view"])
@pytest.mark.parametrize("kind", ["random", "hot", "one"])
def test_gradients_match_float32_autograd(kind, variant, dtype, backend):
    gen = torch.Generator(device="cuda").manual_seed(5)
    t, k, n, e, tail = 1100, 256, 384, 9, 21
    x = torch.randn(t, k, device="cuda", dtype=dtype, generator=gen, requires_grad=True)
    w, trans_b = make_weights(e, k, n, dtype, variant, "cuda", gen)
    w.requires_grad_()
    counts = random_counts(e, t - tail, torch.Generator().manual_seed(6), kind).to("cuda", torch.int32)
    counts[1] = 0  # always a zero-token expert
    counts[-1] += t - tail - int(counts.sum())
    dy = torch.randn(t, n, device="cuda", dtype=dtype, generator=gen)
    y = moe_gemm(x, w, counts, trans_b=trans_b, backend=backend)
    assert y.grad_fn is not None
    y.backward(dy)
    ref_dx, ref_dw = reference_grads(x, w, counts.cpu(), trans_b, dy)
    check_dx(x.grad, ref_dx, counts.cpu(), t)
    check_dw(w.grad, ref_dw, counts.cpu(), t)


@gpu
@requires_kernels
@pytest.mark.parametrize("counts_on", ["cuda", "cpu"])
def test_new_output_is_fully_defined(counts_on):
    # Rows no expert owns are zeros in a new output (never torch.empty's leftovers), on every family.
    x = torch.randn(600, 64, device="cuda", dtype=BF16)
    w = torch.randn(4, 64, 128, device="cuda", dtype=BF16)
    counts = torch.tensor([100, 0, 300, 50], device=counts_on)
    for backend in ("auto",) + tuple(b for b in ("moe", "grouped", "sm80_moe", "sm80_grouped")
                                     if f":{b}:" in ":".join(cutlass_moe.built_configs())):
        torch.cuda.empty_cache()
        junk = torch.full((600, 128), float("nan"), device="cuda", dtype=BF16)  # what the allocator hands back
        del junk
        y = moe_gemm(x, w, counts, backend=backend)
        assert bool((y[450:] == 0).all()), backend
        assert_close_per_expert(y, x, w, counts.cpu())


wgrad_backends = pytest.mark.parametrize("backend", [wgrad_backend_param(f) for f in ("moe", "grouped", "sm80_grouped")])


@gpu
@wgrad_backends
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
# few_rows: under one K block of rows per expert on average, where the MoE launch stores dW with
# EVICT_FIRST (sm90_wgrad_moe.cuh).
@pytest.mark.parametrize("t,e", [(3001, 12), (300, 24)], ids=["rows", "few_rows"])
def test_wgrad_alone_per_expert_and_deterministic(t, e, out_dtype, trans_b, backend):
    gen = torch.Generator(device="cuda").manual_seed(7)
    k, n = 512, 264
    counts = random_counts(e, t - 9, torch.Generator().manual_seed(8), "random").to("cuda", torch.int64)
    counts[3] = 0
    counts[-1] += t - 9 - int(counts.sum())
    x = torch.randn(t, k, device="cuda", dtype=BF16, generator=gen)
    dy = torch.randn(t, n, device="cuda", dtype=BF16, generator=gen)
    shape = (e, n, k) if trans_b else (e, k, n)
    out = torch.full(shape, float("nan"), device="cuda", dtype=out_dtype)
    dw = moe_gemm_wgrad(x, dy, counts, trans_b=trans_b, out=out, backend=backend)
    assert dw is out
    ref = cutlass_moe.moe_gemm_wgrad_reference(x, dy, counts.cpu(), trans_b=trans_b)
    check_dw(dw, ref, counts.cpu(), t)
    again = moe_gemm_wgrad(x, dy, counts, trans_b=trans_b, out=torch.empty_like(out), backend=backend)
    assert torch.equal(again, dw), "the same inputs must give the same bits"


@gpu
@wgrad_backends
def test_wgrad_accumulates_into_fp32_and_leaves_empty_experts(backend):
    gen = torch.Generator(device="cuda").manual_seed(9)
    t, k, n = 2000, 256, 128
    counts = torch.tensor([700, 0, 1200, 0], device="cuda")
    x = torch.randn(t, k, device="cuda", dtype=BF16, generator=gen)
    dy = torch.randn(t, n, device="cuda", dtype=BF16, generator=gen)
    main_grad = torch.randn(4, k, n, device="cuda", generator=gen)
    before = main_grad.clone()
    moe_gemm_wgrad(x, dy, counts, out=main_grad, accumulate=True, backend=backend)
    ref = cutlass_moe.moe_gemm_wgrad_reference(x, dy, counts.cpu())
    assert torch.equal(main_grad[1], before[1]) and torch.equal(main_grad[3], before[3]), "empty experts untouched"
    for e in (0, 2):
        torch.testing.assert_close(main_grad[e] - before[e], ref[e], rtol=1e-3, atol=1e-2)


@gpu
@wgrad_backends
def test_wgrad_weights_layout_views(backend):
    # dW written into an (E, K, N)-shaped buffer whose K is contiguous (a transposed (E, N, K)).
    gen = torch.Generator(device="cuda").manual_seed(10)
    x = torch.randn(500, 128, device="cuda", dtype=BF16, generator=gen)
    dy = torch.randn(500, 64, device="cuda", dtype=BF16, generator=gen)
    counts = torch.tensor([200, 300], device="cuda")
    out = torch.empty(2, 64, 128, device="cuda", dtype=torch.float32).transpose(1, 2)
    moe_gemm_wgrad(x, dy, counts, out=out, backend=backend)
    check_dw(out, cutlass_moe.moe_gemm_wgrad_reference(x, dy, counts.cpu()), counts.cpu(), 500)


@gpu
@pytest.mark.parametrize("t,k,n,e", [(16384, 2880, 5760, 128), (16384, 64, 5760, 1)])
@pytest.mark.parametrize("backend", [wgrad_backend_param("moe")])
def test_wgrad_moe_partial_tiles_at_scale(t, k, n, e, backend):
    # dW of K x N, neither a multiple of the 128 x 256 tile, with long reductions: the last tiles'
    # TMA boxes wholly past K or N once faulted when x or grad_out ended at the end of mapped memory.
    gen = torch.Generator(device="cuda").manual_seed(12)
    x = torch.randn(t, k, device="cuda", dtype=BF16, generator=gen)
    dy = torch.randn(t, n, device="cuda", dtype=BF16, generator=gen)
    counts = torch.full((e,), t // e, device="cuda", dtype=torch.int32)
    dw = moe_gemm_wgrad(x, dy, counts, backend=backend)
    ref = torch._grouped_mm(x.t(), dy, offs=torch.cumsum(counts, 0, dtype=torch.int32))
    for i in range(e):
        err = float((dw[i].float() - ref[i].float()).norm() / ref[i].float().norm())
        assert err < 1e-2, (i, err)


@gpu
@pytest.mark.parametrize("backend", [wgrad_backend_param("moe")])
def test_wgrad_moe_columns_first_when_a_outgrows_l2(backend):
    # (E, N, K) weights with N x the rows per expert of grad_out over half of a 50 MB L2: the launch
    # numbers each expert's tiles columns first (sm90_wgrad_moe.cuh). Ragged counts with an empty
    # expert and rows past the owned ones, partial tiles in both dimensions of dW.
    gen = torch.Generator(device="cuda").manual_seed(31)
    t, k, n = 9216, 320, 6200
    x = torch.randn(t, k, device="cuda", dtype=BF16, generator=gen)
    dy = torch.randn(t, n, device="cuda", dtype=BF16, generator=gen)
    counts = torch.tensor([3000, 0, 4100, 2000], device="cuda")
    out = torch.full((4, n, k), float("nan"), device="cuda", dtype=BF16)
    dw = moe_gemm_wgrad(x, dy, counts, trans_b=True, out=out, backend=backend)
    check_dw(dw, cutlass_moe.moe_gemm_wgrad_reference(x, dy, counts.cpu(), trans_b=True), counts.cpu(), t)
    assert torch.equal(moe_gemm_wgrad(x, dy, counts, trans_b=True, backend=backend), dw)


_WGRAD_MOE_CONFIGS = sorted({name.split(":")[-1] for name in cutlass_moe.built_configs() if ":wgrad_moe:" in name})


@gpu
@pytest.mark.parametrize("config", _WGRAD_MOE_CONFIGS or [pytest.param("none", marks=pytest.mark.skip(
    reason="no sm90 MoE wgrad kernels in this build"))])
@pytest.mark.parametrize("t,k,n,counts", [
    (69, 384, 200, [37, 0, 32]),         # each expert's last K block short (<= 32 rows), ending at T
    (20, 128, 136, [7, 13]),             # fewer rows than one K block in all
    (1003, 384, 520, [500, 1, 0, 502]),  # odd M tiles, a partial N tile, a one-row expert
])
def test_wgrad_moe_configs_ragged_ends(config, t, k, n, counts):
    # Each MoE wgrad config forced, with expert ends at T: the partial K blocks' TMA boxes reach past
    # the last row of x and grad_out and must read nothing there (see sm90_wgrad_kernel.hpp).
    if not runs_here("wgrad_moe"):
        pytest.skip("no sm90 MoE wgrad kernels for this GPU")
    gen = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, k, device="cuda", dtype=BF16, generator=gen)
    dy = torch.randn(t, n, device="cuda", dtype=BF16, generator=gen)
    counts = torch.tensor(counts, device="cuda")
    dw = moe_gemm_wgrad(x, dy, counts, backend="moe", config=config)
    check_dw(dw, cutlass_moe.moe_gemm_wgrad_reference(x, dy, counts.cpu()), counts.cpu(), t)
    torch.cuda.synchronize()


@gpu
@pytest.mark.parametrize("config", _WGRAD_MOE_CONFIGS or [pytest.param("none", marks=pytest.mark.skip(
    reason="no sm90 MoE wgrad kernels in this build"))])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("counts", [
    [0, 0, 1, 64, 65, 0, 128, 130, 192, 0, 0, 200, 256, 257, 320, 448, 5, 63, 0, 0],
    # Under one K block of rows per expert on average: the launch stores with EVICT_FIRST.
    [0, 0, 3, 1, 0, 17, 63, 64, 2, 0, 40, 5, 0, 0, 9, 33, 1, 0, 12, 65, 0, 7, 0, 0],
], ids=["rows", "few_rows"])
def test_wgrad_moe_deferred_stores_every_block_count(counts, dtype, trans_b, config):
    # 16-bit dW defers each tile's stores into the next tile's K blocks, one slice per block and the
    # rest with the last block (sm90_wgrad_kernel.hpp); each MoE wgrad config forced. Experts of 0 to
    # 7 K blocks of 64 rows, in runs of empty experts at the start, the middle and the end (the last
    # held tile is zeros); more tiles than CTAs, so each CTA stores held tiles across experts; a
    # partial N tile of one 8-column slice and a partial M tile. Every element of the NaN-filled
    # output must be written.
    if not runs_here("wgrad_moe"):
        pytest.skip("no sm90 MoE wgrad kernels for this GPU")
    short = DTYPE_NAMES[dtype]
    if f"sm90:wgrad_moe:{short}:{short}:{config}" not in cutlass_moe.built_configs():
        pytest.skip(f"this build has no {short} MoE wgrad kernel with config {config}")
    gen = torch.Generator(device="cuda").manual_seed(21)
    t, k, n, e = sum(counts) + 7, 456, 520, len(counts)
    x = torch.randn(t, k, device="cuda", dtype=dtype, generator=gen)
    dy = torch.randn(t, n, device="cuda", dtype=dtype, generator=gen)
    counts = torch.tensor(counts, device="cuda")
    shape = (e, n, k) if trans_b else (e, k, n)
    out = torch.full(shape, float("nan"), device="cuda", dtype=dtype)
    dw = moe_gemm_wgrad(x, dy, counts, trans_b=trans_b, out=out, backend="moe", config=config)
    check_dw(dw, cutlass_moe.moe_gemm_wgrad_reference(x, dy, counts.cpu(), trans_b=trans_b), counts.cpu(), t)
    again = moe_gemm_wgrad(x, dy, counts, trans_b=trans_b, backend="moe", config=config)
    assert torch.equal(again, dw), "the same inputs must give the same bits"


@gpu
@requires_kernels
def test_opcheck_gpu():
    _opcheck("cuda")


@gpu
@requires_kernels
def test_compile_fullgraph_gpu_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MoeMLP(8, 256, 128, 2, ours, BF16, "cuda")
    x = torch.randn(512, 256, device="cuda", dtype=BF16)
    eager = model(x)
    eager.float().pow(2).sum().backward()
    grads = [p.grad.clone() for p in (model.w_gate, model.w_up, model.w_down)]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    y = compiled(x)
    torch.testing.assert_close(y, eager, rtol=2e-2, atol=2e-2)
    y.float().pow(2).sum().backward()
    # Inductor fuses the SiLU and the products in float32 where eager rounds to bf16 in between: the
    # gradients agree to bf16 rounding as a whole, not element by element near zero.
    for p, g in zip((model.w_gate, model.w_up, model.w_down), grads):
        err = (p.grad.float() - g.float()).norm() / g.float().norm()
        assert err < 2e-2, f"relative error {err:.3e}"


@gpu
@requires_kernels
def test_activation_checkpointing_gpu():
    _checkpointed_grads_are_the_same_bits("cuda", BF16, 512, 256, 128, "inductor")


@gpu
@requires_kernels
def test_compile_dynamic_token_counts_gpu():
    _compile_dynamic_token_counts("cuda", BF16, "inductor")


@gpu
@requires_kernels
def test_compile_counts_from_bincount_gpu():
    _compile_counts_from_bincount("cuda", BF16, "inductor")


@gpu
@requires_kernels
def test_cuda_graph_forward_backward_with_new_counts():
    gen = torch.Generator(device="cuda").manual_seed(11)
    t, k, n, e = 1536, 256, 192, 16
    x = torch.randn(t, k, device="cuda", dtype=BF16, generator=gen, requires_grad=True)
    w = torch.randn(e, k, n, device="cuda", dtype=BF16, generator=gen, requires_grad=True)
    dy = torch.randn(t, n, device="cuda", dtype=BF16, generator=gen)
    counts = random_counts(e, t, torch.Generator().manual_seed(0)).to("cuda", torch.int32)

    def step():
        x.grad = w.grad = None
        moe_gemm(x, w, counts).backward(dy)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    x.grad = w.grad = None
    with torch.cuda.graph(graph):
        moe_gemm(x, w, counts).backward(dy)
    dx, dw = x.grad, w.grad  # the graph's own buffers, rewritten by every replay
    for seed, kind in [(1, "random"), (2, "hot"), (3, "one")]:
        new = random_counts(e, t - 17, torch.Generator().manual_seed(seed), kind).to("cuda", torch.int32)
        new[5] = 0
        new[-1] += t - 17 - int(new.sum())
        counts.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        ref_dx, ref_dw = reference_grads(x, w, new.cpu(), False, dy)
        check_dx(dx, ref_dx, new.cpu(), t)
        check_dw(dw, ref_dw, new.cpu(), t)


@gpu
@requires_kernels
@pytest.mark.parametrize("counts", ["index_add", "bincount"])
def test_compile_reduce_overhead_gpu(counts):
    """torch.compile(mode="reduce-overhead") of the MoE MLP on the fused ops (conftest.FusedMoeMLP):
    training steps (the fused ops' composite path) and inference (the fused kernels) replayed from
    CUDA graphs while the routing, and with it the counts, changes at every step."""
    torch.manual_seed(0)
    model = FusedMoeMLP(8, 256, 128, 2, counts, dtype=BF16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    check_reduce_overhead(model, lambda: torch.randn(512, 256, device="cuda", dtype=BF16, generator=gen))


@gpu
@requires_kernels
@pytest.mark.parametrize("counts", ["index_add", "bincount"])
def test_aoti_package_gpu(counts, tmp_path):
    """The MoE MLP on the fused ops in bf16, exported and compiled ahead of time by AOTInductor, run
    from the loaded package (the fused kernels, through AOTInductor's proxy executor) while the
    routing and the number of tokens change (a dynamic leading dimension); bincount (no C shim)
    runs through the same proxy executor."""
    torch.manual_seed(0)
    model = FusedMoeMLP(8, 256, 128, 2, counts, dtype=BF16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    targets = check_aoti_package(model, lambda t: torch.randn(t, 256, device="cuda", dtype=BF16, generator=gen),
                                 tmp_path / "moe.pt2")
    assert targets == ["cutlass_moe.moe_gemm_fused.default"] * 2, targets


@gpu
@requires_kernels
def test_grouped_mm_drop_in_matches_torch():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this PyTorch has no torch._grouped_mm")
    gen = torch.Generator(device="cuda").manual_seed(12)
    t, k, n, e = 1024, 256, 128, 8
    counts = random_counts(e, t, torch.Generator().manual_seed(13)).to("cuda", torch.int32)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = torch.randn(t, k, device="cuda", dtype=BF16, generator=gen)
    w = torch.randn(e, n, k, device="cuda", dtype=BF16, generator=gen).transpose(-2, -1)  # torchtitan's view
    dy = torch.randn(t, n, device="cuda", dtype=BF16, generator=gen)
    assert_close_per_expert(cutlass_moe.grouped_mm(x, w, offs=offs), x, w, counts.cpu())
    dw = cutlass_moe.grouped_mm(x.t(), dy, offs=offs)
    check_dw(dw, cutlass_moe.moe_gemm_wgrad_reference(x, dy, counts.cpu()), counts.cpu(), t)
    dw32 = cutlass_moe.grouped_mm(x.t(), dy, offs=offs, out_dtype=torch.float32)
    assert dw32.dtype == torch.float32
    check_dw(dw32, cutlass_moe.moe_gemm_wgrad_reference(x, dy, counts.cpu()), counts.cpu(), t, rel=1e-4)
    torch.testing.assert_close(dw, torch._grouped_mm(x.t(), dy, offs=offs), rtol=2e-2, atol=2e-2)
    # differentiable: x and w get gradients through our ops
    xg, wg = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
    cutlass_moe.grouped_mm(xg, wg, offs=offs).backward(dy)
    assert xg.grad is not None and wg.grad is not None


@gpu
@requires_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_casts_like_nn_linear_gpu(dtype):
    _autocast_checks("cuda", dtype)


@gpu
@requires_kernels
def test_autocast_compiled_and_grouped_mm_keeps_dtypes():
    # torch.compile(fullgraph=True) sees the casts; grouped_mm, like torch._grouped_mm, casts nothing.
    gen = torch.Generator(device="cuda").manual_seed(31)
    x = torch.randn(300, 128, device="cuda", generator=gen)
    w = torch.randn(3, 128, 64, device="cuda", generator=gen) * 128 ** -0.5
    counts = torch.tensor([100, 0, 190], device="cuda")

    def f(x, w, counts):
        with torch.autocast("cuda", dtype=BF16):
            return moe_gemm(x, w, counts)

    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    eager = f(x, w, counts)
    assert eager.dtype == BF16 and torch.equal(compiled(x, w, counts), eager)
    xb, wb = x.to(BF16), w.to(BF16)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    with torch.autocast("cuda", dtype=torch.float16):
        got = cutlass_moe.grouped_mm(xb, wb, offs=offs)
    assert got.dtype == BF16 and torch.equal(got, cutlass_moe.grouped_mm(xb, wb, offs=offs))


@gpu
@requires_kernels
def test_inference_mode_gives_the_no_grad_bits():
    # Serving stacks run under torch.inference_mode: the same kernels as under no_grad, the same bits.
    gen = torch.Generator(device="cuda").manual_seed(32)
    x = torch.randn(300, 128, device="cuda", dtype=BF16, generator=gen)
    w = torch.randn(3, 128, 64, device="cuda", dtype=BF16, generator=gen) * 128 ** -0.5
    counts = torch.tensor([100, 0, 190], device="cuda")
    probs = torch.rand(300, device="cuda", generator=gen)
    linear = cutlass_moe.GroupedLinear(4, 128, 64, device="cuda", dtype=BF16)
    mlp = cutlass_moe.GroupedMLP(4, 128, 96, 64, device="cuda", dtype=BF16)
    xg = x[:288].view(72, 4, 128)

    def run():
        return (moe_gemm(x, w, counts), moe_gemm(x, w, counts, activation="silu", row_scale=probs),
                cutlass_moe.moe_gemm_gated(x, w, counts, row_scale=probs), linear(xg), mlp(xg))

    with torch.no_grad():
        want = run()
    with torch.inference_mode():
        got = run()
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.is_inference() and torch.equal(a, b), f"result {i} differs under inference_mode"


@gpu
@requires_kernels
def test_deterministic_algorithms_mode(monkeypatch):
    # Under torch.use_deterministic_algorithms(True) no entry point raises (none uses an op torch
    # flags as nondeterministic), and two runs of forward and backward give the same bits.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # torch's condition for its cuBLAS GEMMs
    gen = torch.Generator(device="cuda").manual_seed(33)
    x = torch.randn(300, 128, device="cuda", dtype=BF16, generator=gen)
    w = torch.randn(3, 128, 64, device="cuda", dtype=BF16, generator=gen) * 128 ** -0.5
    bias = torch.randn(3, 64, device="cuda", dtype=BF16, generator=gen) * 0.1
    counts = torch.tensor([100, 0, 190], device="cuda")
    probs = torch.rand(300, device="cuda", generator=gen)
    torch.manual_seed(34)
    linear = cutlass_moe.GroupedLinear(4, 128, 64, device="cuda", dtype=BF16)
    mlp = cutlass_moe.GroupedMLP(4, 128, 96, 64, bias=True, device="cuda", dtype=BF16)

    def run():
        leaves = [t.clone().requires_grad_() for t in (x, w, bias, probs)]
        xl, wl, bl, pl = leaves
        outs = [moe_gemm(xl, wl, counts, bias=bl, activation="gelu", row_scale=pl),
                cutlass_moe.moe_gemm_gated(xl, wl, counts, bias=bl, row_scale=pl),
                linear(xl[:288].view(72, 4, 128)), mlp(xl[:288].view(72, 4, 128))]
        sum(o.float().pow(2).sum() for o in outs).backward()
        grads = [t.grad for t in leaves] + [p.grad for p in (*linear.parameters(), *mlp.parameters())]
        linear.zero_grad(set_to_none=True)
        mlp.zero_grad(set_to_none=True)
        return [o.detach() for o in outs] + grads

    torch.use_deterministic_algorithms(True)
    try:
        first, second = run(), run()
    finally:
        torch.use_deterministic_algorithms(False)
    for i, (a, b) in enumerate(zip(first, second)):
        assert a is not None and torch.equal(a, b), f"tensor {i} differs between two runs"


@gpu
@requires_kernels
def test_counts_as_strided_views_gpu():
    _counts_as_views("cuda")


@gpu
@requires_kernels
def test_gmm_drop_in_with_cpu_batch_sizes():
    gen = torch.Generator(device="cuda").manual_seed(14)
    a = torch.randn(700, 128, device="cuda", dtype=BF16, generator=gen, requires_grad=True)
    b = torch.randn(5, 64, 128, device="cuda", dtype=BF16, generator=gen, requires_grad=True)
    sizes = torch.tensor([100, 0, 300, 200, 100], dtype=torch.int64)  # grouped_gemm: int64 on the CPU
    y = cutlass_moe.gmm(a, b, sizes, trans_b=True)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref_dx, ref_dw = reference_grads(a, b, sizes, True, dy)
    check_dx(a.grad, ref_dx, sizes, 700)
    check_dw(b.grad, ref_dw, sizes, 700)


@gpu
@requires_kernels
def test_device_counts_never_synchronize_the_host():
    """With the counts on the GPU, no eager entry point waits for the device: forward and backward
    of moe_gemm (both layouts), moe_gemm_gated with its row scale, moe_gemm_wgrad (accumulating
    too), and the grouped_mm drop-in with offsets on the device. torch's sync debug mode raises on a
    synchronizing call (a .item(), a device-to-host copy, a stream synchronize)."""
    gen = torch.Generator(device="cuda").manual_seed(15)
    t, k, n, e = 1024, 256, 128, 8
    counts = random_counts(e, t - 5, torch.Generator().manual_seed(16)).to("cuda", torch.int32)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = torch.randn(t, k, device="cuda", dtype=BF16, generator=gen, requires_grad=True)
    w_kn = torch.randn(e, k, n, device="cuda", dtype=BF16, generator=gen, requires_grad=True)
    w_nk = torch.randn(e, n, k, device="cuda", dtype=BF16, generator=gen, requires_grad=True)
    gate_up = cutlass_moe.interleave_gate_up(torch.randn(e, k, 2 * n, device="cuda", dtype=BF16, generator=gen))
    gate_up.requires_grad_()
    probs = torch.rand(t, device="cuda", generator=gen, requires_grad=True)
    dy = torch.randn(t, n, device="cuda", dtype=BF16, generator=gen)
    main_grad = torch.zeros(e, k, n, device="cuda")

    def calls():
        for p in (x, w_kn, w_nk, gate_up, probs):
            p.grad = None
        moe_gemm(x, w_kn, counts).backward(dy)
        moe_gemm(x, w_nk, counts, trans_b=True).backward(dy)
        cutlass_moe.moe_gemm_gated(x, gate_up, counts, row_scale=probs).backward(dy)
        moe_gemm_wgrad(x.detach(), dy, counts)
        moe_gemm_wgrad(x.detach(), dy, counts, out=main_grad, accumulate=True)
        cutlass_moe.grouped_mm(x, w_kn, offs=offs).backward(dy)

    calls()  # first calls resolve and cache their plans; they may allocate
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        calls()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert x.grad is not None and w_kn.grad is not None and w_nk.grad is not None and gate_up.grad is not None
    assert probs.grad is not None
