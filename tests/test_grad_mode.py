"""Grad mode inside a traced function: what eager does not differentiate, fulmen must not either."""

import torch

import fulmen


def test_no_grad_block_inside_the_function_stops_gradients():
    def f(x, w):
        with torch.no_grad():
            scale = (x * w).sum()  # a constant for autograd in eager
        return (x * w * scale).sum()

    x, w = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    f(x, w).backward()
    expected = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    fulmen.jit(f)(x, w).backward()
    torch.testing.assert_close(x.grad, expected[0])
    torch.testing.assert_close(w.grad, expected[1])


def test_detach_stops_gradients():
    def f(x):
        return (x * x.detach()).sum()

    x = torch.randn(4, requires_grad=True)
    fulmen.jit(f)(x).backward()
    torch.testing.assert_close(x.grad, x.detach())
