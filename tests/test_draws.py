"""``fulmen.core.draws``: whether a call draws random numbers, asked the same way by every pass that must keep a draw
where eager makes it (dead-code elimination, fusion, checkpointing, ``torch.cond``, replay, CUDA graphs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fulmen
from fulmen.core.draws import draws, is_draw
from fulmen.extend import OperatorExecutor

_ex = OperatorExecutor("draws_test_ex", version="0.1")
# an operator without a random tag of its own whose decomposition draws, as eager's dropout does
_noisy = _ex.register_operator("draws_test_noisy", like=lambda x: F.dropout(x, 0.5), fn=lambda x: F.dropout(x, 0.5))


def test_an_unused_operator_whose_decomposition_draws_still_advances_the_generator():
    # dead-code elimination asked only symbols tagged RANDOM_OP: the unused call was dropped, so the next draw
    # took the numbers eager's dropout had taken
    def f(x):
        _noisy(x)
        return torch.rand_like(x)

    def eager(x):
        F.dropout(x, 0.5)
        return torch.rand_like(x)

    x = torch.randn(4, 4)
    jf = fulmen.jit(f, executors=[_ex])
    torch.manual_seed(0)
    out = jf(x)
    torch.manual_seed(0)
    torch.testing.assert_close(out, eager(x), rtol=0, atol=0)
    (call,) = [b for b in fulmen.last_traces(jf)[0].bound_symbols if b.sym.name == "draws_test_noisy"]
    assert draws(call) and not is_draw(call)


def test_a_composite_that_can_draw_draws_only_if_its_decomposition_does():
    def f(q, p):
        return F.scaled_dot_product_attention(q, q, q, dropout_p=p)

    q = torch.randn(1, 2, 4, 8)
    for p, expected in ((0.0, False), (0.5, True)):
        jf = fulmen.jit(f, executors=["torch"])
        jf(q, p)
        (call,) = [b for b in fulmen.last_traces(jf)[0].bound_symbols if "attention" in b.sym.name]
        assert draws(call) is expected, p


def test_two_calls_of_an_operator_whose_decomposition_draws_are_not_merged():
    # common-subexpression elimination merged them (the second call's numbers were the first's): eager draws twice
    def f(x):
        return _noisy(x) - _noisy(x)

    x = torch.ones(64)
    jf = fulmen.jit(f, executors=[_ex])
    torch.manual_seed(0)
    out = jf(x)
    torch.manual_seed(0)
    want = F.dropout(x, 0.5) - F.dropout(x, 0.5)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert want.abs().sum() > 0, "the two masks differ"
