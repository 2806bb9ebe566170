"""The trace IR: printing, check_trace, symbols outside tracing, proxies, type promotion, data-dependent errors
and the fallback for ops without a rule."""

from __future__ import annotations

import re

import pytest
import torch

import fulmen
from fulmen import clang, prims
from fulmen import torch as ltorch
from fulmen.core import langctx
from fulmen.core.proxies import DataDependentError, TensorProxy
from fulmen.core.symbol import OpTags, SymbolCalledOutsideTracing
from fulmen.core.trace import Trace, TraceCheckError, check_trace
from fulmen.testing import assert_close
from fulmen.torch.fallback import fallback_ops

# ---------------------------------------------------------------------------------------------------------
# printing


def _fun(a, b):
    return a + b * a


def test_trace_prints_in_the_seed_format():
    a, b = torch.randn(2, 2), torch.randn(2, 1)
    jfn = fulmen.jit(_fun)
    torch.testing.assert_close(jfn(a, b), _fun(a, b))
    lines = str(fulmen.last_traces(jfn)[0]).splitlines()
    start = next(i for i, ln in enumerate(lines) if re.fullmatch(r"def \w+\(a, b\):", ln))
    body = lines[start + 1:]
    assert body[0] == '  # a: "cpu f32[2, 2]"'
    assert body[1] == '  # b: "cpu f32[2, 1]"'
    assert body[2] == '  t1 = ltorch.mul(b, a)  # t1: "cpu f32[2, 2]"'
    assert body[3] == '    # t0 = prims.broadcast_in_dim(b, [2, 2], (0, 1))  # t0: "cpu f32[2, 2]"'
    assert body[4] == '    # t1 = prims.mul(t0, a)  # t1: "cpu f32[2, 2]"'
    # the seed prints the defaulted alpha; either form is the same call
    assert re.fullmatch(r'  t2 = ltorch\.add\(a, t1(, alpha=None)?\)  # t2: "cpu f32\[2, 2\]"', body[5]), body[5]
    assert body[6] == '    # t2 = prims.add(a, t1)  # t2: "cpu f32[2, 2]"'
    assert body[7] == "  return t2"


def test_bound_symbols_and_subsymbols_print_like_the_trace():
    jfn = fulmen.jit(_fun)
    jfn(torch.randn(2, 2), torch.randn(2, 1))
    mul = [b for b in fulmen.last_traces(jfn)[0].bound_symbols if b.sym.id == "torch.mul"]
    assert len(mul) == 1
    assert [s.sym.id for s in mul[0].subsymbols] == [prims.PrimIDs.BROADCAST_IN_DIM, prims.PrimIDs.MUL]
    assert str(mul[0]).splitlines() == [
        't1 = ltorch.mul(b, a)  # t1: "cpu f32[2, 2]"',
        '  # t0 = prims.broadcast_in_dim(b, [2, 2], (0, 1))  # t0: "cpu f32[2, 2]"',
        '  # t1 = prims.mul(t0, a)  # t1: "cpu f32[2, 2]"',
    ]


def _programs():
    def inplace(x, y):
        x.mul_(2)
        return x + y

    def constants(x):
        return torch.nan_to_num(x, nan=float("nan"), posinf=float("inf")) + x.to(torch.float64)

    def tuple_out(x):
        return torch.special.i0(x), torch.where(x > 0, x, 0.5), (x.abs(),)

    def kwargs_and_names(input, list=None, *, torch_=1.5):  # argument names that shadow builtins and modules
        return input.clamp(min=-1.0, max=torch_) * list

    return [
        (_fun, (torch.randn(2, 2), torch.randn(2, 1)), {}),
        (inplace, (torch.randn(3, 3), torch.randn(3)), {}),
        (constants, (torch.randn(4),), {}),
        (tuple_out, (torch.randn(2, 3),), {}),
        (kwargs_and_names, (torch.randn(3), torch.randn(3)), {"torch_": 0.5}),
    ]


@pytest.mark.parametrize("fn, args, kwargs", _programs(), ids=lambda x: getattr(x, "__name__", ""))
def test_every_printed_trace_is_valid_python(fn, args, kwargs):
    expected = fn(*[a.clone() for a in args], **kwargs)
    jfn = fulmen.jit(fn)
    actual = jfn(*[a.clone() for a in args], **kwargs)
    assert_close(actual, expected)
    traces = fulmen.last_traces(jfn)
    assert len(traces) >= 2
    for t in traces:
        source = str(t)
        compile(source, "<trace>", "exec")
        check_trace(t)


# ---------------------------------------------------------------------------------------------------------
# check_trace on traces built by hand


def _p(name, shape=(2, 2), dtype=torch.float32):
    return TensorProxy(name, shape=shape, dtype=dtype, device="cpu")


def _trace(args, bsyms, output):
    t = Trace("handmade")
    t.args, t.bound_symbols, t.output = list(args), list(bsyms), output
    return t


def test_check_trace_accepts_a_well_formed_trace():
    a, b, t0, t1 = _p("a"), _p("b"), _p("t0"), _p("t1")
    check_trace(_trace([a, b], [prims.add.bind(a, b, output=t0), prims.mul.bind(t0, a, output=t1)], t1))


def test_check_trace_catches_use_before_definition():
    a, t0, t1 = _p("a"), _p("t0"), _p("t1")
    broken = _trace([a], [prims.add.bind(a, t1, output=t0), prims.mul.bind(a, a, output=t1)], t0)
    with pytest.raises(TraceCheckError, match="t1 is used before it is defined"):
        check_trace(broken)


def test_check_trace_catches_an_undefined_output():
    a, t0 = _p("a"), _p("t0")
    with pytest.raises(TraceCheckError, match="t0"):
        check_trace(_trace([a], [], t0))


def test_check_trace_catches_double_assignment():
    a, first, second = _p("a"), _p("t0"), _p("t0")
    broken = _trace([a], [prims.add.bind(a, a, output=first), prims.mul.bind(a, a, output=second)], second)
    with pytest.raises(TraceCheckError, match="t0 is assigned twice"):
        check_trace(broken)


def test_check_trace_catches_a_duplicated_input():
    a = _p("a")
    with pytest.raises(TraceCheckError, match="a appears twice"):
        check_trace(_trace([a, a], [], a))


@pytest.mark.parametrize("wrong", [
    _p("t0", shape=(3, 3)),
    _p("t0", dtype=torch.float64),
    TensorProxy("t0", shape=(2, 2), dtype=torch.float32, device="meta"),
], ids=["shape", "dtype", "device"])
def test_check_trace_catches_a_meta_mismatch(wrong):
    a, b = _p("a"), _p("b")
    broken = _trace([a, b], [prims.add.bind(a, b, output=wrong)], wrong)
    with pytest.raises(TraceCheckError, match=r"t0 is recorded as .* but the meta of prims\.add gives cpu f32\[2, 2\]"):
        check_trace(broken)


def test_check_trace_catches_inputs_a_meta_rejects():
    a, b, t0 = _p("a"), _p("b", shape=(3,)), _p("t0")
    with pytest.raises(TraceCheckError, match="rejects its recorded inputs"):
        check_trace(_trace([a, b], [prims.add.bind(a, b, output=t0)], t0))


# ---------------------------------------------------------------------------------------------------------
# symbols and proxies


@pytest.mark.parametrize("sym, name", [(ltorch.add, "ltorch.add"), (prims.mul, "prims.mul"),
                                       (ltorch.sin, "ltorch.sin")])
def test_symbol_called_outside_tracing_raises(sym, name):
    x = torch.ones(2)
    args = (x,) if sym is ltorch.sin else (x, x)
    with pytest.raises(SymbolCalledOutsideTracing, match=re.escape(name) + " was called outside of tracing"):
        sym(*args)


def test_tensor_proxy_is_a_tensor_and_torch_calls_on_it_are_captured():
    assert issubclass(TensorProxy, torch.Tensor)
    seen = []

    def f(x, y):
        seen.append((type(x), isinstance(x, torch.Tensor)))
        return torch.sin(x) * x.exp() - torch.nn.functional.tanh(y) + abs(x) + (-y) ** 2 / torch.add(x, y, alpha=2)

    x, y = torch.randn(3, 4), torch.randn(4)
    jfn = fulmen.jit(f)
    torch.testing.assert_close(jfn(x, y), f(x, y))
    assert seen[0] == (TensorProxy, True)
    ids = [b.sym.id for b in fulmen.last_traces(jfn)[0].bound_symbols]
    for expected in ("torch.sin", "torch.exp", "torch.tanh", "torch.abs", "torch.neg", "torch.pow", "torch.add",
                     "torch.mul", "torch.sub", "torch.true_divide"):
        assert expected in ids, f"{expected} not captured; trace has {ids}"
    assert all(not str(i).startswith("fallback:") for i in ids)


_PROMOTION_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                     torch.float32, torch.float64, torch.complex64, torch.complex128)


def _pair(dtype, ndim):
    shape = (2,) * ndim
    return torch.ones(shape, dtype=dtype), TensorProxy("x", shape=shape, dtype=dtype, device="cpu")


@pytest.mark.parametrize("ndims", [(1, 1), (1, 0), (0, 1), (0, 0)], ids=lambda n: f"{n[0]}d-{n[1]}d")
def test_result_dtype_matches_torch_for_tensor_pairs(ndims):
    wrong = []
    for d1 in _PROMOTION_DTYPES:
        for d2 in _PROMOTION_DTYPES:
            (t1, p1), (t2, p2) = _pair(d1, ndims[0]), _pair(d2, ndims[1])
            want, got = torch.result_type(t1, t2), clang.result_dtype(p1, p2)
            if want != got:
                wrong.append(f"{d1}({ndims[0]}d), {d2}({ndims[1]}d): torch {want}, fulmen {got}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("ndim", [0, 1], ids=["0d", "1d"])
def test_result_dtype_matches_torch_with_python_scalars(ndim):
    wrong = []
    for dtype in _PROMOTION_DTYPES:
        t, p = _pair(dtype, ndim)
        for scalar in (True, 2, -2.5, 1j):
            for want, got, order in ((torch.result_type(t, scalar), clang.result_dtype(p, scalar), "tensor, scalar"),
                                     (torch.result_type(scalar, t), clang.result_dtype(scalar, p), "scalar, tensor")):
                if want != got:
                    wrong.append(f"{order} = {dtype}({ndim}d), {scalar!r}: torch {want}, fulmen {got}")
    assert not wrong, "\n".join(wrong)


def test_result_dtype_three_way_matches_torch_add_chain():
    # a dimensioned int tensor, a 0-d float64 tensor and a Python float: the 0-d tensor decides the float kind
    i = TensorProxy("i", shape=(3,), dtype=torch.int32, device="cpu")
    z = TensorProxy("z", shape=(), dtype=torch.float64, device="cpu")
    h = TensorProxy("h", shape=(3,), dtype=torch.float16, device="cpu")
    assert clang.result_dtype(i, z, 2.5) is torch.float64
    assert clang.result_dtype(h, z, 2.5) is torch.float16
    assert clang.result_dtype(i, 2) is torch.int32
    with pytest.raises(TypeError):
        clang.result_dtype(i, "x")


# ---------------------------------------------------------------------------------------------------------
# data-dependent Python


def _branch_on_value(x):
    if x > 0:  # the line DataDependentError must name
        return x
    return -x


def _item(x):
    return x * x.item()


def _tolist(x):
    return x + len(x.tolist())


def _numpy(x):
    return x + x.numpy().sum()


def test_data_dependent_error_names_the_users_line():
    line = _numpy.__code__.co_firstlineno + 1
    with pytest.raises(DataDependentError) as info:
        fulmen.jit(_numpy)(torch.randn(3))
    message = str(info.value)
    assert f'File "{__file__}", line {line}' in message, message
    assert "numpy" in message
    assert "torch.compile" in message  # the way out


@pytest.mark.parametrize("fn", [_branch_on_value, _item, _tolist], ids=["bool", "item", "tolist"])
def test_values_read_by_python_are_split_points(fn):
    # fulmen.jit reads the value from the call's tensors and guards it (tests/test_data_dependent.py covers more)
    line = fn.__code__.co_firstlineno + 1
    jfn = fulmen.jit(fn, executors=["torch"])
    for x in (torch.tensor([1.5]), torch.tensor([-2.0])):
        torch.testing.assert_close(jfn(x), fn(x))
    assert f'line {line}' in str(fulmen.last_traces(jfn)[0])


# ---------------------------------------------------------------------------------------------------------
# fallback for ops without a rule

_FALLBACK_CANDIDATES = (torch.special.i0, torch.special.i1e, torch.special.zeta, torch.special.bessel_j0)


def _unruled_op():
    for fn in _FALLBACK_CANDIDATES:
        if fn not in langctx.torch_functions:
            return fn
    pytest.fail("every candidate op now has a torch-language rule; add an op without one to _FALLBACK_CANDIDATES")


def test_op_without_a_rule_runs_as_a_marked_fallback():
    op = _unruled_op()
    args = (torch.randn(3, 4),) if op is not torch.special.zeta else (torch.rand(3, 4) + 1, torch.rand(3, 4) + 1)

    def f(*xs):
        return op(*xs) * 2 + xs[0]

    jfn = fulmen.jit(f)
    torch.testing.assert_close(jfn(*args), f(*args))
    trace = fulmen.last_traces(jfn)[0]
    opaque = [b for b in trace.bound_symbols if OpTags.FALLBACK in b.sym.tags]
    assert len(opaque) == 1, str(trace)
    assert fallback_ops(trace) == [opaque[0].sym.qualified_name]
    assert op.__name__.replace("special_", "") in opaque[0].sym.qualified_name
    # the printed trace says which line runs without a fulmen rule
    printed = "\n".join(opaque[0].python_lines())
    assert "fallback" in printed.lower(), f"the fallback is not marked in the printed trace:\n{printed}"
    for t in fulmen.last_traces(jfn):
        check_trace(t)


def test_fallback_keeps_torch_return_types():
    assert torch.cummax not in langctx.torch_functions, "cummax has a rule now; pick another structured-output op"
    x = torch.randn(5)
    out = fulmen.jit(lambda t: torch.cummax(t, 0))(x)
    expected = torch.cummax(x, 0)
    torch.testing.assert_close(tuple(out), tuple(expected))
    assert type(out) is type(expected), f"got {type(out).__name__}, eager gives {type(expected).__name__}"
    torch.testing.assert_close(out.indices, expected.indices)
