"""A user's first hour: the normal path prints no warnings, compile_stats reads as a short table, and the
executors= argument replaces the defaults (and there is a spelling that adds to them)."""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import fulmen
from fulmen.executors import inductor


def test_torch_compile_backend_warns_about_nothing_on_a_plain_model(caplog):
    """Dynamo's lazy GraphModule writes its generated code on its first call; that is not a side effect of the
    user's program and must not be reported as one on every compile."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    compiled = torch.compile(model, backend="fulmen", options={"executors": ["torch"]})
    x = torch.randn(3, 8)
    with caplog.at_level(logging.WARNING, logger="fulmen"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(x)
    torch.testing.assert_close(out, model(x))
    assert [r.getMessage() for r in caplog.records if r.name.startswith("fulmen")] == []
    assert [str(w.message) for w in caught if "fulmen" in str(w.filename) or "recompile" in str(w.message)] == []


def test_compile_stats_repr_is_a_short_table_of_counters_and_phases():
    f = fulmen.jit(lambda a, b: a + b * a, executors=["torch"])
    f(torch.randn(2, 2), torch.randn(2, 2))
    f(torch.randn(2, 3), torch.randn(2, 3))
    f(torch.randn(2, 3), torch.randn(2, 3))
    text = repr(fulmen.compile_stats(f))
    lines = text.splitlines()
    assert lines[0] == "CompileStats(" and lines[-1] == ")"
    assert len(lines) <= 20 and all(len(line) <= 160 for line in lines), text
    rows = [line[2:] for line in lines[1:-1]]
    assert rows[0].split() == ["calls", "3"]
    starts = {len(row) - len(row.split("  ")[-1].lstrip()) for row in rows}
    assert len(starts) == 1, text  # the values start in one column
    assert "cache misses" in text and "trace ms" in text and "codegen ms" in text
    assert "last recompile" in text and "dim 1" in text
    assert "def computation" not in text  # the traces themselves stay out
    assert fulmen.compile_stats(f).recompile_reasons == [fulmen.compile_stats(f).last_recompile_reason]


def _attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sin() * 2 + q


def _executors_of(jfn) -> set[str]:
    names = set()
    for b in fulmen.last_traces(jfn)[-1].bound_symbols:
        if b.sym.is_fusion:
            names.add("fusion")
        elif b.sym.executor is not None:
            names.add(b.sym.executor.name)
    return names


def test_executors_replace_the_defaults_and_the_documented_spelling_adds(monkeypatch):
    monkeypatch.setattr(inductor, "MIN_REGION_SIZE", 1)
    q, mask = torch.randn(2, 2, 4, 8), torch.randn(4, 4)
    expected = _attention(q, q, q, mask)
    assert [e.name for e in fulmen.default_executors()] == ["inductor"]

    replaced = fulmen.jit(_attention, executors=["sdpa"])
    torch.testing.assert_close(replaced(q, q, q, mask), expected)
    assert "fusion" not in _executors_of(replaced) and "sdpa" in _executors_of(replaced)

    added = fulmen.jit(_attention, executors=["sdpa", *fulmen.default_executors()])
    torch.testing.assert_close(added(q, q, q, mask), expected)
    assert {"fusion", "sdpa"} <= _executors_of(added)
    assert fulmen.default_executors() == fulmen.default_executors()  # a fresh list each time: the caller may edit
    assert fulmen.default_executors() is not fulmen.default_executors()


def test_bench_and_demo_state_the_ratio_convention(capsys):
    from fulmen.bench import cli

    assert cli.main(["bench", "--model", "mlp-tiny", "--mode", "inference", "--backends", "eager,fulmen-torch",
                     "--steps", "1", "--warmup", "0", "--quiet"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert "speedup" in header and "x" not in header
    assert "speedup = eager time / the row's time, eager's steps interleaved with the row's own" in out
    assert cli.main(["demo", "--model", "mlp-tiny", "--calls", "1", "--lines", "2"]) == 0
    out = capsys.readouterr().out
    assert "speedup = eager time / fulmen time" in out and "x eager" not in out
