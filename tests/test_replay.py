"""Copying a decomposition recorded earlier in the trace (fulmen.frontend.replay) must record exactly what running
it again records: the same operations, arguments and names. Every test traces with copying on and off and
compares the printed traces, and checks the copies were made where they should be (or not)."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.bench.hf import HF_MODELS, build_hf
from fulmen.bench.models import build_any
from fulmen.core.options import JitOptions
from fulmen.frontend import replay
from fulmen.frontend.tracing import trace_program


@pytest.fixture
def copies(monkeypatch):
    """Counts, by symbol name, the calls that were copies of an earlier call."""
    counts: collections.Counter = collections.Counter()
    lookup = replay.Replays.lookup

    def counting(self, sym, args, kwargs):
        call = lookup(self, sym, args, kwargs)
        if call is not None and call.bsym is not None:
            counts[sym.name] += 1
        return call

    monkeypatch.setattr(replay.Replays, "lookup", counting)
    return counts


def _traces(fn, args, kwargs=None, monkeypatch=None) -> tuple[str, str]:
    """The printed trace of fn(*args) with copying off, then on."""
    out = []
    for on in (False, True):
        trace, _ = trace_program(fn, args, kwargs or {}, replay=on)
        out.append(str(trace))
    return out[0], out[1]


def _module_traces(module, args, monkeypatch) -> tuple[str, str]:
    jitted = fulmen.jit(module, compile="off")
    program = jitted._fulmen_jitted
    out = []
    for on in (False, True):
        program.options = JitOptions.build(program.options, replay=on)
        trace, _ = program._trace(args, {})
        out.append(str(trace))
    return out[0], out[1]


@pytest.mark.parametrize("name", ["gpt-small", "llama-small"])
def test_builtin_models_trace_the_same(name, monkeypatch, copies):
    model, make_inputs = build_any(name, seed=0)
    ran, copied = _module_traces(model, make_inputs(2, targets=True), monkeypatch)
    assert copied == ran
    assert sum(copies.values()) >= 10  # every layer after the first is mostly copies


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_hugging_face_models_trace_the_same(name, monkeypatch, copies):
    pytest.importorskip("transformers")
    model, make_inputs = build_hf(f"hf:{name}", seq_len=8)
    ran, copied = _module_traces(model, make_inputs(2), monkeypatch)
    assert copied == ran


def test_copies_give_eagers_results_and_gradients(copies):
    model, make_inputs = build_any("gpt-small", seed=0)
    reference, _ = build_any("gpt-small", seed=0)
    idx, targets = make_inputs(2, targets=True)
    jitted = fulmen.jit(model, compile="off")
    logits, loss = jitted(idx, targets)
    loss.backward()
    assert copies["layer_norm"] >= 8 and copies["scaled_dot_product_attention"] >= 3
    ref_logits, ref_loss = reference(idx, targets)
    ref_loss.backward()
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_calls_differing_in_any_argument_are_not_copies(monkeypatch, copies):
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    w = torch.randn(8, requires_grad=True)

    def fn(x, y, w):
        return (F.gelu(x), F.gelu(x, approximate="tanh"),  # a string
                x * 2.0, x * -0.0, x * 0.0,  # 0.0 and -0.0 are different calls
                torch.mul(x, x), torch.mul(x, y),  # the same tensor twice, or two tensors
                F.layer_norm(x, (8,), eps=1e-5), F.layer_norm(x, (8,), eps=1e-6),
                F.layer_norm(x, (8,), weight=w), F.layer_norm(y, (8,), weight=w.detach()),  # requires_grad
                x.double() * 2, x.t().contiguous() * 2)  # dtype, sizes

    ran, copied = _traces(fn, (x, y, w), monkeypatch=monkeypatch)
    assert copied == ran
    assert sum(copies.values()) == 0


def test_the_same_call_under_no_grad_is_not_a_copy(monkeypatch, copies):
    w = torch.randn(8, 8, requires_grad=True)

    def fn(x):
        a = F.linear(x, w)
        with torch.no_grad():
            b = F.linear(x, w)
        return a, b, F.linear(x, w)

    ran, copied = _traces(fn, (torch.randn(2, 8),), monkeypatch=monkeypatch)
    assert copied == ran
    assert copies["linear"] == 1  # the third call copies the first, not the no_grad one


def test_random_draws_are_never_copied(monkeypatch, copies):
    def fn(x):
        return F.dropout(x, 0.5, training=True), F.dropout(x, 0.5, training=True)

    ran, copied = _traces(fn, (torch.randn(64, 64),), monkeypatch=monkeypatch)
    assert copied == ran
    assert copies["dropout"] == 0
    a, b = fulmen.jit(fn, compile="off")(torch.ones(64, 64))
    assert not torch.equal(a, b)  # two masks, as in eager


def test_in_place_updates_between_calls(monkeypatch, copies):
    def fn(x):
        a = F.gelu(x)
        x.mul_(2)  # later calls read x's new value
        b = F.gelu(x)
        a.add_(1)  # a's later value must not leak into copies of the call that made it
        return a, b, F.gelu(x)

    ran, copied = _traces(fn, (torch.randn(4, 4),), monkeypatch=monkeypatch)
    assert copied == ran
    x = torch.randn(4, 4)
    expected = fn(x.clone())
    got = fulmen.jit(fn, compile="off")(x.clone())
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    assert copies["gelu"] >= 1


def test_autocast_casts_before_the_lookup(monkeypatch, copies):
    w = torch.randn(16, 16)

    def fn(x):
        a = F.linear(x, w)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            b = F.linear(x, w)
            c = F.linear(x, w)
        return a, b, c

    ran, copied = _traces(fn, (torch.randn(4, 16),), monkeypatch=monkeypatch)
    assert copied == ran
    assert copies["linear"] == 1  # c copies b; a (float32) is another call
    a, b, c = fulmen.jit(fn, compile="off")(torch.randn(4, 16))
    assert a.dtype == torch.float32 and b.dtype == c.dtype == torch.bfloat16
