"""One tensor object passed as two arguments (``f(a, a)``, ``mha(x, x, x)``).

Eager code sees ``x is y`` and a write through one argument read through the other; the traced program must
assume the same, and a program traced for ``f(a, a)`` must not run for ``f(a, b)`` (or the reverse).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fulmen
from fulmen.testing import assert_close


def _branches(x, y):
    if x is y:
        return x * 3
    return x - y


def test_identity_branch_alternating_calls_match_eager():
    f = fulmen.jit(_branches, executors=["torch"])
    a, b = torch.randn(4), torch.randn(4)
    for args in [(a, a), (a, b), (a, a), (b, b), (b, a)]:
        assert_close(f(*args), _branches(*args))
    assert fulmen.cache_misses(f) == 2  # one program per identity pattern, reused after
    assert "same tensor object" in fulmen.compile_stats(f).recompile_reasons[-1]


def test_identity_pattern_inside_containers_and_kwargs():
    def fn(xs, y):
        return xs[0] * 2 if xs[1] is y else xs[0] + xs[1] + y

    f = fulmen.jit(fn, executors=["torch"])
    a, b, c = torch.randn(3), torch.randn(3), torch.randn(3)
    for xs, y in [((a, b), b), ((a, b), c), ((a, c), c), ((a, a), a)]:
        assert_close(f(xs, y=y), fn(xs, y=y))


def test_write_through_one_argument_is_read_through_the_other(caplog):
    def fn(x, y):
        x.mul_(2)
        return y + 1

    f = fulmen.jit(fn, executors=["torch"])
    for same in (True, False, True):
        a, a_ref, b = torch.ones(3), torch.ones(3), torch.full((3,), 5.0)
        out = f(a, a) if same else f(a, b)
        ref = fn(a_ref, a_ref) if same else fn(a_ref, b.clone())
        assert_close(out, ref)
        assert_close(a, a_ref)
    # traced with one proxy for f(a, a), the write needs no eager fallback
    assert "run eagerly" not in caplog.text
    assert fulmen.cache_misses(f) == 2


def test_gradient_of_a_tensor_passed_twice():
    def fn(x, y):
        return (x * y.sin()).sum() if x is y else (x * y).sum()

    f = fulmen.jit(fn, executors=["torch"])
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    f(x, x).backward()
    fn(x_ref, x_ref).backward()
    assert_close(x.grad, x_ref.grad)  # d/dx x*sin(x) = sin(x) + x*cos(x)
    assert_close(x.grad, x.detach().sin() + x.detach() * x.detach().cos())


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_self_and_cross(need_weights):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    jm = fulmen.jit(mha, executors=["torch"])
    x, k, v = (torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for i, args in enumerate([(x, x, x), (x, k, v), (x, x, x)]):
        for t in (x, k, v):
            t.grad = None
        mha.zero_grad()
        out, weights = jm(*args, need_weights=need_weights)
        (out.sum() + (weights.sum() if weights is not None else 0)).backward()
        grads = [t.grad for t in (x, k, v)] + [p.grad for p in mha.parameters()]
        for t in (x, k, v):
            t.grad = None
        mha.zero_grad()
        ref, ref_weights = mha(*args, need_weights=need_weights)
        (ref.sum() + (ref_weights.sum() if ref_weights is not None else 0)).backward()
        assert_close(out, ref)
        assert (weights is None) == (ref_weights is None)
        if weights is not None:
            assert_close(weights, ref_weights)
        for g, r in zip(grads, [t.grad for t in (x, k, v)] + [p.grad for p in mha.parameters()]):
            assert (g is None) == (r is None)
            if g is not None:
                assert_close(g, r)
        if i == 0:  # self-attention was traced with x as one input of the program
            n_state = len(list(mha.parameters())) + len(list(mha.buffers()))
            assert len(fulmen.last_traces(jm)[0].args) == n_state + 1
    assert fulmen.cache_misses(jm) == 2


@pytest.mark.parametrize("n", [5, 12])  # the prologue compares pairs of a few tensors, a set of ids of more
def test_many_tensors_one_repeated(n):
    def fn(*ts):
        return sum(ts) + (10.0 if ts[-1] is ts[0] else 0.0)

    f = fulmen.jit(fn, executors=["torch"])
    ts = [torch.randn(2) for _ in range(n)]
    for args in [ts, ts[:-1] + ts[:1], ts, ts[:-1] + ts[1:2]]:
        assert_close(f(*args), fn(*args))
    assert fulmen.cache_misses(f) == 3


def test_functional_grad_differentiates_each_position_as_torch_func():
    def fn(a, b, c):
        return (a * b).sum() + (c * c.sin()).sum()

    a, b = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    grads = fulmen.grad(fn)(a, b, a)
    expected = torch.func.grad(fn, argnums=(0, 1, 2))(a, b, a)
    for g, e in zip(grads, expected):
        assert_close(g, e)
