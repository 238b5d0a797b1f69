"""The Python examples run as a user runs them (a process of their own) and check themselves: each
exits non-zero where a check fails."""
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import HAS_CUDA, aoti_compiler, requires_kernels

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples" / "python"


def run_example(name, *args, env=None):
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, f"{name} {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    assert result.stdout.rstrip().endswith("ok"), result.stdout
    return result.stdout


def aoti_args():
    """(the example's AOTInductor arguments, its environment): --aoti where this torch's AOTInductor
    works, with $CXX set to conftest.aoti_compiler's compiler where torch's own choice fails."""
    compiler, reason = aoti_compiler()
    if reason:
        return [], None
    return ["--aoti"], (None if compiler is None else {**os.environ, "CXX": compiler})


def test_moe_block_example_cpu():
    # The float32 reference path, eager, compiled (aot_eager) and, where this torch's AOTInductor
    # works, from an AOTInductor package.
    aoti, env = aoti_args()
    out = run_example("moe_block.py", "--tokens", "64", "--hidden", "32", "--inter", "48", "--experts", "4",
                      "--compile", "--compile-backend", "aot_eager", *aoti, env=env)
    assert ("333 tokens" in out) == bool(aoti), out


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@requires_kernels
def test_moe_block_example_gpu():
    # The kernels in bf16, eager, under Inductor and, where this torch's AOTInductor works, from an
    # AOTInductor package; the timing against the per-expert loop.
    aoti, env = aoti_args()
    out = run_example("moe_block.py", "--device", "cuda", "--compile", *aoti, env=env)
    assert "ms with cutlass_moe" in out, out
    assert ("from the AOTInductor package" in out) == bool(aoti), out
