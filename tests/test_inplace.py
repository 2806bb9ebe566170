"""In-place semantics: results *and* the caller's tensors end exactly as in eager PyTorch.

fulmen traces in-place ops functionally (``fulmen.torch.inplace``): a view remembers its base, an update of a
view is scattered into the base, the base's other views see it, and inputs whose value changed are copied
back into the caller's tensors at the end. Each program runs eagerly on one copy of the inputs and compiled
(twice: the compiling call and a cached call) and decomposed to prims on others; everything must agree.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fulmen
from fulmen.testing import assert_close, run_decomposed


def _copies(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def check(fn, *args):
    """``fn(*args)`` compiled, cached and decomposed vs eager: outputs and every tensor argument afterwards."""
    eager_args = _copies(args)
    expected = fn(*eager_args)
    jfn = fulmen.jit(fn)
    for run in (jfn, jfn, lambda *a: run_decomposed(fn, *a)):
        run_args = _copies(args)
        assert_close(run(*run_args), expected)
        assert_close(run_args, eager_args)
    return jfn


# ---------------------------------------------------------------------------------------------------------
# views of inputs


def test_update_of_a_view_reaches_the_input():
    def f(a):
        x = a[0]
        x.mul_(2)
        return x

    check(f, torch.randn(3, 4))


def test_views_of_views_and_sibling_views_see_updates():
    def f(a):
        row = a[1:]
        cell = row[0]
        col = a[:, 1]
        cell.fill_(3.0)  # reaches row, a and col
        a.t()[2].zero_()  # through a transposed view
        return a.clone(), row, col

    check(f, torch.randn(3, 4))


def test_update_of_the_base_is_seen_by_existing_views():
    def f(a):
        y = a[0]
        z = y[1:]
        w = a.view(-1)
        a.add_(10)
        return y, z, w

    check(f, torch.randn(3, 4))


@pytest.mark.parametrize("make_view", [
    lambda a: a.view(2, 6), lambda a: a.reshape(-1), lambda a: a.transpose(0, 1), lambda a: a.permute(1, 0),
    lambda a: a.narrow(1, 1, 2), lambda a: a.select(0, -1), lambda a: a.split(2, 1)[1], lambda a: a.unbind(1)[2],
    lambda a: a.chunk(2)[0], lambda a: a.diagonal(), lambda a: a.unsqueeze(0).squeeze(0), lambda a: a.flatten(),
    lambda a: a.unflatten(1, (2, 2)), lambda a: a.T, lambda a: a.mT, lambda a: a[..., ::2], lambda a: a.movedim(0, 1),
    lambda a: a.detach(), lambda a: a.contiguous(), lambda a: a.expand(1, 3, 4)[0], lambda a: a.unfold(1, 2, 2),
], ids=["view", "reshape", "transpose", "permute", "narrow", "select", "split", "unbind", "chunk", "diagonal",
        "unsqueeze", "flatten", "unflatten", "T", "mT", "slice", "movedim", "detach", "contiguous", "expand", "unfold"])
def test_every_view_op_propagates_updates(make_view):
    def f(a):
        v = make_view(a)
        v.mul_(-2)
        return v

    check(f, torch.randn(3, 4))


def test_copies_do_not_propagate_updates():
    def f(a):
        for copy in (a.clone(), a.t().contiguous(), a.t().reshape(-1), a[[0, 2]], a.flip(0), a.repeat(1, 1),
                     torch.cat([a]), a.to(torch.float32, copy=True), a.roll(0)):
            copy.zero_()
        return a

    check(f, torch.randn(3, 4))


# ---------------------------------------------------------------------------------------------------------
# __setitem__


def test_setitem_basic_slices_and_broadcast_values():
    def f(a, b):
        a[:, 1:3] = b
        a[0] = 7.0
        a[..., -1] = b[:, 0]
        a[None, 1, ::2] = torch.tensor(0.5)
        return a

    check(f, torch.randn(3, 4), torch.randn(3, 2))


def test_setitem_advanced_indices():
    def f(a, idx, v):
        a[idx] = v
        a[[0, 2], 1] = -1.0
        a[idx, idx] = torch.arange(2.0)
        return a

    check(f, torch.randn(4, 4), torch.tensor([3, 1]), torch.randn(4))


def test_setitem_with_boolean_masks():
    def f(a):
        a[a < 0] = 0.0
        a[:, torch.tensor([True, False, True, False])] = torch.tensor([2.5])
        return a

    check(f, torch.randn(3, 4))


def test_setitem_converts_the_value_dtype():
    def f(a, v):
        a[1] = v  # float64 values into an int64 tensor: truncated, as in eager
        return a

    check(f, torch.zeros(3, 2, dtype=torch.int64), torch.tensor([1.7, -2.9], dtype=torch.float64))


def test_setitem_on_a_view_of_an_input():
    def f(a):
        v = a.view(2, 8)
        v[:, ::2] += 1
        v.T[0] -= 5
        return v

    check(f, torch.randn(4, 4))


# ---------------------------------------------------------------------------------------------------------
# in-place ops


def test_chained_in_place_ops_and_returning_the_mutated_input():
    def f(a):
        a.mul_(2).add_(1).clamp_(max=3)
        return a

    check(f, torch.randn(5))


def test_indexed_in_place_ops():
    def f(a, b, idx):
        a.index_put_((idx,), b[0], accumulate=True)
        a.index_add_(1, idx, b.t()[:3, :2], alpha=2)
        a.scatter_(0, idx.view(1, 2).expand(2, 2), b[:, :2])
        a[1:].scatter_add_(1, torch.tensor([[0, 0, 1]]), b[:1, 1:])
        return a

    check(f, torch.randn(3, 4), torch.randn(2, 4), torch.tensor([2, 0]))


def test_copy_fill_zero():
    def f(a, b, s):
        a[0].copy_(b)  # broadcast, float64 -> float32
        a[1].fill_(s)  # a 0-d tensor value
        a[2:].zero_()
        a.t()[0].fill_(9)
        return a

    check(f, torch.randn(4, 3), torch.randn(3, dtype=torch.float64), torch.tensor(4.5))


def test_in_place_on_a_non_contiguous_input():
    def f(a):
        a.add_(1)
        a[0, 0] = 0.0

    x = torch.randn(3, 4).t()
    eager = x.clone().t().contiguous().t()  # same layout as x
    f(eager)
    fulmen.jit(f)(x)
    assert_close(x, eager)
    assert x.stride() == (1, 4)


def test_unchanged_inputs_are_not_written():
    def f(a, b):
        b.add_(1)
        return a * 2

    jfn = check(f, torch.randn(3), torch.randn(3))
    copies = [b for b in fulmen.last_traces(jfn)[0].bound_symbols if b.sym.name == "copy_"]
    assert [c.args[1].name for c in copies] == ["b"]


def test_in_place_on_an_input_that_requires_grad_raises_like_eager():
    def f(w):
        w.add_(1)
        return w

    w = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place"):
        f(w.clone().detach().requires_grad_(True))
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place"):
        fulmen.jit(f)(w)
    with torch.no_grad():  # allowed without grad, as in eager
        expected = f(w.detach().clone().requires_grad_(True))
        assert_close(fulmen.jit(f)(w), expected)
        assert_close(w.detach(), expected)


# ---------------------------------------------------------------------------------------------------------
# modules


class RunningMean(nn.Module):
    """A buffer updated in place in forward, as BatchNorm's running statistics are."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        self.steps += 1
        self.mean[0] = self.steps.float()
        return self.proj(x - self.mean)


def test_module_buffer_updated_in_forward_is_written_back():
    torch.manual_seed(0)
    eager = RunningMean()
    compiled_module = RunningMean()
    compiled_module.load_state_dict(eager.state_dict())
    jitted = fulmen.jit(compiled_module)
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(5, 4)
            assert_close(jitted(x), eager(x))
            assert_close(compiled_module.mean, eager.mean)
            assert compiled_module.steps.item() == eager.steps.item() == step + 1
    assert fulmen.cache_hits(jitted) == 2


# ---------------------------------------------------------------------------------------------------------
# aliasing: values that must stay independent, and views fulmen has no rule for


def test_copy_gives_the_target_its_own_value():
    def f(a, b):
        a.copy_(b)
        b.add_(1)  # must not reach a
        return a, b

    def g(a, b):
        a.copy_(b)
        a.add_(1)  # must not reach the caller's b
        return b * 1

    def h(x):
        b = x * 1
        a = torch.zeros(2)
        a.copy_(b)
        b.add_(1)
        return a

    check(f, torch.zeros(2), torch.ones(2))
    check(g, torch.zeros(2), torch.ones(2))
    check(h, torch.ones(2))


@pytest.mark.parametrize("make", [
    lambda x: F.interpolate(x.view(1, 1, 4), size=4),
    lambda x: F.interpolate(x.view(1, 1, 4), size=4, mode="linear"),
    lambda x: F.interpolate(x.view(1, 1, 2, 2), scale_factor=1.0, mode="bilinear"),
    lambda x: F.adaptive_avg_pool1d(x.view(1, 1, 4), 4),
    lambda x: F.adaptive_max_pool1d(x.view(1, 1, 4), 4),
], ids=["nearest", "linear", "bilinear", "adaptive_avg", "adaptive_max"])
def test_ops_that_change_nothing_still_copy(make):
    def f(a):
        out = make(a)
        out.add_(100)  # eager's result is a new tensor: the caller's input keeps its values
        return a * 1, out

    check(f, torch.arange(4.0))


def test_nan_to_num_of_an_integer_tensor_copies():
    def f(a):
        a.nan_to_num().add_(100)
        return a * 1

    check(f, torch.arange(4))


def test_writes_through_as_strided_reach_the_input():
    def f(a):
        v = a.as_strided((2,), (2,))
        v.add_(3)
        w = torch.as_strided(a, (2, 2), (1, 2), 1)
        a.mul_(2)  # seen by both views
        return a + 0, v * 1, w * 1

    check(f, torch.ones(6))


def test_writes_through_view_as_real_and_view_as_complex_reach_the_input():
    def f(a, r):
        torch.view_as_real(a)[..., 1].zero_()
        pairs = torch.view_as_real(a)
        a.mul_(2)  # seen by pairs
        torch.view_as_complex(r).mul_(1j)
        return a * 1, pairs * 1, r * 1

    z = torch.randn(3, dtype=torch.complex64)
    check(f, z, torch.randn(3, 2))


@pytest.mark.parametrize("executors", [None, ["torch"]], ids=["default", "torch"])
def test_identical_returned_computations_stay_independent(executors):
    def f(a):
        return a + 1, a + 1, a * 2, (a * 2).view(4), a.view(4), a.view(4), (a - 1).sum()

    jfn = fulmen.jit(f) if executors is None else fulmen.jit(f, executors=executors)
    for _ in range(2):  # compiling call and cached call
        outs, expected = jfn(torch.ones(2, 2)), f(torch.ones(2, 2))
        for i, o in enumerate(outs):
            for j in range(i + 1, len(outs)):
                assert (o is outs[j]) == (expected[i] is expected[j])
        outs[0].add_(5)  # an independent tensor in eager: no other output changes
        outs[2].zero_()
        outs[4].mul_(3)  # a view of the input: the input's other view changes, as in eager
        expected[0].add_(5)
        expected[2].zero_()
        expected[4].mul_(3)
        assert_close(outs, expected)


# ---------------------------------------------------------------------------------------------------------
# inputs that share memory, mutated globals, returning mutated inputs


@pytest.mark.parametrize("second", [lambda x: x, lambda x: x[1:]], ids=["same", "view"])
def test_an_input_written_while_another_input_shares_its_memory(second, caplog):
    # the same tensor twice is traced as one input and compiles (tests/test_same_tensor_twice.py); a view of it runs
    # eagerly
    def f(a, b):
        a.mul_(2)
        return b + 1

    jfn = fulmen.jit(f)
    separate = jfn(torch.ones(4), torch.ones(4))  # compiled for separate tensors
    x, y = torch.ones(4), torch.ones(4)
    expected = f(x, second(x))
    with caplog.at_level("WARNING", logger="fulmen"):
        assert_close(jfn(y, second(y)), expected)  # a view: runs eagerly, and says so
    assert_close(y, x)
    assert ("shares memory with another input" in caplog.text) is (second(y) is not y)
    assert_close(jfn(torch.ones(4), torch.ones(4)), separate)


def test_in_place_update_of_a_global_tensor_is_written_back():
    G = torch.zeros(3)

    def f(x):
        G.add_(x)
        G[0] = 5.0
        G.mul_(2)
        return G * 1

    jfn = fulmen.jit(f)
    for _ in range(2):
        expected_g = G.clone()
        eager_g = expected_g.clone()
        eager_g.add_(1)[0] = 5.0
        eager_g.mul_(2)
        assert_close(jfn(torch.ones(3)), eager_g)
        assert_close(G, eager_g)


def test_returning_a_mutated_input_returns_the_callers_tensor():
    def f(a):
        return a.add_(1)

    jfn = fulmen.jit(f)
    for _ in range(2):
        x = torch.zeros(8, 4)[::2]  # non-contiguous: eager returns x, strides and all
        out = jfn(x)
        assert out is x
        out.mul_(10)
        assert_close(x, torch.full((4, 4), 10.0))


# ---------------------------------------------------------------------------------------------------------
# out=


def test_out_argument_writes_an_input_and_a_local_tensor():
    def f(a, b, o):
        torch.add(a, b, out=o)
        local = torch.empty(3, 4, dtype=torch.float64)
        torch.mul(o, 2, out=local)
        return local + 1, o

    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    check(f, a, b, torch.zeros(3, 4, dtype=torch.float64))


def test_out_argument_of_a_view_and_of_a_reduction():
    def f(a, o):
        torch.sum(a, 1, out=o[1])  # a view of the input: the write reaches o
        return torch.exp(a, out=torch.empty_like(a)).sum() + o

    check(f, torch.randn(3, 4, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64))


def test_out_argument_casts_and_returns_named_tuples():
    def f(a):
        v, i = torch.empty(3, dtype=torch.float64), torch.empty(3, dtype=torch.long)
        r = torch.max(a, 1, out=(v, i))
        as_float = torch.empty(3, 4, dtype=torch.float64)
        torch.add(a.long(), 1, out=as_float)  # Long -> Double is a cast torch allows
        return r.values * 2, r.indices, v, i, as_float

    check(f, torch.randn(3, 4, dtype=torch.float64))


def test_out_argument_errors_as_eager():
    a = torch.randn(3, 4, dtype=torch.float64)

    def narrowing(a):
        return torch.add(a, 1, out=torch.empty(3, 4, dtype=torch.long))

    with pytest.raises(RuntimeError, match="result type Double can't be cast to the desired output type Long"):
        narrowing(a)
    with pytest.raises(RuntimeError, match="result type Double can't be cast to the desired output type Long"):
        fulmen.jit(narrowing)(a)

    def with_grad(a, o):
        return torch.mul(a, 2, out=o)

    w = a.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        with_grad(w, torch.empty(3, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        fulmen.jit(with_grad)(w, torch.empty(3, 4, dtype=torch.float64))

    def resized(a):
        return torch.exp(a, out=torch.empty(0, dtype=torch.float64))

    with pytest.raises(NotImplementedError, match="eager PyTorch would resize it"):
        fulmen.jit(resized)(a)


def test_out_argument_of_an_op_without_a_rule():
    def f(a, o):
        torch.special.i1e(a, out=o)  # no torch-language rule: an opaque op, then the copy into o
        return o * 2

    check(f, torch.randn(3, 4, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.float64))


def test_out_argument_of_a_creation_op_into_a_global_buffer():
    buffer = torch.empty(3, dtype=torch.float64)

    def f(x):
        torch.arange(3, out=buffer)  # no traced argument: routed by fulmen's torch-function mode
        return x + buffer

    x = torch.randn(3, dtype=torch.float64)
    torch.testing.assert_close(fulmen.jit(f)(x), x + torch.arange(3.0, dtype=torch.float64))
    torch.testing.assert_close(buffer, torch.arange(3.0, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------------
# views made by ops without a rule, and complex views


def test_update_through_a_view_made_by_an_op_without_a_rule():
    def f(x):
        flat = torch.ravel(x)  # an opaque op whose result eager makes a view of x
        flat[1:3] = 7.0
        same = torch.resolve_neg(x)  # returns x itself in eager
        same.mul_(2)
        return x * 1, flat

    check(f, torch.randn(2, 3, dtype=torch.float64))


def test_update_of_the_input_reaches_a_view_made_by_an_op_without_a_rule():
    def f(x):
        flat = torch.ravel(x)
        x.add_(1)
        return flat * 1

    check(f, torch.randn(2, 3, dtype=torch.float64))


def test_updates_through_complex_views():
    def parts(c):
        c.real.mul_(2)
        c.imag.add_(1)
        return c * 1, c.real, torch.imag(c)

    def conjugated(c):
        y = torch.conj(c)
        y.add_(1j)  # c gets conj(y)
        a = c.adjoint()
        a[0, 0] = 5 + 2j
        return c.clone(), y, c.mH, c.H

    def real_input(r):
        y = r.conj()  # r itself
        y.add_(1)
        z = r.real  # r itself
        z.mul_(3)
        return r * 1, torch.conj_physical(r)

    c = torch.randn(3, 3, dtype=torch.complex128)
    check(parts, c)
    check(conjugated, c)
    check(real_input, torch.randn(3, 3, dtype=torch.float64))


def test_complex_conjugation_ops_and_their_gradients():
    c = torch.randn(4, dtype=torch.complex128, requires_grad=True)

    def f(c):
        return (torch.conj(c) * c.real).abs().sum() + torch.vdot(c, c * 2).real + c.imag.sum() + \
            torch.conj_physical(c).imag.sum() + c.reshape(2, 2).adjoint().real.sum()

    torch.testing.assert_close(fulmen.jit(f)(c), f(c))
    expected = torch.autograd.grad(f(c), c)[0]
    torch.testing.assert_close(torch.autograd.grad(fulmen.jit(f)(c), c)[0], expected)


def test_write_through_a_value_changing_view_without_a_rule_is_refused():
    def f(x):
        y = torch._neg_view(x)  # eager: a view holding -x (the negative bit), no fulmen rule
        y.add_(1)
        return x * 1

    with pytest.raises(NotImplementedError, match="could not reach the input"):
        fulmen.jit(f)(torch.randn(3, dtype=torch.float64))


def test_inputs_with_a_lazy_conjugate_or_negative_bit_are_read_and_written_as_eager():
    # x.conj() and x.conj().imag are lazy views (a bit, no copy); compiled code reads raw memory, so a program
    # compiled for plain inputs must not be reused for them, and writes must reach the viewed tensor
    torch.manual_seed(0)
    c = torch.randn(4, dtype=torch.complex128)

    def scale(a):
        return a * 3 + 1

    jitted = fulmen.jit(scale, compile="sync")
    for a in (c.conj().imag.clone(), c.conj().imag, c.clone(), c.conj()):
        assert_close(jitted(a), scale(a))
        assert_close(jitted(a), scale(a))  # the cached program too

    def bump(a):
        a.add_(1)
        return a * 2

    for make in (lambda t: t.conj(), lambda t: t.conj().imag):
        base, eager_base = c.clone(), c.clone()
        eager_out = bump(make(eager_base))
        out = fulmen.jit(bump)(make(base))
        assert_close(out, eager_out)
        assert_close(base, eager_base)  # written through the view, as eager does


def test_gradient_flows_through_a_negative_bit_input():
    c = torch.randn(4, dtype=torch.complex128, requires_grad=True)

    def f(a):
        return (a.sin() * a).sum()

    expected = torch.autograd.grad(f(c.conj().imag), c)[0]
    jitted = fulmen.jit(f, compile="sync")
    for _ in range(3):  # the first call runs on PyTorch's autograd, later ones on the compiled backward
        torch.testing.assert_close(torch.autograd.grad(jitted(c.conj().imag), c)[0], expected)


def test_resolve_conj_and_resolve_neg_copy_exactly_when_eager_does():
    # eager copies when the tensor carries the lazy bit (after conj(), conj().imag) and aliases otherwise, so a
    # write to the result reaches the input only in the second case
    def resolved_conj(x):
        y = x.conj().resolve_conj()
        y.add_(1)
        return x * 1, y

    def resolved_neg(x):
        y = x.conj().imag.resolve_neg()
        y.mul_(2)
        return x * 1, y

    def plain(x):
        y = x.resolve_conj().resolve_neg()  # no bit: x itself
        y.add_(1)
        return x * 1, y

    def conj_twice(x):
        y = x.conj().conj().resolve_conj()  # the bits cancel: a view of x
        y.add_(1)
        return x * 1, y

    for fn in (resolved_conj, resolved_neg, plain, conj_twice):
        check(fn, torch.randn(3, dtype=torch.complex128))
