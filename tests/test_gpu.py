"""GPU tests of every kernel family against a float32 reference. Each test skips (with a reason)
where the build has no kernels for the GPU: the sm90 families need sm90, the sm80 families run on
the archs they were built for (sm_90 included by default). Run them on the GPU machine."""
import pytest
import torch

import cutlass_moe
from cutlass_moe import moe_gemm, moe_gemm_reference
from cutlass_moe.ops import runs_aligned_config
from cutlass_moe.reference import assert_close_per_expert

from conftest import (backend_param, is_built, random_counts, requires_cuda, requires_kernels, runs_here,
                      skip_unless_built)

pytestmark = requires_cuda

SMALL_M = "sm90_pingpong_64x256x64_1x1x1"
LARGE_M = "sm90_cooperative_128x256x64_1x2x1"
SM80_SMALL_M = "sm80_64x128x32_32x64_s4"
SM80_LARGE_M = "sm80_128x128x32_64x64_s4"
BACKENDS = ["grouped", "moe", "sm80_grouped", "sm80_moe"]  # the sm80 families run on Hopper too
# (backend, config): every config of every family, each tested where built.
# MoE configs: the 64x256 pingpong, 128x256 cooperative and 64x512 wide cooperative tiles.
COOPERATIVE = "sm90_cooperative_128x256x64_1x1x1"
WIDE = "sm90_cooperative_wide_64x512x32_1x1x1"  # MoE family: both consumers on the same 64 rows
PINGPONG = SMALL_M  # the 64x256 pingpong tile, in both families
KERNELS = [("grouped", SMALL_M), ("grouped", LARGE_M), ("moe", SMALL_M), ("moe", COOPERATIVE), ("moe", WIDE),
           ("sm80_grouped", SM80_SMALL_M), ("sm80_grouped", SM80_LARGE_M),
           ("sm80_moe", SM80_SMALL_M), ("sm80_moe", SM80_LARGE_M)]
KERNEL_IDS = [f"{b}-{'_'.join(c.split('_')[1:])}" for b, c in KERNELS]
_BUILT = {tuple(name.split(":")[1::3]) for name in cutlass_moe.built_configs()}  # (backend, config)


def _kernel_param(backend, config):
    built = any(b == backend and c == config for b, c in _BUILT)
    reason = f"{backend}:{config} not in this build" if not built else f"no {backend} kernels for this GPU"
    return pytest.param(backend, config, marks=pytest.mark.skipif(not (built and runs_here(backend)), reason=reason))


backends = pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])


kernels = pytest.mark.parametrize("backend,config", [_kernel_param(b, c) for b, c in KERNELS], ids=KERNEL_IDS)


def make_weights(e, k, n, dtype, variant, gen):
    """(weights, trans_b) for one of the four ways a user hands over K x N matrices."""
    if variant == "kn":  # (E, K, N)
        return torch.randn(e, k, n, device="cuda", dtype=dtype, generator=gen), False
    if variant == "nk":  # (E, N, K), nn.Linear layout
        return torch.randn(e, n, k, device="cuda", dtype=dtype, generator=gen), True
    if variant == "nk_view":  # (E, N, K).transpose(1, 2): logical (E, K, N), K contiguous
        return torch.randn(e, n, k, device="cuda", dtype=dtype, generator=gen).transpose(1, 2), False
    if variant == "kn_view":  # (E, K, N).transpose(1, 2): logical (E, N, K), N contiguous
        return torch.randn(e, k, n, device="cuda", dtype=dtype, generator=gen).transpose(1, 2), True
    raise ValueError(variant)


LAYOUT_OF_VARIANT = {"kn": "kn", "nk": "nk", "nk_view": "nk", "kn_view": "kn"}  # storage of each K x N matrix


def check(y, x, w, counts, trans_b, poison_rows_from=None):
    """y against the float32 reference, expert by expert (cutlass_moe.reference.assert_close_per_expert:
    every owned row finite, each expert's relative error, and a per-element bound that one wrong row
    breaks); with poison_rows_from, the rows past the owned rows must still hold their NaN poison."""
    assert_close_per_expert(y, x, w, counts, trans_b=trans_b)
    if poison_rows_from is not None:
        rows = cutlass_moe.expert_row_ranges(counts, x.shape[0])
        written = rows[-1][1] if rows else 0
        assert torch.isnan(y[written:].float()).all(), "rows past the owned rows must be left unwritten"


def run_case(t, k, n, e, dtype, variant, config, kind, seed=0, count_dtype=torch.int32, counts_on="cuda", tail=0,
             backend="auto"):
    skip_unless_built(backend, dtype, LAYOUT_OF_VARIANT[variant], config)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, device="cuda", dtype=dtype, generator=gen)
    w, trans_b = make_weights(e, k, n, dtype, variant, gen)
    counts = random_counts(e, t - tail, cpu_gen, kind).to(counts_on, count_dtype)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=dtype)
    y = moe_gemm(x, w, counts, trans_b=trans_b, out=out, backend=backend, config=config)
    assert y is out
    check(y, x, w, counts, trans_b, poison_rows_from=True)


@kernels
@pytest.mark.parametrize("variant", ["kn", "nk", "nk_view", "kn_view"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtypes_layouts_and_configs(dtype, variant, backend, config):
    run_case(t=1000, k=256, n=384, e=8, dtype=dtype, variant=variant, backend=backend, config=config,
             kind="random", tail=37)


@kernels
@pytest.mark.parametrize("kind", ["random", "hot", "one", "uniform"])
@pytest.mark.parametrize("e", [1, 5, 64, 160])
def test_irregular_splits(e, kind, backend, config):
    run_case(t=2053, k=128, n=136, e=e, dtype=torch.bfloat16, variant="kn", backend=backend, config=config,
             kind=kind, seed=e)


@backends
@pytest.mark.parametrize("kind", ["random", "hot", "one"])
@pytest.mark.parametrize("e", [1024, 4096])
def test_many_experts(e, kind, backend):
    # Most experts empty at T = 3001 < E; K and N small. T is no multiple of any tile.
    run_case(t=3001, k=64, n=72, e=e, dtype=torch.bfloat16, variant="nk", backend=backend, config="auto",
             kind=kind, seed=e, tail=7)


@kernels
def test_rows_at_tile_boundaries(backend, config):
    # Experts ending on either side of every 64-row boundary up to 513 rows, with an empty one, and
    # a K deep enough for several pipeline rounds per tile.
    skip_unless_built(backend, torch.bfloat16, "kn", config)
    gen = torch.Generator(device="cuda").manual_seed(11)
    sizes = [1, 63, 64, 65, 127, 128, 129, 0, 191, 192, 193, 255, 256, 257, 320, 449, 513]
    counts = torch.tensor(sizes, dtype=torch.int32)
    t, k, n = sum(sizes) + 5, 1024, 200
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(len(sizes), k, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = moe_gemm(x, w, counts.cuda(), out=out, backend=backend, config=config)
    check(y, x, w, counts, False, poison_rows_from=True)


@kernels
@pytest.mark.parametrize("k,n", [(64, 64), (128, 264)])
@pytest.mark.parametrize("sizes", [[4096, 8192, 0, 16384, 32768, 65536 + 5], [100003]], ids=["doubling", "one"])
def test_experts_with_tens_of_thousands_of_rows(sizes, k, n, backend, config):
    # Experts far larger than the public cases' (at most a few thousand rows each): hundreds of
    # M tiles per expert and many tiles per CTA, with K and N small so the problem stays cheap and
    # each tile's mainloop short (one K block and one N tile; or two K blocks and a full and a
    # partial 256-wide N tile), which leaves the epilogue of one tile the least time before the
    # next. One wrong half tile among 100003 rows moves a norm by well under 1e-2: the per-element
    # bound of the check is what catches it.
    skip_unless_built(backend, torch.bfloat16, "kn", config)
    gen = torch.Generator(device="cuda").manual_seed(12)
    t = sum(sizes) + 3
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(len(sizes), k, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    counts = torch.tensor(sizes, dtype=torch.int32)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    moe_gemm(x, w, counts.cuda(), out=out, backend=backend, config=config)
    check(out, x, w, counts, False, poison_rows_from=True)


@kernels
@pytest.mark.parametrize("case", ["seed000-g8", "gptoss-120b-prefill"])
def test_public_case_splits(case, backend, config):
    # The public cases' own counts at full size, on every config: a config once faulted on these
    # two (a 2-CTA-cluster MoE config, since removed: a spare CTA's x box wholly outside the ragged
    # view) while the small problems passed.
    skip_unless_built(backend, torch.bfloat16, "kn", config)
    from cutlass_moe import bench
    cases = bench.load_cases()
    spec = next(c for c in cases if c["name"] == case)
    counts = bench.case_counts(cases)[case]
    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(spec["T"], spec["K"], device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(spec["E"], spec["K"], spec["N"], device="cuda", dtype=torch.bfloat16, generator=gen)
    w *= spec["K"] ** -0.5
    y = moe_gemm(x, w, counts.cuda(), backend=backend, config=config)
    torch.cuda.synchronize()
    check(y, x, w, counts, False)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("n", [256, 384])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("last_round", ["one", "few", "half", "over_half"])
def test_cooperative_tile_halves_a_short_last_round(last_round, dtype, n, fused):
    # The cooperative MoE tile cuts a last round of L <= G / 2 tiles (G CTAs) into 64-row halves, taken
    # by CTAs c and L + c (sm90_moe_kernel.hpp, CooperativeUnits). Tile counts of 2G + L: the last
    # round holds partial tiles of 1 to 128 rows (a second half of no rows where the tile has <= 64),
    # after a zero-count expert; one (n = 256) or two column tiles, the second partial (n = 384);
    # bf16 (stores deferred, a bias seeded) and fp16 (stored after each tile); with and without
    # a bias, activation and row scale; rows past the owned ones NaN-poisoned (out=) or zeroed
    # (a new output). "over_half" (L > G / 2) keeps whole tiles.
    skip_unless_built("moe", dtype, "kn", COOPERATIVE)
    if not runs_here("moe"):
        pytest.skip("no sm90 MoE kernels for this GPU")
    grid = torch.cuda.get_device_properties(0).multi_processor_count
    partial = {"one": 1, "few": 7, "half": grid // 2, "over_half": grid // 2 + 1}[last_round]
    tiles_n = (n + 255) // 256
    head, tail = [5, 0, 300], [30, 100, 0, 64, 65, 128, 1]  # 4 and 6 row tiles
    row_tiles = (2 * grid + partial + tiles_n - 1) // tiles_n  # tiles = row_tiles * tiles_n
    big = 128 * (row_tiles - 10 - 1) + 77
    counts = torch.tensor(head + [big] + tail, dtype=torch.int32)
    t, k, e = int(counts.sum()) + 9, 384, len(counts)
    gen = torch.Generator(device="cuda").manual_seed(partial)
    x = torch.randn(t, k, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(e, k, n, device="cuda", dtype=dtype, generator=gen) * k ** -0.5
    kwargs = {}
    if fused:
        kwargs = dict(bias=torch.randn(e, n, device="cuda", dtype=dtype, generator=gen), activation="silu",
                      row_scale=torch.rand(t, device="cuda", generator=gen))
    ref = moe_gemm_reference(x.cpu(), w.cpu(), counts,
                             **{a: v.cpu() if isinstance(v, torch.Tensor) else v for a, v in kwargs.items()})
    out = torch.full((t, n), float("nan"), device="cuda", dtype=dtype)
    got = moe_gemm(x, w, counts.cuda(), out=out, backend="moe", config=COOPERATIVE, **kwargs)
    new = moe_gemm(x, w, counts.cuda(), backend="moe", config=COOPERATIVE, **kwargs)
    assert torch.equal(new[:t - 9], got[:t - 9]), "the same inputs must give the same bits"
    assert bool((new[t - 9:] == 0).all()), "a new output's rows past the owned rows must be zeros"
    assert torch.isnan(got[t - 9:].float()).all(), "rows past the owned rows must be left unwritten"
    start = 0
    for i, c in enumerate(counts.tolist()):
        rows = slice(start, start + c)
        start += c
        if c == 0:
            continue
        g, r = got[rows].float().cpu(), ref[rows].float()
        assert bool(torch.isfinite(g).all()), f"expert {i}: non-finite outputs"
        err = float((g - r).norm() / r.norm().clamp_min(1e-30))
        assert err < 1e-2, f"expert {i} ({c} rows): relative error {err:.2e}"
        worst = float(((g - r).abs() / (r.abs() + r.abs().mean())).max())
        assert worst < 5e-2, f"expert {i} ({c} rows): an element off by {worst:.2e} (a wrong row?)"


@backends
@pytest.mark.parametrize("counts_on", ["cuda", "cpu"])
@pytest.mark.parametrize("count_dtype", [torch.int32, torch.int64])
def test_count_types_and_devices(count_dtype, counts_on, backend):
    run_case(t=777, k=64, n=64, e=12, dtype=torch.float16, variant="nk", backend=backend, config="auto",
             kind="random", count_dtype=count_dtype, counts_on=counts_on, tail=13)


@requires_kernels
@pytest.mark.parametrize("seed", range(4))
def test_families_agree_on_random_splits(seed):
    # Every family that runs here, on the same data, against the float32 reference expert by expert
    # (fp32 accumulation in every family: each is within bf16 rounding of it).
    gen = torch.Generator(device="cuda").manual_seed(seed)
    e, t = [7, 33, 128, 300][seed], 4099
    x = torch.randn(t, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(e, 768, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    counts = random_counts(e, t, torch.Generator().manual_seed(seed), "random").cuda()
    here = [b for b in BACKENDS if runs_here(b) and is_built(b, torch.bfloat16, "nk")]
    if len(here) < 2:
        pytest.skip(f"fewer than two families with bf16 nk kernels run on this GPU in this build: {here}")
    for backend in here:
        y = moe_gemm(x, w, counts, trans_b=True, backend=backend)
        try:
            assert_close_per_expert(y, x, w, counts, trans_b=True)
        except AssertionError as exc:
            raise AssertionError(f"{backend}: {exc}") from None


def _kernel_launches(fn):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]


@pytest.mark.parametrize("new_output", [False, True], ids=["out", "new_output"])
@pytest.mark.parametrize("backend,launches", [backend_param("moe", 1), backend_param("grouped", 2),
                                              backend_param("sm80_moe", 1), backend_param("sm80_grouped", 2)])
def test_launches_per_call(backend, launches, new_output):
    # The MoE families: one kernel, which also zeros a new output's unowned rows. The grouped
    # families: the argument-building kernel, then the GEMM, and for a new output the zero fill.
    skip_unless_built(backend, torch.bfloat16, "kn")
    x = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 256, 512, device="cuda", dtype=torch.bfloat16)
    counts = random_counts(64, 4000, torch.Generator().manual_seed(0)).to("cuda", torch.int32)
    out = None if new_output else torch.empty(4096, 512, device="cuda", dtype=torch.bfloat16)
    names = _kernel_launches(lambda: moe_gemm(x, w, counts, out=out, backend=backend))
    if new_output and backend in ("grouped", "sm80_grouped"):
        launches += 1
    assert len(names) == launches, names
    if backend in ("moe", "sm80_moe"):
        assert "MoeGemmKernel" in names[0], names


def test_picks_that_follow_the_dram():
    # Few experts with deep K and wide N, below 768 rows each (Mixtral at 128 rows per expert, Llama 4
    # Scout at 128 and 256): the 64-row wide tile where DRAM is fast (the H200, and device=-1), the
    # 128-row cooperative tile on an H100 (heuristics.cpp). From 768 rows per expert (Mixtral's
    # prefill) the cooperative tile defers its stores and is taken on both.
    name = torch.cuda.get_device_name()
    if torch.cuda.get_device_capability() != (9, 0) or not ("H100" in name or "H200" in name):
        pytest.skip(f"the expected pick is known for the H100 and H200, not {name}")
    expect = "sm90_cooperative_128x256x64_1x1x1" if "H100" in name else WIDE
    for t, e, n, k in [(1024, 8, 28672, 4096), (2048, 16, 16384, 5120), (4096, 16, 16384, 5120)]:
        assert cutlass_moe.select_config(t, e, n, k, backend="moe") == ("moe", expect)
        assert cutlass_moe.select_config(t, e, n, k, backend="moe", device=-1) == ("moe", WIDE)
    assert cutlass_moe.select_config(8192, 8, 28672, 4096, backend="moe") == ("moe", "sm90_cooperative_128x256x64_1x1x1")
    # Many experts below 256 rows each with K from 1408 to 2559 (Qwen3-30B's gate/up at 192 rows):
    # the cooperative tile on an H100, the pingpong tile where DRAM is fast.
    shallow = "sm90_cooperative_128x256x64_1x1x1" if "H100" in name else "sm90_pingpong_64x256x64_1x1x1"
    assert cutlass_moe.select_config(24576, 128, 1536, 2048, backend="moe") == ("moe", shallow)
    assert cutlass_moe.select_config(24576, 128, 1536, 2048, backend="moe", device=-1)[1] == "sm90_pingpong_64x256x64_1x1x1"
    # Many experts are unaffected: gpt-oss-120b prefill takes the cooperative tile on both.
    assert cutlass_moe.select_config(16384, 128, 5760, 2880, backend="moe")[1] == "sm90_cooperative_128x256x64_1x1x1"


# Few experts (< 32) with 256-767 rows each and N >= 16384, where the H200 picks the wide tile: the
# plan also holds the cooperative tile, run instead where every count is a multiple of 128 (read on
# the device; heuristics.cpp, select_aligned_config).
ALIGNED_T, ALIGNED_E, ALIGNED_N, ALIGNED_K = 2048, 8, 16384, 512


def _auto_plan(t, e, n, k):
    from cutlass_moe import ops
    return ops._C.plan(ops._DTYPES[torch.bfloat16], ops._LAYOUTS["kn"], t, e, n, k, ops._BACKENDS["auto"],
                       ops._CONFIGS["auto"], torch.cuda.current_device(), False)


def _skip_unless_two_configs():
    skip_unless_built("moe", torch.bfloat16, "kn", COOPERATIVE)
    skip_unless_built("moe", torch.bfloat16, "kn", WIDE)
    plan = _auto_plan(ALIGNED_T, ALIGNED_E, ALIGNED_N, ALIGNED_K)
    if plan.config != WIDE:
        pytest.skip(f"this GPU picks {plan.config} here, not the wide tile (its DRAM: heuristics.cpp)")
    return plan


def _aligned_operands(seed):
    """x (T, K), weights (E, K, N) and the generator that drew them, for the aligned tests' shape."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(ALIGNED_T, ALIGNED_K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(ALIGNED_E, ALIGNED_K, ALIGNED_N, device="cuda", dtype=torch.bfloat16, generator=gen)
    return x, w, gen


def test_plans_with_a_config_for_aligned_splits():
    plan = _skip_unless_two_configs()
    assert plan.aligned_config == COOPERATIVE
    # Not where no count vector can be all multiples of 128 (T), below 256 rows, nor with 32 experts.
    for t, e in [(2048 + 64, ALIGNED_E), (1024, ALIGNED_E), (256 * 32, 32)]:
        assert _auto_plan(t, e, ALIGNED_N, ALIGNED_K).aligned_config is None, (t, e)
    # The heuristic's answer stays the wide tile: the choice between the two is the device's.
    assert cutlass_moe.select_config(ALIGNED_T, ALIGNED_E, ALIGNED_N, ALIGNED_K, backend="moe") == ("moe", WIDE)


@pytest.mark.parametrize("counts", [
    [256] * 8,                                  # even: the cooperative tile
    [128, 384, 0, 256, 512, 128, 384, 256],     # uneven but whole 128-row tiles: the cooperative tile
    [250, 262, 256, 256, 256, 256, 256, 256],   # one count off: the wide tile
    [256, 256, 256, 256, 256, 256, 256, 0],     # whole tiles, a tail no expert owns: cooperative
    [-128, 4096, 256, 0, 0, 0, 0, 0],           # hostile (clamped alike), multiples of 128: cooperative
    [-1, 4096, 256, 0, 0, 0, 0, 0],             # hostile, not multiples: the wide tile
    [128] * 8,                                  # one tile per expert (a tail no expert owns): the wide tile
], ids=["even", "aligned", "one_off", "tail", "hostile_aligned", "hostile", "one_tile_each"])
@pytest.mark.parametrize("count_dtype", [torch.int32, torch.int64])
def test_the_device_runs_one_config_per_split(counts, count_dtype):
    # Auto launches both configs; exactly one computes, and its output is that config's bit for bit,
    # the unowned tail zeroed for a new output.
    _skip_unless_two_configs()
    x, w, _ = _aligned_operands(0)
    c = torch.tensor(counts, dtype=count_dtype, device="cuda")
    aligned = runs_aligned_config(counts)
    y = moe_gemm(x, w, c)
    expect = moe_gemm(x, w, c, backend="moe", config=COOPERATIVE if aligned else WIDE)
    assert torch.equal(y, expect)
    rows = cutlass_moe.expert_row_ranges(c.cpu(), ALIGNED_T)
    owned = rows[-1][1] if rows else 0
    if min(counts) >= 0:
        assert_close_per_expert(y, x, w, c.cpu(), trans_b=False)
    assert not y[owned:].any(), "a new output's unowned rows are zeros"
    names = _kernel_launches(lambda: moe_gemm(x, w, c))
    assert len(names) == 2 and all("MoeGemmKernel" in n for n in names), names


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "uneven"])
def test_the_launch_for_the_other_split_returns_at_once(aligned):
    # The two tiles may give the same bits, so the outputs alone cannot tell which one computed:
    # run_moe_gemm launches the aligned config first, then the plan's, and the one whose split it is
    # not must return at once (a quarter of the other's time at most; it reads 8 counts).
    from torch.profiler import ProfilerActivity, profile
    _skip_unless_two_configs()
    x, w, _ = _aligned_operands(4)
    counts = [512, 0, 128, 384, 256, 256, 128, 384] if aligned else [300, 212, 0, 400, 256, 256, 100, 524]
    c = torch.tensor(counts, dtype=torch.int32, device="cuda")
    moe_gemm(x, w, c)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        moe_gemm(x, w, c)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and "MoeGemmKernel" in e.name), key=lambda e: e.time_range.start)
    assert len(kernels) == 2, [e.name for e in kernels]
    computing, returning = (kernels[0], kernels[1]) if aligned else (kernels[1], kernels[0])
    assert returning.device_time < 0.25 * computing.device_time, [(e.name, e.device_time) for e in kernels]


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "uneven"])
def test_the_device_runs_one_config_per_split_gated(aligned):
    # The same for the fused gated projection with a bias and a row scale (Mixtral's and Llama 4's
    # gate/up, where the split decides): bitwise the forced config's output.
    _skip_unless_two_configs()
    x, w, gen = _aligned_operands(2)
    bias = torch.randn(ALIGNED_E, ALIGNED_N, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = torch.rand(ALIGNED_T, device="cuda", generator=gen)
    counts = [512, 0, 128, 384, 256, 256, 128, 384] if aligned else [300, 212, 0, 400, 256, 256, 100, 524]
    c = torch.tensor(counts, dtype=torch.int32, device="cuda")
    kwargs = dict(activation="silu", bias=bias, row_scale=scale)
    y = cutlass_moe.moe_gemm_gated(x, w, c, **kwargs)
    expect = cutlass_moe.moe_gemm_gated(x, w, c, backend="moe", config=COOPERATIVE if aligned else WIDE, **kwargs)
    assert torch.equal(y, expect)
    other = cutlass_moe.moe_gemm_gated(x, w, c, backend="moe", config=WIDE if aligned else COOPERATIVE, **kwargs)
    torch.testing.assert_close(y, other, rtol=2e-2, atol=2e-2)  # the other tile agrees within rounding


# Many experts (>= 32) with 65-255 rows each, where the H200 picks the pingpong tile: in calls of 2^37
# MACs or more the plan also holds the cooperative tile, run on splits of whole 128-row tiles where
# some expert holds two or more (select_aligned_config). 192 rows per expert, 1.6 GB of weights.
MANY_T, MANY_E, MANY_N, MANY_K = 6144, 32, 12288, 2048


@pytest.mark.parametrize("split", ["one_tile_each", "aligned", "random"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["kn", "nk"])
def test_many_experts_run_the_cooperative_tile_on_splits_of_whole_tiles(split, trans_b):
    layout = "nk" if trans_b else "kn"
    skip_unless_built("moe", torch.bfloat16, layout, COOPERATIVE)
    skip_unless_built("moe", torch.bfloat16, layout, PINGPONG)
    plan_config = cutlass_moe.select_config(MANY_T, MANY_E, MANY_N, MANY_K, backend="moe", trans_b=trans_b)[1]
    aligned = cutlass_moe.aligned_config(MANY_T, MANY_E, MANY_N, MANY_K, trans_b=trans_b)
    if (plan_config, aligned) != (PINGPONG, COOPERATIVE):
        pytest.skip(f"this GPU plans {plan_config} with {aligned} here (its DRAM: heuristics.cpp)")
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(MANY_T, MANY_K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(MANY_E, *((MANY_N, MANY_K) if trans_b else (MANY_K, MANY_N)), device="cuda",
                    dtype=torch.bfloat16, generator=gen)
    if split == "aligned":  # whole tiles, a quarter of the experts empty: as a padded layout makes them
        counts = torch.tensor([0, 256, 128, 384] * (MANY_E // 4), dtype=torch.int64)
    elif split == "one_tile_each":  # and a tail no expert owns
        counts = torch.full((MANY_E,), 128, dtype=torch.int64)
    else:
        counts = random_counts(MANY_E, MANY_T, torch.Generator().manual_seed(2), "random")
    assert int(counts.sum()) <= MANY_T
    c = counts.to("cuda", torch.int32)
    assert runs_aligned_config(counts) == (split == "aligned")
    y = moe_gemm(x, w, c, trans_b=trans_b)
    runs = COOPERATIVE if split == "aligned" else PINGPONG
    assert torch.equal(y, moe_gemm(x, w, c, trans_b=trans_b, backend="moe", config=runs))
    assert_close_per_expert(y, x, w, counts, trans_b=trans_b)
    assert not y[int(counts.sum()):].any(), "a new output's unowned rows are zeros"
    names = _kernel_launches(lambda: moe_gemm(x, w, c, trans_b=trans_b))
    assert len(names) == 2 and all("MoeGemmKernel" in n for n in names), names


def test_a_graph_replays_the_config_of_each_split():
    # One capture holds both launches: each replay runs the config its counts ask for.
    _skip_unless_two_configs()
    x, w, _ = _aligned_operands(1)
    splits = {"even": [256] * 8, "random": [300, 212, 0, 400, 256, 256, 100, 524],
              "aligned": [512, 0, 128, 384, 256, 256, 128, 384]}
    c = torch.tensor(splits["random"], dtype=torch.int32, device="cuda")
    out = torch.empty(ALIGNED_T, ALIGNED_N, device="cuda", dtype=torch.bfloat16)
    moe_gemm(x, w, c, out=out)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_gemm(x, w, c, out=out)
    for name in ["even", "random", "aligned", "even", "random"]:
        c.copy_(torch.tensor(splits[name], dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        config = WIDE if name == "random" else COOPERATIVE
        assert torch.equal(out, moe_gemm(x, w, c, backend="moe", config=config)), name
        assert_close_per_expert(out, x, w, c.cpu(), trans_b=False)


@requires_kernels
def test_auto_config_and_new_output():
    skip_unless_built("auto", torch.bfloat16, "kn")
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(16, 512, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    counts = random_counts(16, 4096, torch.Generator().manual_seed(1)).cuda()
    y = moe_gemm(x, w, counts)
    assert y.shape == (4096, 1024) and y.dtype == torch.bfloat16
    check(y, x, w, counts, False)


@requires_kernels
def test_zero_tokens_and_empty_experts():
    skip_unless_built("auto", torch.bfloat16, "kn")
    x = torch.empty(0, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 64, 32, device="cuda", dtype=torch.bfloat16)
    assert moe_gemm(x, w, torch.zeros(4, dtype=torch.int32, device="cuda")).shape == (0, 32)
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    out = torch.full((16, 32), float("nan"), device="cuda", dtype=torch.bfloat16)
    moe_gemm(x, w, torch.zeros(4, dtype=torch.int32, device="cuda"), out=out)
    assert torch.isnan(out.float()).all(), "all-zero counts write nothing"


@backends
def test_k_zero_writes_zeros_to_owned_rows(backend):
    skip_unless_built(backend, torch.bfloat16, "kn")
    x = torch.empty(10, 0, device="cuda", dtype=torch.bfloat16)
    w = torch.empty(2, 0, 16, device="cuda", dtype=torch.bfloat16)
    out = torch.full((10, 16), float("nan"), device="cuda", dtype=torch.bfloat16)
    moe_gemm(x, w, torch.tensor([3, 4], device="cuda"), out=out, backend=backend)
    assert (out[:7] == 0).all() and torch.isnan(out[7:].float()).all()


@kernels
@pytest.mark.parametrize("counts", [[5000, 5000, 5000], [-7, 300, 2**31 - 1], [0, 0, 999], [-1, -1, -1]])
def test_bad_device_counts_are_clamped_on_the_device(counts, backend, config):
    # Counts on the device are never read by the host: overruns are clamped in the kernel, and
    # nothing outside x, weights or out is touched (run under compute-sanitizer on the GPU machine).
    skip_unless_built(backend, torch.bfloat16, "kn", config)
    t = 1000
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(t, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(3, 128, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    c = torch.tensor(counts, device="cuda", dtype=torch.int64)
    out = torch.full((t, 256), float("nan"), device="cuda", dtype=torch.bfloat16)
    moe_gemm(x, w, c, out=out, backend=backend, config=config)
    torch.cuda.synchronize()
    check(out, x, w, c, False, poison_rows_from=True)


@kernels
def test_strided_x_and_out(backend, config):
    # out is a column window of a wider buffer: nothing left or right of it, or below the owned rows,
    # may be written (the cooperative MoE configs store through a TMA view of out).
    skip_unless_built(backend, torch.bfloat16, "kn", config)
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(300, 192, device="cuda", dtype=torch.bfloat16, generator=gen)[:, :128]  # ldx 192
    w = torch.randn(4, 128, 136, device="cuda", dtype=torch.bfloat16, generator=gen)
    big = torch.full((300, 168), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = big[:, 16:152]  # ldout 168, 32-byte offset
    counts = torch.tensor([100, 0, 150, 40], device="cuda")
    moe_gemm(x, w, counts, out=out, backend=backend, config=config)
    check(out, x, w, counts, False, poison_rows_from=True)
    assert torch.isnan(big[:, :16].float()).all() and torch.isnan(big[:, 152:].float()).all()


@requires_kernels
def test_misaligned_views_are_rejected():
    x = torch.randn(64, 72, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2, 64, 64, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([32, 32], device="cuda")
    with pytest.raises(ValueError, match="x: data pointer must be 16-byte aligned"):
        moe_gemm(x[:, 1:65], w, counts)
    with pytest.raises(ValueError, match="x: K = 60 must be a multiple of 8"):
        moe_gemm(x[:, :60], w[:, :60], counts)
    with pytest.raises(ValueError, match="x: the last dimension must be contiguous"):
        moe_gemm(torch.randn(64, 64, 2, device="cuda", dtype=torch.bfloat16)[..., 0], w, counts)
    with pytest.raises(ValueError, match="weights: leading stride of 68 elements"):
        moe_gemm(x[:, :64], torch.randn(2, 64, 68, device="cuda", dtype=torch.bfloat16)[:, :, :64], counts)


@requires_kernels
def test_repeated_signature_still_checks_each_call():
    """Eager calls check their arguments and resolve the plan once per signature (shapes, strides,
    dtypes, devices, options: ops._resolved_call). A repeat with new data, counts and pointers must
    still compute and zero the tail, and still reject what only the call shows: a misaligned pointer
    (the core checks each call), CPU counts that sum past T, a trans_b of the wrong type."""
    skip_unless_built("auto", torch.bfloat16, "kn")
    gen = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(4, 128, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    for seed in range(3):
        x = torch.randn(300, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        counts = random_counts(4, 300 - 7 * seed, torch.Generator().manual_seed(seed), "random").cuda()
        y = moe_gemm(x, w, counts)
        check(y, x, w, counts, False)
        assert (y[300 - 7 * seed:] == 0).all()
    flat = torch.randn(300 * 128 + 8, device="cuda", dtype=torch.bfloat16, generator=gen)
    moe_gemm(flat[:300 * 128].view(300, 128), w, counts)
    with pytest.raises(ValueError, match="x: data pointer must be 16-byte aligned"):
        moe_gemm(flat[1:300 * 128 + 1].view(300, 128), w, counts)
    moe_gemm(x, w, counts.cpu())
    with pytest.raises(ValueError, match="tokens_per_expert: counts sum to 301"):
        moe_gemm(x, w, torch.tensor([301, 0, 0, 0]))
    with pytest.raises(TypeError, match="trans_b: expected a bool"):
        moe_gemm(x, w, counts, trans_b=0)


@requires_kernels
def test_tune_remembers_the_fastest_config(tmp_path, monkeypatch):
    # tune times every built config of the shape, keeps the fastest in its file, and an auto call of
    # that shape then runs it (resolved once per signature), with the same results.
    import json
    from cutlass_moe import ops, tuning
    skip_unless_built("auto", torch.bfloat16, "kn")
    monkeypatch.setenv("CUTLASS_MOE_TUNING_FILE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(tuning, "_tables", {})
    try:
        (res,) = cutlass_moe.tune([(1000, 8, 256, 384)], warmup_ms=2, rep_ms=5)
        assert res["ms"] == min(res["times"].values()) and f"{res['backend']}:{res['config']}" in res["times"]
        assert res["heuristic"] in res["times"] and len(res["times"]) >= 2 and res["remembered"]
        saved = json.loads((tmp_path / "tuning.json").read_text())["choices"]["bf16:kn:1000:8:384:256"]
        assert (saved["backend"], saved["config"]) == (res["backend"], res["config"])
        gen = torch.Generator(device="cuda").manual_seed(11)
        x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(8, 256, 384, device="cuda", dtype=torch.bfloat16, generator=gen)
        counts = random_counts(8, 1000, torch.Generator().manual_seed(11)).cuda()
        check(moe_gemm(x, w, counts), x, w, counts, False)
        r = ops._resolved_call(x, w, counts, False, "auto", "auto")
        assert (r.plan.backend, r.plan.config) == (res["backend"], res["config"])
        # A remembered choice this build cannot run (another build's file) gives way to the heuristic.
        tuning._tables[torch.cuda.current_device()]["bf16:kn:1000:8:384:256"] = {"backend": "moe",
                                                                                "config": "sm80_64x128x32_32x64_s4"}
        ops._RESOLVED.clear()
        r = ops._resolved_call(x, w, counts, False, "auto", "auto")
        assert ":".join((r.plan.backend, r.plan.config)) == res["heuristic"]
    finally:
        ops._RESOLVED.clear()  # later tests resolve without this file


def test_tune_leaves_splits_of_whole_tiles_to_auto(tmp_path, monkeypatch):
    # tune times an even split. Where that split is one of whole 128-row tiles and its fastest config
    # is the plan's aligned config, auto already runs it there (and the wide tile on other splits):
    # tune remembers nothing, and an auto call keeps both configs.
    from cutlass_moe import ops, tuning
    _skip_unless_two_configs()
    monkeypatch.setenv("CUTLASS_MOE_TUNING_FILE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(tuning, "_tables", {})
    key = f"bf16:kn:{ALIGNED_T}:{ALIGNED_E}:{ALIGNED_N}:{ALIGNED_K}"
    # An earlier tune's choice for the shape (the pingpong tile), which a choice not remembered drops.
    tuning._write(str(tmp_path / "tuning.json"), {key: {"backend": "moe", "config": SMALL_M}},
                  torch.cuda.current_device())
    try:
        (res,) = cutlass_moe.tune([(ALIGNED_T, ALIGNED_E, ALIGNED_K, ALIGNED_N)], warmup_ms=2, rep_ms=5)
        lookup = tuning.choice(ops._DTYPES[torch.bfloat16], ops._LAYOUTS["kn"], ALIGNED_T, ALIGNED_E, ALIGNED_N,
                               ALIGNED_K, torch.cuda.current_device())
        if (res["backend"], res["config"]) == ("moe", COOPERATIVE):
            assert not res["remembered"] and lookup is None, key
            x, w, _ = _aligned_operands(3)
            counts = torch.full((ALIGNED_E,), ALIGNED_T // ALIGNED_E, device="cuda", dtype=torch.int32)
            r = ops._resolved_call(x, w, counts, False, "auto", "auto")
            assert (r.plan.config, r.plan.aligned_config) == (WIDE, COOPERATIVE)
        else:  # another config was faster even there: remembered as any other choice
            assert res["remembered"] and lookup == (res["backend"], res["config"]), key
    finally:
        ops._RESOLVED.clear()


@backends
def test_non_default_stream(backend):
    skip_unless_built(backend, torch.bfloat16, "kn")
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(8, 256, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    counts = random_counts(8, 2048, torch.Generator().manual_seed(3)).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = moe_gemm(x, w, counts, backend=backend)
    stream.synchronize()
    check(y, x, w, counts, False)


@kernels
def test_cuda_graph_replay_with_new_counts(backend, config):
    skip_unless_built(backend, torch.bfloat16, "kn", config)
    gen = torch.Generator(device="cuda").manual_seed(4)
    t, e = 1536, 16
    x = torch.randn(t, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(e, 256, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    counts = random_counts(e, t, torch.Generator().manual_seed(0)).to("cuda", torch.int32)
    out = torch.empty(t, 256, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe_gemm(x, w, counts, out=out, backend=backend, config=config)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_gemm(x, w, counts, out=out, backend=backend, config=config)
    for seed, kind in [(1, "random"), (2, "hot"), (3, "one"), (4, "uniform")]:
        new = random_counts(e, t - 11, torch.Generator().manual_seed(seed), kind).to("cuda", torch.int32)
        counts.copy_(new)
        out.fill_(float("nan"))
        x.normal_(generator=gen)
        graph.replay()
        torch.cuda.synchronize()
        check(out, x, w, new, False, poison_rows_from=True)


def test_paired_ratio_reads_one_and_two():
    # bench.paired_ratio, the method issue 11's fused/plain ratios are read with: a call against itself
    # reads 1, and against itself run twice reads 2 (a compute-bound matmul, so the second run's warm
    # L2 barely shows), within a few percent on a power-capped card.
    from cutlass_moe import bench
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    once = lambda: torch.mm(a, b)
    same = bench.paired_ratio(once, once, ms=300, heat_ms=50)
    twice = bench.paired_ratio(once, lambda: (once(), once()), ms=300, heat_ms=50)
    assert same["pairs"] >= 20 and same["ratio_p25"] <= same["ratio"] <= same["ratio_p75"]
    assert 0.98 < same["ratio"] < 1.02, same
    assert 1.9 < twice["ratio"] < 2.1, twice


def test_bench_paired_reads_ours_against_the_best_peer(tmp_path):
    # python -m cutlass_moe.bench --paired: the best peer's time over ours, call by call, beside the
    # rounds' medians, and the same reading within the noise of those medians.
    if not runs_here("moe"):
        pytest.skip("no sm90 MoE kernels for this GPU")
    import json
    from cutlass_moe import bench
    out = tmp_path / "bench.json"
    assert bench.main(["--cases", "seed000-g8", "--variants", "", "--paired", "--json", str(out),
                       "--warmup-ms", "2", "--rep-ms", "20"]) == 0
    row = json.loads(out.read_text())["cases"][0]
    paired = row["best_peer_paired"]
    assert paired["pairs"] >= 20 and paired["ratio_p25"] <= paired["ratio"] <= paired["ratio_p75"]
    assert 0.8 < paired["ratio"] / (row["best_peer_ms"] / row["moe_gemm_ms"]) < 1.25


def test_bench_times_ours_on_nk_weights(tmp_path):
    # python -m cutlass_moe.bench --variants nk: the headline call on the same weights stored (E, N, K)
    # (trans_b), checked per expert like every moe_gemm runner (the bench exits non-zero otherwise).
    skip_unless_built("moe", torch.bfloat16, "nk")
    if not runs_here("moe"):
        pytest.skip("no sm90 MoE kernels for this GPU")
    import json
    from cutlass_moe import bench
    out = tmp_path / "bench.json"
    assert bench.main(["--cases", "qwen3-30b-decode", "--variants", "nk", "--json", str(out),
                       "--warmup-ms", "2", "--rep-ms", "5"]) == 0
    row = json.loads(out.read_text())["cases"][0]
    assert row["moe_gemm[nk]_ms"] > 0 and row["moe_gemm[nk]_worst_rel"] <= 2e-2
