"""Reads the wgrad kernel's per-tile clock64() trace (benchmarks/wip/wgrad_tile_trace.patch: CTA 0's
first 64 tiles, lane 0 of each consumer and the producer; the bf16 -> bf16 cooperative instance).

Build (a reduced build is enough; the stamps may cost spills, so ptxas warnings must not fail it):
  git apply benchmarks/wip/wgrad_tile_trace.patch
  pip install --no-index --no-deps --no-build-isolation -C cmake.define.CUTLASS_MOE_DTYPES=kBFloat16 \
      -C cmake.define.CUTLASS_MOE_WEIGHT_LAYOUTS=kKN -C cmake.define.CUTLASS_MOE_PTXAS_WERROR=OFF .
  The patch's scratch macro CUTLASS_MOE_WGRAD_BUFFERS sets the wgrad's store buffers per consumer
  (default 4): CUDAFLAGS=-DCUTLASS_MOE_WGRAD_BUFFERS=5 before the build.
The consumer's point 7 and the stage() calls' points 6 and 7 were added after the thirty-fifth
session's runs (benchmarks/NOTES.md): compiled, not yet run.
Run (from outside the source tree): python3 wgrad_tile_trace.py [E,T,K,N ...] [--case NAME ...]
  TRACE_DUMP=DIR also writes each case's raw stamps to DIR/<case>.json (both traces share CTA 0's clock).
Consumer points per tile: 0 loop top, 1 the tile's record taken, 7 mma_pipelined entered, 2 block 0's
hook entered (its MMAs issued), 3 the hook done (slice 0 of the held tile staged), 4 every block
issued, 5 mma_tail done, 6 hold() done. Per stage() call (thread 0 of each consumer): 6 store_slice
entered, 7 stage() about to be called, 0 stage() entered, 1 store wait done, 2 barrier, 3 staged,
4 fence and barrier, 5 the TMA store issued. Producer points: 0 loop top, 1 tile found, 2 block 0's
stage acquired, 3 the last block's stage acquired.
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

SYMBOL = "cutlass_moe_wgrad_trace_kBFloat16_kBFloat16_kSm90Cooperative_128x256x64_1x1x1"
STAGE_SYMBOL = "cutlass_moe_stage_trace_kBFloat16_kBFloat16_kSm90Cooperative_128x256x64_1x1x1"


def trace_fn():
    here = os.path.dirname(cutlass_moe.__file__)
    for path in glob.glob(os.path.join(here, "*.so")):
        lib = ctypes.CDLL(path)
        if hasattr(lib, SYMBOL):
            fns = [getattr(lib, SYMBOL), getattr(lib, STAGE_SYMBOL, None)]
            for f in fns:
                if f is not None:
                    f.argtypes = [ctypes.POINTER(ctypes.c_longlong), ctypes.c_int]
            return fns
    raise RuntimeError(f"{SYMBOL} not found: build with the patch")


def run(label, t, e, k, n, counts, fns):
    fn, stage_fn = fns
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=g)
    dw = torch.empty(e, k, n, device="cuda", dtype=torch.bfloat16)
    counts = counts.to("cuda", torch.int32)
    call = lambda: cutlass_moe.moe_gemm_wgrad(x, dy, counts, out=dw, backend="moe")
    for _ in range(30):
        call()
    torch.cuda.synchronize()
    buf = (ctypes.c_longlong * (3 * 64 * 8))()
    sbuf = (ctypes.c_longlong * (2 * 64 * 8))()
    assert fn(buf, 1) == 0
    if stage_fn is not None:
        assert stage_fn(sbuf, 1) == 0
    call()
    torch.cuda.synchronize()
    assert fn(buf, 0) == 0
    if stage_fn is not None:
        assert stage_fn(sbuf, 0) == 0
        for c in (0, 1):
            calls = [j for j in range(4, 60) if sbuf[(c * 64 + j) * 8 + 5]]
            seg = lambda a, b: statistics.median(sbuf[(c * 64 + j) * 8 + b] - sbuf[(c * 64 + j) * 8 + a] for j in calls)
            print(f"  stage() of consumer {c}, thread 0, medians over {len(calls)} slices: store wait {seg(0, 1):.0f}, "
                  f"barrier {seg(1, 2):.0f}, stmatrix {seg(2, 3):.0f}, fence + barrier {seg(3, 4):.0f}, "
                  f"issue {seg(4, 5):.0f}, whole {seg(0, 5):.0f}")
            print(f"    store_slice() before stage(): {seg(6, 7):.0f}; stage() entry to its first stamp: {seg(7, 0):.0f}")
    if os.environ.get("TRACE_DUMP"):  # the raw stamps, to align the two traces offline
        with open(os.path.join(os.environ["TRACE_DUMP"], label.split()[0] + ".json"), "w") as f:
            json.dump({"tiles": list(buf), "stages": list(sbuf)}, f)
    at = lambda role, tile, point: buf[(role * 64 + tile) * 8 + point]
    tiles = [i for i in range(64) if at(0, i, 6) and at(1, i, 6) and at(0, i + 1 if i < 63 else i, 0)]
    tiles = [i for i in tiles if i + 1 < 64 and at(0, i + 1, 0)]
    mid = tiles[1:-1] or tiles
    print(f"{label}: {len(tiles)} tiles traced (medians over tiles 1..n-2, cycles)")
    for c in (0, 1):
        parts = {
            "take the tile": [at(c, i, 1) - at(c, i, 0) for i in mid],
            "to mma_pipelined": [at(c, i, 7) - at(c, i, 1) for i in mid],
            "to block 0 issued": [at(c, i, 2) - at(c, i, 7) for i in mid],
            "block 0 hook": [at(c, i, 3) - at(c, i, 2) for i in mid],
            "blocks 1.. issued": [at(c, i, 4) - at(c, i, 3) for i in mid],
            "mma_tail": [at(c, i, 5) - at(c, i, 4) for i in mid],
            "hold": [at(c, i, 6) - at(c, i, 5) for i in mid],
            "loop to next top": [at(c, i + 1, 0) - at(c, i, 6) for i in mid],
            "whole tile": [at(c, i + 1, 0) - at(c, i, 0) for i in mid],
        }
        print(f"  consumer {c}: " + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in parts.items()))
    stagger = [at(1, i, 5) - at(0, i, 5) for i in mid]
    lead = [at(0, i, 2) - at(2, i, 2) for i in mid]
    sched_p = [at(2, i, 1) - at(2, i, 0) for i in mid]
    print(f"  consumer 1 - consumer 0 at mma_tail done: median {statistics.median(stagger):.0f} "
          f"(min {min(stagger)}, max {max(stagger)})")
    print(f"  producer: scheduler {statistics.median(sched_p):.0f}; block 0's stage acquired before consumer 0 "
          f"issued it: median {statistics.median(lead):.0f} (min {min(lead)}, max {max(lead)})")
    print("  first tiles (consumer 0, points 0..6 relative to point 0):",
          [[at(0, i, p) - at(0, i, 0) for p in range(7)] for i in tiles[:3]])


def main():
    fn = trace_fn()
    args = sys.argv[1:] or ["128,32768,2048,1536", "--case", "qwen3-30b-prefill"]
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
