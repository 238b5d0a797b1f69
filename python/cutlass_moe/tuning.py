"""Optional autotuning: :func:`tune` times every built kernel config on this GPU for the problem
shapes a user names and remembers the fastest on disk, per GPU and cutlass_moe version.

Calls with ``backend="auto", config="auto"`` then take the remembered choice for their shape
(dtype, weight layout, T, E, N, K), looked up once per call signature together with the kernel plan
(``ops._Resolved``): nothing is added per call. Default calls never measure; without a tuning file
(or with ``CUTLASS_MOE_TUNING=0``) they take the heuristic's choice, :func:`cutlass_moe.select_config`.

The file is ``$XDG_CACHE_HOME/cutlass_moe/tuning-<gpu>-<version>.json`` (``~/.cache`` without
XDG_CACHE_HOME), or ``$CUTLASS_MOE_TUNING_FILE``. A choice the build cannot run (a file from
another build) is skipped, with the heuristic taking its place.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from . import _C

__all__ = ["tune", "tuning_file"]

_DTYPE_NAMES = {value: name for name, value in dict(_C.dtypes()).items()}
_LAYOUT_NAMES = {value: name for name, value in dict(_C.layouts()).items()}
_FORWARD_FAMILIES = ("moe", "grouped", "sm80_moe", "sm80_grouped")
_tables: Dict[int, Dict[str, dict]] = {}  # device index -> the loaded choices


def tuning_file(device: Optional[int] = None) -> str:
    """Where :func:`tune` keeps the choices for `device` (default: the current CUDA device)."""
    override = os.environ.get("CUTLASS_MOE_TUNING_FILE")
    if override:
        return override
    if device is None:
        device = torch.cuda.current_device()
    gpu = re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(device)).strip("_")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    from . import __version__
    return os.path.join(base, "cutlass_moe", f"tuning-{gpu}-{__version__}.json")


def _key(dtype: str, layout: str, num_tokens: int, num_experts: int, n: int, k: int) -> str:
    return f"{dtype}:{layout}:{num_tokens}:{num_experts}:{n}:{k}"


def _read(path: str) -> Dict[str, dict]:
    try:
        with open(path) as f:
            return dict(json.load(f)["choices"])
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"cutlass_moe: ignoring the tuning file {path}: {exc}")
        return {}


def _enabled() -> bool:
    return os.environ.get("CUTLASS_MOE_TUNING") != "0"


def _table(device: int) -> Dict[str, dict]:
    table = _tables.get(device)
    if table is None:
        table = _read(tuning_file(device)) if _enabled() else {}
        _tables[device] = table
    return table


def choice(dtype: int, layout: int, num_tokens: int, num_experts: int, n: int, k: int,
           device: int) -> Optional[Tuple[str, str]]:
    """The remembered (backend, config) for this shape on `device`, or None (the core's enum values
    for dtype and layout)."""
    table = _table(device)
    if not table:
        return None
    entry = table.get(_key(_DTYPE_NAMES[dtype], _LAYOUT_NAMES[layout], num_tokens, num_experts, n, k))
    return (entry["backend"], entry["config"]) if entry else None


def _write(path: str, choices: Dict[str, dict], device: int) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    from . import __version__
    body = {"device": torch.cuda.get_device_name(device), "version": __version__, "choices": choices}
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one


Problem = Union[Sequence[int], Dict[str, int]]


def _storage_names(dtype: torch.dtype, trans_b: bool) -> Tuple[str, str]:
    """The core's names of the dtype and the weight layout, as instance names and keys spell them."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype], ("nk" if trans_b else "kn")


def candidates(dtype: torch.dtype, trans_b: bool) -> List[Tuple[str, str]]:
    """The built (backend, config) pairs of the forward families for this dtype and weight storage."""
    dtype_name, layout = _storage_names(dtype, trans_b)
    pairs = []
    for name in _C.built_instances():
        _, family, inst_dtype, inst_layout, config = name.split(":")
        if family in _FORWARD_FAMILIES and inst_dtype == dtype_name and inst_layout == layout:
            pairs.append((family, config))
    return pairs


def time_configs(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, trans_b: bool,
                 pairs: Sequence[Tuple[str, str]], warmup_ms: float, rep_ms: float,
                 rounds: int = 1) -> Dict[str, float]:
    """ms of each (backend, config) that runs this call ("backend:config" -> the median over
    `rounds` do_bench medians), leaving out those that raise (not for this GPU or shape) or whose
    result differs from the auto call's beyond bf16 rounding. The rounds alternate the configs'
    order (forward, then backward, ...): one timing of each moved by up to 10% between runs on the
    H200 (benchmarks/NOTES.md, twelfth session), more than the differences a choice turns on."""
    if rounds < 1:
        raise ValueError(f"rounds: expected at least 1, got {rounds}")
    from .bench import median_of_rounds  # do_bench's medians (L2 flushed between runs), alternating rounds
    from .ops import moe_gemm

    reference = moe_gemm(x, w, counts, trans_b=trans_b)
    scale = float(reference.abs().max()) + 1e-6

    def close(y: torch.Tensor) -> bool:  # in row chunks: the float copies of a large out would not fit
        step = max(1, (1 << 28) // max(1, y.shape[1]))
        return all(torch.allclose(y[i:i + step].float(), reference[i:i + step].float(), rtol=2e-2, atol=2e-2 * scale)
                   for i in range(0, y.shape[0], step))

    runs = {}
    for backend, config in pairs:
        run = lambda b=backend, c=config: moe_gemm(x, w, counts, trans_b=trans_b, backend=b, config=c)
        try:
            y = run()
        except (NotImplementedError, ValueError):
            continue
        if close(y):
            runs[f"{backend}:{config}"] = run
        del y
    return median_of_rounds(runs, rounds, warmup_ms, rep_ms)


def tune(problems: Iterable[Problem], *, dtype: torch.dtype = torch.bfloat16, trans_b: bool = False,
         device: Optional[int] = None, save: bool = True, warmup_ms: float = 10.0,
         rep_ms: float = 50.0, rounds: int = 3) -> List[dict]:
    """Times every built (backend, config) of the forward families on each problem and remembers
    the fastest for ``moe_gemm(..., backend="auto", config="auto")`` of that shape.

    Args:
        problems: (T, E, K, N) tuples, or dicts with those keys: x is (T, K), the weights (E, K, N),
            or (E, N, K) with ``trans_b=True``. Each expert gets T/E rows (the remainder to the last):
            the choice is per shape, as the heuristic's is, never per count vector.
        dtype: torch.bfloat16 or torch.float16.
        device: CUDA device index (default: the current one).
        save: merge the choices into :func:`tuning_file` (and use them in this process at once).
        warmup_ms, rep_ms: per config and round, as ``triton.testing.do_bench`` takes them.
        rounds: timings of each config, in alternating order; each config's time is their median.

    Returns:
        One dict per problem: the shape, ``backend`` and ``config`` chosen with their ``ms``, the
        heuristic's choice and its ``heuristic_ms``, every config's time in ``times``, and whether
        the choice was ``remembered``. Configs whose result differs from the heuristic's (beyond
        bf16 rounding) are left out. Where the even split timed here is one of whole 128-row tiles
        (256, 384, ... rows per expert), a choice that is the shape's :func:`cutlass_moe.aligned_config`
        is not remembered: auto already runs that config on such splits, and keeps the heuristic's
        for the shape's other splits.
    """
    from .ops import _RESOLVED, aligned_config, runs_aligned_config, select_config

    if not torch.cuda.is_available():
        raise RuntimeError("tune: needs a CUDA GPU (default calls never measure; they take select_config's choice)")
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype: expected torch.bfloat16 or torch.float16, got {dtype}")
    device = torch.cuda.current_device() if device is None else device
    dtype_name, layout = _storage_names(dtype, trans_b)
    pairs = candidates(dtype, trans_b)
    results, new, forget = [], {}, set()
    gen = torch.Generator(device=f"cuda:{device}").manual_seed(0)
    with torch.cuda.device(device), torch.no_grad():
        for problem in problems:
            num_tokens, num_experts, k, n = ((problem["T"], problem["E"], problem["K"], problem["N"])
                                             if isinstance(problem, dict) else tuple(problem))
            x = torch.randn(num_tokens, k, device="cuda", dtype=dtype, generator=gen)
            w = torch.randn(num_experts, *((n, k) if trans_b else (k, n)), device="cuda", dtype=dtype,
                            generator=gen) * k ** -0.5
            counts = torch.full((num_experts,), num_tokens // num_experts, dtype=torch.int32)
            counts[-1] += num_tokens - int(counts.sum())
            aligned_split = runs_aligned_config(counts)  # the even split timed here (SplitGate)
            counts = counts.cuda()
            times = time_configs(x, w, counts, trans_b, pairs, warmup_ms, rep_ms, rounds)
            if not times:
                raise RuntimeError(f"tune: no built kernel runs T={num_tokens} E={num_experts} K={k} N={n} here")
            best = min(times, key=times.get)
            heuristic = ":".join(select_config(num_tokens, num_experts, n, k, device=device, trans_b=trans_b,
                                               dtype=dtype))
            entry = {"backend": best.split(":")[0], "config": best.split(":")[1], "ms": times[best],
                     "heuristic": heuristic, "heuristic_ms": times.get(heuristic)}
            aligned = aligned_config(num_tokens, num_experts, n, k, device=device, trans_b=trans_b, dtype=dtype)
            remembered = not (aligned is not None and aligned_split and
                              best == f"{heuristic.split(':')[0]}:{aligned}")
            key = _key(dtype_name, layout, num_tokens, num_experts, n, k)
            if remembered:
                new[key] = entry
            else:
                forget.add(key)  # and an earlier tune's choice for the shape goes
            results.append({"T": num_tokens, "E": num_experts, "K": k, "N": n, **entry, "times": times,
                            "remembered": remembered})
            del x, w
    if save:
        path = tuning_file(device)
        choices = {key: entry for key, entry in {**_read(path), **new}.items() if key not in forget}
        _write(path, choices, device)
        _tables[device] = choices if _enabled() else {}
        _RESOLVED.clear()  # resolutions made before now took the old choices
        from .fused import _FUSED_RESOLVED  # the fused calls' too (fused.py imports this module's user, ops)
        _FUSED_RESOLVED.clear()
    return results
