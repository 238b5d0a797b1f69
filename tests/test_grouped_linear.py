"""grouped_linear, GroupedLinear and GroupedMLP (issue 11's grouped-linear forms): against a plain
float32 loop over groups, judged group by group (the worst group's relative error, and every
element within a bound); forward and backward (x, weights, biases); the (B, G, K) and (B * G, K)
forms; no copies in or out; torch.compile without graph breaks; the argument errors. The CPU tests
run everywhere; the CUDA tests need a GPU (conftest)."""
import pytest
import torch

from cutlass_moe.fused import interleave_gate_up
from cutlass_moe.grouped_linear import (GATED_MLP_ACTIVATIONS, GroupedLinear, GroupedMLP, _grouped_linear_op,
                                        gated_activation, grouped_linear, grouped_mlp)
from cutlass_moe.reference import ACTIVATIONS

from conftest import graph_recorder, requires_cuda

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
# Per group: ||got - ref|| / ||ref|| (a product of bf16/fp16 inputs differs from the float32
# reference by the output's rounding, ~2e-3 for bf16), and per element |got - ref| <= TOL * (|ref| +
# rms(ref_g)) (tests/test_autograd.py's bound).
REL = {FP64: 1e-10, FP32: 1e-5, BF16: 1e-2, FP16: 5e-3}
TOL = {FP64: 1e-9, FP32: 1e-4, BF16: 2e-2, FP16: 1e-2}


def compute_dtype(dtype):
    return FP64 if dtype == FP64 else FP32


def make(b, g, k, n, dtype, device="cpu", bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, g, k, generator=gen).to(device, dtype)
    w = (torch.randn(g, k, n, generator=gen) * k ** -0.5).to(device, dtype)
    bb = torch.randn(g, n, generator=gen).to(device, dtype) if bias else None
    return x, w, bb


def loop_linear(x, w, b=None):
    """The baseline every test judges by: a float32 (float64) matmul per group, stacked."""
    acc = compute_dtype(x.dtype)
    return torch.stack([x[:, g].to(acc) @ w[g].to(acc) + (b[g].to(acc) if b is not None else 0)
                        for g in range(w.shape[0])], dim=1)


def loop_mlp(x, gate, up, down, gate_bias=None, up_bias=None, down_bias=None, activation="silu", rounding=None):
    """down(act(x @ gate + gate_bias) * (x @ up + up_bias)) + down_bias per group, in float32.

    rounding: the module's dtype, where it is bf16/fp16: gate, up and the activation's output are
    rounded to it where the module stores them, and (through the casts' backward) so are their
    gradients. Without it, a bf16 gradient summed over a few rows can miss the per-element bound
    by the module's own, legitimate, intermediate roundings."""
    act = ACTIVATIONS[activation]
    rnd = (lambda t: t.to(rounding).to(t.dtype)) if rounding in (BF16, FP16) else (lambda t: t)
    h = rnd(act(rnd(loop_linear(x, gate, gate_bias))) * rnd(loop_linear(x, up, up_bias)))
    return loop_linear(h, down, down_bias)


def check(got, ref, dtype, group_dim, what, elementwise=True, rel=None):
    """Group by group along group_dim: the relative error of the group (at most rel, default
    REL[dtype]), and (elementwise) each element within TOL * (|ref| + rms of the group's reference)."""
    rel = REL[dtype] if rel is None else rel
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    got, ref = got.detach().to(ref.dtype), ref.detach()
    assert bool(torch.isfinite(got).all()), f"{what}: non-finite values"
    for g in range(ref.shape[group_dim]):
        o, r = got.select(group_dim, g), ref.select(group_dim, g)
        err = float((o - r).norm() / r.norm().clamp_min(1e-30))
        assert err <= rel, f"{what}, group {g}: relative error {err:.3e} > {rel:g}"
        if not elementwise:
            continue
        bound = TOL[dtype] * (r.abs() + r.pow(2).mean().sqrt())
        worst = float(((o - r).abs() / bound.clamp_min(1e-30)).max()) if r.numel() else 0.0
        assert worst <= 1, f"{what}, group {g}: an element is {worst:.2f}x outside {TOL[dtype]:g} * (|ref| + rms)"


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]


def reference_grads(fn, inputs, dy):
    """The float32 (float64) reference's gradients, by autograd through the loop."""
    ref_inputs = [t.detach().to(compute_dtype(t.dtype)).requires_grad_() if t is not None else None
                  for t in inputs]
    y = fn(*ref_inputs)
    y.backward(dy.to(y.dtype))
    return y, [t.grad if t is not None else None for t in ref_inputs]


def run_grouped_linear_case(b, g, k, n, dtype, device, form, bias):
    x, w, bb = make(b, g, k, n, dtype, device, bias)
    xl, wl, bl = leaves(x, w, bb)
    y = grouped_linear(xl.reshape(b * g, k) if form == "2d" else xl, wl, bl)
    assert y.shape == (b, g, n) and y.dtype == dtype and y.is_contiguous()
    dy = torch.randn(b, g, n, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    y.backward(dy)
    ref, (dx, dw, db) = reference_grads(loop_linear, (x, w, bb), dy)
    check(y, ref, dtype, 1, "y")
    check(xl.grad, dx, dtype, 1, "dx")
    check(wl.grad, dw, dtype, 0, "dW")
    if bias:
        check(bl.grad, db, dtype, 0, "dbias")


# ---- grouped_linear on the CPU ---------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 3, 8, 16), (7, 5, 13, 11)], ids=["B1", "odd"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("form", ["3d", "2d"])
@pytest.mark.parametrize("dtype", [FP32, BF16, FP64], ids=str)
def test_grouped_linear_cpu(dtype, form, bias, shape):
    run_grouped_linear_case(*shape, dtype, "cpu", form, bias)


def test_two_forms_agree_and_empty_sizes():
    x, w, bb = make(6, 4, 8, 5, FP32)
    assert torch.equal(grouped_linear(x, w, bb), grouped_linear(x.reshape(24, 8), w, bb))
    y = grouped_linear(x[:0], w, bb)
    assert y.shape == (0, 4, 5)
    assert grouped_linear(x[:0].reshape(0, 8), w).shape == (0, 4, 5)
    # K = 0: the empty sum, plus the bias.
    assert torch.equal(grouped_linear(x[..., :0], w[:, :0], bb), bb.expand(6, 4, 5))
    assert torch.equal(grouped_linear(x[..., :0], w[:, :0]), torch.zeros(6, 4, 5))


def test_strided_operands():
    # x a (B, G, K) view of a (G, B, K) tensor, the weight nn.Linear's (G, N, K) layout seen as
    # (G, K, N): used as they are, and the weight's gradient comes back in its own layout.
    b, g, k, n = 9, 3, 16, 12
    gen = torch.Generator().manual_seed(3)
    x_gbk = torch.randn(g, b, k, generator=gen, requires_grad=True)
    w_nk = torch.randn(g, n, k, generator=gen, requires_grad=True)
    x, w = x_gbk.transpose(0, 1), w_nk.transpose(1, 2)
    y = grouped_linear(x, w)
    dy = torch.randn(b, g, n, generator=gen)
    y.backward(dy)
    ref, (dx, dw) = reference_grads(loop_linear, (x, w), dy)
    check(y, ref, FP32, 1, "y")
    check(x_gbk.grad.transpose(0, 1), dx, FP32, 1, "dx")
    check(w_nk.grad.transpose(1, 2), dw, FP32, 0, "dW")
    assert w_nk.grad.is_contiguous(), "dW is computed in the weight's (G, N, K) layout"


def test_output_is_new_and_out_writes_in_place():
    x, w, bb = make(5, 3, 8, 6, FP32)
    y = grouped_linear(x, w, bb)
    assert y.shape == (5, 3, 6) and y.is_contiguous()
    assert y.data_ptr() not in (x.data_ptr(), w.data_ptr(), bb.data_ptr())
    out = torch.full((5, 3, 6), float("nan"))
    ptr = out.data_ptr()
    result = grouped_linear(x.reshape(15, 8), w, bb, out=out)
    assert result is out and out.data_ptr() == ptr, "out= must be written in place"
    assert torch.equal(out, y)
    # A strided out: the (G, B, N) storage seen as (B, G, N).
    out_gbn = torch.full((3, 5, 6), float("nan"))
    grouped_linear(x, w, bb, out=out_gbn.transpose(0, 1))
    assert torch.equal(out_gbn.transpose(0, 1), y)
    with pytest.raises(RuntimeError, match="^out: a call with out= is not differentiable"):
        grouped_linear(x, w.requires_grad_(), out=out)


def _aten_ops(fn):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [(e.name, e.input_shapes) for e in prof.events() if e.name.startswith("aten::")]


COPIES = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy")


def assert_only_bias_fill(ops, shape, bias):
    """No copy among the profiled aten ops but, with a bias, baddbmm's fill of the (G, B, N) output
    view with the broadcast bias (where the profiler records it)."""
    b, g, n = shape
    copies = [op for op in ops if op[0] in COPIES]
    allowed = [("aten::copy_", [[g, b, n], [g, b, n], []])] if bias else []
    assert copies in (allowed, []), copies


def check_no_copies(shape, dtype, device, bias):
    """grouped_linear forward (no copy but the bias fill) and backward (no copy) on (B, G, K, N);
    returns the backward's aten ops."""
    b, g, k, n = shape
    x, w, bb = make(b, g, k, n, dtype, device, bias)
    assert_only_bias_fill(_aten_ops(lambda: grouped_linear(x, w, bb)), (b, g, n), bias)
    xl, wl, bl = leaves(x, w, bb)
    y = grouped_linear(xl, wl, bl)
    dy = torch.randn_like(y)
    backward = _aten_ops(lambda: y.backward(dy))
    assert [op for op in backward if op[0] in COPIES] == [], backward
    return backward


def test_interleaved_out_predicate():
    # Which given outs the interleaved kernel may store into (else grouped_linear takes baddbmm).
    from cutlass_moe.grouped_linear import _interleaved_out_ok
    base = torch.empty(8, 4, 256, dtype=BF16)
    assert _interleaved_out_ok(base)
    assert _interleaved_out_ok(torch.empty(8, 4, 320, dtype=BF16)[:, :, :256])    # wider rows, same groups
    assert not _interleaved_out_ok(base.transpose(0, 1))                           # rows inside groups
    assert not _interleaved_out_ok(torch.empty(8, 256, 4, dtype=BF16).transpose(1, 2))  # N not contiguous
    assert not _interleaved_out_ok(base.as_strided((8, 4, 256), (512, 128, 1)))    # overlapping groups
    assert not _interleaved_out_ok(base.view(-1)[4:4 + 8 * 4 * 252].view(8, 4, 252)[:, :, :248])  # odd strides


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_no_copies_cpu(bias):
    # float32 on the CPU runs bmm on the strided views without any copy (bfloat16's CPU kernel
    # copies a strided input itself, torch.bmm alone too; the CUDA test below checks bf16/fp16).
    # The one copy allowed: baddbmm writing the broadcast bias into the output.
    backward = check_no_copies((6, 3, 8, 5), FP32, "cpu", bias)
    assert sum(op[0] == "aten::bmm" for op in backward) == 2  # dgrad and wgrad


def test_gradcheck_and_gradgradcheck():
    x, w, bb = make(3, 2, 4, 3, FP64, seed=5)
    inputs = [t.requires_grad_() for t in (x.reshape(6, 4), w, bb)]
    assert torch.autograd.gradcheck(grouped_linear, inputs)
    assert torch.autograd.gradgradcheck(grouped_linear, inputs)


def test_opcheck():
    x, w, bb = make(4, 3, 8, 5, FP32)
    for args in ((x, w, bb), (x, w, None)):
        # the launch-only twin that compiled graphs call has no autograd: inputs without grad
        torch.library.opcheck(torch.ops.cutlass_moe.grouped_linear_launch.default,
                              [t.detach() if t is not None else None for t in args])
        torch.library.opcheck(_grouped_linear_op, [t.detach().requires_grad_() if t is not None else None for t in args])


def test_export_holds_the_registered_op():
    layer = GroupedLinear(3, 8, 5)
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(12))
    program = torch.export.export(layer, (x,))
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert targets == ["cutlass_moe.grouped_linear.default"], targets
    torch.testing.assert_close(program.module()(x), layer(x))


def test_bad_arguments_name_themselves():
    x, w, bb = make(4, 3, 8, 5, FP32)
    cases = [
        ((x.numpy(), w), TypeError, "^x: expected a torch.Tensor"),
        ((x[0, 0], w), ValueError, r"^x: expected \(B, G, K\) or \(B \* G, K\)"),
        ((x.int(), w.int()), TypeError, "^x: expected dtype"),
        ((x, w[0]), ValueError, "^weight: expected 3 dimensions"),
        ((x, w.double()), TypeError, "^weight: dtype torch.float64 does not match"),
        ((x, w.to("meta")), ValueError, "^weight: on meta, expected x's device"),
        ((x, w[:2]), ValueError, "^weight: expected shape .* with G = 3 groups"),
        ((x, w[:, :7]), ValueError, "^weight: expected shape .* with K = 8"),
        ((x.reshape(12, 8)[:11], w), ValueError, "^x: a 2-D x is .* expected a multiple of G = 3 rows"),
        ((x, w, bb[:, :4]), ValueError, r"^bias: expected shape \(3, 5\)"),
        ((x, w, bb[0]), ValueError, "^bias: expected 2 dimensions"),
        ((x, w, bb.double()), TypeError, "^bias: dtype"),
        ((x, w, bb.to("meta")), ValueError, "^bias: on meta"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            grouped_linear(*args)
    with pytest.raises(ValueError, match=r"^out: expected shape \(4, 3, 5\)"):
        grouped_linear(x, w, out=torch.empty(4, 3, 6))
    with pytest.raises(TypeError, match="^out: dtype"):
        grouped_linear(x, w, out=torch.empty(4, 3, 5, dtype=FP64))


# ---- the gated activation and the modules on the CPU ------------------------------------------------

@pytest.mark.parametrize("activation", GATED_MLP_ACTIVATIONS)
def test_gated_activation_gradcheck(activation):
    h = torch.randn(3, 2, 8, dtype=FP64, generator=torch.Generator().manual_seed(2))
    h[..., 0::2] += 0.05 * torch.sign(h[..., 0::2])  # keep relu's kink away from the finite differences
    assert torch.autograd.gradcheck(lambda t: gated_activation(t, activation), (h.requires_grad_(),))


def test_gated_activation_rounds_once():
    # Computed in float32 and rounded once: the bf16 result is the float32 one rounded.
    h = torch.randn(4, 3, 32, generator=torch.Generator().manual_seed(4)).to(BF16)
    want = (torch.nn.functional.silu(h[..., 0::2].float()) * h[..., 1::2].float()).to(BF16)
    assert torch.equal(gated_activation(h, "silu"), want)


def test_gated_activation_bad_arguments():
    h = torch.randn(2, 6)
    with pytest.raises(ValueError, match="^activation: expected one of"):
        gated_activation(h, "swish")
    with pytest.raises(ValueError, match=r"^h: expected \(..., 2H\)"):
        gated_activation(torch.randn(2, 5))


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_grouped_linear_module(dtype):
    b, g, k, n = 5, 4, 24, 7
    torch.manual_seed(13)
    layer = GroupedLinear(g, k, n, dtype=dtype)
    assert layer.weight.shape == (g, k, n) and layer.bias.shape == (g, n) and layer.weight.dtype == dtype
    bound = k ** -0.5  # nn.Linear's: kaiming_uniform_(a=sqrt(5)) over fan_in = K, and the bias's
    for p in (layer.weight, layer.bias):
        largest = float(p.detach().abs().max())
        assert 0.5 * bound < largest <= bound * 1.01
    assert repr(layer) == f"GroupedLinear(num_groups={g}, in_features={k}, out_features={n}, bias=True)"
    assert GroupedLinear(g, k, n, bias=False).bias is None
    x = torch.randn(b, g, k, generator=torch.Generator().manual_seed(6)).to(dtype)
    xl = x.clone().requires_grad_()
    y = layer(xl.reshape(b * g, k))
    dy = torch.randn(b, g, n, generator=torch.Generator().manual_seed(7)).to(dtype)
    y.backward(dy)
    ref, (dx, dw, db) = reference_grads(loop_linear, (x, layer.weight, layer.bias), dy)
    check(y, ref, dtype, 1, "y")
    check(xl.grad, dx, dtype, 1, "dx")
    check(layer.weight.grad, dw, dtype, 0, "dW")
    check(layer.bias.grad, db, dtype, 0, "dbias")


def run_mlp_case(b, g, k, hidden, n, dtype, device, activation, bias, form="3d", fused=True):
    torch.manual_seed(12)  # the parameters' init
    mlp = GroupedMLP(g, k, hidden, n, bias=bias, activation=activation, device=device, dtype=dtype)
    mlp.fused = fused
    # On the GPU the half-precision intermediates round at the kernels' points (a bias added in fp32
    # after the GEMM's rounding; relu's kink): judged by each group's relative error alone there.
    elementwise = device == "cpu" or dtype not in (BF16, FP16)
    # relu's kink: a pre-activation near 0 whose sign the rounding flips moves its whole gradient.
    rel = 5e-2 if not elementwise and activation == "relu" else None
    x = torch.randn(b, g, k, generator=torch.Generator().manual_seed(8)).to(device, dtype)
    xl = x.clone().requires_grad_()
    y = mlp(xl.reshape(b * g, k) if form == "2d" else xl)
    assert y.shape == (b, g, n) and y.dtype == dtype and y.is_contiguous()
    dy = torch.randn(b, g, n, generator=torch.Generator().manual_seed(9)).to(device, dtype)
    y.backward(dy)
    w = mlp.gate_up_weight
    bias_of = mlp.gate_up_bias
    inputs = (x, w[..., 0::2], w[..., 1::2], mlp.down_weight,
              bias_of[..., 0::2] if bias else None, bias_of[..., 1::2] if bias else None, mlp.down_bias)
    ref, grads = reference_grads(lambda *t: loop_mlp(*t, activation=activation, rounding=dtype), inputs, dy)
    check(y, ref, dtype, 1, "y", elementwise)
    plain = loop_mlp(*[t.detach() if t is not None else None for t in inputs], activation=activation)
    for i in range(g):  # against the float32 loop without the intermediate roundings: the norm only
        err = float((y[:, i].detach().float() - plain[:, i]).norm() / plain[:, i].norm())
        assert err <= REL[dtype], f"y, group {i}: relative error {err:.3e} against the unrounded reference"
    check(xl.grad, grads[0], dtype, 1, "dx", elementwise, rel)
    check(w.grad[..., 0::2], grads[1], dtype, 0, "d gate weight", elementwise, rel)
    check(w.grad[..., 1::2], grads[2], dtype, 0, "d up weight", elementwise, rel)
    check(mlp.down_weight.grad, grads[3], dtype, 0, "d down weight", elementwise, rel)
    if bias:
        check(mlp.gate_up_bias.grad[..., 0::2], grads[4], dtype, 0, "d gate bias", elementwise, rel)
        check(mlp.gate_up_bias.grad[..., 1::2], grads[5], dtype, 0, "d up bias", elementwise, rel)
        check(mlp.down_bias.grad, grads[6], dtype, 0, "d down bias", elementwise, rel)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
@pytest.mark.parametrize("activation", GATED_MLP_ACTIVATIONS)
def test_grouped_mlp_cpu(activation, dtype, bias):
    run_mlp_case(7, 3, 16, 24, 9, dtype, "cpu", activation, bias)


def test_grouped_mlp_b1_and_flat_input():
    run_mlp_case(1, 2, 8, 12, 5, FP32, "cpu", "silu", True, form="2d")


def test_grouped_mlp_module_basics():
    mlp = GroupedMLP(3, 16, 24, 8, bias=True, activation="gelu")
    assert mlp.gate_up_weight.shape == (3, 16, 48) and mlp.down_weight.shape == (3, 24, 8)
    assert mlp.gate_up_bias.shape == (3, 48) and mlp.down_bias.shape == (3, 8)
    assert float(mlp.gate_up_weight.detach().abs().max()) <= 16 ** -0.5
    assert float(mlp.down_weight.detach().abs().max()) <= 24 ** -0.5
    assert repr(mlp) == ("GroupedMLP(num_groups=3, in_features=16, hidden_features=24, out_features=8, bias=True, "
                         "activation='gelu')")
    plain = GroupedMLP(3, 16, 24, 8)
    assert plain.gate_up_bias is None and plain.down_bias is None
    with pytest.raises(ValueError, match="^activation: expected one of"):
        GroupedMLP(3, 16, 24, 8, activation="tanh")


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_from_gate_up(bias):
    g, k, hidden, n = 3, 8, 10, 6
    gen = torch.Generator().manual_seed(10)
    gate, up = torch.randn(g, k, hidden, generator=gen), torch.randn(g, k, hidden, generator=gen)
    down = torch.randn(g, hidden, n, generator=gen)
    biases = [torch.randn(g, hidden, generator=gen), torch.randn(g, hidden, generator=gen),
              torch.randn(g, n, generator=gen)] if bias else [None] * 3
    mlp = GroupedMLP.from_gate_up(gate, up, down, *biases, activation="gelu_tanh")
    assert torch.equal(mlp.gate_up_weight[..., 0::2], gate) and torch.equal(mlp.gate_up_weight[..., 1::2], up)
    assert torch.equal(interleave_gate_up(gate, up)[..., 1::2], up)
    x = torch.randn(4, g, k, generator=gen)
    check(mlp(x), loop_mlp(x, gate, up, down, *biases, activation="gelu_tanh"), FP32, 1, "y")
    with pytest.raises(ValueError, match="^gate_bias, up_bias, down_bias: give all three or none"):
        GroupedMLP.from_gate_up(gate, up, down, biases[0] if bias else gate[:, 0])
    with pytest.raises(ValueError, match="^up_weight: expected gate_weight's shape"):
        GroupedMLP.from_gate_up(gate, up[:, :4], down)
    with pytest.raises(ValueError, match=r"^down_weight: expected shape \(G, H, N\)"):
        GroupedMLP.from_gate_up(gate, up, down[:, :4])


@pytest.mark.parametrize("form", ["3d", "2d"])
def test_compile_grouped_mlp_fullgraph(form):
    # fullgraph=True raises on any graph break; one graph each way, whose grouped GEMMs are the
    # launch-only op: the two projections forward, their two dgrads backward (the weights' gradients
    # are bmm).
    torch._dynamo.reset()
    mlp = GroupedMLP(3, 16, 24, 8, bias=True)
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(11))
    x_in = x.reshape(15, 16) if form == "2d" else x
    backend, targets = graph_recorder()
    compiled = torch.compile(mlp, fullgraph=True, backend=backend)
    xl = x_in.clone().requires_grad_()
    y = compiled(xl)
    y.backward(torch.ones_like(y))
    launches = ["cutlass_moe.grouped_linear_launch.default"] * 2
    assert targets == {"forward": [launches], "backward": [launches]}, targets
    grads = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    xe = x_in.clone().requires_grad_()
    ye = mlp(xe)
    ye.backward(torch.ones_like(ye))
    torch.testing.assert_close(y, ye)
    torch.testing.assert_close(xl.grad, xe.grad)
    for got, want in zip(grads, (p.grad for p in mlp.parameters())):
        torch.testing.assert_close(got, want)


def test_compile_grouped_mlp_dynamic_batch():
    # A new batch size per call: one compiled graph (dynamic shapes) serves them all, forward and
    # backward, with eager's results.
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    mlp = GroupedMLP(3, 16, 24, 8, bias=True)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(mlp, fullgraph=True, dynamic=True, backend=counter)
    gen = torch.Generator().manual_seed(13)
    frames = None
    for batch in (5, 7, 11):
        x = torch.randn(batch, 3, 16, generator=gen)
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = compiled(xc)
        y.sum().backward()
        frames = frames or counter.frame_count
        ye = mlp(xe)
        ye.sum().backward()
        torch.testing.assert_close(y, ye)
        torch.testing.assert_close(xc.grad, xe.grad)
    assert counter.frame_count == frames, (counter.frame_count, frames)


# ---- CUDA: runs on the GPU machine -------------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("shape", [(1, 3, 64, 128), (37, 12, 136, 264)], ids=["B1", "odd"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("form", ["3d", "2d"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=str)
def test_grouped_linear_cuda(dtype, form, bias, shape):
    run_grouped_linear_case(*shape, dtype, "cuda", form, bias)


@requires_cuda
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=str)
def test_no_copies_cuda(dtype, bias):
    # cuBLAS takes the strided views as they are: no copy in or out, forward or backward, apart
    # from baddbmm writing the broadcast bias into the output.
    check_no_copies((64, 12, 128, 256), dtype, "cuda", bias)


@requires_cuda
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=str)
@pytest.mark.parametrize("shape", [(40, 8, 128, 2048), (40, 8, 128, 1024), (40, 4, 128, 2048)],
                         ids=["n2048-g8", "n1024", "g4"])
def test_no_bias_kernel_choice_cuda(monkeypatch, shape, dtype):
    # Without a bias: our MoE kernel over interleaved groups for bf16 with N >= 2048 and G >= 8
    # (where the build has it), else cuBLAS's bmm; the output against the float32 loop either way,
    # forward and backward.
    import sys
    from conftest import runs_here
    gl = sys.modules["cutlass_moe.grouped_linear"]
    calls = []
    real = gl._interleaved_linear
    monkeypatch.setattr(gl, "_interleaved_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    b, g, k, n = shape
    with torch.no_grad():
        x, w, _ = make(b, g, k, n, dtype, "cuda", bias=False)
        check(grouped_linear(x, w), loop_linear(x, w), dtype, 1, "y")
    takes = dtype == BF16 and n >= 2048 and g >= 8 and runs_here("moe")
    assert calls == ([1] if takes else []), (calls, takes)
    run_grouped_linear_case(b, g, k, n, dtype, "cuda", "3d", False)


@requires_cuda
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=str)
@pytest.mark.parametrize("activation", GATED_MLP_ACTIVATIONS)
def test_grouped_mlp_cuda(activation, dtype, bias, fused):
    # With gradients both take grouped_linear then gated_activation (fused=True only in inference).
    run_mlp_case(37, 12, 128, 200, 72, dtype, "cuda", activation, bias, fused=fused)


@requires_cuda
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=str)
@pytest.mark.parametrize("activation", GATED_MLP_ACTIVATIONS)
@pytest.mark.parametrize("form", ["3d", "2d"])
def test_grouped_mlp_fused_kernel_cuda(form, activation, dtype, bias):
    # Inference: the gate/up projection and the activation in moe_gemm_gated's kernel (where the
    # build has the sm90 moe family), against the unrounded float32 loop, group by group.
    from conftest import runs_here
    if not runs_here("moe"):
        pytest.skip("no sm90 moe kernels for this GPU in this build")
    from cutlass_moe.grouped_linear import _gated_kernel_takes
    torch.manual_seed(13)
    b, g, k, hidden, n = 37, 12, 128, 200, 72
    mlp = GroupedMLP(g, k, hidden, n, bias=bias, activation=activation, device="cuda", dtype=dtype)
    x = torch.randn(b, g, k, generator=torch.Generator().manual_seed(14)).to("cuda", dtype)
    assert _gated_kernel_takes(x, mlp.gate_up_weight, mlp.gate_up_bias, activation)
    with torch.no_grad():
        y = mlp(x.reshape(b * g, k) if form == "2d" else x)
    assert y.shape == (b, g, n) and y.dtype == dtype
    w, bias_of = mlp.gate_up_weight, mlp.gate_up_bias
    ref = loop_mlp(x, w[..., 0::2], w[..., 1::2], mlp.down_weight, bias_of[..., 0::2] if bias else None,
                   bias_of[..., 1::2] if bias else None, mlp.down_bias, activation=activation)
    for i in range(g):
        err = float((y[:, i].float() - ref[:, i]).norm() / ref[:, i].norm())
        assert err <= REL[dtype], f"y, group {i}: relative error {err:.3e}"


@requires_cuda
def test_grouped_mlp_fused_kernel_only_in_inference_cuda(monkeypatch):
    # With a gradient recorded, grouped_linear's batched GEMMs (faster in training than the fused
    # op's composite path); without, moe_gemm_gated's kernel where the build has it.
    import sys
    from conftest import runs_here
    gl = sys.modules["cutlass_moe.grouped_linear"]  # the module: the package's attribute is the function
    calls = []
    real, real_interleaved = gl.moe_gemm_gated, gl._interleaved_linear
    monkeypatch.setattr(gl, "moe_gemm_gated", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(gl, "_interleaved_linear", lambda *a, **kw: calls.append(1) or real_interleaved(*a, **kw))
    mlp = GroupedMLP(12, 128, 256, 64, device="cuda", dtype=BF16)
    x = torch.randn(40, 12, 128, device="cuda", dtype=BF16)
    y = mlp(x)
    assert y.grad_fn is not None and calls == []
    y.sum().backward()
    assert all(p.grad is not None for p in mlp.parameters())
    with torch.no_grad():
        mlp(x)
    assert calls == ([1] if runs_here("moe") else [])


@requires_cuda
def test_compile_grouped_mlp_cuda():
    torch._dynamo.reset()
    mlp = GroupedMLP(12, 128, 256, 64, bias=True, device="cuda", dtype=BF16)
    x = torch.randn(40, 12, 128, device="cuda", dtype=BF16)
    compiled = torch.compile(mlp, fullgraph=True)
    xl, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = compiled(xl)
    y.backward(torch.ones_like(y))
    grads = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    ye = mlp(xe)
    ye.backward(torch.ones_like(ye))
    check(y, ye.float(), BF16, 1, "y")
    check(xl.grad, xe.grad.float(), BF16, 1, "dx")
    for got, want in zip(grads, (p.grad for p in mlp.parameters())):
        check(got, want.float(), BF16, 0, "d parameter")


@requires_cuda
@pytest.mark.parametrize("offset", [0, 4], ids=["in_place", "misaligned_x"])
def test_compile_grouped_mlp_inference_cuda(offset):
    # Compiled inference runs the fused gated kernel as eager does: through the launch-only op
    # cutlass_moe::grouped_gated_projection, which decides at run time whether x's groups are read
    # in place (the traced call cannot: no pointers). x 8 bytes off a 16-byte boundary: the kernel
    # runs on x's group-major copy instead.
    torch._dynamo.reset()
    mlp = GroupedMLP(12, 128, 256, 64, bias=True, device="cuda", dtype=BF16)
    x = torch.randn(40 * 12 * 128 + offset, device="cuda", dtype=BF16)[offset:].view(40, 12, 128)
    w, b = mlp.gate_up_weight.detach(), mlp.gate_up_bias.detach()
    torch.library.opcheck(torch.ops.cutlass_moe.grouped_gated_projection.default, (x, w, b, "silu"))
    backend, targets = graph_recorder()
    with torch.no_grad():
        want = mlp(x)
        got = torch.compile(mlp, fullgraph=True, backend=backend)(x)
        torch._dynamo.reset()
        got_inductor = torch.compile(mlp, fullgraph=True)(x)
    assert targets == {"forward": [["cutlass_moe.grouped_gated_projection.default",
                                    "cutlass_moe.grouped_linear_launch.default"]], "backward": []}, targets
    if offset == 0:  # the same kernels on the same strides as eager
        assert torch.equal(got, want)
    check(got, want.float(), BF16, 1, "y")
    check(got_inductor, want.float(), BF16, 1, "y (Inductor)")


def _count_route_calls(monkeypatch, gl):
    """(checks, kernels): lists that grow by one at each call of _check_grouped_linear and of our
    interleaved kernel; the routes start empty."""
    checks, kernels = [], []
    real_check, real_kernel = gl._check_grouped_linear, gl._interleaved_linear
    monkeypatch.setattr(gl, "_check_grouped_linear", lambda *a: checks.append(1) or real_check(*a))
    monkeypatch.setattr(gl, "_interleaved_linear", lambda *a, **kw: kernels.append(1) or real_kernel(*a, **kw))
    gl._ROUTES.clear()
    return checks, kernels


def _offset_copy(t: torch.Tensor, elements: int) -> torch.Tensor:
    """A copy of t with t's shape and strides, `elements` past the start of a new buffer."""
    buf = torch.empty(t.numel() + elements, dtype=t.dtype, device=t.device)
    return buf[elements:].view(t.shape).copy_(t)


@requires_cuda
@pytest.mark.parametrize("case", ["bias", "bmm", "nobias_kernel"])
def test_grouped_linear_inference_route_cuda(monkeypatch, case):
    # As grouped_mlp's route (below), for grouped_linear: our kernel with a bias, the bmm without
    # one, our kernel without one (bf16, N >= 2048, G >= 8).
    import sys
    from conftest import runs_here
    if not runs_here("moe"):
        pytest.skip("no sm90 moe kernels for this GPU in this build")
    gl = sys.modules["cutlass_moe.grouped_linear"]
    b, g, k, n = (24, 8, 128, 2048) if case == "nobias_kernel" else (40, 12, 128, 64)
    _, w, bias = make(b, g, k, n, BF16, "cuda", bias=case == "bias", seed=21)

    def general(*args):  # the path without the route
        with monkeypatch.context() as m:
            m.setattr(gl, "_grouped_linear_routed", lambda *a: None)
            return grouped_linear(*args)

    checks, kernels = _count_route_calls(monkeypatch, gl)
    with torch.no_grad():
        for form in ("3d", "2d"):
            for seed in (22, 23):  # the signature's first call, then a call by its route
                x = make(b, g, k, n, BF16, "cuda", seed=seed)[0]
                xin = x.view(b * g, k) if form == "2d" else x
                checks.clear(), kernels.clear()
                y = grouped_linear(xin, w, bias)
                assert (checks == []) == (seed == 23), (form, seed, checks)  # the route skips the checks
                assert kernels == ([] if case == "bmm" else [1]), (form, seed, kernels)
                assert torch.equal(y, general(xin, w, bias)), (form, seed)
                check(y, loop_linear(x, w, bias), BF16, 1, f"y ({form}, seed {seed})")
        x = make(b, g, k, n, BF16, "cuda", seed=24)[0]
        for i, name in enumerate(("x", "weight", "bias")):
            args = [x, w, bias]
            if args[i] is None:
                continue
            args[i] = _offset_copy(args[i], 1 if name == "bias" else 4)  # 2 or 8 bytes off
            y = grouped_linear(*args)
            assert torch.equal(y, general(*args)), name
            check(y, loop_linear(x, w, bias), BF16, 1, f"y ({name} off the alignment)")
    wl = w.clone().requires_grad_()
    y = grouped_linear(x, wl, bias)  # a gradient recorded: the autograd path
    y.float().sum().backward()
    assert wl.grad is not None


@requires_cuda
@pytest.mark.parametrize("down_bias", [True, False], ids=["down_kernel", "down_bmm"])
def test_grouped_mlp_inference_route_cuda(monkeypatch, down_bias):
    # An inference call's checks and kernel choices are made once per signature: a call whose
    # signature was seen runs neither grouped_linear's checks nor its decisions again, and gives
    # the general path's bits. Addresses are checked on every call: an x, weight or bias off the
    # kernel's alignment (same shapes and strides) takes the general path, and a gradient recorded
    # the autograd path. Down projection: our kernel (with a bias) or the bmm (without one, N < 2048).
    import sys
    from conftest import runs_here
    if not runs_here("moe"):
        pytest.skip("no sm90 moe kernels for this GPU in this build")
    gl = sys.modules["cutlass_moe.grouped_linear"]
    torch.manual_seed(15)
    b, g, k, hidden, n = 40, 12, 128, 256, 64
    mlp = GroupedMLP(g, k, hidden, n, bias=True, device="cuda", dtype=BF16)
    if not down_bias:
        mlp.down_bias = None
    params = (mlp.gate_up_weight, mlp.down_weight, mlp.gate_up_bias, mlp.down_bias)

    def general(x, w, dw, bb, db):  # the path without the routes
        with monkeypatch.context() as m:
            m.setattr(gl, "_grouped_mlp_routed", lambda *a: None)
            m.setattr(gl, "_grouped_linear_routed", lambda *a: None)
            return grouped_mlp(x, w, dw, bb, db)

    def reference(x, w, dw, bb, db):
        return loop_mlp(x.view(b, g, k), w[..., 0::2], w[..., 1::2], dw, bb[..., 0::2], bb[..., 1::2], db)

    checks, kernels = _count_route_calls(monkeypatch, gl)
    with torch.no_grad():
        for form in ("3d", "2d"):
            for seed in (16, 17):  # the signature's first call, then a call by its route
                x = torch.randn(b, g, k, generator=torch.Generator().manual_seed(seed)).to("cuda", BF16)
                if form == "2d":
                    x = x.view(b * g, k)
                checks.clear(), kernels.clear()
                y = grouped_mlp(x, *params)
                assert (checks == []) == (seed == 17), (form, seed, checks)  # the route skips the checks
                assert kernels == ([1, 1] if down_bias else [1]), (form, seed, kernels)
                assert torch.equal(y, general(x, *params)), (form, seed)
                check(y, reference(x, *params), BF16, 1, f"y ({form}, seed {seed})", elementwise=False)
        x = torch.randn(b, g, k, generator=torch.Generator().manual_seed(18)).to("cuda", BF16)
        want = reference(x, *params)
        # Each tensor 8 bytes (x, the weights) or 2 bytes (the biases) off, one at a time.
        for i, name in enumerate(("x", "gate_up_weight", "down_weight", "gate_up_bias", "down_bias")):
            args = [x, *params]
            if args[i] is None:
                continue
            args[i] = _offset_copy(args[i], 1 if "bias" in name else 4)
            y = grouped_mlp(*args)
            assert torch.equal(y, general(*args)), name
            check(y, want, BF16, 1, f"y ({name} off the alignment)", elementwise=False)
    y = grouped_mlp(x, *params)  # a gradient recorded: the autograd path
    assert y.grad_fn is not None
    y.float().sum().backward()
    assert all(p.grad is not None for p in mlp.parameters())


@requires_cuda
def test_compile_grouped_mlp_reduce_overhead_cuda():
    # torch.compile(mode="reduce-overhead"): GroupedMLP with biases replayed from CUDA graphs,
    # training and inference (conftest.check_reduce_overhead).
    from conftest import check_reduce_overhead
    torch.manual_seed(19)
    mlp = GroupedMLP(12, 128, 256, 64, bias=True, device="cuda", dtype=BF16)
    gen = torch.Generator(device="cuda").manual_seed(20)
    check_reduce_overhead(mlp, lambda: torch.randn(40, 12, 128, device="cuda", dtype=BF16, generator=gen))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_grouped_mlp_aoti_package(device, tmp_path):
    # GroupedMLP with biases, exported and compiled ahead of time by AOTInductor
    # (conftest.check_aoti_package): the package holds the registered grouped_linear op.
    from conftest import check_aoti_package
    torch.manual_seed(21)
    dtype = BF16 if device == "cuda" else torch.float32
    mlp = GroupedMLP(12, 128, 256, 64, bias=True, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(22)
    targets = check_aoti_package(mlp, lambda t: torch.randn(t, 12, 128, device=device, dtype=dtype, generator=gen),
                                 tmp_path / "mlp.pt2", rel=2e-2 if device == "cuda" else 1e-5)
    # The registered ops, never their launch-only twins (a torch.compile graph's); on the GPU the
    # gate/up projection may be the fused gated op over a group-major copy of x (grouped_mlp).
    assert targets and not any("launch" in t for t in targets), targets
    if device == "cpu":
        assert targets == ["cutlass_moe.grouped_linear.default"] * 2, targets


@requires_cuda
def test_grouped_mlp_functional_matches_module_cuda():
    mlp = GroupedMLP(4, 64, 96, 32, bias=True, device="cuda", dtype=BF16)
    x = torch.randn(16, 4, 64, device="cuda", dtype=BF16)
    with torch.no_grad():
        want = mlp(x)
        got = grouped_mlp(x, mlp.gate_up_weight, mlp.down_weight, mlp.gate_up_bias, mlp.down_bias)
    assert torch.equal(got, want)


@pytest.mark.parametrize("module", ["linear", "mlp"])
def test_autocast_cpu(module):
    # Under torch.autocast the modules compute in the autocast dtype from fp32 parameters, whose
    # gradients stay fp32, as nn.Linear does.
    torch.manual_seed(21)
    b, g, k, n = 6, 3, 16, 8
    x = torch.randn(b, g, k, requires_grad=True)
    layer = GroupedLinear(g, k, n) if module == "linear" else GroupedMLP(g, k, 12, n, bias=True)
    with torch.autocast("cpu", dtype=BF16):
        y = layer(x)
    assert y.dtype == BF16
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == FP32
    for p in layer.parameters():
        assert p.grad is not None and p.grad.dtype == FP32
    with torch.no_grad():
        want = layer(x.detach())  # fp32
    err = float((y.detach().float() - want).norm() / want.norm())
    assert err < REL[BF16], f"autocast output: relative error {err:.2e} against fp32"


# ---- CUDA: the sm90 MoE kernel over interleaved groups ----------------------------------------------

def _moe_configs(dtype=None, layout=None):
    """The built sm90 moe configs (of this dtype and weight layout, where given)."""
    from conftest import DTYPE_NAMES, built_instances
    return sorted({inst[4] for inst in built_instances() if inst[0] == "sm90" and inst[1] == "moe"
                   and (dtype is None or inst[2] == DTYPE_NAMES[dtype]) and (layout is None or inst[3] == layout)})


def _loop_gated(x, w, bias, activation):
    """act(gate + bias) * (up + bias) per group in float32, gate and up interleaved column by column."""
    from cutlass_moe.reference import gated_activation as ref_gated
    h = loop_linear(x, w, bias)
    return ref_gated(h[..., 0::2], h[..., 1::2], activation)


@requires_cuda
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=str)
@pytest.mark.parametrize("shape", [(1, 3, 64, 128), (300, 5, 192, 256), (37, 12, 128, 128), (320, 4, 320, 512)],
                         ids=["B1", "ragged", "G12", "deferred"])
def test_interleaved_kernel_cuda(shape, dtype, layout, gated):
    # Every built sm90 moe config (the pingpong and the cooperative epilogue), with and without a
    # bias, on x read in place from a wider tensor (group stride > K) into a given out whose
    # neighbouring columns must stay untouched, against the float32 loop, group by group. "deferred"
    # (320 rows per group, K 320) is where bf16 cooperative tiles defer their stores, the bias seeded.
    from conftest import is_built, runs_here
    from cutlass_moe.grouped_linear import _interleaved_linear, _interleaved_takes
    if not runs_here("moe") or not is_built("moe", dtype, layout):
        pytest.skip("no sm90 moe kernel for this GPU, dtype and layout in this build")
    b, g, k, n = shape
    gen = torch.Generator().manual_seed(21)
    x_wide = torch.randn(b, g, k + 64, generator=gen).to("cuda", dtype)
    x = x_wide[:, :, 32:32 + k]                                  # group stride k + 64, 16-byte aligned
    w = (torch.randn(g, k, n, generator=gen) * k ** -0.5).to("cuda", dtype)
    if layout == "nk":
        w = w.transpose(1, 2).contiguous().transpose(1, 2)       # (G, K, N) view of (G, N, K) storage
    bias = torch.randn(g, n, generator=gen).to("cuda", dtype)
    cols = n // 2 if gated else n
    for config in _moe_configs(dtype, layout):  # the wide tile: (E, K, N) weights only
        for with_bias in (False, True):
            bb = bias if with_bias else None
            assert _interleaved_takes(x, w, bb, gated)
            out_wide = torch.full((b, g, cols + 64), float("nan"), dtype=dtype, device="cuda")
            out = out_wide[:, :, :cols]
            activation = "silu" if gated else "none"
            _interleaved_linear(x, w, bb, out, activation=activation, gated=gated, config=config)
            what = f"{config}, bias={with_bias}"
            assert bool(torch.isnan(out_wide[:, :, cols:]).all()), f"{what}: wrote past a group's columns"
            ref = _loop_gated(x, w, bb, activation) if gated else loop_linear(x, w, bb)
            check(out, ref, dtype, 1, what)
            if not gated:  # a new output
                check(_interleaved_linear(x, w, bb, config=config), ref, dtype, 1, what + ", new out")


@requires_cuda
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=str)
def test_grouped_linear_bias_takes_interleaved_kernel_cuda(dtype, monkeypatch):
    # With a bias, grouped_linear runs the MoE kernel where it takes the shape (bias in its
    # epilogue, no baddbmm fill), forward and in the autograd forward; gradients stay cuBLAS's.
    import sys
    from conftest import is_built, runs_here
    gl = sys.modules["cutlass_moe.grouped_linear"]
    calls = []
    real = gl._interleaved_linear
    monkeypatch.setattr(gl, "_interleaved_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    expected = runs_here("moe") and is_built("moe", dtype, "kn")
    run_grouped_linear_case(64, 12, 128, 192, dtype, "cuda", "3d", True)
    assert calls == ([1] if expected else [])
    run_grouped_linear_case(64, 12, 136, 192, dtype, "cuda", "3d", True)   # K not a multiple of 64: baddbmm
    assert calls == ([1] if expected else [])


@requires_cuda
def test_interleaved_bad_arguments_name_themselves_cuda():
    # The core's checks of interleaved groups, through the binding: each names its argument.
    from conftest import is_built, runs_here
    from cutlass_moe import _C
    from cutlass_moe.ops import _BACKENDS, _CONFIGS, _DTYPES, _LAYOUTS, _stream
    if not runs_here("moe") or not is_built("moe", BF16, "kn"):
        pytest.skip("no sm90 moe kernel for bf16 in this build")
    b, g, k, n = 8, 4, 128, 128
    x = torch.randn(b, g, k, device="cuda", dtype=BF16)
    w = torch.randn(g, k, n, device="cuda", dtype=BF16)
    out = torch.empty(b, g, n, device="cuda", dtype=BF16)

    def run(k_=k, ldx=g * k, x_gs=k, ldout=g * n, out_gs=n, rows=b, n_=n):
        plan = _C.plan(_DTYPES[BF16], _LAYOUTS["kn"], rows * g, g, n_, k_, _BACKENDS["moe"], _CONFIGS["auto"],
                       torch.cuda.current_device(), True)
        _C.run_interleaved(plan, x.data_ptr(), ldx, x_gs, w.data_ptr(), n_, k_ * n_, out.data_ptr(), ldout, out_gs,
                           rows, 0, 0, _stream(torch.cuda.current_device()), 0, 0, 0, False, 1.702, 7.0)

    run()  # the valid call
    with pytest.raises(ValueError, match="x: K = 96 must be a positive multiple of 64"):
        run(k_=96, x_gs=96, ldx=g * 96)
    with pytest.raises(ValueError, match="out: 96 columns must be a multiple of 64"):
        run(n_=96, out_gs=96, ldout=g * 96)
    with pytest.raises(ValueError, match="x: group stride of 64 elements"):
        run(x_gs=64)
    with pytest.raises(ValueError, match="x: row stride of 256 elements must cover every group"):
        run(ldx=256)
    with pytest.raises(ValueError, match="out: row stride of 256 elements must cover every group"):
        run(ldout=256)


@requires_cuda
def test_grouped_linear_bias_replays_in_a_cuda_graph():
    # The interleaved kernel (or baddbmm where it does not run) captured once and replayed on new
    # inputs written into the captured tensors: no host sync, no allocation that replays stale.
    b, g, k, n = 96, 6, 128, 192
    x, w, bb = make(b, g, k, n, BF16, "cuda", True, seed=3)
    with torch.no_grad():
        grouped_linear(x, w, bb)  # warm-up: plans and descriptors made outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = grouped_linear(x, w, bb)
        for seed in (4, 5):
            fresh, fresh_w, fresh_b = make(b, g, k, n, BF16, "cuda", True, seed=seed)
            x.copy_(fresh)
            w.copy_(fresh_w)
            bb.copy_(fresh_b)
            graph.replay()
            torch.cuda.synchronize()
            check(y, loop_linear(fresh, fresh_w, fresh_b), BF16, 1, f"replay with seed {seed}")
