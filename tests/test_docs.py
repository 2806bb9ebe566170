"""The contributor docs' examples run: every ```python block of each docs/*.md file, in order, as one script.

A block preceded by a ``<!-- skip-test -->`` line is left out; that marker is for blocks that cannot run on
a CPU-only machine. Each document runs in its own process so that the executors and OpInfos it registers
stay out of the other tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
_BLOCK = re.compile(r"(?P<marker><!-- skip-test -->\s*\n)?```python\n(?P<code>.*?)```", re.DOTALL)


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """``(line number, code, skipped)`` for each ```python block."""
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


DOC_FILES = sorted(DOCS.glob("*.md"))


def test_the_docs_exist_and_have_examples():
    names = {p.name for p in DOC_FILES}
    assert {"writing_an_executor.md", "adding_an_operator.md"} <= names
    for path in DOC_FILES:
        blocks = python_blocks(path.read_text())
        assert len([b for b in blocks if not b[2]]) >= 3, f"{path.name} has too few runnable examples"


def test_block_extraction_honours_the_skip_marker():
    text = "x\n```python\na = 1\n```\n<!-- skip-test -->\n```python\nb = 2\n```\n"
    assert python_blocks(text) == [(3, "a = 1\n", False), (7, "b = 2\n", True)]


@pytest.mark.parametrize("path", DOC_FILES, ids=[p.name for p in DOC_FILES])
def test_doc_examples_run(path: Path, tmp_path: Path):
    script = tmp_path / path.name.replace(".md", ".py")
    script.write_text(_script(path))
    env = dict(os.environ, PYTHONWARNINGS="ignore::DeprecationWarning")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            cwd=str(DOCS.parent), env=env)
    assert result.returncode == 0, (
        f"an example in docs/{path.name} failed (line numbers are the document's):\n"
        f"{result.stderr[-4000:]}"
    )
