"""Data-parallel training with FSDP2 (``torch.distributed.fsdp.fully_shard``), as torchtitan shards
its MoE layers: two ranks, each with half of a batch, parameters sharded along the expert (group)
dimension, mixed precision (bf16 compute, fp32 parameters and gradient reduction). What reaches our
ops there: the parameters unsharded by FSDP's all-gather (bf16 tensors in its own buffers), and
gradients that FSDP reduce-scatters and averages over the ranks.

The check: the sharded run's losses and its gradients (gathered back with ``full_tensor()``) match
one process training the same model on the whole batch, with the parameters cast to bf16 the way
FSDP's mixed-precision policy casts them. On the CPU (gloo) this runs the reference path; on two
GPUs (nccl) the kernels. Each rank is a process of its own (torch.multiprocessing.spawn)."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import cutlass_moe

from conftest import HAS_CUDA, FusedMoeMLP, runs_here

BF16 = torch.bfloat16
EXPERTS, HIDDEN, INTER, TOP_K, GROUPS = 8, 64, 48, 2, 4
TOKENS_PER_RANK, STEPS, LR = 96, 3, 0.5


class Block(torch.nn.Module):
    """The MoE MLP, then a GroupedMLP over GROUPS equal slices of the hidden vector (PR #263's
    pattern), each a unit of its own for FSDP (and for torch.compile), as torchtitan shards and
    compiles a model's blocks."""

    def __init__(self):
        super().__init__()
        self.moe = FusedMoeMLP(EXPERTS, HIDDEN, INTER, TOP_K)  # counts from torch.bincount
        self.grouped = cutlass_moe.GroupedMLP(GROUPS, HIDDEN // GROUPS, 32, HIDDEN // GROUPS, bias=True)

    def forward(self, x):
        y = self.moe(x)
        return y + self.grouped(y.view(x.shape[0], GROUPS, -1)).reshape(x.shape[0], -1)


def _batch(device):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2 * TOKENS_PER_RANK, HIDDEN, generator=gen)
    target = torch.randn(2 * TOKENS_PER_RANK, HIDDEN, generator=gen)
    return x.to(device), target.to(device)


def _model(device):
    torch.manual_seed(0)
    return Block().to(device)


def _loss(model, x, target):
    return (model(x).float() - target).pow(2).mean()


def _rank(rank, world, init_file, device_type, result_file, compile_backend):
    """One FSDP2 rank: compile (with `compile_backend`, unless None) and shard each unit, train
    STEPS steps of SGD on its half of the batch, save the losses (averaged over the ranks), the
    first step's gradients (gathered) and the number of compiled graphs from rank 0."""
    import faulthandler
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    faulthandler.enable()  # a rank that crashes in C++ prints its Python stack
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = dist.device_mesh.init_device_mesh(device_type, (world,))
        model = _model(device)
        policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
        for unit in (model.moe, model.grouped):
            if compile_backend is not None:
                unit.compile(backend=compile_backend, fullgraph=True)
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        x, target = _batch(device)
        rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
        losses, grads = [], None
        for step in range(STEPS):
            optimizer.zero_grad()
            loss = _loss(model, x[rows], target[rows])
            loss.backward()
            if step == 0:
                grads = {name: p.grad.full_tensor().cpu() for name, p in model.named_parameters()}
            optimizer.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
        if rank == 0:
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            torch.save({"losses": losses, "grads": grads, "graphs": graphs}, result_file)
        dist.barrier()  # no rank tears down its connections while another still uses them
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: with torch 2.13's gloo group, about one rank exit in
    # twenty aborted there ("terminate called without an active exception", no Python frame left),
    # after the rank's work was done and saved.
    os._exit(0)


def _unsharded(device):
    """The same training in one process on the whole batch: parameters kept in fp32, each step's
    forward and backward on their bf16 copies (FSDP's mixed precision), the loss the mean of the
    two halves' losses (what averaging the ranks' gradients computes)."""
    model = _model(device)
    x, target = _batch(device)
    losses, grads = [], None
    for step in range(STEPS):
        low = _model(device).to(BF16)
        low.load_state_dict({k: v.to(BF16) for k, v in model.state_dict().items()})
        halves = [_loss(low, x[r * TOKENS_PER_RANK:(r + 1) * TOKENS_PER_RANK].to(BF16),
                        target[r * TOKENS_PER_RANK:(r + 1) * TOKENS_PER_RANK]) for r in range(2)]
        loss = (halves[0] + halves[1]) / 2
        loss.backward()
        with torch.no_grad():
            step_grads = {name: p.grad.float() for name, p in low.named_parameters()}
            for name, p in model.named_parameters():
                p -= LR * step_grads[name]
        if step == 0:
            grads = {name: g.cpu() for name, g in step_grads.items()}
        losses.append(loss.item())
    return losses, grads


def _run(device_type, compile_backend):
    with tempfile.TemporaryDirectory() as tmp:
        init_file, result_file = os.path.join(tmp, "init"), os.path.join(tmp, "result.pt")
        torch.multiprocessing.spawn(_rank, args=(2, init_file, device_type, result_file, compile_backend), nprocs=2,
                                    join=True)
        sharded = torch.load(result_file)
    # fullgraph=True: one graph per unit (a graph break raises), or none in eager.
    assert sharded["graphs"] == (0 if compile_backend is None else 2), sharded["graphs"]
    losses, grads = _unsharded("cuda" if device_type == "cuda" else "cpu")
    assert sharded["grads"].keys() == grads.keys()
    for name, want in grads.items():
        got = sharded["grads"][name]
        assert got.shape == want.shape, name
        # bf16 forward and backward on both sides; the halves' gradients averaged in fp32 by FSDP on
        # one, summed in bf16 by autograd on the other: bound the error by the gradient's scale.
        err = (got - want).abs().max().item()
        assert err <= 1e-2 * want.abs().max().item() + 1e-5, f"{name}: max error {err:.3g}"
    for step, (got, want) in enumerate(zip(sharded["losses"], losses)):
        assert abs(got - want) <= 1e-2 * abs(want), f"step {step}: loss {got} against {want}"
    assert losses[-1] < losses[0]  # it trains


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("compile_backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_fsdp2_cpu(compile_backend):
    _run("cpu", compile_backend)


@pytest.mark.skipif(not (HAS_CUDA and torch.cuda.device_count() >= 2), reason="needs 2 CUDA GPUs")
@pytest.mark.skipif(HAS_CUDA and not runs_here("auto"), reason="no kernels for these GPUs in this build")
@pytest.mark.parametrize("compile_backend", [None, "inductor"], ids=["eager", "compiled"])
def test_fsdp2_two_gpus(compile_backend):
    _run("cuda", compile_backend)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_dtensor_arguments_are_refused_naming_them():
    # A DTensor has no storage of its own (its data pointer reads 0): our ops take the local shard,
    # as torchtitan's GroupedExperts passes it (to_local()); a DTensor is refused, naming the argument,
    # by the checks a call's signature gets the first time it is seen (the shapes here are this
    # test's own). A signature seen before skips them; on the GPU the core then refuses the null
    # data pointer, naming the argument, and on the CPU the reference path raises.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            x, w, counts = torch.randn(21, 40), torch.randn(3, 40, 24), torch.tensor([10, 0, 11])
            bias = torch.randn(3, 24)
            calls = [
                ("weights", lambda: cutlass_moe.moe_gemm(x, distribute_tensor(w, mesh, [Shard(0)]), counts)),
                ("x", lambda: cutlass_moe.moe_gemm(distribute_tensor(x, mesh, [Replicate()]), w, counts)),
                ("bias", lambda: cutlass_moe.moe_gemm(x, w, counts, bias=distribute_tensor(bias, mesh, [Shard(0)]))),
                ("tokens_per_expert", lambda: cutlass_moe.moe_gemm_wgrad(
                    x, torch.randn(21, 24), distribute_tensor(counts, mesh, [Replicate()]))),
                ("weight", lambda: cutlass_moe.grouped_linear(x.view(7, 3, 40),
                                                              distribute_tensor(w, mesh, [Shard(0)]))),
                ("x", lambda: cutlass_moe.grouped_linear(distribute_tensor(x.view(7, 3, 40), mesh, [Replicate()]), w)),
            ]
            for name, call in calls:
                with pytest.raises(TypeError, match=f"^{name}: expected a plain tensor, got a DTensor"):
                    call()
        finally:
            dist.destroy_process_group()
