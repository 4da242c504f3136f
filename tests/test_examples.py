"""The examples run as a user runs them (`python examples/<name>.py`), so CI runs them too."""
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def test_torch_linear_example_runs_and_matches():
    out = subprocess.run([sys.executable, str(EXAMPLES / "torch_linear.py")], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "NkiLinear: out (2, 64, 1024) torch.bfloat16" in out.stdout
    assert "same result True" in out.stdout
    err = float(out.stdout.split("max relative error vs fp32 ")[1].split()[0])
    assert err < 2e-2                                    # bf16 output rounding


def test_serve_step_example_runs_and_matches():
    out = subprocess.run([sys.executable, str(EXAMPLES / "serve_step.py")], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "chunks: 96 over 64, 130 over 0" in out.stdout
    assert out.stdout.count("o (230, 8, 64) bfloat16") == 2
    err = float(out.stdout.split("max error over 2 layers ")[1].split()[0])
    assert err < 2e-2                                    # one bf16 rounding of outputs near 1
