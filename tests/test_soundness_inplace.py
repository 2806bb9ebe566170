"""In-place operations and aliasing as eager PyTorch has them: autograd history kept through in-place updates,
errors where eager raises, and the caller's tensors (values, metadata, memory) as eager leaves them.

Each case runs eagerly and through ``fulmen.jit`` on separate copies of the inputs and compares the results, the
inputs afterwards, and the gradients (with the torch executor alone and with the default executors).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fulmen
from fulmen.testing import assert_close

EXECUTORS = [pytest.param(["torch"], id="torch"), pytest.param(None, id="default")]


def _copies(args):
    return [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]


def check_against_eager(fn, *args, executors=None, grad=True):
    """``fn(*args)`` eager vs compiled (compiling call and cached call): outputs, requires_grad, inputs afterwards,
    and the gradients of every input that requires grad (of the sum of the floating outputs)."""
    eager_args = _copies(args)
    expected = fn(*eager_args)
    eager_outs = torch.utils._pytree.tree_leaves(expected)
    if grad:
        _backward(eager_outs)
    jfn = fulmen.jit(fn, executors=executors)
    for _ in range(2):
        run_args = _copies(args)
        out = jfn(*run_args)
        assert_close(out, expected)
        outs = torch.utils._pytree.tree_leaves(out)
        assert [o.requires_grad for o in outs] == [o.requires_grad for o in eager_outs]
        assert_close([a.detach() for a in run_args], [a.detach() for a in eager_args])
        if grad:
            _backward(outs)
            for a, e in zip(run_args, eager_args):
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    assert (a.grad is None) == (e.grad is None)
                    if e.grad is not None:
                        assert_close(a.grad, e.grad)
    return jfn


def _backward(outs):
    outs = [o for o in outs if o.requires_grad]
    if outs:
        torch.autograd.backward([o.sum() for o in outs])


# ---------------------------------------------------------------------------------------------------------
# autograd history through in-place updates


@pytest.mark.parametrize("executors", EXECUTORS)
def test_update_of_a_leaf_under_no_grad(executors):
    def f(x, w):
        y = x + w
        with torch.no_grad():
            w.add_(1)
        return y + x * w

    check_against_eager(f, torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True),
                        executors=executors)


@pytest.mark.parametrize("executors", EXECUTORS)
def test_several_updates_of_a_leaf_under_no_grad(executors):
    def f(x, w):
        with torch.no_grad():
            w.add_(1)
            w.mul_(2)
        return (x * w).sum()

    check_against_eager(f, torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True),
                        executors=executors)


@pytest.mark.parametrize("executors", EXECUTORS)
def test_update_of_a_parameter_under_no_grad_in_forward(executors):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x):
            with torch.no_grad():
                self.w.mul_(0.5)
            return (x * self.w).sum()

    torch.manual_seed(0)
    eager, compiled = Model(), Model()
    compiled.load_state_dict(eager.state_dict())
    jitted = fulmen.jit(compiled, executors=executors)
    for _ in range(2):
        x = torch.randn(4)
        expected, out = eager(x), jitted(x)
        assert_close(out, expected)
        expected.backward()
        out.backward()
        assert compiled.w.is_leaf
        assert_close(compiled.w.detach(), eager.w.detach())
        assert_close(compiled.w.grad, eager.w.grad)


@pytest.mark.parametrize("executors", EXECUTORS)
def test_update_of_a_view_of_a_leaf_under_no_grad(executors):
    def f(x):
        v = x[1:]
        with torch.no_grad():
            x.mul_(2)
        return v * x[:-1]

    check_against_eager(f, torch.randn(5, requires_grad=True), executors=executors)


def _zeroed_through_detach(x):
    x.detach().zero_()
    return x * 2 + 1


def _updated_through_detach(x):
    y = x * 3
    y.detach().add_(1)
    return y * x


def _scaled_through_data(x):
    x.data.mul_(2)
    return x * x


@pytest.mark.parametrize("executors", EXECUTORS)
@pytest.mark.parametrize("fn", [_zeroed_through_detach, _updated_through_detach, _scaled_through_data])
def test_write_through_a_detached_alias_keeps_the_history(fn, executors):
    check_against_eager(fn, torch.randn(3, requires_grad=True), executors=executors)


@pytest.mark.parametrize("executors", EXECUTORS)
@pytest.mark.parametrize("overwrite", ["zero_", "fill_", "fill_tensor", "copy_", "copy_broadcast"])
def test_overwritten_value_keeps_requires_grad_and_gets_zero_gradient(overwrite, executors):
    def f(x, s):
        y = x * 2
        if overwrite == "zero_":
            y.zero_()
        elif overwrite == "fill_":
            y.fill_(3.0)
        elif overwrite == "fill_tensor":
            y.fill_(s.sum().detach())
        elif overwrite == "copy_":
            y.copy_(s.detach())
        else:
            y[1:].copy_(s[0].detach())
        return y

    check_against_eager(f, torch.randn(2, 3, requires_grad=True), torch.randn(2, 3), executors=executors)


def test_clone_zero_requires_grad():
    check_against_eager(lambda x: x.clone().zero_(), torch.randn(3, requires_grad=True), executors=["torch"])


# ---------------------------------------------------------------------------------------------------------
# out= tensors of another dtype: eager's rule differs by op


def _index(n):
    return torch.zeros(n, 2, dtype=torch.long)


_OUT_DTYPE_CASES = {
    "gather": (lambda x, o: torch.gather(x, 0, _index(2), out=o), torch.float64),
    "aminmax": (lambda x, o: torch.aminmax(x, out=(o[0], o[1])), torch.float64),
    "complex": (lambda x, o: torch.complex(x, x, out=o), torch.complex128),
    "multinomial": (lambda x, o: torch.multinomial(x.abs() + 0.1, 1, out=o), torch.int32),
    "where": (lambda x, o: torch.where(x > 0, x, -x, out=o), torch.float64),
}


@pytest.mark.parametrize("op", sorted(_OUT_DTYPE_CASES))
def test_out_of_a_dtype_eager_refuses_raises_as_eager(op):
    fn, dtype = _OUT_DTYPE_CASES[op]
    x = torch.rand(2, 2)
    out = (torch.empty((), dtype=dtype), torch.empty((), dtype=dtype)) if op == "aminmax" else torch.empty(
        2, 1 if op == "multinomial" else 2, dtype=dtype)
    with pytest.raises(RuntimeError) as eager_error:
        fn(x, out)
    message = str(eager_error.value).split("\n")[0]
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fulmen.jit(fn, executors=["torch"])(x, out)


def test_out_of_a_dtype_eager_casts_into_still_works():
    def f(x, o, s):
        torch.add(x, 1, out=o)
        torch.sum(x, 0, out=s)
        return o, s

    x = torch.randn(3, 4)
    eager = f(x, torch.empty(3, 4, dtype=torch.float64), torch.empty(4, dtype=torch.float64))
    compiled = fulmen.jit(f, executors=["torch"])(x, torch.empty(3, 4, dtype=torch.float64),
                                                   torch.empty(4, dtype=torch.float64))
    assert [t.dtype for t in compiled] == [torch.float64, torch.float64]
    assert_close(compiled, eager)


# ---------------------------------------------------------------------------------------------------------
# in-place changes of shape and strides: the caller's tensor would keep its old layout, so they are refused


_METADATA_CHANGES = {
    "squeeze_": (lambda x: x.squeeze_(), (3, 1)),
    "squeeze_dim": (lambda x: x.squeeze_(1), (3, 1)),
    "unsqueeze_": (lambda x: x.unsqueeze_(0), (3,)),
    "t_": (lambda x: x.t_(), (2, 3)),
    "transpose_": (lambda x: x.transpose_(0, 1), (2, 3)),
    "swapdims_": (lambda x: x.swapdims_(0, 1), (2, 3)),
    "swapaxes_": (lambda x: x.swapaxes_(0, 1), (2, 3)),
    "resize_": (lambda x: x.resize_(6), (2, 3)),
    "as_strided_": (lambda x: x.as_strided_((3, 2), (1, 3)), (2, 3)),
    "set_": (lambda x: x.set_(x.flatten()), (2, 3)),
    "on_a_local": (lambda x: (x * 2).unsqueeze_(0), (3,)),
}


@pytest.mark.parametrize("case", sorted(_METADATA_CHANGES))
def test_in_place_change_of_shape_or_strides_is_refused_naming_the_line(case):
    fn, shape = _METADATA_CHANGES[case]
    x = torch.randn(shape)
    before = x.clone()
    with pytest.raises(NotImplementedError, match=r"in place, which fulmen.jit does not support(.|\n)*"
                       r"test_soundness_inplace.py"):
        fulmen.jit(fn, executors=["torch"])(x)
    assert x.shape == before.shape and torch.equal(x, before)


@pytest.mark.parametrize("fn, shape", [(lambda x: x.squeeze_().add_(1), (2, 3)),
                                       (lambda x: x.resize_(2, 3).mul_(2), (2, 3)),
                                       (lambda x: x.t_().add_(1), (4,)),
                                       (lambda x: x.transpose_(1, -1).add_(1), (2, 3))],
                         ids=["squeeze_", "resize_", "t_", "transpose_"])
def test_in_place_shape_ops_that_change_nothing_run(fn, shape):
    x = torch.randn(shape)
    eager_x = x.clone()
    expected = fn(eager_x)
    out = fulmen.jit(fn, executors=["torch"])(x)
    assert out is x
    assert_close(x, eager_x)
    assert_close(out, expected)


def test_assigning_data_is_refused_naming_the_line():
    def f(x, y):
        x.data = y
        return x + 1

    with pytest.raises(NotImplementedError, match=r"Tensor.data of x(.|\n)*test_soundness_inplace.py(.|\n)*x.data = y"):
        fulmen.jit(f, executors=["torch"])(torch.randn(3), torch.randn(3))


# ---------------------------------------------------------------------------------------------------------
# returned views of inputs written in place share the caller's memory, as eager's do


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _views_after_update(x):
    x.add_(1)
    return x[0], x.t()[1:], x.unsqueeze(0)[:, 2:4], x * 2


def _view_taken_before_update(x):
    v = x[1]
    x.mul_(2)
    return v


def _view_of_an_updated_view(x):
    v = x[1]
    v.add_(1)
    return v[1:]


@pytest.mark.parametrize("executors", EXECUTORS)
@pytest.mark.parametrize("fn", [_views_after_update, _view_taken_before_update, _view_of_an_updated_view])
def test_returned_view_of_an_updated_input_shares_its_memory(fn, executors):
    jfn = fulmen.jit(fn, executors=executors)
    for make in (lambda b: b[:2], lambda b: b[:, :4].t(), lambda b: b[:, ::2]):  # contiguous or not
        base = torch.randn(4, 8)
        x, eager_x = make(base.clone()), make(base.clone())
        expected = torch.utils._pytree.tree_leaves(fn(eager_x))
        out = torch.utils._pytree.tree_leaves(jfn(x))
        assert_close(out, expected)
        assert_close(x, eager_x)
        for o, e in zip(out, expected):
            assert _shares_memory(o, x) == _shares_memory(e, eager_x)
            assert (o.shape, o.stride(), o.storage_offset()) == (e.shape, e.stride(), e.storage_offset())
            if _shares_memory(o, x):  # a write through the result reaches the caller's tensor
                o.fill_(7.0)
                e.fill_(7.0)
                assert_close(x, eager_x)


# ---------------------------------------------------------------------------------------------------------
# a source that shares part of the memory written: eager refuses, so does fulmen


def _update_through_an_older_view(x):
    v = x.t()
    x.add_(1)
    return x.copy_(v)


_OVERLAPS = {
    "copy_transpose": (lambda x: x.copy_(x.t()), True),
    "add_transpose": (lambda x: x.add_(x.t()), True),
    "copy_broadcast_row": (lambda x: x.copy_(x[0]), True),
    "mul_broadcast_row": (lambda x: x.mul_(x[0]), True),
    "shift": (lambda x: x[1:].copy_(x[:-1]), True),
    "older_view": (_update_through_an_older_view, True),
    "local_value": (lambda x: _local(x), True),
    "out_transpose": (lambda x: torch.add(x, 1, out=x.t()), True),
    "setitem_shift": (lambda x: x.__setitem__(slice(1, None), x[:-1]), True),
    "setitem_advanced": (lambda x: x.__setitem__([0, 1], x[1:3]), True),
    # eager accepts these
    "other_row": (lambda x: x[0].copy_(x[1]), False),
    "itself": (lambda x: x.add_(x), False),
    "same_view": (lambda x: x.copy_(x[:, :]), False),
    "out_itself": (lambda x: torch.add(x, 1, out=x), False),
    "out_other_row": (lambda x: torch.add(x[0], 1, out=x[1]), False),
    "setitem_other_row": (lambda x: x.__setitem__(0, x[1]), False),
}


def _local(x):
    y = x * 2
    return y.copy_(y.t())


@pytest.mark.parametrize("case", sorted(_OVERLAPS))
def test_source_overlapping_the_written_memory_raises_as_eager(case):
    fn, refused = _OVERLAPS[case]
    x = torch.randn(3, 3)
    eager_x = x.clone()
    if refused:
        with pytest.raises(RuntimeError, match="some elements of the input tensor and the written-to tensor"):
            fn(eager_x)
        with pytest.raises(RuntimeError, match="some elements of the input tensor and the written-to tensor"):
            fulmen.jit(fn, executors=["torch"])(x)
    else:
        expected = fn(eager_x)
        assert_close(fulmen.jit(fn, executors=["torch"])(x), expected)
        assert_close(x, eager_x)


# ---------------------------------------------------------------------------------------------------------
# a value saved for the backward and overwritten in place afterwards: eager's backward refuses it


def _saved_by_sin(x):
    y = x * 1
    z = y.sin()
    y.add_(1)
    return z


def _saved_by_mul_then_updated_under_no_grad(x, w):
    y = x * w
    with torch.no_grad():
        w.add_(1)
    return y


def _saved_then_relu_in_place(x):
    y = x * 2
    z = y.sin()
    torch.nn.functional.relu(y, inplace=True)
    return z + y


def _saved_by_pow(x):
    y = x * 1
    z = y.pow(2)
    y.mul_(2)
    return z + y


def _saved_by_log(x):
    x = x.abs() + 1
    y = x.log()
    x.mul_(2)
    return y


def _result_saved_by_exp(x):
    x = x * 1
    y = x.exp()  # eager saves the result, not x
    x.mul_(2)
    return y


def _saved_as_the_other_operand(x):
    y = x * 1
    y.mul_(y)  # mul saves its other operand: the tensor the update then changes
    return y


def _saved_by_the_argument_of_the_update(x):
    y = x * 1
    y.add_(y.sin())
    return y


def _own_self_of_pow_(x):
    y = x * 1
    y.pow_(2)  # eager keeps what the in-place op itself needs of self
    return y


def _detached_argument_of_the_update(x):
    y = x * 1
    y.div_(y.detach() + 1)
    return y


def _not_saved_by_add(x):
    y = x * 1
    z = y + 1
    y.add_(1)
    return z * y


def _own_result_of_exp_(x):
    y = x * 1
    y.exp_()
    return y


def _not_saved_by_scaling(x):
    y = x * 1
    z = y * 3
    y.zero_()
    return z + y


@pytest.mark.parametrize("executors", EXECUTORS)
@pytest.mark.parametrize("fn, n_args, refused", [
    (_saved_by_sin, 1, True), (_saved_by_mul_then_updated_under_no_grad, 2, True), (_saved_then_relu_in_place, 1, True),
    (_saved_by_pow, 1, True), (_saved_by_log, 1, True), (_result_saved_by_exp, 1, False),
    (_saved_as_the_other_operand, 1, True), (_saved_by_the_argument_of_the_update, 1, True),
    (_own_self_of_pow_, 1, False), (_detached_argument_of_the_update, 1, False),
    (_not_saved_by_add, 1, False), (_own_result_of_exp_, 1, False), (_not_saved_by_scaling, 1, False)],
    ids=lambda v: getattr(v, "__name__", str(v)))
def test_backward_through_a_saved_value_overwritten_in_place_raises_as_eager(fn, n_args, refused, executors):
    args = [torch.randn(3, requires_grad=True) for _ in range(n_args)]
    if not refused:
        check_against_eager(fn, *args, executors=executors)
        return
    jfn = fulmen.jit(fn, executors=executors)
    for run in (fn, jfn, jfn):
        out = run(*_copies(args))  # the forward runs, as in eager
        with pytest.raises(RuntimeError, match="one of the variables needed for gradient computation has been "
                                               "modified by an inplace operation"):
            out.sum().backward()


def test_backward_of_an_output_that_does_not_reach_the_overwritten_value_runs():
    def f(x, w):
        y = x * 1
        z = y.sin()  # saves y, which add_ then overwrites
        y.add_(1)
        return z, (w * 2).sum()

    jfn = fulmen.jit(f, executors=["torch"])
    for run in (f, jfn):
        x, w = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
        z, loss = run(x, w)
        loss.backward()  # eager runs this backward: it never reaches sin's
        assert_close(w.grad, torch.full((3,), 2.0))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.sum().backward()
