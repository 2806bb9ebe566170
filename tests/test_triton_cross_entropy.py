"""Runs the Triton cross-entropy kernel checks (tests/triton_cross_entropy_checks.py) in a fresh process.

Without a GPU the kernels run through Triton's interpreter, which Triton selects from TRITON_INTERPRET when it
first sets up; a separate process keeps that choice from depending on what other tests imported first."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


@pytest.mark.slow  # a fresh interpreter importing torch, Triton and fulmen
def test_triton_cross_entropy_kernels_match_torch():
    checks = Path(__file__).with_name("triton_cross_entropy_checks.py")
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(checks)],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
