"""The fused MoE expert MLP (issue 11's tables): the gated gate/up projection and the down projection
with row scale (and bias), against our own plain GEMMs and against the same MLP built from
torch._grouped_mm and eager torch operations, with the same weights.

Shapes: dsv3, qwen3-30b, mixtral and gpt-oss (gate/up N = 2 x intermediate, down K = intermediate),
prefill and decode, with the public bench cases' T, E and counts (gpt-oss decode: T = 512, counts
drawn the same way). gpt-oss uses its gated form (swiglu_oai) and biases on both projections; the
others SwiGLU without biases. Every MLP scales its output rows by router weights. bf16, (E, K, N)
weights. Each time is the median over alternating rounds of do_bench medians.

Tables:
  inference (torch.no_grad()):
    gated/plain    moe_gemm_gated against moe_gemm's plain (T, 2I) projection (bar: <= 1.03)
    down/plain     moe_gemm with row_scale (+ bias) against the plain down GEMM (bar: <= 1.03)
    unfused/fused  our plain GEMMs + eager elementwise (act * up, scale, bias) against the fused MLP
    torch/fused    torch._grouped_mm + eager elementwise against the fused MLP (bar: >= 1.3 geomean, > 1 each)
  training (forward + backward of all inputs and weights):
    torch/ours     the same two MLPs with gradients (bar: > 1 on every shape)

To run on the GPU machine (after the build): python3 benchmarks/mlp_bench.py [--rounds 3] [--no-train]
[--compiled] [--ops-apart] [--paired]
--paired adds the two fused/plain ratios measured call by call (bench.paired_ratio), which the power
cap's clock does not move, and the plain GEMM against itself as the control.
"""
import argparse
import math

import torch

import cutlass_moe
from cutlass_moe import bench
from cutlass_moe.fused import _row_experts
from cutlass_moe.reference import gated_activation

MODELS = {  # name -> (hidden, intermediate, bench case prefix, gpt-oss form)
    "dsv3": (7168, 2048, "dsv3", False),
    "qwen3-30b": (2048, 768, "qwen3-30b", False),
    "mixtral": (4096, 14336, "mixtral", False),
    "gptoss-120b": (2880, 2880, "gptoss-120b", True),
}


def shapes():
    cases = bench.load_cases()
    counts = bench.case_counts(cases)
    by_name = {c["name"]: c for c in cases}
    for model, (hidden, inter, prefix, oai) in MODELS.items():
        for phase in ("prefill", "decode"):
            name = f"{prefix}-{phase}"
            if name in by_name:
                case = by_name[name]
                assert case["K"] == hidden and case["N"] == 2 * inter, name
                yield name, case["T"], case["E"], hidden, inter, oai, counts[name]
            else:  # gpt-oss decode: 128 tokens x top-4
                gen = torch.Generator().manual_seed(4321)
                e, t = 128, 512
                c = torch.rand(e, generator=gen)
                c = (c / c.sum() * t).long()
                c[-1] += t - int(c.sum())
                yield name, t, e, hidden, inter, oai, c


def geo(v):
    return math.exp(sum(map(math.log, v)) / len(v))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-train", action="store_true")
    parser.add_argument("--compiled", action="store_true",
                        help="run the fused MLP and the torch._grouped_mm MLP under torch.compile(fullgraph=True) "
                             "(the torch/fused and training tables; the per-op ratios stay eager)")
    parser.add_argument("--only", default=None, help="comma-separated shape names")
    parser.add_argument("--profile", action="store_true",
                        help="also print the top GPU kernels of one training step of each MLP (torch.profiler)")
    parser.add_argument("--ops-apart", action="store_true",
                        help="time the single GEMMs (plain and fused) in rounds of their own, apart from the three "
                             "MLPs, whose company in the rounds might move their clocks under the power cap (it "
                             "did not, measurably: benchmarks/NOTES.md, twenty-first session)")
    parser.add_argument("--paired", action="store_true",
                        help="also give each fused op's time over its plain GEMM's as bench.paired_ratio measures it "
                             "(the two calls side by side, order swapped per pair; median of the pairs' ratios), "
                             "with the plain GEMM against itself as the method's control")
    parser.add_argument("--fused-config", default=None,
                        help="also time the two fused ops with this config forced (e.g. sm90_pingpong_64x256x64_1x1x1)")
    args = parser.parse_args()
    print(f"mlp_bench on {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, rounds {args.rounds}"
          + (", the two MLPs compiled" if args.compiled else ""))
    head = (f"{'shape':<22} {'plain gu':>9} {'gated':>8} {'g/p':>6} {'plain dn':>9} {'down+':>8} {'d/p':>6} "
            f"{'unfused':>8} {'fused':>8} {'unf/f':>6} {'torch':>8} {'t/f':>6}")
    rows, train_rows = [], []
    print(head)
    for name, t, e, hidden, inter, oai, counts_cpu in shapes():
        if args.only and name not in args.only.split(","):
            continue
        dev = "cuda"
        gen = torch.Generator(device=dev).manual_seed(0)
        rnd = lambda *s, scale=1.0: (torch.randn(*s, device=dev, generator=gen) * scale).to(torch.bfloat16)
        x = rnd(t, hidden)
        gate, up = rnd(e, hidden, inter, scale=hidden ** -0.5), rnd(e, hidden, inter, scale=hidden ** -0.5)
        w_gu = cutlass_moe.interleave_gate_up(gate, up)         # ours: (E, K, 2I) interleaved
        w_cat = torch.cat([gate, up], -1)                        # torch's: [gate; up]
        del gate, up
        w_down = rnd(e, inter, hidden, scale=inter ** -0.5)
        b_gu = b_cat = b_down = None
        if oai:
            bg, bu = rnd(e, inter, scale=0.1), rnd(e, inter, scale=0.1)
            b_gu, b_cat, b_down = cutlass_moe.interleave_gate_up(bg, bu), torch.cat([bg, bu], -1), rnd(e, hidden, scale=0.1)
        act = "swiglu_oai" if oai else "silu"
        probs = torch.rand(t, device=dev, generator=gen)
        counts = counts_cpu.to(dev, torch.int32)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        expert = _row_experts(counts, t, dev)

        def expert_rows(b):  # bias rows gathered without a host sync (torch._grouped_mm has no bias)
            return torch.cat([b, b.new_zeros(1, b.shape[1])])[expert]

        def fused_mlp(x, w_gu, w_down, b_gu, b_down, probs):
            h = cutlass_moe.moe_gemm_gated(x, w_gu, counts, activation=act, bias=b_gu)
            return cutlass_moe.moe_gemm(h, w_down, counts, bias=b_down, row_scale=probs)

        def unfused_mlp():  # our plain GEMMs, then eager elementwise
            y = cutlass_moe.moe_gemm(x, w_gu, counts).float()
            if b_gu is not None:
                y = y + expert_rows(b_gu).float()
            h = gated_activation(y[:, 0::2], y[:, 1::2], act).to(torch.bfloat16)
            o = cutlass_moe.moe_gemm(h, w_down, counts).float()
            if b_down is not None:
                o = o + expert_rows(b_down).float()
            return (o * probs[:, None]).to(torch.bfloat16)

        def torch_mlp(x, w_cat, w_down, b_cat, b_down, probs):
            y = torch._grouped_mm(x, w_cat, offs=offs).float()
            if b_cat is not None:
                y = y + expert_rows(b_cat).float()
            g, u = y.chunk(2, -1)
            h = gated_activation(g, u, act).to(torch.bfloat16)
            o = torch._grouped_mm(h, w_down, offs=offs).float()
            if b_down is not None:
                o = o + expert_rows(b_down).float()
            return (o * probs[:, None]).to(torch.bfloat16)

        if args.compiled:  # Inductor fuses each MLP's elementwise work; ours calls launch-only ops
            fused_mlp, torch_mlp = (torch.compile(fn, fullgraph=True) for fn in (fused_mlp, torch_mlp))

        with torch.no_grad():
            h_plain = cutlass_moe.moe_gemm(x, w_gu, counts)
            h = cutlass_moe.moe_gemm_gated(x, w_gu, counts, activation=act, bias=b_gu)
            runners = {
                "plain_gu": lambda: cutlass_moe.moe_gemm(x, w_gu, counts),
                "gated": lambda: cutlass_moe.moe_gemm_gated(x, w_gu, counts, activation=act, bias=b_gu),
                "plain_down": lambda: cutlass_moe.moe_gemm(h, w_down, counts),
                "down": lambda: cutlass_moe.moe_gemm(h, w_down, counts, bias=b_down, row_scale=probs),
                "unfused": unfused_mlp,
                "fused": lambda: fused_mlp(x, w_gu, w_down, b_gu, b_down, probs),
                "torch": lambda: torch_mlp(x, w_cat, w_down, b_cat, b_down, probs),
            }
            if args.fused_config:
                cfg = args.fused_config
                runners["gated_cfg"] = lambda: cutlass_moe.moe_gemm_gated(x, w_gu, counts, activation=act, bias=b_gu,
                                                                          config=cfg)
                runners["down_cfg"] = lambda: cutlass_moe.moe_gemm(h, w_down, counts, bias=b_down, row_scale=probs,
                                                                   config=cfg)
            ours, theirs, unf = runners["fused"](), runners["torch"](), runners["unfused"]()
            end = int(offs[-1])
            ref = theirs[:end].float()
            err = lambda y: float((y[:end].float() - ref).norm() / ref.norm().clamp_min(1e-30))
            assert err(ours) < 3e-2 and err(unf) < 3e-2, (name, err(ours), err(unf))
            del h_plain, ours, theirs, unf
            if args.ops_apart:
                ops = {"plain_gu", "gated", "plain_down", "down", "gated_cfg", "down_cfg"}
                med = bench.median_of_rounds({k: v for k, v in runners.items() if k in ops}, args.rounds)
                med.update(bench.median_of_rounds({k: v for k, v in runners.items() if k not in ops}, args.rounds))
            else:
                med = bench.median_of_rounds(runners, args.rounds)
        r = dict(name=name, gp=med["gated"] / med["plain_gu"], dp=med["down"] / med["plain_down"],
                 uf=med["unfused"] / med["fused"], tf=med["torch"] / med["fused"])
        rows.append(r)
        print(f"{name:<22} {med['plain_gu']:9.3f} {med['gated']:8.3f} {r['gp']:6.3f} {med['plain_down']:9.3f} "
              f"{med['down']:8.3f} {r['dp']:6.3f} {med['unfused']:8.3f} {med['fused']:8.3f} {r['uf']:6.2f} "
              f"{med['torch']:8.3f} {r['tf']:6.2f}", flush=True)
        if args.paired:
            for label, base, other in (("gated/plain", "plain_gu", "gated"), ("down+/plain", "plain_down", "down"),
                                       ("plain/plain", "plain_gu", "plain_gu")):
                with torch.no_grad():
                    pr = bench.paired_ratio(runners[base], runners[other])
                r.setdefault("paired", {})[label] = pr["ratio"]
                print(f"{'':<22} paired {label}: {pr['ratio']:.4f} (quartiles {pr['ratio_p25']:.4f}-"
                      f"{pr['ratio_p75']:.4f}, {pr['pairs']} pairs; {pr['base_ms']:.3f} / {pr['other_ms']:.3f} ms)",
                      flush=True)
        if args.fused_config:
            print(f"{'':<22} with {args.fused_config}: gated {med['gated_cfg']:.3f} ms "
                  f"({med['gated_cfg'] / med['plain_gu']:.3f} of plain), down+ {med['down_cfg']:.3f} ms "
                  f"({med['down_cfg'] / med['plain_down']:.3f} of plain)", flush=True)

        if not args.no_train:
            dy = rnd(t, hidden)
            leaves = {k: v.detach().requires_grad_() for k, v in
                      dict(x=x, w_gu=w_gu, w_cat=w_cat, w_down=w_down, probs=probs).items()}
            bias_leaves = {k: (v.detach().requires_grad_() if v is not None else None) for k, v in
                           dict(b_gu=b_gu, b_cat=b_cat, b_down=b_down).items()}

            def step(fn, w_first, b_first):
                def run():
                    for v in (*leaves.values(), *bias_leaves.values()):
                        if v is not None:
                            v.grad = None
                    fn(leaves["x"], leaves[w_first], leaves["w_down"], bias_leaves[b_first], bias_leaves["b_down"],
                       leaves["probs"]).backward(dy)
                return run

            med_t = bench.median_of_rounds(
                {"ours": step(fused_mlp, "w_gu", "b_gu"), "torch": step(torch_mlp, "w_cat", "b_cat")}, args.rounds)
            if args.profile:
                for label, fn in (("ours", step(fused_mlp, "w_gu", "b_gu")), ("torch", step(torch_mlp, "w_cat", "b_cat"))):
                    fn()
                    torch.cuda.synchronize()
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        fn()
                        torch.cuda.synchronize()
                    print(f"--- {name} training step, {label}")
                    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
            train_rows.append(dict(name=name, ours=med_t["ours"], torch=med_t["torch"],
                                   ratio=med_t["torch"] / med_t["ours"]))
            print(f"{'':<22} train: ours {med_t['ours']:.3f} ms, torch {med_t['torch']:.3f} ms, "
                  f"torch/ours {train_rows[-1]['ratio']:.3f}", flush=True)
            del leaves, bias_leaves, dy
        del x, w_gu, w_cat, w_down, h
        torch.cuda.empty_cache()

    print(f"geomean gated/plain {geo([r['gp'] for r in rows]):.3f} (max {max(r['gp'] for r in rows):.3f}); "
          f"down+/plain {geo([r['dp'] for r in rows]):.3f} (max {max(r['dp'] for r in rows):.3f}); "
          f"unfused/fused {geo([r['uf'] for r in rows]):.2f}; torch/fused {geo([r['tf'] for r in rows]):.2f} "
          f"(min {min(r['tf'] for r in rows):.2f})")
    if args.paired:
        for label in ("gated/plain", "down+/plain", "plain/plain"):
            v = [r["paired"][label] for r in rows]
            print(f"paired {label}: geomean {geo(v):.4f} (max {max(v):.4f})")
    if train_rows:
        print(f"training torch/ours geomean {geo([r['ratio'] for r in train_rows]):.3f} "
              f"(min {min(r['ratio'] for r in train_rows):.3f})")


if __name__ == "__main__":
    main()
