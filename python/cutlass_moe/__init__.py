"""cutlass_moe: Mixture-of-Experts grouped GEMM for PyTorch on CUTLASS.

    y = cutlass_moe.moe_gemm(x, weights, tokens_per_expert)         # differentiable in x and weights
    dw = cutlass_moe.moe_gemm_wgrad(x, dy, tokens_per_expert)       # the weight gradient on its own
    h = cutlass_moe.moe_gemm_gated(x, gate_up, tokens_per_expert)   # silu(x @ Wg) * (x @ Wu), fused

See :func:`moe_gemm` for shapes and semantics, ``python -m cutlass_moe.bench`` for the benchmark.
"""
from __future__ import annotations

from typing import Dict, List

from . import _C
from .compat import gmm, grouped_mm
from .fused import interleave_gate_up, moe_gemm_gated
from .grouped_linear import GroupedLinear, GroupedMLP, grouped_linear, grouped_mlp
from .ops import MAX_TOKENS, aligned_config, moe_gemm, moe_gemm_wgrad, select_config
from .reference import expert_row_ranges, moe_gemm_reference, moe_gemm_wgrad_reference
from .tuning import tune, tuning_file

__version__ = "0.1.0"

__all__ = ["moe_gemm", "moe_gemm_wgrad", "moe_gemm_gated", "interleave_gate_up", "grouped_linear", "grouped_mlp",
           "GroupedLinear", "GroupedMLP", "gmm", "grouped_mm", "moe_gemm_reference", "moe_gemm_wgrad_reference",
           "expert_row_ranges", "select_config", "aligned_config", "tune", "tuning_file", "built_configs", "build_info", "MAX_TOKENS"]


def built_configs() -> List[str]:
    """Kernel instances this build holds, as ``arch:family:dtype:layout:config`` strings."""
    return list(_C.built_instances())


def build_info() -> Dict[str, object]:
    """What the compiled core was built with: versions, target archs (CUTLASS_MOE_ARCHS), the compute
    capabilities the sm80 families have machine code for, and the kernel instances."""
    return {"version": __version__, "summary": _C.build_info(), "instances": built_configs(),
            "archs": list(_C.target_archs()), "sm80_family_ccs": list(_C.sm80_family_ccs())}
