"""User extensions of autograd inside traced functions: ``torch.autograd.Function`` and ``Tensor.register_hook``.

Both must give the gradients eager gives: a Function's own ``backward`` (not the derivative of its forward), and
the gradient a hook returns. Each program is checked against eager in float64 on its first and later calls, with
``compile="sync"`` and in the default ``"async"`` mode, whose first call runs on PyTorch autograd.
"""

from __future__ import annotations

import pytest
import torch

import fulmen
from fulmen.core.symbol import OpTags

MODES = ["sync", "async"]
_APPLY = torch.autograd.Function.__dict__["apply"]  # fulmen wraps it only while tracing


class ScaledIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 10.0  # not the derivative of the forward


class Clip(torch.autograd.Function):  # a straight-through estimator: clamp's gradient would be zero outside
    @staticmethod
    def forward(ctx, x):
        return x.clamp(-0.5, 0.5)

    @staticmethod
    def backward(ctx, g):
        return g * 10.0


class ScaleTwo(torch.autograd.Function):  # setup_context style, non-tensor arguments, two outputs
    @staticmethod
    def forward(x, w, k, mode="a"):
        return x * w * k, (x + 1).exp()

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, k, mode = inputs
        ctx.save_for_backward(x, w)
        ctx.k = k

    @staticmethod
    def backward(ctx, g1, g2):
        x, w = ctx.saved_tensors
        return g1 * 3 * ctx.k + g2, (g1 * x).sum(0) * 7, None, None


class RandomMask(torch.autograd.Function):  # draws random numbers: the backward must see the same mask
    @staticmethod
    def forward(ctx, x):
        mask = (torch.rand_like(x) > 0.5).to(x.dtype)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g * mask * 5


def _run(fn, shapes, seed=0):
    torch.manual_seed(0)
    args = [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes]
    torch.manual_seed(seed)
    out = fn(*args)
    loss = sum(o.sum() for o in out) if isinstance(out, tuple) else out.sum()
    loss.backward()
    outs = out if isinstance(out, tuple) else (out,)
    return [o.detach() for o in outs], [a.grad for a in args], [o.requires_grad for o in outs]


def _check_against_eager(fn, shapes, jfn, calls=3):
    expected = _run(fn, shapes)
    for call in range(calls):
        got = _run(jfn, shapes)
        assert got[2] == expected[2], f"call {call}: requires_grad of the outputs"
        for g, e in zip(got[0] + got[1], expected[0] + expected[1]):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def _compile(fn, mode):
    return fulmen.jit(fn, compile=mode, executors=["torch"])


# ---------------------------------------------------------------------------------------------------------
# torch.autograd.Function

@pytest.mark.parametrize("mode", MODES)
def test_function_uses_its_own_backward(mode):
    def f(x):
        return ScaledIdentity.apply(x * 2) + Clip.apply(x * 2)

    _check_against_eager(f, [(3,)], _compile(f, mode))


@pytest.mark.parametrize("mode", MODES)
def test_setup_context_function_with_non_tensor_args_and_two_outputs(mode):
    def f(x, w):
        a, b = ScaleTwo.apply(torch.sin(x), w, 2.5, mode="b")
        return a * b, b

    _check_against_eager(f, [(4, 3), (3,)], _compile(f, mode))


@pytest.mark.parametrize("mode", MODES)
def test_random_function_backward_sees_the_forward_random_numbers(mode):
    def f(x):
        return RandomMask.apply(x * 3) + x

    _check_against_eager(f, [(64,)], _compile(f, mode))


def test_function_without_grad():
    def f(x):
        return Clip.apply(x * 2) * 3

    x = torch.randn(8, dtype=torch.float64)
    jfn = _compile(f, "sync")
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(jfn(x), f(x), rtol=0, atol=0)
    torch.testing.assert_close(jfn(x), f(x), rtol=0, atol=0)


def test_function_is_one_named_op_in_the_trace():
    def f(x):
        return Clip.apply(x * 2)

    jfn = _compile(f, "sync")
    jfn(torch.randn(3, requires_grad=True))
    trace = fulmen.last_traces(jfn)[0]
    names = [b.sym.name for b in trace.bound_symbols if OpTags.FALLBACK in b.sym.tags]
    assert names == ["Clip.apply"]
    assert "Clip.apply(" in str(trace)
    assert torch.autograd.Function.__dict__["apply"] is _APPLY, "Function.apply stays wrapped after tracing"


def test_function_under_autocast_runs_its_forward_under_autocast():
    class MatMul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a @ b

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            return (g @ b.t().to(g.dtype)).to(a.dtype) * 2, None

    def f(x, w):
        return MatMul.apply(x, w)

    x, w = torch.randn(4, 8), torch.randn(8, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = f(x, w)
        got = _compile(f, "sync")(x, w)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_function_under_the_torch_compile_backend():
    def f(x):
        return Clip.apply(x * 2) + ScaledIdentity.apply(x).sin()

    compiled = torch.compile(f, backend="fulmen", options={"executors": ["torch"], "compile": "sync"})
    _check_against_eager(f, [(5,)], compiled, calls=2)


def test_function_reading_parameters_it_is_not_passed_is_a_clear_error():
    class ApplyModule(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, module):
            return module(x)

        @staticmethod
        def backward(ctx, g):
            return g, None

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(5, 5)

        def forward(self, x):
            return ApplyModule.apply(x * 2, self.a)  # self.a's parameters would get no gradient

    with pytest.raises(NotImplementedError, match=r"(?s)ApplyModule.apply.*not arguments of apply.*ApplyModule"):
        fulmen.jit(Model())(torch.randn(2, 5, requires_grad=True))


@pytest.mark.parametrize("mode", MODES)
def test_reentrant_checkpoint_gives_parameter_gradients(mode):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(5, 5).double()
            self.b = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.GELU(), torch.nn.Linear(5, 5)).double()

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.b, self.a(x), use_reentrant=True)

    torch.manual_seed(0)
    model = Model()
    x = torch.randn(3, 5, dtype=torch.float64)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    jmodel = fulmen.jit(model, compile=mode, executors=["torch"])
    for _ in range(2):
        model.zero_grad()
        jmodel(x).sum().backward()
        for p, e in zip(model.parameters(), expected):
            torch.testing.assert_close(p.grad, e, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# Tensor.register_hook

@pytest.mark.parametrize("mode", MODES)
def test_hook_on_an_intermediate_changes_its_gradient(mode):
    seen = []

    def f(x, w):
        y = torch.tanh(x @ w)
        y.register_hook(lambda g: seen.append(g.clone()))  # returns None: the gradient is unchanged
        z = y * 3
        z.register_hook(lambda g: g.flip(0) * 100)
        return (z * y).sum() + z.sin().sum()

    shapes = [(4, 3), (3, 5)]
    _run(f, shapes)
    expected_seen = list(seen)
    jfn = _compile(f, mode)
    for call in range(2):
        seen.clear()
        _check_against_eager(f, shapes, jfn, calls=1)
        seen.clear()
        _run(jfn, shapes)
        assert len(seen) == 1, f"call {call}: the hook ran {len(seen)} times"
        torch.testing.assert_close(seen[0], expected_seen[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_hook_in_a_module_forward(mode):
    class WithHook(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4).double(), torch.nn.Linear(4, 1).double()

        def forward(self, x):
            h = self.a(x)
            h.register_hook(lambda g: g * 5)
            return self.b(h)

    torch.manual_seed(0)
    model = WithHook()
    x = torch.randn(3, 4, dtype=torch.float64)
    model(x).sum().backward()
    expected = model.a.weight.grad.clone()
    jmodel = fulmen.jit(model, compile=mode, executors=["torch"])
    for _ in range(2):
        model.zero_grad()
        jmodel(x).sum().backward()
        torch.testing.assert_close(model.a.weight.grad, expected, rtol=1e-12, atol=1e-12)


def test_hook_registered_after_a_use_is_a_clear_error():
    def f(x):
        y = x * 2
        z = y + 1
        y.register_hook(lambda g: g * 3)  # eager's hook would also see the gradient through z
        return (z * y).sum()

    with pytest.raises(NotImplementedError, match=r"(?s)already used.*test_user_autograd.py.*y.register_hook"):
        fulmen.jit(f)(torch.ones(2, requires_grad=True))


def test_hook_on_an_input_is_a_clear_error():
    def f(x):
        x.register_hook(lambda g: g * 3)
        return x.sum()

    with pytest.raises(NotImplementedError, match="before passing it in"):
        fulmen.jit(f)(torch.ones(2, requires_grad=True))


def test_retain_grad_inside_is_a_clear_error_and_works_on_a_returned_tensor():
    def inside(x):
        y = x * 2
        y.retain_grad()
        return (y * y).sum()

    with pytest.raises(NotImplementedError, match="retain_grad"):
        fulmen.jit(inside)(torch.ones(2, requires_grad=True))
    double = fulmen.jit(lambda x: x * 2)
    for _ in range(2):  # the first call runs on PyTorch autograd, the second on fulmen's backward
        out = double(torch.ones(2, requires_grad=True))
        out.retain_grad()
        (out * out).sum().backward()
        torch.testing.assert_close(out.grad, torch.full((2,), 4.0))
