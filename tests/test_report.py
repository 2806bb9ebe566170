"""fulmen.report and `fulmen report`: one self-contained, well-formed HTML page with the pipeline of traces and
their diffs, the fused regions (coloured, foldable) with their times next to eager's, the per-operation profile,
peak memory and the recompilations with their reasons."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from torch import nn

import fulmen
from fulmen.bench import cli
from fulmen.executors import inductor

_VOID = {"meta", "br", "hr", "img", "input", "link", "wbr", "col", "area", "base", "source"}
# Elements whose end tag HTML lets a page leave out; the report closes them anyway, so the check is strict.


class _Checker(HTMLParser):
    """Every element closed in order; collects the tags and attributes seen."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in _VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
        else:
            self.stack.pop()


def _check_html(text: str) -> _Checker:
    checker = _Checker()
    checker.feed(text)
    checker.close()
    assert not checker.errors, checker.errors[:5]
    assert checker.stack == [], checker.stack
    assert text.startswith("<!DOCTYPE html>")
    return checker


def _self_contained(checker: _Checker, text: str) -> None:
    assert all(tag not in ("script", "link", "img", "iframe") for tag, _ in checker.tags)
    assert not any("src" in attrs or "href" in attrs for _, attrs in checker.tags)
    assert "url(" not in text and "@import" not in text


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))


@pytest.fixture
def small_regions(monkeypatch):
    monkeypatch.setattr(inductor, "MIN_REGION_SIZE", 1)


def test_report_of_a_training_step_shows_regions_times_and_traces(tmp_path, small_regions):
    """Regions run unfused here (compile "off", no Inductor build): the page's structure is what is checked."""
    model, x = _mlp(), torch.randn(4, 16)
    path = fulmen.report(model, x, path=tmp_path / "r.html", steps=2, compile="off")
    text = Path(path).read_text()
    checker = _check_html(text)
    _self_contained(checker, text)
    regions = [a for tag, a in checker.tags if tag == "details" and a.get("class") == "region"]
    assert regions and all("border-color: hsl(" in a["style"] for a in regions)
    names = set(re.findall(r"inductor_fusion_\d+", text))
    assert names, "no fused region named on the page"
    for name in names:  # a row with both times for every region
        assert re.search(rf"<td>{name}</td><td class=n>[\d.]+ ms</td><td class=n>[\d.]+ ms</td>", text), name
    assert "Final forward trace" in text and "Final backward trace" in text
    assert "speedup = eager time / fulmen time" in text
    assert re.search(r"median step \(interleaved\)</td><td class=n>[\d.]+ ms</td><td class=n>[\d.]+ ms", text)
    assert "Dead Code Elimination" in text and "Delete Last Used" in text  # pipeline steps by name
    assert 'class="add"' in text  # a diff between steps
    assert "aten::addmm" in text or "aten::linear" in text  # the per-operation profile
    assert "peak memory" in text and "No recompilation" in text


def test_report_lists_recompilations_and_their_reasons(tmp_path):
    jitted = fulmen.jit(lambda a, b: (a * b).sin() + a, executors=["torch"])
    jitted(torch.randn(3, 4), torch.randn(3, 4))
    jitted(torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64))
    path = fulmen.report(jitted, torch.randn(3, 4), torch.randn(3, 4), path=tmp_path / "r.html", steps=1)
    text = path.read_text()
    _check_html(text)
    assert "why it recompiled" in text and "float64" in text, text[text.find("Recompilations"):][:800]
    assert "No fused regions" in text


def test_report_rejects_a_nonpositive_step_count(tmp_path):
    with pytest.raises(ValueError, match="steps must be at least 1, got 0"):
        fulmen.report(lambda a: a + 1, torch.randn(2), path=tmp_path / "r.html", steps=0)


def test_report_with_inductor_kernels_times_the_compiled_region(tmp_path, small_regions):
    def f(a, w):
        return torch.nn.functional.gelu(a @ w).sum(-1) * 2

    a, w = torch.randn(8, 16), torch.randn(16, 8)
    path = fulmen.report(f, a, w, path=tmp_path / "r.html", steps=2)
    text = path.read_text()
    _check_html(text)
    row = re.search(r"<td>(inductor_fusion_\d+)</td><td class=n>([\d.]+) ms</td>", text)
    assert row and float(row.group(2)) > 0


def test_cli_report_writes_the_page_for_a_built_in_model(tmp_path, capsys):
    out = tmp_path / "mlp.html"
    assert cli.main(["report", "--model", "mlp-tiny", "--executors", "torch", "--steps", "1", "--path",
                     str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    _check_html(out.read_text())
    trained = tmp_path / "mlp-train.html"
    assert cli.main(["report", "--model", "mlp-tiny", "--mode", "train", "--executors", "torch", "--steps", "1",
                     "--path", str(trained)]) == 0
    text = trained.read_text()
    _check_html(text)
    assert "Final backward trace" in text and "forward and backward per step" in text


def _browser() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(_browser() is None, reason="no headless Chromium installed")
def test_the_page_renders_in_a_headless_browser(tmp_path, small_regions):
    path = fulmen.report(_mlp(), torch.randn(4, 16), path=tmp_path / "r.html", steps=1, compile="off")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
    done = subprocess.run([_browser(), *flags, "--dump-dom", path.resolve().as_uri()], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Fused regions" in done.stdout and re.search(r'class="region"[^>]*><summary>', done.stdout)
    shot = tmp_path / "r.png"
    subprocess.run([_browser(), *flags, f"--screenshot={shot}", "--window-size=1400,2000", path.resolve().as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 10_000


def test_report_leaves_the_programs_regions_as_they_were(tmp_path, small_regions):
    """The timing wrappers last as long as the profiled run: afterwards each region calls what it called before."""
    jitted = fulmen.jit(_mlp(), compile="off")
    x = torch.randn(4, 16)
    jitted(x).sum().backward()
    jitted(x).sum().backward()
    traces = fulmen.last_traces(jitted)[-1:] + fulmen.last_backward_traces(jitted)[-1:]
    regions = [b.sym.impl for t in traces for b in t.bound_symbols if b.sym.is_fusion]
    before = [(r.eager, dict(r.variants)) for r in regions]
    assert regions
    fulmen.report(jitted, x, path=tmp_path / "r.html", steps=1)
    assert [(r.eager, dict(r.variants)) for r in regions] == before
