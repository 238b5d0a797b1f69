"""A fluid model of the MoE wgrad's time on a split, and of tile orders that mix experts (CPU only).

Each expert's tiles (ceil(M / 128) x ceil(N / 256), all of them whatever its rows) cost, spread over
132 SMs, the larger of their MMAs and their stores: a tile's MMAs take --block cycles per K block
of 64 rows (a partial block costs a whole one) plus --tile cycles for the tile's transition, at
--clock GHz; its 64 KB of bf16 dW go out at --write TB/s shared by all SMs. Experts that run at the
same time (an order's group) add their MMAs and their stores before the max. With the costs the
thirty-sixth session traced (1,250 cycles per block, 1,300 per tile) the model gives dsv3's,
gpt-oss's and qwen3-30b's wgrad on the bench's splits as 5.24 / 1.58 / 0.415 ms (measured
5.47-5.87 / 1.58-1.60 / 0.42-0.43). It knows nothing of L2: an order that mixes experts costs L2
reuse that the model does not charge (benchmarks/NOTES.md, thirty-eighth session). Measured in the
thirty-ninth session, the orders it forecast at 0.91-0.98 ran 1.01-1.09x slower: use it for one
expert at a time only.

  python3 wgrad_fluid_model.py [--block 1250] [--tile 1300] [--clock 1.6] [--write 3.38]
"""
import argparse
import math

from cutlass_moe import bench

SHAPES = {"dsv3-prefill": (7168, 4096), "qwen3-30b-prefill": (2048, 1536), "gptoss-120b-prefill": (2880, 5760),
          "mixtral-prefill": (4096, 28672)}  # the wgrad's M and N with (E, K, N) weights: K and N

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--block", type=float, default=1250.0)
parser.add_argument("--tile", type=float, default=1300.0)
parser.add_argument("--clock", type=float, default=1.6)
parser.add_argument("--write", type=float, default=3.38)
parser.add_argument("--sms", type=int, default=132)
args = parser.parse_args()
counts_of = bench.case_counts(bench.load_cases())

for name, (m, n) in SHAPES.items():
    counts = counts_of[name].tolist()
    e = len(counts)
    tiles = math.ceil(m / 128) * math.ceil(n / 256)
    mma = lambda rows: tiles * (math.ceil(rows / 64) * args.block + args.tile) / (args.clock * 1e9) / args.sms
    store = tiles * 128 * 256 * 2 / (args.write * 1e12)

    def ms(order, group):  # experts in `order`, `group` at a time
        return 1e3 * sum(max(sum(mma(r) for r in order[i:i + group]), len(order[i:i + group]) * store)
                         for i in range(0, e, group))

    base = ms(counts, 1)
    even = e * max(mma(sum(counts) / e), store) * 1e3
    ranked = sorted(counts)
    light_heavy = [r for i in range(e // 2) for r in (ranked[i], ranked[e - 1 - i])] + ranked[e // 2:e - e // 2]
    print(f"{name:20s} expert-major {base:.3f} ms, even split {even:.3f} ms; over expert-major: "
          + ", ".join(f"groups of {g} {ms(counts, g) / base:.3f}" for g in (2, 4, 8))
          + f", light-heavy pairs {ms(light_heavy, 2) / base:.3f}")
