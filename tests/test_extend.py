"""The extension API as an executor author meets it: new operators, new implementations, the registry,
the seeds' older forms (``add_operator_executor``, ``fulmen.compile``, ``fulmen.trace()``), ``fulmen.examine``,
and the errors an author gets for a name registered twice, an unknown executor, a checker or an
implementation that raises, and an implementation whose outputs disagree with the meta.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import fulmen
import fulmen.torch as ltorch
from fulmen.core.proxies import TensorProxy
from fulmen.executors import add_operator_executor
from fulmen.executors import base as executors_base
from fulmen.extend import (
    ExecutorError,
    OperatorExecutor,
    add_default_executor,
    deregister_executor,
    get_all_executors,
    get_default_executors,
    get_executor,
    register_executor,
    set_default_executors,
)
from fulmen.prims import PrimIDs

_ids = itertools.count()


@pytest.fixture
def fresh():
    """Unique executor names, deregistered (and the default list restored) after the test."""
    created: list[str] = []
    defaults = list(get_default_executors())

    def name(prefix: str = "testex") -> str:
        n = f"{prefix}_{next(_ids)}"
        created.append(n)
        return n

    yield name
    for n in created:
        deregister_executor(n)
    set_default_executors(defaults)


def _exec_lines(f) -> list[str]:
    """Code lines of the last execution trace, without comments."""
    lines = (ln.split("  # ")[0].strip() for ln in str(fulmen.last_traces(f)[-1]).splitlines())
    return [ln for ln in lines if ln and not ln.startswith("#")]


def _numpy_add(a, b):
    return torch.from_numpy(np.add(a.numpy(), b.numpy()))


def _float32_2xn(a, b):
    return a.dtype == b.dtype == torch.float32 and a.ndim == b.ndim == 2 and a.shape[0] == b.shape[0] == 2


def fun(a, b):
    return a + b * a


# ---------------------------------------------------------------------------------------------------------------
# the public surface
# ---------------------------------------------------------------------------------------------------------------

def test_extend_reexports_the_executor_machinery():
    import fulmen.extend as extend

    for name in ("Executor", "OperatorExecutor", "FusionExecutor", "register_executor", "deregister_executor",
                 "get_executor", "get_all_executors", "get_default_executors", "set_default_executors",
                 "add_default_executor"):
        assert getattr(extend, name) is getattr(executors_base, name), name
    assert fulmen.extend is extend
    assert fulmen.executors.TORCH is get_executor("torch")
    assert fulmen.executors.TORCH in get_all_executors()


# ---------------------------------------------------------------------------------------------------------------
# register_operator
# ---------------------------------------------------------------------------------------------------------------

def test_register_operator_with_meta_runs_fn_and_prints_its_name(fresh):
    ex = OperatorExecutor(fresh(), version="1")
    seen = []

    def scale_meta(a, k):
        return TensorProxy(like=a)

    def scale_impl(a, k):
        seen.append(type(a))
        return a * k

    scale = ex.register_operator("scale_by", meta=scale_meta, fn=scale_impl, tags=None)
    assert scale.id == "scale_by" and scale.executor is ex
    f = fulmen.jit(lambda x: scale(x, 3.0) + 1, executors=[ex])
    x = torch.randn(3, 4)
    torch.testing.assert_close(f(x), x * 3.0 + 1)
    torch.testing.assert_close(f(x), x * 3.0 + 1)
    assert seen == [torch.Tensor, torch.Tensor]  # the implementation receives real tensors
    assert "t0 = scale_by(x, 3.0)" in _exec_lines(f)
    # an operator declared with a meta has no decomposition: only its executor can run it
    g = fulmen.jit(lambda x: scale(x, 3.0))
    with pytest.raises(RuntimeError, match=r"Could not find executor for bound symbol t0 = scale_by\(x, 3.0\)"):
        g(x)


def test_register_operator_like_gives_metadata_and_a_decomposition(fresh):
    ex = OperatorExecutor(fresh())

    def multimul_like(a, b, c, d):
        return a * b, c * d

    multimul = ex.register_operator("multimul", like=multimul_like,
                                    fn=lambda a, b, c, d: (np.multiply(a, b), np.multiply(c, d)))
    a, b = torch.randn(2, 2), torch.randn(2, 2)
    f = fulmen.jit(lambda a, b, c, d: multimul(a, b, c, d), executors=[ex])
    out = f(a, b, b.clone(), a.clone())  # four tensor objects, four inputs (one object twice is one input)
    torch.testing.assert_close(out, (a * b, b * a))
    text = str(fulmen.last_traces(f)[-1])
    assert "(t0, t1) = multimul(a, b, c, d)" in text
    assert "# t0 = ltorch.mul(a, b)" in text  # the like function's decomposition is kept as comments
    # without the executor, the torch executor runs the like function's decomposition
    g = fulmen.jit(lambda a, b: multimul(a, b, a, b)[0])
    torch.testing.assert_close(g(a, b), a * b)
    assert "t0 = torch.mul(a, b)" in _exec_lines(g)


def test_register_operator_argument_errors(fresh):
    ex = OperatorExecutor(fresh())
    meta = lambda a: TensorProxy(like=a)  # noqa: E731
    with pytest.raises(TypeError, match="exactly one of meta= or like=.*both"):
        ex.register_operator("op", meta=meta, like=meta, fn=lambda a: a)
    with pytest.raises(TypeError, match="exactly one of meta= or like=.*neither"):
        ex.register_operator("op", fn=lambda a: a)
    with pytest.raises(TypeError, match="fn must be callable"):
        ex.register_operator("op", meta=meta, fn=3)
    ex.register_operator("op", meta=meta, fn=lambda a: a)
    with pytest.raises(ValueError, match=f"executor '{ex.name}' already has an operator named 'op'"):
        ex.register_operator("op", meta=meta, fn=lambda a: a)
    with pytest.raises(TypeError, match="needs op= or execution_transform="):
        ex.register_implementation(ltorch.mul)


# ---------------------------------------------------------------------------------------------------------------
# register_implementation: checkers, execution transforms, executor order
# ---------------------------------------------------------------------------------------------------------------

def _mul_executor(name: str):
    ex = OperatorExecutor(name)
    calls = []
    pairmul = ex.register_operator("pairmul", like=lambda a, b, c, d: (a * b, c * d),
                                   fn=lambda a, b, c, d: (a * b, c * d))

    def mul_to_pairmul(a, b):
        return pairmul(a, b, 0, 0)[0]

    def only_float32(a, b):
        calls.append((a.name, b.name))
        return all(not isinstance(x, TensorProxy) or x.dtype == torch.float32 for x in (a, b))

    ex.register_implementation(ltorch.mul, checker=only_float32, execution_transform=mul_to_pairmul)
    return ex, calls


def test_execution_transform_and_checker(fresh):
    ex, calls = _mul_executor(fresh())
    f = fulmen.jit(lambda a, b: a * b + b, executors=[ex])
    a, b = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(f(a, b), a * b + b)
    lines = _exec_lines(f)
    assert "(t0, _) = pairmul(a, b, 0, 0)" in lines and "t1 = torch.add(t0, b)" in lines
    assert calls == [("a", "b")]
    # the checker rejects float64: the torch executor takes ltorch.mul
    a64, b64 = a.double(), b.double()
    torch.testing.assert_close(f(a64, b64), a64 * b64 + b64)
    assert "t0 = torch.mul(a, b)" in _exec_lines(f)
    # by name, and in priority order: with the torch executor first nothing reaches ours
    register_executor(ex)
    g = fulmen.jit(lambda a, b: a * b, executors=[fulmen.executors.TORCH, ex.name])
    g(a, b)
    assert "t0 = torch.mul(a, b)" in _exec_lines(g)
    h = fulmen.jit(lambda a, b: a * b, executors=[ex.name])
    h(a, b)
    assert "(t0, _) = pairmul(a, b, 0, 0)" in _exec_lines(h)


def test_reregistering_an_implementation_replaces_it(fresh):
    ex, _ = _mul_executor(fresh())
    ex.register_implementation(ltorch.mul, checker=lambda a, b: False,
                               execution_transform=lambda a, b: None)
    f = fulmen.jit(lambda a, b: a * b, executors=[ex])
    f(torch.randn(2), torch.randn(2))
    assert "t0 = torch.mul(a, b)" in _exec_lines(f)


# ---------------------------------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------------------------------

def test_registry_names_and_defaults(fresh):
    ex = OperatorExecutor(fresh())
    assert register_executor(ex) is ex
    assert get_executor(ex.name) is ex
    register_executor(ex)  # the same object again is fine
    with pytest.raises(ValueError, match=f"an executor named '{ex.name}' is already registered"):
        register_executor(OperatorExecutor(ex.name))
    with pytest.raises(ValueError, match="no executor named 'no_such_executor'; registered executors are"):
        get_executor("no_such_executor")
    with pytest.raises(ValueError, match="no executor named 'no_such_executor'"):
        fulmen.jit(fun, executors=["no_such_executor"])
    with pytest.raises(TypeError, match="Executor objects or registered names"):
        fulmen.jit(fun, executors=[3])

    add_default_executor(ex)
    assert get_default_executors()[0] is ex
    f = fulmen.jit(fun)
    assert f.executors[0] is ex and f.executors[-1] is fulmen.executors.TORCH
    deregister_executor(ex)
    assert ex not in get_default_executors() and ex not in get_all_executors()
    with pytest.raises(ValueError, match="no executor named"):
        get_executor(ex.name)


# ---------------------------------------------------------------------------------------------------------------
# add_operator_executor and fulmen.compile (seed 002)
# ---------------------------------------------------------------------------------------------------------------

def _custom_add(fresh, checker=_float32_2xn, impl=_numpy_add) -> tuple[str, list]:
    calls = []

    def logged(a, b):
        calls.append((a.name, b.name))
        return checker(a, b)

    name = fresh("custom_add")
    ex = add_operator_executor(name, {PrimIDs.ADD: ("add_numpy", logged, impl)}, add_to_default_executors=False)
    assert get_executor(name) is ex and ex not in get_default_executors()
    return name, calls


def test_operator_executor_from_op_map_claims_through_decomposition(fresh):
    name, calls = _custom_add(fresh)
    a, b = torch.randn(2, 2), torch.randn(2, 1)
    cfun = fulmen.compile(fun, executors_list=[name, fulmen.executors.TORCH])
    torch.testing.assert_close(cfun(a, b), fun(a, b))
    assert calls == [("a", "t1"), ("a", "t1")]  # asked about ltorch.add's decomposition, then about prims.add
    lines = _exec_lines(cfun)
    assert "t1 = torch.mul(b, a)" in lines and "t2 = add_numpy(a, t1)" in lines

    # executor order: the torch executor first takes everything
    first = fulmen.compile(fun, executors_list=[fulmen.executors.TORCH, name])
    torch.testing.assert_close(first(a, b), fun(a, b))
    assert "t2 = torch.add(a, t1)" in _exec_lines(first)

    # the checker rejects float64 and (3, 2): the torch executor runs ltorch.add
    calls.clear()
    a64, b64 = torch.randn(3, 2, dtype=torch.float64), torch.randn(3, 1, dtype=torch.float64)
    torch.testing.assert_close(cfun(a64, b64), fun(a64, b64))
    assert calls == [("a", "t1")]
    assert "t2 = torch.add(a, t1)" in _exec_lines(cfun)


def test_compile_with_only_a_custom_executor_names_the_unclaimed_symbol(fresh):
    name, _ = _custom_add(fresh)
    cfun = fulmen.compile(fun, executors_list=[name])
    with pytest.raises(RuntimeError) as info:
        cfun(torch.randn(2, 2), torch.randn(2, 1))
    message = str(info.value)
    assert message.startswith('Could not find executor for bound symbol t1 = ltorch.mul(b, a)  # t1: "cpu f32[2, 2]"')
    assert "  # t0 = prims.broadcast_in_dim(b, [2, 2], (0, 1))" in message
    assert name in message


def test_add_operator_executor_defaults_and_errors(fresh):
    name = fresh("custom_add")
    ex = add_operator_executor(name, {PrimIDs.ADD: ("add_numpy", None, _numpy_add)})
    assert get_default_executors()[0] is ex
    f = fulmen.jit(lambda a, b: a + b)
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(f(a, b), a + b)
    assert "t0 = add_numpy(a, b)" in _exec_lines(f)
    with pytest.raises(ValueError, match=f"an executor named '{name}' is already registered"):
        add_operator_executor(name, {PrimIDs.ADD: ("add_numpy", None, _numpy_add)})
    with pytest.raises(TypeError, match="must be a tuple"):
        add_operator_executor(fresh(), {PrimIDs.ADD: ("add_numpy", _numpy_add)})
    with pytest.raises(ValueError, match="must be a Python identifier"):
        add_operator_executor(fresh(), {PrimIDs.ADD: ("add numpy", None, _numpy_add)})
    with pytest.raises(TypeError, match="non-empty dict op_map"):
        add_operator_executor(fresh(), {})


# ---------------------------------------------------------------------------------------------------------------
# errors from checkers and implementations, and the one-time output check
# ---------------------------------------------------------------------------------------------------------------

def test_checker_that_raises_names_executor_and_symbol(fresh):
    def broken(a, b):
        raise KeyError("oops")

    name = fresh()
    add_operator_executor(name, {PrimIDs.ADD: ("add_numpy", broken, _numpy_add)}, add_to_default_executors=False)
    f = fulmen.jit(lambda a, b: a + b, executors=[name])
    with pytest.raises(ExecutorError, match=f"checker of executor '{name}' for prims.add raised KeyError"):
        f(torch.randn(2), torch.randn(2))


@pytest.mark.parametrize("kind", ["raises", "shape", "dtype", "not a tensor"])
def test_implementation_errors_name_executor_and_symbol(fresh, kind):
    def impl(a, b):
        if kind == "raises":
            raise ValueError("numpy exploded")
        if kind == "shape":
            return (a + b)[:1]
        if kind == "dtype":
            return (a + b).double()
        return 3.0

    expected = {
        "raises": "the implementation of add_numpy in executor '{}' raised ValueError: numpy exploded",
        "shape": r"implementation of add_numpy in executor '{}' disagrees with its meta: output is cpu f32\[1, 3\], "
                 r"but the meta promises cpu f32\[2, 3\]",
        "dtype": r"disagrees with its meta: output is cpu f64\[2, 3\], but the meta promises cpu f32\[2, 3\]",
        "not a tensor": r"output is float \(3.0\), but the meta promises a tensor cpu f32\[2, 3\]",
    }[kind]
    name = fresh()
    add_operator_executor(name, {PrimIDs.ADD: ("add_numpy", None, impl)}, add_to_default_executors=False)
    f = fulmen.jit(lambda a, b: a + b, executors=[name])
    with pytest.raises(ExecutorError, match=expected.format(name)):
        f(torch.randn(2, 3), torch.randn(2, 3))


def test_register_operator_implementation_is_checked_against_meta(fresh):
    """An operator's meta that disagrees with its implementation's outputs is the operator author's to fix: fulmen
    warns, naming both, and compiles again with what the implementation returned."""
    ex = OperatorExecutor(fresh())
    rowsum = ex.register_operator("rowsum", meta=lambda a: TensorProxy(like=a, shape=(a.shape[0],)),
                                  fn=lambda a: a.sum(0))  # wrong dimension
    f = fulmen.jit(lambda a: rowsum(a) * 2, executors=[ex])
    x = torch.randn(2, 3)
    with pytest.warns(UserWarning, match=rf"rowsum in executor '{ex.name}' disagrees with its meta: output is "
                                         r"cpu f32\[3\], but the meta promises cpu f32\[2\]"):
        torch.testing.assert_close(f(x), x.sum(0) * 2)
    assert fulmen.cache_misses(f) == 2 and "compiled again" in fulmen.compile_stats(f).last_recompile_reason
    torch.testing.assert_close(f(x), x.sum(0) * 2)
    assert fulmen.cache_hits(f) == 1

    returned = iter([torch.float64, torch.float16])  # a different dtype at each call: no metadata to trace with
    flaky = ex.register_operator("flaky", meta=lambda a: TensorProxy(like=a), fn=lambda a: a.to(next(returned)))
    with pytest.warns(UserWarning, match="flaky"), pytest.raises(ExecutorError, match="flaky in executor"):
        fulmen.jit(lambda a: flaky(a), executors=[ex])(x)


def test_output_check_runs_once_then_the_program_calls_the_implementation_directly(fresh):
    calls = []

    def impl(a, b):
        calls.append(1)
        return a + b

    name = fresh()
    add_operator_executor(name, {PrimIDs.ADD: ("add_numpy", None, impl)}, add_to_default_executors=False)
    f = fulmen.jit(lambda a, b: a + b, executors=[name])
    a, b = torch.randn(4), torch.randn(4)
    f(a, b)
    (entry,) = f._cache.values()
    generated_globals = entry.program.forward.__globals__
    assert generated_globals["add_numpy"] is impl  # the checking wrapper replaced itself after the first call
    torch.testing.assert_close(f(a, b), a + b)
    assert len(calls) == 2


# ---------------------------------------------------------------------------------------------------------------
# fulmen.trace() and fulmen.examine
# ---------------------------------------------------------------------------------------------------------------

def test_trace_shows_inputs_ops_and_return_as_bound_symbols():
    a, b = torch.randn(2, 2), torch.randn(2, 1)
    trace = fulmen.trace()(fun, a, b)
    ids = [bsym.sym.id for bsym in trace.bound_symbols]
    assert ids == [PrimIDs.UNPACK_TRIVIAL, PrimIDs.UNPACK_TRIVIAL, "torch.mul", "torch.add", PrimIDs.RETURN]
    assert [s.sym.id for s in trace.bound_symbols[2].subsymbols] == [PrimIDs.BROADCAST_IN_DIM, PrimIDs.MUL]
    assert [s.sym.id for s in trace.bound_symbols[3].subsymbols] == [PrimIDs.ADD]
    assert str(trace.bound_symbols[0]) == '# a: "cpu f32[2, 2]"'
    assert str(trace.bound_symbols[-1]) == "return t2"
    text = str(trace)
    assert "@torch.no_grad()\ndef fun(a, b):\n" in text
    assert text.count('# a: "cpu f32[2, 2]"') == 1 and text.rstrip().endswith("return t2")
    with pytest.raises(TypeError, match="expects a callable"):
        fulmen.trace()(3, a)


def test_examine_reports_rules_fallbacks_and_agreement(capsys):
    def g(x):
        return torch.special.bessel_j0(x) * 2 + x

    report = fulmen.examine(g, torch.randn(5))
    printed = capsys.readouterr().out
    assert report.ok and report.matches_eager and report.max_abs_error < 1e-6
    assert report.fallbacks == {"torch.special.bessel_j0": 1}
    assert report.supported == {"torch.mul": 1, "torch.add": 1}
    assert "torch.special.bessel_j0" in printed and "matches eager PyTorch" in printed


def test_examine_reports_a_function_fulmen_cannot_trace():
    def g(x):
        return x * float(x.numpy().sum())  # a value NumPy computes: fulmen cannot read it as a split point

    report = fulmen.examine(g, torch.ones(3), show=False)
    assert not report.ok and "DataDependentError" in report.error
    assert "FAILED" in str(report)


def test_checked_implementation_called_outside_generated_code_checks_once():
    from fulmen.executors import checked_implementation

    calls = []

    def impl(a):
        calls.append(a.shape)
        return a[:1] if len(calls) > 1 else a

    wrapped = checked_implementation(impl, executor="ex", symbol="ident", meta=lambda a: TensorProxy(like=a))
    x = torch.randn(3)
    assert wrapped(x) is x  # checked: matches the meta
    assert wrapped(x).shape == (1,)  # afterwards it only forwards
    bad = checked_implementation(lambda a: a[:1], executor="ex", symbol="ident", meta=lambda a: TensorProxy(like=a))
    with pytest.raises(ExecutorError, match=r"ident in executor 'ex' disagrees with its meta"):
        bad(x)


# ---------------------------------------------------------------------------------------------------------------
# fulmen.core.transforms and the seed-000 form: inline, value_and_grad, compile
# ---------------------------------------------------------------------------------------------------------------

def test_core_transforms_reexports_autodiff():
    import fulmen.core.transforms as transforms
    import fulmen.frontend.functional as functional
    import fulmen.transforms.autodiff as autodiff

    for name in ("grad", "value_and_grad", "vjp"):
        assert getattr(transforms, name) is getattr(functional, name) is getattr(fulmen, name), name
    for name in ("get_grad", "put_grad", "put_grads", "register_grad", "register_augmented_forward",
                 "register_backward", "compute_in_forward"):
        assert getattr(transforms, name) is getattr(autodiff, name), name
    assert "inline" in dir(transforms)

    def f(x):
        return x

    assert transforms.inline(f) is f
    with pytest.raises(TypeError, match="inline expects a callable"):
        transforms.inline(3)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        transforms.nope


def test_compiled_value_and_grad_returns_value_and_grads():
    from fulmen.core.transforms import inline, value_and_grad

    @inline
    @value_and_grad
    def loss(logits, labels):
        return torch.nn.functional.cross_entropy(logits, labels, reduction="none")

    logits, labels = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 5, (6,))
    trace = fulmen.trace()(loss, logits, labels)
    assert "def loss(logits, labels):" in str(trace)
    assert trace.bound_symbols[-1].sym.id is PrimIDs.RETURN

    cfun = fulmen.compile(loss, disable_preprocessing=True)
    out, (grad_logits, grad_labels) = cfun(logits, labels)
    reference = logits.clone().requires_grad_()
    expected = torch.nn.functional.cross_entropy(reference, labels, reduction="none")
    expected.sum().backward()
    torch.testing.assert_close(out, expected.detach())
    torch.testing.assert_close(grad_logits, reference.grad)
    assert grad_labels is None
    with pytest.raises(TypeError, match="disable_preprocessing must be a bool"):
        fulmen.compile(loss, disable_preprocessing="yes")


def test_compile_accepts_a_single_executor_and_defaults(fresh):
    name, _ = _custom_add(fresh)
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    single = fulmen.compile(lambda a, b: a + b, executors_list=name)
    torch.testing.assert_close(single(a, b), a + b)
    assert [ex.name for ex in single.executors] == [name]
    default = fulmen.compile(fun)
    assert default.executors[-1] is fulmen.executors.TORCH
    torch.testing.assert_close(default(a, b), fun(a, b))
