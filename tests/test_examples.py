"""Every script in examples/ runs to completion; each asserts what its seed document shows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.py"))


def test_the_seed_examples_exist():
    names = {p.name for p in SCRIPTS}
    assert {"seed_000_custom_fwd_bwd.py", "seed_001_extend.py", "seed_002_operator_executor.py"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_example_runs(script: Path):
    env = dict(os.environ, PYTHONWARNINGS="ignore::DeprecationWarning")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            cwd=str(EXAMPLES.parent), env=env)
    assert result.returncode == 0, f"{script.name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    if script.name.startswith("seed_"):
        assert result.stdout.rstrip().endswith("OK"), f"{script.name} did not reach its final check"
