"""Drop-ins for the two grouped-GEMM conventions users already call, on cutlass_moe's kernels.

- :func:`gmm`: tgale96/grouped_gemm's ``ops.gmm`` (MegaBlocks, Megatron): replace
  ``from grouped_gemm import ops; ops.gmm(a, b, batch_sizes, trans_b)`` by
  ``cutlass_moe.gmm(a, b, batch_sizes, trans_b)``.
- :func:`grouped_mm`: ``torch._grouped_mm``'s MoE cases (torchtitan, Hugging Face): 2D x 3D (the
  forward) and 2D x 2D (the weight gradient) with ``offs``. Every other case is passed through
  to ``torch._grouped_mm`` unchanged.

Both are differentiable (through ``torch.ops.cutlass_moe.*``).
"""
from __future__ import annotations

from typing import Optional

import torch

from .ops import _any_autocast, moe_gemm, moe_gemm_wgrad


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """grouped_gemm's ``ops.gmm``: ``a`` (T, K) sorted by group, ``b`` (E, K, N) or, with
    ``trans_b``, (E, N, K); ``batch_sizes`` (E,) int64 on the CPU (or int32/int64 on a's GPU: no
    host synchronization then). Returns (T, N): :func:`cutlass_moe.moe_gemm` (which also follows
    ``torch.autocast``, where grouped_gemm needs bf16 operands)."""
    return moe_gemm(a, b, batch_sizes, trans_b=trans_b)


def _counts_from_offsets(offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm's cumulative end offsets -> rows per group, on offs' device (no sync)."""
    if not isinstance(offs, torch.Tensor) or offs.dim() != 1:
        raise ValueError(f"offs: expected a 1-D tensor of cumulative end offsets, got {offs!r:.80}")
    if offs.dtype != torch.int32:
        raise TypeError(f"offs: expected dtype torch.int32 (torch._grouped_mm's), got {offs.dtype}")
    return torch.diff(offs, prepend=offs.new_zeros(1))


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch._grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)``.

    Taken by cutlass_moe's kernels:
      - 2D x 3D: ``mat_a`` (T, K), ``mat_b`` (E, K, N) (any view with a contiguous inner
        dimension, e.g. ``w.transpose(-2, -1)`` of an (E, N, K) tensor), ``offs`` (E,) int32
        cumulative row ends: returns (T, N) in mat_a's dtype;
      - 2D x 2D: ``mat_a`` (K, T) with T contiguous (the ``x.t()`` of a row-major x), ``mat_b``
        (T, N), ``offs`` over T: returns (E, K, N), in mat_a's dtype or ``out_dtype=torch.float32``.
    Rows past ``offs[-1]`` are zeros in the 2D x 3D result and add nothing in 2D x 2D.
    Everything else (3D operands, no ``offs``, a ``bias``, other layouts or dtypes) goes to
    ``torch._grouped_mm`` as it is. Like ``torch._grouped_mm``, nothing is cast under
    ``torch.autocast``.
    """
    ours = (offs is not None and bias is None and mat_a.dim() == 2 and isinstance(mat_b, torch.Tensor)
            and mat_a.dtype in (torch.bfloat16, torch.float16) and mat_b.dtype == mat_a.dtype
            and mat_a.device.type == "cuda")
    if ours and mat_b.dim() == 3 and out_dtype in (None, mat_a.dtype) and mat_a.stride(-1) == 1:
        if _any_autocast():  # torch._grouped_mm has no autocast rule: its operands keep their dtype
            with torch.autocast(mat_a.device.type, enabled=False):
                return moe_gemm(mat_a, mat_b, _counts_from_offsets(offs))
        return moe_gemm(mat_a, mat_b, _counts_from_offsets(offs))
    if (ours and mat_b.dim() == 2 and out_dtype in (None, mat_a.dtype, torch.float32) and mat_a.stride(0) == 1
            and mat_b.stride(-1) == 1):
        return moe_gemm_wgrad(mat_a.t(), mat_b, _counts_from_offsets(offs), out_dtype=out_dtype)
    return torch._grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
