"""Automatic dynamic sizes: a dimension seen with a second size is traced once more with a symbolic size, and
that compilation serves every later size its guards accept. Results are compared with eager PyTorch."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before any background Inductor compilation; see the report)

import fulmen
from fulmen.bench.models import build
from fulmen.core.proxies import has_symbolic
from fulmen.frontend import dynamic


@pytest.fixture
def strict(monkeypatch):
    """Compiling with dynamic sizes must not fail (no silent fallback to exact sizes) in these tests: the
    raise_on_dynamic_failure option, through its environment override, for every fulmen.jit of the test."""
    monkeypatch.setenv("FULMEN_RAISE_ON_DYNAMIC_FAILURE", "1")


def _counts(f):
    return fulmen.cache_misses(f), fulmen.cache_hits(f)


def test_elementwise_compiles_twice_for_many_sizes(strict):
    def f(x, y):
        return (x * 2 + y).sin() / x.shape[1]

    jf = fulmen.jit(f, executors=[])  # the torch executor only: every operation is a line of the trace
    for n in (4, 6, 9, 17, 6):
        x, y = torch.randn(3, n), torch.randn(n)
        torch.testing.assert_close(jf(x, y), f(x, y))
    assert _counts(jf) == (2, 3)
    assert "argument 0 (x) dim 1 changed 4 -> 6: marked dynamic" in fulmen.compile_stats(jf).last_recompile_reason
    source = str(fulmen.last_traces(jf)[-1])
    assert re.search(r"s\d+ = (x\.shape\[1\]|y\.shape\[0\])", source)  # the code binds the symbol from an input
    namespace: dict = {}
    exec(source, namespace)  # the printed execution trace runs, at a size it was not traced for
    x, y = torch.randn(3, 11), torch.randn(11)
    torch.testing.assert_close(namespace["computation"](x, y), f(x, y))


def test_shape_used_in_view_and_reshape(strict):
    def f(x):
        b, t, c = x.shape
        y = x.view(b * t, c).relu().reshape(b, t * c)
        return y + torch.arange(t * c, dtype=x.dtype)

    jf = fulmen.jit(f)
    for t in (3, 5, 8):
        x = torch.randn(2, t, 4)
        torch.testing.assert_close(jf(x), f(x))
    assert _counts(jf) == (2, 1)


def test_dynamic_true_and_false():
    f = lambda x: x.cumsum(0) * 2  # noqa: E731
    always = fulmen.jit(f, dynamic=True)
    never = fulmen.jit(f, dynamic=False)
    for n in (3, 5, 7):
        x = torch.randn(n)
        torch.testing.assert_close(always(x), f(x))
        torch.testing.assert_close(never(x), f(x))
    assert _counts(always) == (1, 2)
    assert _counts(never) == (3, 0)
    with pytest.raises(TypeError, match="dynamic="):
        fulmen.jit(f, dynamic="yes")


def test_size_one_specializes_and_recompiles_correctly(strict):
    def f(x, y):
        return x + y  # broadcasting depends on whether a size is 1

    jf = fulmen.jit(f)
    for n in (4, 6, 1, 8, 1):
        x, y = torch.randn(5, n), torch.randn(5, 6 if n == 1 else n)
        torch.testing.assert_close(jf(x, y), f(x, y))
    assert fulmen.cache_misses(jf) == 3  # 4, then 6 (dynamic), then 1 (exact: size 1 is never symbolic)


def test_shape_dependent_branch_fails_the_guard_and_recompiles(strict, caplog):
    def f(x):
        if x.shape[0] > 8:  # a Python branch on a size: a guard
            return x * 2
        return x - 1

    jf = fulmen.jit(f)
    for n in (3, 5, 12, 4, 20):
        x = torch.randn(n)
        torch.testing.assert_close(jf(x), f(x))
    assert _counts(jf) == (3, 2)
    reason = fulmen.compile_stats(jf).last_recompile_reason
    assert "guards of the entry compiled with dynamic sizes failed" in reason and "8" in reason


def test_fallback_to_exact_sizes_when_symbolic_compilation_fails(caplog, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("no symbols today")

    monkeypatch.setattr(dynamic.SymbolicSizes, "__init__", boom)
    f = lambda x: x * 3  # noqa: E731
    jf = fulmen.jit(f)
    with caplog.at_level(logging.WARNING, logger="fulmen"):
        for n in (2, 3, 4):
            x = torch.randn(n)
            torch.testing.assert_close(jf(x), f(x))
    assert fulmen.cache_misses(jf) == 3
    messages = [r.getMessage() for r in caplog.records if r.name == "fulmen"]
    assert len(messages) == 1 and "no symbols today" in messages[0] and "exact sizes" in messages[0]


def test_has_symbolic_marks_symbols_with_symbolic_sizes(strict):
    jf = fulmen.jit(lambda x: x.exp() + 1, dynamic=True)
    jf(torch.randn(4))
    trace = fulmen.last_traces(jf)[0]
    assert all(has_symbolic(b) for b in trace.bound_symbols)
    static = fulmen.jit(lambda x: x.exp() + 1)
    static(torch.randn(4))
    assert not any(has_symbolic(b) for b in fulmen.last_traces(static)[0].bound_symbols)


def _gpt_inputs(t: int, b: int = 2):
    gen = torch.Generator().manual_seed(t)
    return torch.randint(0, 128, (b, t), generator=gen), torch.randint(0, 128, (b, t), generator=gen)


def test_gpt_inference_sequence_lengths(strict):
    model, _ = build("gpt-tiny")
    jm = fulmen.jit(model)
    with torch.no_grad():
        for t in (5, 8, 11, 16):
            idx, _ = _gpt_inputs(t)
            torch.testing.assert_close(jm(idx), model(idx))
        assert fulmen.cache_misses(jm) == 2
        idx, _ = _gpt_inputs(7, b=3)  # a new batch size: one more dimension marked dynamic
        torch.testing.assert_close(jm(idx), model(idx))
        idx, _ = _gpt_inputs(9, b=5)
        torch.testing.assert_close(jm(idx), model(idx))
    assert fulmen.cache_misses(jm) == 3
    assert "dim 0 changed 2 -> 3: marked dynamic" in fulmen.compile_stats(jm).last_recompile_reason


def test_gpt_training_sequence_lengths(strict):
    model, _ = build("gpt-tiny")
    ref, _ = build("gpt-tiny")  # same seed: same weights
    jm = fulmen.jit(model)
    for t in (6, 9, 12, 16):
        idx, targets = _gpt_inputs(t)
        logits, loss = jm(idx, targets)
        ref_logits, ref_loss = ref(idx, targets)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        loss.backward()
        ref_loss.backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        model.zero_grad()
        ref.zero_grad()
    assert fulmen.cache_misses(jm) == 2


def test_backward_binds_symbols_from_saved_tensors_or_cotangents(strict):
    def f(x, w):
        b, t, c = x.shape
        return (x.reshape(b * t, c) @ w).sum(0)  # the backward expands a cotangent to (b * t, ...)

    jf = fulmen.jit(f, executors=[])
    w = torch.randn(4, 3, requires_grad=True)
    for t in (3, 5, 8):
        x = torch.randn(2, t, 4, requires_grad=True)
        x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        jf(x, w).sum().backward()
        f(x2, w2).sum().backward()
        torch.testing.assert_close(x.grad, x2.grad)
        torch.testing.assert_close(w.grad, w2.grad)
        w.grad = None
    assert fulmen.cache_misses(jf) == 2
    backward = str(fulmen.last_backward_traces(jf)[-1])
    assert re.search(r"s\d+ = \w+\.shape\[\d\]", backward), backward


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_training_sequence_lengths(strict, name):
    pytest.importorskip("transformers")
    import transformers

    from fulmen.bench.hf import hf_model

    transformers.logging.set_verbosity_error()
    ref, model = hf_model(name).train(), hf_model(name).train()
    jm = fulmen.jit(model)
    params = dict(model.named_parameters())
    for seq in (8, 12, 16):
        gen = torch.Generator().manual_seed(seq)
        kwargs = {"input_ids": torch.randint(2, ref.config.vocab_size, (2, seq), generator=gen),
                  "labels": torch.randint(2, ref.config.vocab_size, (2, seq), generator=gen)}
        actual, expected = jm(**kwargs), ref(**kwargs)
        torch.testing.assert_close(actual.logits, expected.logits, rtol=1e-5, atol=1e-5)
        actual.loss.backward()
        expected.loss.backward()
        for pname, p in ref.named_parameters():
            if p.grad is not None:
                scale = max(1.0, p.grad.abs().max().item())
                torch.testing.assert_close(params[pname].grad, p.grad, rtol=1e-5, atol=1e-5 * scale)
        ref.zero_grad()
        model.zero_grad()
    assert fulmen.cache_misses(jm) == 2



_IMPORTS_OUTSIDE_THE_LOCK = """
import builtins, sys, torch, fulmen
from fulmen.core.utils import compiler_import_lock
assert "torch._dynamo" not in sys.modules
outside = []
original = builtins.__import__

def recording(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name.startswith("torch._dynamo") and name not in sys.modules \\
            and not compiler_import_lock._is_owned():
        outside.append(name)
    return original(name, globals, locals, fromlist, level)

builtins.__import__ = recording
f = fulmen.jit(lambda x: (x * 3).sum(0), compile="off")
f(torch.randn(4, 3))
f(torch.randn(6, 3))  # dynamic sizes: a ShapeEnv, which imports Dynamo's modules
assert fulmen.compile_stats(f).last_recompile_reason.endswith("marked dynamic")
print(outside)
"""


def test_dynamic_sizes_import_dynamo_only_under_the_compiler_import_lock():
    """The background compiler imports Dynamo under ``compiler_import_lock``; a dynamic compilation on the main
    thread must too, or one thread can meet the other's half-imported ``torch._dynamo`` (an ImportError that hit
    about 2 runs in 3 of docs/recompilation.md in the "async" mode). Checked in a fresh process, where Dynamo
    is not imported yet: no ``torch._dynamo`` module is first imported outside the lock."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _IMPORTS_OUTSIDE_THE_LOCK], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
