"""Plain reference implementation: a loop over experts in float32.

It defines the semantics every kernel must match, including how bad counts are clamped
(see :func:`expert_row_ranges`). It is also the CPU path of :func:`cutlass_moe.moe_gemm`.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

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


def weight_matrix(weights: torch.Tensor, expert: int, trans_b: bool) -> torch.Tensor:
    """Expert ``expert``'s K x N matrix (a view)."""
    return weights[expert].t() if trans_b else weights[expert]


def moe_gemm_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    tokens_per_expert,
    *,
    trans_b: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``out[rows_e] = x[rows_e] @ W_e`` for every expert, in float32.

    Returns a float32 (T, N) tensor unless ``out`` is given, in which case the result is cast to
    out's dtype and written into it. Rows no expert owns are zero in a new result and left
    untouched in ``out``.
    """
    num_tokens = x.shape[0]
    n = weights.shape[1] if trans_b else weights.shape[2]
    result = out if out is not None else torch.zeros(num_tokens, n, dtype=torch.float32, device=x.device)
    for expert, (start, stop) in enumerate(expert_row_ranges(tokens_per_expert, num_tokens)):
        if stop > start:
            w = weight_matrix(weights, expert, trans_b).float()
            result[start:stop] = (x[start:stop].float() @ w).to(result.dtype)
    return result
