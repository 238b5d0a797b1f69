"""Grouped linear layers over equal-sized groups: :func:`grouped_linear`, :class:`GroupedLinear` and
:class:`GroupedMLP` (issue 11's grouped-linear forms).

Every group g has its own weight and sees the same number of rows: ``out[b, g] = x[b, g] @ W[g]``
for an input laid out (B, G, K), i.e. batch-major with the groups interleaved (recsys models:
one small MLP per feature or task, HSTU's per-head projections). A loop of per-group matmuls,
``torch.stack([x[:, g] @ W[g] for g in range(G)], dim=1)``, pays G launches, the stack's copy of
the whole output, and in the backward a zero-filled (B, G, K) gradient per group. Here each
projection is one batched GEMM that reads x and writes the output in place, in their (B, G, .)
layouts, through strided views:

    torch.bmm(x.transpose(0, 1), W, out=y.transpose(0, 1))       # y = torch.empty(B, G, N)

What torch does with such views (measured with torch 2.13 on the CPU; on the GPU read in ATen's
``baddbmm_out_cuda_impl`` and ``prepare_batch_matrix_for_cublas``, and checked by the CUDA tests):
  - ``bmm``/``baddbmm`` accept the non-contiguous ``out=`` view: no resize (y keeps its storage and
    data_ptr), no temporary copied back (the profiler shows ``aten::bmm`` and no ``copy_``), the
    values land in y. On the GPU a (G, B, N) view whose last dimension is contiguous and whose row
    stride is at least N goes to cuBLAS's strided-batched GEMM as it is (``ldc = G * N``, batch
    stride N), and so do the inputs ``x.transpose(0, 1)`` (ld G * K), ``weight.transpose(1, 2)``
    and ``x.permute(1, 2, 0)`` (transposed operands): no copy in or out.
  - On the CPU, float32 and float64 run without any copy; bfloat16 copies a strided *input* to a
    contiguous one inside the CPU kernel (plain ``torch.bmm`` does the same), never the output.
  - With a bias, ``baddbmm`` first writes the broadcast bias into the output (``beta * self``),
    then accumulates the GEMM on it (cuBLAS with beta = 1). At PR #263's shape on the H200 that is
    0.45 ms, against 0.29 for the bmm without bias and 0.53 for the bmm followed by an in-place
    broadcast add (torch's broadcast kernel runs well below bandwidth). So on an sm90 GPU, where K
    and N are multiples of 64, a projection with a bias is our MoE kernel instead, reading x's
    groups in place with the bias in its epilogue (the section "interleaved groups" below).
  - Without a bias, bf16 projections with N >= 2048 and at least 8 groups go to that kernel too:
    among 90 shapes of ``benchmarks/grouped_linear_sweep.py`` (H200) it takes 0.92-1.01x cuBLAS's
    bmm time there (PR #263's shape: 0.97x), and up to 1.13x with N = 1024 or 2-4 groups, which
    keep the bmm (``_no_bias_takes_moe``).
  - ``out=`` cannot record a gradient ("functions with out=... arguments don't support automatic
    differentiation"), and Dynamo refuses an ``out=`` that is not contiguous ("Attempted to call op
    with non-contiguous `out=` tensor", a graph break). So eager calls that record a gradient go
    through a ``torch.autograd.Function`` whose backward is strided batched GEMMs again
    (``dx[b, g] = dy[b, g] @ W[g]^T`` is this op with ``W.transpose(1, 2)``; ``dW[g] = x[:, g]^T @
    dy[:, g]`` one ``bmm`` of strided views; ``dbias[g] = sum_b dy[b, g]``), and traced calls
    through an op, which keeps the in-place write out of the traced graph: the custom op
    ``torch.ops.cutlass_moe.grouped_linear`` (a fake implementation and registered autograd) under
    torch.export and for meta tensors, its launch-only twin ``grouped_linear_launch`` (no Python
    autograd layer per call) under an autograd.Function in compiled graphs.

:class:`GroupedMLP` computes ``down(act(gate(x)) * up(x))`` per group with gate and up in one
(G, K, 2H) weight, interleaved column by column (gate's column j at column 2j, up's at 2j + 1, the
layout of :func:`cutlass_moe.moe_gemm_gated`). Where our fused gated kernel runs (a CUDA device
whose MoE family, sm90 ``moe`` or ``sm80_moe``, takes the shapes), the gate/up projection and the
activation are that one kernel: over x's groups in place where the sm90 kernel takes them as
interleaved groups, else over x's rows copied group-major once (a (G * B, K) copy of x, against a
(B, G, 2H) GEMM output and its elementwise passes saved); the down projection is
:func:`grouped_linear`. Elsewhere (the CPU, ``fused=False``) and wherever a gradient is recorded
(there the batched GEMMs on x in place are faster than the fused op's composite path), it is
:func:`grouped_linear`, then
:func:`gated_activation` (in float32, rounded once: on the GPU one kernel each way, under
torch.compile too, elsewhere torch operations).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch
from torch import nn

from . import _C
from .fused import (_MISSING, FusedArgs, _bias_aligned, _runs_fused_kernel, gated_activation_of, interleave_gate_up,
                    moe_gemm_gated)
from .ops import _ACTIVATION_IDS, _BACKENDS, _CONFIGS, _DTYPES as _CORE_DTYPES  # the core's ids
from .ops import (_autocast, _check_not_dtensor, _check_once, _check_tensor, _compiled, _new_workspace, _on_device,
                  _plan, _records_graph, _remember, _stream, _tensor_key, _traced, _weight_layout, define_launch_op)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
GATED_MLP_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")  # gelu: the erf form; gelu_tanh: tanh approximation


# ---- grouped_linear ------------------------------------------------------------------------------

def _check_grouped_linear(x, weight, bias, out) -> torch.Tensor:
    """Everything a user can get wrong that is visible without reading data; returns x as (B, G, K)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    _check_not_dtensor("x", x)
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected (B, G, K) or (B * G, K), got shape {tuple(x.shape)}")
    _check_tensor("weight", weight, 3)
    if x.dtype not in _DTYPES:
        raise TypeError(f"x: expected dtype {' or '.join(map(str, _DTYPES))}, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} does not match x's {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight: on {weight.device}, expected x's device {x.device}")
    groups, k, n = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"weight: expected shape (G, K, N) with K = {x.shape[-1]} (x is {tuple(x.shape)}), "
                         f"got {tuple(weight.shape)}")
    if x.dim() == 3:
        if x.shape[1] != groups:
            raise ValueError(f"weight: expected shape (G, K, N) with G = {x.shape[1]} groups (x is (B, G, K) = "
                             f"{tuple(x.shape)}), got {tuple(weight.shape)}")
    elif groups == 0 or x.shape[0] % groups != 0:
        raise ValueError(f"x: a 2-D x is (B * G, K), row b * G + g in group g: expected a multiple of "
                         f"G = {groups} rows (weight is {tuple(weight.shape)}), got {x.shape[0]}")
    else:
        x = x.view(x.shape[0] // groups, groups, k)  # splitting the row dimension is always a view
    if bias is not None:
        _check_tensor("bias", bias, 2)
        if tuple(bias.shape) != (groups, n):
            raise ValueError(f"bias: expected shape {(groups, n)} (G, N), got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"bias: dtype {bias.dtype} does not match x's {x.dtype}")
        if bias.device != x.device:
            raise ValueError(f"bias: on {bias.device}, expected x's device {x.device}")
    if out is not None:
        _check_tensor("out", out, 3)
        if tuple(out.shape) != (x.shape[0], groups, n):
            raise ValueError(f"out: expected shape {(x.shape[0], groups, n)} (B, G, N), got {tuple(out.shape)}")
        if out.dtype != x.dtype:
            raise TypeError(f"out: dtype {out.dtype} does not match x's {x.dtype}")
        if out.device != x.device:
            raise ValueError(f"out: on {out.device}, expected x's device {x.device}")
    return x


# ---- the sm90 MoE kernel over interleaved groups -------------------------------------------------
#
# Our MoE kernel reads a (B, G, K) x in place as interleaved groups (MoeGemmProblem::group_rows in
# cutlass_moe.h): group g's rows are x[:, g], its output columns out[:, g], and the fused epilogue
# (bias, activation, the gated pair) comes with it. Where it runs (an sm90 device, K and the output
# columns multiples of 64, 16-byte strides) it takes the projections with a bias, which baddbmm pays
# for with a second pass over the output, and GroupedMLP's gated projection, with no group-major
# copy of x.

# (x, weight and bias layouts, gated, config) -> (plan, ldx, x group stride, ldw, expert stride), or None
_INTERLEAVED_PLANS: dict = {}


def _group_strides(t: torch.Tensor, width: int) -> Optional[Tuple[int, int]]:
    """(row stride, group stride) of a (B, G, width) tensor read as interleaved groups (a one-row or
    one-group tensor's unused stride made up), or None where its last dimension is not contiguous,
    a stride is not a 16-byte multiple, or groups or rows overlap."""
    batch, groups, _ = t.shape
    if t.stride(2) != 1:
        return None
    group = t.stride(1) if groups > 1 else width
    row = t.stride(0) if batch > 1 else (groups - 1) * group + width
    if row % 8 or group % 8 or group < width or row < (groups - 1) * group + width:
        return None
    return row, group


def _interleaved_plan(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], gated: bool,
                      config: str):
    """_interleaved_call's part that depends on shapes and strides alone, cached."""
    key = (x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.stride(),
           None if bias is None else bias.stride(), gated, config)
    if key in _INTERLEAVED_PLANS:
        return _INTERLEAVED_PLANS[key]
    call = None
    batch, groups, k = x.shape
    n = weight.shape[2]
    cols = n // 2 if gated else n
    x_strides = _group_strides(x, k)
    if (x.dtype in _CORE_DTYPES and batch > 0 and groups > 0 and k > 0 and k % 64 == 0 and cols % 64 == 0
            and n % 2 == 0 and x_strides is not None):
        try:
            layout, ldw = _weight_layout(weight, False, "weight")
        except ValueError:
            layout = ldw = None
        expert_stride = weight.stride(0) if groups > 1 else 0
        bias_ok = bias is None or (bias.stride(1) == 1 and bias.stride(0) % 2 == 0 and bias.stride(0) >= n)
        if layout is not None and bias_ok and ldw % 8 == 0 and expert_stride % 8 == 0:
            try:
                plan = _plan(_CORE_DTYPES[x.dtype], layout, batch * groups, groups, n, k, _BACKENDS["moe"],
                             _CONFIGS[config], x.device.index, True)
                call = (plan, *x_strides, ldw, expert_stride)
            except (NotImplementedError, ValueError):  # no sm90 MoE kernel here for this dtype or layout
                pass
    _remember(_INTERLEAVED_PLANS, key, call)
    return call


def _interleaved_call(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], gated: bool = False,
                      config: str = "auto"):
    """The MoE kernel's (plan, ldx, x group stride, ldw, expert stride) for x (B, G, K) and weight
    (G, K, N) as interleaved groups, or None where it does not take them (traced or CPU tensors,
    shapes, strides, pointers). config: the heuristic's ("auto") or a built one (tests)."""
    if _traced(x, weight) or not x.is_cuda or not (_addresses_ok(x, None) and _addresses_ok(weight, bias)):
        return None
    return _interleaved_plan(x, weight, bias, gated, config)


def _interleaved_takes(x, weight, bias, gated: bool = False) -> bool:
    """Whether the MoE kernel takes x (B, G, K) as interleaved groups."""
    return _interleaved_call(x, weight, bias, gated) is not None


def _interleaved_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        out: Optional[torch.Tensor] = None, activation: str = "none", gated: bool = False,
                        alpha: float = 1.702, limit: float = 7.0, config: str = "auto", call=None) -> torch.Tensor:
    """out[b, g] = act(x[b, g] @ weight[g] + bias[g]) (gated: over (gate, up) column pairs, N/2
    columns) by the MoE kernel over interleaved groups. call: _interleaved_call(...)'s answer, not
    None (looked up here when not given). out: a new contiguous (B, G, cols) tensor, or a given
    one that _interleaved_out_ok takes."""
    plan, ldx, x_group_stride, ldw, expert_stride = call or _interleaved_call(x, weight, bias, gated, config)
    batch, groups, _ = x.shape
    cols = weight.shape[2] // 2 if gated else weight.shape[2]
    if out is None:
        out = torch.empty(batch, groups, cols, dtype=x.dtype, device=x.device)
        ldout, out_group_stride = groups * cols, cols  # what _group_strides makes of a new tensor
    else:
        ldout, out_group_stride = _group_strides(out, cols)
    device = x.device.index
    ws_bytes = plan.workspace_bytes
    workspace = _new_workspace(ws_bytes, x.device) if ws_bytes else None
    _on_device(device, _C.run_interleaved, plan, x.data_ptr(), ldx, x_group_stride, weight.data_ptr(), ldw,
               expert_stride, out.data_ptr(), ldout, out_group_stride, batch,
               workspace.data_ptr() if ws_bytes else 0, ws_bytes, _stream(device),
               bias.data_ptr() if bias is not None else 0, bias.stride(0) if bias is not None else 0,
               _ACTIVATION_IDS[activation], gated, alpha, limit)
    return out


def _no_bias_takes_moe(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a projection without a bias tries our MoE kernel over interleaved groups before the
    bmm: bf16, N >= 2048 and G >= 8, where the kernel beat cuBLAS's bmm on the sweep's shapes
    (benchmarks/grouped_linear_sweep_h200.json: this rule is never more than 1.4% behind the bmm
    there, 1.3% ahead in geomean, within 2% of the faster of the two on 83 of 90 shapes)."""
    return x.dtype == torch.bfloat16 and weight.shape[2] >= 2048 and weight.shape[0] >= 8


def _interleaved_out_ok(out: torch.Tensor) -> bool:
    """Whether a given (B, G, N) out takes the interleaved kernel's stores: its last dimension
    contiguous, 16-byte strides and address, groups and rows that do not overlap (else baddbmm)."""
    return out.data_ptr() % 16 == 0 and _group_strides(out, out.shape[2]) is not None


def _grouped_linear_impl(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         out: Optional[torch.Tensor] = None, call=_MISSING) -> torch.Tensor:
    """x (B, G, K), any strides; writes (B, G, N) into out or a new contiguous tensor, in place
    through its (G, B, N) view (see the module docstring: no copy in or out). With a bias, our MoE
    kernel over interleaved groups where it runs (the bias in its epilogue); without one, there too
    where _no_bias_takes_moe, else cuBLAS's bmm. call: that choice made by the caller (the
    interleaved kernel's _interleaved_call answer, or None for the bmm)."""
    if call is _MISSING:
        call = _interleaved_call(x, weight, bias) if bias is not None or _no_bias_takes_moe(x, weight) else None
    if call is not None and (out is None or _interleaved_out_ok(out)):
        return _interleaved_linear(x, weight, bias, out, call=call)
    if out is None:
        out = torch.empty(x.shape[0], x.shape[1], weight.shape[2], dtype=x.dtype, device=x.device)
    if bias is None:
        torch.bmm(x.transpose(0, 1), weight, out=out.transpose(0, 1))
    else:
        # baddbmm (the bias written into out, then the GEMM with beta = 1): 0.45 ms at PR #263's
        # shape on the H200, against 0.53 for the bmm and an in-place broadcast add after it
        # (benchmarks/NOTES.md).
        torch.baddbmm(bias.unsqueeze(1), x.transpose(0, 1), weight, out=out.transpose(0, 1))
    return out


# Eager inference calls on the GPU resolved by their signature (the tensors' shapes, strides, dtypes
# and devices; grouped_mlp's activation), as the fused calls' _resolved_fused: the checks and the
# kernel choices are made once, the addresses checked on every call. Values: a _LinearRoute
# (grouped_linear), an _MlpRoute or None (grouped_mlp).
_ROUTES: dict = {}


class _LinearRoute(NamedTuple):
    groups_shape: Tuple[int, int, int]  # x as (B, G, K)
    call: Optional[tuple]               # _interleaved_plan's answer; None: the bmm (baddbmm with a bias)


def _linear_route(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> _LinearRoute:
    """_grouped_linear_impl's choice for x (B, G, K), checked, without the addresses."""
    call = None
    if x.is_cuda and (bias is not None or _no_bias_takes_moe(x, weight)):
        call = _interleaved_plan(x, weight, bias, False, "auto")
    return _LinearRoute(tuple(x.shape), call)


def _addresses_ok(t: torch.Tensor, bias: Optional[torch.Tensor], interleaved: bool = True) -> bool:
    """The interleaved kernel's address rules for x or a weight t and its bias: 16-byte aligned t, a
    bias read in column pairs (_bias_aligned) (interleaved=False: the bmm's, any). A null address (a
    tensor without storage of its own, e.g. a DTensor, or an empty one) never passes: the checks and
    the general path deal with those."""
    p = t.data_ptr()
    if p == 0 or (interleaved and p % 16):
        return False
    return bias is None or (bias.data_ptr() != 0 and (not interleaved or _bias_aligned(bias)))


def _run_linear_route(route: _LinearRoute, x: torch.Tensor, weight: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """grouped_linear by the route of its signature, or None where the addresses do not suit it."""
    kernel = route.call is not None
    if not (_addresses_ok(x, None, kernel) and _addresses_ok(weight, bias, kernel)):
        return None
    if x.dim() == 2:
        x = x.view(route.groups_shape)
    if kernel:
        return _interleaved_linear(x, weight, bias, call=route.call)
    return _grouped_linear_impl(x, weight, bias, call=None)


def _route(key: tuple, make, *args):
    """The route of the signature `key` (hashable), made by make(*args) the first time it is seen:
    make runs the checks, which raise naming the argument."""
    route = _ROUTES.get(key, _MISSING)
    if route is _MISSING:
        route = make(*args)
        _remember(_ROUTES, key, route)
    return route


def _checked_linear_route(x, weight, bias) -> _LinearRoute:
    """A signature's first grouped_linear call: its checks, then its route."""
    return _linear_route(_check_grouped_linear(x, weight, bias, None), weight, bias)


def _grouped_linear_routed(x, weight, bias) -> Optional[torch.Tensor]:
    """An eager inference call (no gradient recorded) by its signature's route, or None where the
    call takes grouped_linear's general path."""
    try:
        if _records_graph(x, weight, bias):
            return None
        key = ("linear", _tensor_key(x), _tensor_key(weight), _tensor_key(bias))
    except (AttributeError, TypeError):  # not tensors: the checks name them
        return None
    return _run_linear_route(_route(key, _checked_linear_route, x, weight, bias), x, weight, bias)


def _weight_grad(x: torch.Tensor, grad: torch.Tensor, weight_strides: Tuple[int, ...]) -> torch.Tensor:
    """dW[g] = x[:, g]^T @ dy[:, g], one bmm of strided views, in the weight's layout: a weight
    stored (G, N, K) (a transposed view, K contiguous) gets dW^T = dy^T x written that way."""
    if weight_strides[2] != 1 and weight_strides[1] == 1:
        return torch.bmm(grad.permute(1, 2, 0), x.transpose(0, 1)).transpose(1, 2)
    return torch.bmm(x.permute(1, 2, 0), grad.transpose(0, 1))


@torch.library.custom_op("cutlass_moe::grouped_linear", mutates_args=())
def _grouped_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    # A direct torch.ops call or an exported program: grouped_linear's checks (it checked already).
    return _grouped_linear_impl(_check_grouped_linear(x, weight, bias, None), weight, bias)


@_grouped_linear_op.register_fake
def _grouped_linear_fake(x, weight, bias):
    return x.new_empty(x.shape[0], x.shape[1], weight.shape[2])


def _grouped_linear_setup_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)
    ctx.weight_strides = weight.stride()


def _grouped_linear_grads(ctx, grad, path: str):
    """(dx, dW, dbias), the dgrad through the registered op ("op": torch.export), its launch-only twin
    ("launch": compiled graphs, _CompiledGroupedLinear) or the public function ("eager": no
    dispatcher cost, and differentiable again under create_graph)."""
    x, weight = ctx.saved_tensors
    grad_x = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        # dgrad: dx[b, g] = dy[b, g] @ W[g]^T, this op with the weight's transposed view (no copy).
        weight_t = weight.transpose(1, 2)
        grad_x = _DGRAD_CALLS[path](grad, weight_t, None)
    if ctx.needs_input_grad[1]:
        grad_weight = _weight_grad(x, grad, ctx.weight_strides)
    if ctx.needs_input_grad[2]:
        grad_bias = grad.sum(0)
    return grad_x, grad_weight, grad_bias


_grouped_linear_op.register_autograd(lambda ctx, grad: _grouped_linear_grads(ctx, grad, "op"),
                                     setup_context=_grouped_linear_setup_context)
def _check_launch_grouped_linear(x, weight, bias) -> None:
    _check_tensor("x", x, 3)  # the launch-only ops take x as (B, G, K)
    _check_grouped_linear(x, weight, bias, None)


def _grouped_linear_launch_body(x, weight, bias):
    _check_once(("grouped_linear", _tensor_key(x), _tensor_key(weight), _tensor_key(bias)),
                _check_launch_grouped_linear, x, weight, bias)
    return _grouped_linear_impl(x, weight, bias)


_grouped_linear_launch = define_launch_op("grouped_linear_launch", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
                                          _grouped_linear_launch_body, _grouped_linear_fake)


# The dgrad of each path (_grouped_linear_grads): the registered op, its launch-only twin, the public function.
_DGRAD_CALLS = {"op": _grouped_linear_op, "launch": _grouped_linear_launch,
                "eager": lambda x, weight, bias: grouped_linear(x, weight, bias)}


class _CompiledGroupedLinear(torch.autograd.Function):
    """grouped_linear as torch.compile traces it: the forward and the dgrad through the launch-only
    op cutlass_moe::grouped_linear_launch, which has no Python autograd layer to run on every call
    (cutlass_moe.ops.define_launch_op); the weight's and bias's gradients are torch operations."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)  # the partitioner drops what goes unused
        ctx.weight_strides = weight.stride()
        return _grouped_linear_launch(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        return _grouped_linear_grads(ctx, grad, "launch")


class _GroupedLinearFunction(torch.autograd.Function):
    """Eager autograd of grouped_linear: the registered op's forward and backward without its
    dispatch cost (a torch.library op defined in Python costs tens of microseconds a call)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        _grouped_linear_setup_context(ctx, (x, weight, bias), None)
        return _grouped_linear_impl(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        return _grouped_linear_grads(ctx, grad, "eager")


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Equal-sized grouped linear: ``out[b, g] = x[b, g] @ weight[g] (+ bias[g])``.

    One batched GEMM over the groups, reading x and writing the output through strided views of
    their (B, G, .) layouts: no permutation copy in or out (module docstring).

    Args:
        x: (B, G, K), or (B * G, K) whose row ``b * G + g`` belongs to group g (the (B, G, K)
            tensor flattened). Any strides. float16, bfloat16, float32 or float64.
        weight: (G, K, N), x's dtype and device. Any strides: e.g. an (G, N, K) tensor's
            ``.transpose(1, 2)`` (nn.Linear's layout) is used as it is.
        bias: optional (G, N), x's dtype and device.
        out: optional (B, G, N) tensor to write into (x's dtype and device). A call with ``out``
            is not differentiable (like torch's ``out=`` ops).

    Returns:
        (B, G, N), always 3-D: a new contiguous tensor, or ``out``. Products accumulate as
        torch's batched matmul does (float32 for float16/bfloat16 on the GPU).

    Under ``torch.autocast`` (x's device type) x, weight and bias are cast to the autocast dtype
    first, as ``nn.Linear``'s are (not with ``out``).

    An eager call on the GPU with no gradient recorded makes its checks and its kernel choice once
    per signature (shapes, strides, dtypes, devices); the addresses are checked on every call.

    Autograd: differentiable in x, weight and bias (``torch.ops.cutlass_moe.grouped_linear`` under
    torch.export; compiled graphs call its launch-only twin ``grouped_linear_launch``):
    ``dx[b, g] = dy[b, g] @ weight[g]^T`` (this function with the weight's transposed view),
    ``dweight[g] = x[:, g]^T @ dy[:, g]`` (one bmm, in the weight's layout) and
    ``dbias[g] = sum_b dy[b, g]``.

    Raises:
        TypeError / ValueError naming the argument.

    Example::

        >>> import torch
        >>> from cutlass_moe.grouped_linear import grouped_linear
        >>> x = torch.randn(6, 3, 16)                      # (B, G, K)
        >>> w = torch.randn(3, 16, 8)                      # (G, K, N)
        >>> b = torch.randn(3, 8)                          # (G, N)
        >>> y = grouped_linear(x, w, b)                    # (B, G, N)
        >>> ref = torch.stack([x[:, g] @ w[g] + b[g] for g in range(3)], dim=1)
        >>> bool(torch.allclose(y, ref, rtol=1e-5, atol=1e-5))
        True
        >>> bool(torch.equal(grouped_linear(x.reshape(18, 16), w, b), y))  # the (B * G, K) form
        True
    """
    if out is None:
        x, weight, bias = _autocast(x, weight, bias)
        if isinstance(x, torch.Tensor) and x.is_cuda and not torch.compiler.is_compiling():
            y = _grouped_linear_routed(x, weight, bias)
            if y is not None:
                return y
    x = _check_grouped_linear(x, weight, bias, out)
    if out is not None:
        if _records_graph(x, weight, bias):
            raise RuntimeError("out: a call with out= is not differentiable; drop out= or run under torch.no_grad()")
        return _grouped_linear_impl(x, weight, bias, out)
    if _compiled():
        return _CompiledGroupedLinear.apply(x, weight, bias)
    if _traced(x, weight):  # torch.export, meta tensors
        return _grouped_linear_op(x, weight, bias)
    if _records_graph(x, weight, bias):
        return _GroupedLinearFunction.apply(x, weight, bias)
    return _grouped_linear_impl(x, weight, bias)


# ---- the gated activation ------------------------------------------------------------------------

def _check_activation(activation) -> None:
    if activation not in GATED_MLP_ACTIVATIONS:
        raise ValueError(f"activation: expected one of {list(GATED_MLP_ACTIVATIONS)}, got {activation!r}")


def gated_activation(h: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(h[..., 0::2]) * h[..., 1::2]``: gate and up interleaved column by column, computed in
    float32 (float64 for float64 h) and rounded once to h's dtype.

    Args:
        h: (..., 2H), e.g. the (B, G, 2H) output of the gate/up projection.
        activation: ``"silu"``, ``"gelu"`` (erf), ``"gelu_tanh"`` or ``"relu"``.

    Returns:
        (..., H) of h's dtype. Differentiable in h. On the GPU (fp16/bf16) one kernel each way
        (``cutlass_moe.fused.gated_activation_of``; launch-only ops under torch.compile);
        elsewhere torch operations.
    """
    _check_activation(activation)
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"h: expected a torch.Tensor, got {type(h).__name__}")
    if h.dim() < 1 or h.shape[-1] % 2:
        raise ValueError(f"h: expected (..., 2H), gate and up interleaved, got shape {tuple(h.shape)}")
    if not h.is_floating_point():
        raise TypeError(f"h: expected a floating-point dtype, got {h.dtype}")
    return gated_activation_of(h, activation)


# ---- modules -------------------------------------------------------------------------------------

def _init_linear_(weight: torch.Tensor, bias: Optional[torch.Tensor], fan_in: int) -> None:
    """nn.Linear's init for each group's (K, N) matrix: kaiming_uniform_(a=sqrt(5)) over fan_in = K
    gives the bound gain * sqrt(3 / K) = 1 / sqrt(K) (gain = sqrt(2 / (1 + 5))), and the bias
    uniform(-1 / sqrt(K), 1 / sqrt(K)). (kaiming_uniform_ on the 3-D tensor would take fan_in =
    K * N.) The entries are independent, so the interleaving of gate and up does not matter."""
    if fan_in == 0:
        return  # nothing to draw (nn.Linear warns and leaves it)
    bound = nn.init.calculate_gain("leaky_relu", math.sqrt(5)) * math.sqrt(3.0 / fan_in)
    nn.init.uniform_(weight, -bound, bound)
    if bias is not None:
        nn.init.uniform_(bias, -1.0 / math.sqrt(fan_in), 1.0 / math.sqrt(fan_in))


class GroupedLinear(nn.Module):
    """G independent linear layers over equal-sized groups: ``y[b, g] = x[b, g] @ weight[g] + bias[g]``.

    Args:
        num_groups: G.
        in_features: K.
        out_features: N.
        bias: whether to learn a (G, N) bias.
        device, dtype: of the parameters.

    Shapes:
        input (B, G, K), or (B * G, K) with row ``b * G + g`` in group g; output (B, G, N).
        ``weight`` (G, K, N) (each group's matrix is nn.Linear's weight transposed), ``bias`` (G, N).
        Initialized like ``nn.Linear(K, N)`` per group.

    Example::

        >>> import torch
        >>> from cutlass_moe.grouped_linear import GroupedLinear
        >>> layer = GroupedLinear(4, 32, 16)
        >>> x = torch.randn(10, 4, 32)
        >>> y = layer(x)                                                       # (10, 4, 16)
        >>> ref = torch.stack([x[:, g] @ layer.weight[g] + layer.bias[g] for g in range(4)], dim=1)
        >>> bool(torch.allclose(y, ref, rtol=1e-5, atol=1e-5))
        True
    """

    def __init__(self, num_groups: int, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_groups, in_features, out_features, **factory))
        self.bias = nn.Parameter(torch.empty(num_groups, out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_linear_(self.weight, self.bias, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")


def _gated_kernel_takes(x: torch.Tensor, gate_up_weight: torch.Tensor, gate_up_bias, activation: str,
                        check_addresses: bool = True) -> bool:
    """Whether moe_gemm_gated's fused kernel takes the gate/up projection of x (B, G, K): a CUDA
    tensor, sizes and strides its kernels take, and a MoE family (moe, sm80_moe) for the shapes.
    check_addresses=False: whatever the weight's and the bias's addresses (the caller checks them)."""
    batch, groups, k = x.shape
    w = gate_up_weight
    if not (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and batch * groups > 0):
        return False
    if k % 8 or w.shape[2] % 16 or not (w.stride(2) == 1 or w.stride(1) == 1):
        return False
    if any(stride % 8 for stride in w.stride() if stride != 1):
        return False
    if _traced(x, w):  # the pointers and the plan are decided at run time, by the op itself
        return True
    if check_addresses and w.data_ptr() % 16:
        return False
    return _runs_fused_kernel(x, w, False, "auto", "auto", FusedArgs(gate_up_bias, activation, None, True),
                              num_tokens=batch * groups, check_bias_address=check_addresses)


def _gated_projection(x: torch.Tensor, gate_up_weight: torch.Tensor, gate_up_bias: Optional[torch.Tensor],
                      activation: str) -> torch.Tensor:
    """act(gate) * up of x (B, G, K), (B, G, H), by the fused gated kernel where
    _gated_kernel_takes: over x's groups in place where the sm90 kernel takes them as interleaved
    groups (a new contiguous tensor), else over a group-major copy of x (a (B, G, H) view)."""
    call = _interleaved_call(x, gate_up_weight, gate_up_bias, gated=True)
    if call is not None:
        return _interleaved_linear(x, gate_up_weight, gate_up_bias, activation=activation, gated=True, call=call)
    batch, groups, k = x.shape
    rows = x.transpose(0, 1).reshape(groups * batch, k)                 # group-major: one copy of x
    counts = torch.full((groups,), batch, dtype=torch.int32, device=x.device)
    a = moe_gemm_gated(rows, gate_up_weight, counts, activation=activation, bias=gate_up_bias)
    return a.view(groups, batch, -1).transpose(0, 1)


def _gated_projection_fake(x, gate_up_weight, gate_up_bias, activation):
    return x.new_empty(x.shape[0], x.shape[1], gate_up_weight.shape[2] // 2)


# What a compiled GroupedMLP calls for its gated projection in inference: _gated_projection at run
# time (contiguous, as the fake implementation), launch-only (no autograd: only called where no
# gradient is recorded; torch.export traces _gated_projection itself).
def _check_launch_gated_projection(x, gate_up_weight, gate_up_bias, activation) -> None:
    _check_launch_grouped_linear(x, gate_up_weight, gate_up_bias)
    _check_activation(activation)
    if gate_up_weight.shape[2] % 2:
        raise ValueError(f"gate_up_weight: expected (G, K, 2H), gate and up interleaved, got an odd "
                         f"{gate_up_weight.shape[2]} columns")


def _grouped_gated_projection_body(x, gate_up_weight, gate_up_bias, activation):
    _check_once(("grouped_gated_projection", _tensor_key(x), _tensor_key(gate_up_weight), _tensor_key(gate_up_bias),
                 activation), _check_launch_gated_projection, x, gate_up_weight, gate_up_bias, activation)
    return _gated_projection(x, gate_up_weight, gate_up_bias, activation).contiguous()


_grouped_gated_projection = define_launch_op(
    "grouped_gated_projection", "(Tensor x, Tensor gate_up_weight, Tensor? gate_up_bias, str activation) -> Tensor",
    _grouped_gated_projection_body, _gated_projection_fake)


def _check_grouped_mlp(x, gate_up_weight, down_weight, gate_up_bias, down_bias) -> torch.Tensor:
    """grouped_mlp's checks of x and the gate/up projection (the down projection's are
    grouped_linear's, on the activation); returns x as (B, G, K)."""
    if down_weight.dim() == 3 and gate_up_weight.dim() == 3 and down_weight.shape[1] * 2 != gate_up_weight.shape[2]:
        raise ValueError(f"down_weight: expected (G, H, N) with H = {gate_up_weight.shape[2] // 2} (half of "
                         f"gate_up_weight's {gate_up_weight.shape[2]} columns), got {tuple(down_weight.shape)}")
    return _check_grouped_linear(x, gate_up_weight, gate_up_bias, None)


class _MlpRoute(NamedTuple):
    groups_shape: Tuple[int, int, int]  # x as (B, G, K)
    gate_up: tuple                      # _interleaved_plan's answer for the gated projection
    down: _LinearRoute                  # the down projection's, over the activation


def _mlp_route(x, gate_up_weight, down_weight, gate_up_bias, down_bias, activation) -> Optional[_MlpRoute]:
    """The route of an inference call on a signature seen for the first time, after grouped_mlp's
    checks and the down projection's (which raise naming the argument): the choices
    grouped_mlp's general path makes, without the addresses (checked per call); None where the
    gate/up projection is not the interleaved kernel (the general path decides per call)."""
    x = _check_grouped_mlp(x, gate_up_weight, down_weight, gate_up_bias, down_bias)
    batch, groups, _ = x.shape
    hidden = gate_up_weight.shape[2] // 2
    # A stand-in for the activation: a new (B, G, H) tensor, as the gated projection makes.
    activation_like = torch.empty(batch, groups, hidden, dtype=x.dtype, device=x.device)
    down = _linear_route(_check_grouped_linear(activation_like, down_weight, down_bias, None), down_weight, down_bias)
    if not (x.is_cuda and _gated_kernel_takes(x, gate_up_weight, gate_up_bias, activation, check_addresses=False)):
        return None
    gate_up = _interleaved_plan(x, gate_up_weight, gate_up_bias, True, "auto")
    return None if gate_up is None else _MlpRoute(tuple(x.shape), gate_up, down)


def _grouped_mlp_routed(x, gate_up_weight, down_weight, gate_up_bias, down_bias,
                        activation) -> Optional[torch.Tensor]:
    """An inference call (no gradient recorded) by its signature's route, or None where the call
    takes grouped_mlp's general path."""
    try:
        if _records_graph(x, gate_up_weight, down_weight, gate_up_bias, down_bias):
            return None
        key = ("mlp", _tensor_key(x), _tensor_key(gate_up_weight), _tensor_key(down_weight),
               _tensor_key(gate_up_bias), _tensor_key(down_bias), activation)  # activation: checked, a str
    except (AttributeError, TypeError):  # not tensors: the checks name them
        return None
    route = _route(key, _mlp_route, x, gate_up_weight, down_weight, gate_up_bias, down_bias, activation)
    if route is None or not (_addresses_ok(x, None) and _addresses_ok(gate_up_weight, gate_up_bias)):
        return None
    if x.dim() == 2:
        x = x.view(route.groups_shape)
    a = _interleaved_linear(x, gate_up_weight, gate_up_bias, activation=activation, gated=True, call=route.gate_up)
    y = _run_linear_route(route.down, a, down_weight, down_bias)
    if y is None:  # the down projection's addresses fail its route: its checks (e.g. a null address) and choice
        y = _grouped_linear_impl(_check_grouped_linear(a, down_weight, down_bias, None), down_weight, down_bias)
    return y


def grouped_mlp(x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
                gate_up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None,
                activation: str = "silu", *, fused: bool = True) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` per group, with the interleaved (G, K, 2H) gate/up weight and
    the (G, H, N) down weight. Returns (B, G, N).

    ``fused``: in inference (no gradient recorded), the gate/up projection and the activation as
    :func:`cutlass_moe.moe_gemm_gated`'s one kernel where it runs (module docstring); else, and
    always where a gradient is recorded, :func:`grouped_linear` then :func:`gated_activation`.
    The down projection is :func:`grouped_linear` either way. An eager inference call's checks and
    kernel choices are made once per signature (shapes, strides, dtypes, devices, activation);
    the addresses are checked on every call."""
    _check_activation(activation)
    x, gate_up_weight, down_weight, gate_up_bias, down_bias = _autocast(x, gate_up_weight, down_weight, gate_up_bias,
                                                                       down_bias)
    if fused and isinstance(x, torch.Tensor) and x.is_cuda and not torch.compiler.is_compiling():
        y = _grouped_mlp_routed(x, gate_up_weight, down_weight, gate_up_bias, down_bias, activation)
        if y is not None:
            return y
    x = _check_grouped_mlp(x, gate_up_weight, down_weight, gate_up_bias, down_bias)   # (B, G, K)
    # The fused kernel only in inference: where a gradient is recorded, moe_gemm_gated would run its
    # composite path (a plain GEMM kept for the backward) over the group-major copy of x, and its
    # backward our MoE dgrad and wgrad; cuBLAS's strided batched GEMMs on x in place are faster in
    # training at PR #263's shape (benchmarks/NOTES.md, "GroupedMLP in training").
    if (fused and not _records_graph(x, gate_up_weight, gate_up_bias)
            and _gated_kernel_takes(x, gate_up_weight, gate_up_bias, activation)):
        # Under torch.compile through an op, which decides at run time (pointers, strides) whether
        # x's groups are read in place; traced, _interleaved_call never takes them.
        projection = _grouped_gated_projection if _compiled() else _gated_projection
        a = projection(x, gate_up_weight, gate_up_bias, activation)     # (B, G, H)
    else:
        a = gated_activation(grouped_linear(x, gate_up_weight, gate_up_bias), activation)  # (B, G, H)
    return grouped_linear(a, down_weight, down_bias)                    # (B, G, N)


class GroupedMLP(nn.Module):
    """G independent gated MLPs over equal-sized groups: ``y[b, g] = down_g(act(gate_g(x[b, g])) *
    up_g(x[b, g]))``.

    Args:
        num_groups: G.
        in_features: K.
        hidden_features: H, the width of gate and up.
        out_features: N.
        bias: whether to learn biases (``gate_up_bias``, ``down_bias``).
        activation: ``"silu"`` (SwiGLU), ``"gelu"`` (erf; GEGLU), ``"gelu_tanh"`` or ``"relu"``.
        device, dtype: of the parameters.

    Shapes:
        input (B, G, K) or (B * G, K) (row ``b * G + g`` in group g); output (B, G, N).
        ``gate_up_weight`` (G, K, 2H): gate's column j at column 2j, up's at column 2j + 1 (one
        GEMM for both; the layout of the project's fused gated epilogue). ``gate_up_bias`` (G, 2H)
        interleaved the same way. ``down_weight`` (G, H, N), ``down_bias`` (G, N). Each projection
        is initialized like ``nn.Linear`` per group.

    The attribute ``fused`` (default True) picks :func:`grouped_mlp`'s fused gated kernel in
    inference, where it runs. Separate gate and up weights convert with
    :meth:`from_gate_up`; ``gate_up_weight[..., 0::2]`` and ``[..., 1::2]`` are views of them.

    Example::

        >>> import torch
        >>> from cutlass_moe.grouped_linear import GroupedMLP
        >>> mlp = GroupedMLP(3, 16, 24, 8)
        >>> x = torch.randn(5, 3, 16)
        >>> y = mlp(x)                                                         # (5, 3, 8)
        >>> gate, up = mlp.gate_up_weight[..., 0::2], mlp.gate_up_weight[..., 1::2]
        >>> ref = torch.stack([(torch.nn.functional.silu(x[:, g] @ gate[g]) * (x[:, g] @ up[g])) @ mlp.down_weight[g]
        ...                    for g in range(3)], dim=1)
        >>> bool(torch.allclose(y, ref, rtol=1e-4, atol=1e-5))
        True
    """

    def __init__(self, num_groups: int, in_features: int, hidden_features: int, out_features: int,
                 bias: bool = False, activation: str = "silu", device=None, dtype=None) -> None:
        super().__init__()
        _check_activation(activation)
        factory = {"device": device, "dtype": dtype}
        self.num_groups, self.in_features = num_groups, in_features
        self.hidden_features, self.out_features = hidden_features, out_features
        self.activation = activation
        self.fused = True
        self.gate_up_weight = nn.Parameter(torch.empty(num_groups, in_features, 2 * hidden_features, **factory))
        self.down_weight = nn.Parameter(torch.empty(num_groups, hidden_features, out_features, **factory))
        if bias:
            self.gate_up_bias = nn.Parameter(torch.empty(num_groups, 2 * hidden_features, **factory))
            self.down_bias = nn.Parameter(torch.empty(num_groups, out_features, **factory))
        else:
            self.register_parameter("gate_up_bias", None)
            self.register_parameter("down_bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_linear_(self.gate_up_weight, self.gate_up_bias, self.in_features)
        _init_linear_(self.down_weight, self.down_bias, self.hidden_features)

    @classmethod
    def from_gate_up(cls, gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor,
                     gate_bias: Optional[torch.Tensor] = None, up_bias: Optional[torch.Tensor] = None,
                     down_bias: Optional[torch.Tensor] = None, activation: str = "silu") -> "GroupedMLP":
        """A GroupedMLP holding copies of separate weights: gate and up (G, K, H), down (G, H, N),
        biases (G, H), (G, H), (G, N) (all three or none), interleaved into ``gate_up_weight``.
        Its output is ``down(act(x @ gate + gate_bias) * (x @ up + up_bias)) + down_bias``."""
        for name, t in (("gate_weight", gate_weight), ("up_weight", up_weight), ("down_weight", down_weight)):
            _check_tensor(name, t, 3)
        if up_weight.shape != gate_weight.shape:
            raise ValueError(f"up_weight: expected gate_weight's shape {tuple(gate_weight.shape)}, "
                             f"got {tuple(up_weight.shape)}")
        groups, k, hidden = gate_weight.shape
        if tuple(down_weight.shape[:2]) != (groups, hidden):
            raise ValueError(f"down_weight: expected shape (G, H, N) with G, H = {groups}, {hidden}, "
                             f"got {tuple(down_weight.shape)}")
        biases = (gate_bias, up_bias, down_bias)
        if any(b is None for b in biases) and not all(b is None for b in biases):
            raise ValueError("gate_bias, up_bias, down_bias: give all three or none")
        mlp = cls(groups, k, hidden, down_weight.shape[2], bias=gate_bias is not None, activation=activation,
                  device=gate_weight.device, dtype=gate_weight.dtype)
        with torch.no_grad():
            mlp.gate_up_weight.copy_(interleave_gate_up(gate_weight, up_weight))
            mlp.down_weight.copy_(down_weight)
            if gate_bias is not None:
                mlp.gate_up_bias.copy_(interleave_gate_up(gate_bias, up_bias))
                mlp.down_bias.copy_(down_bias)
        return mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grouped_mlp(x, self.gate_up_weight, self.down_weight, self.gate_up_bias, self.down_bias,
                           self.activation, fused=self.fused)

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"hidden_features={self.hidden_features}, out_features={self.out_features}, "
                f"bias={self.gate_up_bias is not None}, activation={self.activation!r}")
