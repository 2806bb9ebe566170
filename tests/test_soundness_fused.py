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


# ---------------------------------------------------------------------------------------------------------
# values whose bits the backward compares are saved, not recomputed


def _pool_of_gelu(x):
    return F.max_pool2d(F.gelu(x), 2)


def _recomputed_ops(jf):
    return {b.sym.name for t in fulmen.last_backward_traces(jf)[-1:] for b in t.bound_symbols
            for s in (b, *b.subsymbols)}


def test_backward_saves_what_it_compares_with_a_saved_maximum():
    """max_pool2d's gradient compares its input with the saved maximum for equality: the GELU before it is
    saved, because a recomputation (by another kernel) need not reproduce its bits."""
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    jf = fulmen.jit(_pool_of_gelu, executors=["torch"])
    _compare(jf, _pool_of_gelu, (x,))
    assert not {"gelu", "erf"} & _recomputed_ops(jf), fulmen.last_backward_traces(jf)[-1]


def test_backward_still_recomputes_data_movement_and_ordinary_values():
    """Only the bits that decide matter: the pooled windows (views of the saved activation) and an activation
    whose gradient compares nothing are still recomputed."""
    def f(x):
        return F.max_pool2d(F.gelu(x), 2) * 2 + torch.sin(x * 3).sum()

    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    jf = fulmen.jit(f, executors=["torch"])
    _compare(jf, f, (x,))
    saved = fulmen.last_traces(jf)[-1].output[1:]
    # x, the pooled windows and their maximum: sin's input (x * 3) is recomputed from x
    assert [tuple(p.shape) for p in saved] == [(2, 3, 8, 8), (2, 3, 4, 4, 2, 2), (2, 3, 4, 4)], saved


def test_fused_max_pool_of_gelu_gradients_match_eager():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    jf = fulmen.jit(_pool_of_gelu, compile="sync")
    _compare(jf, _pool_of_gelu, (x,), rtol=1e-5, atol=1e-6)
    assert any(b.sym.is_fusion for b in fulmen.last_backward_traces(jf)[-1].bound_symbols)


# ---------------------------------------------------------------------------------------------------------
# casts to a lower precision round inside fused regions, as they do in eager


def _low_precision_intermediates(x):
    return (x.to(torch.bfloat16).amax(-1).float(),  # the gradient compares with a bfloat16 maximum
            (x > x.to(torch.bfloat16)).float() * x,  # true exactly where rounding went down
            (x.to(torch.float16) * 3).float() + x)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fused_casts_to_lower_precision_round_as_in_eager(mode):
    import torch._inductor.config as inductor_config

    from fulmen.executors.inductor_compile import wait_for_compilations

    emulating = inductor_config.emulate_precision_casts
    torch.manual_seed(0)
    x = torch.randn(4, 33, requires_grad=True)
    jf = fulmen.jit(_low_precision_intermediates, compile=mode)
    expected = _low_precision_intermediates(x)
    expected_grad, = torch.autograd.grad(sum(e.sum() for e in expected), x)
    for call in range(4):
        if call == 2:
            wait_for_compilations()  # the last calls run the swapped-in kernels
        out = jf(x)
        grad, = torch.autograd.grad(sum(o.sum() for o in out), x)
        for o, e in zip(out, expected):
            torch.testing.assert_close(o, e, rtol=0, atol=0)
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
    assert any(b.sym.is_fusion for b in fulmen.last_traces(jf)[-1].bound_symbols)
    assert inductor_config.emulate_precision_casts == emulating, "fulmen's compiles leave Inductor's config as it was"
