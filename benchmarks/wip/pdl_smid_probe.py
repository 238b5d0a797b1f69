"""Where and when the sm90 MoE kernel's CTAs start: a plain launch against the plan's second launch
made a programmatic dependent (PDL), which ran 5-18% slower (benchmarks/NOTES.md, "The second launch
under PDL"). Needs a build with benchmarks/wip/pdl_smid_probe.patch applied: each CTA that computes
prints its blockIdx, %smid, and %globaltimer at entry and after the split test.

To run (on the GPU machine, from outside the source tree, after the patched build):
  python3 pdl_smid_probe.py > probe.log
It prints, per launch, the spread of the CTAs' entry and start times, and how many CTAs sit on the
SM the plain launch gave them.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import torch

import cutlass_moe

PINGPONG = "sm90_pingpong_64x256x64_1x1x1"
T, E, K, N = 32768, 256, 2048, 7168  # DeepSeek-V3's down projection at 128 rows: the plan holds two configs


def child(mode: str) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from sweep import split_counts
    counts = split_counts(E, T, "random", seed=2).to("cuda", torch.int32)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16) * K ** -0.5
    assert cutlass_moe.aligned_config(T, E, N, K) is not None
    for _ in range(3):
        if mode == "plain":
            cutlass_moe.moe_gemm(x, w, counts, backend="moe", config=PINGPONG)
        else:
            cutlass_moe.moe_gemm(x, w, counts)
        torch.cuda.synchronize()
        print("LAUNCH-END", flush=True)


def summarize(mode: str, text: str) -> dict:
    launches, current = [], []
    for line in text.splitlines():
        m = re.match(r"PROBE gate=(\d+) cta=(\d+) sm=(\d+) entry=(\d+) start=(\d+)", line)
        if m:
            current.append(tuple(int(v) for v in m.groups()))
        elif line.startswith("LAUNCH-END"):
            launches.append(current)
            current = []
    last = launches[-1]  # the third call: warm
    entry = [r[3] for r in last]
    start = [r[4] for r in last]
    sm_of = {r[1]: r[2] for r in last}
    print(f"{mode}: {len(last)} CTAs, gate {last[0][0]}; entry spread {(max(entry) - min(entry)) / 1e3:.1f} us, "
          f"start spread {(max(start) - min(start)) / 1e3:.1f} us; waited at most "
          f"{max(s - e for s, e in zip(start, entry)) / 1e3:.1f} us")
    order = sorted(last, key=lambda r: r[4])
    print(f"  first 16 CTAs by start: {[r[1] for r in order[:16]]}")
    print(f"  SMs of CTAs 0-15: {[sm_of.get(c) for c in range(16)]}")
    return sm_of


def main() -> None:
    if len(sys.argv) > 1:
        child(sys.argv[1])
        return
    maps = {}
    for mode in ("plain", "pdl"):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), mode], capture_output=True, text=True,
                             check=True).stdout
        maps[mode] = summarize(mode, out)
    same = sum(1 for c, sm in maps["plain"].items() if maps["pdl"].get(c) == sm)
    print(f"CTAs on the same SM in both launches: {same} of {len(maps['plain'])}")


if __name__ == "__main__":
    main()
