"""Fused regions, recomputed values and swapped-in kernels compute exactly what the program computes.

Every test compares forward values and gradients with eager PyTorch."""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.core.trace import check_trace


def _grads(fn, inputs, *args):
    out = fn(*inputs, *args)
    return out, torch.autograd.grad(out.sum(), inputs)


def _compare(jf, fn, inputs, *args, calls=2, **tol):
    """``jf`` against eager ``fn``: forward and gradients of ``inputs``, for ``calls`` calls (a cache hit too)."""
    expected, expected_grads = _grads(fn, inputs, *args)
    for _ in range(calls):
        out, grads = _grads(jf, inputs, *args)
        torch.testing.assert_close(out, expected, **tol)
        for g, e in zip(grads, expected_grads):
            torch.testing.assert_close(g, e, **tol)


# ---------------------------------------------------------------------------------------------------------
# a symbol that passes an input through as one of its outputs


def _gather_of_broadcast(x, c):
    y = x * 2
    v, l = torch.broadcast_tensors(c.unsqueeze(-1), y)  # l is y itself: it has the common shape already
    return l.gather(-1, v[..., :1]).sum() + (y * y).sum()


def test_backward_recomputes_no_value_a_symbol_passes_through():
    """``broadcast_tensors`` returns ``y`` under its own name: recomputing the index in the backward must not
    recompute ``y`` with it (it would read ``y`` before defining it)."""
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    c = torch.tensor([0, 3, 1])
    jf = fulmen.jit(_gather_of_broadcast, executors=["torch"])
    _compare(jf, _gather_of_broadcast, (x,), c, calls=3)
    for trace in fulmen.last_backward_traces(jf):
        check_trace(trace)


def test_categorical_log_prob_and_entropy():
    """A policy-gradient loss: ``log_prob`` broadcasts the actions against the normalized logits, which the
    entropy reads too."""
    def f(logits, actions):
        dist = torch.distributions.Categorical(logits=logits, validate_args=False)
        return dist.log_prob(actions).sum() - 0.01 * dist.entropy().sum()

    logits = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    actions = torch.tensor([0, 5, 2, 2, 1])
    jf = fulmen.jit(f, executors=["torch"])
    _compare(jf, f, (logits,), actions, calls=3)
    torch.autograd.gradcheck(lambda lg: jf(lg, actions), (logits,))
