"""The main job: ``python -m cutlass_moe.bench``.

Runs the public benchmark cases (cases.json, carried in the package) on the GPU, timing
cutlass_moe.moe_gemm against its peers in the same run, on the same data: torch._grouped_mm (where
present) with the weights in both layouts ((E, K, N), and (E, N, K) storage read transposed), a loop
of per-expert torch.mm (cuBLAS), the same loop spread over CUDA streams (the multi-stream baseline
of the grouped-GEMM blog this project started from), and torch.bmm where every expert has the same
rows. Checks every result against a float32 reference, prints a table (ms, TFLOP/s, fraction of the
roofline floor, speedup over each peer and over the best one) and writes JSON. Each time is the
median of --rounds alternating rounds of every provider, after heating the GPU (heat): a card that
paused for the checks boosts its clock, and would flatter whichever runner went first.

``--paired`` also times ours against each case's best peer call by call (``paired_ratio``), a reading
that does not move from run to run with the power cap's clock. It compares the two at the clock their
mix sets, not each at its own sustained clock as the rounds do: a kernel that draws more power than
its peer reads faster than in the rounds (ours against the loop on dsv3-prefill: 1.53x paired, 1.36x in
the rounds' medians). The headline figures stay the rounds' medians; the paired reading is for ties.

``--plot out.png`` draws each provider's time against the number of groups over the blog's sweep
(the seed000-g8 ... g128 cases: 8 to 128 groups of one problem), or over the cases run when --cases
leaves the sweep out (matplotlib, an optional extra: ``pip install matplotlib``).

The floor of a case is max(FLOPs / peak, bytes / bandwidth), with bytes = x + the weights of
experts that have tokens + out, each once. It is given twice: with the fixed rates the public cases
are scored against (790 TFLOP/s on both Hoppers; 4.36 TB/s on an H200, 3.08 on an H100 SXM, the
H200's elsewhere: ``fixed_ceilings``) and with the two ceilings measured in this run on this GPU (a
large bf16 matmul, a large device-to-device copy).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from importlib import resources
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .reference import per_expert_errors

H200_TFLOPS = 790.0
DEFAULT_VARIANTS = "grouped:auto,moe:auto"  # each sm90 family forced, beside the headline
H200_TBPS = 4.36
H100_TBPS = 3.08  # the H100 SXM's (80GB HBM3) fixed bandwidth ceiling, as issue 12 scores it
# The peers every case is timed against (where they run), as they appear in the JSON.
PEERS = ("torch_grouped_mm", "torch_grouped_mm_nk", "loop", "multistream", "bmm")
SWEEP_PREFIX = "seed000-g"  # the blog's sweep: 8 to 128 groups of one problem


def load_cases() -> List[dict]:
    with resources.files(__package__).joinpath("cases.json").open() as f:
        return json.load(f)["cases"]


def case_counts(cases: List[dict]) -> Dict[str, torch.Tensor]:
    """tokens_per_expert of each case, drawn as cases.json's note says: 'random' cases draw
    torch.rand(E) from one generator seeded 1234, in list order, normalize, scale by T, truncate
    and add the remainder to the last expert; 'uniform' cases get T/E each."""
    gen = torch.Generator().manual_seed(1234)
    counts = {}
    for case in cases:
        e, t = case["E"], case["T"]
        if case["dist"] == "random":
            r = torch.rand(e, generator=gen, dtype=torch.float32)
            c = (r / r.sum() * t).to(torch.int64)
            c[-1] += t - int(c.sum())
        elif case["dist"] == "uniform":
            c = torch.full((e,), t // e, dtype=torch.int64)
            c[-1] += t - int(c.sum())
        else:
            raise ValueError(f"case {case['name']}: unknown dist {case['dist']!r}")
        counts[case["name"]] = c
    return counts


def fixed_ceilings(device_name: str) -> Tuple[str, float, float]:
    """(label, TFLOP/s, TB/s) of the fixed rates a GPU's floor fractions are scored against: the H100
    SXM's ("H100 80GB HBM3") for it, the H200's for any other GPU."""
    if "H100" in device_name and "HBM3" in device_name:
        return "H100", H200_TFLOPS, H100_TBPS
    return "H200", H200_TFLOPS, H200_TBPS


def case_work(case: dict, counts: torch.Tensor, elem_bytes: int = 2) -> Tuple[float, float]:
    """(FLOPs, bytes) the floor counts: 2 T K N, and x, the weights of experts with rows, and out."""
    t, k, n = case["T"], case["K"], case["N"]
    active = int((counts > 0).sum())
    return 2.0 * t * k * n, float(elem_bytes * (t * k + active * k * n + t * n))


def floor_ms(case: dict, counts: torch.Tensor, tflops: float, tbps: float, elem_bytes: int = 2) -> float:
    flops, bytes_moved = case_work(case, counts, elem_bytes)
    return max(flops / (tflops * 1e12), bytes_moved / (tbps * 1e12)) * 1e3


def _l2_flush_buffer() -> torch.Tensor:
    """256 MB to zero before a timed call, as triton's do_bench does: more than any L2 holds."""
    return torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")


def _do_bench(fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> float:
    """Median ms. triton.testing.do_bench (which flushes L2 between runs) when Triton is there,
    else the same method with CUDA events."""
    try:
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    except ImportError:
        pass
    flush = _l2_flush_buffer()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    times = []
    for _ in range(max(1, int(rep_ms / estimate))):
        flush.zero_()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# How long heat() runs a kernel before the first timed run: the H200 settles at its power cap within
# this (benchmarks/NOTES.md, "The bench flattered whichever runner it timed first";
# benchmarks/clock_ramp.py).
HEAT_MS = 300.0


def heat(fn: Callable[[], object], ms: float = HEAT_MS) -> None:
    """Runs fn back to back for about `ms` milliseconds, untimed, so that the GPU is at its sustained
    clock when timing starts. After a pause (the float32 checks, making the data) the card is cool
    and boosts (1980 MHz); under back-to-back prefill kernels it sits at its 700 W cap (1350-1500
    MHz on the H200 and H100). Without this, whichever runner is timed first after a pause reads up
    to 8% fast. No-op without CUDA."""
    if ms <= 0 or not torch.cuda.is_available():
        return
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < ms:
        fn()
        torch.cuda.synchronize()


def median_of_rounds(runners: Dict[str, Callable[[], object]], rounds: int, warmup_ms: float = 25.0,
                     rep_ms: float = 100.0, heat_ms: float = HEAT_MS) -> Dict[str, float]:
    """Each runner's ms: the median over `rounds` rounds of its _do_bench median. Every round times
    each runner once, in the runners' order, reversed every other round, so that none gains from
    its place (as clocks drift); the first runner heats the GPU first (heat), so that none gains from
    going first after a pause either."""
    samples: Dict[str, List[float]] = {name: [] for name in runners}
    if runners:
        heat(next(iter(runners.values())), heat_ms)
    for r in range(rounds):
        for name in (list(runners) if r % 2 == 0 else list(reversed(runners))):
            samples[name].append(_do_bench(runners[name], warmup_ms, rep_ms))
    return {name: statistics.median(ms) for name, ms in samples.items()}


def paired_ratio(base: Callable[[], object], other: Callable[[], object], ms: float = 1500.0,
                 heat_ms: float = HEAT_MS, max_pairs: int = 400) -> Dict[str, float]:
    """How much longer `other` takes than `base`, to a fraction of a percent on a power-capped card.

    The two calls run next to each other, L2 flushed before each as in do_bench, their order swapped
    from one pair to the next, for about `ms` milliseconds after heating. Each pair gives the ratio of
    its two CUDA-event times. The clock that the power cap sets moves by up to 10% over tens of
    milliseconds, moving medians of separate rounds by 2-4% from one call to the next; the two calls of
    a pair, a few milliseconds apart, see the same clock, so their ratio does not move with it.

    That clock is the one the two calls' mix sets. Two kernels of about the same power draw (a fused
    epilogue against its plain GEMM) read as they would each alone; between kernels that draw
    different power, the one that draws more reads faster here than back to back on its own (ours
    against a torch.mm loop on dsv3-prefill: 1.53x here, 1.36x in median_of_rounds; NOTES.md).

    Returns the median of the pairs' ratios, its 25th and 75th percentiles, each side's median ms, and
    the number of pairs. Needs CUDA."""
    flush = _l2_flush_buffer()
    heat(lambda: (base(), other()), heat_ms)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    base()
    other()
    end.record()
    end.synchronize()
    pairs = int(min(max_pairs, max(20, ms / max(start.elapsed_time(end), 1e-3))))
    events = []
    for i in range(pairs):
        pair = []
        for fn in ((base, other) if i % 2 == 0 else (other, base)):
            flush.zero_()
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
            fn()
            ev[1].record()
            pair.append(ev)
        events.append(pair if i % 2 == 0 else pair[::-1])  # (base, other) either way
    torch.cuda.synchronize()
    base_ms = [b[0].elapsed_time(b[1]) for b, _ in events]
    other_ms = [o[0].elapsed_time(o[1]) for _, o in events]
    ratios = sorted(o / b for b, o in zip(base_ms, other_ms))
    q = statistics.quantiles(ratios, n=4)
    return {"ratio": statistics.median(ratios), "ratio_p25": q[0], "ratio_p75": q[2],
            "base_ms": statistics.median(base_ms), "other_ms": statistics.median(other_ms), "pairs": pairs}


def measure_ceilings() -> Dict[str, float]:
    """This GPU's bf16 matmul rate (TFLOP/s) and copy bandwidth (TB/s, read + write), on random data."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = _do_bench(lambda: torch.mm(a, b), 25, 200)
    src = torch.randn(1024 * 1024 * 1024 // 4, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = _do_bench(lambda: dst.copy_(src), 25, 200)
    del a, b, src, dst
    return {"tflops": 2 * 8192**3 / (mm_ms * 1e-3) / 1e12, "tbps": 2 * 2**30 / (copy_ms * 1e-3) / 1e12}


def grouped_mm_peer(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> Optional[Callable[[], torch.Tensor]]:
    """torch._grouped_mm on the same data, or None where this PyTorch has none."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return None
    offs = torch.cumsum(counts, 0).to(device=x.device, dtype=torch.int32)
    return lambda: fn(x, w, offs=offs)


def loop_peer(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The sequential baseline: one cuBLAS torch.mm per expert with tokens (counts known on the host)."""
    out = torch.empty(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
    bounds, start = [], 0
    for e, c in enumerate(counts.tolist()):
        if c:
            bounds.append((e, start, start + c))
        start += c

    def run() -> torch.Tensor:
        for e, s, t in bounds:
            torch.mm(x[s:t], w[e], out=out[s:t])
        return out

    run.out, run.bounds = out, bounds  # for multistream_peer
    return run


def multistream_peer(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                     num_streams: int = 4) -> Callable[[], torch.Tensor]:
    """The loop with the experts spread round-robin over `num_streams` CUDA streams, which start
    after and join back into the current stream (counts known on the host)."""
    run_loop = loop_peer(x, w, counts)
    out = run_loop.out
    bounds = run_loop.bounds
    streams = [torch.cuda.Stream(device=x.device) for _ in range(num_streams)]

    def run() -> torch.Tensor:
        current = torch.cuda.current_stream(x.device)
        for stream in streams:
            stream.wait_stream(current)
        for i, (e, s, t) in enumerate(bounds):
            with torch.cuda.stream(streams[i % num_streams]):
                torch.mm(x[s:t], w[e], out=out[s:t])
        for stream in streams:
            current.wait_stream(stream)
        return out

    return run


def bmm_peer(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> Optional[Callable[[], torch.Tensor]]:
    """torch.bmm over (E, T/E, K) views, where every expert has the same rows and they cover x."""
    e = w.shape[0]
    if e == 0 or x.shape[0] % e or any(c != x.shape[0] // e for c in counts.tolist()):
        return None
    out = torch.empty(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
    xv, outv = x.view(e, -1, x.shape[1]), out.view(e, -1, w.shape[2])

    def run() -> torch.Tensor:
        torch.bmm(xv, w, out=outv)
        return out

    return run


def run_case(case: dict, counts: torch.Tensor, args, moe_gemm) -> dict:
    t, k, n, e = case["T"], case["K"], case["N"], case["E"]
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, k, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(e, k, n, device="cuda", dtype=dtype, generator=gen) * (k ** -0.5)
    counts_gpu = counts.to("cuda", torch.int32)
    flops = 2.0 * t * k * n
    row = {"name": case["name"], "E": e, "T": t, "K": k, "N": n, "dist": case["dist"]}

    variants = args.variants.split(",") if args.variants else []
    peer = grouped_mm_peer(x, w, counts)
    # The same weights in the nn.Linear layout, (E, N, K) storage, for torch._grouped_mm's second peer
    # and the "nk" variant.
    w_nk = w.transpose(1, 2).contiguous() if peer is not None or "nk" in variants else None

    runners = {"moe_gemm": lambda: moe_gemm(x, w, counts_gpu, backend=args.backend, config=args.config)}
    for variant in variants:  # each family, and tuning runs
        if variant == "nk":  # ours on (E, N, K) weights (trans_b), the headline backend and config
            runners["moe_gemm[nk]"] = lambda: moe_gemm(x, w_nk, counts_gpu, trans_b=True, backend=args.backend,
                                                       config=args.config)
            continue
        backend, _, config = variant.partition(":")
        runners[f"moe_gemm[{variant}]"] = (
            lambda backend=backend, config=config or "auto": moe_gemm(x, w, counts_gpu, backend=backend, config=config))
    if peer is not None:
        runners["torch_grouped_mm"] = peer
        runners["torch_grouped_mm_nk"] = grouped_mm_peer(x, w_nk.transpose(1, 2), counts)
    runners["loop"] = loop_peer(x, w, counts)
    runners["multistream"] = multistream_peer(x, w, counts)
    peer = bmm_peer(x, w, counts)
    if peer is not None:
        runners["bmm"] = peer

    timed = {}
    for label, fn in runners.items():
        try:
            y = fn()
            torch.cuda.synchronize()
        except Exception as exc:  # a peer that cannot run this case is reported, not fatal
            row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        if not args.no_check:  # per expert: one norm over all rows would hide a wrong expert or row
            errors = per_expert_errors(y, x, w, counts)
            row[f"{label}_worst_rel"] = errors["worst_rel"]  # NaN or inf where an owned row is not finite
            row[f"{label}_max_abs"] = errors["max_abs"]
            row[f"{label}_elem_ratio"] = errors["elem_ratio"]  # > 1: some element outside its tolerance
        del y
        timed[label] = fn
    # Time after every check: the median of alternating rounds, the GPU heated first, so that no
    # runner is favoured by going first after the float32 checks (a cool card boosts its clock) or by
    # drifting clocks.
    for label, ms in median_of_rounds(timed, args.rounds, args.warmup_ms, args.rep_ms).items():
        row[f"{label}_ms"] = ms
    for label in timed:
        row[f"{label}_tflops"] = flops / (row[f"{label}_ms"] * 1e-3) / 1e12
    peers = {label: row[f"{label}_ms"] for label in PEERS if f"{label}_ms" in row}
    if peers:
        row["best_peer"] = min(peers, key=peers.get)
        row["best_peer_ms"] = peers[row["best_peer"]]
        if args.paired and "moe_gemm" in timed:  # the best peer's time over ours, call by call
            pr = paired_ratio(timed["moe_gemm"], timed[row["best_peer"]])
            row["best_peer_paired"] = {k: pr[k] for k in ("ratio", "ratio_p25", "ratio_p75", "pairs")}
    return row


def _fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def _geomean(values: List[float]) -> float:
    return 2 ** (sum(math.log2(v) for v in values) / len(values))


def print_table(rows: List[dict], ceilings: Dict[str, float], fixed: Optional[Tuple[str, float, float]] = None) -> None:
    label, fixed_tflops, fixed_tbps = fixed or fixed_ceilings("")
    head = (f"{'case':<20} {'ours ms':>8} {'grouped':>8} {'moe':>8} {'gmm ms':>8} {'gmm nk':>8} {'loop ms':>8} "
            f"{'streams':>8} {'bmm ms':>8} {'TFLOP/s':>8} {'floor':>7} {'%floor':>7} {'%floor*':>7} {'x gmm':>6} "
            f"{'x loop':>6} {'x best':>6} {'err':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        ours = r.get("moe_gemm_ms")
        floor = r.get("floor_ms_fixed", r["floor_ms_h200"])
        frac = floor / ours if ours else None
        frac_measured = r["floor_ms_measured"] / ours if ours else None
        gmm, loop = r.get("torch_grouped_mm_ms"), r.get("loop_ms")
        best = r.get("best_peer_ms")
        print(f"{r['name']:<20} {_fmt(ours, '8.3f')} {_fmt(r.get('moe_gemm[grouped:auto]_ms'), '8.3f')} "
              f"{_fmt(r.get('moe_gemm[moe:auto]_ms'), '8.3f')} {_fmt(gmm, '8.3f')} "
              f"{_fmt(r.get('torch_grouped_mm_nk_ms'), '8.3f')} {_fmt(loop, '8.3f')} "
              f"{_fmt(r.get('multistream_ms'), '8.3f')} {_fmt(r.get('bmm_ms'), '8.3f')} "
              f"{_fmt(r.get('moe_gemm_tflops'), '8.1f')} {floor:7.3f} "
              f"{_fmt(frac and 100 * frac, '6.1f')}% {_fmt(frac_measured and 100 * frac_measured, '6.1f')}% "
              f"{_fmt(gmm and ours and gmm / ours, '6.2f')} {_fmt(loop and ours and loop / ours, '6.2f')} "
              f"{_fmt(best and ours and best / ours, '6.2f')} {_fmt(r.get('moe_gemm_worst_rel'), '8.1e')}")
    extra = sorted({k[len("moe_gemm["):-len("]_ms")] for r in rows for k in r if k.startswith("moe_gemm[") and k.endswith("]_ms")})
    extra = [v for v in extra if v not in ("grouped:auto", "moe:auto")]
    if extra:
        print("\nother variants, ms (ratio to the headline moe_gemm):")
        for r in rows:
            cells = [f"{c}={r[f'moe_gemm[{c}]_ms']:.3f} ({r[f'moe_gemm[{c}]_ms'] / r['moe_gemm_ms']:.2f})"
                     for c in extra if f"moe_gemm[{c}]_ms" in r and r.get("moe_gemm_ms")]
            print(f"  {r['name']:<20} " + "  ".join(cells))
    print(f"floor: {label} rates ({fixed_tflops:.0f} TFLOP/s, {fixed_tbps} TB/s); %floor* uses this GPU's measured "
          f"ceilings ({ceilings['tflops']:.0f} TFLOP/s, {ceilings['tbps']:.2f} TB/s). "
          f"ours: backend/config 'auto'; grouped, moe: each family forced (config auto). "
          f"gmm nk: torch._grouped_mm on (E, N, K) weights; streams: the loop over 4 CUDA streams; bmm: where "
          f"every expert has T/E rows. x gmm / x loop / x best: speedup of ours over torch._grouped_mm / the "
          f"torch.mm loop / the fastest peer.")
    ratios = [r["best_peer_ms"] / r["moe_gemm_ms"] for r in rows if r.get("best_peer_ms") and r.get("moe_gemm_ms")]
    if ratios:
        print(f"ours vs the best peer: geomean {_geomean(ratios):.3f}x, min {min(ratios):.3f}x")
    paired = [r for r in rows if "best_peer_paired" in r]
    if paired:
        print("ours vs the best peer, call by call (--paired: the median of each pair's peer time over ours, "
              "quartiles):")
        for r in paired:
            p = r["best_peer_paired"]
            print(f"  {r['name']:<20} {r['best_peer']:<20} {p['ratio']:.3f}x ({p['ratio_p25']:.3f}-{p['ratio_p75']:.3f}, "
                  f"{p['pairs']} pairs)")
        values = [r["best_peer_paired"]["ratio"] for r in paired]
        print(f"  geomean {_geomean(values):.3f}x, min {min(values):.3f}x")


def plot(rows: List[dict], path: str, device: str) -> None:
    """Each provider's time against the number of groups (the cases' E), log-log."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib, an optional extra: pip install matplotlib")
    rows = sorted(rows, key=lambda r: r["E"])
    labels = {"moe_gemm": "cutlass_moe.moe_gemm", "torch_grouped_mm": "torch._grouped_mm (E, K, N)",
              "torch_grouped_mm_nk": "torch._grouped_mm (E, N, K)", "loop": "torch.mm loop",
              "multistream": "torch.mm loop, 4 streams", "bmm": "torch.bmm"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in labels.items():
        points = [(r["E"], r[f"{key}_ms"]) for r in rows if f"{key}_ms" in r]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("number of groups (experts)")
    ax.set_ylabel("time (ms)")
    shapes = sorted({(r["T"], r["K"], r["N"]) for r in rows})
    ax.set_title(f"{device}: T, K, N = " + "; ".join(f"{t}, {k}, {n}" for t, k, n in shapes), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {os.path.abspath(path)}", file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cutlass_moe.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--json", default="cutlass_moe_bench.json", help="where to write the results")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--backend", default="auto", help="headline moe_gemm backend (default: auto)")
    parser.add_argument("--config", default="auto", help="headline moe_gemm kernel config (default: auto)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help="more moe_gemm runs to time beside it, as backend:config, comma-separated, "
                             "or nk: the headline call on the same weights stored (E, N, K) (trans_b) "
                             "(default: each sm90 family with its heuristic config; the sm80 families on "
                             "other GPUs)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="each time is the median of this many alternating rounds of all providers (default 5: "
                             "one runner's time moves by up to 10%% from round to round on a power-capped card)")
    parser.add_argument("--paired", action="store_true",
                        help="also time ours against each case's best peer call by call (paired_ratio: the two "
                             "side by side, order swapped per pair), a reading that does not move from run to run; "
                             "it compares the two at their mix's clock, which favours the kernel that draws more "
                             "power: for ties, not for the headline")
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--no-check", action="store_true", help="skip the float32 reference check")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="draw time against the number of groups for every provider (over the seed000-g* "
                             "sweep; needs matplotlib)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")

    cases = load_cases()
    counts = case_counts(cases)  # drawn over the whole list, so a filter does not change them
    if args.cases:
        wanted = set(args.cases.split(","))
        unknown = wanted - {c["name"] for c in cases}
        if unknown:
            parser.error(f"unknown case(s): {', '.join(sorted(unknown))}")
        cases = [c for c in cases if c["name"] in wanted]

    if not torch.cuda.is_available():
        print("cutlass_moe.bench: no CUDA GPU is visible, so nothing was timed. The kernels need an sm90 "
              "(Hopper) GPU, or an sm80/86/89 one for the sm80 families. These are the cases it would run, "
              "with the H200 floor and the peers' H200 times from cases.json:")
        for c in cases:
            print(f"  {c['name']:<20} E={c['E']:<4} T={c['T']:<6} K={c['K']:<5} N={c['N']:<6} {c['dist']:<8} "
                  f"floor {c['floor_ms']:.3f} ms, torch._grouped_mm {c['torch_grouped_mm_ms']:.3f} ms, "
                  f"loop {c['loop_ms']:.3f} ms")
        return 1

    from . import moe_gemm
    major, minor = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if (major, minor) != (9, 0) and args.variants == DEFAULT_VARIANTS:
        args.variants = "sm80_grouped:auto,sm80_moe:auto"  # the sm90 families do not run here

    print(f"cutlass_moe.bench on {name}, torch {torch.__version__}, {args.dtype}", file=sys.stderr)
    print("measuring this GPU's ceilings (bf16 matmul, copy bandwidth)...", file=sys.stderr)
    ceilings = measure_ceilings()
    fixed = fixed_ceilings(name)
    rows = []
    started = time.time()
    for i, case in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}] {case['name']} (E={case['E']} T={case['T']} K={case['K']} N={case['N']})...",
              file=sys.stderr, flush=True)
        row = run_case(case, counts[case["name"]], args, moe_gemm)
        row["floor_ms_h200"] = floor_ms(case, counts[case["name"]], H200_TFLOPS, H200_TBPS)
        row["floor_ms_fixed"] = floor_ms(case, counts[case["name"]], fixed[1], fixed[2])
        row["floor_ms_measured"] = floor_ms(case, counts[case["name"]], ceilings["tflops"], ceilings["tbps"])
        row["public"] = {k: case[k] for k in ("floor_ms", "torch_grouped_mm_ms", "loop_ms") if k in case}
        rows.append(row)
        torch.cuda.empty_cache()
    print(f"done in {time.time() - started:.0f} s", file=sys.stderr)

    print_table(rows, ceilings, fixed)
    if args.plot:  # the sweep's cases where they ran, else every case run
        plot([r for r in rows if r["name"].startswith(SWEEP_PREFIX)] or rows, args.plot, name)
    result = {"device": name, "torch": torch.__version__, "dtype": args.dtype, "backend": args.backend,
              "config": args.config, "variants": args.variants,
              "ceilings": ceilings, "fixed_ceilings": {"label": fixed[0], "tflops": fixed[1], "tbps": fixed[2]},
              "cases": rows}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {os.path.abspath(args.json)}", file=sys.stderr)
    # The worst expert's relative error and every element's tolerance (assert_close_per_expert's
    # bounds); "not <=" also fails a NaN or inf (an owned row not finite).
    limits = {"_worst_rel": 2e-2, "_elem_ratio": 1.0}
    failed = sorted({r["name"] for r in rows for k in r if k.startswith("moe_gemm") and (
        k.endswith("_error") or any(k.endswith(suffix) and not r[k] <= bound for suffix, bound in limits.items()))})
    if failed:
        print(f"moe_gemm FAILED its check on: {', '.join(failed)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
