"""The public op: :func:`moe_gemm`, its argument checks, and the call into the compiled core."""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from . import _C
from .reference import moe_gemm_reference

# Enum values and limits of the C++ API (include/cutlass_moe/cutlass_moe.h), read from the build.
_DTYPES = {torch.float16: _C.dtypes()["fp16"], torch.bfloat16: _C.dtypes()["bf16"]}
_COUNT_TYPES = {torch.int32: _C.index_types()["int32"], torch.int64: _C.index_types()["int64"]}
_LAYOUTS = dict(_C.layouts())  # "kn": (E, K, N) storage, N contiguous; "nk": (E, N, K), K contiguous
_CONFIGS = dict(_C.config_names())  # name -> value, "auto" -> -1
_BACKENDS = dict(_C.backend_names())  # "auto", "grouped", "moe", ... -> value
_BACKEND_NAMES = {value: name for name, value in _BACKENDS.items()}
_CONFIG_NAMES = {value: name for name, value in _CONFIGS.items()}
MAX_TOKENS = _C.MAX_TOKENS  # rows of x and out the kernels take (2^31 - 1024)


def _check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")


def _weight_layout(weights: torch.Tensor, trans_b: bool) -> Tuple[int, int]:
    """(layout, leading dimension) of the per-expert K x N matrix, read off the strides.

    Any view whose innermost dimension is contiguous is taken as it is, without a copy. (K and N
    are multiples of 8 by then, so a size-1 dimension cannot make the strides ambiguous.)
    """
    _, s1, s2 = weights.stride()
    # The tensor is (E, K, N) for trans_b=False and (E, N, K) for trans_b=True.
    if s2 == 1:
        return _LAYOUTS["nk" if trans_b else "kn"], s1
    if s1 == 1:
        return _LAYOUTS["kn" if trans_b else "nk"], s2
    raise ValueError(
        f"weights: one of the last two dimensions must be contiguous (stride 1), got strides "
        f"{tuple(weights.stride())} for shape {tuple(weights.shape)}")


# One plan per problem shape: the kernel instance is resolved once, not on every call.
_plan = functools.lru_cache(maxsize=4096)(_C.plan)


def _new_workspace(nbytes: int, device: torch.device) -> torch.Tensor:
    """The workspace of one call (the grouped families' per-expert arrays and CUTLASS's own); its
    contents need not be initialized. benchmarks/sanitize_sweep.py swaps in zeros for initcheck."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def select_config(num_tokens: int, num_experts: int, n: int, k: int, backend: str = "auto",
                  device: Optional[int] = None) -> Tuple[str, str]:
    """The (backend, config) that ``backend=backend, config="auto"`` takes for these sizes on
    ``device`` (default: the current CUDA device, or an sm90 one where there is none): a choice
    from the architecture, T/E, N and K alone, never the counts."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(_BACKENDS)}, got {backend!r}")
    if device is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else -1
    b, c = _C.select(num_tokens, num_experts, n, k, _BACKENDS[backend], device)
    return _BACKEND_NAMES[b], _CONFIG_NAMES[c]


def moe_gemm(
    x: torch.Tensor,
    weights: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    trans_b: bool = False,
    out: Optional[torch.Tensor] = None,
    backend: str = "auto",
    config: str = "auto",
) -> torch.Tensor:
    """Grouped GEMM over experts: ``out[rows_e] = x[rows_e] @ W_e`` with fp32 accumulation.

    Args:
        x: (T, K) bf16 or fp16, rows sorted by expert (expert 0's rows first). Rows may be
            strided; the last dimension must be contiguous.
        weights: (E, K, N), or (E, N, K) with ``trans_b=True`` (the nn.Linear layout, computing
            ``x_e @ weights[e].T``). Any view whose innermost dimension is contiguous is used
            without a copy, e.g. an (E, N, K) tensor's ``.transpose(1, 2)`` with ``trans_b=False``.
        tokens_per_expert: (E,) int32 or int64, on x's device or on the CPU. On the device it is
            never read by the host (no synchronization, CUDA-graph safe).
        trans_b: whether ``weights`` is (E, N, K).
        out: optional (T, N) tensor of x's dtype to write into; its last dimension must be
            contiguous.
        backend: kernel family. ``"moe"`` (sm90): our MoE kernel, which takes base pointers and
            the counts and finds each tile's expert on the device (one launch, no workspace).
            ``"grouped"`` (sm90): CUTLASS's ptr-array grouped GEMM, after a small kernel that
            writes per-expert pointers and shapes. ``"sm80_moe"``, ``"sm80_grouped"``: the same two
            ideas on CUTLASS 2.x (Ampere/Ada; also built for Hopper). ``"auto"`` picks per device
            and problem (from the arch, T/E, N, K).
        config: ``"auto"`` (heuristic from T/E, N, K) or a kernel config name from
            :func:`cutlass_moe.built_configs` for the chosen backend.

    Returns:
        (T, N) tensor of x's dtype. Expert e owns rows ``[start_e, start_e + count_e)`` where the
        counts are clamped to [0, T] and the running start is capped at T (so counts summing past T
        are cut off at T, on the device). Rows past the last owned row are left unwritten: a new
        output holds whatever ``torch.empty`` gave there.

    Raises:
        TypeError / ValueError naming the argument, before any launch. Counts on the CPU are
        checked on the host: negative counts, or counts summing past T, raise ValueError.

    Example::

        >>> import torch, cutlass_moe
        >>> x = torch.randn(96, 128, dtype=torch.bfloat16)
        >>> w = torch.randn(3, 128, 64, dtype=torch.bfloat16)
        >>> counts = torch.tensor([32, 0, 64])
        >>> y = cutlass_moe.moe_gemm(x, w, counts)
        >>> ref = cutlass_moe.moe_gemm_reference(x, w, counts)
        >>> bool(torch.allclose(y.float(), ref, rtol=2e-2, atol=1e-1))
        True
    """
    _check_tensor("x", x, 2)
    _check_tensor("weights", weights, 3)
    _check_tensor("tokens_per_expert", tokens_per_expert, 1)
    if x.dtype not in _DTYPES:
        raise TypeError(f"x: expected dtype torch.bfloat16 or torch.float16, got {x.dtype}")
    if weights.dtype != x.dtype:
        raise TypeError(f"weights: dtype {weights.dtype} does not match x's {x.dtype}")
    if tokens_per_expert.dtype not in _COUNT_TYPES:
        raise TypeError(f"tokens_per_expert: expected dtype torch.int32 or torch.int64, got {tokens_per_expert.dtype}")
    if not isinstance(trans_b, bool):
        raise TypeError(f"trans_b: expected a bool, got {type(trans_b).__name__}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(_BACKENDS)}, got {backend!r}")
    if config not in _CONFIGS:
        raise ValueError(f"config: expected 'auto' or one of {sorted(n for n in _CONFIGS if n != 'auto')}, got {config!r}")

    num_tokens, k = x.shape
    num_experts = weights.shape[0]
    wk, n = (weights.shape[2], weights.shape[1]) if trans_b else (weights.shape[1], weights.shape[2])
    if wk != k:
        dims = "(E, N, K)" if trans_b else "(E, K, N)"
        raise ValueError(f"weights: expected shape {dims} with K = {k} (x is {tuple(x.shape)}), got {tuple(weights.shape)}")
    if tokens_per_expert.shape[0] != num_experts:
        raise ValueError(f"tokens_per_expert: expected {num_experts} entries (one per expert), got {tokens_per_expert.shape[0]}")
    if weights.device != x.device:
        raise ValueError(f"weights: on {weights.device}, expected x's device {x.device}")
    if tokens_per_expert.device != x.device and tokens_per_expert.device.type != "cpu":
        raise ValueError(f"tokens_per_expert: on {tokens_per_expert.device}, expected x's device {x.device} or the CPU")
    if out is not None:
        _check_tensor("out", out, 2)
        if out.dtype != x.dtype:
            raise TypeError(f"out: dtype {out.dtype} does not match x's {x.dtype}")
        if tuple(out.shape) != (num_tokens, n):
            raise ValueError(f"out: expected shape {(num_tokens, n)}, got {tuple(out.shape)}")
        if out.device != x.device:
            raise ValueError(f"out: on {out.device}, expected x's device {x.device}")
    if tokens_per_expert.device.type == "cpu":
        counts = tokens_per_expert
        if bool((counts < 0).any()):
            raise ValueError(f"tokens_per_expert: counts must be >= 0, got {counts.tolist()}")
        total = int(counts.sum())
        if total > num_tokens:
            raise ValueError(f"tokens_per_expert: counts sum to {total}, more than the {num_tokens} rows of x")

    if x.device.type == "cpu":
        if out is None:
            out = torch.empty(num_tokens, n, dtype=x.dtype)
        return moe_gemm_reference(x, weights, tokens_per_expert, trans_b=trans_b, out=out)
    if x.device.type != "cuda":
        raise ValueError(f"x: expected a CUDA or CPU tensor, got device {x.device}")
    return _moe_gemm_cuda(x, weights, tokens_per_expert, trans_b, out, backend, config, num_tokens, num_experts, n, k)


def _moe_gemm_cuda(x, weights, tokens_per_expert, trans_b, out, backend, config, num_tokens, num_experts, n, k):
    # Python derives the layout and the strides; the C++ core checks them (sizes, 16-byte multiples,
    # pointers) and raises ValueError naming the argument.
    if k > 0 and x.stride(1) != 1:
        raise ValueError(f"x: the last dimension must be contiguous, got strides {tuple(x.stride())}")
    if out is not None and n > 0 and out.stride(1) != 1:
        raise ValueError(f"out: the last dimension must be contiguous, got strides {tuple(out.stride())}")
    if k > 0 and num_experts > 0 and n > 0:
        layout, ldw = _weight_layout(weights, trans_b)
    else:
        layout, ldw = _LAYOUTS["nk" if trans_b else "kn"], n
    device = x.device.index
    plan = _plan(_DTYPES[x.dtype], layout, num_tokens, num_experts, n, k, _BACKENDS[backend], _CONFIGS[config], device)
    if out is None:
        out = torch.empty(num_tokens, n, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or num_experts == 0 or n == 0:
        return out
    counts = tokens_per_expert
    if counts.device != x.device:
        counts = counts.to(x.device, non_blocking=True)
    ws_bytes = plan.workspace_bytes
    workspace = _new_workspace(ws_bytes, x.device) if ws_bytes else None
    args = (plan, _COUNT_TYPES[counts.dtype],
            x.data_ptr(), x.stride(0) if num_tokens > 1 else k,
            weights.data_ptr(), ldw, weights.stride(0) if num_experts > 1 else 0,
            out.data_ptr(), out.stride(0) if num_tokens > 1 else n,
            counts.data_ptr(), workspace.data_ptr() if ws_bytes else 0, ws_bytes,
            torch.cuda.current_stream(device).cuda_stream)
    if device == torch.cuda.current_device():
        _C.run(*args)
    else:  # the core launches on the current device
        with torch.cuda.device(device):
            _C.run(*args)
    return out
