"""Plain reference implementation: a loop over experts in float32.

It defines the semantics every kernel must match, including how bad counts are clamped
(see :func:`expert_row_ranges`). It is also the CPU path of :func:`cutlass_moe.moe_gemm`.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch


def expert_row_ranges(tokens_per_expert, num_tokens: int) -> List[Tuple[int, int]]:
    """Rows ``[start, stop)`` of x and out that each expert owns, after clamping.

    ``count = clamp(tokens_per_expert[e], 0, T)``; ``start`` is the running sum of the clamped
    counts, capped at T; ``stop = min(start + count, T)``. The kernels compute the same on the
    device, so no count vector can make them touch memory outside their tensors.
    """
    counts = torch.as_tensor(tokens_per_expert).detach().to("cpu", torch.int64).clamp(0, num_tokens)
    ranges = []
    start = 0
    for count in counts.tolist():
        stop = min(start + count, num_tokens)
        ranges.append((start, stop))
        start = stop
    return ranges


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs (gradcheck on the CPU path)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def weight_matrix(weights: torch.Tensor, expert: int, trans_b: bool) -> torch.Tensor:
    """Expert ``expert``'s K x N matrix (a view)."""
    return weights[expert].t() if trans_b else weights[expert]


# The fused epilogue's activations (moe_gemm's `activation`), on float tensors.
ACTIVATIONS = {
    "none": lambda v: v,
    "relu": torch.relu,
    "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh"),
    "gelu": torch.nn.functional.gelu,
    "silu": torch.nn.functional.silu,
}
GATED_ACTIVATIONS = (*ACTIVATIONS, "swiglu_oai")  # moe_gemm_gated's: act(gate) * up, or gpt-oss's form


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: Optional[str] = "silu",
                     alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """``act(gate) * up``; ``"swiglu_oai"`` is gpt-oss's form, with gate clamped above at limit and
    up clamped to [-limit, limit]: ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    if activation == "swiglu_oai":
        g = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * g * torch.sigmoid(alpha * g)
    return ACTIVATIONS[activation or "none"](gate) * up


def moe_gemm_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    tokens_per_expert,
    *,
    trans_b: bool = False,
    out: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    row_scale: Optional[torch.Tensor] = None,
    gated: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """``out[rows_e] = row_scale[rows_e] * act(x[rows_e] @ W_e + bias[e])`` for every expert, in
    float32 (float64 for float64 x); without bias, activation and row_scale, ``x[rows_e] @ W_e``.
    ``gated``: columns 2j and 2j + 1 of ``x @ W_e + bias[e]`` are gate and up, and output column j
    is ``gated_activation(gate, up, activation, alpha, limit)`` (N/2 columns).

    Returns a float32 (T, N) tensor unless ``out`` is given, in which case the result is cast to
    out's dtype and written into it. Rows no expert owns are zero in a new result and left
    untouched in ``out``. Differentiable (plain torch operations).
    """
    num_tokens = x.shape[0]
    n = weights.shape[1] if trans_b else weights.shape[2]
    acc = _compute_dtype(x)
    act = ACTIVATIONS[activation or "none"] if not gated else None
    out_cols = n // 2 if gated else n
    result = out if out is not None else torch.zeros(num_tokens, out_cols, dtype=acc, device=x.device)
    for expert, (start, stop) in enumerate(expert_row_ranges(tokens_per_expert, num_tokens)):
        if stop > start:
            w = weight_matrix(weights, expert, trans_b).to(acc)
            rows = x[start:stop].to(acc) @ w
            if bias is not None:
                rows = rows + bias[expert].to(acc)
            if gated:
                rows = gated_activation(rows[:, 0::2], rows[:, 1::2], activation, alpha, limit)
            else:
                rows = act(rows)
            if row_scale is not None:
                rows = rows * row_scale[start:stop, None].to(acc)
            result[start:stop] = rows.to(result.dtype)
    return result


def moe_gemm_wgrad_reference(x: torch.Tensor, grad_out: torch.Tensor, tokens_per_expert, *,
                             trans_b: bool = False) -> torch.Tensor:
    """``dW[e] = x[rows_e]^T @ grad_out[rows_e]`` for every expert, in float32 (float64 for
    float64 x): (E, K, N), or (E, N, K) with ``trans_b``. Experts with no rows get zeros."""
    num_tokens, k = x.shape
    n = grad_out.shape[1]
    acc = _compute_dtype(x)
    ranges = expert_row_ranges(tokens_per_expert, num_tokens)
    result = torch.zeros(len(ranges), k, n, dtype=acc, device=x.device)
    for expert, (start, stop) in enumerate(ranges):
        if stop > start:
            result[expert] = x[start:stop].to(acc).t() @ grad_out[start:stop].to(acc)
    return result.transpose(1, 2) if trans_b else result


# Per-element relative tolerance of a result against the float32 reference, by output dtype. The
# products of bf16/fp16 inputs are exact in float32 and every family accumulates in float32, so a
# correct result differs from the reference by the rounding of the output (at most 2^-8 of |ref|
# for bf16, 2^-11 for fp16) plus float32 summation-order noise (~1e-6 of the row's scale).
_RTOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2}
_TINY = 1e-30
_CHUNK_ELEMENTS = 1 << 24  # float32 temporaries per chunk of rows (64 MiB each)


def per_expert_errors(
    y: torch.Tensor,
    x: torch.Tensor,
    weights: torch.Tensor,
    tokens_per_expert,
    *,
    trans_b: bool = False,
    rtol: Optional[float] = None,
) -> Dict[str, object]:
    """How far ``y`` is from the float32 reference ``x[rows_e].float() @ W_e.float()``, expert by
    expert, over the rows each expert owns (:func:`expert_row_ranges`; other rows are ignored).

    Computed on the tensors' device, one expert (and at most ``2**24`` float32 elements of
    temporaries) at a time, with one host synchronization at the end. Returns a dict:

    - ``worst_rel``: max over experts of ``||y_e - ref_e|| / max(||ref_e||, tiny)`` (Frobenius);
    - ``worst_expert``: the expert it comes from (-1 where no expert owns rows);
    - ``max_abs``: max ``|y - ref|`` over all owned rows; ``max_abs_expert``, ``max_abs_row``;
    - ``finite``: whether every owned row of ``y`` is finite; ``nonfinite_expert`` (first expert
      with a non-finite value, -1 if none);
    - ``elem_ratio``: max over owned elements of ``|y - ref| / (rtol * (|ref| + rms(ref_e)))``,
      the fraction of the per-element tolerance used (<= 1 passes; see
      :func:`assert_close_per_expert`), with ``rms(ref_e)`` the root mean square of expert e's
      reference; ``elem_expert``, ``elem_row``: where it is largest; ``rtol``: the rtol used
      (default by y's dtype: 2e-2 bf16, 1e-2 fp16 and others).

    A norm over all rows (or one expert's rows) hides a wholly wrong row: one zeroed row among m
    rows moves the norm by only ``sqrt(1/m)`` (0.6% at m = 24576). ``elem_ratio`` does not.
    """
    if rtol is None:
        rtol = _RTOL.get(y.dtype, 1e-2)
    num_tokens, k = x.shape
    n = y.shape[1]
    step = max(1, _CHUNK_ELEMENTS // max(n, k, 1))  # rows per chunk
    labels, stats = [], []
    for expert, (start, stop) in enumerate(expert_row_ranges(tokens_per_expert, num_tokens)):
        if stop <= start or n == 0:
            continue
        w = weight_matrix(weights, expert, trans_b).float()
        chunks = [(first, min(stop, first + step)) for first in range(start, stop, step)]
        refs = {}
        if len(chunks) == 1:  # the usual case: the reference is computed once
            refs[chunks[0]] = x[start:stop].float() @ w
            ref_sq = refs[chunks[0]].pow(2).sum(dtype=torch.float64)
        else:  # an expert too large for one chunk: a first pass for its scale
            ref_sq = sum((x[a:b].float() @ w).pow(2).sum(dtype=torch.float64) for a, b in chunks)
        abs_tol = rtol * (ref_sq / ((stop - start) * n)).sqrt().float()  # rtol * rms(ref_e), on the device
        for first, last in chunks:
            ref = refs.pop((first, last), None)
            if ref is None:
                ref = x[first:last].float() @ w
            got = y[first:last].float()
            diff = (got - ref).abs()
            abs_max, abs_at = diff.flatten().max(0)
            used = diff / (rtol * ref.abs() + abs_tol).clamp_min(_TINY)  # <= 1 passes
            used_max, used_at = used.flatten().max(0)
            stats.append(torch.stack([
                diff.pow(2).sum(dtype=torch.float64), ref.pow(2).sum(dtype=torch.float64),
                abs_max.double(), (abs_at // n + first).double(),
                used_max.double(), (used_at // n + first).double(),
                (~torch.isfinite(got)).sum().double(),
            ]))
            labels.append(expert)
    result = {"worst_rel": 0.0, "worst_expert": -1, "max_abs": 0.0, "max_abs_expert": -1, "max_abs_row": -1,
              "finite": True, "nonfinite_expert": -1, "elem_ratio": 0.0, "elem_expert": -1, "elem_row": -1,
              "rtol": rtol}
    if not stats:
        return result
    rows = torch.stack(stats).cpu().tolist()  # the one synchronization

    def worse(new, old):  # NaN counts as the worst
        return math.isnan(new) or (not math.isnan(old) and new > old)

    # Fold the chunks into experts: sums add up, maxima keep their row.
    per_expert: Dict[int, List[float]] = {}
    for expert, row in zip(labels, rows):
        acc = per_expert.setdefault(expert, [0.0, 0.0, -math.inf, -1, -math.inf, -1, 0.0])
        acc[0] += row[0]
        acc[1] += row[1]
        if worse(row[2], acc[2]):
            acc[2], acc[3] = row[2], row[3]
        if worse(row[4], acc[4]):
            acc[4], acc[5] = row[4], row[5]
        acc[6] += row[6]
    for i, (expert, (err_sq, ref_sq, amax, arow, used, urow, bad)) in enumerate(per_expert.items()):
        rel = math.sqrt(err_sq) / max(math.sqrt(ref_sq), _TINY) if not math.isnan(err_sq) else math.nan
        if i == 0 or worse(rel, result["worst_rel"]):
            result["worst_rel"], result["worst_expert"] = rel, expert
        if i == 0 or worse(amax, result["max_abs"]):
            result["max_abs"], result["max_abs_expert"], result["max_abs_row"] = amax, expert, int(arow)
        if i == 0 or worse(used, result["elem_ratio"]):
            result["elem_ratio"], result["elem_expert"], result["elem_row"] = used, expert, int(urow)
        if bad and result["finite"]:
            result["finite"], result["nonfinite_expert"] = False, expert
    return result


def assert_close_per_expert(
    y: torch.Tensor,
    x: torch.Tensor,
    weights: torch.Tensor,
    counts,
    *,
    trans_b: bool = False,
    rel: float = 1e-2,
    abs_tol: Optional[float] = None,
    rtol: Optional[float] = None,
) -> Dict[str, object]:
    """Raise AssertionError, naming the expert and the numbers, unless ``y`` matches the float32
    reference on every row an expert owns (rows no expert owns are not looked at). Returns
    :func:`per_expert_errors`'s dict.

    Three checks, each per expert:

    - every owned element is finite;
    - ``||y_e - ref_e|| / ||ref_e|| <= rel`` for every expert (default 1e-2; bf16 output rounding
      alone gives about 2e-3);
    - per element, with ``abs_tol=None`` (the default):
      ``|y - ref| <= rtol * (|ref| + rms(ref_e))``, rtol = 2e-2 for bf16 and 1e-2 for fp16
      outputs. The relative term covers the output rounding (2^-8 of |ref| for bf16, 5x margin;
      2^-11 for fp16, 20x). The absolute term, ``rtol * rms(ref_e)``, covers elements near zero,
      where only float32 summation-order noise (~1e-6 of the scale) remains; it scales with the
      data like the reference does: with randn x and W, ``rms(ref_e) ~ sqrt(K)``, and with the
      benchmark's ``W * K**-0.5``, ~1. A wholly wrong row (zeros, another expert's row, another
      row's result) breaks this bound on almost every element, however many rows there are; so
      does a missing K block (error ~ ``rms * sqrt(block / K)``).
      With ``abs_tol`` given instead: ``max |y - ref| <= abs_tol``.
    """
    errors = per_expert_errors(y, x, weights, counts, trans_b=trans_b, rtol=rtol)
    where = (f"worst expert {errors['worst_expert']} (relative error {errors['worst_rel']:.3e}); "
             f"max |y - ref| = {errors['max_abs']:.3e} in expert {errors['max_abs_expert']}, "
             f"row {errors['max_abs_row']}")
    if not errors["finite"]:
        raise AssertionError(f"expert {errors['nonfinite_expert']} has non-finite values in its rows "
                             f"(a row it owns was not written?); {where}")
    if not errors["worst_rel"] <= rel:
        raise AssertionError(f"relative error {errors['worst_rel']:.3e} > {rel:g} in expert "
                             f"{errors['worst_expert']}; {where}")
    if abs_tol is not None:
        if not errors["max_abs"] <= abs_tol:
            raise AssertionError(f"max |y - ref| = {errors['max_abs']:.3e} > {abs_tol:g} in expert "
                                 f"{errors['max_abs_expert']}, row {errors['max_abs_row']}; {where}")
    elif not errors["elem_ratio"] <= 1.0:
        raise AssertionError(
            f"expert {errors['elem_expert']}, row {errors['elem_row']}: |y - ref| is {errors['elem_ratio']:.3g} x "
            f"rtol * (|ref| + rms(ref_e)) (rtol {errors['rtol']:g}); {where}")
    return errors
