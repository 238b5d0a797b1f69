"""The row limit: cutlass_moe.MAX_TOKENS (2**31 - 1024) rows of x and out are supported, one more
is refused before any launch. The rejection is tested without allocating (expanded views); the
boundary itself needs x and out of 32 GiB each (K = N = 8, bf16) and skips, saying why, on a GPU
with less than 72 GiB free. Run them on the GPU machine."""
import pytest
import torch

import cutlass_moe
from cutlass_moe.reference import assert_close_per_expert

from conftest import backend_param, requires_cuda, skip_unless_built

pytestmark = requires_cuda

BACKENDS = ["moe", "grouped", "sm80_moe", "sm80_grouped"]

MAX_TOKENS = getattr(cutlass_moe, "MAX_TOKENS", None)
requires_max_tokens = pytest.mark.skipif(MAX_TOKENS is None, reason="MAX_TOKENS not exposed")
GIB = 1 << 30

backends = pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])


@requires_max_tokens
@backends
def test_more_rows_than_max_tokens_are_refused(backend):
    # T = MAX_TOKENS + 1 through stride-0 views of one row: nothing of that size is allocated. The
    # row count must be refused first, naming x, T and rows, before the strides are looked at.
    skip_unless_built(backend, torch.bfloat16, "kn")
    t = MAX_TOKENS + 1
    x = torch.empty(1, 8, device="cuda", dtype=torch.bfloat16).expand(t, 8)
    w = torch.randn(2, 8, 8, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([1, 1], device="cuda", dtype=torch.int32)
    out = torch.empty(1, 8, device="cuda", dtype=torch.bfloat16).expand(t, 8)
    with pytest.raises(ValueError) as info:
        cutlass_moe.moe_gemm(x, w, counts, out=out, backend=backend)
    message = str(info.value)
    assert message.startswith("x: T = ") and "rows" in message, (
        f"expected a message that starts with the argument's name, 'x: T = ... rows', got {message!r}")


@pytest.fixture(scope="module")
def max_tokens_problem():
    """x (MAX_TOKENS, 8), weights (3, 8, 8) and out (MAX_TOKENS, 8), bf16, with counts
    [MAX_TOKENS - 3000, 1000, 1999]: the last row is owned by no expert. Made once for every backend
    (64 GiB), freed after the module."""
    if MAX_TOKENS is None:
        pytest.skip("MAX_TOKENS not exposed")
    torch.cuda.empty_cache()  # what earlier tests left in PyTorch's cache counts as free
    free = torch.cuda.mem_get_info()[0]
    if free < 72 * GIB:
        pytest.skip(f"needs 72 GiB of free GPU memory for x and out at T = MAX_TOKENS, {free / GIB:.1f} GiB free")
    gen = torch.Generator(device="cuda").manual_seed(17)
    x = torch.empty(MAX_TOKENS, 8, device="cuda", dtype=torch.bfloat16)
    step = 1 << 27  # in place, in chunks: no temporary of x's size
    for first in range(0, MAX_TOKENS, step):
        x[first:first + step].normal_(generator=gen)
    w = torch.randn(3, 8, 8, device="cuda", dtype=torch.bfloat16, generator=gen)
    counts = [MAX_TOKENS - 3000, 1000, 1999]
    out = torch.empty(MAX_TOKENS, 8, device="cuda", dtype=torch.bfloat16)
    problem = {"x": x, "w": w, "counts": counts, "out": out}
    yield problem
    problem.clear()
    del x, out
    torch.cuda.empty_cache()


def _windows(first_expert_rows):
    """Row windows of expert 0 to check: its first 4096 rows, its last 4096, 4096 rows around
    2**31 - 2**20, and around each power of two from 2**27 on, where a 32-bit row * stride product
    (bytes: 2**27 rows of 16 bytes; elements: 2**28 rows of 8) or a 32-bit row would overflow."""
    centers = [1 << p for p in range(27, 31)] + [(1 << 31) - (1 << 20)]
    windows = [(0, 4096), (first_expert_rows - 4096, first_expert_rows)]
    windows += [(c - 2048, c + 2048) for c in centers if c + 2048 <= first_expert_rows]
    return windows


@requires_max_tokens
@backends
def test_max_tokens_rows(backend, max_tokens_problem):
    # The largest supported T, with an expert of almost 2**31 rows: rows far past 2**27, 2**28 and
    # 2**30 must be computed right, the two small experts at the end in full, and the one row no
    # expert owns (the last) left unwritten.
    skip_unless_built(backend, torch.bfloat16, "kn")
    x, w, counts, out = (max_tokens_problem[k] for k in ("x", "w", "counts", "out"))
    out.fill_(float("nan"))
    y = cutlass_moe.moe_gemm(x, w, torch.tensor(counts, device="cuda", dtype=torch.int64), out=out, backend=backend)
    assert y is out
    torch.cuda.synchronize()
    failures = []
    for first, last in _windows(counts[0]):  # expert 0, sampled
        try:
            assert_close_per_expert(out[first:last], x[first:last], w[:1], [last - first])
        except AssertionError as exc:
            failures.append(f"expert 0, rows [{first}, {last}) (rows below counted from {first}): {exc}")
    start = counts[0]
    stop = start + counts[1] + counts[2]
    assert stop == MAX_TOKENS - 1
    try:  # experts 1 and 2, whole
        assert_close_per_expert(out[start:stop], x[start:stop], w[1:], counts[1:])
    except AssertionError as exc:
        failures.append(f"experts 1 and 2, rows [{start}, {stop}) (experts 0 and 1 below; rows counted from "
                        f"{start}): {exc}")
    if not torch.isnan(out[stop:].float()).all():
        failures.append(f"row {stop}, which no expert owns, was written")
    assert not failures, "\n".join(failures)
