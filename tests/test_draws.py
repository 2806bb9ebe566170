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


def _noisy_block(x, w):
    return _noisy(x) * w


def _eager_block(x, w):
    return F.dropout(x, 0.5) * w


def test_a_checkpointed_call_whose_decomposition_draws_is_not_drawn_anew_in_the_backward():
    # rematerialization asked the call's own tags: a checkpointed region recomputed the untagged operator in the
    # backward, which drew a new mask (w's gradient used other numbers than the forward's, and the generator moved)
    from torch.utils.checkpoint import checkpoint

    def program(block, x, w):
        return checkpoint(block, x, w, use_reentrant=False).sum()

    x, w = torch.randn(32), torch.randn(32, requires_grad=True)
    jf = fulmen.jit(lambda x, w: program(_noisy_block, x, w), executors=[_ex])
    torch.manual_seed(0)
    (got,) = torch.autograd.grad(jf(x, w), [w])
    after = torch.rand(8)
    torch.manual_seed(0)
    (want,) = torch.autograd.grad(program(_eager_block, x, w), [w])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(after, torch.rand(8), rtol=0, atol=0)


def test_overlapping_communication_keeps_the_order_of_calls_whose_decomposition_draws():
    # the scheduler moved operations without an ordering tag freely: the untagged operator drew before the
    # rand_like that eager runs first (it waits on the all-reduce), taking the numbers rand_like should get
    from fulmen.torch import collectives as c
    from fulmen.transforms.overlap import overlapping, schedule_communication

    def f(x, y):
        a = torch.rand_like(c.wait_tensor(c.all_reduce(x, "sum", "g")))
        return a, _noisy(y)

    trace = fulmen.trace()(f, torch.randn(4), torch.randn(4))
    with overlapping(True):
        scheduled = schedule_communication(trace)
    order = [b.sym.name for b in scheduled.bound_symbols if draws(b)]
    assert order == [b.sym.name for b in trace.bound_symbols if draws(b)] and len(order) == 2, order


# an operator whose decomposition draws twice: first in an untagged operator, then in dropout
_twice = _ex.register_operator(
    "draws_test_twice",
    like=lambda x, w: _noisy(x) * F.dropout(w, 0.5),
    fn=lambda x, w: F.dropout(x, 0.5) * F.dropout(w, 0.5),
)


def test_a_checkpointed_call_drawing_twice_is_not_replayed_from_the_state_before_its_first_draw():
    # the checkpoint replay counted only tagged draws: it drew dropout's mask again from the generator state before
    # the call, which the untagged operator's draw had used, so w's gradient used other numbers than the forward's
    from torch.utils.checkpoint import checkpoint

    def program(block, x, w):
        return checkpoint(block, x, w, use_reentrant=False).sum()

    x, w = torch.randn(32), torch.randn(32, requires_grad=True)
    jf = fulmen.jit(lambda x, w: program(_twice, x, w), executors=[_ex])
    torch.manual_seed(0)
    (got,) = torch.autograd.grad(jf(x, w), [w])
    after = torch.rand(8)
    torch.manual_seed(0)
    (want,) = torch.autograd.grad(program(lambda x, w: F.dropout(x, 0.5) * F.dropout(w, 0.5), x, w), [w])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(after, torch.rand(8), rtol=0, atol=0)
