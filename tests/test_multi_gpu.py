"""Tests on two GPUs, run on the two-GPU machine (elsewhere they skip, saying why): tensors on
cuda:1 while cuda:0 is the current device must be computed on cuda:1, on cuda:1's current stream,
without changing the current device; the same shapes on both GPUs must not share per-device state
(plans, workspaces, cached TMA descriptors); tensors on different GPUs are refused, naming the
argument. The same holds for every entry point past the forward GEMM (the backward, the weight
gradient, the fused epilogues, the gated projection, the grouped-linear modules): each runs on
both GPUs with cuda:0 current and must give bitwise the same result on cuda:1 as on cuda:0 (the
same kernels on the same data, in a fixed order), and the float32 reference's."""
import time

import pytest
import torch

import cutlass_moe
from cutlass_moe import moe_gemm, moe_gemm_gated, moe_gemm_wgrad
from cutlass_moe.reference import (assert_close_per_expert, expert_row_ranges, moe_gemm_reference,
                                   moe_gemm_wgrad_reference)

from conftest import (HAS_CUDA, backend_param, check_dw, check_dx, random_counts, runs_here, skip_unless_built,
                      wgrad_backend_param)

TWO_GPUS = HAS_CUDA and torch.cuda.device_count() >= 2
SAME_ARCH = TWO_GPUS and torch.cuda.get_device_capability(0) == torch.cuda.get_device_capability(1)
pytestmark = [
    pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA GPUs"),
    # conftest.runs_here answers for cuda:0; the tests below need the same kernels on cuda:1.
    pytest.mark.skipif(TWO_GPUS and not SAME_ARCH, reason="needs 2 CUDA GPUs of the same architecture"),
    pytest.mark.skipif(TWO_GPUS and not runs_here("auto"), reason="no kernels for these GPUs in this build"),
]

BF16 = torch.bfloat16
BACKENDS = ["auto", "moe", "grouped", "sm80_moe", "sm80_grouped"]
backends = pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
SLEEP_CYCLES = int(2e8)  # torch.cuda._sleep: about 100 ms at 2 GHz


def _problem(device, trans_b=False, seed=0, t=1000, k=256, n=384, e=8, tail=9):
    """x, weights, counts (on the CPU) and a NaN-poisoned out on `device`; the last `tail` rows are
    owned by no expert."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(t, k, device=device, dtype=BF16, generator=gen)
    shape = (e, n, k) if trans_b else (e, k, n)
    w = torch.randn(*shape, device=device, dtype=BF16, generator=gen)
    counts = random_counts(e, t - tail, torch.Generator().manual_seed(seed), "random").to(torch.int32)
    out = torch.full((t, n), float("nan"), device=device, dtype=BF16)
    return x, w, counts, out


def _check(out, x, w, counts, trans_b, tail=9):
    assert_close_per_expert(out, x, w, counts, trans_b=trans_b)
    assert torch.isnan(out[out.shape[0] - tail:].float()).all(), "rows no expert owns must be left unwritten"


@backends
@pytest.mark.parametrize("trans_b", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("counts_on", ["cpu", "cuda:1"])
def test_tensors_on_the_second_gpu(counts_on, trans_b, backend):
    # cuda:0 is current and everything is on cuda:1: the kernel must run on cuda:1 (its NaN-poisoned
    # out gets written, right), and the current device must still be cuda:0 afterwards.
    skip_unless_built(backend, BF16, "nk" if trans_b else "kn")
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    x, w, counts, out = _problem(dev, trans_b=trans_b, seed=1)
    counts = counts.to(counts_on)
    y = moe_gemm(x, w, counts, trans_b=trans_b, out=out, backend=backend)
    assert torch.cuda.current_device() == 0
    assert y is out
    torch.cuda.synchronize(dev)
    _check(out, x, w, counts, trans_b)
    # A new output lands on the tensors' GPU too.
    y = moe_gemm(x, w, counts, trans_b=trans_b, backend=backend)
    assert y.device == dev and torch.cuda.current_device() == 0
    torch.cuda.synchronize(dev)
    assert_close_per_expert(y, x, w, counts, trans_b=trans_b)


@backends
def test_same_shapes_on_both_gpus(backend):
    # The same shapes on cuda:0, cuda:1, cuda:0 again: whatever the library keeps across calls
    # (plans, workspace sizes, TMA descriptors) must be per device, or one GPU gets the other's.
    skip_unless_built(backend, BF16, "kn")
    torch.cuda.set_device(0)
    problems = {d: _problem(torch.device("cuda", d), seed=10 + d) for d in (0, 1)}
    for d in (0, 1, 0, 1):
        x, w, counts, out = problems[d]
        out.fill_(float("nan"))
        moe_gemm(x, w, counts.to(x.device), out=out, backend=backend)
        torch.cuda.synchronize(x.device)
        _check(out, x, w, counts, False)
        assert torch.cuda.current_device() == 0


def _launched_on_current_stream(out, launch):
    """launch() with cuda:0 current, the tensors (and out) on cuda:1, and cuda:1's current stream s1
    kept busy by a ~100 ms sleep. torch.cuda.stream(s1) makes s1 the current stream of cuda:1 and,
    inside, cuda:1 the current device (torch.cuda.set_stream switches devices); torch.cuda.device(0)
    inside it makes cuda:0 current again while cuda:1's current stream stays s1. A kernel launched on
    s1 waits behind the sleep, so snapshots of the NaN-poisoned out taken meanwhile on a third stream
    s2 (which waits for nothing) are still all NaN. A kernel launched on cuda:1's default stream would
    have run by the second snapshot; one launched on cuda:0 would fail or write the snapshot too.
    Returns launch()'s result once s1 is done."""
    dev = out.device
    s1 = torch.cuda.Stream(device=dev)
    s2 = torch.cuda.Stream(device=dev)
    out.fill_(float("nan"))
    torch.cuda.synchronize(dev)
    with torch.cuda.stream(s1):
        torch.cuda._sleep(SLEEP_CYCLES)  # on s1
        with torch.cuda.device(0):
            assert torch.cuda.current_device() == 0
            assert torch.cuda.current_stream(dev) == s1
            assert torch.cuda.current_stream(0) == torch.cuda.default_stream(0)
            result = launch()
            assert torch.cuda.current_device() == 0
    assert torch.cuda.current_device() == 0
    with torch.cuda.stream(s2):
        snap = out.clone()
    s2.synchronize()
    assert torch.isnan(snap.float()).all(), "the kernel did not wait behind the sleep on s1: not launched on s1"
    time.sleep(0.01)
    with torch.cuda.stream(s2):
        snap = out.clone()
    s2.synchronize()
    assert torch.isnan(snap.float()).all(), "out was written 10 ms after the call, during s1's sleep: not launched on s1"
    s1.synchronize()
    return result


@backends
def test_current_stream_of_the_tensors_gpu(backend):
    # cuda:0 current, tensors on cuda:1, cuda:1's current stream a side stream: the forward runs there.
    skip_unless_built(backend, BF16, "kn")
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    x, w, counts, out = _problem(dev, seed=2)
    counts = counts.to(dev)
    moe_gemm(x, w, counts, out=torch.empty_like(out), backend=backend)  # first-call setup outside the timing
    torch.cuda.synchronize(dev)
    y = _launched_on_current_stream(out, lambda: moe_gemm(x, w, counts, out=out, backend=backend))
    assert y is out
    _check(out, x, w, counts, False)


@pytest.mark.parametrize("family", [wgrad_backend_param(f) for f in ("moe", "grouped", "sm80_grouped")])
def test_weight_gradient_on_the_current_stream_of_the_tensors_gpu(family):
    # The same for moe_gemm_wgrad: dW stays NaN through the sleep on cuda:1's current stream, then is
    # right (for the grouped families, after their argument-building and zero-fill launches too).
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    x, w, counts, dy = (t.to(dev) for t in _cpu_data(seed=26))
    dw = torch.empty(w.shape, device=dev, dtype=BF16)
    moe_gemm_wgrad(x, dy, counts, out=torch.empty_like(dw), backend=family)  # first-call setup
    torch.cuda.synchronize(dev)
    got = _launched_on_current_stream(dw, lambda: moe_gemm_wgrad(x, dy, counts, out=dw, backend=family))
    assert got is dw
    counts = counts.cpu()
    check_dw(dw.cpu(), moe_gemm_wgrad_reference(x.cpu(), dy.cpu(), counts), counts, x.shape[0])


@pytest.mark.parametrize("argument", ["weights", "out", "tokens_per_expert"])
def test_tensors_on_different_gpus_are_refused(argument):
    # x on cuda:1 and one other tensor on cuda:0: refused before any launch, naming that tensor.
    x, w, counts, out = _problem(torch.device("cuda", 1), seed=3)
    kwargs = {"weights": w, "tokens_per_expert": counts.to("cuda:1"), "out": out}
    kwargs[argument] = kwargs[argument].to("cuda:0")
    with pytest.raises(ValueError, match=f"^{argument}:"):
        moe_gemm(x, kwargs["weights"], kwargs["tokens_per_expert"], out=kwargs["out"])


# ---- past the forward GEMM: each entry point on cuda:1 with cuda:0 current ------------------------

def _cpu_data(seed, t=1000, k=256, n=384, e=8, tail=9):
    """x (T, K), weights (E, K, N), counts (E,) owning all but the last `tail` rows, and grad_out
    (T, N), on the CPU, so that both GPUs get the same bits."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen).to(BF16)
    w = (torch.randn(e, k, n, generator=gen) * k ** -0.5).to(BF16)
    counts = random_counts(e, t - tail, gen, "random").to(torch.int32)
    dy = (torch.randn(t, n, generator=gen) * 0.1).to(BF16)
    return x, w, counts, dy


def _on_each_gpu(run, *cpu_tensors):
    """run(*tensors moved to cuda:d) for d = 0, 1, 0, 1 with cuda:0 current each time (the second pass
    finds whatever the first left behind per device): the results of the first pass, moved to the
    CPU, after checking that the second pass gives the same bits and that cuda:0 stayed current."""
    results = {}
    for d in (0, 1, 0, 1):
        torch.cuda.set_device(0)
        dev = torch.device("cuda", d)
        got = run(*(t.to(dev) for t in cpu_tensors))
        assert torch.cuda.current_device() == 0, "the call changed the current device"
        assert all(g.device == dev for g in got), "a result is not on the inputs' GPU"
        torch.cuda.synchronize(dev)
        got = [g.cpu() for g in got]
        if d in results:
            for a, b in zip(results[d], got):
                assert torch.equal(a, b), f"cuda:{d}: a second call with the same inputs gave other bits"
        results[d] = got
    return results[0], results[1]


def _assert_same_bits(on0, on1, names):
    for name, a, b in zip(names, on0, on1):
        assert torch.equal(a, b), f"{name}: cuda:1's result differs from cuda:0's"


def _assert_close(got, want, what, rel=1e-2):
    err = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))
    assert err <= rel, f"{what}: relative error {err:.3e}"


@pytest.mark.parametrize("family", [wgrad_backend_param(f) for f in ("moe", "grouped", "sm80_grouped")])
def test_weight_gradient_on_the_second_gpu(family):
    # moe_gemm_wgrad in bf16, and accumulated into an fp32 buffer (Megatron's main_grad), with the
    # counts on the tensors' GPU.
    x, w, counts, dy = _cpu_data(seed=20)
    start = torch.linspace(-1, 1, w.numel()).reshape(w.shape)

    def run(x, dy, counts, start):
        acc = start.clone()
        moe_gemm_wgrad(x, dy, counts, out=acc, accumulate=True, backend=family)
        return moe_gemm_wgrad(x, dy, counts, backend=family), acc

    on0, on1 = _on_each_gpu(run, x, dy, counts, start)
    _assert_same_bits(on0, on1, ["dW", "accumulated dW"])
    ref = moe_gemm_wgrad_reference(x, dy, counts)
    check_dw(on1[0], ref, counts, x.shape[0])
    check_dw(on1[1], ref, counts, x.shape[0], start=start)


@backends
@pytest.mark.parametrize("trans_b", [False, True], ids=["kn", "nk"])
def test_backward_on_the_second_gpu(trans_b, backend):
    # Autograd through moe_gemm: the backward runs on the GPU of the tensors (dx by the forward
    # family with the weights' other layout, dW by the wgrad kernel).
    skip_unless_built(backend, BF16, "nk" if trans_b else "kn")
    x, w, counts, dy = _cpu_data(seed=21)
    if trans_b:
        w = w.transpose(1, 2).contiguous()

    def run(x, w, counts, dy):
        x.requires_grad_()
        w.requires_grad_()
        y = moe_gemm(x, w, counts, trans_b=trans_b, backend=backend)
        y.backward(dy)
        return y.detach(), x.grad, w.grad

    on0, on1 = _on_each_gpu(run, x, w, counts, dy)
    _assert_same_bits(on0, on1, ["y", "dx", "dW"])
    x32, w32 = x.float().requires_grad_(), w.float().requires_grad_()
    (moe_gemm_reference(x32, w32, counts, trans_b=trans_b) * dy.float()).sum().backward()
    assert_close_per_expert(on1[0], x, w, counts, trans_b=trans_b)
    check_dx(on1[1], x32.grad, counts, x.shape[0])
    check_dw(on1[2], w32.grad, counts, x.shape[0])


FUSED_BACKENDS = ["auto", "moe", "sm80_moe"]


@pytest.mark.parametrize("backend", [backend_param(b) for b in FUSED_BACKENDS])
def test_fused_epilogue_and_gated_projection_on_the_second_gpu(backend):
    # In inference (the fused kernels: bias, activation and row scale in the epilogue; the gated
    # projection in one GEMM) and with a gradient recorded (the GEMM plain, the epilogue as torch
    # operations and the gated activation kernel, forward and backward).
    skip_unless_built(backend, BF16, "kn")
    x, w, counts, dy = _cpu_data(seed=22)
    gen = torch.Generator().manual_seed(23)
    bias = (torch.randn(w.shape[0], w.shape[2], generator=gen) * 0.1).to(BF16)
    row_scale = torch.rand(x.shape[0], generator=gen)
    half = dy[:, : w.shape[2] // 2].contiguous()

    def run(x, w, counts, bias, row_scale, half):
        with torch.no_grad():
            fused = moe_gemm(x, w, counts, bias=bias, activation="silu", row_scale=row_scale, backend=backend)
            gated = moe_gemm_gated(x, w, counts, activation="swiglu_oai", bias=bias, backend=backend)
        x.requires_grad_()
        w.requires_grad_()
        bias.requires_grad_()
        row_scale.requires_grad_()
        y = moe_gemm_gated(x, w, counts, activation="silu", bias=bias, row_scale=row_scale, backend=backend)
        y.backward(half)
        return fused, gated, y.detach(), x.grad, w.grad, bias.grad, row_scale.grad

    on0, on1 = _on_each_gpu(run, x, w, counts, bias, row_scale, half)
    _assert_same_bits(on0, on1, ["fused", "gated", "gated with grad", "dx", "dW", "dbias", "drow_scale"])
    end = sum(hi - lo for lo, hi in expert_row_ranges(counts, x.shape[0]))
    want = moe_gemm_reference(x, w, counts, bias=bias, activation="silu", row_scale=row_scale)
    _assert_close(on1[0][:end], want[:end], "fused moe_gemm")
    want = moe_gemm_reference(x, w, counts, bias=bias, activation="swiglu_oai", gated=True)
    _assert_close(on1[1][:end], want[:end], "moe_gemm_gated")
    x32, w32, b32, s32 = (t.float().requires_grad_() for t in (x, w, bias, row_scale))
    y32 = moe_gemm_reference(x32, w32, counts, bias=b32, activation="silu", row_scale=s32, gated=True)
    (y32 * half.float()).sum().backward()
    _assert_close(on1[2][:end], y32.detach()[:end], "moe_gemm_gated with grad")
    check_dx(on1[3], x32.grad, counts, x.shape[0])
    check_dw(on1[4], w32.grad, counts, x.shape[0])
    for name, got, want in zip(["dbias", "drow_scale"], on1[5:], [b32.grad, s32.grad]):
        _assert_close(got, want, name)


def test_grouped_linear_modules_in_inference_on_the_second_gpu():
    # No gradient: GroupedLinear and GroupedMLP (biases: every projection our interleaved kernel, the
    # gated one fused) by their signatures' routes, which are per device: each GPU's first pass
    # resolves its own, the second pass takes it (_on_each_gpu checks the bits of both passes).
    skip_unless_built("moe", BF16, "kn")
    batch, groups, k, hidden, n = 96, 8, 256, 384, 128
    torch.manual_seed(26)
    linear = cutlass_moe.GroupedLinear(groups, k, n, dtype=BF16)
    mlp = cutlass_moe.GroupedMLP(groups, k, hidden, n, bias=True, dtype=BF16)
    x = torch.randn(batch, groups, k, generator=torch.Generator().manual_seed(27)).to(BF16)

    def run(x):
        with torch.no_grad():
            return tuple(module.to(x.device)(x) for module in (linear, mlp))

    on0, on1 = _on_each_gpu(run, x)
    _assert_same_bits(on0, on1, ["GroupedLinear", "GroupedMLP"])
    xf = x.float()
    params = {name: p.detach().cpu().float() for name, p in [*linear.named_parameters(), *mlp.named_parameters()]}
    _assert_close(on1[0], torch.einsum("bgk,gkn->bgn", xf, params["weight"]) + params["bias"], "GroupedLinear")
    h = torch.einsum("bgk,gkh->bgh", xf, params["gate_up_weight"]) + params["gate_up_bias"]
    ref = torch.einsum("bgh,ghn->bgn", torch.nn.functional.silu(h[..., 0::2]) * h[..., 1::2],
                       params["down_weight"]) + params["down_bias"]
    _assert_close(on1[1], ref, "GroupedMLP")


def test_grouped_linear_modules_on_the_second_gpu():
    # GroupedLinear (its interleaved MoE kernel with the bias in the epilogue) and GroupedMLP (the
    # gated projection and the down projection), forward and backward, same parameters on both GPUs.
    skip_unless_built("moe", BF16, "kn")
    batch, groups, k, hidden, n = 96, 8, 256, 384, 128
    torch.manual_seed(24)
    linear = cutlass_moe.GroupedLinear(groups, k, n, dtype=BF16)
    mlp = cutlass_moe.GroupedMLP(groups, k, hidden, n, dtype=BF16)
    gen = torch.Generator().manual_seed(25)
    x = torch.randn(batch, groups, k, generator=gen).to(BF16)
    dy = (torch.randn(batch, groups, n, generator=gen) * 0.1).to(BF16)

    def run(x, dy):
        dev = x.device
        ys, grads = [], []
        for module in (linear, mlp):
            m = module.to(dev)
            m.zero_grad(set_to_none=True)
            xg = x.clone().requires_grad_()
            y = m(xg)
            y.backward(dy)
            ys.append(y.detach())
            grads += [xg.grad, *(p.grad for p in m.parameters())]
        return (*ys, *grads)

    on0, on1 = _on_each_gpu(run, x, dy)
    _assert_same_bits(on0, on1, [f"result {i}" for i in range(len(on0))])
    # on1: the two outputs, then x's, the weight's and the bias's gradients of GroupedLinear, then
    # x's, gate_up_weight's and down_weight's of GroupedMLP.
    xf, dyf = x.float(), dy.float()
    ref = torch.einsum("bgk,gkn->bgn", xf, linear.weight.detach().cpu().float()) + linear.bias.detach().cpu().float()
    _assert_close(on1[0], ref, "GroupedLinear")
    _assert_close(on1[3], torch.einsum("bgk,bgn->gkn", xf, dyf), "GroupedLinear's weight gradient")
    h = torch.einsum("bgk,gkh->bgh", xf, mlp.gate_up_weight.detach().cpu().float())
    ref = torch.einsum("bgh,ghn->bgn", torch.nn.functional.silu(h[..., 0::2]) * h[..., 1::2],
                       mlp.down_weight.detach().cpu().float())
    _assert_close(on1[1], ref, "GroupedMLP")
