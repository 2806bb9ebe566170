"""The docs' examples run: every ```python block of README.md and of each docs/*.md file, in order, as one script.

A block preceded by a ``<!-- skip-test -->`` line is left out; that marker is for blocks that cannot run on
a CPU-only machine. A block preceded by ``<!-- trace: first -->`` or ``<!-- trace: last -->`` is a printed
trace: it is not run, but compared with what fulmen prints for the README's example under the default
executors. Each document runs in its own process so that the executors and OpInfos it registers stay out of the
other tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
_BLOCK = re.compile(r"(?P<marker><!-- (?:skip-test|trace: \w+) -->\s*\n)?```python\n(?P<code>.*?)```", re.DOTALL)
_TRACE = re.compile(r"<!-- trace: (?P<which>\w+) -->\s*\n```python\n(?P<code>.*?)```", re.DOTALL)
GUIDES = {"writing_an_executor.md", "adding_an_operator.md", "recompilation.md", "how-it-works.md"}


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """``(line number, code, skipped)`` for each ```python block (a printed trace counts as skipped)."""
    blocks = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        blocks.append((line, m.group("code"), m.group("marker") is not None))
    return blocks


def _script(path: Path) -> str:
    """The runnable blocks joined into one script; line numbers in tracebacks match the document's."""
    text = path.read_text()
    lines = [""] * (text.count("\n") + 1)
    for line, code, skipped in python_blocks(text):
        if skipped:
            continue
        for i, code_line in enumerate(code.splitlines()):
            lines[line - 1 + i] = code_line
    return "\n".join(lines) + "\n"


DOC_FILES = [README, *sorted(DOCS.glob("*.md"))]


def test_the_docs_exist_and_have_examples():
    names = {p.name for p in DOC_FILES}
    assert GUIDES | {"performance.md", "README.md"} <= names
    for path in DOC_FILES:
        runnable = [b for b in python_blocks(path.read_text()) if not b[2]]
        assert len(runnable) >= (3 if path.name in GUIDES else 1), f"{path.name} has too few runnable examples"


def test_block_extraction_honours_the_trace_marker():
    text = "<!-- trace: last -->\n```python\ndef computation(): pass\n```\n"
    assert python_blocks(text) == [(3, "def computation(): pass\n", True)]


def test_readme_is_a_first_ten_minutes_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    for command in ("make demo", "make test", "fulmen.report", 'backend="fulmen"', "fulmen bench"):
        assert command in text, command
    for link in re.findall(r"\]\(((?:docs|examples|benchmarks)/[^)#]+)", text):
        assert (ROOT / link).exists(), f"README links {link}, which does not exist"


def test_one_ratio_convention_everywhere():
    """Stated once in the README, and the same words in the performance doc, fulmen bench and the demo."""
    from fulmen.bench import cli

    convention = "speedup = eager time / fulmen time"
    assert convention in README.read_text() and convention in (DOCS / "performance.md").read_text()
    assert cli.SPEEDUP.startswith(convention) and "interleaved" in cli.BENCH_SPEEDUP_NOTE
    for path in DOC_FILES:  # the old inverted wording ("0.88x eager's time") is gone
        assert not re.search(r"\d\.\d+x eager's time", path.read_text()), path.name


def _normalize(trace: str) -> str:
    lines = [re.sub(r"\(took \d+ milliseconds\)", "(took N milliseconds)", ln) for ln in trace.strip().splitlines()]
    return "\n".join(ln for ln in lines if ln.strip() and not ln.startswith(("import ", "from ")))


def test_readme_traces_are_what_the_default_executors_print(tmp_path):
    """The two traces the README shows, under fulmen's default executors (whatever the compile mode: a region is
    in the trace before its kernel is built)."""
    script = tmp_path / "traces.py"
    script.write_text(
        "import json, torch, fulmen\n"
        "f = fulmen.jit(lambda a, b: a + b * a)\n"
        "f(torch.randn(2, 2), torch.randn(2, 2))\n"
        "print(json.dumps({'first': str(fulmen.last_traces(f)[0]), 'last': str(fulmen.last_traces(f)[-1])}))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    printed = json.loads(done.stdout.strip().splitlines()[-1])
    shown = {m.group("which"): m.group("code") for m in _TRACE.finditer(README.read_text())}
    assert set(shown) == {"first", "last"}
    for which, code in shown.items():
        assert _normalize(code) == _normalize(printed[which]), f"README's {which} trace:\n{printed[which]}"


def test_block_extraction_honours_the_skip_marker():
    text = "x\n```python\na = 1\n```\n<!-- skip-test -->\n```python\nb = 2\n```\n"
    assert python_blocks(text) == [(3, "a = 1\n", False), (7, "b = 2\n", True)]


@pytest.mark.parametrize("path", DOC_FILES, ids=[p.name for p in DOC_FILES])
def test_doc_examples_run(path: Path, tmp_path: Path):
    script = tmp_path / path.name.replace(".md", ".py")
    script.write_text(_script(path))
    env = dict(os.environ, PYTHONWARNINGS="ignore::DeprecationWarning")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            cwd=str(tmp_path if path == README else ROOT), env=env)
    assert result.returncode == 0, (
        f"an example in {path.relative_to(ROOT)} failed (line numbers are the document's):\n"
        f"{result.stderr[-4000:]}"
    )
