"""Reads the wgrad kernel's per-K-block clock64() trace (benchmarks/wip/wgrad_block_trace.patch: CTA 0's
first 64 tiles, thread 0 of each consumer; the bf16 -> bf16 cooperative instance with deferred stores).

Build (a reduced build is enough; ptxas warnings must not fail it):
  git apply benchmarks/wip/wgrad_block_trace.patch
  pip install --no-index --no-deps --no-build-isolation -C cmake.define.CUTLASS_MOE_DTYPES=kBFloat16 \
      -C cmake.define.CUTLASS_MOE_WEIGHT_LAYOUTS=kKN -C cmake.define.CUTLASS_MOE_PTXAS_WERROR=OFF .
Run (from outside the source tree): python3 wgrad_block_trace.py [--case NAME ...]  (TRACE_DUMP=DIR: raw stamps)
Slots per tile: 0 loop top, 1 the tile's record taken, 2 mma_pipelined called, 3 it returned (every block
issued), 20 mma_tail done, 21 hold() done; K block k < 4: 4 + 4k + p, p = 0 its stage's data waited for,
1 its MMAs issued (committed), 2 the previous block's MMAs done and their stage released, 3 its hook done.
"""
import ctypes
import glob
import json
import os
import statistics
import sys

import torch

import cutlass_moe
from cutlass_moe import bench

SYMBOL = "cutlass_moe_block_trace_kBFloat16_kBFloat16_kSm90Cooperative_128x256x64_1x1x1"
SLOTS = 24


def trace_fn():
    here = os.path.dirname(cutlass_moe.__file__)
    for path in glob.glob(os.path.join(here, "*.so")):
        lib = ctypes.CDLL(path)
        if hasattr(lib, SYMBOL):
            fn = getattr(lib, SYMBOL)
            fn.argtypes = [ctypes.POINTER(ctypes.c_longlong), ctypes.c_int]
            return fn
    raise RuntimeError(f"{SYMBOL} not found: build with the patch")


def run(label, t, e, k, n, counts, fn):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=g)
    dw = torch.empty(e, k, n, device="cuda", dtype=torch.bfloat16)
    counts = counts.to("cuda", torch.int32)
    call = lambda: cutlass_moe.moe_gemm_wgrad(x, dy, counts, out=dw, backend="moe")
    for _ in range(30):
        call()
    torch.cuda.synchronize()
    buf = (ctypes.c_longlong * (2 * 64 * SLOTS))()
    assert fn(buf, 1) == 0
    call()
    torch.cuda.synchronize()
    assert fn(buf, 0) == 0
    if os.environ.get("TRACE_DUMP"):
        with open(os.path.join(os.environ["TRACE_DUMP"], label.split()[0] + ".json"), "w") as f:
            json.dump(list(buf), f)
    at = lambda c, i, p: buf[(c * 64 + i) * SLOTS + p]
    print(f"{label}: medians over the tiles of CTA 0 (cycles)")
    for c in (0, 1):
        tiles = [i for i in range(1, 62) if at(c, i, 21) and at(c, i + 1, 0)]
        by_blocks = {}
        for i in tiles:
            blocks = sum(1 for b in range(4) if at(c, i, 4 + 4 * b + 1))
            by_blocks.setdefault(blocks, []).append(i)
        for blocks, ids in sorted(by_blocks.items()):
            rows = []
            for i in ids:
                p = lambda s: at(c, i, s)
                r = {"take": p(1) - p(0), "setup": p(2) - p(1)}
                prev = p(2)
                for b in range(blocks):
                    base = 4 + 4 * b
                    r[f"b{b} wait"] = p(base) - prev
                    r[f"b{b} issue"] = p(base + 1) - p(base)
                    r[f"b{b} mma-wait"] = p(base + 2) - p(base + 1)
                    r[f"b{b} hook"] = p(base + 3) - p(base + 2)
                    prev = p(base + 3)
                r["return"] = p(3) - prev
                r["tail"] = p(20) - p(3)
                r["hold"] = p(21) - p(20)
                r["loop"] = at(c, i + 1, 0) - p(21)
                r["TILE"] = at(c, i + 1, 0) - p(0)
                rows.append(r)
            med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
            print(f"  consumer {c}, {blocks}-block tiles ({len(ids)}): " + ", ".join(f"{k} {v:.0f}" for k, v in med.items()))


def main():
    fn = trace_fn()
    args = sys.argv[1:] or ["--case", "qwen3-30b-prefill"]
    cases = {c["name"]: c for c in bench.load_cases()}
    split = bench.case_counts(list(cases.values()))
    i = 0
    while i < len(args):
        if args[i] == "--case":
            c = cases[args[i + 1]]
            run(f"{c['name']} (its split)", c["T"], c["E"], c["K"], c["N"], split[c["name"]], fn)
            i += 2
        else:
            e, t, k, n = (int(v) for v in args[i].split(","))
            run(f"{args[i]} (uniform)", t, e, k, n, torch.full((e,), t // e, dtype=torch.int32), fn)
            i += 1


if __name__ == "__main__":
    main()
