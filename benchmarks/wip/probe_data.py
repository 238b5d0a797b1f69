"""Scratch: a public case's data as cutlass_moe.bench.run_case makes it (seeded x, weights scaled by
K**-0.5, the bench's counts), for the probes in this folder."""
import torch

from cutlass_moe import bench


def case_data(name: str):
    """(case, counts on the host, x, w, counts on the GPU as int32), bf16."""
    case = {c["name"]: c for c in bench.load_cases()}[name]
    counts = bench.case_counts([case])[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(case["T"], case["K"], device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(case["E"], case["K"], case["N"], device="cuda", dtype=torch.bfloat16, generator=gen) * case["K"] ** -0.5
    return case, counts, x, w, counts.to("cuda", torch.int32)
