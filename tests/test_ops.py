"""Tests generated from the OpInfo database (``fulmen.tests.opinfos``), for every op and dtype.

- ``test_core_vs_torch_consistency``: ``fulmen.jit(op)`` against the eager reference on every sample, outputs and
  (for in-place ops) the mutated inputs; ``check_trace`` on every trace the compilation produced.
- ``test_decomposed_vs_torch``: the same with every torch-language symbol replaced by its prims.
- ``test_meta``: every bound symbol of the computation trace, and of its decomposition, run on real tensors; each
  output proxy's shape, dtype and device must equal the real output's (strides of the final outputs when the
  OpInfo says torch guarantees them).
- ``test_errors``: error inputs raise the declared exception type and message through ``fulmen.jit`` (and torch
  raises the same type, so the database entry itself is right).
- ``test_print_exec_roundtrip``: the printed execution trace, exec'd, reproduces the result; every printed trace
  is valid Python.

The conftest turns on ``check_trace`` after every transform of the pipeline. The suite picks up every OpInfo
registered when it is collected.
"""

from __future__ import annotations

import math
import sys
import traceback

import pytest
import torch

import fulmen
from fulmen.core.bookkeeping import is_bookkeeping
from fulmen.core.codegen import python_source
from fulmen.core.devices import DeviceType
from fulmen.core.proxies import DataDependentError, Proxy, TensorProxy
from fulmen.core.trace import check_trace
from fulmen.executors.torchex import ex as torch_executor
from fulmen.frontend.cache import args_key
from fulmen.testing import clone_args as _clone
from fulmen.testing import run_decomposed

try:
    from fulmen.tests.opinfos import all_opinfos

    OPINFOS = all_opinfos()
    IMPORT_ERROR = None
except Exception:  # a broken OpInfo file must not hide the others: report it in its own test
    IMPORT_ERROR = traceback.format_exc()
    _base = sys.modules.get("fulmen.tests.opinfos.base")
    OPINFOS = _base.all_opinfos() if _base is not None else []

TEST_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool)
_DTYPE_NAMES = {d: str(d).replace("torch.", "") for d in TEST_DTYPES}

# (rtol, atol) by output dtype, unless the OpInfo says otherwise; exact dtypes compare exactly
DEFAULT_TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}
#: How many samples the heavier checks run per op: print/exec (float32 only) and the meta interpretation for
#: dtypes other than float32 (float32 runs every sample).
MAX_ROUNDTRIP_SAMPLES = 4
MAX_META_SAMPLES_OTHER_DTYPES = 8
MAX_FAILURES_SHOWN = 5


# ---------------------------------------------------------------------------------------------------------
# parametrization


def _as_mark(directive):
    decorator = directive.decorator
    reason = directive.reason or f"OpInfo directive for {directive.test_name}"
    if getattr(decorator, "name", None) == "xfail":
        # strict: a directive that no longer applies must be removed, so it cannot hide a later regression
        return decorator.with_args(reason=reason, strict=True)
    if getattr(decorator, "name", None) is not None:
        return decorator.with_args(reason=reason)
    return decorator


def _marks(op, test_name, dtype, devicetype):
    marks = []
    for d in op.test_directives:
        if any(d.applies(test_name, dtype, dev, "torch") for dev in (devicetype, DeviceType(devicetype))):
            marks.append(_as_mark(d))
    return marks


def _params(test_name, *, devicetype="cpu", dtypes=TEST_DTYPES, first_dtype_only=False):
    params = []
    for op in OPINFOS:
        chosen = [d for d in dtypes if op.supports_dtype(d, devicetype)]
        if first_dtype_only:
            chosen = chosen[:1]
        for dtype in chosen:
            params.append(pytest.param(op, dtype, id=f"{op.name}-{_DTYPE_NAMES[dtype]}",
                                       marks=_marks(op, test_name, dtype, devicetype)))
    return params


def _op_params(test_name):
    return [pytest.param(op, id=op.name, marks=_marks(op, test_name, None, "cpu"))
            for op in OPINFOS if op.error_input_generator is not None]


# ---------------------------------------------------------------------------------------------------------
# running samples


def _call(fn, op, sample):
    """Call ``fn`` on a fresh copy of the sample; returns (output, args after the call, kwargs after the call)."""
    args, kwargs = _clone(sample.args), _clone(sample.kwargs)
    if op.is_random:
        torch.manual_seed(20240607)
    return fn(*args, **kwargs), args, kwargs


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        layout = "" if x.is_contiguous() else f" strides={x.stride()}"
        return f"Tensor{list(x.shape)}:{_DTYPE_NAMES.get(x.dtype, x.dtype)}{layout}"
    if isinstance(x, (tuple, list)):
        inner = ", ".join(_describe(v) for v in x)
        return f"({inner})" if isinstance(x, tuple) else f"[{inner}]"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}={_describe(v)}" for k, v in x.items()) + "}"
    return repr(x)


def _describe_sample(sample) -> str:
    parts = [_describe(a) for a in sample.args] + [f"{k}={_describe(v)}" for k, v in sample.kwargs.items()]
    return "(" + ", ".join(parts) + ")"


class _Failures:
    """Collects per-sample failures so one test reports every failing sample of its op, not just the first."""

    def __init__(self, op):
        self.op = op
        self.messages: list[str] = []
        self.count = 0

    def run(self, i, sample, check):
        try:
            check()
        except (Exception, pytest.fail.Exception) as e:  # pytest.raises' "DID NOT RAISE" is a pytest.fail
            self.count += 1
            if len(self.messages) < MAX_FAILURES_SHOWN:
                text = str(e).strip()
                if len(text) > 1500:
                    text = text[:1500] + " ..."
                self.messages.append(f"sample {i} {_describe_sample(sample)}:\n    {type(e).__name__}: {text}")

    def raise_if_any(self, total):
        if self.messages:
            more = f"\n  ... and {self.count - len(self.messages)} more" if self.count > len(self.messages) else ""
            pytest.fail(f"{self.op.name}: {self.count} of {total} samples failed\n  " + "\n  ".join(self.messages)
                        + more, pytrace=False)


def _samples(op, device, dtype, limit=None):
    torch.manual_seed(0)  # the same samples whichever worker runs the test, in whatever order
    samples = []
    for i, s in enumerate(op.sample_inputs(device, dtype, requires_grad=False)):
        if limit is not None and i >= limit:
            break
        samples.append(s)
    assert samples, f"{op.name} has no samples for {dtype}"
    return samples


# ---------------------------------------------------------------------------------------------------------
# comparing


def _leaves(x):
    if isinstance(x, (tuple, list)):
        return [leaf for v in x for leaf in _leaves(v)]
    if isinstance(x, dict):
        return [leaf for k in x for leaf in _leaves(x[k])]
    return [x]


def _tolerance(op, test_dtype, out_dtype):
    if not (out_dtype.is_floating_point or out_dtype.is_complex):
        return 0.0, 0.0
    override = op.tolerances(test_dtype)
    if override is not None:
        return override
    return DEFAULT_TOLERANCES.get(out_dtype, (1.3e-6, 1e-5))


def assert_matches(actual, expected, op, dtype, what="output"):
    got, want = _leaves(actual), _leaves(expected)
    assert len(got) == len(want), f"{what}: {len(got)} values where eager gives {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        where = f"{what} {i}" if len(want) > 1 else what
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor), f"{where}: got {type(g).__name__}, eager gives a tensor"
            rtol, atol = _tolerance(op, dtype, w.dtype)
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True,
                                       msg=lambda m, where=where: f"{where}: {m}")
        elif isinstance(w, float) and math.isnan(w):
            assert isinstance(g, float) and math.isnan(g), f"{where}: got {g!r}, eager gives nan"
        else:
            assert g == w, f"{where}: got {g!r}, eager gives {w!r}"


def _check_all_traces(jfn):
    """check_trace on every trace of the last compilation (the pipeline already checked its own steps when the
    conftest turned the check_traces option on; the computation trace is checked here in any case)."""
    from fulmen.core.options import JitOptions

    traces = fulmen.last_traces(jfn)
    for t in traces if not JitOptions().check_traces else traces[:1]:
        check_trace(t)


def _flat_inputs(jfn, args, kwargs):
    flat: list[torch.Tensor] = []
    args_key(args, kwargs, flat)
    entry = jfn._cache.get(jfn._last_key)
    if entry is not None and entry.spec.captured:
        flat += list(entry.spec.captured)
    return flat


# ---------------------------------------------------------------------------------------------------------
# (a) fulmen.jit vs eager torch


def _consistency(op, dtype, device):
    if op.torch_reference is None:
        pytest.skip(f"{op.name} has no torch reference")
    samples = _samples(op, device, dtype)
    failures = _Failures(op)
    for i, sample in enumerate(samples):
        def check(sample=sample):
            jfn = fulmen.jit(op.op)
            expected, e_args, e_kwargs = _call(op.torch_reference, op, sample)
            actual, a_args, a_kwargs = _call(jfn, op, sample)
            assert_matches(actual, expected, op, dtype)
            # in-place ops: the caller's tensors must end as in eager
            assert_matches((a_args, a_kwargs), (e_args, e_kwargs), op, dtype, "input after the call")
            _check_all_traces(jfn)

        failures.run(i, sample, check)
    failures.raise_if_any(len(samples))


@pytest.mark.parametrize("op, dtype", _params("test_core_vs_torch_consistency"))
def test_core_vs_torch_consistency(op, dtype):
    _consistency(op, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("op, dtype", _params("test_core_vs_torch_consistency", devicetype="cuda"))
def test_core_vs_torch_consistency_cuda(op, dtype):
    _consistency(op, dtype, "cuda")


# ---------------------------------------------------------------------------------------------------------
# (b) the decomposition (prims only) vs eager torch


@pytest.mark.parametrize("op, dtype", _params("test_decomposed_vs_torch"))
def test_decomposed_vs_torch(op, dtype):
    if op.torch_reference is None:
        pytest.skip(f"{op.name} has no torch reference")
    samples = _samples(op, "cpu", dtype)
    failures = _Failures(op)
    for i, sample in enumerate(samples):
        def check(sample=sample):
            expected, e_args, e_kwargs = _call(op.torch_reference, op, sample)
            actual, a_args, a_kwargs = _call(lambda *a, **k: run_decomposed(op.op, *a, **k), op, sample)
            assert_matches(actual, expected, op, dtype, "decomposed output")
            assert_matches((a_args, a_kwargs), (e_args, e_kwargs), op, dtype, "input after the decomposed call")

        failures.run(i, sample, check)
    failures.raise_if_any(len(samples))


# ---------------------------------------------------------------------------------------------------------
# (c) metadata: every output proxy against the real tensor it stands for


def _substitute(x, env):
    if isinstance(x, Proxy):
        if x.name not in env:
            raise AssertionError(f"{x.name} is read before any bound symbol produced it")
        return env[x.name]
    if isinstance(x, torch.SymInt):  # a data-dependent size: its value in the real results bound so far
        from fulmen.core.symbolic import expr_of

        return int(expr_of(x).subs(env.get(_SYMBOLS, {})))
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_substitute(v, env) for v in x)
    if isinstance(x, list):
        return [_substitute(v, env) for v in x]
    if isinstance(x, dict):
        return {k: _substitute(v, env) for k, v in x.items()}
    return x


def _concrete_shape(shape, real_shape, symbols: dict | None = None) -> tuple:
    """The traced shape with each data-dependent size (``u0``: nonzero, boolean masks) replaced by the value the
    same symbol takes in the real result; a size that is an expression of them is evaluated with those values."""
    from fulmen.core.symbolic import expr_of
    from fulmen.core.unbacked import has_unbacked

    if not has_unbacked(shape):
        return tuple(shape)
    values = dict(symbols or {})
    for d, r in zip(shape, real_shape):
        if has_unbacked(d) and expr_of(d).is_Symbol:
            values.setdefault(expr_of(d), r)
    return tuple(int(expr_of(d).subs(values)) if has_unbacked(d) else d for d in shape)


def _compare_meta(proxy_struct, real, where: str, symbols: dict | None = None):
    if isinstance(proxy_struct, TensorProxy):
        assert isinstance(real, torch.Tensor), f"{where}: {proxy_struct.name} stands for a tensor, got " \
                                               f"{type(real).__name__}"
        want = (tuple(real.shape), real.dtype, str(real.device))
        got = (_concrete_shape(proxy_struct.shape, real.shape, symbols), proxy_struct.dtype, str(proxy_struct.device))
        assert got == want, f"{where}: {proxy_struct.name} is {proxy_struct.type_string()} in the trace but the " \
                            f"real value is {real.device} {real.dtype}{list(real.shape)}"
    elif isinstance(proxy_struct, (tuple, list)):
        assert isinstance(real, (tuple, list)) and len(real) == len(proxy_struct), \
            f"{where}: the trace has {len(proxy_struct)} outputs, the real call returned {_describe(real)}"
        for p, r in zip(proxy_struct, real):
            _compare_meta(p, r, where, symbols)


_SYMBOLS = "<symbols>"  # the env's key for the values of the data-dependent sizes (u0) met so far


def _bind(proxy_struct, real, env):
    if isinstance(proxy_struct, Proxy):
        env[proxy_struct.name] = real
        if isinstance(proxy_struct, TensorProxy) and isinstance(real, torch.Tensor):
            from fulmen.core.symbolic import bare_symbol

            for d, r in zip(proxy_struct.shape, real.shape):
                if bare_symbol(d) is not None:
                    env.setdefault(_SYMBOLS, {})[bare_symbol(d)] = r
    elif isinstance(proxy_struct, (tuple, list)) and isinstance(real, (tuple, list)):
        for p, r in zip(proxy_struct, real):
            _bind(p, r, env)


def _torch_impl(bsym):
    if torch_executor.can_execute(bsym):
        return torch_executor.execution_symbol(bsym).impl
    return None


def interpret_and_check_meta(bound_symbols, env, path=""):
    """Run each bound symbol on real tensors (its subsymbols too, separately) and compare metadata."""
    for bsym in bound_symbols:
        if is_bookkeeping(bsym):
            continue
        where = f"{path}{bsym.python_lines(with_subsymbols=False)[0]}"
        args, kwargs = _substitute(bsym.args, env), _substitute(bsym.kwargs, env)
        sub_env = None
        if bsym.subsymbols:
            sub_env = dict(env)
            interpret_and_check_meta(bsym.subsymbols, sub_env, path=f"{where}\n  in decomposition: ")
        impl = _torch_impl(bsym)
        if impl is not None:
            try:
                real = impl(*args, **kwargs)
            except Exception as e:
                # the torch executor would run this line exactly so (e.g. after an executor decomposed its parent)
                raise AssertionError(f"the torch executor's implementation rejects the recorded call {where}: "
                                     f"{type(e).__name__}: {e}") from e
        elif sub_env is not None:
            real = _substitute(bsym.output, sub_env)
        else:
            raise AssertionError(f"no torch implementation for {where}")
        _bind(bsym.output, real, env)
        _compare_meta(bsym.output, real, where, env.get(_SYMBOLS))


def _strides_agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() <= 1:
        return True
    return all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def _meta(op, dtype, device):
    samples = _samples(op, device, dtype, limit=None if dtype is torch.float32 else MAX_META_SAMPLES_OTHER_DTYPES)
    failures = _Failures(op)
    for i, sample in enumerate(samples):
        def check(sample=sample):
            jfn = fulmen.jit(op.op)
            actual, _, _ = _call(jfn, op, sample)
            trace = fulmen.last_traces(jfn)[0]
            _compare_meta(trace.output, actual, "the computation trace's output")
            args, kwargs = _clone(sample.args), _clone(sample.kwargs)
            flat = _flat_inputs(jfn, args, kwargs)
            assert len(flat) == len(trace.args), f"{len(flat)} tensor inputs for {len(trace.args)} trace inputs"
            env = {p.name: t for p, t in zip(trace.args, flat)}
            if op.is_random:
                torch.manual_seed(20240607)
            interpret_and_check_meta(trace.bound_symbols, env)
            if op.check_strides and op.torch_reference is not None:
                expected, _, _ = _call(op.torch_reference, op, sample)
                for k, (g, w) in enumerate(zip(_leaves(actual), _leaves(expected))):
                    if isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor):
                        assert _strides_agree(g, w), f"output {k} has strides {g.stride()}, eager gives {w.stride()}"

        failures.run(i, sample, check)
    failures.raise_if_any(len(samples))


@pytest.mark.parametrize("op, dtype", _params("test_meta"))
def test_meta(op, dtype):
    _meta(op, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("op, dtype", _params("test_meta", devicetype="cuda"))
def test_meta_cuda(op, dtype):
    _meta(op, dtype, "cuda")


# ---------------------------------------------------------------------------------------------------------
# (d) error inputs

# exceptions that say "fulmen cannot trace this", which eager torch has no reason to raise
_FULMEN_ONLY_ERRORS = (NotImplementedError, DataDependentError)


@pytest.mark.parametrize("op", _op_params("test_errors"))
def test_errors(op):
    cases = list(op.error_inputs("cpu"))
    assert cases, f"{op.name}'s error generator yields nothing"
    failures = _Failures(op)
    for i, (sample, exc_type, regex) in enumerate(cases):
        def check(sample=sample, exc_type=exc_type, regex=regex):
            jfn = fulmen.jit(op.op)
            try:
                with pytest.raises(exc_type, match=regex):
                    _call(jfn, op, sample)
            except Exception as e:  # a different exception type: say what was expected
                raise AssertionError(f"expected {exc_type.__name__} matching {regex!r}, got "
                                     f"{type(e).__name__}: {e}") from e
            if op.torch_reference is not None and not issubclass(exc_type, _FULMEN_ONLY_ERRORS):
                with pytest.raises(exc_type):  # the database entry itself: eager torch rejects it the same way
                    _call(op.torch_reference, op, sample)

        failures.run(i, sample, check)
    failures.raise_if_any(len(cases))


# ---------------------------------------------------------------------------------------------------------
# (e) print -> exec round trip


@pytest.mark.parametrize("op, dtype", _params("test_print_exec_roundtrip", first_dtype_only=True))
def test_print_exec_roundtrip(op, dtype):
    samples = _samples(op, "cpu", dtype, limit=MAX_ROUNDTRIP_SAMPLES)
    failures = _Failures(op)
    for i, sample in enumerate(samples):
        def check(sample=sample):
            jfn = fulmen.jit(op.op)
            expected, _, _ = _call(jfn, op, sample)
            traces = fulmen.last_traces(jfn)
            for k, t in enumerate(traces):
                compile(str(t), f"<trace {k} of {op.name}>", "exec")  # every printed trace is Python
            final = traces[-1]
            _, ctx = python_source(final)
            namespace = dict(ctx)
            exec(compile(str(final), f"<printed execution trace of {op.name}>", "exec"), namespace)
            args, kwargs = _clone(sample.args), _clone(sample.kwargs)
            flat = _flat_inputs(jfn, args, kwargs)
            if op.is_random:
                torch.manual_seed(20240607)
            with torch.no_grad():
                actual = namespace[final.fn_name](*flat)
            assert_matches(actual, expected, op, dtype, "printed-and-exec'd trace output")

        failures.run(i, sample, check)
    failures.raise_if_any(len(samples))


# ---------------------------------------------------------------------------------------------------------
# the database itself


def test_opinfo_database_imports():
    assert IMPORT_ERROR is None, f"fulmen.tests.opinfos failed to import:\n{IMPORT_ERROR}"


def test_opinfo_names_are_unique():
    seen: dict[str, int] = {}
    for op in OPINFOS:
        seen[op.name] = seen.get(op.name, 0) + 1
    assert not [n for n, c in seen.items() if c > 1], f"duplicate OpInfo names: {[n for n, c in seen.items() if c > 1]}"


def test_every_elementwise_symbol_has_an_opinfo():
    import fulmen.torch.elementwise as ew
    from fulmen.core.symbol import Symbol

    covered = {id(op.op) for op in OPINFOS}
    missing = sorted(name for name, v in vars(ew).items()
                     if isinstance(v, Symbol) and v.module == "ltorch" and id(v) not in covered
                     and getattr(v.meta, "__module__", None) == ew.__name__)
    assert not missing, f"elementwise symbols without an OpInfo: {missing}"


def test_add_opinfo_first_sample_matches_seed():
    from fulmen.tests.opinfos import add_opinfo

    sample = next(add_opinfo.sample_input_generator(add_opinfo, device="cpu", dtype=torch.float32,
                                                    requires_grad=False))
    assert len(sample.args) == 2 and not sample.kwargs
    for t in sample.args:
        assert isinstance(t, torch.Tensor) and t.shape == (4, 4) and t.dtype is torch.float32
    assert "SampleInput args=" in repr(sample)
