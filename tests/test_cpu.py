"""Tests that run everywhere (CI has no GPU): argument checking, the reference path, layout
handling, the heuristic, the compiled module, the correctness check the GPU tests and the benchmark
use, and the benchmark's behaviour without a GPU. They pass on any build configuration (archs,
dtypes, layouts, config lists): nothing here depends on which kernels were built."""
import itertools
import random
import re

import pytest
import torch

import cutlass_moe
from cutlass_moe import _C, moe_gemm, moe_gemm_reference, ops
from cutlass_moe.ops import _weight_layout
from cutlass_moe.reference import assert_close_per_expert, per_expert_errors

from conftest import HAS_CUDA, random_counts

BF16 = torch.bfloat16
# The layout enum values: from the C++ enum (ops._LAYOUTS) where ops exposes them, else the old constants.
_LAYOUT_KN, _LAYOUT_NK = ((ops._LAYOUTS["kn"], ops._LAYOUTS["nk"]) if hasattr(ops, "_LAYOUTS")
                          else (ops._LAYOUT_KN, ops._LAYOUT_NK))


def make(t=48, k=32, n=24, e=3, dtype=BF16, counts=None, trans_b=False):
    x = torch.randn(t, k, dtype=dtype)
    w = torch.randn(e, n, k, dtype=dtype) if trans_b else torch.randn(e, k, n, dtype=dtype)
    c = torch.tensor([16, 0, 32]) if counts is None else counts
    return x, w, c


def _bad_cases():
    x, w, c = make()
    yield "x not a tensor", dict(x=x.tolist()), TypeError, "x:"
    yield "x rank", dict(x=x[None]), ValueError, "x: expected 2 dimensions"
    yield "x dtype", dict(x=x.int(), weights=w.int()), TypeError, "x: expected dtype"
    yield "weights dtype", dict(weights=w.half()), TypeError, "weights: dtype"
    yield "weights rank", dict(weights=w[0]), ValueError, "weights: expected 3 dimensions"
    yield "K mismatch", dict(weights=torch.randn(3, 16, 24, dtype=BF16)), ValueError, "weights: expected shape (E, K, N) with K = 32"
    yield "K mismatch trans_b", dict(weights=torch.randn(3, 24, 16, dtype=BF16), trans_b=True), ValueError, "(E, N, K)"
    yield "E mismatch", dict(tokens_per_expert=torch.tensor([16, 32])), ValueError, "tokens_per_expert: expected 3 entries"
    yield "counts dtype", dict(tokens_per_expert=c.float()), TypeError, "tokens_per_expert: expected dtype"
    yield "counts rank", dict(tokens_per_expert=c[None]), ValueError, "tokens_per_expert: expected 1 dimensions"
    yield "negative count", dict(tokens_per_expert=torch.tensor([16, -1, 32])), ValueError, "counts must be >= 0"
    yield "counts past T", dict(tokens_per_expert=torch.tensor([16, 1, 32])), ValueError, "sum to 49"
    yield "out shape", dict(out=torch.empty(48, 8, dtype=BF16)), ValueError, "out: expected shape (48, 24)"
    yield "out dtype", dict(out=torch.empty(48, 24, dtype=torch.half)), TypeError, "out: dtype"
    yield "out rank", dict(out=torch.empty(48, 24, 1, dtype=BF16)), ValueError, "out: expected 2 dimensions"
    yield "weights device", dict(weights=w.to("meta")), ValueError, "weights: on meta"
    yield "counts device", dict(tokens_per_expert=c.to("meta")), ValueError, "tokens_per_expert: on meta"
    yield "out device", dict(out=torch.empty(48, 24, dtype=BF16, device="meta")), ValueError, "out: on meta"
    yield "trans_b type", dict(trans_b=1), TypeError, "trans_b"
    yield "config name", dict(config="fastest"), ValueError, "config: expected 'auto'"
    yield "backend name", dict(backend="cublas"), ValueError, "backend: expected one of"


@pytest.mark.parametrize("label,override,exc,match", list(_bad_cases()), ids=[c[0] for c in _bad_cases()])
def test_bad_arguments_raise_naming_the_argument(label, override, exc, match):
    x, w, c = make()
    kwargs = dict(x=x, weights=w, tokens_per_expert=c)
    kwargs.update(override)
    with pytest.raises(exc) as info:
        moe_gemm(kwargs.pop("x"), kwargs.pop("weights"), kwargs.pop("tokens_per_expert"), **kwargs)
    assert match in str(info.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("kind", ["random", "hot", "one", "uniform"])
def test_cpu_path_matches_per_expert_matmul(dtype, trans_b, kind):
    g = torch.Generator().manual_seed(7)
    t, k, n, e = 67, 40, 24, 6
    counts = random_counts(e, t - 5, g, kind)  # 5 tail rows that no expert owns
    x = torch.randn(t, k, dtype=dtype, generator=g)
    w = torch.randn(e, n, k, dtype=dtype, generator=g) if trans_b else torch.randn(e, k, n, dtype=dtype, generator=g)
    out = torch.full((t, n), 7.0, dtype=dtype)
    y = moe_gemm(x, w, counts, trans_b=trans_b, out=out)
    assert y is out and y.dtype == dtype and y.shape == (t, n)
    start = 0
    for i, c in enumerate(counts.tolist()):
        we = w[i].t() if trans_b else w[i]
        expect = (x[start:start + c].float() @ we.float()).to(dtype)
        torch.testing.assert_close(y[start:start + c], expect)
        start += c
    assert bool((y[start:] == 7.0).all()), "tail rows must be left unwritten"


def test_reference_clamps_counts_like_the_kernels():
    assert cutlass_moe.expert_row_ranges(torch.tensor([3, -2, 10, 4]), 8) == [(0, 3), (3, 3), (3, 8), (8, 8)]
    assert cutlass_moe.expert_row_ranges(torch.tensor([2**40, 1]), 5) == [(0, 5), (5, 5)]


def _hostile_count_cases():
    rng = random.Random(5)
    for _ in range(20):  # random counts summing below, to and past T
        e, t = rng.randint(1, 40), rng.randint(0, 3000)
        counts = [rng.randint(0, max(1, 2 * t // e)) for _ in range(e)]
        yield counts, t
        yield counts, sum(counts)
        yield counts, max(0, sum(counts) - rng.randint(1, 50))
    big, int64_max, int64_min = 2**40, 2**63 - 1, -2**63
    yield [3, -2, 10, 4], 8
    yield [big, 1], 5
    yield [1, big, big, 7], 1000
    yield [int64_max, int64_max, 5], 77
    yield [int64_min, 10, int64_min, 20], 25
    yield [int64_max, int64_min, int64_max], 2**31 - 1024
    yield [-1, -5, -(2**31)], 100
    yield [0, 0, 0, 0], 16
    yield [], 16
    yield [], 0
    yield [5, 0, 3], 0
    yield [2**31 - 1, 2**31 - 1, 1], 2**31 - 1024
    yield [2**31, 2**32 + 3, 9], 2**31 - 1024


def test_one_clamping_rule_on_host_and_device():
    # The C++ expert_row_ranges runs the __host__ __device__ function the kernels use to clamp the
    # counts; the Python reference must give the same rows for every count vector, hostile ones
    # (negative, past T, near the int64 limits) included.
    rows_in_cpp = getattr(_C, "expert_row_ranges", None)
    if rows_in_cpp is None:
        pytest.skip("cutlass_moe._C has no expert_row_ranges yet")
    for counts, t in _hostile_count_cases():
        want = cutlass_moe.expert_row_ranges(torch.tensor(counts, dtype=torch.int64), t)
        got = [tuple(r) for r in rows_in_cpp(counts, t)]
        assert got == want, (counts, t)
        assert all(0 <= s <= e <= t for s, e in want) and all(a[1] == b[0] for a, b in zip(want, want[1:]))


def test_reference_returns_float32_with_zero_tail():
    x, w, c = make()
    ref = moe_gemm_reference(x, w, c)
    assert ref.dtype == torch.float32 and ref.shape == (48, 24)
    assert bool((ref[48:] == 0).all())
    torch.testing.assert_close(ref[:16], x[:16].float() @ w[0].float())
    torch.testing.assert_close(ref[16:48], x[16:48].float() @ w[2].float())


def _reference_case(t=24576, k=64, n=32, e=8, dtype=BF16, seed=0, tail=0):
    """x, w, counts and a correct result (the float32 reference rounded to dtype, as a kernel
    rounds its float32 accumulators): e experts sharing t - tail rows evenly (e = 1: all of them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, dtype=dtype, generator=g)
    w = torch.randn(e, k, n, dtype=dtype, generator=g)
    counts = random_counts(e, t - tail, g, "uniform" if e > 1 else "one")
    y = moe_gemm_reference(x, w, counts).to(dtype)
    return x, w, counts, y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("e", [1, 8])
def test_per_expert_check_catches_one_wrong_row(e, dtype):
    # A correct result passes; one wholly wrong row among 24576 fails, however the experts split
    # them: one norm over all rows (or over one expert's 3072 or 24576 rows) moves by only
    # sqrt(1/rows) (0.6-1.8%), within a 1e-2 or 2e-2 relative tolerance, so the check must also
    # bound every element.
    x, w, counts, y = _reference_case(e=e, dtype=dtype)
    errors = assert_close_per_expert(y, x, w, counts)
    assert errors["finite"] and errors["worst_rel"] < 5e-3 and errors["elem_ratio"] < 0.5, errors
    starts = [s for s, _ in cutlass_moe.expert_row_ranges(counts, x.shape[0])]
    row = 12345
    expert = max(i for i, s in enumerate(starts) if s <= row)

    zeroed = y.clone()
    zeroed[row] = 0
    with pytest.raises(AssertionError, match=f"expert {expert}, row {row}"):
        assert_close_per_expert(zeroed, x, w, counts)

    scaled = y.clone()
    scaled[row] *= 1.1  # 10% off: more than any rounding
    with pytest.raises(AssertionError, match=f"expert {expert}"):
        assert_close_per_expert(scaled, x, w, counts)

    other = 20000 if expert == 0 and e == 1 else starts[-1] + 7  # another expert's row where there is one
    swapped = y.clone()
    swapped[[row, other]] = swapped[[other, row]]
    with pytest.raises(AssertionError, match="row"):
        assert_close_per_expert(swapped, x, w, counts)

    unwritten = y.clone()
    unwritten[row, 3] = float("nan")
    with pytest.raises(AssertionError, match=f"expert {expert} has non-finite values"):
        assert_close_per_expert(unwritten, x, w, counts)


def test_per_expert_check_names_the_worst_expert_and_ignores_unowned_rows():
    x, w, counts, y = _reference_case(t=1000, k=256, n=64, e=5, tail=40)
    y[-40:] = float("nan")  # rows no expert owns are not looked at
    assert assert_close_per_expert(y, x, w, counts)["finite"]
    ranges = cutlass_moe.expert_row_ranges(counts, x.shape[0])
    start, stop = ranges[3]
    y[start:stop] = moe_gemm_reference(x[start:stop], w[2:3], torch.tensor([stop - start])).to(BF16)  # expert 2's W
    errors = per_expert_errors(y, x, w, counts)
    assert errors["worst_expert"] == 3 and errors["worst_rel"] > 0.5, errors
    with pytest.raises(AssertionError, match=r"relative error .* in expert 3;.*max \|y - ref\|"):
        assert_close_per_expert(y, x, w, counts)
    # An explicit absolute tolerance replaces the per-element bound.
    errors = assert_close_per_expert(y[:start], x[:start], w[:3], counts[:3], abs_tol=1.0)
    assert errors["max_abs"] <= 1.0
    y[5, 0] += 2.0
    with pytest.raises(AssertionError, match="max \\|y - ref\\| = .* > 1 in expert 0, row 5"):
        assert_close_per_expert(y[:start], x[:start], w[:3], counts[:3], abs_tol=1.0, rel=1.0)


def test_per_expert_check_of_nothing():
    x, w, _, y = _reference_case(t=10, k=16, n=8, e=2)
    errors = assert_close_per_expert(y, x, w, torch.zeros(2, dtype=torch.int64))
    assert errors["worst_expert"] == -1 and errors["finite"]


def test_strided_weight_views_are_read_without_copy():
    base = torch.randn(4, 64, 32, dtype=BF16)  # (E, N, K)
    assert _weight_layout(base, trans_b=True) == (_LAYOUT_NK, 32)
    assert _weight_layout(base.transpose(1, 2), trans_b=False) == (_LAYOUT_NK, 32)
    kn = torch.randn(4, 32, 64, dtype=BF16)  # (E, K, N)
    assert _weight_layout(kn, trans_b=False) == (_LAYOUT_KN, 64)
    assert _weight_layout(kn.transpose(1, 2), trans_b=True) == (_LAYOUT_KN, 64)
    padded = torch.randn(4, 32, 80, dtype=BF16)[:, :, :64]  # rows padded to 80
    assert _weight_layout(padded, trans_b=False) == (_LAYOUT_KN, 80)
    with pytest.raises(ValueError, match="weights: one of the last two dimensions must be contiguous"):
        _weight_layout(torch.randn(4, 64, 64, 2, dtype=BF16)[..., 0], trans_b=False)


def test_cpu_path_takes_strided_views():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 48, dtype=BF16, generator=g)[:, :32]  # row stride 48
    w_nk = torch.randn(3, 24, 32, dtype=BF16, generator=g)
    c = torch.tensor([10, 20, 10])
    torch.testing.assert_close(moe_gemm(x, w_nk.transpose(1, 2), c), moe_gemm(x, w_nk, c, trans_b=True))


def test_empty_problems_on_cpu():
    x, w, _ = make(t=0)
    assert moe_gemm(x, w, torch.zeros(3, dtype=torch.int64)).shape == (0, 24)
    x = torch.randn(5, 16, dtype=BF16)
    w = torch.randn(0, 16, 8, dtype=BF16)
    assert moe_gemm(x, w, torch.zeros(0, dtype=torch.int32)).shape == (5, 8)


@pytest.mark.parametrize("t,e,n,k,expect", [
    (1024, 256, 4096, 7168, "sm90_pingpong_64x256x64_1x1x1"),       # dsv3-decode
    (512, 128, 1536, 2048, "sm90_pingpong_64x256x64_1x1x1"),        # qwen3-30b-decode
    (64, 8, 28672, 4096, "sm90_pingpong_64x256x64_1x1x1"),          # mixtral-decode
    (32768, 256, 4096, 7168, "sm90_pingpong_64x256x64_1x1x1"),      # dsv3-prefill, 128 rows/expert
    (24576, 128, 1024, 1024, "sm90_pingpong_64x256x64_1x1x1"),      # seed000-g128
    (24576, 8, 1024, 1024, "sm90_cooperative_128x256x64_1x2x1"),    # seed000-g8, 3072 rows/expert
    (30720, 12, 3072, 1024, "sm90_cooperative_128x256x64_1x2x1"),   # seed004-uniform
    (0, 0, 8, 8, "sm90_pingpong_64x256x64_1x1x1"),
])
def test_heuristic_picks_small_m_tiles_unless_experts_have_thousands_of_rows(t, e, n, k, expect):
    assert cutlass_moe.select_config(t, e, n, k, backend="grouped") == ("grouped", expect)


WIDE_TILE = "sm90_cooperative_wide_64x512x32_1x1x1"


# The rule fitted on benchmarks/sweep_h200.json (heuristics.cpp): the cooperative tile from 768 rows
# per expert (bf16, K >= 256: it defers its stores), from 256 with 32 or more experts, and below with
# deep K among many experts. The wide tile (fast DRAM, (E, K, N) weights, N padded no more by 512
# columns than by 256) takes the cooperative tile's place below 256 rows among 32 or more experts,
# and the pingpong tile's from 65 to 767 rows among fewer experts with N >= 16384. Fewer experts with
# N < 16384 and K >= 2560 keep the pingpong tile up to 1535 rows.
@pytest.mark.parametrize("t,e,n,k,expect", [
    (1024, 256, 4096, 7168, "sm90_pingpong_64x256x64_1x1x1"),       # dsv3-decode
    (64, 8, 28672, 4096, "sm90_pingpong_64x256x64_1x1x1"),          # mixtral-decode: 8 rows/expert
    (24576, 128, 1024, 1024, "sm90_pingpong_64x256x64_1x1x1"),      # seed000-g128: 192 rows/expert
    (32768, 128, 1536, 192, "sm90_pingpong_64x256x64_1x1x1"),       # 256 rows/expert, K = 192: no deferral
    (32768, 128, 1536, 2048, "sm90_cooperative_128x256x64_1x1x1"),  # qwen3-30b-prefill: 256 rows/expert
    (24576, 64, 1024, 1024, "sm90_cooperative_128x256x64_1x1x1"),   # seed000-g64: 384 rows/expert
    (24576, 32, 1024, 1024, "sm90_cooperative_128x256x64_1x1x1"),   # seed000-g32: 768 rows/expert
    (8192, 8, 28672, 4096, "sm90_cooperative_128x256x64_1x1x1"),    # mixtral-prefill: 8 experts, 1024 rows
    (4096, 16, 16384, 5120, WIDE_TILE),                             # seed001-llama4: 16 experts, 256 rows
    (3072, 8, 28672, 4096, WIDE_TILE),                              # Mixtral gate/up: 384 rows, 8 experts
    (4096, 8, 4096, 14336, "sm90_pingpong_64x256x64_1x1x1"),        # Mixtral down at 512 rows: N < 16384
    (8192, 8, 4096, 14336, "sm90_pingpong_64x256x64_1x1x1"),        # Mixtral down at 1024 rows: N < 16384
    (12288, 8, 4096, 14336, "sm90_cooperative_128x256x64_1x1x1"),   # Mixtral down at 1536 rows
    (16384, 16, 5120, 8192, "sm90_pingpong_64x256x64_1x1x1"),       # Llama 4 Scout down at 1024 rows
    (24576, 8, 1024, 1024, "sm90_cooperative_128x256x64_1x1x1"),    # seed000-g8: 3072 rows/expert, K = 1024
    (30720, 12, 3072, 1024, "sm90_cooperative_128x256x64_1x1x1"),   # seed004-uniform: 2560 rows/expert
    (32768, 256, 4096, 7168, WIDE_TILE),                            # dsv3-prefill: deep K, 128 rows/expert
    (16384, 128, 3072, 4096, WIDE_TILE),                            # Qwen3-235B gate/up, 128 rows/expert
    (16384, 128, 2880, 2880, WIDE_TILE),                            # gpt-oss-120b down: 12 columns of 256, 6 of 512
    (16384, 128, 5760, 2880, "sm90_cooperative_128x256x64_1x1x1"),  # gptoss-120b-prefill: 23 of 256, 12 of 512
    (65536, 256, 4096, 7168, "sm90_cooperative_128x256x64_1x1x1"),  # dsv3 gate/up at 256 rows/expert
    (16384, 128, 5760, 1024, "sm90_pingpong_64x256x64_1x1x1"),      # 128 rows/expert, K = 1024
    (16384, 32, 5760, 2880, "sm90_cooperative_128x256x64_1x1x1"),   # gpt-oss-20b: 32 experts, 512 rows/expert
    (262144, 64, 2816, 2048, "sm90_cooperative_128x256x64_1x1x1"),  # 4096 rows/expert, K = 2048
    (32768, 64, 2048, 2048, "sm90_cooperative_128x256x64_1x1x1"),   # OLMoE gate/up: 512 rows/expert
    (65536, 256, 7168, 2048, "sm90_cooperative_128x256x64_1x1x1"),  # DeepSeek-V3 down: 256 rows/expert
])
def test_moe_heuristic_takes_128_row_tiles_with_deep_k_among_many_experts_or_thousands_of_rows(t, e, n, k, expect):
    # device=-1: the rule as fitted (an H200's DRAM); the H100's exception is tested on the GPU.
    assert cutlass_moe.select_config(t, e, n, k, backend="moe", device=-1) == ("moe", expect)


# A call also launches the cooperative tile, which the device runs instead on splits of whole 128-row
# tiles (heuristics.cpp, select_aligned_config), where the rule picks:
# - the wide tile for fewer than 32 experts with 256 or more rows each (with (E, N, K) weights the
#   rule takes the cooperative tile there outright);
# - the pingpong tile for 32 or more experts with 65-255 rows each, in calls of 2^37 MACs or more.
# T must be a multiple of 128.
@pytest.mark.parametrize("t,e,n,k,trans_b,expect", [
    (4096, 16, 16384, 5120, False, "sm90_cooperative_128x256x64_1x1x1"),  # seed001-llama4: 256 rows
    (3072, 8, 28672, 4096, False, "sm90_cooperative_128x256x64_1x1x1"),   # Mixtral gate/up: 384 rows
    (3072 + 64, 8, 28672, 4096, False, None),                             # T not a multiple of 128
    (1024, 8, 28672, 4096, False, None),                                  # 128 rows: no faster there
    (4096, 16, 16384, 5120, True, None),                                  # (E, N, K): the cooperative tile outright
    (3072, 8, 28672, 4096, True, None),                                   # the same, Mixtral gate/up at 384 rows
    (2048, 16, 16384, 5120, True, None),                                  # (E, N, K) at 128 rows
    (32768, 256, 4096, 7168, False, None),                                # dsv3-prefill: many experts
    (8192, 8, 28672, 4096, False, None),                                  # mixtral-prefill: cooperative
    (32768, 256, 7168, 2048, False, "sm90_cooperative_128x256x64_1x1x1"), # dsv3 down, 128 rows: pingpong
    (24576, 256, 7168, 2048, True, "sm90_cooperative_128x256x64_1x1x1"),  # dsv3 down, 96 rows, (E, N, K)
    (24576, 128, 4096, 1536, False, "sm90_cooperative_128x256x64_1x1x1"), # qwen3-235b down, 192 rows
    (16384, 256, 7168, 2048, False, None),                                # 64 rows: no consistent gain
    (32768 + 64, 256, 7168, 2048, False, None),                           # T not a multiple of 128
    (24576, 128, 1536, 2048, False, None),                                # qwen3-30b gate/up: under 2^37 MACs
    (8192, 64, 2048, 1024, False, None),                                  # olmoe down: under 2^37 MACs
    (2048, 8, 4096, 14336, False, None),                                  # Mixtral down, 256 rows: few experts
    (32768, 128, 1536, 2048, False, None),                                # qwen3-30b-prefill: cooperative
])
def test_a_second_config_for_splits_of_whole_tiles(t, e, n, k, trans_b, expect):
    assert cutlass_moe.aligned_config(t, e, n, k, device=-1, trans_b=trans_b) == expect
    assert cutlass_moe.aligned_config(t, e, n, k, backend="grouped", device=-1, trans_b=trans_b) is None
    with pytest.raises(ValueError, match="backend"):
        cutlass_moe.aligned_config(t, e, n, k, backend="bogus")


def test_which_splits_run_the_aligned_config():
    # The kernel's SplitGate: every count a multiple of 128 and some expert holding two tiles or more.
    from cutlass_moe.ops import runs_aligned_config
    assert runs_aligned_config([256] * 8) and runs_aligned_config(torch.tensor([0, 128, 384, 0]))
    assert not runs_aligned_config([128] * 8)             # one tile per expert: the plan's pick
    assert not runs_aligned_config([256, 250, 262, 256])  # a count off
    assert not runs_aligned_config([0, 0, 0, 0])
    assert runs_aligned_config(torch.tensor([-128, 4096, 0], dtype=torch.int32))  # hostile, as the device reads them


def test_heuristic_sees_the_weights_layout_and_the_dtype():
    # The wide tile is built for (E, K, N) weights only: with trans_b the cooperative tile takes its
    # place from 256 rows per expert (aligned_split_bench.py --trans-b --seeds 3), the pingpong tile's
    # below.
    assert cutlass_moe.select_config(4096, 16, 16384, 5120, device=-1) == ("moe", WIDE_TILE)
    assert cutlass_moe.select_config(4096, 16, 16384, 5120, device=-1, trans_b=True) == (
        "moe", "sm90_cooperative_128x256x64_1x1x1")
    assert cutlass_moe.select_config(3072, 16, 16384, 5120, device=-1, trans_b=True) == (
        "moe", "sm90_pingpong_64x256x64_1x1x1")  # 192 rows per expert
    assert cutlass_moe.select_config(4096, 8, 28672, 4096, device=-1) == ("moe", WIDE_TILE)
    assert cutlass_moe.select_config(4096, 8, 28672, 4096, device=-1, trans_b=True) == (
        "moe", "sm90_cooperative_128x256x64_1x1x1")
    assert cutlass_moe.select_config(4096, 8, 4096, 14336, device=-1, trans_b=True) == (
        "moe", "sm90_pingpong_64x256x64_1x1x1")  # Mixtral's down projection: N < 16384
    # From 768 rows per expert Mixtral's down projection takes the cooperative tile with (E, N, K)
    # weights, with (E, K, N) weights from 1536.
    assert cutlass_moe.select_config(8192, 8, 4096, 14336, device=-1, trans_b=True) == (
        "moe", "sm90_cooperative_128x256x64_1x1x1")
    assert cutlass_moe.select_config(8192, 8, 4096, 14336, device=-1) == ("moe", "sm90_pingpong_64x256x64_1x1x1")
    # The cooperative tile defers its stores in bf16 only: fp16 at 256 rows per expert with K < 2560
    # keeps the pingpong tile (qwen3-30b-prefill's shape).
    assert cutlass_moe.select_config(32768, 128, 1536, 2048, device=-1) == ("moe", "sm90_cooperative_128x256x64_1x1x1")
    assert cutlass_moe.select_config(32768, 128, 1536, 2048, device=-1, dtype=torch.float16) == (
        "moe", "sm90_pingpong_64x256x64_1x1x1")
    with pytest.raises(TypeError, match="dtype"):
        cutlass_moe.select_config(64, 8, 64, 64, device=-1, dtype=torch.float32)


def test_wgrad_family_takes_grouped_only_when_accumulating():
    # benchmarks/wgrad_sweep_h200.json: the MoE wgrad kernel from 128 to 4096 rows per expert; CUTLASS's
    # grouped GEMM (a read-add-write epilogue) when adding into an fp32 buffer.
    def family(t, e, accumulate=False):
        return ops._BACKEND_NAMES[_C.select_wgrad(t, e, accumulate)]
    for t, e in ((32768, 128), (8192, 8), (4096 * 32, 32), (0, 0)):
        assert family(t, e) == "moe"
        assert family(t, e, accumulate=True) == "grouped"


def test_moe_backend_config_and_auto_backend_resolve():
    assert cutlass_moe.select_config(1024, 256, 4096, 7168, device=-1) == ("moe", "sm90_pingpong_64x256x64_1x1x1")
    for t, e, n, k in [(32768, 256, 4096, 7168), (8192, 8, 28672, 4096), (16384, 128, 5760, 2880),
                       (4096, 16, 16384, 5120), (24576, 8, 1024, 1024), (30720, 12, 3072, 1024)]:
        assert cutlass_moe.select_config(t, e, n, k, device=-1)[0] == "moe"
    # Thousands of rows per expert with K >= 1536: the MoE family's cooperative tile, which defers its
    # stores in bf16 (select_config's problem); the grouped family's 1x2-cluster tile took them before.
    for t, e, n, k in [(262144, 64, 2816, 2048), (32768, 8, 28672, 4096), (131072, 32, 5760, 2880)]:
        assert cutlass_moe.select_config(t, e, n, k, device=-1) == ("moe", "sm90_cooperative_128x256x64_1x1x1")
    for family in ("sm80_moe", "sm80_grouped"):
        assert cutlass_moe.select_config(1024, 256, 4096, 7168, backend=family) == (family, "sm80_64x128x32_32x64_s4")
        assert cutlass_moe.select_config(32768, 256, 4096, 7168, backend=family) == (family, "sm80_128x128x32_64x64_s4")
    with pytest.raises(ValueError, match="backend"):
        cutlass_moe.select_config(1, 1, 8, 8, backend="fast")


_SM90_FAMILIES = {"grouped", "moe"}
_SM80_FAMILIES = {"sm80_grouped", "sm80_moe"}


def _build_archs(info):
    """(archs, sm80_family_ccs) from build_info()'s fields, or parsed off its summary
    ("...; archs 90a; sm80 families for sm_90") from a core that does not report them."""
    archs = info.get("archs")
    if archs is None:
        match = re.search(r"archs ([0-9a-z,]+)", info["summary"])
        assert match, info["summary"]
        archs = match.group(1).split(",")
    ccs = info.get("sm80_family_ccs")
    if ccs is None:
        match = re.search(r"sm80 families for ((?:sm_[0-9]+,?)*)", info["summary"])
        assert match, info["summary"]
        ccs = [int(a[3:]) for a in match.group(1).split(",") if a]
    return [str(a) for a in archs], [int(c) for c in ccs]


def test_compiled_module_reports_its_build():
    # Whatever the build configuration (CUTLASS_MOE_ARCHS, CUTLASS_MOE_DTYPES,
    # CUTLASS_MOE_WEIGHT_LAYOUTS, the config lists), what build_info() reports must be consistent:
    # the archs and the sm80 families' compute capabilities agree, every instance names known
    # values of its family's arch, sm90 instances exist only in a 90a build, and each family's
    # instances are the full product of its dtypes, layouts and configs (the build table in
    # CMakeLists.txt is a product, with one dtype list and one layout list for every family).
    info = cutlass_moe.build_info()
    assert "CUTLASS 4." in info["summary"], info["summary"]
    assert info["version"] == cutlass_moe.__version__
    archs, ccs = _build_archs(info)
    assert archs and all(re.fullmatch(r"8[0-9]|90a", a) for a in archs), archs
    # CMakeLists.txt: 90a builds the sm80 families for sm_90, each 8x arch for sm_8x.
    assert set(ccs) == {90 if a == "90a" else int(a) for a in archs}, (archs, ccs)

    configs = set(dict(_C.config_names())) - {"auto"}
    assert _SM90_FAMILIES | _SM80_FAMILIES <= set(dict(_C.backend_names())), _C.backend_names()
    instances = list(info["instances"])
    assert instances, "a build without kernels"
    assert len(set(instances)) == len(instances), instances
    families = {}
    wgrad = {}
    for name in instances:
        fields = name.split(":")
        assert len(fields) == 5, name
        arch, backend, dtype, layout, config = fields
        if backend.startswith("wgrad_"):  # arch:wgrad_<family>:dtype:out_dtype:config, out_dtype = dtype or fp32
            family = backend[len("wgrad_"):]
            assert family in (("moe", "grouped") if arch == "sm90" else ("sm80_grouped",)), name
            assert arch in ("sm90", "sm80") and (arch == "sm80" or "90a" in archs), name
            assert dtype in ("bf16", "fp16") and layout in (dtype, "fp32"), name
            assert config in configs and config.startswith(arch + "_"), name
            wgrad.setdefault(backend, set()).add((dtype, layout, config))
            continue
        assert dtype in ("bf16", "fp16") and layout in ("kn", "nk"), name
        assert config in configs and config.startswith(arch + "_"), name
        if arch == "sm90":
            assert backend in _SM90_FAMILIES and "90a" in archs, name
        else:
            assert arch == "sm80" and backend in _SM80_FAMILIES, name
        families.setdefault((arch, backend), set()).add((dtype, layout, config))
    dtypes = {d for members in families.values() for d, _, _ in members}
    layouts = {l for members in families.values() for _, l, _ in members}
    for (arch, backend), members in families.items():
        family_configs = {c for _, _, c in members}
        # The MoE family's wide tile is built for (E, K, N) weights only (CMakeLists.txt).
        expected = {(d, l, c) for d, l, c in itertools.product(dtypes, layouts, family_configs)
                    if not ("_wide_" in c and l != "kn")}
        assert members == expected, (
            f"{arch}:{backend} is not the product of {sorted(dtypes)} x {sorted(layouts)} x {sorted(family_configs)}: "
            f"{sorted(members)}")
    # The wgrad families: every dtype of the build, each with its own dtype and fp32 as output.
    for family, members in wgrad.items():
        family_configs = {c for _, _, c in members}
        expected = {(d, o, c) for d in dtypes for o in (d, "fp32") for c in family_configs}
        assert members == expected, f"{family}: {sorted(members)}, expected {sorted(expected)}"


def test_bench_counts_follow_the_public_recipe():
    from cutlass_moe import bench
    cases = bench.load_cases()
    counts = bench.case_counts(cases)
    for case in cases:
        c = counts[case["name"]]
        assert c.shape == (case["E"],) and int(c.sum()) == case["T"] and bool((c >= 0).all())
    # The published floors were computed from these counts (only experts with tokens count).
    for case in cases:
        floor = bench.floor_ms(case, counts[case["name"]], bench.H200_TFLOPS, bench.H200_TBPS)
        assert floor == pytest.approx(case["floor_ms"], rel=0.02, abs=2e-3), case["name"]


def test_bench_fixed_ceilings_per_gpu():
    # Issue 12's fixed rates: 790 TFLOP/s on both Hoppers, 4.36 TB/s on an H200, 3.08 on an H100 SXM.
    from cutlass_moe import bench
    assert bench.fixed_ceilings("NVIDIA H100 80GB HBM3") == ("H100", 790.0, 3.08)
    assert bench.fixed_ceilings("NVIDIA H200") == ("H200", 790.0, 4.36)
    assert bench.fixed_ceilings("NVIDIA H100 PCIe")[0] == "H200"  # not the SXM part: no fixed rates of its own
    # A memory-bound case (decode: 8 rows per expert): its floor scales with the bandwidth alone.
    case = {"T": 64, "K": 4096, "N": 14336}
    counts = torch.full((8,), 8)
    h100 = bench.floor_ms(case, counts, *bench.fixed_ceilings("NVIDIA H100 80GB HBM3")[1:])
    h200 = bench.floor_ms(case, counts, *bench.fixed_ceilings("NVIDIA H200")[1:])
    assert h100 / h200 == pytest.approx(4.36 / 3.08)


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU behaviour")
def test_bench_without_gpu_says_so(capsys):
    from cutlass_moe import bench
    assert bench.main(["--cases", "dsv3-decode"]) == 1
    out = capsys.readouterr().out
    assert "no CUDA GPU" in out and "dsv3-decode" in out


def test_bench_peers_and_plot(tmp_path):
    # The bmm peer runs only where every expert has T/E rows, and computes the same as the loop.
    from cutlass_moe import bench
    x, w = torch.randn(12, 16), torch.randn(3, 16, 8)
    assert bench.bmm_peer(x, w, torch.tensor([4, 5, 3])) is None
    uniform = torch.tensor([4, 4, 4])
    torch.testing.assert_close(bench.bmm_peer(x, w, uniform)(), bench.loop_peer(x, w, uniform)())
    rows = [{"name": f"seed000-g{e}", "E": e, "T": 64, "K": 16, "N": 8, "moe_gemm_ms": 0.1 * e, "loop_ms": 0.2 * e}
            for e in (8, 16)]
    path = tmp_path / "sweep.png"
    try:
        import matplotlib  # noqa: F401  (an optional extra)
    except ImportError:
        with pytest.raises(SystemExit, match="pip install matplotlib"):
            bench.plot(rows, str(path), "cpu")
    else:
        bench.plot(rows, str(path), "cpu")
        assert path.stat().st_size > 1000


def test_paired_ratio_pairs_each_call_with_its_neighbour(monkeypatch):
    # bench.paired_ratio on a fake clock: `other` takes 1.1x `base` while the clock's speed drifts
    # from pair to pair (as a power-capped card's does); each pair's ratio stays 1.1 whichever call
    # goes first, and the medians of each side's times follow the drift.
    from cutlass_moe import bench
    clock = {"now": 0.0, "speed": 1.0, "order": []}

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock["now"]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.t - self.t

    def call(name, cost):
        def fn():
            clock["order"].append(name)
            clock["now"] += cost / clock["speed"]
        return fn

    class Flush:
        def zero_(self):
            clock["speed"] = 1.0 + 0.1 * (len(clock["order"]) // 2 % 3)  # a new clock every pair

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "_l2_flush_buffer", lambda: Flush())
    monkeypatch.setattr(bench, "heat", lambda fn, ms=bench.HEAT_MS: None)
    result = bench.paired_ratio(call("base", 1.0), call("other", 1.1), ms=63.0)
    assert result["pairs"] == 30  # 63 ms over 2.1 ms per pair
    assert abs(result["ratio"] - 1.1) < 1e-9 and abs(result["ratio_p25"] - 1.1) < 1e-9
    # the first pair (base, other) after the one-pair estimate, then swapped pair by pair
    assert clock["order"][2:8] == ["base", "other", "other", "base", "base", "other"]
    assert 0.9 < result["base_ms"] < 1.0 and abs(result["other_ms"] / result["base_ms"] - 1.1) < 1e-9
    assert bench.paired_ratio(call("base", 1.0), call("other", 1.1), ms=1.0)["pairs"] == 20  # at least 20


def test_median_of_rounds_heats_with_the_first_runner(monkeypatch):
    # A card that paused boosts its clock: the first runner heats the GPU before any round, then the
    # rounds alternate their order and each runner keeps its median. bench --rounds must be >= 1.
    from cutlass_moe import bench
    events, ticks = [], iter([5.0, 1.0, 2.0, 6.0, 3.0, 4.0])
    monkeypatch.setattr(bench, "heat", lambda fn, ms=bench.HEAT_MS: events.append(("heat", fn(), ms)))
    monkeypatch.setattr(bench, "_do_bench", lambda fn, warmup_ms, rep_ms: (events.append(("time", fn())), next(ticks))[1])
    times = bench.median_of_rounds({"a": lambda: "a", "b": lambda: "b"}, rounds=3, heat_ms=7.0)
    assert events[0] == ("heat", "a", 7.0)
    assert [e[1] for e in events[1:]] == ["a", "b", "b", "a", "a", "b"]
    assert times == {"a": 5.0, "b": 2.0}  # medians of (5, 6, 3) and (1, 2, 4)
    monkeypatch.undo()
    if not HAS_CUDA:  # without CUDA, heat is a no-op
        calls = []
        bench.heat(lambda: calls.append(1), 50.0)
        assert calls == []
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])


def test_tuning_file_choices(tmp_path, monkeypatch):
    # What cutlass_moe.tune remembers is read once per device, keyed by dtype, layout, T, E, N, K.
    import json
    import warnings
    from cutlass_moe import tuning
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("CUTLASS_MOE_TUNING_FILE", str(path))
    monkeypatch.setattr(tuning, "_tables", {})
    assert cutlass_moe.tuning_file() == str(path)
    bf16, kn = ops._DTYPES[torch.bfloat16], ops._LAYOUTS["kn"]
    assert tuning.choice(bf16, kn, 64, 4, 128, 256, 0) is None  # no file: the heuristic
    chosen = {"backend": "grouped", "config": "sm90_pingpong_64x256x64_1x1x1"}
    path.write_text(json.dumps({"choices": {"bf16:kn:64:4:128:256": chosen}}))
    monkeypatch.setattr(tuning, "_tables", {})
    assert tuning.choice(bf16, kn, 64, 4, 128, 256, 0) == ("grouped", "sm90_pingpong_64x256x64_1x1x1")
    assert tuning.choice(bf16, kn, 64, 4, 256, 128, 0) is None
    assert tuning.choice(bf16, ops._LAYOUTS["nk"], 64, 4, 128, 256, 0) is None
    monkeypatch.setenv("CUTLASS_MOE_TUNING", "0")
    monkeypatch.setattr(tuning, "_tables", {})
    assert tuning.choice(bf16, kn, 64, 4, 128, 256, 0) is None  # switched off
    monkeypatch.delenv("CUTLASS_MOE_TUNING")
    path.write_text("{not json")
    monkeypatch.setattr(tuning, "_tables", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tuning.choice(bf16, kn, 64, 4, 128, 256, 0) is None
    assert any("ignoring the tuning file" in str(w.message) for w in caught)
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="tune: needs a CUDA GPU"):
            cutlass_moe.tune([(64, 4, 256, 128)])


def test_time_configs_alternates_rounds_and_takes_the_median(monkeypatch):
    # tune's and the sweep's timing: each config timed `rounds` times, the order reversed every
    # other round, its median kept; configs that raise or disagree with the auto call left out.
    from cutlass_moe import bench, tuning
    calls, ticks = [], iter([3.0, 1.0, 9.0, 2.0, 5.0, 4.0, 8.0, 6.0, 7.0])

    def fake_moe_gemm(x, w, counts, trans_b=False, backend="auto", config="auto"):
        if config == "raises":
            raise NotImplementedError("not built")
        return x @ w[0] + (1.0 if config == "wrong" else 0.0)

    def fake_bench(fn, warmup_ms, rep_ms):
        calls.append(fn.__defaults__[1])
        return next(ticks)

    monkeypatch.setattr(ops, "moe_gemm", fake_moe_gemm)
    monkeypatch.setattr(bench, "_do_bench", fake_bench)
    x, w = torch.ones(4, 8), torch.ones(1, 8, 8) / 8
    pairs = [("moe", "a"), ("moe", "raises"), ("moe", "b"), ("moe", "wrong"), ("grouped", "c")]
    times = tuning.time_configs(x, w, torch.tensor([4]), False, pairs, 1.0, 1.0, rounds=3)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert times == {"moe:a": 4.0, "moe:b": 5.0, "grouped:c": 7.0}  # medians of (3, 4, 8), (1, 5, 6), (9, 2, 7)
    with pytest.raises(ValueError, match="rounds"):
        tuning.time_configs(x, w, torch.tensor([4]), False, pairs, 1.0, 1.0, rounds=0)


def _benchmark_module(name: str):
    """benchmarks/<name>.py, imported from its file (benchmarks/ is not a package)."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sweep_shapes_splits_and_summary(monkeypatch):
    # benchmarks/sweep.py (issue 12's heuristic sweep): its splits sum to T, the skewed one gives
    # one expert half of the rows, and the summary judges the heuristic over the shapes above the floor.
    sweep = _benchmark_module("sweep")
    for split in sweep.SPLITS:
        counts = sweep.split_counts(60, 60 * 129, split, seed=3)
        assert int(counts.sum()) == 60 * 129 and bool((counts >= 0).all()), split
    assert int(sweep.split_counts(60, 60 * 129, "skewed", seed=3).max()) >= 60 * 129 // 2
    with pytest.raises(ValueError, match="split"):
        sweep.split_counts(4, 64, "zipf", seed=0)
    # "aligned" (on request): random counts in whole 128-row tiles, the remainder to the last expert.
    aligned = sweep.split_counts(60, 60 * 256, "aligned", seed=3)
    assert int(aligned.sum()) == 60 * 256 and bool((aligned % 128 == 0).all()) and len(set(aligned.tolist())) > 1
    assert int(sweep.split_counts(60, 60 * 129, "aligned", seed=3)[:-1].remainder(128).sum()) == 0
    # "hotP" (on request): one expert holds P percent of the rows, the rest are random.
    hot = sweep.split_counts(60, 60 * 129, "hot10", seed=3)
    assert int(hot.sum()) == 60 * 129 and bool((hot >= 0).all()) and int(hot.max()) >= 60 * 129 // 10
    for bad in ("hot0", "hot100", "hotx"):
        with pytest.raises(ValueError, match="hotP"):
            sweep.split_counts(4, 64, bad, seed=0)
    shapes = list(sweep.shapes(["olmoe"], [16, 256], ["uniform"]))
    assert [(s["proj"], s["K"], s["N"], s["T"]) for s in shapes] == [
        ("gate_up", 2048, 2048, 1024), ("gate_up", 2048, 2048, 16384), ("down", 1024, 2048, 1024),
        ("down", 1024, 2048, 16384)]
    # --draws: that many rows of each drawn split, one of each even split.
    drawn = [s["split"] for s in sweep.shapes(["olmoe"], [16], ["uniform", "random", "skewed"], draws=3)]
    assert drawn == (["uniform"] + ["random"] * 3 + ["skewed"] * 3) * 2
    # --projs: one projection alone.
    assert [s["proj"] for s in sweep.shapes(["olmoe"], [16, 256], ["uniform"], projs=["down"])] == ["down"] * 2
    with pytest.raises(ValueError, match="projs"):
        list(sweep.shapes(["olmoe"], [16], ["uniform"], projs=["up"]))
    rows = [dict(model="m", proj="p", E=8, T=t, K=64, N=64, split="uniform", floor_us=floor, heuristic="moe:a",
                 heuristic_ms=h, times={"moe:a": h, "moe:b": b})
            for t, floor, h, b in ((1, 10.0, 1.0, 0.1), (2, 100.0, 0.2, 0.2), (3, 100.0, 0.3, 0.25))]
    summary = sweep.summarize(rows, min_floor_us=50.0)
    assert summary["shapes"] == 2 and summary["heuristic_within_5pct"] == 0.5
    assert summary["floor_fraction_min"] == pytest.approx(100.0 / 300.0)
    assert summary["shapes_under_0.7_of_floor"] == 2
    assert summary["worst_five"][0]["T"] == 3
    # --judge: a stored table judged again with the installed heuristic, against the default
    # build's configs only (a table timed with extra configs keeps them out of "the best").
    pick = ":".join(cutlass_moe.select_config(8192, 8, 28672, 4096, device=-1))
    stored = [dict(model="mixtral", proj="gate_up", E=8, T=8192, K=4096, N=28672, split="uniform", floor_us=2400.0,
                   heuristic="stale:pick", heuristic_ms=9.0,
                   times={**{c: 3.0 for c in sweep.DEFAULT_CONFIGS}, pick: 2.9, "moe:extra_tile": 1.0})]
    judged = sweep.judge(stored, sweep.DEFAULT_CONFIGS)
    assert judged[0]["heuristic"] == pick and judged[0]["heuristic_ms"] == 2.9
    assert "moe:extra_tile" not in judged[0]["times"]
    assert sweep.summarize(judged, min_floor_us=50.0)["heuristic_within_5pct"] == 1.0
    # What auto runs: on an even split of whole 128-row tiles where the plan holds a second config
    # (Llama 4 Scout's gate/up at 256 rows), that config's time; on an uneven split, the pick's.
    wide, coop = "moe:sm90_cooperative_wide_64x512x32_1x1x1", "moe:sm90_cooperative_128x256x64_1x1x1"
    llama4 = dict(model="llama4-scout", proj="gate_up", E=16, T=4096, K=5120, N=16384, floor_us=900.0,
                  times={**{c: 1.2 for c in sweep.DEFAULT_CONFIGS}, wide: 1.1, coop: 1.05})
    judged = sweep.judge([{**llama4, "split": "uniform"}, {**llama4, "split": "random"}], sweep.DEFAULT_CONFIGS)
    assert [(r["heuristic"], r["heuristic_ms"]) for r in judged] == [(coop, 1.05), (wide, 1.1)]
    # --judge-device: the pick is that device's rule (an H100's table is judged on an H100).
    asked = []
    monkeypatch.setattr(cutlass_moe, "select_config",
                        lambda *a, device=None, trans_b=False: asked.append((device, trans_b)) or ("moe", "x"))
    monkeypatch.setattr(cutlass_moe, "aligned_config", lambda *a, device=None, trans_b=False: None)
    assert sweep.judge(stored, sweep.DEFAULT_CONFIGS, device=3)[0]["heuristic"] == "moe:x" and asked == [(3, False)]
    # A table timed with (E, N, K) weights (--trans-b) is judged with that layout's rule.
    sweep.judge(stored, sweep.DEFAULT_CONFIGS, trans_b=True)
    assert asked[-1] == (-1, True)


def test_wgrad_sweep_summary():
    # benchmarks/wgrad_sweep.py (issue 10's wgrad sweep): per family, the share of shapes within 5% of
    # the best family; auto's floor fraction and its speedup over torch's wgrad.
    import math
    wgrad_sweep = _benchmark_module("wgrad_sweep")
    rows = [dict(times={"moe": 1.0, "grouped": 1.5}, auto_ms=1.0, torch_ms=1.2, floor_ms=0.8),
            dict(times={"moe": 2.0, "grouped": 2.02}, auto_ms=2.0, torch_ms=1.8, floor_ms=1.0)]
    summary = wgrad_sweep.summarize(rows)
    assert summary["shapes"] == 2
    assert summary["moe_within_5pct"] == 1.0 and summary["grouped_within_5pct"] == 0.5
    assert summary["auto_floor_fraction_min"] == pytest.approx(0.5)
    assert summary["auto_floor_fraction_geomean"] == pytest.approx(math.sqrt(0.8 * 0.5))
    assert summary["auto_over_torch_min"] == pytest.approx(0.9)
    assert summary["auto_over_torch_geomean"] == pytest.approx(math.sqrt(1.2 * 0.9))
    # A table without torch's times (--trans-b) leaves the comparison out.
    assert "auto_over_torch_geomean" not in wgrad_sweep.summarize([{**rows[0], "torch_ms": None}])
    assert wgrad_sweep.summarize([]) == {"shapes": 0}


def test_ab_bench_summary_of_forward_and_wgrad_rounds(tmp_path, capsys):
    # benchmarks/ab_bench.py --summarize: per case and runner, each build's median over its rounds,
    # new/old and a REGRESSION verdict; --wgrad rounds carry the weight gradient's runners.
    import json
    ab_bench = _benchmark_module("ab_bench")

    def run(label, ms, runners):
        row = {"name": "case", "E": 8, "T": 64, "K": 32, "N": 32, "counts_sha1": "x", "floor_ms": None}
        row.update({f"{r}_ms": v for r, v in zip(runners, ms)})
        return {"label": label, "rev": label, "device": "test", "cases": [row]}

    for kind, runners in (("fwd", ("auto", "moe")), ("wgrad", ("wauto", "wmoe"))):
        files = []
        for i, (label, ms) in enumerate([("old", (1.0, 1.0)), ("new", (0.9, 1.5)), ("old", (1.0, 1.0)),
                                         ("new", (0.9, 1.5))]):
            files.append(tmp_path / f"{kind}_{i}.json")
            files[-1].write_text(json.dumps(run(label, ms, runners)))
        out = tmp_path / f"{kind}_summary.txt"
        assert ab_bench.main(["--summarize", *map(str, files), "--summary-out", str(out)]) == 3  # a regression
        text = out.read_text()
        first, second = runners
        assert any(line.split()[:2] == ["case", first] and "0.900" in line and line.endswith("ok")
                   for line in text.splitlines())
        assert any(line.split()[:2] == ["case", second] and "1.500" in line and line.endswith("REGRESSION")
                   for line in text.splitlines())
    capsys.readouterr()
    # --wgrad's check: dW[e] against x_e^T dy_e per expert; an expert with no rows must be zeros.
    counts = torch.tensor([2, 0, 3])
    x, dy = torch.randn(5, 4), torch.randn(5, 6)
    dw = torch.stack([x[:2].t() @ dy[:2], torch.zeros(4, 6), x[2:].t() @ dy[2:]])
    assert ab_bench.worst_expert_rel_wgrad(dw, x, dy, counts) < 1e-6
    dw[2] *= 1.1
    assert ab_bench.worst_expert_rel_wgrad(dw, x, dy, counts) == pytest.approx(0.1, rel=1e-4)
    dw[1, 0, 0] = 1.0
    assert ab_bench.worst_expert_rel_wgrad(dw, x, dy, counts) == float("inf")


def test_is_missing_kernel_looks_through_wrapping_errors():
    # opcheck raises its own error from the op's NotImplementedError: a reduced build's missing
    # kernel must still be recognised there (and only a missing kernel).
    from conftest import is_missing_kernel

    missing = NotImplementedError("no moe kernel built for bf16, weights (E, N, K)")
    assert is_missing_kernel(missing)
    try:
        try:
            raise missing
        except NotImplementedError as inner:
            raise RuntimeError("opcheck(op, ...): test_schema failed") from inner
    except RuntimeError as wrapped:
        assert is_missing_kernel(wrapped)
    assert not is_missing_kernel(RuntimeError("opcheck(op, ...): outputs differ"))
    try:
        try:
            raise missing
        except NotImplementedError:
            raise AssertionError("a test's own check, failing while it handles the error")
    except AssertionError as own:
        assert not is_missing_kernel(own)
    assert not is_missing_kernel(NotImplementedError("something else"))
    assert not is_missing_kernel(None)


def test_is_reduced_build_names_the_quick_builds():
    # conftest turns a GPU test's "no kernel built" NotImplementedError into a skip in a reduced
    # build only; the default build's instance list must not count as reduced.
    from conftest import is_reduced_build

    def instances(arch, forward, wgrad, dtypes=("bf16", "fp16"), layouts=("kn", "nk")):
        rows = [(arch, f, d, lay, "cfg") for f in forward for d in dtypes for lay in layouts]
        outs = {"bf16": ("bf16", "fp32"), "fp16": ("fp16", "fp32")}
        return rows + [(arch, w, d, o, "cfg") for w in wgrad for d in dtypes for o in outs[d]]

    sm90 = instances("sm90", ("grouped", "moe"), ("wgrad_moe", "wgrad_grouped"))
    sm80 = instances("sm80", ("sm80_grouped", "sm80_moe"), ("wgrad_sm80_grouped",))
    assert not is_reduced_build(sm90 + sm80)
    assert not is_reduced_build(sm90)  # an arch left out entirely: its tests skip on their own
    assert is_reduced_build(instances("sm90", ("grouped", "moe"), ("wgrad_moe", "wgrad_grouped"), dtypes=("bf16",)))
    assert is_reduced_build(instances("sm90", ("grouped", "moe"), ("wgrad_moe", "wgrad_grouped"), layouts=("kn",)))
    assert is_reduced_build(instances("sm90", ("grouped", "moe"), ("wgrad_moe",)))  # no grouped wgrad
    assert is_reduced_build(instances("sm90", ("moe",), ("wgrad_moe", "wgrad_grouped")))  # no grouped family
    assert is_reduced_build(sm90 + instances("sm80", ("sm80_grouped", "sm80_moe"), ()))


def test_reduced_build_hook_skips_only_missing_kernels(pytester):
    # conftest's pytest_runtest_makereport, in a pytest run of its own: the core's "no kernel built"
    # error is a skip in a reduced build, a failure in a full one, and any other error a failure.
    import pathlib
    pytester.makeconftest(pathlib.Path(__file__).with_name("conftest.py").read_text())
    pytester.makepyfile(test_hook="""
        import conftest

        MISSING = "no moe kernel built for fp16, weights nk, config x [cutlass_moe moe_gemm.cpp:149]"

        def fake(monkeypatch, reduced):
            monkeypatch.setattr(conftest, "HAS_CUDA", True)
            monkeypatch.setattr(conftest, "is_reduced_build", lambda: reduced)

        def test_missing_kernel_reduced(monkeypatch):
            fake(monkeypatch, True)
            raise NotImplementedError(MISSING)

        def test_missing_kernel_full(monkeypatch):
            fake(monkeypatch, False)
            raise NotImplementedError(MISSING)

        def test_other_error_reduced(monkeypatch):
            fake(monkeypatch, True)
            raise NotImplementedError("something else")
    """)
    result = pytester.runpytest_subprocess("-q", "-rs")
    result.assert_outcomes(skipped=1, failed=2)
    result.stdout.fnmatch_lines(["*reduced build: no moe kernel built for fp16*"])
