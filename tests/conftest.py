"""Shared fixtures and GPU markers. GPU tests are skipped with a reason where there is no GPU;
they never pass without running."""
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
IS_SM90 = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
requires_sm90 = pytest.mark.skipif(not IS_SM90, reason="needs an sm90 (Hopper) GPU for the sm90a kernels")


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
