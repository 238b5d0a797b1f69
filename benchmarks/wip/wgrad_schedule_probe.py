"""Does a pingpong schedule pay off for the weight gradient? CUTLASS's own ptr-array grouped wgrad
(sm90_wgrad_grouped.cuh) in several tiles and schedules, next to our MoE wgrad, on issue 10's four
shapes with the bench's split: the grouped family's cooperative 128x256 against its pingpong 128x128
(each consumer its own tile, the epilogue of one under the other's MMAs) tells whether an own
pingpong 128x128 MoE wgrad is worth building, without building it.

Build (reduced), after `git apply benchmarks/wip/pingpong_128x128_config.patch` (the pingpong
128x128 1x1 config is not in the tree): CUTLASS_MOE_SM90_WGRAD_CONFIGS="kSm90Cooperative_128x256x64_1x1x1;
kSm90Pingpong_128x128x64_1x1x1;kSm90Pingpong_64x256x64_1x1x1;kSm90Cooperative_128x128x64_1x1x1"
with CUTLASS_MOE_DTYPES=kBFloat16.
Run: python3 wgrad_schedule_probe.py [rounds]; prints ms per runner (median of alternating rounds)
and each one's time over our moe wgrad's.
"""
import sys

import torch

import cutlass_moe
from cutlass_moe import bench

BF16 = torch.bfloat16
SHAPES = ["qwen3-30b-prefill", "dsv3-prefill", "mixtral-prefill", "gptoss-120b-prefill", "seed000-g128"]


def grouped_configs():
    out = []
    for name in cutlass_moe.built_configs():
        arch, family, dtype, out_dtype, config = name.split(":")
        if arch == "sm90" and family == "wgrad_grouped" and dtype == out_dtype == "bf16":
            out.append(config)
    return out


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    cases = bench.load_cases()
    counts_by_case = bench.case_counts(cases)
    configs = grouped_configs()
    print(f"{torch.cuda.get_device_name()}, grouped wgrad configs: {configs}")
    for name in SHAPES:
        case = next(c for c in cases if c["name"] == name)
        t, k, n = case["T"], case["K"], case["N"]
        counts = counts_by_case[name].to("cuda", torch.int32)
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(t, k, device="cuda", dtype=BF16, generator=gen)
        dy = torch.randn(t, n, device="cuda", dtype=BF16, generator=gen) * 0.1
        runners = {"moe": lambda: cutlass_moe.moe_gemm_wgrad(x, dy, counts, backend="moe")}
        for c in configs:
            runners[c] = lambda c=c: cutlass_moe.moe_gemm_wgrad(x, dy, counts, backend="grouped", config=c)
        ref = runners["moe"]()
        for c in configs:  # per expert, relative to our moe wgrad's dW
            got = runners[c]()
            err = max(float((got[i].float() - ref[i].float()).norm() / ref[i].float().norm().clamp_min(1e-30))
                      for i in range(ref.shape[0]) if int(counts[i]) > 0)
            assert err < 1e-2, (name, c, err)
            del got
        del ref
        ms = bench.median_of_rounds(runners, rounds)
        base = ms["moe"]
        print(f"{name:<22} " + "  ".join(f"{r}={v:.3f} ({v / base:.3f})" for r, v in ms.items()), flush=True)
        del x, dy
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
