"""The Python examples run as a user runs them (a process of their own) and check themselves: each
exits non-zero where a check fails."""
import pathlib
import subprocess
import sys

import pytest

from conftest import HAS_CUDA, requires_kernels

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples" / "python"


def run_example(name, *args):
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"{name} {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    assert result.stdout.rstrip().endswith("ok"), result.stdout
    return result.stdout


def test_moe_block_example_cpu():
    # The float32 reference path, eager and compiled (aot_eager: no C++ compiler needed).
    run_example("moe_block.py", "--tokens", "64", "--hidden", "32", "--inter", "48", "--experts", "4",
                "--compile", "--compile-backend", "aot_eager")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@requires_kernels
def test_moe_block_example_gpu():
    # The kernels in bf16, eager and under Inductor, and the timing against the per-expert loop.
    out = run_example("moe_block.py", "--device", "cuda", "--compile")
    assert "ms with cutlass_moe" in out, out
