"""The fused epilogue of moe_gemm (bias, activation, row scale): against the float32 reference,
expert by expert, on the fused sm90 kernel and on the composite path (gradients, other families,
the CPU); and the argument errors."""
import pytest
import torch

import cutlass_moe
from cutlass_moe import moe_gemm, moe_gemm_reference
from cutlass_moe.reference import expert_row_ranges

from conftest import HAS_CUDA, backend_param, random_counts

ACTIVATIONS = [None, "relu", "gelu_tanh", "gelu", "silu"]
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def make(t, k, n, e, dtype, device, trans_b=False, seed=0, kind="random"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen).to(device, dtype)
    shape = (e, n, k) if trans_b else (e, k, n)
    w = (torch.randn(*shape, generator=gen) * k ** -0.5).to(device, dtype)
    bias = torch.randn(e, n, generator=gen).to(device, dtype)
    scale = torch.rand(t, generator=gen).to(device)
    counts = random_counts(e, t - 5, gen, kind)  # 5 rows that no expert owns
    return x, w, bias, scale, counts


def check(y, ref, counts, num_tokens, rel=1e-2):
    """Per expert: relative error of the owned rows; rows no expert owns are zeros."""
    y, ref = y.float().cpu(), ref.float().cpu()
    ranges = expert_row_ranges(counts, num_tokens)
    for e, (start, stop) in enumerate(ranges):
        if stop > start:
            err = float((y[start:stop] - ref[start:stop]).norm() / ref[start:stop].norm().clamp_min(1e-30))
            assert err <= rel, f"expert {e}: relative error {err:.2e}"
    end = max((stop for _, stop in ranges), default=0)
    assert bool((y[end:] == 0).all()), "rows no expert owns must be zeros"


def test_bad_arguments_name_themselves():
    x, w, bias, scale, counts = make(64, 32, 16, 4, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="^bias: expected shape"):
        moe_gemm(x, w, counts, bias=bias[:, :8])
    with pytest.raises(TypeError, match="^bias: dtype"):
        moe_gemm(x, w, counts, bias=bias.float())
    with pytest.raises(ValueError, match="^activation: expected"):
        moe_gemm(x, w, counts, activation="swish")
    with pytest.raises(ValueError, match="^row_scale: expected 64 entries"):
        moe_gemm(x, w, counts, row_scale=scale[:10])
    with pytest.raises(TypeError, match="^row_scale: expected dtype torch.float32"):
        moe_gemm(x, w, counts, row_scale=scale.double())


@pytest.mark.parametrize("counts", [[40, 0, 25], [70, 0, 5], [-4, 30, 2**40], [0, 0, 0], [2**63 - 1, -2**63, 3]])
def test_composite_epilogue_follows_the_clamp_rule(counts):
    # The composite path finds each row's expert from device counts on its own: it must follow the
    # kernels' clamp rule (expert_row_ranges) for any count vector, hostile ones included.
    from cutlass_moe.ops import _apply_epilogue
    t, k, n = 60, 16, 8
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(t, k, generator=gen, dtype=torch.float64)
    w = torch.randn(3, k, n, generator=gen, dtype=torch.float64)
    bias = torch.randn(3, n, generator=gen, dtype=torch.float64)
    scale = torch.rand(t, generator=gen, dtype=torch.float64)
    c = torch.tensor(counts, dtype=torch.int64)
    plain = moe_gemm_reference(x, w, c)
    got = _apply_epilogue(plain, c, bias, "silu", scale)
    want = moe_gemm_reference(x, w, c, bias=bias, activation="silu", row_scale=scale)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cpu_matches_reference(activation):
    x, w, bias, scale, counts = make(200, 48, 40, 6, torch.bfloat16, "cpu", kind="random")
    y = moe_gemm(x, w, counts, bias=bias, activation=activation, row_scale=scale)
    ref = moe_gemm_reference(x, w, counts, bias=bias, activation=activation, row_scale=scale)
    check(y, ref, counts, 200)


def test_cpu_out_keeps_rows_no_expert_owns():
    # The composite path with out=: owned rows get the result, the 5 tail rows keep out's values.
    x, w, bias, scale, counts = make(100, 32, 24, 4, torch.bfloat16, "cpu", kind="random")
    out = torch.full((100, 24), 7.0, dtype=torch.bfloat16)
    assert moe_gemm(x, w, counts, bias=bias, activation="relu", row_scale=scale, out=out) is out
    ref = moe_gemm_reference(x, w, counts, bias=bias, activation="relu", row_scale=scale)
    check(out[:95], ref[:95], counts, 95)
    assert bool((out[95:] == 7.0).all())


def test_cpu_gradcheck():
    x, w, bias, scale, counts = make(24, 8, 8, 3, torch.float64, "cpu", kind="random")
    args = [t.double().requires_grad_() for t in (x, w, bias, scale)]
    fn = lambda x, w, b, s: moe_gemm(x, w, counts, bias=b, activation="gelu_tanh", row_scale=s)
    assert torch.autograd.gradcheck(fn, args)


@gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", [backend_param("moe"), backend_param("grouped")])
def test_gpu_matches_reference(backend, dtype, trans_b, activation):
    # moe: the fused epilogue in the kernel; grouped: the composite path. Zero-token experts, a tail.
    t, k, n, e = 1000, 264, 136, 9
    x, w, bias, scale, counts = make(t, k, n, e, dtype, "cuda", trans_b, seed=3)
    counts[2] = 0
    counts[-1] += t - 5 - int(counts.sum())
    ref = moe_gemm_reference(x, w, counts, trans_b=trans_b, bias=bias, activation=activation, row_scale=scale)
    for b, s in ((bias, None), (None, scale), (bias, scale)):
        y = moe_gemm(x, w, counts.cuda(), trans_b=trans_b, backend=backend, bias=b, activation=activation,
                     row_scale=s)
        want = moe_gemm_reference(x, w, counts, trans_b=trans_b, bias=b, activation=activation, row_scale=s)
        check(y, want, counts, t)
    y = moe_gemm(x, w, counts.cuda(), trans_b=trans_b, backend=backend, bias=bias, activation=activation,
                 row_scale=scale)
    check(y, ref, counts, t)


@gpu
@pytest.mark.parametrize("kind", ["hot", "one", "uniform"])
def test_gpu_fused_kernel_splits_and_out(kind):
    t, k, n, e = 4096, 512, 1024, 16
    x, w, bias, scale, counts = make(t, k, n, e, torch.bfloat16, "cuda", seed=4, kind=kind)
    ref = moe_gemm_reference(x, w, counts, bias=bias, activation="silu", row_scale=scale)
    y = moe_gemm(x, w, counts.cuda(), backend="moe", bias=bias, activation="silu", row_scale=scale)
    check(y, ref, counts, t)
    out = torch.full((t, n), 7.0, device="cuda", dtype=torch.bfloat16)
    moe_gemm(x, w, counts.cuda(), backend="moe", bias=bias, activation="silu", row_scale=scale, out=out)
    end = sum(stop - start for start, stop in expert_row_ranges(counts, t))
    check(out[:end], ref[:end], counts, end)
    assert bool((out[end:] == 7.0).all()), "a given out keeps the rows no expert owns"


@gpu
def test_gpu_gradients_through_the_composite_path():
    t, k, n, e = 300, 64, 48, 5
    x, w, bias, scale, counts = make(t, k, n, e, torch.bfloat16, "cuda", seed=5)
    leaves = [v.clone().requires_grad_() for v in (x, w, bias, scale)]
    ref_leaves = [v.detach().float().cpu().requires_grad_() for v in (x, w, bias, scale)]
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    moe_gemm(leaves[0], leaves[1], counts.cuda(), bias=leaves[2], activation="gelu", row_scale=leaves[3]).backward(dy)
    moe_gemm_reference(ref_leaves[0], ref_leaves[1], counts, bias=ref_leaves[2], activation="gelu",
                       row_scale=ref_leaves[3]).backward(dy.float().cpu())
    for name, got, want in zip(("x", "weights", "bias", "row_scale"), leaves, ref_leaves):
        g, r = got.grad.float().cpu(), want.grad
        err = float((g - r).norm() / r.norm().clamp_min(1e-30))
        assert err < 2e-2, f"d{name}: relative error {err:.2e}"


@gpu
def test_fused_compiles_fullgraph():
    t, k, n, e = 256, 64, 64, 4
    x, w, bias, scale, counts = make(t, k, n, e, torch.bfloat16, "cuda", seed=6)
    fn = torch.compile(lambda x, w, c, b, s: moe_gemm(x, w, c, bias=b, activation="relu", row_scale=s),
                       fullgraph=True)
    y = fn(x, w, counts.cuda(), bias, scale)
    check(y, moe_gemm_reference(x, w, counts, bias=bias, activation="relu", row_scale=scale), counts, t)
