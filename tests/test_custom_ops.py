"""torch.library custom ops through fulmen: one named symbol, fake-tensor metadata, the op's own autograd."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch.library import custom_op, register_autograd

import fulmen

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "custom_ops.py"


def _load_example():
    name = "fulmen_example_custom_ops"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ---- ops used below (defined once per process) ----

@custom_op("fulmen_test::scale_saves_input", mutates_args=())
def scale_saves_input(x: torch.Tensor, w: torch.Tensor, *, alpha: float = 2.0) -> torch.Tensor:
    return x * x * w * alpha


@scale_saves_input.register_fake
def _(x, w, *, alpha=2.0):
    return torch.empty_like(x)


def _scale_setup(ctx, inputs, keyword_only_inputs, output):
    x, w = inputs
    ctx.save_for_backward(x, w)
    ctx.alpha = keyword_only_inputs["alpha"]


def _scale_backward(ctx, g):
    x, w = ctx.saved_tensors
    gx = g * 2 * x * w * ctx.alpha if ctx.needs_input_grad[0] else None
    gw = g * x * x * ctx.alpha if ctx.needs_input_grad[1] else None
    return gx, gw


register_autograd(scale_saves_input, _scale_backward, setup_context=_scale_setup)


@custom_op("fulmen_test::split_two", mutates_args=())
def split_two(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.sin(), x.cos()


@split_two.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x)


register_autograd(split_two, lambda ctx, ga, gb: ga * ctx.x.cos() - gb * ctx.x.sin(),
                  setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]))


@custom_op("fulmen_test::add_into", mutates_args=("out",))
def add_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.add_(x)


@add_into.register_fake
def _(x, out):
    return None


@custom_op("fulmen_test::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    return x + 1


# ---- seed 003 ----

def test_seed_003_float32_matches_softmax_and_is_one_call():
    ex = _load_example()
    trace = ex.check_float32()
    assert "torch.ops.lynx_cortex.softmax.default(t0)" in trace


def test_seed_003_gradcheck_float64():
    _load_example().check_gradcheck()


def test_seed_003_torch_compile_backend():
    _load_example().check_torch_compile()


def test_symbol_names_the_op():
    ex = _load_example()
    jfn = fulmen.jit(ex.softmax_custom)
    jfn(torch.randn(3, 5))
    trace = fulmen.last_traces(jfn)[0]
    (bsym,) = [b for b in trace.bound_symbols if "lynx_cortex" in str(b.sym.id)]
    assert bsym.sym.id == "custom_op:lynx_cortex.softmax"
    assert bsym.sym.qualified_name == "torch.ops.lynx_cortex.softmax.default"


def test_packet_call_form_and_backward_in_fulmen_ops():
    ex = _load_example()
    fn = fulmen.jit(lambda x: torch.ops.lynx_cortex.softmax(x) * torch.arange(5.0))
    x = torch.randn(3, 5, requires_grad=True)
    out = fn(x)
    out.sum().backward()
    xr = x.detach().clone().requires_grad_()
    (torch.softmax(xr, -1) * torch.arange(5.0)).sum().backward()
    torch.testing.assert_close(out, torch.softmax(x.detach(), -1) * torch.arange(5.0))
    torch.testing.assert_close(x.grad, xr.grad)
    assert "torch.ops.lynx_cortex.softmax.default(" in str(fulmen.last_traces(fn)[-1])
    backward = str(fulmen.last_backward_traces(fn)[-1])
    assert "torch.sum(" in backward and "autograd_vjp" not in backward
    assert ex.softmax_custom is not None


# ---- autograd formulas: saving inputs, keyword-only arguments, several outputs ----

def test_setup_context_saving_inputs_with_keyword_only_args():
    fn = fulmen.jit(lambda x, w: scale_saves_input(x, w, alpha=3.0).tanh())
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    out = fn(x, w)
    out.backward(torch.ones_like(out))
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = scale_saves_input(xr, wr, alpha=3.0).tanh()
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)


def test_only_some_inputs_require_grad():
    fn = fulmen.jit(lambda x, w: scale_saves_input(x, w))
    x, w = torch.randn(5, requires_grad=True), torch.randn(5)
    fn(x, w).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach() * w * 2.0)


def test_multiple_outputs_one_used():
    fn = fulmen.jit(lambda x: split_two(x)[1] * 3)
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fn, (x,))
    fn(x).sum().backward()
    torch.testing.assert_close(x.grad, -3 * x.detach().sin())


# ---- mutation and missing fake implementations ----

def test_mutating_op_is_functionalized():
    def f(x, acc):
        add_into(x * 2, acc)
        return acc + 1

    fn = fulmen.jit(f)
    x, acc = torch.randn(4), torch.randn(4)
    acc_eager = acc.clone()
    expected = f(x, acc_eager)
    out = fn(x, acc)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(acc, acc_eager)  # the caller's tensor is updated, as in eager
    assert "add_into_functional" in str(fulmen.last_traces(fn)[-1])


def test_missing_fake_implementation_says_how_to_add_one():
    fn = fulmen.jit(lambda x: no_fake(x))
    with pytest.raises(RuntimeError, match=r"fulmen_test::no_fake has no fake implementation.*register_fake"):
        fn(torch.randn(3))


def test_aten_ops_are_not_custom_ops():
    from fulmen.torch.custom_ops import is_custom_op

    assert not is_custom_op(torch.ops.aten.add.Tensor)
    assert not is_custom_op(torch.add)
    assert is_custom_op(torch.ops.fulmen_test.split_two)
    assert is_custom_op(torch.ops.fulmen_test.split_two.default)
    assert is_custom_op(split_two)
