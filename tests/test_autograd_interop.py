"""Where a compiled training program meets PyTorch autograd around it: double backward, inputs updated in
place, outputs that are views of inputs.

Each case runs eagerly and compiled (the compiling call and a cached call) on float64 copies of the same
inputs; values, the caller's tensors afterwards and every gradient must agree, or fulmen must raise where it
cannot follow (double backward) -- never give a silently different gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fulmen

D = torch.float64


def _grads(fn, make, loss):
    """``fn(*inputs)`` for fresh inputs from ``make() -> (leaves, inputs)``; then ``loss(out, inputs).backward()``.
    Returns (output, inputs afterwards, gradients of the leaves)."""
    leaves, inputs = make()
    out = fn(*inputs)
    loss(out, inputs).backward()
    return out, [t.detach() for t in inputs], [leaf.grad for leaf in leaves]


def check_grads(fn, make, loss=lambda out, inputs: out.sum(), **jit_kwargs):
    expected = _grads(fn, make, loss)
    jfn = fulmen.jit(fn, **jit_kwargs)
    for call in range(2):
        torch.testing.assert_close(_grads(jfn, make, loss), expected, msg=lambda m: f"call {call}: {m}")
    return jfn


def _seeded(*shapes, requires_grad=True):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, dtype=D, generator=gen, requires_grad=requires_grad) for s in shapes]


# ---------------------------------------------------------------------------------------------------------
# double backward: a clear error wherever the second derivative would pass through fulmen's backward

DOUBLE = "double backward.*not supported.*eagerly"


def _first_grad(jf, x):
    (g,) = torch.autograd.grad((jf(x) + x ** 3).sum(), x, create_graph=True)
    return g


def test_double_backward_through_autograd_grad_with_inputs_raises():
    jf = fulmen.jit(torch.sin)
    (x,) = _seeded(3)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=DOUBLE):
            torch.autograd.grad(_first_grad(jf, x).sum(), x)
        with pytest.raises(RuntimeError, match=DOUBLE):
            _first_grad(jf, x).sum().backward()


def test_double_backward_through_a_non_leaf_input_and_saved_intermediates_raises():
    def f(h, w):
        return (h @ w).tanh()

    jf = fulmen.jit(f)
    a, w = _seeded((4, 3), (3, 5))
    for wrt in ("w", "h"):  # the first gradient reads a saved intermediate / the cotangent path to h
        h = a * 2
        (g,) = torch.autograd.grad(jf(h, w).sum(), w if wrt == "w" else h, create_graph=True)
        with pytest.raises(RuntimeError, match=DOUBLE):
            torch.autograd.grad(g.sum(), a)


def test_gradgradcheck_raises_instead_of_reporting_a_mismatch():
    jf = fulmen.jit(lambda x: x.sin() * x)
    (x,) = _seeded(3)
    jf(x)
    with pytest.raises(RuntimeError, match=DOUBLE):
        torch.autograd.gradgradcheck(jf, (x,))


def test_create_graph_without_a_second_derivative_still_works():
    jf = fulmen.jit(torch.sin)
    (x,) = _seeded(3)
    for _ in range(2):
        g = _first_grad(jf, x)
        torch.testing.assert_close(g, x.cos() + 3 * x ** 2)
        assert g.requires_grad


# ---------------------------------------------------------------------------------------------------------
# inputs updated in place: the backward reads them as they were before the update


def test_backward_reads_the_buffer_as_updated_not_as_written_back_twice():
    def f(x, buf):
        buf.add_(1.0)
        return x * buf

    buf = torch.zeros(3, dtype=D)
    jf = fulmen.jit(f)
    for call in range(2):
        (x,) = _seeded(3)
        jf(x, buf).sum().backward()
        torch.testing.assert_close(x.grad, torch.full((3,), call + 1.0, dtype=D))


def test_input_that_requires_grad_updated_in_place():
    def f(x, w):
        x.mul_(w)
        return x.sum()

    def make():
        a, w = _seeded(3, 3)
        return [a, w], [a * 1, w]

    check_grads(f, make)
    # the caller's tensor now has the function as its history: gradients through it after the call
    check_grads(f, make, loss=lambda out, inputs: out + (inputs[0] ** 3).sum())


def test_input_that_requires_grad_overwritten_by_a_constant_loses_its_history():
    def f(x, w):
        x.zero_()
        return w * 2  # no output depends on x: the program still gives x its new history

    jf = fulmen.jit(f)
    for call in range(2):
        a, w = _seeded(3, 3, requires_grad=False)
        a.requires_grad_()
        x = a * 1
        jf(x, w)
        (x * 3 + a).sum().backward()  # eager: x's old history gets zeros, so a.grad is 1
        torch.testing.assert_close(a.grad, torch.ones(3, dtype=D), msg=lambda m: f"call {call}: {m}")


def test_update_of_a_view_of_an_input_that_requires_grad():
    def f(x, w):
        x[0].mul_(w[0])  # the backward needs x[0] from before: a view of x must not be saved by reference
        return (x * w).sum()

    def make():
        a, w = _seeded(3, 3)
        return [a, w], [a * 1, w]

    check_grads(f, make, loss=lambda out, inputs: out + (inputs[0] ** 3).sum())


def test_in_place_relu_on_the_output_of_an_eager_layer():
    layer = nn.Linear(4, 4).double()

    def make():
        (a,) = _seeded((3, 4))
        return [a, layer.weight, layer.bias], [layer(a)]

    def relu_twice(h):
        return F.relu(h, inplace=True) * 2

    check_grads(relu_twice, make, loss=lambda out, inputs: out.sum() + (inputs[0] ** 2).sum())
    jf = check_grads(nn.ReLU(inplace=True), make, loss=lambda out, inputs: (out * inputs[0]).sum())
    _, (h,) = make()
    assert jf(h) is h  # returned as eager returns it: the caller's tensor, with the function as its history
    assert h.grad_fn is not None and "Fulmen" in type(h.grad_fn).__name__


def test_in_place_update_of_a_leaf_that_requires_grad_is_refused_as_in_eager():
    def f(x):
        return x.mul_(2)

    (x,) = _seeded(3)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        fulmen.jit(f)(x)


def test_running_statistics_get_no_history():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).double()
    jitted = fulmen.jit(model)
    (x,) = _seeded((8, 4))
    jitted(x).sum().backward()
    assert model[1].running_mean.grad_fn is None and not model[1].running_var.requires_grad


# ---------------------------------------------------------------------------------------------------------
# outputs that are views of inputs


def test_output_view_of_a_leaf_cannot_be_updated_in_place():
    def f(x):
        return x[0], x * 2

    jf = fulmen.jit(f, compile="sync")  # Inductor returns x[0] as a tensor over x's memory
    for _ in range(2):
        (x,) = _seeded((3, 2))
        a, b = jf(x)
        torch.testing.assert_close(a, x[0])
        with pytest.raises(RuntimeError, match="view"):
            a.mul_(5)
        torch.testing.assert_close(x, _seeded((3, 2))[0])  # unchanged
        (a.sum() + b.sum()).backward()
        torch.testing.assert_close(x.grad, torch.tensor([[3.0, 3.0], [2.0, 2.0], [2.0, 2.0]], dtype=D))


@pytest.mark.parametrize("compile_mode", ["off", "sync"])
def test_an_unused_input_with_a_freed_history_is_not_visited(compile_mode):
    """An input that requires grad but reaches no output gets no edge in autograd's graph, as in eager: its history
    may already be freed by an earlier backward."""
    f = fulmen.jit(lambda x, y: x * 2, compile=compile_mode)
    for _ in range(2):
        z = torch.randn(3, requires_grad=True)
        y = z * 2
        y.sum().backward()  # frees y's history
        x = torch.randn(3, requires_grad=True)
        f(x, y).sum().backward()
        torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
