"""Tests that run everywhere (CI has no GPU): argument checking, the reference path, layout
handling, the heuristic, the compiled module, and the benchmark's behaviour without a GPU."""
import pytest
import torch

import cutlass_moe
from cutlass_moe import moe_gemm, moe_gemm_reference
from cutlass_moe.ops import _weight_layout, _LAYOUT_KN, _LAYOUT_NK

from conftest import HAS_CUDA, random_counts

BF16 = torch.bfloat16


def make(t=48, k=32, n=24, e=3, dtype=BF16, counts=None, trans_b=False):
    x = torch.randn(t, k, dtype=dtype)
    w = torch.randn(e, n, k, dtype=dtype) if trans_b else torch.randn(e, k, n, dtype=dtype)
    c = torch.tensor([16, 0, 32]) if counts is None else counts
    return x, w, c


def _bad_cases():
    x, w, c = make()
    yield "x not a tensor", dict(x=x.tolist()), TypeError, "x:"
    yield "x rank", dict(x=x[None]), ValueError, "x: expected 2 dimensions"
    yield "x dtype", dict(x=x.float(), weights=w.float()), TypeError, "x: expected dtype"
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


def test_reference_returns_float32_with_zero_tail():
    x, w, c = make()
    ref = moe_gemm_reference(x, w, c)
    assert ref.dtype == torch.float32 and ref.shape == (48, 24)
    assert bool((ref[48:] == 0).all())
    torch.testing.assert_close(ref[:16], x[:16].float() @ w[0].float())
    torch.testing.assert_close(ref[16:48], x[16:48].float() @ w[2].float())


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


@pytest.mark.parametrize("t,e,n,k,expect", [
    (1024, 256, 4096, 7168, "sm90_pingpong_64x256x64_1x1x1"),       # dsv3-decode
    (24576, 128, 1024, 1024, "sm90_pingpong_64x256x64_1x1x1"),      # seed000-g128
    (32768, 128, 1536, 2048, "sm90_pingpong_64x256x64_1x1x1"),      # qwen3-30b-prefill: K = 2048
    (24576, 32, 1024, 1024, "sm90_pingpong_64x256x64_1x1x1"),       # seed000-g32: 768 rows/expert, K = 1024
    (8192, 8, 28672, 4096, "sm90_cooperative_128x256x64_1x1x1"),    # mixtral-prefill: 1024 rows/expert
    (32768, 256, 4096, 7168, "sm90_cooperative_128x256x64_1x1x1"),  # dsv3-prefill: deep K, 128 rows/expert
    (16384, 128, 5760, 2880, "sm90_cooperative_128x256x64_1x1x1"),  # gptoss-120b-prefill
    (4096, 16, 16384, 5120, "sm90_cooperative_128x256x64_1x1x1"),   # seed001-llama4
    (24576, 8, 1024, 1024, "sm90_cooperative_128x256x64_1x1x1"),    # seed000-g8: 3072 rows/expert
    (30720, 12, 3072, 1024, "sm90_cooperative_128x256x64_1x1x1"),   # seed004-uniform: 2560 rows/expert
])
def test_moe_heuristic_takes_128_row_tiles_with_deep_k_or_thousands_of_rows(t, e, n, k, expect):
    assert cutlass_moe.select_config(t, e, n, k, backend="moe") == ("moe", expect)


def test_moe_backend_config_and_auto_backend_resolve():
    assert cutlass_moe.select_config(1024, 256, 4096, 7168, device=-1) == ("moe", "sm90_pingpong_64x256x64_1x1x1")
    for t, e, n, k in [(32768, 256, 4096, 7168), (8192, 8, 28672, 4096), (16384, 128, 5760, 2880),
                       (4096, 16, 16384, 5120), (24576, 8, 1024, 1024)]:
        assert cutlass_moe.select_config(t, e, n, k, device=-1)[0] == "moe"
    for family in ("sm80_moe", "sm80_grouped"):
        assert cutlass_moe.select_config(1024, 256, 4096, 7168, backend=family) == (family, "sm80_64x128x32_32x64_s4")
        assert cutlass_moe.select_config(32768, 256, 4096, 7168, backend=family) == (family, "sm80_128x128x32_64x64_s4")
    with pytest.raises(ValueError, match="backend"):
        cutlass_moe.select_config(1, 1, 8, 8, backend="fast")


def test_compiled_module_reports_its_build():
    info = cutlass_moe.build_info()
    assert "CUTLASS 4." in info["summary"] and "90a" in info["summary"]
    instances = set(info["instances"])
    for dtype in ("bf16", "fp16"):
        for layout in ("kn", "nk"):
            for config in ("sm90_pingpong_64x256x64_1x1x1", "sm90_cooperative_128x256x64_1x2x1"):
                assert f"sm90:grouped:{dtype}:{layout}:{config}" in instances
            for config in ("sm90_pingpong_64x256x64_1x1x1", "sm90_cooperative_128x256x64_1x1x1"):
                assert f"sm90:moe:{dtype}:{layout}:{config}" in instances
            for family in ("sm80_grouped", "sm80_moe"):
                for config in ("sm80_64x128x32_32x64_s4", "sm80_128x128x32_64x64_s4"):
                    assert f"sm80:{family}:{dtype}:{layout}:{config}" in instances


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


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU behaviour")
def test_bench_without_gpu_says_so(capsys):
    from cutlass_moe import bench
    assert bench.main(["--cases", "dsv3-decode"]) == 1
    out = capsys.readouterr().out
    assert "no CUDA GPU" in out and "dsv3-decode" in out
