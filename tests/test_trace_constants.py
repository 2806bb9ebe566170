"""Values computed while tracing are kept as constants only when nothing can change them between calls.

A torch call made by the traced code on a tensor it reads from a global (or a closure, an object) must read that
tensor at every call, whatever the call is: a torch function written in Python with no fulmen rule (``F.softmin``,
``torch.cdist``), a C function of a torch submodule (``torch.linalg.multi_dot``) or a tensor method without a rule.
A tensor made from no tensor by an ATen function without a rule (``aten.scalar_tensor``, ``aten.empty_strided``,
as aten graphs run through ``TorchCalls`` call them) is a fresh tensor at each call.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fulmen
from fulmen.frontend.aten_graph import TorchCalls
from fulmen.torch.fallback import fallback_ops

W = torch.randn(4, dtype=torch.float64)
G = torch.randn(3, 4, dtype=torch.float64)
S = torch.randn(64, dtype=torch.float64)


def _softmin(x):
    return x + F.softmin(W, dim=0)


def _softmin_no_grad(x):
    with torch.no_grad():
        y = F.softmin(W, dim=0)
    return x + y


def _cdist(x):
    return x + torch.cdist(G, G).sum()


def _unique(x):
    return x + torch.unique(W).sum()


def _multi_dot(x):
    return x + torch.linalg.multi_dot([G, G.T]).sum()


def _method_without_rule(x):
    return x + W.logcumsumexp(0)


def _special(x):
    return x + torch.special.erfcx(W)


def _fft(x):
    return x + torch.fft.fft(W).real


def _stft(x):
    return x + torch.stft(S, 16, window=torch.ones(16, dtype=S.dtype), return_complex=True).abs().sum()


class _Scaler:  # a helper object the traced code reads a tensor from
    table = torch.randn(4, dtype=torch.float64)

    def weights(self):
        return F.softmin(self.table, dim=0) * torch.cdist(self.table[None, :, None], self.table[None, :, None]).sum()


_scaler = _Scaler()


def _helper_object(x):
    return x + _scaler.weights()


@pytest.mark.parametrize(
    "fn",
    [
        _softmin,
        _softmin_no_grad,
        _cdist,
        _unique,
        _multi_dot,
        _method_without_rule,
        _special,
        _fft,
        _stft,
        _helper_object,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_global_tensor_read_at_every_call(fn):
    jitted = fulmen.jit(fn, executors=["torch"])
    x = torch.zeros(4, dtype=torch.float64)
    torch.testing.assert_close(jitted(x), fn(x))
    saved = [t.clone() for t in (W, G, S, _Scaler.table)]
    try:
        for t in (W, G, S, _Scaler.table):
            t.mul_(3).add_(0.5)
        expected = fn(x)
        torch.testing.assert_close(jitted(x), expected)  # the updated values, not the ones seen while tracing
    finally:
        for t, s in zip((W, G, S, _Scaler.table), saved):
            t.copy_(s)
    assert fulmen.cache_misses(jitted) == 1


_aten = torch.ops.aten


def _factories(x):
    return (
        x + 1,
        _aten.scalar_tensor.default(2.0, dtype=torch.float32),
        _aten.empty_strided.default([2], [1], dtype=torch.float32).fill_(3.0),
    )


def _torch_factories(x):
    return x + 1, torch.scalar_tensor(2.0), torch.empty_strided((2,), (1,)).fill_(3.0)


def _aten_graph_program():
    gm = make_fx(_factories)(torch.zeros(2))
    return lambda x: TorchCalls(gm).run(x)


@pytest.mark.parametrize(
    "make", [lambda: _factories, lambda: _torch_factories, _aten_graph_program], ids=["aten", "torch", "TorchCalls"]
)
def test_factory_results_are_fresh_each_call(make):
    jitted = fulmen.jit(make(), executors=["torch"])
    x = torch.zeros(2)
    first = jitted(x)
    expected = _factories(x)
    for got, want in zip(first, expected):
        torch.testing.assert_close(got, want)
    for t in first:
        t.add_(100.0)  # the caller owns what it was given
    second = jitted(x)
    for got, want in zip(second, expected):
        torch.testing.assert_close(got, want)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(first, second))


V = torch.tensor([2.0])


@pytest.mark.parametrize(
    "fn",
    [lambda x: x + V.item(), lambda x: x + float(V), lambda x: x * V.tolist()[0], lambda x: x[: int(V)]],
    ids=["item", "float", "tolist", "int"],
)
def test_global_tensor_value_read_in_python_is_checked_at_every_call(fn):
    jitted = fulmen.jit(fn, executors=["torch"])
    x = torch.arange(6.0)
    try:
        torch.testing.assert_close(jitted(x), fn(x))
        V.fill_(3.0)
        torch.testing.assert_close(jitted(x), fn(x))  # a new value: compiled again, not the value seen first
    finally:
        V.fill_(2.0)


@pytest.mark.parametrize(
    "fn, what",
    [
        (lambda x: x + float(V.numpy()[0]), r"Tensor\.numpy\(\)"),
        (lambda x: x + float(np.asarray(V)[0]), r"np\.asarray"),
        (lambda x: x + (1.0 if 2.0 in V else 0.0), r"`in` on a tensor"),
    ],
    ids=["numpy", "asarray", "in"],
)
def test_global_tensor_values_read_without_a_guard_name_the_line(fn, what):
    with pytest.raises(fulmen.core.proxies.DataDependentError, match=what + r"[\s\S]*test_trace_constants\.py"):
        fulmen.jit(fn, executors=["torch"])(torch.zeros(2))


def test_aten_scalar_tensor_in_an_aten_graph_is_a_torch_language_op():
    def g(x):
        s = _aten.scalar_tensor.default
        return x + 1, s(2), s(True, dtype=torch.bool), s(3, dtype=torch.int64)

    gm = make_fx(g)(torch.zeros(2))
    jitted = fulmen.jit(lambda x: TorchCalls(gm).run(x), executors=["torch"])
    x = torch.zeros(2)
    first, second = jitted(x), jitted(x)
    for got, again, want in zip(first, second, g(x)):
        torch.testing.assert_close(got, want)  # dtype included: aten's default dtype for the int 2
        assert got.data_ptr() != again.data_ptr()
    assert not fallback_ops(fulmen.last_traces(jitted)[0])  # traced through ltorch.full: fusable


def test_nn_init_fills_the_tensor_at_every_call():
    """``torch.nn.init`` functions fill the tensor they are given in place, a global's or an argument's."""
    glob = torch.randn(3, 3)

    def on_global(x):
        torch.nn.init.constant_(glob, 0.5)
        return x + glob

    def on_argument(x, w):
        torch.nn.init.constant_(w, 0.25)
        return x * w

    x = torch.ones(3, 3)
    jitted = fulmen.jit(on_global, executors=["torch"])
    jitted(x)
    glob.fill_(7.0)
    torch.testing.assert_close(jitted(x), torch.full((3, 3), 1.5))
    torch.testing.assert_close(glob, torch.full((3, 3), 0.5))  # filled again, as eager fills it at every call

    w = torch.randn(3, 3)
    torch.testing.assert_close(fulmen.jit(on_argument, executors=["torch"])(x, w), torch.full((3, 3), 0.25))
    torch.testing.assert_close(w, torch.full((3, 3), 0.25))


def test_nn_init_that_draws_writes_the_global_with_eager_numbers():
    glob = torch.zeros(3, 3)

    def fn(x):
        torch.nn.init.uniform_(glob, -1.0, 1.0)
        return x + glob

    jitted = fulmen.jit(fn, executors=["torch"])
    x = torch.zeros(3, 3)
    jitted(x)
    torch.manual_seed(7)
    got, got_glob = jitted(x), glob.clone()
    torch.manual_seed(7)
    torch.testing.assert_close(got, fn(x))
    torch.testing.assert_close(got_glob, glob)


_S = torch.tensor(2.0)
_W = torch.ones(3, 2)

# torch.Tensor's operators written in Python, with a global tensor on the right: Python calls S.__rsub__(1) etc.
_OPERATORS = {
    "rsub": lambda x: x * (1 - _S),
    "rtruediv": lambda x: x * (1 / _S),
    "rpow": lambda x: x * (0.9**_S),
    "rfloordiv": lambda x: x * (7 // _S),
    "floordiv": lambda x: x * (_S // 1),
    "rmod": lambda x: x * (7 % _S),
    "rmatmul": lambda x: x * _W.t().__rmatmul__(torch.ones(1, 2)).sum(),
    "reversed": lambda x: x * next(iter(reversed(_W))).sum(),
}


@pytest.mark.parametrize("name", list(_OPERATORS))
def test_python_operators_on_a_global_tensor_read_it_at_every_call(name):
    # on the previous code these ran once while tracing: 1 - S gave -1 after S became 3
    fn = _OPERATORS[name]
    _S.fill_(2.0), _W.fill_(1.0)
    x = torch.ones(2)
    jitted = fulmen.jit(fn, executors=["torch"])
    torch.testing.assert_close(jitted(x), fn(x))
    _S.fill_(3.0), _W.fill_(2.0)
    torch.testing.assert_close(jitted(x), fn(x))


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_a_jitted_foreach_adam_step_matches_eager(cls):
    # the foreach step computes 1 - beta1 ** step with step a tensor (Tensor.__rpow__), which ran once while tracing,
    # so the jitted step used the first traced step's bias correction at every later step. Traced code takes the
    # step's compile-friendly branch (torch.compile's too): the bias correction in the step tensor's float32, where
    # eager's for-loop takes the step count as a Python float; hence the tolerance, far below the old error (0.19).
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    reference = torch.nn.Linear(3, 2).double()
    reference.load_state_dict(model.state_dict())
    opt = cls(model.parameters(), lr=0.1, foreach=True)
    ref_opt = cls(reference.parameters(), lr=0.1, foreach=True)
    x = torch.randn(4, 3, dtype=torch.float64)

    def backward(m, o):
        o.zero_grad()
        m(x).pow(2).sum().backward()

    for m, o in ((model, opt), (reference, ref_opt)):  # the first step, which makes the state, eagerly
        backward(m, o)
        o.step()
    step = fulmen.jit(lambda: opt.step())
    for _ in range(4):
        backward(model, opt)
        step()
        backward(reference, ref_opt)
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    assert fulmen.cache_misses(step) == 1
