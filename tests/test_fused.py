"""The fused epilogues: moe_gemm's bias, activation and row scale, and the gated projection
moe_gemm_gated. Against the float32 reference, expert by expert, on the fused sm90 kernel and on
the composite path (gradients, other families, the CPU); the custom op; the argument errors."""
import pytest
import torch

import cutlass_moe
from cutlass_moe import moe_gemm, moe_gemm_reference
from cutlass_moe.reference import expert_row_ranges

from conftest import HAS_CUDA, backend_param, graph_recorder, random_counts

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
    with pytest.raises(TypeError, match="^row_scale: expected dtype torch.float32 or x's torch.bfloat16"):
        moe_gemm(x, w, counts, row_scale=scale.double())
    with pytest.raises(TypeError, match="^row_scale: expected dtype torch.float32 or x's torch.bfloat16"):
        moe_gemm(x, w, counts, row_scale=scale.half())


def _row_scale_in_x_dtype(device, dtype):
    """A row scale in x's dtype (Hugging Face casts its routing weights so), or a strided view (a
    column of top-k weights), computes what its contiguous float32 copy does, in moe_gemm and
    moe_gemm_gated, and its gradient comes back in its own dtype."""
    x, w, bias, scale, counts = make(96, 64, 32, 4, dtype, device)
    counts = counts.to(device)
    half = scale.to(dtype)
    column = torch.stack([half.float(), scale], 1)[:, 0]
    for gated in (False, True):
        gemm = cutlass_moe.moe_gemm_gated if gated else lambda *a, **kw: moe_gemm(*a, activation="silu", **kw)
        with torch.no_grad():  # the fused kernel on the GPU
            want = gemm(x, w, counts, bias=bias, row_scale=half.float())
            assert torch.equal(gemm(x, w, counts, bias=bias, row_scale=half), want)
            assert torch.equal(gemm(x, w, counts, bias=bias, row_scale=column), want)
        grads = []
        for s in (half, half.float()):
            s = s.clone().requires_grad_()
            gemm(x, w, counts, bias=bias, row_scale=s).float().pow(2).sum().backward()
            grads.append(s.grad)
        assert grads[0].dtype == dtype and torch.equal(grads[0], grads[1].to(dtype))


def test_row_scale_in_x_dtype_cpu():
    _row_scale_in_x_dtype("cpu", torch.bfloat16)


def _fused_ops_check_their_arguments(device):
    """torch.ops.cutlass_moe.* is public (torch.compile and export call it): a direct call of the
    registered fused op or of its launch-only twin gets the public functions' errors, naming the
    argument, before anything reaches a kernel (the counts too short to read E of them, a bias too
    small)."""
    x, w, bias, scale, counts = make(64, 32, 16, 4, torch.bfloat16, device)
    counts = counts.to(device)
    for fused in (torch.ops.cutlass_moe.moe_gemm_fused, torch.ops.cutlass_moe.moe_gemm_fused_launch):
        _fused_op_checks(fused, x, w, bias, scale, counts)
    xg = x.view(16, 4, 32)  # (B, G, K) for the grouped-linear ops, G = 4 groups of w's (4, 32, 16)
    for linear in (torch.ops.cutlass_moe.grouped_linear, torch.ops.cutlass_moe.grouped_linear_launch):
        with pytest.raises(ValueError, match="^bias: expected shape"):
            linear(xg, w, bias[:, :8])
        with pytest.raises(ValueError, match="^weight: expected shape"):
            linear(xg, w[:, :16], None)
    projection = torch.ops.cutlass_moe.grouped_gated_projection
    with pytest.raises(ValueError, match="^activation: expected"):
        projection(xg, w, bias, "tanh")
    with pytest.raises(ValueError, match="^bias: expected shape"):
        projection(xg, w, bias[:3], "silu")
    if device == "cuda":  # the gated activation's launch-only ops run on the GPU alone
        y = torch.randn(24, 32, device=device, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="^grad: expected"):
            torch.ops.cutlass_moe.gated_activation_backward_launch(y, y[:8, :16], "silu", 1.702, 7.0)
        with pytest.raises(ValueError, match="^y: expected"):
            torch.ops.cutlass_moe.gated_activation_launch(y[:, :6], "silu", 1.702, 7.0)
        with pytest.raises(ValueError, match="^activation: expected"):
            torch.ops.cutlass_moe.gated_activation_launch(y, "tanh", 1.702, 7.0)


def _fused_op_checks(fused, x, w, bias, scale, counts):
    args = dict(bias=None, activation="silu", row_scale=None, gated=False, alpha=1.702, limit=7.0, backend="auto",
                config="auto")
    with pytest.raises(ValueError, match="^bias: expected shape"):
        fused(x, w, counts, False, **{**args, "bias": bias[:, :8]})
    with pytest.raises(ValueError, match="^row_scale: expected 64 entries"):
        fused(x, w, counts, False, **{**args, "row_scale": scale[:10]})
    with pytest.raises(ValueError, match="^row_scale: must be contiguous"):
        fused(x, w, counts, False, **{**args, "row_scale": scale[:1].expand(64)})
    with pytest.raises(ValueError, match="^weights: N = 15 must be even"):
        fused(x, w[..., :15], counts, False, **{**args, "gated": True})
    with pytest.raises(ValueError, match="^tokens_per_expert: expected 4 entries"):
        fused(x, w, counts[:3], False, **args)
    # A signature seen before (its arguments were checked then) and one that differs only in the
    # counts' length: checked again.
    fused(x, w, counts, False, **{**args, "bias": bias})
    with pytest.raises(ValueError, match="^tokens_per_expert: expected 4 entries"):
        fused(x, w, counts[:3], False, **{**args, "bias": bias})


def test_registered_ops_called_directly_check_their_arguments():
    _fused_ops_check_their_arguments("cpu")


@pytest.mark.parametrize("counts", [[40, 0, 25], [70, 0, 5], [-4, 30, 2**40], [0, 0, 0], [2**63 - 1, -2**63, 3]])
def test_composite_epilogue_follows_the_clamp_rule(counts):
    # The composite path finds each row's expert from device counts on its own: it must follow the
    # kernels' clamp rule (expert_row_ranges) for any count vector, hostile ones included.
    from cutlass_moe.fused import FusedArgs, _apply_epilogue
    t, k, n = 60, 16, 8
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(t, k, generator=gen, dtype=torch.float64)
    w = torch.randn(3, k, n, generator=gen, dtype=torch.float64)
    bias = torch.randn(3, n, generator=gen, dtype=torch.float64)
    scale = torch.rand(t, generator=gen, dtype=torch.float64)
    c = torch.tensor(counts, dtype=torch.int64)
    plain = moe_gemm_reference(x, w, c)
    got = _apply_epilogue(plain, c, FusedArgs(bias, "silu", scale))
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
@pytest.mark.parametrize("backend", [backend_param("moe"), backend_param("sm80_moe"), backend_param("grouped")])
def test_gpu_matches_reference(backend, dtype, trans_b, activation):
    # moe, sm80_moe: the fused epilogue in the kernel; grouped: the composite path. Zero-token
    # experts, a tail.
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
@pytest.mark.parametrize("backend", [backend_param("moe"), backend_param("sm80_moe")])
def test_gpu_fused_kernel_splits_and_out(backend, kind):
    t, k, n, e = 4096, 512, 1024, 16
    x, w, bias, scale, counts = make(t, k, n, e, torch.bfloat16, "cuda", seed=4, kind=kind)
    ref = moe_gemm_reference(x, w, counts, bias=bias, activation="silu", row_scale=scale)
    y = moe_gemm(x, w, counts.cuda(), backend=backend, bias=bias, activation="silu", row_scale=scale)
    check(y, ref, counts, t)
    out = torch.full((t, n), 7.0, device="cuda", dtype=torch.bfloat16)
    moe_gemm(x, w, counts.cuda(), backend=backend, bias=bias, activation="silu", row_scale=scale, out=out)
    end = sum(stop - start for start, stop in expert_row_ranges(counts, t))
    check(out[:end], ref[:end], counts, end)
    assert bool((out[end:] == 7.0).all()), "a given out keeps the rows no expert owns"


def check_grads(leaves, ref_leaves, counts, num_tokens, activation):
    """Gradients against the float32 reference's, per expert: the rows of dx and d row_scale each
    expert owns, each expert's dW and d bias; rows no expert owns get dx = 0. relu's kink makes
    half-precision gradients move where rounding puts a pre-activation on its other side: judged
    at 5e-2. (swiglu_oai's clamps do the same: the tests keep its pre-activations inside the limit
    here, and test_gpu_gated_activation_kernels_match_torch checks its clamped gradients on the
    same rounded inputs.)"""
    rel = 5e-2 if activation == "relu" else 2e-2
    ranges = expert_row_ranges(counts, num_tokens)
    for name, got, want in zip(("x", "weights", "bias", "row_scale"), leaves, ref_leaves):
        if got is None:
            continue
        g, r = got.grad.float().cpu(), want.grad
        per_row = name in ("x", "row_scale")
        for e, (start, stop) in enumerate(ranges):
            gp, rp = (g[start:stop], r[start:stop]) if per_row else (g[e], r[e])
            if stop > start and float(rp.norm()) > 0:
                err = float((gp - rp).norm() / rp.norm())
                assert err < rel, f"d{name}, expert {e}: relative error {err:.2e}"
        if name == "x":
            end = max((stop for _, stop in ranges), default=0)
            assert bool((g[end:] == 0).all()), "dx: rows no expert owns must be zeros"


@gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gradients_through_the_composite_path(dtype, trans_b, activation):
    t, k, n, e = 300, 64, 48, 5
    x, w, bias, scale, counts = make(t, k, n, e, dtype, "cuda", trans_b, seed=5)
    counts[1] = 0
    counts[-1] += t - 5 - int(counts.sum())
    leaves = [v.clone().requires_grad_() for v in (x, w, bias, scale)]
    ref_leaves = [v.detach().float().cpu().requires_grad_() for v in (x, w, bias, scale)]
    dy = torch.randn(t, n, generator=torch.Generator().manual_seed(17)).to("cuda", dtype)
    moe_gemm(leaves[0], leaves[1], counts.cuda(), trans_b=trans_b, bias=leaves[2], activation=activation,
             row_scale=leaves[3]).backward(dy)
    moe_gemm_reference(ref_leaves[0], ref_leaves[1], counts, trans_b=trans_b, bias=ref_leaves[2],
                       activation=activation, row_scale=ref_leaves[3]).backward(dy.float().cpu())
    check_grads(leaves, ref_leaves, counts, t, activation)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_row_scale_in_x_dtype_gpu(dtype):
    _row_scale_in_x_dtype("cuda", dtype)


@gpu
def test_fused_ops_called_directly_check_their_arguments_gpu():
    _fused_ops_check_their_arguments("cuda")


@gpu
@pytest.mark.parametrize("gated", [False, True])
def test_gpu_bias_at_an_odd_address_after_an_aligned_one(gated):
    # The fused kernel reads the bias in column pairs (4-byte aligned); a call is resolved once per
    # signature, and the bias's address is not in it: a bias at an odd 2-byte address with the same
    # shape and strides as one seen before runs the composite, right.
    t, k, n, e = 256, 64, 64, 4
    x, w, bias, scale, counts = make(t, k, n, e, torch.bfloat16, "cuda", seed=21)
    storage = torch.empty(e * n + 1, device="cuda", dtype=torch.bfloat16)
    odd = storage[1:].view(e, n)
    odd.copy_(bias)
    assert odd.data_ptr() % 4 == 2 and odd.stride() == bias.stride()
    if gated:
        call = lambda b: cutlass_moe.moe_gemm_gated(x, w, counts.cuda(), bias=b, row_scale=scale)
        want = moe_gemm_reference(x, w, counts, bias=bias, activation="silu", gated=True, row_scale=scale)
    else:
        call = lambda b: moe_gemm(x, w, counts.cuda(), bias=b, activation="gelu", row_scale=scale)
        want = moe_gemm_reference(x, w, counts, bias=bias, activation="gelu", row_scale=scale)
    for b in (bias, odd, bias):
        check(call(b), want, counts, t)


@gpu
def test_fused_compiles_fullgraph():
    t, k, n, e = 256, 64, 64, 4
    x, w, bias, scale, counts = make(t, k, n, e, torch.bfloat16, "cuda", seed=6)
    fn = torch.compile(lambda x, w, c, b, s: moe_gemm(x, w, c, bias=b, activation="relu", row_scale=s),
                       fullgraph=True)
    y = fn(x, w, counts.cuda(), bias, scale)
    check(y, moe_gemm_reference(x, w, counts, bias=bias, activation="relu", row_scale=scale), counts, t)


# ---- the gated projection ------------------------------------------------------------------------

GATED = [None, "relu", "gelu_tanh", "gelu", "silu", "swiglu_oai"]
MOE_CONFIGS = ["sm90_pingpong_64x256x64_1x1x1", "sm90_cooperative_128x256x64_1x1x1", "sm90_cooperative_wide_64x512x32_1x1x1"]


def make_gated(t, k, inter, e, dtype, device, trans_b=False, seed=0, kind="random"):
    """x, separate gate and up weights and biases (E, K, I) / (E, I) (or (E, I, K)), row scales, counts."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen).to(device, dtype)
    shape = (e, inter, k) if trans_b else (e, k, inter)
    gate, up = ((torch.randn(*shape, generator=gen) * 2 * k ** -0.5).to(device, dtype) for _ in range(2))
    bg, bu = (torch.randn(e, inter, generator=gen).to(device, dtype) for _ in range(2))
    scale = torch.rand(t, generator=gen).to(device)
    counts = random_counts(e, t - 5, gen, kind)  # 5 rows that no expert owns
    return x, gate, up, bg, bu, scale, counts


def separate_reference(x, gate, up, bg, bu, scale, counts, activation, trans_b=False, alpha=1.702, limit=7.0):
    """The gated projection from two plain reference GEMMs (independent of the interleaved layout)."""
    from cutlass_moe.reference import gated_activation
    g = moe_gemm_reference(x, gate, counts, trans_b=trans_b, bias=bg)
    u = moe_gemm_reference(x, up, counts, trans_b=trans_b, bias=bu)
    h = gated_activation(g, u, activation, alpha, limit)
    return h if scale is None else h * scale[:, None].float()


def test_interleave_gate_up_layouts():
    gate, up = torch.randn(2, 3, 16, 8).unbind(0)
    w = cutlass_moe.interleave_gate_up(gate, up)
    assert w.shape == (3, 16, 16) and w.is_contiguous()
    assert torch.equal(w[..., 0::2], gate) and torch.equal(w[..., 1::2], up)
    assert torch.equal(cutlass_moe.interleave_gate_up(torch.cat([gate, up], -1)), w)
    wt = cutlass_moe.interleave_gate_up(gate.transpose(1, 2), up.transpose(1, 2), dim=1)  # (E, I, K)
    assert torch.equal(wt, w.transpose(1, 2))
    with pytest.raises(ValueError, match="^up: expected gate's shape"):
        cutlass_moe.interleave_gate_up(gate, up[:, :, :4])
    with pytest.raises(ValueError, match="^gate: a concatenated"):
        cutlass_moe.interleave_gate_up(torch.randn(3, 16, 7))


def test_gated_bad_arguments_name_themselves():
    x, gate, up, bg, bu, scale, counts = make_gated(64, 32, 16, 4, torch.bfloat16, "cpu")
    w = cutlass_moe.interleave_gate_up(gate, up)
    with pytest.raises(TypeError, match="^weights: expected one tensor with gate and up interleaved"):
        cutlass_moe.moe_gemm_gated(x, (gate, up), counts)
    with pytest.raises(ValueError, match="^weights: N = 15 must be even"):
        cutlass_moe.moe_gemm_gated(x, w[..., :15], counts)
    with pytest.raises(ValueError, match="^activation: expected"):
        cutlass_moe.moe_gemm_gated(x, w, counts, activation="swish")
    with pytest.raises(ValueError, match="^activation: .*'swiglu_oai' is gated"):
        moe_gemm(x, w, counts, activation="swiglu_oai")
    with pytest.raises(ValueError, match=r"^bias: expected shape \(4, 32\)"):
        cutlass_moe.moe_gemm_gated(x, w, counts, bias=bg)  # not interleaved: (E, I)
    with pytest.raises(ValueError, match="^row_scale: expected 64 entries"):
        cutlass_moe.moe_gemm_gated(x, w, counts, row_scale=scale[:3])
    with pytest.raises(ValueError, match=r"^out: expected shape \(64, 16\)"):
        cutlass_moe.moe_gemm_gated(x, w, counts, out=torch.empty(64, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="^limit: expected a positive"):
        cutlass_moe.moe_gemm_gated(x, w, counts, activation="swiglu_oai", limit=0.0)


@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("trans_b", [False, True])
def test_gated_cpu_matches_separate_gemms(activation, trans_b):
    x, gate, up, bg, bu, scale, counts = make_gated(200, 48, 24, 6, torch.bfloat16, "cpu", trans_b)
    w = cutlass_moe.interleave_gate_up(gate, up, dim=1 if trans_b else -1)
    b = cutlass_moe.interleave_gate_up(bg, bu)
    y = cutlass_moe.moe_gemm_gated(x, w, counts, activation=activation, trans_b=trans_b, bias=b, row_scale=scale)
    assert y.shape == (200, 24) and y.dtype == torch.bfloat16
    check(y, separate_reference(x, gate, up, bg, bu, scale, counts, activation, trans_b), counts, 200)


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_gated_cpu_gradcheck(activation):
    x, gate, up, bg, bu, scale, counts = make_gated(24, 8, 8, 3, torch.float64, "cpu")
    w = cutlass_moe.interleave_gate_up(gate, up)
    b = cutlass_moe.interleave_gate_up(bg, bu)
    args = [t.double().requires_grad_() for t in (x, w, b, scale)]
    fn = lambda x, w, b, s: cutlass_moe.moe_gemm_gated(x, w, counts, activation=activation, bias=b, row_scale=s,
                                                       limit=1.5)  # a limit the values cross
    assert torch.autograd.gradcheck(fn, args)


def test_fused_docstring_examples_run():
    import doctest
    import cutlass_moe.fused as fused
    result = doctest.testmod(fused, raise_on_error=True)
    assert result.attempted > 0


def test_fused_op_opcheck_cpu():
    x, gate, up, bg, bu, scale, counts = make_gated(64, 16, 8, 3, torch.float32, "cpu")
    w, b = cutlass_moe.interleave_gate_up(gate, up), cutlass_moe.interleave_gate_up(bg, bu)
    torch.library.opcheck(torch.ops.cutlass_moe.moe_gemm_fused.default,
                          (x, w, counts, False, b, "swiglu_oai", scale, True, 1.702, 7.0, "auto", "auto"))
    torch.library.opcheck(torch.ops.cutlass_moe.moe_gemm_fused.default,
                          (x, w, counts, False, None, "relu", scale, False, 1.702, 7.0, "auto", "auto"))
    torch.library.opcheck(torch.ops.cutlass_moe.moe_gemm_fused_launch.default,
                          (x, w, counts, False, b, "swiglu_oai", scale, True, 1.702, 7.0, "auto", "auto"))


def test_compiled_fused_calls_the_launch_op_export_the_registered_one_cpu():
    # Without a gradient, a compiled graph calls the fused op's launch-only twin and an exported
    # program records the registered op; with one, the composite (the plain GEMM's launch op).
    x, gate, up, bg, bu, scale, counts = make_gated(64, 16, 8, 3, torch.float32, "cpu")
    w, b = cutlass_moe.interleave_gate_up(gate, up), cutlass_moe.interleave_gate_up(bg, bu)
    fn = lambda x, w, b, s: cutlass_moe.moe_gemm_gated(x, w, counts, bias=b, row_scale=s)
    want = fn(x, w, b, scale)
    torch._dynamo.reset()
    backend, targets = graph_recorder()
    with torch.no_grad():
        got = torch.compile(fn, fullgraph=True, backend=backend)(x, w, b, scale)
    assert targets == {"forward": [["cutlass_moe.moe_gemm_fused_launch.default"]], "backward": []}, targets
    torch.testing.assert_close(got, want)

    torch._dynamo.reset()
    backend, targets = graph_recorder()
    got = torch.compile(fn, fullgraph=True, backend=backend)(x, w.requires_grad_(), b, scale)
    got.sum().backward()
    assert targets["forward"] == [["cutlass_moe.moe_gemm_launch.default"]], targets
    torch.testing.assert_close(got, want)

    class Gated(torch.nn.Module):
        def forward(self, x, w, b, s):
            return fn(x, w, b, s)
    with torch.no_grad():
        program = torch.export.export(Gated(), (x, w.detach(), b, scale))
    targets = [str(n.target) for n in program.graph.nodes if str(n.target).startswith("cutlass_moe.")]
    assert targets == ["cutlass_moe.moe_gemm_fused.default"], targets
    torch.testing.assert_close(program.module()(x, w.detach(), b, scale), want)


@gpu
@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", MOE_CONFIGS + ["sm80_moe", "grouped"])
def test_gpu_gated_matches_separate_gemms(config, dtype, trans_b, activation):
    # The fused kernels (sm90: both epilogues, pingpong staging and cooperative TMA stores; sm80: its
    # own gated store) or, for "grouped", the composite path. I = 136: the last N tile is partial;
    # zero-token experts; a tail.
    from conftest import runs_here
    backend = config if config in ("grouped", "sm80_moe") else "moe"
    if not runs_here(backend):
        pytest.skip(f"no {backend} kernels for this GPU in this build")
    if backend == "moe" and f"sm90:moe:{'bf16' if dtype == torch.bfloat16 else 'fp16'}:{'nk' if trans_b else 'kn'}:" \
            f"{config}" not in cutlass_moe.built_configs():
        pytest.skip(f"{config} is not built for this dtype and layout")
    t, k, inter, e = 1000, 264, 136, 9
    x, gate, up, bg, bu, scale, counts = make_gated(t, k, inter, e, dtype, "cuda", trans_b, seed=8)
    counts[2] = 0
    w = cutlass_moe.interleave_gate_up(gate, up, dim=1 if trans_b else -1)
    b = cutlass_moe.interleave_gate_up(bg, bu)
    kw = dict(activation=activation, trans_b=trans_b, backend=backend,
              config=config if backend == "moe" else "auto")
    for bias, s in ((None, None), (b, None), (b, scale)):
        y = cutlass_moe.moe_gemm_gated(x, w, counts.cuda(), bias=bias, row_scale=s, **kw)
        assert y.shape == (t, inter)
        want = separate_reference(x, gate, up, bg if bias is not None else None, bu if bias is not None else None,
                                  s, counts, activation, trans_b)
        check(y, want, counts, t)


@gpu
@pytest.mark.parametrize("kind", ["hot", "one", "uniform"])
@pytest.mark.parametrize("backend", [backend_param("moe"), backend_param("sm80_moe")])
def test_gpu_gated_splits_and_out(backend, kind):
    t, k, inter, e = 4096, 512, 768, 16
    x, gate, up, bg, bu, scale, counts = make_gated(t, k, inter, e, torch.bfloat16, "cuda", seed=9, kind=kind)
    w, b = cutlass_moe.interleave_gate_up(gate, up), cutlass_moe.interleave_gate_up(bg, bu)
    want = separate_reference(x, gate, up, bg, bu, None, counts, "swiglu_oai")
    y = cutlass_moe.moe_gemm_gated(x, w, counts.cuda(), activation="swiglu_oai", bias=b, backend=backend)
    check(y, want, counts, t)
    out = torch.full((t, inter), 7.0, device="cuda", dtype=torch.bfloat16)
    cutlass_moe.moe_gemm_gated(x, w, counts.cuda(), activation="swiglu_oai", bias=b, backend=backend, out=out)
    end = sum(stop - start for start, stop in expert_row_ranges(counts, t))
    check(out[:end], want[:end], counts, end)
    assert bool((out[end:] == 7.0).all()), "a given out keeps the rows no expert owns"


@gpu
@pytest.mark.parametrize("k", [256, 392])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("kind", ["random", "hot"])
@pytest.mark.parametrize("config", ["sm90_cooperative_128x256x64_1x1x1", "sm90_cooperative_wide_64x512x32_1x1x1"])
def test_gpu_cooperative_deferred_stores(config, kind, trans_b, k):
    # bf16 cooperative and wide tiles store each tile while the next tile's first K blocks run (one
    # slice per block, or for a gated tile one row half of a slice; the fused operands loaded before
    # the mainloop). Several tiles per CTA, N's last tile partial (N = 1056), K = 256 (one K block
    # per store step, none left, in the cooperative tile) and 392 (a partial last block); plain,
    # fused (a bias seeds the accumulators, and the seeded tiles defer their stores as well), and
    # gated, gpt-oss's form with its biases among them.
    if f"sm90:moe:bf16:{'nk' if trans_b else 'kn'}:{config}" not in cutlass_moe.built_configs():
        pytest.skip(f"{config} is not built for bf16 and this layout")
    t, n, e = 16384, 1056, 16
    x, w, bias, scale, counts = make(t, k, n, e, torch.bfloat16, "cuda", trans_b, seed=11, kind=kind)
    counts[1] = 0
    counts[-1] += t - 5 - int(counts.sum())
    kw = dict(trans_b=trans_b, backend="moe", config=config)
    for b, activation, s in ((None, None, None), (None, "silu", None), (None, None, scale), (None, "gelu_tanh", scale),
                             (bias, None, None), (bias, "gelu_tanh", scale)):
        y = moe_gemm(x, w, counts.cuda(), bias=b, activation=activation, row_scale=s, **kw)
        want = moe_gemm_reference(x, w, counts, trans_b=trans_b, bias=b, activation=activation, row_scale=s)
        check(y, want, counts, t)
    half = n // 2
    gate, up = (w[:, :half], w[:, half:]) if trans_b else (w[..., :half], w[..., half:])
    wg = cutlass_moe.interleave_gate_up(gate, up, dim=1 if trans_b else -1)
    bg, bu = bias[:, :half], bias[:, half:]
    bgu = cutlass_moe.interleave_gate_up(bg, bu)
    # Each gated slice is stored in two row halves, in two K blocks of the next tile.
    for with_bias, activation, s in ((False, "silu", None), (False, "silu", scale), (False, "gelu_tanh", None),
                                     (True, "swiglu_oai", None), (True, "silu", scale)):
        y = cutlass_moe.moe_gemm_gated(x, wg, counts.cuda(), activation=activation, row_scale=s,
                                       bias=bgu if with_bias else None, **kw)
        want = separate_reference(x, gate, up, bg if with_bias else None, bu if with_bias else None, s, counts,
                                  activation, trans_b)
        check(y, want, counts, t)


@gpu
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", ["sm90_cooperative_128x256x64_1x1x1", "sm90_cooperative_wide_64x512x32_1x1x1"])
def test_gpu_cooperative_stores_scale_rows(config, dtype, trans_b):
    # Where the cooperative and wide tiles store right after the mainloop (fp16; bf16 with fewer
    # than 256 rows per expert, a bias seeded or not), their epilogue's store() multiplies the
    # rows by their scale as it converts them; the fused pass runs only for what else there is (an
    # activation, an fp16 bias). About 125 rows per expert (a zero-token expert, one larger), N's last
    # tile partial, a partial last K block.
    name = "fp16" if dtype == torch.float16 else "bf16"
    if f"sm90:moe:{name}:{'nk' if trans_b else 'kn'}:{config}" not in cutlass_moe.built_configs():
        pytest.skip(f"{config} is not built for {name} and this layout")
    t, k, n, e = 2000, 264, 1056, 16
    x, w, bias, scale, counts = make(t, k, n, e, dtype, "cuda", trans_b, seed=12)
    counts[3] = 0
    counts[-1] += t - 5 - int(counts.sum())  # the last expert takes the rows: a few more tiles
    kw = dict(trans_b=trans_b, backend="moe", config=config)
    for b, activation in ((None, None), (bias, None), (bias, "gelu_tanh"), (None, "silu")):
        y = moe_gemm(x, w, counts.cuda(), bias=b, activation=activation, row_scale=scale, **kw)
        want = moe_gemm_reference(x, w, counts, trans_b=trans_b, bias=b, activation=activation, row_scale=scale)
        check(y, want, counts, t)


@gpu
def test_gpu_gated_n_not_a_multiple_of_16_runs_the_composite():
    t, k, inter, e = 300, 64, 12, 3  # N = 24
    x, gate, up, bg, bu, scale, counts = make_gated(t, k, inter, e, torch.bfloat16, "cuda", seed=10)
    w = cutlass_moe.interleave_gate_up(gate, up)
    y = cutlass_moe.moe_gemm_gated(x, w, counts.cuda())
    check(y, separate_reference(x, gate, up, None, None, None, counts, "silu"), counts, t)


@gpu
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias_scale", "plain"])
@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gated_gradients(dtype, trans_b, activation, with_bias):
    # With bias and row scale: the torch form after the GEMM; without: the gated_activation kernels.
    t, k, inter, e = 300, 64, 24, 5
    x, gate, up, bg, bu, scale, counts = make_gated(t, k, inter, e, dtype, "cuda", trans_b, seed=11)
    counts[1] = 0
    w = cutlass_moe.interleave_gate_up(gate, up, dim=1 if trans_b else -1)
    b = cutlass_moe.interleave_gate_up(bg, bu)
    tensors = (x, w, b, scale) if with_bias else (x, w, None, None)
    leaves = [v.clone().requires_grad_() if v is not None else None for v in tensors]
    ref_leaves = [v.detach().float().cpu().requires_grad_() if v is not None else None for v in tensors]
    dy = torch.randn(t, inter, generator=torch.Generator().manual_seed(16)).to("cuda", dtype)
    cutlass_moe.moe_gemm_gated(leaves[0], leaves[1], counts.cuda(), activation=activation, trans_b=trans_b,
                               bias=leaves[2], row_scale=leaves[3], limit=7.0).backward(dy)
    moe_gemm_reference(ref_leaves[0], ref_leaves[1], counts, trans_b=trans_b, bias=ref_leaves[2],
                       activation=activation, row_scale=ref_leaves[3], gated=True, limit=7.0).backward(dy.float().cpu())
    check_grads(leaves, ref_leaves, counts, t, activation)


@gpu
def test_gpu_bias_gradient_is_deterministic():
    t, k, n, e = 4096, 64, 256, 8
    x, w, bias, scale, counts = make(t, k, n, e, torch.bfloat16, "cuda", seed=12, kind="hot")
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    grads = []
    for _ in range(3):
        b = bias.clone().requires_grad_()
        moe_gemm(x, w, counts.cuda(), bias=b, activation="silu").backward(dy)
        grads.append(b.grad)
    assert all(torch.equal(grads[0], g) for g in grads[1:])


@gpu
def test_gpu_fused_op_opcheck_and_compile():
    t, k, inter, e = 256, 64, 64, 4
    x, gate, up, bg, bu, scale, counts = make_gated(t, k, inter, e, torch.bfloat16, "cuda", seed=13)
    w, b = cutlass_moe.interleave_gate_up(gate, up), cutlass_moe.interleave_gate_up(bg, bu)
    c = counts.cuda()
    for op in (torch.ops.cutlass_moe.moe_gemm_fused.default, torch.ops.cutlass_moe.moe_gemm_fused_launch.default):
        torch.library.opcheck(op, (x, w, c, False, b, "silu", scale, True, 1.702, 7.0, "auto", "auto"))
    fn = torch.compile(lambda x, w, c, b, s: cutlass_moe.moe_gemm_gated(x, w, c, bias=b, row_scale=s),
                       fullgraph=True)
    with torch.no_grad():
        y = fn(x, w, c, b, scale)
    check(y, separate_reference(x, gate, up, bg, bu, scale, counts, "silu"), counts, t)
    # Training: the composite, compiled (the bias's gradient through the wgrad's launch op) and eager.
    grads = []
    for run in (fn, lambda *args: cutlass_moe.moe_gemm_gated(*args[:3], bias=args[3], row_scale=args[4])):
        leaves = [t_.detach().clone().requires_grad_() for t_ in (x, w, b, scale)]
        run(leaves[0], leaves[1], c, leaves[2], leaves[3]).float().pow(2).sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@gpu
def test_gpu_gated_activation_ops_under_compile():
    # Under torch.compile the gated activation's kernels run through launch-only ops, forward and
    # backward, with the eager kernels' bits. y and the incoming gradient sit 4 bytes off the kernels'
    # 8-byte alignment: they are copied first (a traced call cannot see the address; the eager
    # backward takes any gradient autograd hands it).
    from cutlass_moe.fused import _GatedActivation, gated_activation_of
    gen = torch.Generator(device="cuda").manual_seed(16)
    y = torch.randn(300 * 272 + 2, device="cuda", generator=gen).to(torch.bfloat16)[2:].view(300, 272)
    grad = torch.randn(300 * 136 + 2, device="cuda", generator=gen).to(torch.bfloat16)[2:].view(300, 136)
    torch.library.opcheck(torch.ops.cutlass_moe.gated_activation_launch.default, (y, "silu", 1.702, 7.0))
    torch.library.opcheck(torch.ops.cutlass_moe.gated_activation_backward_launch.default,
                          (y, grad, "silu", 1.702, 7.0))
    aligned = y.detach().clone().requires_grad_()
    want = _GatedActivation.apply(aligned, "silu", 1.702, 7.0, False)
    want.backward(grad)
    torch._dynamo.reset()
    backend, targets = graph_recorder()
    yc = y.detach().requires_grad_()
    got = torch.compile(lambda t: gated_activation_of(t, "silu"), fullgraph=True, backend=backend)(yc)
    got.backward(grad)
    assert targets == {"forward": [["cutlass_moe.gated_activation_launch.default"]],
                       "backward": [["cutlass_moe.gated_activation_backward_launch.default"]]}, targets
    assert torch.equal(got, want) and torch.equal(yc.grad, aligned.grad)


@gpu
@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gated_activation_kernels_match_torch(dtype, activation):
    # The composite path's kernels (one pass each way) against the torch form of the same math, on a
    # strided y (row stride past its width) and odd rows; values past the clamp limit included.
    from cutlass_moe.fused import _GatedActivation, _gated_kernel_applies
    from cutlass_moe.reference import gated_activation
    gen = torch.Generator(device="cuda").manual_seed(15)
    base = (torch.randn(333, 2 * 136 + 16, device="cuda", generator=gen) * 4).to(dtype)
    y = base[:, : 2 * 136]
    assert _gated_kernel_applies(y)
    grad = torch.randn(333, 136, device="cuda", generator=gen).to(dtype)
    yk, yt = y.detach().clone().requires_grad_(), y.detach().float().requires_grad_()
    got = _GatedActivation.apply(y.requires_grad_(), activation or "none", 1.702, 3.0, False)
    want = gated_activation(yt[:, 0::2], yt[:, 1::2], activation, 1.702, 3.0)
    rel = lambda a, b: float((a.float() - b).norm() / b.norm().clamp_min(1e-30))
    assert rel(got, want) < 1e-2
    got.backward(grad)
    want.backward(grad.float())
    assert y.grad.shape == y.shape and y.grad.dtype == dtype
    assert rel(y.grad, yt.grad) < 2e-2, f"backward: relative error {rel(y.grad, yt.grad):.2e}"
    del yk


@gpu
def test_fused_calls_stay_in_a_moe_family_where_auto_takes_the_grouped_one():
    # Only the MoE families run the fused epilogue. With thousands of rows per expert and K >= 1536 a
    # plain fp16 call's heuristic takes the grouped family (bf16 takes the MoE family's cooperative
    # tile, which defers its stores); a fused call's plan must stay in the MoE ones (else it would
    # fall back to the composite), and its result must still be right.
    from cutlass_moe import ops
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the grouped pick is the sm90 heuristic's")
    device = torch.cuda.current_device()
    t, e, k, n = 4096, 2, 1536, 256  # 2048 rows per expert
    args = (ops._DTYPES[torch.float16], ops._LAYOUTS["kn"], t, e, n, k, ops._BACKENDS["auto"],
            ops._CONFIGS["auto"], device)
    try:
        plain, fused = ops._plan(*args, False), ops._plan(*args, True)
    except NotImplementedError as err:  # a custom build without both sm90 families
        pytest.skip(str(err))
    assert (plain.backend, fused.backend) == ("grouped", "moe")
    bf16 = ops._plan(ops._DTYPES[torch.bfloat16], *args[1:], False)
    assert bf16.backend == "moe"
    x, w, bias, _, counts = make(t, k, n, e, torch.float16, "cuda")
    y = moe_gemm(x, w, counts.cuda(), bias=bias, activation="silu")
    ref = moe_gemm_reference(x.float().cpu(), w.float().cpu(), counts, bias=bias.float().cpu(), activation="silu")
    check(y, ref, counts, t)
