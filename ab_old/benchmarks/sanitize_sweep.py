"""Workload for compute-sanitizer: every built kernel that runs on this GPU, called on ragged tails,
empty experts, 4096 experts, K = 0, hostile device counts and one CUDA graph replayed with new
counts, each call checked per expert against a float32 reference.

Every tensor a kernel or this harness reads is initialized (x and weights random, out filled with
NaN, never torch.empty), so initcheck reports only what the kernels themselves read uninitialized.
That includes the workspace: CUTLASS's sm90 ptr-array kernel keeps a TMA descriptor per SM in it,
which it writes with tensormap.cp_fenceproxy (a copy from shared memory that initcheck does not count
as a write) and then reads, so the workspace is allocated zeroed here (cutlass_moe.ops._new_workspace).
The reference runs on the CPU (no extra kernels under the sanitizer). A call is wrong if the worst
expert's relative error is >= 1e-2 or a row past the last owned row was written (it must stay NaN).
One line per call; exits 1 if any call was wrong or raised, 2 if nothing could run here.

The weight-gradient families (arch:wgrad_<family>:...) get one checked ragged call each (with an fp32
output, one more that accumulates into it) in the full and small modes.

Modes: full (the sweep: per kernel = per (backend, config) pair in built_configs(), the whole set of
problems on one dtype/layout instance, and one ragged call on each of its other instances); small
(one small ragged call per kernel, for racecheck); graph (only the CUDA-graph step).

With PYTORCH_NO_CUDA_MEMORY_CACHING=1 (sanitize.sh sets it, so the sanitizer sees every tensor as
its own allocation) a capture cannot allocate, so the graph step runs only for the families that
need no workspace (moe, sm80_moe); sanitize.sh runs --mode graph once more with the caching
allocator for the rest.

To run: python3 benchmarks/sanitize_sweep.py [--mode full|small|graph] [--kernels sm90:moe,pingpong]
        [--every-instance]   (from outside the source tree, to import the installed package;
        benchmarks/sanitize.sh runs it under each compute-sanitizer tool)
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

TOL = 1e-2
DEVICE = "cuda"
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Kernel:
    """One built instance, from a built_configs() string arch:backend:dtype:layout:config."""
    arch: str
    backend: str
    dtype: str
    layout: str
    config: str

    @property
    def name(self) -> str:
        return f"{self.arch}:{self.backend}:{self.dtype}:{self.layout}:{self.config}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float16 if self.dtype == "fp16" else torch.bfloat16

    @property
    def trans_b(self) -> bool:  # "nk": weights (E, N, K), passed with trans_b=True
        return self.layout == "nk"


@dataclass
class Problem:
    label: str
    t: int
    e: int
    k: int
    n: int
    counts: Sequence[int]
    count_dtype: torch.dtype = torch.int32


def owned_ranges(counts: Sequence[int], t: int) -> List[Tuple[int, int]]:
    """Rows [start, stop) of each expert after the documented clamping: each count cut to [0, T],
    the running start capped at T."""
    ranges, start = [], 0
    for c in counts:
        c = min(max(int(c), 0), t)
        stop = min(start + c, t)
        ranges.append((start, stop))
        start = stop
    return ranges


def split_counts(e: int, rows: int, seed: int, zero_frac: float = 0.3) -> List[int]:
    """`rows` rows over e experts at random, about zero_frac of them empty (first and last included)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(e, generator=gen)
    weights[torch.rand(e, generator=gen) < zero_frac] = 0
    if e > 2:
        weights[0] = weights[-1] = 0
    if float(weights.sum()) == 0:
        weights[e // 2] = 1
    counts = (weights / weights.sum() * rows).to(torch.int64)
    nonzero = int(torch.nonzero(counts).flatten()[-1]) if bool(counts.any()) else e // 2
    counts[nonzero] += rows - int(counts.sum())
    return counts.tolist()


# The problems. T and N are multiples of no tile size, K (a multiple of 8, as TMA needs) ends in a
# partial K tile for both 64- and 32-deep tiles, and rows are left over past the sum of the counts.
def ragged() -> Problem:
    return Problem("ragged", 997, 8, 264, 136, [0, 130, 0, 211, 97, 0, 500, 0])  # 59 tail rows


def small() -> Problem:
    return Problem("small", 300, 5, 264, 136, [0, 77, 0, 150, 50])  # 23 tail rows


def full_problems() -> List[Problem]:
    decode = split_counts(64, 150, seed=1, zero_frac=0.5)
    return [
        ragged(),
        Problem("decode", 161, 64, 256, 256, decode),  # a few rows per expert, half of them empty
        Problem("hot", 1531, 16, 128, 136, [0] * 5 + [1500] + [0] * 3 + [3] + [0] * 6),  # one expert, many tiles
        Problem("all-empty", 200, 6, 64, 128, [0] * 6),
        Problem("E=4096", 3001, 4096, 64, 64, split_counts(4096, 2980, seed=2)),
        Problem("K=0", 77, 5, 0, 136, [10, 0, 30, 7, 0]),
        Problem("over-T", 1000, 3, 72, 136, [5000, 5000, 5000]),
        Problem("sum-past-T", 1000, 3, 72, 136, [400, 400, 400]),
        Problem("negative", 1000, 4, 72, 136, [-5, 300, -2**31, 400]),
        Problem("int32-max", 1000, 3, 72, 136, [INT32_MAX, 10, 10]),
        Problem("int64-huge", 1000, 4, 72, 136, [2**40, -2**40, 7, 2**62], torch.int64),
    ]


# Graph step: captured with GRAPH_COUNTS[0], replayed with the others copied into the same tensor.
GRAPH_T, GRAPH_E, GRAPH_K, GRAPH_N = 1000, 16, 256, 136
GRAPH_COUNTS = [split_counts(GRAPH_E, GRAPH_T - 11, seed=3),
                split_counts(GRAPH_E, GRAPH_T - 37, seed=4, zero_frac=0.6),
                [GRAPH_T + 5, -3] + [100] * (GRAPH_E - 2)]  # hostile: the first expert takes all of T


def sync() -> None:
    torch.cuda.synchronize()


def make_data(kernel: Kernel, p: Problem, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(p.t, p.k, device=DEVICE, dtype=kernel.torch_dtype, generator=gen)
    shape = (p.e, p.n, p.k) if kernel.trans_b else (p.e, p.k, p.n)
    w = torch.randn(*shape, device=DEVICE, dtype=kernel.torch_dtype, generator=gen)
    w.mul_(max(p.k, 1) ** -0.5)  # in place: no second allocation
    return x, w


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, trans_b: bool,
          counts: Sequence[int]) -> Tuple[bool, str]:
    """Per expert against x[s:e].float() @ W_e.float(), on the CPU; rows past the last owned row must
    still be NaN. Returns (ok, detail)."""
    t = x.shape[0]
    y = out.cpu().float()
    xc, wc = x.cpu().float(), w.cpu().float()
    ranges = owned_ranges(counts, t)
    worst, worst_expert, bad, nan_experts = 0.0, -1, 0, 0
    for i, (s, e) in enumerate(ranges):
        if e <= s:
            continue
        ref = xc[s:e] @ (wc[i].t() if trans_b else wc[i])
        diff = float((y[s:e] - ref).norm())
        den = float(ref.norm())
        err = diff / den if den > 0 else diff  # K = 0: the rows must be exactly 0
        if math.isnan(err):  # an owned row left unwritten (still NaN), or NaN computed
            nan_experts += 1
            bad += 1
            continue
        if err >= TOL:
            bad += 1
        if err > worst:
            worst, worst_expert = err, i
    last = ranges[-1][1] if ranges else 0
    tail = y[last:]
    tail_written = int((~torch.isnan(tail)).any(dim=1).sum()) if tail.numel() else 0
    ok = bad == 0 and tail_written == 0
    detail = (f"owned {last} rows, worst rel err {worst:.1e}"
              + (f" (expert {worst_expert})" if worst_expert >= 0 else "")
              + (f", {bad} experts wrong" if bad else "") + (f" ({nan_experts} with NaN)" if nan_experts else "")
              + f", tail {t - last} rows " + ("NaN" if tail_written == 0 else f"WRITTEN ({tail_written} rows)"))
    return ok, detail


class Sweep:
    def __init__(self, moe_gemm: Callable) -> None:
        self.moe_gemm = moe_gemm
        self.calls = self.failed = self.skipped = 0
        self.failures: List[str] = []

    def report(self, ok: Optional[bool], kernel: Kernel, label: str, shape: str, detail: str, secs: float) -> None:
        if ok is None:
            self.skipped += 1
            status = "skip"
        else:
            self.calls += 1
            status = "ok" if ok else "FAIL"
            if not ok:
                self.failed += 1
                self.failures.append(f"{kernel.name} {label}")
        print(f"{status:<4} {kernel.name:<58} {label:<12} {shape:<30} {detail} [{secs:.2f} s]", flush=True)

    def alive(self) -> bool:
        """After an exception: is the CUDA context still usable? (A kernel fault is sticky.)"""
        try:
            sync()
            return True
        except Exception:
            return False

    def wgrad(self, kernel: Kernel, p: Problem, seed: int) -> bool:
        """One checked weight-gradient call (kernel: arch:wgrad_<family>:dtype:out_dtype:config), and
        with an fp32 output one more that accumulates into it. Returns False if the CUDA context is
        gone."""
        import cutlass_moe
        shape = f"E={p.e} T={p.t} K={p.k} N={p.n}"
        backend = kernel.backend[len("wgrad_"):]
        out_dtype = torch.float32 if kernel.layout == "fp32" else kernel.torch_dtype
        start = time.time()
        try:
            gen = torch.Generator(device=DEVICE).manual_seed(seed)
            x = torch.randn(p.t, p.k, device=DEVICE, dtype=kernel.torch_dtype, generator=gen)
            dy = torch.randn(p.t, p.n, device=DEVICE, dtype=kernel.torch_dtype, generator=gen)
            counts = torch.tensor(list(p.counts), dtype=p.count_dtype).to(DEVICE)
            ref = cutlass_moe.moe_gemm_wgrad_reference(x.cpu(), dy.cpu(), list(p.counts))
            out = torch.full((p.e, p.k, p.n), float("nan"), device=DEVICE, dtype=out_dtype)
            cutlass_moe.moe_gemm_wgrad(x, dy, counts, out=out, backend=backend)
            expect = [ref]
            if out_dtype == torch.float32:
                cutlass_moe.moe_gemm_wgrad(x, dy, counts, out=out, accumulate=True, backend=backend)
                expect = [2 * ref]
            sync()
            got = out.cpu().float()
            errs = [float((got[e] - expect[0][e]).norm() / expect[0][e].norm().clamp_min(1e-30))
                    if stop > start_ else float((got[e] != 0).any())
                    for e, (start_, stop) in enumerate(owned_ranges(p.counts, p.t))]
            worst = max(errs) if errs else 0.0
            ok = worst < TOL and bool(torch.isfinite(got).all())
            detail = f"worst expert rel err {worst:.1e}" + (" (+ accumulate)" if out_dtype == torch.float32 else "")
        except Exception as exc:
            self.report(False, kernel, p.label, shape, f"raised {type(exc).__name__}: {str(exc)[:300]}",
                        time.time() - start)
            return self.alive()
        self.report(ok, kernel, p.label, shape, detail, time.time() - start)
        return True

    def call(self, kernel: Kernel, p: Problem, seed: int) -> bool:
        """One checked call. Returns False if the CUDA context is gone."""
        shape = f"E={p.e} T={p.t} K={p.k} N={p.n}"
        start = time.time()
        try:
            x, w = make_data(kernel, p, seed)
            counts = torch.tensor(list(p.counts), dtype=p.count_dtype).to(DEVICE)
            out = torch.full((p.t, p.n), float("nan"), device=DEVICE, dtype=kernel.torch_dtype)
            self.moe_gemm(x, w, counts, trans_b=kernel.trans_b, out=out, backend=kernel.backend, config=kernel.config)
            sync()
            ok, detail = check(out, x, w, kernel.trans_b, p.counts)
        except Exception as exc:
            self.report(False, kernel, p.label, shape, f"raised {type(exc).__name__}: {str(exc)[:300]}",
                        time.time() - start)
            return self.alive()
        self.report(ok, kernel, p.label, shape, detail, time.time() - start)
        return True

    def graph(self, kernel: Kernel, seed: int) -> bool:
        """Capture one call, replay it twice with new counts copied into the captured tensor."""
        shape = f"E={GRAPH_E} T={GRAPH_T} K={GRAPH_K} N={GRAPH_N}"
        if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1" and kernel.backend.endswith("grouped"):
            self.report(None, kernel, "graph", shape, "skipped: its workspace is allocated inside the capture, which "
                        "needs the caching allocator (PYTORCH_NO_CUDA_MEMORY_CACHING=1 is set; run --mode graph "
                        "without it)", 0.0)
            return True
        start = time.time()
        step = "warm-up"
        try:
            p = Problem("graph", GRAPH_T, GRAPH_E, GRAPH_K, GRAPH_N, GRAPH_COUNTS[0])
            x, w = make_data(kernel, p, seed)
            counts = torch.tensor(GRAPH_COUNTS[0], dtype=torch.int32).to(DEVICE)
            out = torch.full((p.t, p.n), float("nan"), device=DEVICE, dtype=kernel.torch_dtype)
            new_counts = [torch.tensor(c, dtype=torch.int32).to(DEVICE) for c in GRAPH_COUNTS[1:]]

            def run() -> None:
                self.moe_gemm(x, w, counts, trans_b=kernel.trans_b, out=out, backend=kernel.backend,
                              config=kernel.config)

            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                run()  # warm-up outside the capture (descriptor caches, lazy module loading)
            torch.cuda.current_stream().wait_stream(stream)
            sync()
            ok, detail = check(out, x, w, kernel.trans_b, GRAPH_COUNTS[0])
            self.report(ok, kernel, "graph:eager", shape, detail, time.time() - start)
            step = "capture"
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            for i, (host, dev) in enumerate(zip(GRAPH_COUNTS[1:], new_counts)):
                step = f"replay {i + 1}"
                start = time.time()
                counts.copy_(dev)
                out.fill_(float("nan"))
                graph.replay()
                sync()
                ok, detail = check(out, x, w, kernel.trans_b, host)
                self.report(ok, kernel, f"graph:rep{i + 1}", shape, detail, time.time() - start)
            del graph
        except Exception as exc:
            self.report(False, kernel, f"graph:{step}", shape, f"raised {type(exc).__name__}: {str(exc)[:300]}",
                        time.time() - start)
            return self.alive()
        return True


def sm80_family_ccs(cutlass_moe) -> Optional[set]:
    """Compute capabilities the sm80 families have machine code for (from build_info), or None."""
    summary = str(cutlass_moe.build_info().get("summary", ""))
    if "sm80 families for " not in summary:
        return None
    archs = summary.split("sm80 families for ")[-1]
    return {int(a.strip()[3:]) for a in archs.split(",") if a.strip().startswith("sm_") and a.strip()[3:].isdigit()}


def kernels_here(cutlass_moe, filters: List[str]) -> Tuple[List[Kernel], List[str]]:
    """The built instances that run on this GPU and match a filter, and a note on those left out."""
    major, minor = torch.cuda.get_device_capability()
    cc = 10 * major + minor
    sm80_ccs = sm80_family_ccs(cutlass_moe)
    kernels, left_out = [], []
    for name in cutlass_moe.built_configs():
        parts = name.split(":")
        if len(parts) != 5:
            left_out.append(f"{name} (not arch:backend:dtype:layout:config)")
            continue
        k = Kernel(*parts)
        if filters and not any(f in name for f in filters):
            continue
        runs = cc == 90 if k.arch == "sm90" else (sm80_ccs is None or cc in sm80_ccs)
        if not runs:
            left_out.append(f"{name} (no machine code for sm_{cc})")
            continue
        kernels.append(k)
    return kernels, left_out


def group_by_pair(kernels: List[Kernel]) -> List[Tuple[Kernel, List[Kernel]]]:
    """Per (backend, config): the primary instance (bf16 with (E,K,N) weights where built) and the rest."""
    pairs = {}
    for k in kernels:
        pairs.setdefault((k.arch, k.backend, k.config), []).append(k)
    grouped = []
    for members in pairs.values():
        members = sorted(members, key=lambda k: (k.dtype != "bf16", k.layout != "kn", k.dtype, k.layout))
        grouped.append((members[0], members[1:]))
    return grouped


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["full", "small", "graph"], default="full",
                        help="full: the sweep; small: one small ragged call per kernel (racecheck); graph: only "
                             "the CUDA-graph step")
    parser.add_argument("--kernels", default="",
                        help="comma-separated substrings: only built_configs() names holding one of them")
    parser.add_argument("--every-instance", action="store_true",
                        help="run the mode's problems on every dtype/layout instance of a kernel, not only on "
                             "its bf16 (E,K,N) one")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("sanitize_sweep: no CUDA GPU is visible; nothing to run")
        return 2
    import cutlass_moe  # after argparse: --help works without a build
    import cutlass_moe.ops
    cutlass_moe.ops._new_workspace = lambda nbytes, device: torch.zeros(nbytes, dtype=torch.uint8, device=device)

    filters = [f for f in args.kernels.split(",") if f]
    kernels, left_out = kernels_here(cutlass_moe, filters)
    print(f"sanitize_sweep --mode {args.mode}: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cutlass_moe from {os.path.dirname(cutlass_moe.__file__)}, {len(kernels)} instances here"
          + (f", caching allocator off" if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1" else ""),
          flush=True)
    for note in left_out:
        print(f"  left out: {note}")
    if not kernels:
        print("sanitize_sweep: no built kernel runs on this GPU" + (f" matching {args.kernels!r}" if filters else ""))
        return 2

    sweep = Sweep(cutlass_moe.moe_gemm)
    started = time.time()
    seed = 0
    alive = True
    wgrad_kernels = [k for k in kernels if k.backend.startswith("wgrad_")] if args.mode != "graph" else []
    for kernel in wgrad_kernels:  # the weight-gradient families, one checked call each
        seed += 1
        alive = sweep.wgrad(kernel, small() if args.mode != "full" else ragged(), seed)
        if not alive:
            break
    kernels = [k for k in kernels if not k.backend.startswith("wgrad_")] if alive else []
    for primary, others in group_by_pair(kernels):
        targets = [primary] + (others if args.every_instance else [])
        for kernel in targets:
            if args.mode == "small":
                plan: List[object] = [small()]
            elif args.mode == "graph":
                plan = ["graph"]
            else:
                plan = full_problems() + ["graph"]
            for item in plan:
                seed += 1
                alive = sweep.graph(kernel, seed) if item == "graph" else sweep.call(kernel, item, seed)
                if not alive:
                    break
            if not alive:
                break
        if alive and args.mode == "full" and not args.every_instance:
            for kernel in others:  # every other compiled instance once
                seed += 1
                alive = sweep.call(kernel, ragged(), seed)
                if not alive:
                    break
        if not alive:
            print("sanitize_sweep: the CUDA context is unusable after that failure (a kernel fault); stopping")
            break
    print(f"sanitize_sweep: {sweep.calls} checked calls, {sweep.failed} failed, {sweep.skipped} skipped, "
          f"{time.time() - started:.0f} s" + (f"; failed: {', '.join(sweep.failures[:8])}" if sweep.failures else "")
          + (f" and {len(sweep.failures) - 8} more" if len(sweep.failures) > 8 else ""),
          flush=True)
    return 1 if sweep.failed or not alive else 0


if __name__ == "__main__":
    sys.exit(main())
