"""A/B timing of two builds of cutlass_moe on the public bench cases: one run per build and round
(benchmarks/ab_bench.sh alternates the builds), then --summarize the rounds' JSON files.

A run times, per case, moe_gemm(x, w, counts) with backend "auto", "moe" and "grouped" (config auto)
on cutlass_moe.bench's cases, counts and data (bench.run_case's seeded generator, weights scaled by
K**-0.5) with bench's timer (bench._do_bench, median), in two passes of opposite order keeping each
runner's better time, the GPU heated first (heat, as bench.heat); each runner's result is checked
once, per expert, against the float32 reference first. With --wgrad it times
moe_gemm_wgrad(x, dy, counts) instead (runners "wauto", "wmoe", "wgrouped": dW in bf16, checked per
expert against x_e^T dy_e in float32; no floor).
It times whichever cutlass_moe is imported: put the build on PYTHONPATH and run from outside the
source tree. The summary gives per case and runner each build's median over its
rounds, its spread (max - min over the rounds, % of the median), new/old and a verdict: REGRESSION
where new > old * (1 + 2% + the larger spread).

To run (benchmarks/ab_bench.sh does all of it):
  cd /tmp && PYTHONPATH=/tmp/ab_old python3 /path/to/benchmarks/ab_bench.py --label old --json old_r1.json
  python3 benchmarks/ab_bench.py --summarize device_out/ab_*_r*.json
  The weight gradient: AB_ARGS=--wgrad bash benchmarks/ab_bench.sh <old_git_rev> [rounds]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

RUNNERS = {"auto": {}, "moe": {"backend": "moe"}, "grouped": {"backend": "grouped"}}
WGRAD_RUNNERS = {"wauto": {}, "wmoe": {"backend": "moe"}, "wgrouped": {"backend": "grouped"}}  # --wgrad
MAX_REL_ERR = 2e-2  # worst expert's relative error, as cutlass_moe.bench


def worst_expert_rel(y, x, w, counts) -> float:
    """Worst expert's ||y - ref|| / ||ref|| over its rows, ref in float32 (its own check: the bench
    module's helpers differ between revisions). NaN or inf where an owned row is not finite."""
    worst, start = 0.0, 0
    for e, c in enumerate(counts.tolist()):
        if c:
            ref = x[start:start + c].float() @ w[e].float()
            err = float((y[start:start + c].float() - ref).norm()) / max(float(ref.norm()), 1e-30)
            if not math.isfinite(err):
                return err
            worst = max(worst, err)
        start += c
    return worst


def heat(fn, ms: float = 300.0) -> None:
    """cutlass_moe.bench.heat, here because the old build's bench may predate it and both builds
    must be timed alike: fn back to back for `ms` milliseconds, untimed."""
    import torch
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < ms:
        fn()
        torch.cuda.synchronize()


def worst_expert_rel_wgrad(dw, x, dy, counts) -> float:
    """worst_expert_rel for a weight gradient: dW[e] against x_e^T dy_e in float32; an expert with no
    rows must be exact zeros. One expert at a time, not cutlass_moe.moe_gemm_wgrad_reference: that
    builds every expert's float32 dW at once (30 GB on DeepSeek-V3's shapes), and it comes from the
    build under test."""
    worst, start = 0.0, 0
    for e, c in enumerate(counts.tolist()):
        if c:
            ref = x[start:start + c].float().t() @ dy[start:start + c].float()
            err = float((dw[e].float() - ref).norm()) / max(float(ref.norm()), 1e-30)
            if not math.isfinite(err):
                return err
            worst = max(worst, err)
        elif bool(dw[e].any()):
            return math.inf
        start += c
    return worst


def counts_digest(counts) -> str:
    return hashlib.sha1(",".join(str(int(c)) for c in counts.tolist()).encode()).hexdigest()[:12]


def run(args) -> int:
    import torch

    import cutlass_moe
    from cutlass_moe import bench, moe_gemm, moe_gemm_wgrad

    where = os.path.dirname(os.path.abspath(cutlass_moe.__file__))
    print(f"ab_bench [{args.label}]: cutlass_moe from {where}", file=sys.stderr, flush=True)
    if args.expect_dir and not where.startswith(os.path.abspath(args.expect_dir) + os.sep):
        print(f"ab_bench: expected cutlass_moe under {args.expect_dir}, imported {where} (is the source tree or "
              f"another install on sys.path?)", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("ab_bench: no CUDA GPU is visible; nothing to time", file=sys.stderr)
        return 1
    try:
        build_summary = str(cutlass_moe.build_info().get("summary", ""))
        instances = list(cutlass_moe.built_configs())
    except Exception as exc:  # an old build may not have them
        build_summary, instances = f"unavailable: {exc}", []

    if args.cases_json:
        with open(args.cases_json) as f:
            cases = json.load(f)["cases"]
    else:
        cases = bench.load_cases()
    counts = bench.case_counts(cases)  # drawn over the whole list, so a filter does not change them
    if args.cases:
        wanted = set(args.cases.split(","))
        unknown = wanted - {c["name"] for c in cases}
        if unknown:
            print(f"ab_bench: unknown case(s): {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        cases = [c for c in cases if c["name"] in wanted]

    device = torch.cuda.get_device_name()
    rows = []
    failed = []
    started = time.time()
    for i, case in enumerate(cases):
        t, k, n, e = case["T"], case["K"], case["N"], case["E"]
        c = counts[case["name"]]
        print(f"[{i + 1}/{len(cases)}] {case['name']} (E={e} T={t} K={k} N={n})", file=sys.stderr, flush=True)
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        if args.wgrad:
            dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        else:
            w = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16, generator=gen) * (k ** -0.5)
        counts_gpu = c.to("cuda", torch.int32)
        row: Dict[str, object] = {"name": case["name"], "E": e, "T": t, "K": k, "N": n,
                                  "counts_sha1": counts_digest(c),
                                  "floor_ms": None if args.wgrad else
                                  bench.floor_ms(case, c, bench.H200_TFLOPS, bench.H200_TBPS)}
        fns = {}
        for label, kwargs in (WGRAD_RUNNERS if args.wgrad else RUNNERS).items():
            if args.wgrad:
                fn = (lambda kwargs=kwargs: moe_gemm_wgrad(x, dy, counts_gpu, **kwargs))
            else:
                fn = (lambda kwargs=kwargs: moe_gemm(x, w, counts_gpu, **kwargs))
            row[f"{label}_ms"] = None
            try:
                y = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # e.g. a backend the old build does not have
                row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"  {label}: {row[f'{label}_error']}", file=sys.stderr)
                continue
            if not args.no_check:
                err = worst_expert_rel_wgrad(y, x, dy, c) if args.wgrad else worst_expert_rel(y, x, w, c)
                row[f"{label}_worst_rel"] = err
                if not err <= MAX_REL_ERR:
                    failed.append(f"{case['name']}:{label}")
            del y
            fns[label] = fn
        if fns:  # a cool GPU boosts: the first runner timed after the checks would read fast
            heat(next(iter(fns.values())))
        for order in (list(fns), list(reversed(fns)))[:args.passes]:
            for label in order:
                ms = bench._do_bench(fns[label], args.warmup_ms, args.rep_ms)
                best = row[f"{label}_ms"]
                row[f"{label}_ms"] = ms if best is None else min(ms, best)
        print("  " + "  ".join(f"{label} {row[f'{label}_ms']:.4f} ms" for label in fns), file=sys.stderr, flush=True)
        rows.append(row)
        del x, counts_gpu, fns
        dy = w = None
        torch.cuda.empty_cache()

    result = {"label": args.label, "rev": args.rev, "device": device, "torch": torch.__version__,
              "cutlass_moe_file": os.path.abspath(cutlass_moe.__file__), "build_info": build_summary,
              "built_configs": instances, "wgrad": args.wgrad, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
              "passes": args.passes,
              "seconds": round(time.time() - started, 1), "cases": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"ab_bench [{args.label}]: wrote {os.path.abspath(args.json)} ({time.time() - started:.0f} s)",
              file=sys.stderr)
    if failed:
        print(f"ab_bench [{args.label}]: FAILED the float32 check (rel err > {MAX_REL_ERR:g}): {', '.join(failed)}",
              file=sys.stderr)
        return 2
    return 0


# ---- summary --------------------------------------------------------------------------------------
def load_runs(paths: List[str]) -> List[dict]:
    """Each file is one run (ab_bench.py --json), or a merged file {"runs": [...]}."""
    runs = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for r in data.get("runs", [data]):
            r.setdefault("_file", os.path.basename(path))
            runs.append(r)
    return runs


def _spread(values: List[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def summarize(paths: List[str], baseline: str, candidate: str, out_path: Optional[str],
              merge_into: Optional[str] = None) -> int:
    runs = load_runs(paths)
    if merge_into:  # all rounds in one file (the device tool brings back only a few files)
        with open(merge_into, "w") as f:
            json.dump({"runs": runs}, f, indent=1)
        print(f"merged {len(runs)} runs into {os.path.abspath(merge_into)}", file=sys.stderr)
    by_label: Dict[str, List[dict]] = {}
    for r in runs:
        by_label.setdefault(r.get("label", "?"), []).append(r)
    missing = [lb for lb in (baseline, candidate) if lb not in by_label]
    if missing:
        print(f"ab_bench --summarize: no run labelled {', '.join(missing)} in {len(paths)} file(s) "
              f"(labels: {', '.join(sorted(by_label)) or 'none'})", file=sys.stderr)
        return 2
    old_runs, new_runs = by_label[baseline], by_label[candidate]

    def values(group: List[dict], case: str, runner: str) -> List[float]:
        vals = []
        for r in group:
            for row in r.get("cases", []):
                if row.get("name") == case and isinstance(row.get(f"{runner}_ms"), (int, float)):
                    vals.append(float(row[f"{runner}_ms"]))
        return vals

    # The runners the rounds timed: the forward's, or the weight gradient's (--wgrad).
    runners = [lb for lb in (*RUNNERS, *WGRAD_RUNNERS)
               if any(f"{lb}_ms" in row or f"{lb}_error" in row for r in runs for row in r.get("cases", []))]
    names: List[str] = []
    shapes: Dict[str, set] = {}
    floors: Dict[str, float] = {}
    errors: Dict[tuple, str] = {}
    for r in old_runs + new_runs:
        for row in r.get("cases", []):
            if row["name"] not in names:
                names.append(row["name"])
            shapes.setdefault(row["name"], set()).add(
                (row.get("E"), row.get("T"), row.get("K"), row.get("N"), row.get("counts_sha1")))
            floors.setdefault(row["name"], row.get("floor_ms"))
            for runner in runners:
                if f"{runner}_error" in row:
                    errors[(r.get("label"), row["name"], runner)] = row[f"{runner}_error"]

    device = sorted({r.get("device", "?") for r in runs})
    revs = {lb: sorted({str(r.get("rev") or "?") for r in by_label[lb]}) for lb in (baseline, candidate)}
    lines = [f"A/B: {baseline} = {', '.join(revs[baseline])} ({len(old_runs)} rounds), "
             f"{candidate} = {', '.join(revs[candidate])} ({len(new_runs)} rounds); device: {', '.join(device)}",
             "medians over rounds (ms); spread = (max - min) / median over one build's rounds; verdict REGRESSION "
             "where new > old * (1 + 2% + the larger spread)"]
    head = (f"{'case':<20} {'runner':<8} {'old ms':>9} {'new ms':>9} {'old spr':>8} {'new spr':>8} {'new/old':>8} "
            f"{'%floor':>7}  verdict")
    lines += [head, "-" * len(head)]
    regressions = []
    ratios: Dict[str, List[float]] = {runner: [] for runner in runners}
    for name in names:
        for runner in runners:
            old, new = values(old_runs, name, runner), values(new_runs, name, runner)
            if not old and not new and not any(key[1:] == (name, runner) for key in errors):
                continue
            if not old or not new:
                which = [lb for lb, v in ((baseline, old), (candidate, new)) if not v]
                err = next((errors[(lb, name, runner)] for lb in which if (lb, name, runner) in errors), "")
                lines.append(f"{name:<20} {runner:<8} {_cell(old):>9} {_cell(new):>9} {'':>8} {'':>8} {'':>8} {'':>7}  "
                             f"MISSING in {'/'.join(which)}" + (f" ({err[:60]})" if err else ""))
                continue
            old_med, new_med = statistics.median(old), statistics.median(new)
            old_spr, new_spr = _spread(old), _spread(new)
            ratio = new_med / old_med
            ratios[runner].append(ratio)
            verdict = "REGRESSION" if new_med > old_med * (1 + 0.02 + max(old_spr, new_spr)) else "ok"
            if verdict == "REGRESSION":
                regressions.append(f"{name}:{runner}")
            floor = floors.get(name)
            frac = f"{100 * floor / new_med:6.1f}%" if isinstance(floor, (int, float)) and new_med > 0 else "-"
            lines.append(f"{name:<20} {runner:<8} {old_med:9.4f} {new_med:9.4f} {100 * old_spr:7.1f}% "
                         f"{100 * new_spr:7.1f}% {ratio:8.3f} {frac:>7}  {verdict}")
    lines.append("")
    for runner, rs in ratios.items():
        if rs:
            geo = math.exp(sum(math.log(x) for x in rs) / len(rs))
            lines.append(f"geomean new/old, {runner:<8}: {geo:.3f} over {len(rs)} cases "
                         f"(best {min(rs):.3f}, worst {max(rs):.3f})")
    mismatched = [n for n, s in shapes.items() if len(s) > 1]
    if mismatched:
        lines.append(f"WARNING: the builds timed different problems (shape or counts) for: {', '.join(mismatched)}")
    lines.append(f"{len(regressions)} regression(s)" + (f": {', '.join(regressions)}" if regressions else ""))
    text = "\n".join(lines)
    print(text)
    if out_path:
        with open(out_path, "w") as f:
            f.write(text + "\n")
        print(f"wrote {os.path.abspath(out_path)}", file=sys.stderr)
    return 3 if regressions else 0


def _cell(vals: List[float]) -> str:
    return f"{statistics.median(vals):.4f}" if vals else "-"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="new", help="this build's name in the JSON (old, new)")
    parser.add_argument("--rev", default="", help="what this build is (a git revision), for the summary")
    parser.add_argument("--json", default="", help="where to write this run's results")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--cases-json", default="",
                        help="read the cases from this cases.json instead of the imported package's (so two builds "
                             "time the same list)")
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--passes", type=int, choices=[1, 2], default=2,
                        help="timing passes per case, the second in reverse runner order (default 2, as the bench)")
    parser.add_argument("--no-check", action="store_true", help="skip the float32 reference check")
    parser.add_argument("--wgrad", action="store_true",
                        help="time the weight gradient (moe_gemm_wgrad, dW in bf16) instead of the forward")
    parser.add_argument("--expect-dir", default="",
                        help="fail unless cutlass_moe is imported from under this directory")
    parser.add_argument("--summarize", nargs="+", metavar="JSON",
                        help="summarize these runs' JSON files instead of timing (exit 3 if any REGRESSION)")
    parser.add_argument("--baseline", default="old", help="label of the baseline runs in --summarize")
    parser.add_argument("--candidate", default="new", help="label of the candidate runs in --summarize")
    parser.add_argument("--summary-out", default=None,
                        help="where --summarize writes its table (default: ab_summary.txt beside the first JSON)")
    parser.add_argument("--merge-into", default="",
                        help="with --summarize: also write every run into this one JSON file ({\"runs\": [...]}, "
                             "which --summarize reads too)")
    args = parser.parse_args(argv)
    if args.summarize:
        out = args.summary_out
        if out is None:
            out = os.path.join(os.path.dirname(os.path.abspath(args.summarize[0])), "ab_summary.txt")
        return summarize(args.summarize, args.baseline, args.candidate, out or None, args.merge_into or None)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
