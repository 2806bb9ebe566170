"""``torch.autocast`` entered or left inside a traced function applies from there on, as in eager.

fulmen records autocast's casts in the trace and runs generated code with autocast disabled, so an autocast
state that changes inside the function must be followed op by op while tracing, and nothing may be cast
twice (autocast on when called, off inside) or not at all (off when called, on inside).
"""

from __future__ import annotations

import pytest
import torch

import fulmen


def on_inside(x, w):
    y = torch.sin(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = y @ w
    return z.float().exp() + torch.mm(y, w), z


def off_inside(x, w):
    with torch.autocast("cpu", enabled=False):
        u = x @ w
    return u * 2 + (x @ w).float(), u


def _run(fn, autocast_outside: bool):
    torch.manual_seed(0)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 6, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_outside):
        outs = fn(x, w)
    outs[0].sum().backward()
    return [o.detach() for o in outs] + [x.grad, w.grad]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("fn, autocast_outside", [(on_inside, False), (off_inside, True)], ids=["on", "off"])
def test_autocast_changed_inside_the_function(fn, autocast_outside, mode):
    expected = _run(fn, autocast_outside)
    jfn = fulmen.jit(fn, compile=mode, executors=["torch"])
    for call in range(2):
        for got, e in zip(_run(jfn, autocast_outside), expected):
            assert got.dtype == e.dtype, f"call {call}"
            torch.testing.assert_close(got, e, rtol=1e-6, atol=1e-6)


def test_autocast_changed_inside_a_dynamo_graph():
    expected = _run(on_inside, False)
    compiled = torch.compile(on_inside, backend="fulmen", options={"executors": ["torch"], "compile": "sync"})
    for got, e in zip(_run(compiled, False), expected):
        assert got.dtype == e.dtype
        torch.testing.assert_close(got, e, rtol=1e-6, atol=1e-6)


def test_float64_tensors_are_never_cast():
    """Eager autocast leaves float64 alone, in lower-precision ops and in the widest-type promotion of cat/stack."""
    def f(a, b, c):
        return a @ b, torch.cat([a, c]), c @ c, torch.stack([c, c.bfloat16()])

    a, b, c = torch.randn(3, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64), torch.randn(3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, actual = f(a, b, c), fulmen.jit(f)(a, b, c)
    for e, o in zip(expected, actual):
        assert o.dtype == e.dtype
        torch.testing.assert_close(o, e)
