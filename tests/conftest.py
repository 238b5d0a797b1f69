"""Shared fixtures and GPU markers. GPU tests are skipped with a reason where there is no GPU;
they never pass without running."""
import functools
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

pytest_plugins = ["pytester"]  # test_cpu.py runs the reduced-build hook below in a pytest of its own

HAS_CUDA = torch.cuda.is_available()
DEVICE_CC = 10 * torch.cuda.get_device_capability()[0] + torch.cuda.get_device_capability()[1] if HAS_CUDA else 0
IS_SM90 = DEVICE_CC == 90

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
requires_sm90 = pytest.mark.skipif(not IS_SM90, reason="needs an sm90 (Hopper) GPU for the sm90a kernels")


@functools.lru_cache(maxsize=None)
def _build_info():
    import cutlass_moe
    return cutlass_moe.build_info()


def _sm80_family_ccs():
    """Compute capabilities this build's sm80 families have machine code for: build_info()'s
    "sm80_family_ccs", or, from a core that does not report it, parsed off its summary."""
    info = _build_info()
    if "sm80_family_ccs" in info:
        return {int(cc) for cc in info["sm80_family_ccs"]}
    archs = info["summary"].split("sm80 families for ")[-1]
    return {int(a.strip()[3:]) for a in archs.split(",") if a.strip().startswith("sm_")}


@functools.lru_cache(maxsize=None)
def built_instances():
    """This build's kernel instances as (arch, backend, dtype, layout, config) tuples."""
    import cutlass_moe
    return tuple(tuple(name.split(":")) for name in cutlass_moe.built_configs())


_SM90_BACKENDS = ("grouped", "moe")
_SM80_BACKENDS = ("sm80_grouped", "sm80_moe")
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def runs_here(backend: str) -> bool:
    """Whether `backend` has kernels for this GPU in this build ("auto": any family). The sm90
    families need an sm90 GPU and a build with 90a (CUTLASS_MOE_ARCHS); the sm80 families a GPU
    whose compute capability they were built for; and each family at least one instance (a
    custom build may leave a family's config list empty)."""
    if not HAS_CUDA:
        return False
    if backend.startswith("wgrad_"):  # a weight-gradient family: wgrad_moe, wgrad_grouped, wgrad_sm80_grouped
        family = backend[len("wgrad_"):]
        arch_ok = DEVICE_CC == 90 if family in _SM90_BACKENDS else DEVICE_CC in _sm80_family_ccs()
        return arch_ok and any(inst[1] == backend for inst in built_instances())
    if backend not in _SM90_BACKENDS + _SM80_BACKENDS:
        return any(runs_here(b) for b in _SM90_BACKENDS + _SM80_BACKENDS)
    arch_ok = DEVICE_CC == 90 if backend in _SM90_BACKENDS else DEVICE_CC in _sm80_family_ccs()
    return arch_ok and any(inst[1] == backend for inst in built_instances())


def is_built(backend: str, dtype: torch.dtype, layout: str, config: str = "auto") -> bool:
    """Whether this build has a kernel of `backend` ("auto": any family that runs here) for `dtype`
    and the weight `layout` ("kn" or "nk": how each K x N matrix is stored) and, unless "auto",
    `config`. A custom build (CUTLASS_MOE_DTYPES, CUTLASS_MOE_WEIGHT_LAYOUTS, the config lists) may
    lack any of them."""
    families = [backend] if backend != "auto" else [b for b in _SM90_BACKENDS + _SM80_BACKENDS if runs_here(b)]
    wanted = (DTYPE_NAMES[dtype], layout)
    return any(inst[1] in families and tuple(inst[2:4]) == wanted and config in ("auto", inst[4])
               for inst in built_instances())


def skip_unless_built(backend: str, dtype: torch.dtype, layout: str, config: str = "auto") -> None:
    """pytest.skip, saying why, unless is_built(backend, dtype, layout, config)."""
    if not is_built(backend, dtype, layout, config):
        pytest.skip(f"this build has no {backend} kernel for {DTYPE_NAMES[dtype]}, {layout} weights"
                    + ("" if config == "auto" else f", config {config}"))


def backend_param(backend: str, *values):
    """A pytest.param for `backend` that skips, saying why, where it has no kernels for this GPU."""
    return pytest.param(backend, *values, marks=pytest.mark.skipif(
        not runs_here(backend), reason=f"no {backend} kernels for this GPU in this build"))


def wgrad_backend_param(family: str):
    """A pytest.param for the weight-gradient family `family` ("moe", "grouped", "sm80_grouped")
    that skips, saying why, where it has no kernels for this GPU."""
    return pytest.param(family, marks=pytest.mark.skipif(
        not runs_here("wgrad_" + family), reason=f"no {family} wgrad kernels for this GPU in this build"))


requires_kernels = pytest.mark.skipif(not runs_here("auto"), reason="no kernels for this GPU in this build")


def is_reduced_build(instances=None) -> bool:
    """Whether a build (its built_instances() tuples; default: this one's) leaves out a dtype, a
    weight layout or a family of an arch it has: every forward family of the arch holds both dtypes in
    both layouts, and the wgrad families are there with both dtypes and both outputs, as in the default
    build. The quick builds of A/B timing calls (CUTLASS_MOE_DTYPES=kBFloat16,
    CUTLASS_MOE_WEIGHT_LAYOUTS=kKN, empty config lists) are reduced."""
    instances = built_instances() if instances is None else instances
    for arch, forward, wgrad in (("sm90", ("grouped", "moe"), ("wgrad_moe", "wgrad_grouped")),
                                 ("sm80", ("sm80_grouped", "sm80_moe"), ("wgrad_sm80_grouped",))):
        have = {inst[1:4] for inst in instances if inst[0] == arch}
        if not have:
            continue  # the arch is not built at all: runs_here() skips its tests
        forward_ok = all((family, dtype, layout) in have for family in forward for dtype in ("bf16", "fp16")
                         for layout in ("kn", "nk"))
        wgrad_ok = all((family, dtype, out) in have for family in wgrad for dtype, out in
                       (("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "fp16"), ("fp16", "fp32")))
        if not (forward_ok and wgrad_ok):
            return True
    return False


# The core's NotImplementedError for a kernel this build does not have (moe_gemm.cpp).
_MISSING_KERNEL = re.compile(r"\bno \S+ kernel built for |\bthis build has no \S+ wgrad kernel\b")


def is_missing_kernel(exc: BaseException | None) -> bool:
    """Whether exc, or an exception it was raised from (`raise ... from`, its __cause__), is the
    core's NotImplementedError for a kernel this build does not have. torch.library.opcheck raises
    its OpCheckError from the op's error. An error merely raised while handling one (__context__)
    does not count: that is a test's own failure."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, NotImplementedError) and _MISSING_KERNEL.search(str(exc)):
            return True
        exc = exc.__cause__
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In a reduced build (is_reduced_build), a test that fails because the core has no kernel for
    what it asks (is_missing_kernel) is reported as skipped, so that a quick build's test run lists
    real failures only. In the default build such a failure stays a failure: every kernel a test
    asks for should be there."""
    outcome = yield
    report = outcome.get_result()
    if (report.when == "call" and report.failed and call.excinfo is not None
            and is_missing_kernel(call.excinfo.value) and HAS_CUDA and is_reduced_build()):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0,
                           f"reduced build: {str(call.excinfo.value).splitlines()[0]}")


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


def _assert_rows_close(got, want, what, rel):
    """||got - want|| / ||want|| <= rel, and every element within 2e-2 * (|want| + rms(want)): bf16
    rounding of the values and of the scale (see reference.assert_close_per_expert)."""
    got, want = got.float(), want.float()
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    assert err <= rel, f"{what}: relative error {err:.3e}"
    rms = want.pow(2).mean().sqrt()
    worst = float(((got - want).abs() / (2e-2 * (want.abs() + rms))).max())
    assert worst <= 1, f"{what}: an element is {worst:.2f}x outside 2e-2 * (|ref| + rms)"


def check_dw(dw, ref, counts, num_tokens, rel=1e-2, start=None):
    """dW (E, ...) against the float32 reference `ref`, expert by expert (`counts` on the CPU): each
    expert with rows within `rel`, element by element too; each expert without rows exact zeros, or,
    accumulated onto `start` (accumulate=True), left exactly as `start` was."""
    from cutlass_moe.reference import expert_row_ranges
    assert dw.shape == ref.shape
    for e, (lo, hi) in enumerate(expert_row_ranges(counts, num_tokens)):
        if hi == lo:
            if start is None:
                assert bool((dw[e] == 0).all()), f"expert {e} has no rows: its gradient must be exact zeros"
            else:
                assert torch.equal(dw[e], start[e]), f"expert {e} has no rows: its accumulator must be untouched"
        elif start is None:
            _assert_rows_close(dw[e], ref[e], f"dW of expert {e}", rel)
        else:
            _assert_rows_close(dw[e].float() - start[e].float(), ref[e], f"accumulated dW of expert {e}", rel)


def check_dx(dx, ref, counts, num_tokens, rel=1e-2):
    """dx (T, K) against the float32 reference, expert by expert, as check_dw; rows past the last
    owned row must be exact zeros."""
    from cutlass_moe.reference import expert_row_ranges
    ranges = expert_row_ranges(counts, num_tokens)
    end = ranges[-1][1] if ranges else 0
    assert bool((dx[end:] == 0).all()), "rows past the last owned row get dx = 0"
    for e, (lo, hi) in enumerate(ranges):
        if hi > lo:
            _assert_rows_close(dx[lo:hi], ref[lo:hi], f"dx of expert {e}", rel)


def graph_recorder():
    """(backend, targets): a torch.compile backend that runs AOT autograd and records, per compiled
    graph ("forward", "backward"), the sorted targets of its cutlass_moe ops (what a compiled graph
    calls, after the autograd.Functions are traced through); `targets` maps each name to a list with
    one entry per graph compiled."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    targets = {"forward": [], "backward": []}

    def backend(gm, inputs):
        def keep(name):
            def compiler(graph, _):
                ops = (str(n.target) for n in graph.graph.nodes if n.op == "call_function")
                targets[name].append(sorted(t for t in ops if t.startswith("cutlass_moe.")))
                return make_boxed_func(graph.forward)
            return compiler
        return aot_module_simplified(gm, inputs, fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    return backend, targets


class FusedMoeMLP(torch.nn.Module):
    """A Mixtral-style MoE MLP on our fused ops: the router, the gated gate/up projection with its
    bias (gpt-oss), the down projection with (E, N, K) weights scaled by each token's router weight,
    the combine. counts: "bincount" (a length known only at run time while tracing; in eager on a
    GPU it reads the ids back to the host) or "index_add" (a static length, nothing read back)."""

    def __init__(self, experts, hidden, inter, top_k, counts="bincount", dtype=None, device=None):
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.experts, self.top_k, self.counts = experts, top_k, counts
        self.router = torch.nn.Linear(hidden, experts, bias=False, **factory)
        self.w_gate_up = torch.nn.Parameter(torch.randn(experts, hidden, 2 * inter, **factory) * hidden ** -0.5)
        self.b_gate_up = torch.nn.Parameter(torch.randn(experts, 2 * inter, **factory) * 0.1)
        self.w_down = torch.nn.Parameter(torch.randn(experts, hidden, inter, **factory) * inter ** -0.5)

    def forward(self, x):
        import cutlass_moe
        probs, chosen = torch.topk(torch.softmax(self.router(x).float(), dim=-1), self.top_k, dim=-1)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        if self.counts == "bincount":
            counts = torch.bincount(flat, minlength=self.experts)
        else:
            counts = torch.zeros(self.experts, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
        xs = x[order // self.top_k]
        h = cutlass_moe.moe_gemm_gated(xs, self.w_gate_up, counts, bias=self.b_gate_up)
        ys = cutlass_moe.moe_gemm(h, self.w_down, counts, trans_b=True, row_scale=probs.flatten()[order])
        return torch.zeros_like(ys).index_copy(0, order, ys).view(x.shape[0], self.top_k, -1).sum(1)


def check_reduce_overhead(module, make_input, steps=4, rel=2e-2):
    """torch.compile(module, mode="reduce-overhead", fullgraph=True): Inductor records each compiled
    graph in a CUDA graph (cudagraph trees) and replays it. `steps` training steps (forward and
    backward) and `steps` inference steps, a new make_input() each (for an MoE layer: new routing,
    new counts), each against eager: the output's and every gradient's relative error at most rel
    (Inductor computes elementwise work in float32 where eager rounds in between). Inductor must not
    skip the CUDA graphs."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True)
    names = ["output"] + [name for name, _ in module.named_parameters()]

    def assert_close(got, want, what):
        err = float((got.float() - want.float()).norm() / want.float().norm())
        assert err <= rel, f"{what}: relative error {err:.3e}"

    for step in range(steps):  # Inductor's warm-up, the recording, then replays
        x = make_input()
        results = []
        for run in (compiled, module):
            torch.compiler.cudagraph_mark_step_begin()
            module.zero_grad(set_to_none=True)
            y = run(x)
            y.float().pow(2).sum().backward()
            results.append([y.detach().clone()] + [p.grad.clone() for p in module.parameters()])
        for name, got, want in zip(names, *results):
            assert_close(got, want, f"training step {step}, {name}")
    with torch.no_grad():
        for step in range(steps):
            x = make_input()
            torch.compiler.cudagraph_mark_step_begin()
            got = compiled(x).clone()
            assert_close(got, module(x), f"inference step {step}")
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


_AOTI_PROBE = """
import sys, tempfile, torch, torch._inductor.config
class M(torch.nn.Module):
    def forward(self, x):
        return x.sin() + 1
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
x = x.cuda() if torch.cuda.is_available() else x  # a CUDA package compiles in seconds, a CPU one in a minute
compiler = {"cpp.cxx": (None, sys.argv[1])} if len(sys.argv) > 1 else {}
with torch._inductor.config.patch(compiler), tempfile.TemporaryDirectory() as folder:
    path = torch._inductor.aoti_compile_and_package(torch.export.export(M(), (x,)), package_path=folder + "/m.pt2")
    assert torch.allclose(torch._inductor.aoti_load_package(path)(x), x.sin() + 1, atol=1e-6)  # sin + 1 near 0
print("ok")
"""


def _aoti_probe(compiler=None):
    """None where this torch compiles (with the C++ compiler `compiler`; None: torch's own choice)
    and loads an AOTInductor package of a model without our ops (on the GPU where there is one), in a
    process of its own; else why not."""
    try:
        result = subprocess.run([sys.executable, "-c", _AOTI_PROBE] + ([compiler] if compiler else []),
                                capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return "the probe took over 900 s"
    if result.returncode == 0 and result.stdout.rstrip().endswith("ok"):
        return None
    return (f"killed by signal {-result.returncode}" if result.returncode < 0
            else (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1])


# aoti_compiler's answer from a probe made before this process started: benchmarks/run_tests.sh probes
# once and hands it to the pytest processes it starts, one per package-building test, each of which
# would otherwise make its own (each probe compiles a package or two). aoti_compiler_answer() gives it
# in the variable's form.
AOTI_COMPILER_ENV = "CUTLASS_MOE_TEST_AOTI_COMPILER"


@functools.lru_cache(maxsize=None)
def aoti_compiler():
    """(compiler, None) where this torch compiles and loads AOTInductor packages: compiler None is
    torch's own choice (torch._inductor.config.cpp.cxx, from $CXX), else a g++ or clang++ on PATH
    that works where that choice does not (a package needs a C++ compiler); (None, why) where none
    works. Probed once per session, in processes of their own: on the H200 machine $CXX is
    /opt/gcc/bin/g++, whose packages kill the loading process with a segmentation fault, which must
    not take the test session along, while /usr/bin/g++'s load and run (benchmarks/NOTES.md,
    forty-fifth session). Where $CUTLASS_MOE_TEST_AOTI_COMPILER holds an earlier probe's answer
    (aoti_compiler_answer), that answer."""
    known = os.environ.get(AOTI_COMPILER_ENV, "")
    if known == "default":
        return None, None
    if known.startswith("none: "):
        return None, known[len("none: "):]
    if known:
        return known, None
    why = _aoti_probe()
    if why is None:
        return None, None
    import torch._inductor.config as inductor_config
    own = inductor_config.cpp.cxx[-1]
    own_path = os.path.realpath(shutil.which(own) or own)
    for name in ("g++", "clang++"):
        path = shutil.which(name)
        if path and os.path.realpath(path) != own_path and _aoti_probe(path) is None:
            return path, None
    return None, (f"this torch ({torch.__version__}) cannot compile and load an AOTInductor package of a model "
                  f"without our ops with its C++ compiler {own}: {why}")


def aoti_compiler_answer() -> str:
    """aoti_compiler's answer as $CUTLASS_MOE_TEST_AOTI_COMPILER holds it: "default" (torch's own
    compiler), a compiler's path, or "none: " and why not."""
    compiler, why = aoti_compiler()
    return f"none: {why}" if why else compiler or "default"


def check_aoti_package(module, make_input, package_path, sizes=(40, 1, 7, 333), rel=2e-2):
    """torch.export of `module` under no_grad with a dynamic leading dimension (a serving batch's
    tokens), compiled ahead of time by AOTInductor into a package (aoti_compile_and_package), loaded
    back and run on make_input(size) for each of `sizes` (for an MoE layer: new routing, new counts),
    each against eager within `rel` relative error. The package calls our ops through AOTInductor's
    proxy executor, which finds them registered in this process (import cutlass_moe before loading
    one); each size also under torch.inference_mode(), which must give the same bits. Returns the
    exported program's cutlass_moe targets. Skips where AOTInductor itself does not work; compiles
    with aoti_compiler's compiler."""
    import torch._inductor.config as inductor_config
    compiler, reason = aoti_compiler()
    if reason:
        pytest.skip(reason)
    with torch.no_grad(), inductor_config.patch({"cpp.cxx": (None, compiler)} if compiler else {}):
        tokens = torch.export.Dim("tokens", min=1, max=4096)
        program = torch.export.export(module, (make_input(sizes[0]),), dynamic_shapes=({0: tokens},))
        targets = sorted(str(n.target) for n in program.graph.nodes
                         if n.op == "call_function" and str(n.target).startswith("cutlass_moe."))
        path = torch._inductor.aoti_compile_and_package(program, package_path=str(package_path))
        runner = torch._inductor.aoti_load_package(path)
        for size in sizes:
            x = make_input(size)
            got, want = runner(x), module(x)
            assert got.shape == want.shape, (size, got.shape, want.shape)
            err = float((got.float() - want.float()).norm() / want.float().norm())
            assert err <= rel, f"{size} tokens: relative error {err:.3e}"
            with torch.inference_mode():  # how a server calls it: the ops' autograd layer skipped
                assert torch.equal(runner(x), got), f"{size} tokens: inference_mode changed the output"
    return targets
