"""Fused epilogues: moe_gemm's ``bias`` / ``activation`` / ``row_scale``, and the gated projection
:func:`moe_gemm_gated` (``act(gate) * up`` from one GEMM) with its weight-layout helper
:func:`interleave_gate_up`.

Where they run:
  - in the MoE families' kernels (sm90 ``moe``, sm80 ``sm80_moe``), on the fp32 accumulators
    (``FusedEpilogue`` in cpp/fused_epilogue.hpp), when the call records no gradient: eager calls, and
    torch.compile through ``torch.ops.cutlass_moe.moe_gemm_fused_launch`` (the launch-only twin of the
    custom op ``torch.ops.cutlass_moe.moe_gemm_fused``, which torch.export records);
  - otherwise (a gradient is recorded, the CPU, another family) as the composite: the plain GEMM
    through :func:`moe_gemm` (differentiable; its launch-only ops under torch.compile), then the
    epilogue as torch operations (``_apply_epilogue``; a gated activation of the GEMM's own output
    is the core's gated_activation kernels, under torch.compile as launch-only ops). Its backward
    keeps the GEMM's output (the pre-activation) rather than recomputing the GEMM. The bias gradient, each expert's sum of its
    rows of the gradient, runs through the wgrad kernel against a column of ones: no atomics, the
    same bits on every run.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import _C
from .ops import (_ACTIVATION_IDS, _BACKENDS, _CONFIGS, _DTYPES, _Resolved, _autocast, _check_moe_gemm,
                  _check_out, _check_tensor, _compiled, _launch, _moe_gemm_impl, _on_device, _plan, _records_graph,
                  _remember, _stream, _tensor_key, _traced, _weight_layout, define_launch_op, moe_gemm,
                  moe_gemm_wgrad)
from .reference import ACTIVATIONS, GATED_ACTIVATIONS, gated_activation


class FusedArgs(NamedTuple):
    """What the epilogue applies: ``row_scale * act(acc + bias)``, or gated
    ``row_scale * gated_activation(gate + bias, up + bias)`` over column pairs."""
    bias: Optional[torch.Tensor]
    activation: str
    row_scale: Optional[torch.Tensor]
    gated: bool = False
    alpha: float = 1.702
    limit: float = 7.0


def _check_gated_n(n: int) -> None:
    if n % 2:
        raise ValueError(f"weights: N = {n} must be even for a gated projection (gate and up interleaved "
                         "column by column: cutlass_moe.interleave_gate_up)")


def _check_fused(x, fused: FusedArgs, num_experts: int, n: int) -> None:
    bias, row_scale = fused.bias, fused.row_scale
    if fused.gated:
        _check_gated_n(n)
    allowed = GATED_ACTIVATIONS if fused.gated else tuple(ACTIVATIONS)
    if fused.activation not in allowed:
        hint = " ('swiglu_oai' is gated: moe_gemm_gated)" if fused.activation == "swiglu_oai" else ""
        raise ValueError(f"activation: expected None or one of {sorted(a for a in allowed if a != 'none')}, "
                         f"got {fused.activation!r}{hint}")
    if bias is not None:
        _check_tensor("bias", bias, 2)
        if tuple(bias.shape) != (num_experts, n):
            what = "(E, N), gate and up interleaved like the weights" if fused.gated else "(E, N)"
            raise ValueError(f"bias: expected shape {(num_experts, n)} {what}, got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"bias: dtype {bias.dtype} does not match x's {x.dtype}")
        if bias.device != x.device:
            raise ValueError(f"bias: on {bias.device}, expected x's device {x.device}")
        if n > 1 and bias.stride(1) != 1:
            raise ValueError(f"bias: the last dimension must be contiguous, got strides {tuple(bias.stride())}")
    if row_scale is not None:
        _check_tensor("row_scale", row_scale, 1)
        if row_scale.shape[0] != x.shape[0]:
            raise ValueError(f"row_scale: expected {x.shape[0]} entries (one per row of x), got {row_scale.shape[0]}")
        # float64 too on the CPU reference path with float64 x (torch.autograd.gradcheck)
        if row_scale.dtype != torch.float32 and not (x.device.type == "cpu" and row_scale.dtype == x.dtype):
            raise TypeError(f"row_scale: expected dtype torch.float32 or x's {x.dtype}, got {row_scale.dtype}")
        if row_scale.device != x.device:
            raise ValueError(f"row_scale: on {row_scale.device}, expected x's device {x.device}")
        if x.shape[0] > 1 and row_scale.stride(0) != 1:
            raise ValueError(f"row_scale: must be contiguous, got stride {row_scale.stride(0)}")
    if fused.gated and not fused.limit > 0:
        raise ValueError(f"limit: expected a positive clamp limit, got {fused.limit}")


def _row_experts(tokens_per_expert: torch.Tensor, num_tokens: int, device) -> torch.Tensor:
    """Each row's expert by the kernels' clamp rule (counts clamped to [0, T], ends capped at T),
    computed on `device` without a host synchronization; rows no expert owns get E."""
    counts = tokens_per_expert.to(device, torch.int64).clamp(0, num_tokens)
    ends = torch.cumsum(counts, 0).clamp(max=num_tokens)
    return torch.searchsorted(ends, torch.arange(num_tokens, device=device), right=True)


class _ExpertBias(torch.autograd.Function):
    """bias[e] on each row of expert e (zeros on rows no expert owns), in the compute dtype. Its
    backward is each expert's sum of its rows: the wgrad kernel with x = ones on the GPU (a fixed
    reduction order, unlike index_add's atomics), index_add on the CPU (sequential)."""

    @staticmethod
    def forward(ctx, bias, tokens_per_expert, num_tokens, compute):
        expert = _row_experts(tokens_per_expert, num_tokens, bias.device)
        ctx.save_for_backward(tokens_per_expert, expert)
        ctx.bias_dtype = bias.dtype
        rows = bias.to(compute)
        return torch.cat([rows, rows.new_zeros(1, bias.shape[1])])[expert]

    @staticmethod
    def backward(ctx, grad):
        tokens_per_expert, expert = ctx.saved_tensors
        num_tokens, n = grad.shape
        num_experts = tokens_per_expert.shape[0]
        if grad.device.type == "cuda":
            # dW[e] = ones_e^T dy_e: K = 8, the smallest K the kernels take; its first row is the sum.
            ones = grad.new_ones(num_tokens, 8, dtype=ctx.bias_dtype)
            grad = grad.to(ctx.bias_dtype).contiguous()  # e.g. a transposed incoming gradient
            sums = moe_gemm_wgrad(ones, grad, tokens_per_expert, out_dtype=torch.float32)[:, 0]
        else:
            sums = grad.new_zeros(num_experts + 1, n).index_add_(0, expert, grad)[:num_experts]
        return sums.to(ctx.bias_dtype), None, None, None


def _gated_kernel_shape(y: torch.Tensor) -> bool:
    """What the core's gated_activation kernels need of y (rows, 2I) that is known while tracing: an
    fp16/bf16 CUDA tensor whose pairs fill 16-byte vectors."""
    return y.is_cuda and y.dtype in _DTYPES and y.dim() == 2 and y.shape[1] % 8 == 0


def _gated_kernel_applies(y: torch.Tensor) -> bool:
    """Whether the kernels take y as it is: _gated_kernel_shape, and 16-byte rows of 8-byte aligned
    vectors. Outside torch.compile only (Dynamo cannot trace data_ptr(): there _GatedActivation
    runs through launch-only ops that check at run time)."""
    return (not torch.compiler.is_compiling() and _gated_kernel_shape(y) and y.stride(1) == 1
            and y.stride(0) % 4 == 0 and y.data_ptr() % 8 == 0)


def _gated_activation_forward(y, activation, alpha, limit) -> torch.Tensor:
    """(rows, I) = act(gate) * up over y's (rows, 2I) pairs by the core's kernel (y copied first
    where its strides or address do not suit it)."""
    if not _gated_kernel_applies(y):
        y = y.clone(memory_format=torch.contiguous_format)  # a new allocation: aligned
    rows, cols = y.shape[0], y.shape[1] // 2
    out = y.new_empty(rows, cols)
    device = y.device.index
    _on_device(device, _C.gated_activation, _DTYPES[y.dtype], _ACTIVATION_IDS[activation], alpha, limit, rows, cols,
               y.data_ptr(), y.stride(0), out.data_ptr(), cols, _stream(device))
    return out


def _gated_activation_backward(y, grad, activation, alpha, limit) -> torch.Tensor:
    """The (rows, 2I) interleaved gradient of _gated_activation_forward from grad (rows, I)."""
    if not _gated_kernel_applies(y):
        y = y.clone(memory_format=torch.contiguous_format)
    if grad.stride(1) != 1 or grad.stride(0) % 4 or grad.data_ptr() % 8:
        grad = grad.clone(memory_format=torch.contiguous_format)
    rows, cols = y.shape[0], y.shape[1] // 2
    grad_y = torch.empty(rows, 2 * cols, dtype=y.dtype, device=y.device)
    device = y.device.index
    _on_device(device, _C.gated_activation_backward, _DTYPES[y.dtype], _ACTIVATION_IDS[activation], alpha, limit,
               rows, cols, y.data_ptr(), y.stride(0), grad.data_ptr(), grad.stride(0) if rows > 1 else cols,
               grad_y.data_ptr(), 2 * cols, _stream(device))
    return grad_y


def _check_gated_activation_call(y, activation, grad=None) -> None:
    """What _GatedActivation makes sure of before it calls the kernels, checked again in the
    launch-only ops' bodies: a direct torch.ops call must not reach a kernel with shapes it would
    read past."""
    _check_tensor("y", y, 2)
    if not _gated_kernel_shape(y):
        raise ValueError(f"y: expected an fp16 or bf16 CUDA tensor with a multiple of 8 columns, got {y.dtype} "
                         f"{tuple(y.shape)} on {y.device}")
    if activation not in _ACTIVATION_IDS or activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation: expected one of {sorted(GATED_ACTIVATIONS)}, got {activation!r}")
    if grad is not None:
        _check_tensor("grad", grad, 2)
        if tuple(grad.shape) != (y.shape[0], y.shape[1] // 2) or grad.dtype != y.dtype or grad.device != y.device:
            raise ValueError(f"grad: expected {y.dtype} of shape {(y.shape[0], y.shape[1] // 2)} on {y.device}, "
                             f"got {grad.dtype} {tuple(grad.shape)} on {grad.device}")


def _gated_activation_launch_body(y, activation, alpha, limit):
    _check_gated_activation_call(y, activation)
    return _gated_activation_forward(y, activation, alpha, limit)


def _gated_activation_backward_launch_body(y, grad, activation, alpha, limit):
    _check_gated_activation_call(y, activation, grad)
    return _gated_activation_backward(y, grad, activation, alpha, limit)


# The kernels as ops for compiled graphs (launch-only: _GatedActivation is their autograd).
_gated_activation_launch = define_launch_op(
    "gated_activation_launch", "(Tensor y, str activation, float alpha, float limit) -> Tensor",
    _gated_activation_launch_body, lambda y, activation, alpha, limit: y.new_empty(y.shape[0], y.shape[1] // 2),
    keys=("CUDA",))
_gated_activation_backward_launch = define_launch_op(
    "gated_activation_backward_launch", "(Tensor y, Tensor grad, str activation, float alpha, float limit) -> Tensor",
    _gated_activation_backward_launch_body,
    lambda y, grad, activation, alpha, limit: y.new_empty(y.shape[0], y.shape[1]), keys=("CUDA",))


class _GatedActivation(torch.autograd.Function):
    """``act(gate) * up`` over y's interleaved (gate, up) column pairs, by the core's
    gated_activation kernels: one pass forward, one backward writing the interleaved gradient. The
    same as the torch form (fp32 math, rounded once), whose backward costs several passes and a
    stack of the two halves' gradients (benchmarks/NOTES.md). Keeps y for the backward.

    compiled: through the launch-only ops, as torch.compile traces it (they take y's strides and
    address at run time). Inductor's fusion of the torch form kept a float32 copy of y for the
    backward: compiled GroupedMLP training ran at 0.89x the compiled bmm MLP (benchmarks/NOTES.md)."""

    @staticmethod
    def forward(ctx, y, activation, alpha, limit, compiled):
        ctx.save_for_backward(y)
        ctx.args, ctx.compiled = (activation, alpha, limit), compiled
        return (_gated_activation_launch if compiled else _gated_activation_forward)(y, activation, alpha, limit)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        backward = _gated_activation_backward_launch if ctx.compiled else _gated_activation_backward
        return backward(y, grad, *ctx.args), None, None, None, None


def gated_activation_of(y: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """``gated_activation`` over y's (..., 2I) interleaved pairs, differentiable: the core's
    kernels where they take y (as rows x 2I; under torch.compile through launch-only ops), else
    torch operations in fp32; rounded once to y's dtype."""
    flat = y.reshape(-1, y.shape[-1]) if y.dim() != 2 else y
    compiled = _compiled() and _gated_kernel_shape(flat)
    if compiled or _gated_kernel_applies(flat):
        out = _GatedActivation.apply(flat, activation, alpha, limit, compiled)
        return out.view(*y.shape[:-1], y.shape[-1] // 2)
    compute = torch.float64 if y.dtype == torch.float64 else torch.float32
    # unbind, not two strided slices: its backward is one stack, not two zero-filled copies.
    gate, up = y.to(compute).unflatten(-1, (-1, 2)).unbind(-1)
    return gated_activation(gate, up, activation, alpha, limit).to(y.dtype)


def _apply_epilogue(y: torch.Tensor, tokens_per_expert: torch.Tensor, fused: FusedArgs) -> torch.Tensor:
    """The fused epilogue in torch operations on moe_gemm's output y (differentiable, traceable,
    no host synchronization): what the fused kernel computes, with y rounded to its dtype first.
    Gated: N/2 columns."""
    num_tokens = y.shape[0]
    if fused.gated and fused.bias is None and fused.row_scale is None:
        return gated_activation_of(y, fused.activation, fused.alpha, fused.limit)
    compute = torch.float64 if y.dtype == torch.float64 else torch.float32
    h = y.to(compute)
    if fused.bias is not None:
        h = h + _ExpertBias.apply(fused.bias, tokens_per_expert, num_tokens, compute)
    if fused.gated:
        h = gated_activation_of(h, fused.activation, fused.alpha, fused.limit)  # h is fp32: torch operations
    else:
        h = ACTIVATIONS[fused.activation](h)
    if fused.row_scale is not None:
        h = h * fused.row_scale[:, None]
    return h.to(y.dtype)


_FUSED_FAMILIES = ("moe", "sm80_moe")  # the families whose kernels run the fused epilogue


def _bias_aligned(bias: Optional[torch.Tensor]) -> bool:
    return bias is None or bias.data_ptr() % 4 == 0  # the kernel reads the bias in column pairs


def _fused_kernel_takes(x, weights, trans_b, fused: FusedArgs, num_tokens: Optional[int] = None,
                        check_bias_address: bool = True) -> bool:
    """What the fused kernel needs besides a MoE family: a CUDA problem with no empty dimension, a
    gated N that is a multiple of 16 (N/2 output columns in 16-byte vectors), and a bias read in
    column pairs (4-byte aligned rows; its address unless check_bias_address is False). num_tokens:
    T where x is not (T, K) (grouped_mlp's (B, G, K))."""
    num_tokens = x.shape[0] if num_tokens is None else num_tokens  # x's rows, unless given
    n = weights.shape[1] if trans_b else weights.shape[2]
    if x.device.type != "cuda" or min(x.shape[-1], weights.shape[0], n, num_tokens) == 0 or (fused.gated and n % 16):
        return False
    bias = fused.bias
    # the kernel reads column pairs (traced: the op decides again at run time)
    return bias is None or not (bias.stride(0) % 2
                                or (check_bias_address and not _traced(x) and not _bias_aligned(bias)))


def _runs_fused_kernel(x, weights, trans_b, backend, config, fused: FusedArgs, num_tokens: Optional[int] = None,
                       check_bias_address: bool = True) -> bool:
    """Whether the fused kernel takes the call: _fused_kernel_takes, and the plan resolves to a MoE family."""
    if not _fused_kernel_takes(x, weights, trans_b, fused, num_tokens, check_bias_address):
        return False
    layout = _weight_layout(weights, trans_b)[0]
    n = weights.shape[1] if trans_b else weights.shape[2]
    plan = _plan(_DTYPES[x.dtype], layout, x.shape[0] if num_tokens is None else num_tokens, weights.shape[0], n,
                 x.shape[-1], _BACKENDS[backend], _CONFIGS[config], x.device.index, True)
    return plan.backend in _FUSED_FAMILIES


def _check_fused_call(x, weights, tokens_per_expert, trans_b, out, backend, config, fused: FusedArgs) -> None:
    """Everything a fused call can get wrong that is visible without reading data: moe_gemm's
    checks, the epilogue's, and out against the fused output's shape."""
    num_tokens, _, num_experts, n = _check_moe_gemm(x, weights, tokens_per_expert, trans_b, None, backend, config)
    _check_fused(x, fused, num_experts, n)
    if out is not None:
        _check_out(out, x, (num_tokens, n // 2 if fused.gated else n))


# Fused calls resolved by their signature, as ops._RESOLVED for the plain call: everything
# _check_fused_call and the resolution read. A value is the kernel's resolution, or None where the
# composite runs (the CPU, another family, a gated N that is not a multiple of 16).
_FUSED_RESOLVED: dict = {}
_MISSING = object()


def _resolved_fused(x, weights, tokens_per_expert, trans_b, out, backend, config,
                    fused: FusedArgs) -> Optional[_Resolved]:
    """The fused kernel's resolution of the call (None: the composite), checking the arguments the
    first time a signature is seen. The bias's address is not in the signature: the caller checks
    its alignment (_bias_aligned)."""
    try:
        key = (x.shape, x.stride(), x.dtype, x.device, weights.shape, weights.stride(), weights.dtype,
               weights.device, tokens_per_expert.shape, tokens_per_expert.dtype, tokens_per_expert.device, trans_b,
               trans_b.__class__, backend, config, fused.activation, fused.gated, fused.alpha, fused.limit,
               _tensor_key(fused.bias), _tensor_key(fused.row_scale), _tensor_key(out))
        r = _FUSED_RESOLVED.get(key, _MISSING)
    except (AttributeError, TypeError):  # not tensors, or unhashable options: the checks name them
        key, r = None, _MISSING
    if r is _MISSING:
        _check_fused_call(x, weights, tokens_per_expert, trans_b, out, backend, config, fused)
        r = None
        if _fused_kernel_takes(x, weights, trans_b, fused, check_bias_address=False):
            resolved = _Resolved(x, weights, tokens_per_expert, trans_b, backend, config, fused.gated, fused=True)
            if resolved.plan.backend in _FUSED_FAMILIES:
                r = resolved
        if key is not None:
            _remember(_FUSED_RESOLVED, key, r)
    return r


def _run_fused(x, weights, tokens_per_expert, trans_b, out, backend, config, fused: FusedArgs,
               r=_MISSING) -> torch.Tensor:
    """The fused call without autograd: the kernel where the call's signature resolves to it
    (_resolved_fused, unless the caller resolved it: r), else the composite."""
    if r is _MISSING:
        r = _resolved_fused(x, weights, tokens_per_expert, trans_b, out, backend, config, fused)
    if r is not None and _bias_aligned(fused.bias):
        return _launch(r, x, weights, tokens_per_expert, out, fused)
    y = _moe_gemm_impl(x, weights, tokens_per_expert, trans_b, None, backend, config)
    y = _apply_epilogue(y, tokens_per_expert, fused)
    if out is None:
        return y
    # Rows no expert owns keep out's values, as in the unfused call.
    owned = _row_experts(tokens_per_expert, x.shape[0], x.device) < weights.shape[0]
    return out.copy_(torch.where(owned[:, None], y, out))


def _moe_gemm_fused_call(x, weights, tokens_per_expert, trans_b, bias, activation, row_scale, gated, alpha, limit,
                         backend, config) -> torch.Tensor:
    """The body of cutlass_moe::moe_gemm_fused and of its launch-only twin."""
    fused = FusedArgs(bias, activation, row_scale, gated, alpha, limit)
    return _run_fused(x, weights, tokens_per_expert, trans_b, None, backend, config, fused)


@torch.library.custom_op("cutlass_moe::moe_gemm_fused", mutates_args=())
def _moe_gemm_fused_op(x: torch.Tensor, weights: torch.Tensor, tokens_per_expert: torch.Tensor, trans_b: bool,
                       bias: Optional[torch.Tensor], activation: str, row_scale: Optional[torch.Tensor], gated: bool,
                       alpha: float, limit: float, backend: str, config: str) -> torch.Tensor:
    # The arguments are checked once per signature (_run_fused), so that none reaches a kernel
    # unchecked, also by a direct torch.ops call or from an exported program.
    return _moe_gemm_fused_call(x, weights, tokens_per_expert, trans_b, bias, activation, row_scale, gated, alpha,
                                limit, backend, config)


@_moe_gemm_fused_op.register_fake
def _moe_gemm_fused_fake(x, weights, tokens_per_expert, trans_b, bias, activation, row_scale, gated, alpha, limit,
                         backend, config):
    n = weights.shape[1] if trans_b else weights.shape[2]
    return x.new_empty(x.shape[0], n // 2 if gated else n)


# What compiled graphs call (ops.define_launch_op); the op records no gradient either way.
_moe_gemm_fused_launch = define_launch_op(
    "moe_gemm_fused_launch", "(Tensor x, Tensor weights, Tensor tokens_per_expert, bool trans_b, Tensor? bias, "
    "str activation, Tensor? row_scale, bool gated, float alpha, float limit, str backend, str config) -> Tensor",
    _moe_gemm_fused_call, _moe_gemm_fused_fake)


def moe_gemm_fused(x, weights, tokens_per_expert, trans_b, out, backend, config, fused: FusedArgs) -> torch.Tensor:
    """moe_gemm / moe_gemm_gated with a fused epilogue. The arguments are checked here
    (_check_fused_call; eager calls without a gradient once per signature, in _run_fused)."""
    scale = fused.row_scale
    if isinstance(scale, torch.Tensor) and (scale.dtype != torch.float32 or not scale.is_contiguous()):
        # Router weights in the activations' dtype (Hugging Face's MoE blocks cast them so) are read as
        # float32, exactly, and a strided view (a column of top-k weights) as a contiguous copy: both
        # casts are differentiable, so drow_scale comes back in the given dtype and layout.
        if scale.dtype == getattr(x, "dtype", None) and scale.dtype in (torch.float16, torch.bfloat16):
            scale = scale.float()
        fused = fused._replace(row_scale=scale.contiguous())
    if torch.compiler.is_compiling():
        _check_fused_call(x, weights, tokens_per_expert, trans_b, out, backend, config, fused)
        resolved = _MISSING
    else:  # eager: the checks and the kernel's resolution once per signature
        resolved = _resolved_fused(x, weights, tokens_per_expert, trans_b, out, backend, config, fused)
    if _records_graph(x, weights, fused.bias, fused.row_scale):
        if out is not None:
            raise RuntimeError("out: a call with out= is not differentiable; drop out= or run under torch.no_grad()")
        y = moe_gemm(x, weights, tokens_per_expert, trans_b=trans_b, backend=backend, config=config)
        return _apply_epilogue(y, tokens_per_expert, fused)
    if out is None and _traced(x, weights):
        op = _moe_gemm_fused_launch if _compiled() else _moe_gemm_fused_op
        return op(x, weights, tokens_per_expert, trans_b, fused.bias, fused.activation, fused.row_scale, fused.gated,
                  fused.alpha, fused.limit, backend, config)
    return _run_fused(x, weights, tokens_per_expert, trans_b, out, backend, config, fused, resolved)


def moe_gemm_gated(
    x: torch.Tensor,
    weights: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    activation: Optional[str] = "silu",
    trans_b: bool = False,
    bias: Optional[torch.Tensor] = None,
    row_scale: Optional[torch.Tensor] = None,
    alpha: float = 1.702,
    limit: float = 7.0,
    out: Optional[torch.Tensor] = None,
    backend: str = "auto",
    config: str = "auto",
) -> torch.Tensor:
    """The fused gated projection of an MoE expert MLP: ``act(x_e @ Wg_e + bg_e) * (x_e @ Wu_e + bu_e)``
    from one GEMM, written as (T, N/2) with no (T, N) intermediate.

    Args:
        x: (T, K) bf16 or fp16, rows sorted by expert, as in :func:`moe_gemm`.
        weights: (E, K, N), or (E, N, K) with ``trans_b=True``, holding gate and up interleaved
            column by column: column 2j of expert e's K x N matrix is the gate's column j, 2j + 1 the
            up projection's. :func:`interleave_gate_up` builds it from separate gate and up weights or
            from a concatenated [gate; up] tensor. N must be even (a multiple of 16 for the fused
            kernel; other even N run the composite path).
        tokens_per_expert: (E,) int32 or int64 counts, as in :func:`moe_gemm`.
        activation: ``"silu"`` (SwiGLU, the default), ``"gelu"`` / ``"gelu_tanh"`` (GeGLU),
            ``"relu"`` (ReGLU), None (bilinear, ``gate * up``), or ``"swiglu_oai"`` (gpt-oss):
            ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``.
        bias: optional (E, N) of x's dtype, interleaved like the weights (gate's bias at even
            columns), added before the activation: gpt-oss's biases on both projections.
        row_scale: optional (T,) float32 factors multiplying each output row (or in x's dtype,
            read as float32).
        alpha, limit: the ``"swiglu_oai"`` constants (gpt-oss: 1.702 and 7.0).
        out: optional (T, N/2) tensor of x's dtype to write into (not differentiable).
        backend, config: as in :func:`moe_gemm`.

    Returns:
        (T, N/2) of x's dtype; rows no expert owns are zeros (in a new output).

    Under ``torch.autocast`` (and without ``out``), x, weights and bias are cast to the autocast
    dtype first, as in :func:`moe_gemm`.

    Where it runs: the MoE kernels' epilogue (``moe``, ``sm80_moe``) when no gradient is recorded; otherwise the
    plain GEMM, then the activation as torch operations, differentiable in x, weights, bias and
    row_scale (see ``cutlass_moe.fused``).

    Raises:
        TypeError / ValueError naming the argument: e.g. separate gate and up tensors (use
        :func:`interleave_gate_up`), an odd N, an unknown activation, a bias or row_scale of the
        wrong shape.

    Example::

        >>> import torch, cutlass_moe
        >>> x = torch.randn(96, 64, dtype=torch.bfloat16)
        >>> gate, up = (torch.randn(2, 3, 64, 32) / 8).to(torch.bfloat16).unbind(0)
        >>> w = cutlass_moe.interleave_gate_up(gate, up)         # (3, 64, 64)
        >>> counts = torch.tensor([32, 0, 64])
        >>> h = cutlass_moe.moe_gemm_gated(x, w, counts)          # silu(x @ gate) * (x @ up)
        >>> ref = cutlass_moe.moe_gemm_reference(x, w, counts, activation="silu", gated=True)
        >>> h.shape, bool(torch.allclose(h.float(), ref, rtol=2e-2, atol=1e-1))
        (torch.Size([96, 32]), True)
    """
    if isinstance(weights, (tuple, list)):
        raise TypeError("weights: expected one tensor with gate and up interleaved column by column; "
                        "build it with cutlass_moe.interleave_gate_up(gate, up)")
    if out is None:
        x, weights, bias = _autocast(x, weights, bias)
    fused = FusedArgs(bias, activation or "none", row_scale, True, float(alpha), float(limit))
    return moe_gemm_fused(x, weights, tokens_per_expert, trans_b, out, backend, config, fused)


def interleave_gate_up(gate: torch.Tensor, up: Optional[torch.Tensor] = None, *, dim: int = -1) -> torch.Tensor:
    """The fused gated layout: gate and up interleaved along ``dim``, gate's slice j at 2j and up's
    at 2j + 1 (a new contiguous tensor).

    ``dim`` is the output-feature dimension: -1 for (E, K, I) weights and for (E, I) biases, 1 for
    (E, I, K) weights (``trans_b=True``, the nn.Linear layout). With ``up=None``, ``gate`` is the
    concatenation [gate; up] along ``dim`` (e.g. Hugging Face's fused ``gate_up_proj``).
    """
    _check_tensor("gate", gate, gate.dim())
    if up is None:
        if gate.shape[dim] % 2:
            raise ValueError(f"gate: a concatenated [gate; up] needs an even size along dim {dim}, "
                             f"got shape {tuple(gate.shape)}")
        gate, up = gate.chunk(2, dim)
    else:
        _check_tensor("up", up, gate.dim())
        if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
            raise ValueError(f"up: expected gate's shape, dtype and device {tuple(gate.shape)}, {gate.dtype}, "
                             f"{gate.device}; got {tuple(up.shape)}, {up.dtype}, {up.device}")
    d = dim % gate.dim()
    return torch.stack((gate, up), dim=d + 1).flatten(d, d + 1)
