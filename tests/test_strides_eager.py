"""Metadata a compiled call gives as eager gives it: strides of elementwise results, identity of returned inputs,
dtypes under autocast, ``is_inference`` and errors eager raises in backward."""

from __future__ import annotations

import pytest
import torch

import fulmen


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- an input returned unchanged is the caller's tensor, with or without a gradient ----


@pytest.mark.parametrize("op", ["conj", "resolve_conj", "resolve_neg", "identity", "pair"])
def test_an_input_returned_unchanged_that_requires_grad_is_the_callers_tensor(op):
    # eager: x.conj() of a real x is x itself (a leaf, no grad_fn); fulmen returned autograd.Function's view of x
    fns = {
        "conj": lambda x: x.conj(),
        "resolve_conj": lambda x: x.resolve_conj(),
        "resolve_neg": lambda x: x.resolve_neg(),
        "identity": lambda x: x,
        "pair": lambda x: (x.conj(), x * 3),
    }
    fn = fns[op]
    x = torch.randn(3, 2, dtype=torch.float64, generator=_gen(0), requires_grad=True)
    got, want = fulmen.jit(fn, executors=["torch"])(x), fn(x)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    assert [g is x for g in got] == [w is x for w in want] == [True] + [False] * (len(want) - 1)
    assert got[0].grad_fn is None and got[0].is_leaf
    cts = [torch.randn(w.shape, dtype=w.dtype, generator=_gen(k + 1)) for k, w in enumerate(want)]
    (grad_got,) = torch.autograd.grad(got, x, cts)
    (grad_want,) = torch.autograd.grad(want, x, cts)
    torch.testing.assert_close(grad_got, grad_want, rtol=0, atol=0)

