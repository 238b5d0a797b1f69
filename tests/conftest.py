"""Shared fixtures and GPU markers. GPU tests are skipped with a reason where there is no GPU;
they never pass without running."""
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE_CC = 10 * torch.cuda.get_device_capability()[0] + torch.cuda.get_device_capability()[1] if HAS_CUDA else 0
IS_SM90 = DEVICE_CC == 90

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
requires_sm90 = pytest.mark.skipif(not IS_SM90, reason="needs an sm90 (Hopper) GPU for the sm90a kernels")


def _sm80_family_ccs():
    """Compute capabilities this build's sm80 families have machine code for (from build_info)."""
    import cutlass_moe
    summary = cutlass_moe.build_info()["summary"]
    archs = summary.split("sm80 families for ")[-1]
    return {int(a.strip()[3:]) for a in archs.split(",") if a.strip().startswith("sm_")}


def runs_here(backend: str) -> bool:
    """Whether `backend` has kernels for this GPU in this build ("auto": any family)."""
    if not HAS_CUDA:
        return False
    sm90 = DEVICE_CC == 90
    sm80 = DEVICE_CC in _sm80_family_ccs()
    return {"grouped": sm90, "moe": sm90, "sm80_grouped": sm80, "sm80_moe": sm80}.get(backend, sm90 or sm80)


def backend_param(backend: str, *values):
    """A pytest.param for `backend` that skips, saying why, where it has no kernels for this GPU."""
    return pytest.param(backend, *values, marks=pytest.mark.skipif(
        not runs_here(backend), reason=f"no {backend} kernels for this GPU in this build"))


requires_kernels = pytest.mark.skipif(not runs_here("auto"), reason="no kernels for this GPU in this build")


def random_counts(num_experts: int, num_tokens: int, generator: torch.Generator, kind: str = "random") -> torch.Tensor:
    """Irregular splits summing to num_tokens: 'random' (with zero-token experts), 'hot' (one expert
    takes almost everything), 'one' (a single expert takes all), 'uniform'."""
    if num_experts == 0:
        return torch.zeros(0, dtype=torch.int64)
    if kind == "uniform":
        counts = torch.full((num_experts,), num_tokens // num_experts, dtype=torch.int64)
    elif kind == "one":
        counts = torch.zeros(num_experts, dtype=torch.int64)
        counts[int(torch.randint(num_experts, (1,), generator=generator))] = num_tokens
        return counts
    elif kind == "hot":
        counts = torch.zeros(num_experts, dtype=torch.int64)
        rest = num_tokens // 10
        idx = torch.randint(num_experts, (rest,), generator=generator)
        counts.index_add_(0, idx, torch.ones(rest, dtype=torch.int64))
        counts[int(torch.randint(num_experts, (1,), generator=generator))] += num_tokens - rest
        return counts
    elif kind == "random":
        weights = torch.rand(num_experts, generator=generator)
        weights[torch.rand(num_experts, generator=generator) < 0.3] = 0  # zero-token experts
        if weights.sum() == 0:
            weights[0] = 1
        counts = (weights / weights.sum() * num_tokens).to(torch.int64)
    else:
        raise ValueError(kind)
    counts[-1] += num_tokens - counts.sum()
    return counts
