"""The premise of a hybrid MoE tile (issue 12), timed with the kernels we have: 128-row cooperative
units for an expert's full 128-row blocks (and for a last block of more than 64 rows), and 64-row
wide units (64 x 512, the two consumers sharing the x box) for a last block of at most 64 rows. Such
a kernel pads an expert to 64 rows where the cooperative tile pads to 128, while most units keep the
cooperative tile's single read of each weight tile per 128 rows.

For each case (the bench's split `c`), with tail = c % 128 and short = 0 < tail <= 64:
  coop          the cooperative tile on c (all 128-row units; the short tails padded to 128)
  wide          the wide tile on c (all 64-row units)
  auto          moe_gemm's default pick
  coop A        the cooperative tile on c_A = c - tail * short (the rows a hybrid gives to 128-row units)
  wide B        the wide tile on c_B = tail * short (the rows a hybrid gives to 64-row units)
  A + B         coop A then wide B, back to back: an upper bound of the hybrid's time. It pays a
                second launch and its tail, and wide B re-reads from DRAM the weight tiles that coop A
                read (a hybrid would find them in L2 in the same round).
`out=` is passed, so that no launch zeroes rows it does not own. Times: bench.median_of_rounds.

To run (on the GPU machine, the package installed): python3 benchmarks/hybrid_premise.py [--rounds 3]
"""
from __future__ import annotations

import argparse

import torch

import cutlass_moe
from cutlass_moe import bench

COOP = "sm90_cooperative_128x256x64_1x1x1"
WIDE = "sm90_cooperative_wide_64x512x32_1x1x1"
CASES = "qwen3-30b-prefill,gptoss-120b-prefill,dsv3-prefill,seed000-g64,seed000-g128,seed000-g32"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default=CASES)
    args = parser.parse_args()
    cases = {c["name"]: c for c in bench.load_cases()}
    counts_by_case = bench.case_counts(list(cases.values()))
    print(f"hybrid_premise on {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.rounds} rounds")
    print(f"{'case':<22} {'pad coop':>8} {'pad hyb':>8} {'coop':>7} {'wide':>7} {'auto':>7} {'coop A':>7} "
          f"{'wide B':>7} {'A + B':>7} {'(A+B)/min(coop,wide,auto)':>26}")
    for name in args.cases.split(","):
        case = cases[name]
        t, k, n, e = case["T"], case["K"], case["N"], case["E"]
        c = counts_by_case[name].to(torch.int64)
        tail = c % 128
        short = (tail > 0) & (tail <= 64)
        c_a, c_b = c - tail * short, tail * short
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
        out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
        dev = {key: v.to("cuda", torch.int32) for key, v in (("c", c), ("a", c_a), ("b", c_b))}

        def run(counts, config):
            return lambda: cutlass_moe.moe_gemm(x, w, dev[counts], out=out, backend="moe", config=config)

        runners = {"coop": run("c", COOP), "wide": run("c", WIDE),
                   "auto": lambda: cutlass_moe.moe_gemm(x, w, dev["c"], out=out),
                   "coop A": run("a", COOP), "wide B": run("b", WIDE)}
        coop_a, wide_b = runners["coop A"], runners["wide B"]
        runners["A + B"] = lambda: (coop_a(), wide_b())
        ms = bench.median_of_rounds(runners, args.rounds)
        pad_coop = float(((c + 127) // 128 * 128).sum()) / float(c.sum())
        pad_hyb = float(((c_a + 127) // 128 * 128 + (c_b + 63) // 64 * 64).sum()) / float(c.sum())
        best = min(ms["coop"], ms["wide"], ms["auto"])
        print(f"{name:<22} {pad_coop:8.3f} {pad_hyb:8.3f} " + " ".join(f"{ms[r]:7.4f}" for r in runners)
              + f" {ms['A + B'] / best:26.3f}")
        del x, w, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
