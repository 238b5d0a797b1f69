"""Scratch A/B of the bf16 MoE wgrad's modes, chosen per call by an environment switch that a wip
patch reads on the host: median of alternating rounds over the public cases, each mode against the
first, in one process (one build). Modes listed as exact are asserted bitwise equal to the first
mode's dW, both dW layouts, on every case before timing.

  python3 wgrad_scratch_probe.py SWITCH MODES [EXACT] [ROUNDS=5]     (run from outside the tree)

Several switches at once: SWITCH is a comma-separated list and MODES (and EXACT) comma-separated
settings with one character per switch, e.g. `wgrad_scratch_probe.py A,B 00,10,03,13`.

The patches and their switches (benchmarks/NOTES.md, thirty-seventh session):
- wgrad_direct_stores.patch, CUTLASS_MOE_SCRATCH_WGRAD_DIRECT: 0 today (stmatrix into shared
  memory, the store warp's TMA store); 1 and 2 straight from the consumers' registers (32-bit stores;
  16-byte stores after a quad transpose); 3 no stores (wrong dW: the mainloop alone); 4 only the
  staging writes, nothing stored (wrong dW); 5 the store warp copies with LDS + STG instead of TMA;
  6 every slice handed over, none stored (wrong dW: the handshake alone); 7 consumer 0's slices
  stored, consumer 1's handed over only (wrong dW: half the writes); 8 mode 4 without the proxy
  fence; 9 today's path without the fence before each hand-over (timing only: stale data possible).
  E.g. `wgrad_scratch_probe.py CUTLASS_MOE_SCRATCH_WGRAD_DIRECT 01234567 125`.
- wgrad_half_b.patch, CUTLASS_MOE_SCRATCH_WGRAD_HALFB: 1 loads half of B's boxes per CTA (wrong dW:
  the L2 reads a 2-CTA multicast of B would save, without its lockstep). With the patch above too:
  `wgrad_scratch_probe.py CUTLASS_MOE_SCRATCH_WGRAD_HALFB,CUTLASS_MOE_SCRATCH_WGRAD_DIRECT 00,10,03,13 "" 5`.
- wgrad_cache_hints.patch, CUTLASS_MOE_SCRATCH_WGRAD_HINT: bit 0 dW's stores EVICT_FIRST, bit 1 the
  operands' loads EVICT_LAST (all exact). `wgrad_scratch_probe.py CUTLASS_MOE_SCRATCH_WGRAD_HINT 0123 123 5`.
- wgrad_expert_groups.patch, CUTLASS_MOE_SCRATCH_WGRAD_GROUP,CUTLASS_MOE_SCRATCH_WGRAD_EVICT: groups of
  s experts (or light-heavy pairs, p) take turns tile by tile, with dW's stores EVICT_FIRST or not
  (all exact); the command is in the patch's header. Measured and rejected (thirty-ninth session).
- wgrad_fence_placement.patch, CUTLASS_MOE_SCRATCH_WGRAD_FENCE: where the proxy fence before each
  TMA store sits: 0 in every consumer thread, 1 the store warp's leader after the handshake, 2 lane 1
  of the store warp, 4 the whole store warp, 3 none (timing only). Measured: all within 1% (thirty-
  ninth session). `wgrad_scratch_probe.py CUTLASS_MOE_SCRATCH_WGRAD_FENCE 01243 124 5`.
- wgrad_consumer_stagger.patch, CUTLASS_MOE_SCRATCH_WGRAD_STAGGER: consumer 1 starts 500 x the digit
  cycles late. Measured: flat (thirty-ninth session).
  `wgrad_scratch_probe.py CUTLASS_MOE_SCRATCH_WGRAD_STAGGER 01248 1248 5`.
- wgrad_five_buffers.patch, CUTLASS_MOE_SCRATCH_WGRAD_BUFFERS: 4 or 5 store buffers per consumer in
  use (five allocated; 3 stages either way). `wgrad_scratch_probe.py CUTLASS_MOE_SCRATCH_WGRAD_BUFFERS 45 5`."""
import math
import os
import sys

import torch

from cutlass_moe import bench, moe_gemm_wgrad

switches = sys.argv[1].split(",")
split = (lambda v: v.split(",")) if len(switches) > 1 else list
modes = split(sys.argv[2])
exact = split(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else []
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 5
base_mode = modes[0]
cases = bench.load_cases()
counts = bench.case_counts(cases)


def set_mode(mode):
    for switch, value in zip(switches, mode, strict=True):
        os.environ[switch] = value


def with_mode(mode, fn):
    def run():
        set_mode(mode)
        return fn()
    return run


runners = {}
for case in cases:
    t, k, n, e = case["T"], case["K"], case["N"], case["E"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    c = counts[case["name"]].to("cuda", torch.int32)
    if exact:
        for trans_b in (False, True):
            set_mode(base_mode)
            ref = moe_gemm_wgrad(x, dy, c, trans_b=trans_b, backend="moe")
            for m in exact:
                set_mode(m)
                assert torch.equal(ref, moe_gemm_wgrad(x, dy, c, trans_b=trans_b, backend="moe")), (case["name"], m)
            del ref
    for m in modes:
        runners[f"{case['name']} | {m}"] = with_mode(m, lambda x=x, dy=dy, c=c: moe_gemm_wgrad(x, dy, c, backend="moe"))
if exact:
    print(f"modes {exact}: dW bitwise equal to mode {base_mode}'s on every case, both layouts", flush=True)
set_mode(base_mode)
med = bench.median_of_rounds(runners, rounds)
logs = {m: [] for m in modes[1:]}
for case in cases:
    base = med[f"{case['name']} | {base_mode}"]
    line = f"{case['name']:22s} mode {base_mode} {base:.4f} ms"
    for m in modes[1:]:
        r = med[f"{case['name']} | {m}"] / base
        logs[m].append(math.log(r))
        line += f"  {m}/{base_mode} {r:.3f}"
    print(line, flush=True)
for m, v in logs.items():
    print(f"geomean mode {m}/{base_mode}: {math.exp(sum(v) / len(v)):.3f}")
