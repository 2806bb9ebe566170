"""A fresh clone's set-up: `make demo` installs fulmen alone (no test extras, no transformers), the test targets
install the extras, and .ci/run runs every test once: the default run, then the slow ones."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _dry_run(target: str) -> str:
    """The commands `make TARGET` would run, without running them."""
    done = subprocess.run(["make", "-n", "-s", target, "PYTHON=python"], cwd=ROOT, capture_output=True, text=True,
                          check=True)
    return done.stdout


@needs_make
def test_make_demo_installs_no_test_extras():
    commands = _dry_run("demo")
    installs = [line for line in commands.splitlines() if "pip install" in line]
    assert installs, commands
    assert all("[test]" not in line and "transformers" not in line for line in installs), installs
    assert "fulmen.bench.cli demo" in commands


def test_the_package_itself_needs_only_torch():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert [d.split(">")[0].split("=")[0].split("<")[0] for d in project["dependencies"]] == ["torch"]
    assert any(d.startswith("transformers") for d in project["optional-dependencies"]["test"])


@needs_make
def test_make_test_installs_the_extras_and_leaves_out_the_slow_tests():
    commands = _dry_run("test")
    assert '".[test]"' in commands
    assert '-m "not slow"' in commands
    assert '-m slow' in _dry_run("test-slow")
    all_run = [line for line in _dry_run("test-all").splitlines() if "pytest" in line]
    assert all_run and all("slow" not in line for line in all_run), all_run


def test_ci_runs_the_default_tests_then_the_slow_ones():
    steps = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip().startswith("make")]
    assert steps == ["make test", "make test-slow"]


def test_the_demo_runs_without_transformers(tmp_path):
    """`fulmen demo`'s imports, with transformers made unimportable: nothing on the demo's path needs it."""
    blocker = tmp_path / "transformers.py"
    blocker.write_text("raise ImportError('transformers is not installed')\n")
    code = "import fulmen, fulmen.bench.cli, fulmen.bench.models, fulmen.bench.runner; print('ok')"
    env_path = f"{tmp_path}:{ROOT}"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@needs_make
@pytest.mark.slow
def test_make_demo_on_a_fresh_clone_installs_fulmen_without_the_test_extras(tmp_path):
    """A clone of the tracked files, a fresh virtual environment that sees this interpreter's packages (torch is
    not downloaded again), `make install`, then the demo on a tiny model: transformers is not installed into the
    environment, and the demo runs from the `fulmen` package the environment installed."""
    clone = tmp_path / "clone"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    done = subprocess.run(["make", "install", f"PYTHON={python}"], cwd=clone, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert not list(Path(site).glob("transformers*")), "make install put transformers into the environment"
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "FULMEN_COMPILE": "off"}
    demo = subprocess.run([str(python), "-m", "fulmen.bench.cli", "demo", "--model", "mlp-tiny", "--calls", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert "speedup" in demo.stdout
    where = subprocess.run([str(python), "-c", "import fulmen; print(fulmen.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(clone)), where
