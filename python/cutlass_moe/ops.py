"""The public ops: :func:`moe_gemm` and its weight gradient :func:`moe_gemm_wgrad`, their argument
checks, their ``torch.library`` registrations (fake implementations and autograd, so that autograd
and ``torch.compile`` see them), and the calls into the compiled core.

Eager calls that need no autograd graph (``torch.no_grad()``, inputs without ``requires_grad``)
call the core directly, skipping the dispatcher; calls that record a graph, and everything under
``torch.compile``, go through ``torch.ops.cutlass_moe.*``.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from . import _C, tuning
from .reference import moe_gemm_reference, moe_gemm_wgrad_reference

# Enum values and limits of the C++ API (include/cutlass_moe/cutlass_moe.h), read from the build.
_DTYPES = {torch.float16: _C.dtypes()["fp16"], torch.bfloat16: _C.dtypes()["bf16"]}
_FP32 = _C.dtypes()["fp32"]
_COUNT_TYPES = {torch.int32: _C.index_types()["int32"], torch.int64: _C.index_types()["int64"]}
_LAYOUTS = dict(_C.layouts())  # "kn": (E, K, N) storage, N contiguous; "nk": (E, N, K), K contiguous
_CONFIGS = dict(_C.config_names())  # name -> value, "auto" -> -1
_BACKENDS = dict(_C.backend_names())  # "auto", "grouped", "moe", ... -> value
_BACKEND_NAMES = {value: name for name, value in _BACKENDS.items()}
_CONFIG_NAMES = {value: name for name, value in _CONFIGS.items()}
_ACTIVATION_IDS = dict(_C.activations())  # "none", "relu", "gelu_tanh", "gelu", "silu", "swiglu_oai" -> value
MAX_TOKENS = _C.MAX_TOKENS  # rows of x and out the kernels take (2^31 - 1024)
# The CPU path is the float32 reference: it also takes float32 and float64 (torch.autograd.gradcheck).
_CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# One C call that says whether any autocast is on (torch's private helper; where a torch lacks it,
# always ask the device-typed query).
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _autocast(*tensors):
    """Under torch.autocast for the first tensor's device type, the floating tensors in the autocast
    dtype (as nn.Linear's matmul gets them; the casts are differentiable, so fp32 parameters get fp32
    gradients); otherwise the tensors unchanged. None and non-tensors pass through. Without autocast
    it costs one C call (the hot paths' case)."""
    if not _any_autocast():
        return tensors
    first = tensors[0]
    if not isinstance(first, torch.Tensor) or not torch.is_autocast_enabled(first.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(first.device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors)


def _check_not_dtensor(name: str, t: torch.Tensor) -> None:
    if type(t).__name__ == "DTensor":  # a torch.distributed DTensor: a wrapper with no storage of its own
        raise TypeError(f"{name}: expected a plain tensor, got a DTensor; pass its local shard, {name}.to_local() "
                        "(as torchtitan's GroupedExperts does)")


def _check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    _check_not_dtensor(name, t)
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")


def _check_dtype(name: str, t: torch.Tensor) -> None:
    allowed = _CPU_DTYPES if t.device.type == "cpu" else tuple(_DTYPES)
    if t.dtype not in allowed:
        where = "on the CPU" if t.device.type == "cpu" else "on the GPU"
        raise TypeError(f"{name}: expected dtype {' or '.join(str(d) for d in allowed)} {where}, got {t.dtype}")


def _check_counts(counts, num_experts: int, device: torch.device) -> None:
    _check_tensor("tokens_per_expert", counts, 1)
    if counts.dtype not in _COUNT_TYPES:
        raise TypeError(f"tokens_per_expert: expected dtype torch.int32 or torch.int64, got {counts.dtype}")
    entries = counts.shape[0]
    if torch.compiler.is_compiling():
        # Traced, the size may be known only at run time (torch.bincount's counts): asserted there,
        # and from here on the trace knows it is num_experts.
        # (The message may close over nothing: under dynamic shapes num_experts is symbolic.)
        torch._check(entries == num_experts, lambda: "tokens_per_expert: expected one entry per expert")
    elif entries != num_experts:
        raise ValueError(f"tokens_per_expert: expected {num_experts} entries (one per expert), got {entries}")
    if counts.device != device and counts.device.type != "cpu":
        raise ValueError(f"tokens_per_expert: on {counts.device}, expected x's device {device} or the CPU")


def _check_host_counts(counts: torch.Tensor, num_tokens: int) -> Optional[int]:
    """Counts on the CPU are checked on the host (at run time, not while tracing). Returns their
    sum, where the owned rows end, or None for counts on the device."""
    if counts.device.type != "cpu":
        return None
    if counts.numel() == 0:
        return 0
    if bool((counts < 0).any()):
        raise ValueError(f"tokens_per_expert: counts must be >= 0, got {counts.tolist()}")
    total = int(counts.sum())
    if total > num_tokens:
        raise ValueError(f"tokens_per_expert: counts sum to {total}, more than the {num_tokens} rows of x")
    return total


def _weight_layout(weights: torch.Tensor, trans_b: bool, name: str = "weights") -> Tuple[int, int]:
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
        f"{name}: one of the last two dimensions must be contiguous (stride 1), got strides "
        f"{tuple(weights.stride())} for shape {tuple(weights.shape)}")


# One plan per problem shape: the kernel instance is resolved once, not on every call.
_plan = functools.lru_cache(maxsize=4096)(_C.plan)
_wgrad_workspace_size = functools.lru_cache(maxsize=4096)(_C.wgrad_workspace_size)


def _new_workspace(nbytes: int, device: torch.device) -> torch.Tensor:
    """The workspace of one call (the grouped families' per-expert arrays and CUTLASS's own); its
    contents need not be initialized. benchmarks/sanitize_sweep.py swaps in zeros for initcheck."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


# The current raw stream and device through the torch._C entry points Inductor's generated code
# calls: microseconds cheaper per call than torch.cuda.current_stream(), which builds a Stream
# object. CPU-only builds of torch lack them (and never launch).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _stream(device: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(device)
    return torch.cuda.current_stream(device).cuda_stream


def _on_device(device: int, fn, *args) -> None:
    """Calls the core with `device` current (it launches on the current device)."""
    if device == _current_device():
        fn(*args)
    else:
        with torch.cuda.device(device):
            fn(*args)


def runs_aligned_config(tokens_per_expert) -> bool:
    """Whether a call whose plan holds an :func:`aligned_config` runs it on these counts: every count
    a multiple of 128 and some expert holding 256 rows or more (the kernel's SplitGate, which reads
    them on the device; computed here by the library with the same per-count tests). For the
    benchmarks' and tests' bookkeeping; calls never need it."""
    counts = torch.as_tensor(tokens_per_expert).detach().to("cpu", torch.int64)
    return _C.split_of_whole_tiles(counts.reshape(-1).tolist())


def _select(num_tokens, num_experts, n, k, backend, device, trans_b, dtype) -> Tuple[int, int, int]:
    """The core's (backend, config, aligned config) values for select_config and aligned_config,
    their arguments checked; device None: the current CUDA device, or an sm90 one where there is none."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(_BACKENDS)}, got {backend!r}")
    if dtype not in _DTYPES:
        raise TypeError(f"dtype: expected torch.bfloat16 or torch.float16, got {dtype}")
    if device is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else -1
    return _C.select(num_tokens, num_experts, n, k, _BACKENDS[backend], device, _DTYPES[dtype],
                     _LAYOUTS["nk" if trans_b else "kn"])


def select_config(num_tokens: int, num_experts: int, n: int, k: int, backend: str = "auto",
                  device: Optional[int] = None, *, trans_b: bool = False,
                  dtype: torch.dtype = torch.bfloat16) -> Tuple[str, str]:
    """The heuristic's (backend, config) for ``backend=backend, config="auto"`` at these sizes on
    ``device`` (default: the current CUDA device, or an sm90 one where there is none), for weights
    stored as :func:`moe_gemm`'s ``trans_b`` says and x of ``dtype``: a choice from the
    architecture, T/E, N, K, the weights' layout and the dtype alone, never the counts. A shape
    :func:`cutlass_moe.tune` has timed takes tune's choice instead (with backend and config both
    "auto"). This is the heuristic's preference: where the build lacks that config (the default
    build has only the grouped family's 1x2-cluster tile), a call runs the family's first built one.

    Where :func:`aligned_config` names a second config, a call also launches it, and the device runs
    it instead on splits of whole 128-row tiles."""
    b, c, _ = _select(num_tokens, num_experts, n, k, backend, device, trans_b, dtype)
    return _BACKEND_NAMES[b], _CONFIG_NAMES[c]


def aligned_config(num_tokens: int, num_experts: int, n: int, k: int, backend: str = "auto",
                   device: Optional[int] = None, *, trans_b: bool = False,
                   dtype: torch.dtype = torch.bfloat16) -> Optional[str]:
    """The config a ``config="auto"`` call runs instead of :func:`select_config`'s on a split of whole
    128-row tiles (every count of tokens_per_expert a multiple of 128 and some expert holding two tiles
    or more: an even split of 256, 384, ... rows, or a layout that pads each expert to such tiles), or
    None where the pick holds for every split. Where there is one, each call launches both configs,
    and each reads the counts on the device and returns at once unless they are its kind of split: no
    host synchronization, and a CUDA graph replays either with new counts.
    Today the cooperative 128x256 tile, in two places (H200, bf16, both layouts):
    - where the heuristic takes the wide tile for fewer than 32 experts with 256 or more rows each
      (Mixtral's and Llama 4 Scout's gate/up projections): 1-6% faster than the wide tile on splits
      of whole tiles, up to 10% slower on others (with (E, N, K) weights, which have no wide tile,
      the heuristic takes the cooperative tile there for every split);
    - where it takes the pingpong tile for 32 or more experts with 65-255 rows each and the call
      multiplies 2^37 (1.4e11) or more MACs (DeepSeek-V3's and Qwen3-235B's down projections at
      prefill): 4-8% faster on splits of whole tiles; an even split of one tile per expert keeps the
      pingpong tile.
    The launch that returns at once costs 3-8 us on the H200, under 1% of the calls that have one."""
    _, _, a = _select(num_tokens, num_experts, n, k, backend, device, trans_b, dtype)
    return None if a == _CONFIGS["auto"] else _CONFIG_NAMES[a]


# ---- forward -----------------------------------------------------------------------------------

def _check_config(config) -> None:
    if config not in _CONFIGS:
        names = sorted(n for n in _CONFIGS if n != "auto")
        raise ValueError(f"config: expected 'auto' or one of {names}, got {config!r}")


def _check_moe_gemm(x, weights, tokens_per_expert, trans_b, out, backend, config) -> Tuple[int, int, int, int]:
    """Everything a user can get wrong that is visible without reading data; returns (T, K, E, N)."""
    _check_tensor("x", x, 2)
    _check_tensor("weights", weights, 3)
    _check_dtype("x", x)
    if weights.dtype != x.dtype:
        raise TypeError(f"weights: dtype {weights.dtype} does not match x's {x.dtype}")
    if not isinstance(trans_b, bool):
        raise TypeError(f"trans_b: expected a bool, got {type(trans_b).__name__}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(_BACKENDS)}, got {backend!r}")
    _check_config(config)
    num_tokens, k = x.shape
    num_experts = weights.shape[0]
    wk, n = (weights.shape[2], weights.shape[1]) if trans_b else (weights.shape[1], weights.shape[2])
    if wk != k:
        dims = "(E, N, K)" if trans_b else "(E, K, N)"
        raise ValueError(
            f"weights: expected shape {dims} with K = {k} (x is {tuple(x.shape)}), got {tuple(weights.shape)}")
    if weights.device != x.device:
        raise ValueError(f"weights: on {weights.device}, expected x's device {x.device}")
    _check_counts(tokens_per_expert, num_experts, x.device)
    if out is not None:
        _check_out(out, x, (num_tokens, n))
    if x.device.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"x: expected a CUDA or CPU tensor, got device {x.device}")
    return num_tokens, k, num_experts, n


def _check_out(out, x, shape: Tuple[int, int]) -> None:
    _check_tensor("out", out, 2)
    if out.dtype != x.dtype:
        raise TypeError(f"out: dtype {out.dtype} does not match x's {x.dtype}")
    if tuple(out.shape) != shape:
        raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")
    if out.device != x.device:
        raise ValueError(f"out: on {out.device}, expected x's device {x.device}")


class _Resolved:
    """What a moe_gemm call's launch needs besides the data: the kernel plan, the layout and the
    strides, resolved from the arguments' signature (shapes, strides, dtypes, devices, options).
    Built once per signature on the eager path (see _resolved_call). With backend and config "auto",
    the plan takes cutlass_moe.tune's remembered choice for the shape where there is one (for a fused
    call, one of the families that run the fused epilogue), else the heuristic's."""

    __slots__ = ("plan", "count_type", "host_counts", "num_tokens", "num_experts", "n", "out_cols", "ldx", "ldw",
                 "expert_stride", "dtype", "device", "torch_device")

    def __init__(self, x, weights, tokens_per_expert, trans_b, backend, config, gated=False, fused=False):
        num_tokens, k = x.shape
        num_experts = weights.shape[0]
        n = weights.shape[1] if trans_b else weights.shape[2]
        # Python derives the layout and the strides; the C++ core checks them (sizes, 16-byte multiples,
        # pointers) and raises ValueError naming the argument.
        if k > 0 and x.stride(1) != 1:
            raise ValueError(f"x: the last dimension must be contiguous, got strides {tuple(x.stride())}")
        if k > 0 and num_experts > 0 and n > 0:
            layout, self.ldw = _weight_layout(weights, trans_b)
        else:
            layout, self.ldw = _LAYOUTS["nk" if trans_b else "kn"], n
        self.device = x.device.index
        dtype = _DTYPES[x.dtype]
        self.plan = None
        if backend == "auto" and config == "auto":
            tuned = tuning.choice(dtype, layout, num_tokens, num_experts, n, k, self.device)
            if (tuned is not None and tuned[0] in _BACKENDS and tuned[1] in _CONFIGS
                    and not ((fused or gated) and tuned[0] not in ("moe", "sm80_moe"))):
                try:
                    self.plan = _plan(dtype, layout, num_tokens, num_experts, n, k, _BACKENDS[tuned[0]],
                                      _CONFIGS[tuned[1]], self.device, fused or gated)
                except (NotImplementedError, ValueError):  # a choice this build or shape cannot take
                    pass
        if self.plan is None:
            self.plan = _plan(dtype, layout, num_tokens, num_experts, n, k, _BACKENDS[backend], _CONFIGS[config],
                              self.device, fused or gated)
        self.count_type = _COUNT_TYPES[tokens_per_expert.dtype]
        self.host_counts = tokens_per_expert.device.type == "cpu"
        self.num_tokens, self.num_experts, self.n = num_tokens, num_experts, n
        self.out_cols = n // 2 if gated else n
        self.ldx = x.stride(0) if num_tokens > 1 else k
        self.expert_stride = weights.stride(0) if num_experts > 1 else 0
        self.dtype, self.torch_device = x.dtype, x.device


def _launch(r: _Resolved, x, weights, tokens_per_expert, out, fused=None) -> torch.Tensor:
    """Runs a resolved call. A new output (out=None) is fully defined: the rows no expert owns are
    zeros. A given out keeps those rows as they were. fused: the MoE families' fused epilogue
    (fused.FusedArgs; a gated one writes N/2 columns), or None."""
    num_tokens = r.num_tokens
    owned_end = _check_host_counts(tokens_per_expert, num_tokens) if r.host_counts else None
    new_output = out is None
    if new_output:
        out = torch.empty(num_tokens, r.out_cols, dtype=r.dtype, device=r.torch_device)
        ldout = r.out_cols
    else:
        if r.n > 0 and out.stride(1) != 1:
            raise ValueError(f"out: the last dimension must be contiguous, got strides {tuple(out.stride())}")
        ldout = out.stride(0) if num_tokens > 1 else r.out_cols
    if num_tokens == 0 or r.n == 0:
        return out
    counts = tokens_per_expert.contiguous()  # the kernels read E consecutive counts: not a strided view's
    if r.host_counts:
        counts = counts.to(r.torch_device, non_blocking=True)
    # A new output's rows past the owned rows become zeros: in the same core call where the counts are
    # on the device (a zero fill over the tail alone), by the host where it knows where they end.
    zero_tail = new_output and owned_end is None
    if new_output and owned_end is not None and owned_end < num_tokens:
        out[owned_end:].zero_()
    ws_bytes = r.plan.workspace_bytes
    workspace = _new_workspace(ws_bytes, r.torch_device) if ws_bytes else None
    args = (r.plan, r.count_type, x.data_ptr(), r.ldx, weights.data_ptr(), r.ldw, r.expert_stride, out.data_ptr(),
            ldout, counts.data_ptr(), workspace.data_ptr() if ws_bytes else 0, ws_bytes, zero_tail,
            _stream(r.device))
    if fused is None:
        _on_device(r.device, _C.run, *args)
    else:
        bias, row_scale = fused.bias, fused.row_scale
        bias_ptr = bias.data_ptr() if bias is not None else 0
        scale_ptr = row_scale.data_ptr() if row_scale is not None else 0
        # The core reads a null pointer as "none given": a tensor without storage (a DTensor met in a
        # signature seen before, whose checks are skipped) must not be dropped silently.
        if (bias is not None and not bias_ptr) or (row_scale is not None and not scale_ptr):
            name, t = ("bias", bias) if bias is not None and not bias_ptr else ("row_scale", row_scale)
            raise ValueError(f"{name}: a tensor without a data pointer ({type(t).__name__})")
        _on_device(r.device, _C.run_fused, *args, bias_ptr, bias.stride(0) if bias is not None else 0, scale_ptr,
                   _ACTIVATION_IDS[fused.activation], fused.gated, fused.alpha, fused.limit)
    return out


def _moe_gemm_impl(x, weights, tokens_per_expert, trans_b, out, backend, config, fused=None) -> torch.Tensor:
    """Runs the op on checked arguments (see _launch)."""
    if x.device.type == "cpu":
        _check_host_counts(tokens_per_expert, x.shape[0])
        if out is None:
            return moe_gemm_reference(x, weights, tokens_per_expert, trans_b=trans_b).to(x.dtype)
        return moe_gemm_reference(x, weights, tokens_per_expert, trans_b=trans_b, out=out)
    gated = fused is not None and fused.gated
    return _launch(_Resolved(x, weights, tokens_per_expert, trans_b, backend, config, gated), x, weights,
                   tokens_per_expert, out, fused)


_SIGNATURES_KEPT = 4096  # entries of each per-signature cache before it starts over


def _remember(cache: dict, key, value) -> None:
    """cache[key] = value in one of the per-signature caches, which start over when full (a program
    that keeps making new shapes must not grow them without bound)."""
    if len(cache) >= _SIGNATURES_KEPT:
        cache.clear()
    cache[key] = value


# Eager calls resolved by their signature: everything _check_moe_gemm and _Resolved read. A call
# whose signature was seen before skips both (its data pointers are still checked by the core).
_RESOLVED: dict = {}


def _resolved_call(x, weights, tokens_per_expert, trans_b, backend, config) -> Optional[_Resolved]:
    """The plain call's resolution, checking the arguments the first time a signature is seen.
    None where the call does not launch (CPU or meta tensors)."""
    try:
        key = (x.shape, x.stride(), x.dtype, x.device, weights.shape, weights.stride(), weights.dtype,
               weights.device, tokens_per_expert.shape, tokens_per_expert.dtype, tokens_per_expert.device,
               trans_b, trans_b.__class__, backend, config)
    except AttributeError:  # not tensors: the checks below name the argument
        key = None
    r = _RESOLVED.get(key)
    if r is None:
        _check_moe_gemm(x, weights, tokens_per_expert, trans_b, None, backend, config)
        if x.device.type != "cuda" or x.is_meta or weights.is_meta:
            return None
        r = _Resolved(x, weights, tokens_per_expert, trans_b, backend, config)
        _remember(_RESOLVED, key, r)
    return r


def _moe_gemm_call(x, weights, tokens_per_expert, trans_b, backend, config) -> torch.Tensor:
    """The body of cutlass_moe::moe_gemm and of its launch-only twin."""
    r = _resolved_call(x, weights, tokens_per_expert, trans_b, backend, config)
    if r is None:
        return _moe_gemm_impl(x, weights, tokens_per_expert, trans_b, None, backend, config)
    return _launch(r, x, weights, tokens_per_expert, None)


@torch.library.custom_op("cutlass_moe::moe_gemm", mutates_args=())
def _moe_gemm_op(x: torch.Tensor, weights: torch.Tensor, tokens_per_expert: torch.Tensor, trans_b: bool,
                 backend: str, config: str) -> torch.Tensor:
    return _moe_gemm_call(x, weights, tokens_per_expert, trans_b, backend, config)


@_moe_gemm_op.register_fake
def _moe_gemm_fake(x, weights, tokens_per_expert, trans_b, backend, config):
    n = weights.shape[1] if trans_b else weights.shape[2]
    return x.new_empty(x.shape[0], n)


def _moe_gemm_setup_context(ctx, inputs, output):
    x, weights, tokens_per_expert, trans_b, backend, config = inputs
    ctx.trans_b, ctx.backend = trans_b, backend
    ctx.save_for_backward(x if ctx.needs_input_grad[1] else None,
                          weights if ctx.needs_input_grad[0] else None, tokens_per_expert)


def _moe_gemm_grads(ctx, grad, path: str):
    """(dx, dW), through the registered ops ("op": a traced call of torch.ops.cutlass_moe.moe_gemm),
    their launch-only twins ("launch": compiled graphs, see _CompiledMoeGemm) or the public functions
    ("eager": no dispatcher cost, and differentiable again under create_graph); _GRAD_CALLS."""
    x, weights, tokens_per_expert = ctx.saved_tensors
    gemm, wgrad = _GRAD_CALLS[path]
    grad = grad.contiguous()
    # dgrad: dx_e = dy_e @ W_e^T, the forward op with the weights in the other layout (no copy).
    grad_x = (gemm(grad, weights, tokens_per_expert, not ctx.trans_b, ctx.backend, "auto")
              if ctx.needs_input_grad[0] else None)
    # wgrad: dW_e = x_e^T @ dy_e, in the weights' shape and dtype, on the forward family's arch.
    grad_weights = (wgrad(x, grad, tokens_per_expert, ctx.trans_b, None, _WGRAD_BACKEND_OF[ctx.backend], "auto")
                    if ctx.needs_input_grad[1] else None)
    return grad_x, grad_weights


_moe_gemm_op.register_autograd(lambda ctx, grad: (*_moe_gemm_grads(ctx, grad, "op"), None, None, None, None),
                               setup_context=_moe_gemm_setup_context)


class _MoeGemmFunction(torch.autograd.Function):
    """Eager autograd of moe_gemm: the registered op's forward and backward, without its dispatch
    cost (a torch.library op defined in Python costs tens of microseconds per call, measured in
    benchmarks/training_bench.py's host table)."""

    @staticmethod
    def forward(ctx, x, weights, tokens_per_expert, trans_b, backend, config, resolved):
        # forward(ctx, ...) rather than a separate setup_context: the latter costs ~10 us more per
        # call in torch 2.11-2.13 (it is the torch.func-compatible path).
        _moe_gemm_setup_context(ctx, (x, weights, tokens_per_expert, trans_b, backend, config), None)
        if resolved is None:
            return _moe_gemm_impl(x, weights, tokens_per_expert, trans_b, None, backend, config)
        return _launch(resolved, x, weights, tokens_per_expert, None)

    @staticmethod
    def backward(ctx, grad):
        return (*_moe_gemm_grads(ctx, grad, "eager"), None, None, None, None, None)


class _CompiledMoeGemm(torch.autograd.Function):
    """moe_gemm as torch.compile traces it: the forward, dgrad and wgrad through the launch-only ops
    (cutlass_moe::moe_gemm_launch, cutlass_moe::moe_gemm_wgrad_launch: the kernels of the registered
    ops, without an autograd kernel). A compiled graph calls its ops through the dispatcher, and an op
    with registered autograd runs its Python autograd layer on every call even where nothing needs a
    gradient: 10-17 us more per call (benchmarks/NOTES.md), which made a small compiled training
    step host-bound and slower than torch._grouped_mm's."""

    @staticmethod
    def forward(ctx, x, weights, tokens_per_expert, trans_b, backend, config):
        ctx.trans_b, ctx.backend = trans_b, backend
        ctx.save_for_backward(x, weights, tokens_per_expert)  # the partitioner drops what goes unused
        return _moe_gemm_launch(x, weights, tokens_per_expert, trans_b, backend, config)

    @staticmethod
    def backward(ctx, grad):
        return (*_moe_gemm_grads(ctx, grad, "launch"), None, None, None, None)


def _traced(*tensors) -> bool:
    """Whether the call is being traced (torch.compile, export, fake or meta tensors): it must go
    through the registered op, which those see."""
    return torch.compiler.is_compiling() or any(t.is_meta for t in tensors)


def _exporting() -> bool:
    """Whether torch.export is tracing. Not torch.compiler.is_exporting(): torch 2.11's Dynamo folds
    that to True under torch.compile as well. The flag it reads is set by torch.export alone; where a
    torch lacks it, exports take the compiled path (the launch ops under an autograd.Function)."""
    return getattr(torch.compiler, "_is_exporting_flag", False)


def _compiled() -> bool:
    """Whether torch.compile (not torch.export) is tracing the call: its graph calls the launch-only
    twins of the ops (define_launch_op), an exported program the registered ops."""
    return torch.compiler.is_compiling() and not _exporting()


def _records_graph(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def moe_gemm(
    x: torch.Tensor,
    weights: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    trans_b: bool = False,
    out: Optional[torch.Tensor] = None,
    backend: str = "auto",
    config: str = "auto",
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    row_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Grouped GEMM over experts: ``out[rows_e] = x[rows_e] @ W_e`` with fp32 accumulation, and
    optionally a fused epilogue ``row_scale[rows_e] * act(x[rows_e] @ W_e + bias[e])``.

    Args:
        x: (T, K) bf16 or fp16, rows sorted by expert (expert 0's rows first). Rows may be
            strided; the last dimension must be contiguous. On the CPU (the float32 reference
            path) also float32 and float64.
        weights: (E, K, N), or (E, N, K) with ``trans_b=True`` (the nn.Linear layout, computing
            ``x_e @ weights[e].T``). Any view whose innermost dimension is contiguous is used
            without a copy, e.g. an (E, N, K) tensor's ``.transpose(1, 2)`` with ``trans_b=False``.
        tokens_per_expert: (E,) int32 or int64, on x's device or on the CPU. On the device it is
            never read by the host (no synchronization, CUDA-graph safe).
        trans_b: whether ``weights`` is (E, N, K).
        out: optional (T, N) tensor of x's dtype to write into; its last dimension must be
            contiguous. A call with ``out`` is not differentiable (like torch's ``out=`` ops).
        backend: kernel family. ``"moe"`` (sm90): our MoE kernel, which takes base pointers and
            the counts and finds each tile's expert on the device (one launch, no workspace).
            ``"grouped"`` (sm90): CUTLASS's ptr-array grouped GEMM, after a small kernel that
            writes per-expert pointers and shapes. ``"sm80_moe"``, ``"sm80_grouped"``: the same two
            ideas on CUTLASS 2.x (Ampere/Ada; also built for Hopper). ``"auto"`` picks per device
            and problem (from the arch, T/E, N, K).
        config: ``"auto"`` (heuristic from T/E, N, K; with ``backend="auto"``, the choice
            :func:`cutlass_moe.tune` remembered for this shape, where there is one) or a kernel
            config name from :func:`cutlass_moe.built_configs` for the chosen backend.
        bias: optional (E, N) tensor of x's dtype, added to expert e's rows.
        activation: optional ``"relu"``, ``"gelu_tanh"``, ``"gelu"`` (erf) or ``"silu"``, applied
            after the bias.
        row_scale: optional (T,) float32 tensor multiplying each output row last (the router
            weight of the down projection); one in x's dtype is read as float32.
            The three run in the epilogue of the MoE families (``moe``, ``sm80_moe``), in fp32
            from the accumulators, when the call records no gradient (under torch.compile too,
            as ``torch.ops.cutlass_moe.moe_gemm_fused``). Otherwise (a gradient is recorded, the
            CPU, a grouped family) they run as torch operations on the GEMM's output (rounded to
            x's dtype first), differentiable in every tensor argument; the bias gradient is
            deterministic (cutlass_moe.fused). The gated form is :func:`cutlass_moe.moe_gemm_gated`.

    Returns:
        (T, N) tensor of x's dtype. Expert e owns rows ``[start_e, start_e + count_e)`` where the
        counts are clamped to [0, T] and the running start is capped at T (so counts summing past T
        are cut off at T, on the device). In a new output the rows past the last owned row are
        zeros; a given ``out`` keeps them as they were.

    Under ``torch.autocast`` for x's device type (and without ``out``), x, weights and bias are cast
    to the autocast dtype first, as ``nn.Linear`` gets them (fp32 parameters get fp32 gradients);
    row_scale is not cast.

    Autograd: differentiable in x and weights (``torch.ops.cutlass_moe.moe_gemm``). The gradient
    of x (dgrad) is this op again with the weights read in the other layout, ``dx_e = dy_e @ W_e^T``
    (no copy); the gradient of the weights is :func:`moe_gemm_wgrad`. Rows past the last owned
    row get ``dx = 0`` and add nothing to the weights' gradient.

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
    if out is None:
        x, weights, bias = _autocast(x, weights, bias)
    plain = bias is None and activation in (None, "none") and row_scale is None
    if plain and out is None and not torch.compiler.is_compiling():
        # The eager hot path: the checks and the plan once per signature (_resolved_call).
        r = _resolved_call(x, weights, tokens_per_expert, trans_b, backend, config)
        if r is None and (x.is_meta or weights.is_meta):
            return _moe_gemm_op(x, weights, tokens_per_expert, trans_b, backend, config)
        if torch.is_grad_enabled() and (x.requires_grad or weights.requires_grad):
            return _MoeGemmFunction.apply(x, weights, tokens_per_expert, trans_b, backend, config, r)
        if r is None:
            return _moe_gemm_impl(x, weights, tokens_per_expert, trans_b, None, backend, config)
        return _launch(r, x, weights, tokens_per_expert, None)
    if not plain:  # checked there
        from .fused import FusedArgs, moe_gemm_fused  # fused.py builds on this module
        return moe_gemm_fused(x, weights, tokens_per_expert, trans_b, out, backend, config,
                              FusedArgs(bias, activation or "none", row_scale))
    _check_moe_gemm(x, weights, tokens_per_expert, trans_b, out, backend, config)
    if out is None:  # only under torch.compile or export here (eager calls took the path above)
        if _compiled():
            return _CompiledMoeGemm.apply(x, weights, tokens_per_expert, trans_b, backend, config)
        return _moe_gemm_op(x, weights, tokens_per_expert, trans_b, backend, config)  # export
    return _moe_gemm_impl(x, weights, tokens_per_expert, trans_b, out, backend, config)


# ---- weight gradient ---------------------------------------------------------------------------

_WGRAD_BACKENDS = ("auto", "moe", "grouped", "sm80_grouped")
# The wgrad family of a forward family: the same kind on the same arch.
_WGRAD_BACKEND_OF = {"auto": "auto", "moe": "moe", "grouped": "grouped", "sm80_moe": "sm80_grouped",
                     "sm80_grouped": "sm80_grouped"}


def _check_wgrad(x, grad_out, tokens_per_expert, trans_b, out, accumulate, backend) -> Tuple[int, int, int, int]:
    """Returns (T, K, E, N); E comes from the counts."""
    _check_tensor("x", x, 2)
    _check_tensor("grad_out", grad_out, 2)
    _check_dtype("x", x)
    if grad_out.dtype != x.dtype:
        raise TypeError(f"grad_out: dtype {grad_out.dtype} does not match x's {x.dtype}")
    if grad_out.shape[0] != x.shape[0]:
        raise ValueError(f"grad_out: expected {x.shape[0]} rows like x {tuple(x.shape)}, got {tuple(grad_out.shape)}")
    if grad_out.device != x.device:
        raise ValueError(f"grad_out: on {grad_out.device}, expected x's device {x.device}")
    if not isinstance(trans_b, bool):
        raise TypeError(f"trans_b: expected a bool, got {type(trans_b).__name__}")
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate: expected a bool, got {type(accumulate).__name__}")
    if backend not in _WGRAD_BACKENDS:
        raise ValueError(f"backend: expected one of {list(_WGRAD_BACKENDS)} (the wgrad families), got {backend!r}")
    _check_tensor("tokens_per_expert", tokens_per_expert, 1)
    num_tokens, k = x.shape
    n = grad_out.shape[1]
    num_experts = tokens_per_expert.shape[0]
    _check_counts(tokens_per_expert, num_experts, x.device)
    shape = (num_experts, n, k) if trans_b else (num_experts, k, n)
    if accumulate and out is None:
        raise ValueError(f"out: accumulate=True adds into out, a float32 tensor of shape {shape}; got none")
    if out is not None:
        _check_tensor("out", out, 3)
        if tuple(out.shape) != shape:
            raise ValueError(f"out: expected shape {shape} ({'(E, N, K)' if trans_b else '(E, K, N)'}), "
                             f"got {tuple(out.shape)}")
        if out.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"out: expected dtype {x.dtype} (x's) or torch.float32, got {out.dtype}")
        if accumulate and out.dtype != torch.float32:
            raise TypeError(f"out: accumulate=True adds into a torch.float32 buffer, got {out.dtype}")
        if out.device != x.device:
            raise ValueError(f"out: on {out.device}, expected x's device {x.device}")
    return num_tokens, k, num_experts, n


class _WgradResolved:
    """What a moe_gemm_wgrad launch needs besides the data pointers, from the call's signature (as
    _Resolved for moe_gemm): dW's shape and dtype, its layout and strides, the kernel ids and the
    workspace size. Built once per signature (_check_wgrad_call) on checked arguments on the GPU."""

    __slots__ = ("head", "out_shape", "out_dtype", "ldx", "ld_grad_out", "ldw", "expert_stride", "ws_bytes",
                 "host_counts", "device", "empty")

    def __init__(self, x, grad_out, tokens_per_expert, trans_b, out, accumulate, out_dtype, backend, config):
        num_tokens, k = x.shape
        n = grad_out.shape[1]
        num_experts = tokens_per_expert.shape[0]
        self.out_shape = (num_experts, n, k) if trans_b else (num_experts, k, n)
        self.out_dtype = out.dtype if out is not None else (out_dtype or x.dtype)
        self.device = x.device.index
        self.host_counts = tokens_per_expert.device.type == "cpu"
        self.empty = num_experts == 0 or n == 0 or k == 0
        if self.empty:
            return
        if num_tokens > 0 and (x.stride(1) != 1 or grad_out.stride(1) != 1):
            bad = "x" if x.stride(1) != 1 else "grad_out"
            raise ValueError(f"{bad}: the last dimension must be contiguous, got strides "
                             f"{tuple((x if bad == 'x' else grad_out).stride())}")
        # A new dW is contiguous: its layout and strides as _weight_layout reads them off a tensor.
        dw = out if out is not None else torch.empty(self.out_shape, device="meta")
        layout, self.ldw = _weight_layout(dw, trans_b, name="out")
        self.expert_stride = dw.stride(0) if num_experts > 1 else 0
        dtype, out_dtype_id = _DTYPES[x.dtype], (_FP32 if self.out_dtype == torch.float32 else _DTYPES[x.dtype])
        backend_id, config_id = _BACKENDS[backend], _CONFIGS[config]
        self.ws_bytes = _wgrad_workspace_size(dtype, out_dtype_id, layout, accumulate, num_tokens, num_experts, n,
                                              k, backend_id, config_id, self.device)
        self.head = (backend_id, config_id, dtype, out_dtype_id, layout, _COUNT_TYPES[tokens_per_expert.dtype],
                     accumulate, num_tokens, num_experts, n, k)
        self.ldx = x.stride(0) if num_tokens > 1 else k
        self.ld_grad_out = grad_out.stride(0) if num_tokens > 1 else n


def _moe_gemm_wgrad_impl(x, grad_out, tokens_per_expert, trans_b, out, accumulate, out_dtype, backend,
                         config, resolved: Optional[_WgradResolved] = None) -> torch.Tensor:
    """Runs the wgrad on checked arguments. resolved: _check_wgrad_call's answer for them (looked up
    here when not given: the ops' bodies)."""
    if x.device.type == "cpu":
        _check_host_counts(tokens_per_expert, x.shape[0])
        if out is None:
            num_experts, k, n = tokens_per_expert.shape[0], x.shape[1], grad_out.shape[1]
            shape = (num_experts, n, k) if trans_b else (num_experts, k, n)
            out = torch.empty(shape, dtype=out_dtype or x.dtype, device=x.device)
        ref = moe_gemm_wgrad_reference(x, grad_out, tokens_per_expert, trans_b=trans_b)
        if accumulate:
            out += ref
        else:
            out.copy_(ref)
        return out
    r = resolved or _check_wgrad_call(x, grad_out, tokens_per_expert, trans_b, out, accumulate, out_dtype, backend,
                                      config)
    counts = tokens_per_expert.contiguous()  # the kernel reads E consecutive counts: not a strided view's
    if r.host_counts:
        _check_host_counts(counts, x.shape[0])
    if out is None:
        out = torch.empty(r.out_shape, dtype=r.out_dtype, device=x.device)
    if r.empty:
        return out
    workspace = _new_workspace(r.ws_bytes, x.device) if r.ws_bytes else None
    if r.host_counts:
        counts = counts.to(x.device, non_blocking=True)
    _on_device(r.device, _C.wgrad, *r.head, x.data_ptr(), r.ldx, grad_out.data_ptr(), r.ld_grad_out, out.data_ptr(),
               r.ldw, r.expert_stride, counts.data_ptr(), workspace.data_ptr() if r.ws_bytes else 0, r.ws_bytes,
               _stream(r.device))
    return out


def _moe_gemm_wgrad_call(x, grad_out, tokens_per_expert, trans_b, out_dtype, backend, config) -> torch.Tensor:
    """The body of cutlass_moe::moe_gemm_wgrad and of its launch-only twin."""
    return _moe_gemm_wgrad_impl(x, grad_out, tokens_per_expert, trans_b, None, False, out_dtype, backend, config)


@torch.library.custom_op("cutlass_moe::moe_gemm_wgrad", mutates_args=())
def _moe_gemm_wgrad_op(x: torch.Tensor, grad_out: torch.Tensor, tokens_per_expert: torch.Tensor, trans_b: bool,
                       out_dtype: Optional[torch.dtype], backend: str, config: str) -> torch.Tensor:
    return _moe_gemm_wgrad_call(x, grad_out, tokens_per_expert, trans_b, out_dtype, backend, config)


@_moe_gemm_wgrad_op.register_fake
def _moe_gemm_wgrad_fake(x, grad_out, tokens_per_expert, trans_b, out_dtype, backend, config):
    e, k, n = tokens_per_expert.shape[0], x.shape[1], grad_out.shape[1]
    return x.new_empty((e, n, k) if trans_b else (e, k, n), dtype=out_dtype or x.dtype)


# Launch-only twins of the registered ops, for compiled graphs (_compiled()): the same schema, kernels
# and fake implementations, and no autograd kernel (differentiating through them warns). A compiled
# graph calls its ops through the dispatcher, where a torch.library.custom_op runs its Python autograd
# layer on every call, registered backward or not: 10-17 us per call on an H200 host
# (benchmarks/NOTES.md, "Compiled graphs call launch-only ops").
_LAUNCH_LIB = torch.library.Library("cutlass_moe", "FRAGMENT")


def _tensor_key(t):
    """A tensor's part of a call's signature (None for None)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


# Signatures whose arguments a launch-only op's body has checked (_check_once).
_LAUNCH_CHECKED: dict = {}


def _check_once(key, check, *args) -> None:
    """check(*args) the first time `key`, a call's signature, is seen. The launch-only ops' bodies
    check their arguments so, for a direct torch.ops call: none reaches a kernel unchecked, and a
    compiled graph's calls (checked while tracing) pay for a dictionary lookup."""
    if key not in _LAUNCH_CHECKED:
        check(*args)
        _remember(_LAUNCH_CHECKED, key, True)


def define_launch_op(name: str, schema: str, impl, fake, keys=("CPU", "CUDA")):
    """cutlass_moe::<name><schema> with `impl` for the dispatch `keys` and `fake` for tracing;
    returns its overload, torch.ops.cutlass_moe.<name>.default."""
    _LAUNCH_LIB.define(name + schema)
    for key in keys:
        _LAUNCH_LIB.impl(name, impl, key)
    torch.library.register_fake(f"cutlass_moe::{name}", fake, lib=_LAUNCH_LIB)
    return getattr(torch.ops.cutlass_moe, name).default


_moe_gemm_launch = define_launch_op(
    "moe_gemm_launch", "(Tensor x, Tensor weights, Tensor tokens_per_expert, bool trans_b, str backend, "
    "str config) -> Tensor", _moe_gemm_call, _moe_gemm_fake)
_moe_gemm_wgrad_launch = define_launch_op(
    "moe_gemm_wgrad_launch", "(Tensor x, Tensor grad_out, Tensor tokens_per_expert, bool trans_b, "
    "ScalarType? out_dtype, str backend, str config) -> Tensor", _moe_gemm_wgrad_call, _moe_gemm_wgrad_fake)

# What _moe_gemm_grads calls on each path: (dgrad, wgrad), both positional as the ops' schemas.
_GRAD_CALLS = {
    "op": (_moe_gemm_op, _moe_gemm_wgrad_op),
    "launch": (_moe_gemm_launch, _moe_gemm_wgrad_launch),
    "eager": (lambda a, w, counts, trans_b, backend, config: moe_gemm(
                  a, w, counts, trans_b=trans_b, backend=backend, config=config),
              lambda a, dy, counts, trans_b, out_dtype, backend, config: moe_gemm_wgrad(
                  a, dy, counts, trans_b=trans_b, out_dtype=out_dtype, backend=backend, config=config)),
}


def _moe_gemm_wgrad_setup_context(ctx, inputs, output):
    x, grad_out, tokens_per_expert, trans_b, out_dtype, backend, config = inputs
    ctx.trans_b = trans_b
    ctx.save_for_backward(x, grad_out, tokens_per_expert)


def _moe_gemm_wgrad_grads(ctx, grad, path: str):
    # W_e = x_e^T dy_e (K x N, or its transpose): d x_e = dy_e G_e^T, d dy_e = x_e G_e, both the
    # forward op with G (the incoming gradient, in W's layout) read one way or the other; the
    # forward op of `path` (_GRAD_CALLS).
    x, grad_out, tokens_per_expert = ctx.saved_tensors
    g = grad.to(x.dtype).contiguous()  # an incoming gradient may be an expanded view (stride 0)
    gemm = _GRAD_CALLS[path][0]
    grad_x = gemm(grad_out, g, tokens_per_expert, not ctx.trans_b, "auto", "auto") if ctx.needs_input_grad[0] else None
    grad_dy = gemm(x, g, tokens_per_expert, ctx.trans_b, "auto", "auto") if ctx.needs_input_grad[1] else None
    return grad_x, grad_dy


_moe_gemm_wgrad_op.register_autograd(
    lambda ctx, grad: (*_moe_gemm_wgrad_grads(ctx, grad, "op"), None, None, None, None, None),
    setup_context=_moe_gemm_wgrad_setup_context)


class _MoeGemmWgradFunction(torch.autograd.Function):
    """Eager autograd of moe_gemm_wgrad (see _MoeGemmFunction)."""

    @staticmethod
    def forward(ctx, x, grad_out, tokens_per_expert, trans_b, out_dtype, backend, config, resolved):
        inputs = (x, grad_out, tokens_per_expert, trans_b, out_dtype, backend, config)
        _moe_gemm_wgrad_setup_context(ctx, inputs, None)
        return _moe_gemm_wgrad_impl(x, grad_out, tokens_per_expert, trans_b, None, False, out_dtype, backend, config,
                                    resolved)

    @staticmethod
    def backward(ctx, grad):
        return (*_moe_gemm_wgrad_grads(ctx, grad, "eager"), None, None, None, None, None, None)


class _CompiledMoeGemmWgrad(torch.autograd.Function):
    """moe_gemm_wgrad as torch.compile traces it where a gradient is recorded: the launch-only ops
    forward and backward (see _CompiledMoeGemm)."""

    @staticmethod
    def forward(ctx, x, grad_out, tokens_per_expert, trans_b, out_dtype, backend, config):
        ctx.trans_b = trans_b
        ctx.save_for_backward(x, grad_out, tokens_per_expert)
        return _moe_gemm_wgrad_launch(x, grad_out, tokens_per_expert, trans_b, out_dtype, backend, config)

    @staticmethod
    def backward(ctx, grad):
        return (*_moe_gemm_wgrad_grads(ctx, grad, "launch"), None, None, None, None, None)


# Wgrad calls whose arguments passed the checks, by signature, with their resolution (None where no
# kernel runs: the CPU, meta tensors), as _RESOLVED for moe_gemm.
_WGRAD_RESOLVED: dict = {}


def _check_wgrad_call(x, grad_out, tokens_per_expert, trans_b, out, accumulate, out_dtype, backend,
                      config) -> Optional[_WgradResolved]:
    """moe_gemm_wgrad's argument checks and its launch's resolution, once per signature of a call
    that is not traced: everything they read (data pointers are checked by the core on every call,
    and counts on the CPU by _moe_gemm_wgrad_impl)."""
    key = None
    if not torch.compiler.is_compiling():
        try:
            key = (x.shape, x.stride(), x.dtype, x.device, grad_out.shape, grad_out.stride(), grad_out.dtype,
                   grad_out.device, tokens_per_expert.shape, tokens_per_expert.dtype, tokens_per_expert.device,
                   trans_b, trans_b.__class__, accumulate, accumulate.__class__, out_dtype, backend, config,
                   None if out is None else (out.shape, out.stride(), out.dtype, out.device))
            if key in _WGRAD_RESOLVED:
                return _WGRAD_RESOLVED[key]
        except (AttributeError, TypeError):  # not tensors, or unhashable options: the checks name them
            key = None
    _check_wgrad(x, grad_out, tokens_per_expert, trans_b, out, accumulate, backend)
    _check_config(config)
    if out_dtype not in (None, x.dtype, torch.float32):
        raise TypeError(f"out_dtype: expected None, {x.dtype} (x's) or torch.float32, got {out_dtype}")
    if out is not None and out_dtype not in (None, out.dtype):
        raise TypeError(f"out_dtype: {out_dtype} does not match out's {out.dtype}")
    r = None
    if x.device.type == "cuda" and key is not None:
        r = _WgradResolved(x, grad_out, tokens_per_expert, trans_b, out, accumulate, out_dtype, backend, config)
    if key is not None:
        _remember(_WGRAD_RESOLVED, key, r)
    return r


def moe_gemm_wgrad(
    x: torch.Tensor,
    grad_out: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    trans_b: bool = False,
    out: Optional[torch.Tensor] = None,
    accumulate: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    backend: str = "auto",
    config: str = "auto",
) -> torch.Tensor:
    """The weight gradient of :func:`moe_gemm`: ``dW[e] = x[rows_e]^T @ grad_out[rows_e]``.

    A K-grouped GEMM: each expert's reduction runs over its rows, counted on the device (no host
    synchronization; CUDA-graph safe, a replay picks up new counts). Deterministic: no atomics and
    no split reduction, so the same inputs give the same bits.

    Args:
        x: (T, K) bf16 or fp16, the forward's input; last dimension contiguous.
        grad_out: (T, N), x's dtype, the gradient of the forward's output; last dimension contiguous.
        tokens_per_expert: (E,) int32 or int64 on x's device or the CPU, as in the forward.
        trans_b: the forward's ``trans_b``: dW is (E, K, N), or (E, N, K) with ``trans_b=True``.
        out: optional dW to write: that shape, x's dtype or float32, either of the last two
            dimensions contiguous (its layout is read off the strides, like the forward's weights).
        accumulate: add into ``out`` (a float32 buffer, e.g. Megatron's ``main_grad``) instead of
            overwriting it.
        out_dtype: dW's dtype without ``out``: x's (the default) or torch.float32.
        backend: ``"moe"`` (sm90: our MoE kernel, one launch; its tile scheduler reads the counts and
            each expert's reduction runs over its rows through ragged TMA views), ``"grouped"``
            (sm90: CUTLASS's ptr-array grouped GEMM, one group per expert), ``"sm80_grouped"``
            (CUTLASS 2.x GemmGrouped; Ampere, Ada, and Hopper as a fallback), or ``"auto"`` (the
            first of these, in this order, that is built and runs here).
        config: ``"auto"`` (the family's first built config) or a config name of the family from
            :func:`cutlass_moe.built_configs` (``arch:wgrad_<family>:dtype:out_dtype:config``).

    Returns:
        dW. An expert with no rows gets exact zeros, or is left untouched when accumulating.
        Differentiable in x and grad_out when called without ``out``.

    The gradient of x (dgrad) needs no kernel of its own: it is
    ``moe_gemm(grad_out, weights, tokens_per_expert, trans_b=not trans_b)``.
    """
    r = _check_wgrad_call(x, grad_out, tokens_per_expert, trans_b, out, accumulate, out_dtype, backend, config)
    if out is None:
        if _compiled():
            if _records_graph(x, grad_out):
                return _CompiledMoeGemmWgrad.apply(x, grad_out, tokens_per_expert, trans_b, out_dtype, backend, config)
            return _moe_gemm_wgrad_launch(x, grad_out, tokens_per_expert, trans_b, out_dtype, backend, config)
        if _traced(x, grad_out):  # torch.export, meta tensors
            return _moe_gemm_wgrad_op(x, grad_out, tokens_per_expert, trans_b, out_dtype, backend, config)
        if _records_graph(x, grad_out):
            return _MoeGemmWgradFunction.apply(x, grad_out, tokens_per_expert, trans_b, out_dtype, backend, config,
                                               r)
    return _moe_gemm_wgrad_impl(x, grad_out, tokens_per_expert, trans_b, out, accumulate, out_dtype, backend, config,
                                r)
