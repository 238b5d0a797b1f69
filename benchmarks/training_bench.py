"""Training speed: the weight gradient alone, forward + backward of one moe_gemm, a small MoE model
trained with torch.compile, and host time per call, each against torch._grouped_mm in the same run.

  wgrad      moe_gemm_wgrad (dW in bf16, and accumulated into fp32) against the 2D x 2D call torch's
             autograd makes, torch._grouped_mm(x.t(), dy, offs=offs). Floor: max(FLOPs / 790 TFLOP/s,
             (x + dy) / 4.36 TB/s + dW / the write bandwidth measured here (a 4 GiB fill)).
  fwdbwd     y = moe_gemm(x, w, counts); y.backward(dy) against the same with torch._grouped_mm.
  train      a two-layer MoE model, 50 steps of AdamW on a toy regression task, under
             torch.compile(fullgraph=True), ours against torch._grouped_mm from the same weights and
             data, trained side by side (alternating steps): per-step loss agreement and the median
             step time after warm-up (optimizer step included, compile time excluded).
  host       host us per call (1000 back-to-back calls, then one synchronize) of moe_gemm,
             torch._grouped_mm and torch.mm on a tiny problem, and per weight tensor over a model's
             worth (48 layers x 3 projections), under torch.no_grad() and with grad.
  hostparts  each step of the no-grad moe_gemm call timed alone (not in the default parts).
  hostfused  host us per no-grad call (the least mean of 15 runs) of the fused epilogues,
             moe_gemm_gated, grouped_linear and GroupedMLP, and their launch-only ops, beside
             torch.mm and moe_gemm (not in the default parts).

The shapes are the public prefill cases' (qwen3-30b, dsv3, mixtral, gpt-oss), bf16, with their
tokens_per_expert from cutlass_moe.bench. Times (wgrad, fwdbwd): the median over --rounds alternating
rounds of triton.testing.do_bench medians (bench.median_of_rounds).

To run (on the GPU machine): python3 benchmarks/training_bench.py [--parts wgrad,fwdbwd,train,host]
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

import cutlass_moe
from cutlass_moe import bench

SHAPES = ["qwen3-30b-prefill", "dsv3-prefill", "mixtral-prefill", "gptoss-120b-prefill"]
BF16 = torch.bfloat16


def write_bandwidth() -> float:
    """TB/s of filling a 4 GiB tensor."""
    buf = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    ms = bench._do_bench(lambda: buf.fill_(1), 25, 200)
    del buf
    return (4 << 30) / (ms * 1e-3) / 1e12


def shape_data(name, cases, counts_by_case):
    case = next(c for c in cases if c["name"] == name)
    t, k, n, e = case["T"], case["K"], case["N"], case["E"]
    counts = counts_by_case[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, k, device="cuda", dtype=BF16, generator=gen)
    w = torch.randn(e, k, n, device="cuda", dtype=BF16, generator=gen) * k ** -0.5
    dy = torch.randn(t, n, device="cuda", dtype=BF16, generator=gen) * 0.1
    return case, counts, x, w, dy


def wgrad_families():
    """The sm90 wgrad families of this build with a bf16 instance, and its config: {family: config}."""
    families = {}
    for name in cutlass_moe.built_configs():
        arch, family, dtype, out_dtype, config = name.split(":")
        if arch == "sm90" and family.startswith("wgrad_") and dtype == out_dtype == "bf16":
            families.setdefault(family[len("wgrad_"):], config)
    return families


def wgrad_floor_ms(t, k, n, experts, write_tbps):
    """Issue 10's wgrad floor: max(FLOPs / 790 TFLOP/s, x and dy at 4.36 TB/s + the dW of `experts`
    experts at the write bandwidth)."""
    flops_ms = 2.0 * t * k * n / 790e12 * 1e3
    bytes_ms = (2 * (t * k + t * n) / 4.36e12 + 2 * experts * k * n / (write_tbps * 1e12)) * 1e3
    return max(flops_ms, bytes_ms)


def part_wgrad(cases, counts_by_case, write_tbps, moe_configs=(), rounds=5):
    print(f"\nwgrad (write bandwidth measured: {write_tbps:.2f} TB/s)")
    print(f"{'shape':<20} {'zero E':>6} {'ours ms':>8} {'torch ms':>8} {'speedup':>7} {'floor ms':>8} {'%floor':>7} "
          f"{'fp32 acc ms':>11} {'rel err':>8}")
    fractions = []
    for name in SHAPES:
        case, counts, x, w, dy = shape_data(name, cases, counts_by_case)
        del w  # not needed here; DeepSeek-V3's weights alone are 15 GB
        t, k, n, e = case["T"], case["K"], case["N"], case["E"]
        counts_gpu = counts.to("cuda", torch.int32)
        offs = torch.cumsum(counts_gpu, 0, dtype=torch.int32)
        ours = lambda: cutlass_moe.moe_gemm_wgrad(x, dy, counts_gpu)
        theirs = lambda: torch._grouped_mm(x.t(), dy, offs=offs)
        configs = {f: (lambda f=f: cutlass_moe.moe_gemm_wgrad(x, dy, counts_gpu, backend=f))
                   for f in wgrad_families()}
        for c in moe_configs:  # the moe family's configs, each forced
            configs[c] = lambda c=c: cutlass_moe.moe_gemm_wgrad(x, dy, counts_gpu, backend="moe", config=c)
        main_grad = torch.zeros(e, k, n, device="cuda")
        acc = lambda: cutlass_moe.moe_gemm_wgrad(x, dy, counts_gpu, out=main_grad, accumulate=True)
        # Judged per expert in fp32, one expert at a time: fp32 copies of DeepSeek-V3's dW would
        # take 30 GB each.
        got, ref = ours(), theirs()
        err = max(float((got[i].float() - ref[i].float()).norm() / ref[i].float().norm().clamp_min(1e-30))
                  for i in range(e) if int(counts[i]) > 0)
        del ref
        for c in moe_configs:  # bitwise: the same reduction order, whatever the tile
            assert torch.equal(configs[c](), got), (name, c)
        del got
        runners = {"ours": ours, "theirs": theirs, "acc": acc, **(configs if len(configs) > 1 else {})}
        by_name = bench.median_of_rounds(runners, rounds)
        times = {fn: by_name[name] for name, fn in runners.items()}
        active = int((counts > 0).sum())
        floor = wgrad_floor_ms(t, k, n, active, write_tbps)
        fractions.append(floor / times[ours])
        print(f"{name:<20} {e - active:>6} {times[ours]:8.3f} {times[theirs]:8.3f} {times[theirs] / times[ours]:7.2f} "
              f"{floor:8.3f} {100 * floor / times[ours]:6.1f}% {times[acc]:11.3f} {err:8.1e}"
              + ("".join(f"  {c}={times[fn]:.3f}" for c, fn in configs.items()) if len(configs) > 1 else ""))
        del main_grad, x, dy
        torch.cuda.empty_cache()
    geo = math.exp(sum(math.log(f) for f in fractions) / len(fractions))
    print(f"floor fraction: geomean {geo:.2f}, min {min(fractions):.2f}")


def fwdbwd_steps(x, w, counts_gpu, offs, dy):
    """One forward + backward of a single GEMM (y, dx, dW), ours and torch._grouped_mm's autograd:
    (ours, theirs), each on leaf copies of x and w whose grads every call resets."""
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def ours():
        xg.grad = wg.grad = None
        cutlass_moe.moe_gemm(xg, wg, counts_gpu).backward(dy)

    def theirs():
        xg.grad = wg.grad = None
        torch._grouped_mm(xg, wg, offs=offs).backward(dy)

    return ours, theirs


def part_fwdbwd(cases, counts_by_case, rounds=5, by_part=False):
    print("\nforward + backward of one GEMM (y, dx, dW)"
          + ("; then each part alone: forward, dgrad, wgrad (ours / torch's ms)" if by_part else ""))
    print(f"{'shape':<20} {'ours ms':>8} {'torch ms':>8} {'speedup':>7}")
    speedups = []
    for name in SHAPES:
        case, counts, x, w, dy = shape_data(name, cases, counts_by_case)
        counts_gpu = counts.to("cuda", torch.int32)
        offs = torch.cumsum(counts_gpu, 0, dtype=torch.int32)
        ours, theirs = fwdbwd_steps(x, w, counts_gpu, offs, dy)
        runners = {"ours": ours, "theirs": theirs}
        if by_part:  # the three GEMMs each autograd runs, alone (no grad recorded)
            runners.update({
                "ours fwd": lambda: cutlass_moe.moe_gemm(x, w, counts_gpu),
                "theirs fwd": lambda: torch._grouped_mm(x, w, offs=offs),
                "ours dgrad": lambda: cutlass_moe.moe_gemm(dy, w, counts_gpu, trans_b=True),
                "theirs dgrad": lambda: torch._grouped_mm(dy, w.transpose(-2, -1), offs=offs),
                "ours wgrad": lambda: cutlass_moe.moe_gemm_wgrad(x, dy, counts_gpu),
                "theirs wgrad": lambda: torch._grouped_mm(x.t(), dy, offs=offs)})
        times = bench.median_of_rounds(runners, rounds)
        speedups.append(times["theirs"] / times["ours"])
        print(f"{name:<20} {times['ours']:8.3f} {times['theirs']:8.3f} {speedups[-1]:7.2f}"
              + "".join(f"  {p} {times['ours ' + p]:.3f} / {times['theirs ' + p]:.3f}"
                        for p in (("fwd", "dgrad", "wgrad") if by_part else ())))
        del ours, theirs, runners, x, w, dy
        torch.cuda.empty_cache()
    geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
    print(f"speedup over torch._grouped_mm autograd: geomean {geo:.2f}x, min {min(speedups):.2f}x")


class Block(torch.nn.Module):
    """A Mixtral-style MoE layer: router, top-k, gate/up/down projections through `gemm`."""

    def __init__(self, experts, hidden, inter, top_k, gemm):
        super().__init__()
        self.top_k, self.gemm, self.experts = top_k, gemm, experts
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.w_gate = torch.nn.Parameter(torch.randn(experts, hidden, inter) * hidden ** -0.5)
        self.w_up = torch.nn.Parameter(torch.randn(experts, hidden, inter) * hidden ** -0.5)
        self.w_down = torch.nn.Parameter(torch.randn(experts, inter, hidden) * inter ** -0.5)

    def forward(self, x):
        probs, chosen = torch.topk(torch.softmax(self.router(x).float(), dim=-1), self.top_k, dim=-1)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.experts, dtype=torch.int32, device=x.device).index_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        xs = x[order // self.top_k]
        h = torch.nn.functional.silu(self.gemm(xs, self.w_gate, counts)) * self.gemm(xs, self.w_up, counts)
        ys = self.gemm(h, self.w_down, counts)
        out = torch.zeros(x.shape[0] * self.top_k, x.shape[1], dtype=ys.dtype, device=x.device).index_copy(0, order, ys)
        return x + (out.view(x.shape[0], self.top_k, -1) * probs.to(ys.dtype).unsqueeze(-1)).sum(1)


def ours_gemm(xs, w, counts):
    return cutlass_moe.moe_gemm(xs, w, counts)


def torch_gemm(xs, w, counts):
    return torch._grouped_mm(xs, w, offs=torch.cumsum(counts, 0, dtype=torch.int32))


def timed_step(step_fn, opt, x, target):
    """One training step (forward, backward, optimizer), synchronized: (loss, seconds)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    loss = torch.nn.functional.mse_loss(step_fn(x).float(), target)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return loss, time.perf_counter() - start


def profile_step(step_fn, opt, x, target, label):
    """One compiled step under torch.profiler: host time by op, and the GPU's busy time."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        _, wall = timed_step(step_fn, opt, x, target)
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    print(f"--- {label}: step {wall * 1e3:.2f} ms under the profiler, GPU kernels {gpu_us / 1e3:.2f} ms")
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


def compiled_model(gemm, state, mode, fused_adamw=False):
    """The two-layer model from `state`, its AdamW (foreach, torch's default, or fused) and its
    compiled forward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(32, 1024, 2048, 4, gemm) for _ in range(2)]).to("cuda", BF16)
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused_adamw)
    return torch.compile(model, fullgraph=True, mode=mode), opt


def part_train(steps=50, warmup=10, profile=False, fused_adamw=False):
    print("\ntraining: 2 MoE layers (32 experts, top-4, hidden 1024, inter 2048), 4096 tokens/step, bf16, "
          f"AdamW ({'fused' if fused_adamw else 'foreach'}), "
          f"torch.compile(fullgraph=True), {steps} steps")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(32, 1024, 2048, 4, ours_gemm) for _ in range(2)]).to("cuda", BF16)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator(device="cuda").manual_seed(1)
    proj = torch.randn(1024, 1024, device="cuda", generator=gen) * 1024 ** -0.5
    data = []
    for _ in range(steps):
        x = torch.randn(4096, 1024, device="cuda", generator=gen).to(BF16)
        data.append((x, torch.tanh(x.float() @ proj)))
    # The default mode launches every kernel from the host; "reduce-overhead" replays CUDA graphs
    # (no host sync in either op, so the counts can change between replays). The two models train
    # side by side, step i of one next to step i of the other (which goes first alternates), so that
    # the GPU's clock and the host's state drift alike for both.
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        runs = {gemm: (*compiled_model(gemm, state, mode, fused_adamw), [], []) for gemm in (ours_gemm, torch_gemm)}
        for i in range(steps):
            for gemm in (runs if i % 2 == 0 else reversed(list(runs))):
                step_fn, opt, losses, times = runs[gemm]
                loss, seconds = timed_step(step_fn, opt, *data[i])
                times.append(seconds)
                losses.append(float(loss.detach()))
        if profile and mode == "default":
            for gemm, (step_fn, opt, _, _) in runs.items():
                profile_step(step_fn, opt, *data[0], f"{gemm.__name__}, mode={mode}")
        _, _, ours_losses, ours_times = runs[ours_gemm]
        _, _, torch_losses, torch_times = runs[torch_gemm]
        worst = max(abs(a - b) / abs(b) for a, b in zip(ours_losses, torch_losses))
        ours_ms = statistics.median(ours_times[warmup:]) * 1e3
        torch_ms = statistics.median(torch_times[warmup:]) * 1e3
        print(f"mode={mode}: loss step 0 / {steps - 1}: ours {ours_losses[0]:.5f} / {ours_losses[-1]:.5f}, "
              f"torch._grouped_mm {torch_losses[0]:.5f} / {torch_losses[-1]:.5f}; worst relative difference "
              f"{worst:.2e}; median step after {warmup} warm-up steps: ours {ours_ms:.2f} ms, torch._grouped_mm "
              f"{torch_ms:.2f} ms ({torch_ms / ours_ms:.2f}x)")


def per_call_us(fn, calls=1000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def min_call_us(fn, calls=200, repeats=15):
    """Host us per call as the least mean over `repeats` runs of `calls` back-to-back calls: the
    hosts' noise (other processes, clock changes) only ever adds time."""
    per_call_us(fn, 20)
    return min(per_call_us(fn, calls) for _ in range(repeats))


HOST_PROBLEM = (8, 64, 128, 128)  # E, T, K, N: a tiny problem, so the host's time is what is measured


def host_problem():
    """x, w, counts, offs and a (K, N) matrix for torch.mm, for HOST_PROBLEM."""
    e, t, k, n = HOST_PROBLEM
    x = torch.randn(t, k, device="cuda", dtype=BF16)
    w = torch.randn(e, k, n, device="cuda", dtype=BF16)
    counts = torch.full((e,), t // e, device="cuda", dtype=torch.int32)
    return x, w, counts, torch.cumsum(counts, 0, dtype=torch.int32), torch.randn(k, n, device="cuda", dtype=BF16)


def part_host():
    e, t, k, n = HOST_PROBLEM
    x, w, counts, offs, b = host_problem()
    layers = [torch.randn(e, k, n, device="cuda", dtype=BF16) for _ in range(48 * 3)]
    xg = x.clone().requires_grad_()
    print(f"\nhost us per call (E={e} T={t} K={k} N={n}, bf16; loop: per weight tensor over 48 x 3)")
    print(f"{'':<14} {'moe_gemm':>9} {'_grouped_mm':>11} {'torch.mm':>9} {'ratio to mm':>11}")
    for label, grad in (("no_grad", False), ("with grad", True)):
        a = xg if grad else x
        with torch.set_grad_enabled(grad):
            row = [per_call_us(lambda: cutlass_moe.moe_gemm(a, w, counts)),
                   per_call_us(lambda: torch._grouped_mm(a, w, offs=offs)),
                   per_call_us(lambda: torch.mm(a, b))]
            print(f"{label + ' call':<14} {row[0]:9.1f} {row[1]:11.1f} {row[2]:9.1f} {row[0] / row[2]:11.2f}")
            loop = [per_call_us(lambda: [cutlass_moe.moe_gemm(a, l, counts) for l in layers], 20) / len(layers),
                    per_call_us(lambda: [torch._grouped_mm(a, l, offs=offs) for l in layers], 20) / len(layers),
                    per_call_us(lambda: [torch.mm(a, l[0]) for l in layers], 20) / len(layers)]
            print(f"{label + ' loop':<14} {loop[0]:9.1f} {loop[1]:11.1f} {loop[2]:9.1f} {loop[0] / loop[2]:11.2f}")


def part_host_fused():
    """Host us per no-grad call of the fused epilogues and the grouped-linear forms (same problem as
    part_host; G = E groups of B = T / E rows for grouped_linear), beside the plain moe_gemm and
    torch.mm of the same call."""
    e, t, k, n = HOST_PROBLEM
    x, w, counts, offs, b = host_problem()
    bias, scale = torch.randn(e, n, device="cuda", dtype=BF16), torch.rand(t, device="cuda")
    xg = x.view(t // e, e, k)
    mlp = cutlass_moe.GroupedMLP(e, k, n // 2, k, bias=True, device="cuda", dtype=BF16)
    launch_args = (x, w, counts, False, bias, "relu", scale, False, 1.702, 7.0, "auto", "auto")
    calls = {
        "torch.mm": lambda: torch.mm(x, b),
        "moe_gemm": lambda: cutlass_moe.moe_gemm(x, w, counts),
        "moe_gemm(bias, relu, row_scale)": lambda: cutlass_moe.moe_gemm(x, w, counts, bias=bias, activation="relu",
                                                                        row_scale=scale),
        "moe_gemm_gated(bias, row_scale)": lambda: cutlass_moe.moe_gemm_gated(x, w, counts, bias=bias,
                                                                              row_scale=scale),
        "moe_gemm_fused_launch (compiled graphs)": lambda: torch.ops.cutlass_moe.moe_gemm_fused_launch.default(
            *launch_args),
        "grouped_linear(bias)": lambda: cutlass_moe.grouped_linear(xg, w, bias),
        "grouped_linear_launch (compiled graphs)": lambda: torch.ops.cutlass_moe.grouped_linear_launch.default(
            xg, w, bias),
        "GroupedMLP (bias)": lambda: mlp(xg),
    }
    print(f"\nhost us per no-grad call, fused and grouped-linear (E={e} T={t} K={k} N={n}, bf16; least mean of "
          f"15 runs of 200 calls), and the ratio to torch.mm")
    with torch.no_grad():
        mm = None
        for name, fn in calls.items():
            us = min_call_us(fn)
            mm = mm or us
            print(f"  {name:<42} {us:7.1f} {us / mm:6.2f}")


def part_host_breakdown():
    """Where moe_gemm's host time goes: each step of the no-grad call timed alone (same problem as
    part_host)."""
    from cutlass_moe import ops
    e, t, k, n = HOST_PROBLEM
    x, w, counts, offs, b = host_problem()
    out = torch.empty(t, n, device="cuda", dtype=BF16)
    dtype, layout = ops._DTYPES[BF16], ops._LAYOUTS["kn"]
    plan = ops._plan(dtype, layout, t, e, n, k, ops._BACKENDS["auto"], ops._CONFIGS["auto"], 0, False)
    stream = ops._stream(0)
    bias, scale = torch.randn(e, n, device="cuda", dtype=BF16), torch.rand(t, device="cuda")
    fused_args = (x, w, counts, False, bias, "relu", scale, False, 1.702, 7.0, "auto", "auto")
    xg = x.view(t // e, e, k)  # grouped_linear's (B, G, K), G = E
    dw = torch.empty(e, k, n, device="cuda", dtype=BF16)
    auto_backend, auto_config = ops._BACKENDS["auto"], ops._CONFIGS["auto"]
    wgrad_ws = ops._wgrad_workspace_size(dtype, dtype, layout, False, t, e, n, k, auto_backend, auto_config, 0)
    wgrad_workspace = ops._new_workspace(wgrad_ws, x.device) if wgrad_ws else None
    wgrad_args = (auto_backend, auto_config, dtype, dtype, layout, ops._COUNT_TYPES[torch.int32], False, t, e, n, k,
                  x.data_ptr(), k, out.data_ptr(), n, dw.data_ptr(), n, k * n, counts.data_ptr(),
                  wgrad_workspace.data_ptr() if wgrad_ws else 0, wgrad_ws, stream)
    args = (plan, ops._COUNT_TYPES[torch.int32], x.data_ptr(), k, w.data_ptr(), n, k * n, out.data_ptr(), n,
            counts.data_ptr(), 0, 0)
    steps = {
        "torch.mm": lambda: torch.mm(x, b),
        "torch._grouped_mm": lambda: torch._grouped_mm(x, w, offs=offs),
        "moe_gemm": lambda: cutlass_moe.moe_gemm(x, w, counts),
        "_check_moe_gemm": lambda: ops._check_moe_gemm(x, w, counts, False, None, "auto", "auto"),
        "_moe_gemm_impl": lambda: ops._moe_gemm_impl(x, w, counts, False, None, "auto", "auto"),
        "torch.ops.cutlass_moe.moe_gemm.default": lambda: torch.ops.cutlass_moe.moe_gemm.default(
            x, w, counts, False, "auto", "auto"),
        "torch.ops.cutlass_moe.moe_gemm_wgrad.default": lambda: torch.ops.cutlass_moe.moe_gemm_wgrad.default(
            x, out, counts, False, None, "auto", "auto"),
        "torch.ops.cutlass_moe.moe_gemm_launch.default (compiled graphs)": lambda: (
            torch.ops.cutlass_moe.moe_gemm_launch.default(x, w, counts, False, "auto", "auto")),
        "torch.ops.cutlass_moe.moe_gemm_wgrad_launch.default": lambda: (
            torch.ops.cutlass_moe.moe_gemm_wgrad_launch.default(x, out, counts, False, None, "auto", "auto")),
        "moe_gemm_wgrad": lambda: cutlass_moe.moe_gemm_wgrad(x, out, counts),
        "_moe_gemm_wgrad_impl": lambda: ops._moe_gemm_wgrad_impl(x, out, counts, False, None, False, None, "auto",
                                                                 "auto"),
        "_C.wgrad (one launch)": lambda: ops._C.wgrad(*wgrad_args),
        "_wgrad_workspace_size (cached)": lambda: ops._wgrad_workspace_size(dtype, dtype, layout, False, t, e, n, k,
                                                                            auto_backend, auto_config, 0),
        "torch.ops.cutlass_moe.moe_gemm_fused.default (bias, relu, row_scale)": lambda: (
            torch.ops.cutlass_moe.moe_gemm_fused.default(*fused_args)),
        "torch.ops.cutlass_moe.moe_gemm_fused_launch.default": lambda: (
            torch.ops.cutlass_moe.moe_gemm_fused_launch.default(*fused_args)),
        "torch.ops.cutlass_moe.grouped_linear.default (bias)": lambda: (
            torch.ops.cutlass_moe.grouped_linear.default(xg, w, bias)),
        "torch.ops.cutlass_moe.grouped_linear_launch.default": lambda: (
            torch.ops.cutlass_moe.grouped_linear_launch.default(xg, w, bias)),
        "_C.run (one launch)": lambda: ops._C.run(*args, False, stream),
        "_C.run + zero tail": lambda: ops._C.run(*args, True, stream),
        "torch.empty": lambda: torch.empty(t, n, dtype=BF16, device=x.device),
        "x.new_empty": lambda: x.new_empty((t, n)),
        "_stream": lambda: ops._stream(0),
        "_plan lookup": lambda: ops._plan(dtype, layout, t, e, n, k, 0, -1, 0, False),
        "key (shape, stride, dtype, device) x3": lambda: (
            x.shape, x.stride(), x.dtype, x.device, w.shape, w.stride(), w.dtype, w.device,
            counts.shape, counts.dtype, counts.device),
        "data_ptr x3": lambda: (x.data_ptr(), w.data_ptr(), counts.data_ptr()),
    }
    print(f"\nhost breakdown, us per call (E={e} T={t} K={k} N={n}, bf16, no_grad)")
    with torch.no_grad():
        for name, fn in steps.items():
            print(f"  {name:<62} {per_call_us(fn, 3000):7.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="wgrad,fwdbwd,train,host")
    parser.add_argument("--wgrad-configs", default=None,
                        help="wgrad: also time the moe family with each of these configs forced (comma-separated)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="wgrad, fwdbwd: each time is the median of this many alternating rounds")
    parser.add_argument("--by-part", action="store_true",
                        help="fwdbwd: also time the forward, dgrad and wgrad alone, in the same rounds")
    parser.add_argument("--fused-adamw", action="store_true",
                        help="train with AdamW(fused=True) instead of torch's default (foreach)")
    parser.add_argument("--profile", action="store_true",
                        help="train: also profile one compiled step of each (default mode)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    cases = bench.load_cases()
    counts_by_case = bench.case_counts(cases)
    print(f"training_bench on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if "wgrad" in parts:
        part_wgrad(cases, counts_by_case, write_bandwidth(),
                   [c for c in args.wgrad_configs.split(",") if c] if args.wgrad_configs else (), args.rounds)
    if "fwdbwd" in parts:
        part_fwdbwd(cases, counts_by_case, args.rounds, args.by_part)
    if "train" in parts:
        part_train(profile=args.profile, fused_adamw=args.fused_adamw)
    if "host" in parts:
        part_host()
    if "hostfused" in parts:
        part_host_fused()
    if "hostparts" in parts:
        part_host_breakdown()


if __name__ == "__main__":
    main()
