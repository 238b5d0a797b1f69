"""Tests on two GPUs, run on the two-GPU machine (elsewhere they skip, saying why): tensors on
cuda:1 while cuda:0 is the current device must be computed on cuda:1, on cuda:1's current stream,
without changing the current device; the same shapes on both GPUs must not share per-device state
(plans, workspaces, cached TMA descriptors); tensors on different GPUs are refused, naming the
argument."""
import time

import pytest
import torch

from cutlass_moe import moe_gemm
from cutlass_moe.reference import assert_close_per_expert

from conftest import HAS_CUDA, backend_param, random_counts, runs_here, skip_unless_built

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


@backends
def test_current_stream_of_the_tensors_gpu(backend):
    # torch.cuda.stream(s1) makes s1 the current stream of cuda:1 and, inside, cuda:1 the current
    # device (torch.cuda.set_stream switches devices); torch.cuda.device(0) inside it makes cuda:0
    # current again while cuda:1's current stream stays s1. That is the case under test: cuda:0
    # current, tensors on cuda:1, cuda:1's current stream s1. s1 is first kept busy by a ~100 ms
    # sleep; a kernel launched on s1 waits behind it, so snapshots of out taken meanwhile on a third
    # stream s2 (which waits for nothing) are still all NaN. A kernel launched on cuda:1's default
    # stream would have run by the second snapshot; one launched on cuda:0 would fail or write the
    # snapshot too.
    skip_unless_built(backend, BF16, "kn")
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    x, w, counts, out = _problem(dev, seed=2)
    counts = counts.to(dev)
    moe_gemm(x, w, counts, out=torch.empty_like(out), backend=backend)  # first-call setup outside the timing
    torch.cuda.synchronize(dev)
    s1 = torch.cuda.Stream(device=dev)
    s2 = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(s1):
        torch.cuda._sleep(SLEEP_CYCLES)  # on s1
        with torch.cuda.device(0):
            assert torch.cuda.current_device() == 0
            assert torch.cuda.current_stream(dev) == s1
            assert torch.cuda.current_stream(0) == torch.cuda.default_stream(0)
            y = moe_gemm(x, w, counts, out=out, backend=backend)
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
    assert y is out
    _check(out, x, w, counts, False)


@pytest.mark.parametrize("argument", ["weights", "out", "tokens_per_expert"])
def test_tensors_on_different_gpus_are_refused(argument):
    # x on cuda:1 and one other tensor on cuda:0: refused before any launch, naming that tensor.
    x, w, counts, out = _problem(torch.device("cuda", 1), seed=3)
    kwargs = {"weights": w, "tokens_per_expert": counts.to("cuda:1"), "out": out}
    kwargs[argument] = kwargs[argument].to("cuda:0")
    with pytest.raises(ValueError, match=f"^{argument}:"):
        moe_gemm(x, kwargs["weights"], kwargs["tokens_per_expert"], out=kwargs["out"])
