"""Cache keys never reuse a compilation traced for other values (fulmen/frontend/cache.py), the cache is bounded
and stops recompiling for an argument that changes on every call (fulmen/frontend/jit.py), and the printed prologue
is the check that runs (fulmen/frontend/prologue.py)."""

import contextlib
import dataclasses
import gc
import linecache
import logging
import math
import sys
import tracemalloc

import numpy as np
import pytest
import torch

import fulmen
import fulmen.frontend.jit


def _jit(fn, **kw):
    return fulmen.jit(fn, executors=["torch"], **kw)


@dataclasses.dataclass
class Cfg:
    scale: float


@dataclasses.dataclass(frozen=True)
class FrozenCfg:
    scale: float


class Plain:
    def __init__(self, scale):
        self.scale = scale


class Slotted:
    __slots__ = ("scale",)

    def __init__(self, scale):
        self.scale = scale


def test_new_unhashable_objects_are_keyed_by_value_not_address():
    # each Cfg is freed after its call, so the next one may get its address: an identity key would hit stale
    jf = _jit(lambda x, c: x * c.scale)
    x = torch.ones(())
    # floats: keyed by value (an int member that changes becomes symbolic: tests/test_symbolic_ints.py)
    assert [jf(x, Cfg(float(v))).item() for v in range(1, 6)] == [1.0, 2.0, 3.0, 4.0, 5.0]
    jf(x, Cfg(1.0))
    assert fulmen.cache_misses(jf) == 5  # equal contents: the same entry


@pytest.mark.parametrize("make", [Plain, Slotted, Cfg], ids=["plain", "slots", "dataclass"])
def test_an_object_changed_in_place_recompiles(make):
    jf = _jit(lambda x, c: x * c.scale)
    x, c = torch.ones(3), make(2.0)
    torch.testing.assert_close(jf(x, c), x * 2.0)
    c.scale = 3.0
    torch.testing.assert_close(jf(x, c), x * 3.0)
    c.scale = 2.0
    torch.testing.assert_close(jf(x, c), x * 2.0)
    assert fulmen.cache_misses(jf) == 2


def test_an_object_holding_a_new_tensor_recompiles():
    # a tensor read through an object is a captured input, read by identity: another tensor is another program
    jf = _jit(lambda x, c: x + c.scale)
    x, c = torch.ones(3), Plain(torch.full((3,), 2.0))
    torch.testing.assert_close(jf(x, c), x + 2.0)
    c.scale = torch.full((3,), 5.0)
    torch.testing.assert_close(jf(x, c), x + 5.0)


def test_an_object_too_large_to_snapshot_is_held_by_identity_and_never_hits_stale(caplog):
    jf, x = _jit(lambda x, c: x * c.scale), torch.ones(())
    with caplog.at_level(logging.WARNING, logger="fulmen"):
        results = []
        for v in range(1, 6):  # each freed after its call: an address key alone would hit stale
            big = Plain(float(v))
            big.table = list(range(5000))
            results.append(jf(x, big).item())
    assert results == [1.0, 2.0, 3.0, 4.0, 5.0]
    warnings = [r.getMessage() for r in caplog.records if "keyed by identity" in r.getMessage()]
    assert len(warnings) == 1 and "Plain" in warnings[0]


@pytest.mark.parametrize("make", [lambda v: {v, v + 1}, lambda v: frozenset({float(v)}), lambda v: bytearray([v])],
                         ids=["set", "frozenset", "bytearray"])
def test_containers_are_keyed_by_contents(make):
    def f(x, s):
        for v in s:
            x = x * float(v)
        return x

    jf, x = _jit(f), torch.ones(2)
    for v in (1, 2, 3, 1):  # a new object each call, freed after it (its address may be reused)
        torch.testing.assert_close(jf(x, make(v)), f(x, make(v)))


def test_a_bytearray_changed_in_place_recompiles():
    f = lambda x, b: x * b[0]  # noqa: E731
    jf, x, b = _jit(f), torch.ones(2), bytearray(b"\x02")
    torch.testing.assert_close(jf(x, b), x * 2)
    b[0] = 7
    torch.testing.assert_close(jf(x, b), x * 7)


def test_numpy_arrays_are_keyed_by_contents():
    f = lambda x, a: x * float(a.sum())  # noqa: E731
    jf, x = _jit(f), torch.ones(2)
    a = np.array([1.0, 2.0])
    torch.testing.assert_close(jf(x, a), f(x, a))
    a[0] = 5.0  # in place: the same object, other contents
    torch.testing.assert_close(jf(x, a), f(x, a))
    b = np.array([1.0, 2.0], dtype=np.float32)  # same values, another dtype
    torch.testing.assert_close(jf(x, b), f(x, b))
    assert fulmen.cache_misses(jf) == 3


@pytest.mark.parametrize("wrap", [lambda s: s, lambda s: (s,), lambda s: [s], lambda s: {"s": s}, FrozenCfg,
                                  lambda s: np.float64(s)],
                         ids=["float", "tuple", "list", "dict", "frozen-dataclass", "numpy-float64"])
def test_minus_zero_and_zero_are_different_keys(wrap):
    def f(x, s):
        s = s.scale if isinstance(s, FrozenCfg) else s["s"] if isinstance(s, dict) else \
            s[0] if isinstance(s, (tuple, list)) else s
        return x / s

    jf, x = _jit(f), torch.ones(2)
    assert torch.equal(jf(x, wrap(0.0)), f(x, wrap(0.0)))
    assert torch.equal(jf(x, wrap(-0.0)), f(x, wrap(-0.0)))  # -inf, not the +inf of 0.0's program
    assert torch.equal(jf(x, wrap(-0.0)), torch.full((2,), -math.inf))


@pytest.mark.parametrize("wrap", [lambda s: s, lambda s: (s,), lambda s: {"s": s}, Cfg],
                         ids=["float", "tuple", "dict", "dataclass"])
def test_nan_hits_the_cache(wrap):
    jf, x = _jit(lambda x, s: x + 1), torch.ones(2)
    for _ in range(4):
        jf(x, wrap(float("nan")))  # a new NaN object each call
    assert fulmen.cache_misses(jf) == 1


# ---- the recompile limit and the cache bound ----

def test_a_float_that_changes_every_call_stops_recompiling_and_memory_stays_flat(caplog):
    def scaled(x, scale):
        return x * scale

    jf, x = _jit(scaled), torch.ones(3)
    with caplog.at_level(logging.WARNING, logger="fulmen"):
        for i in range(1, 1001):
            torch.testing.assert_close(jf(x, float(i)), x * float(i))
        gc.collect()
        tracemalloc.start()
        objects = len(gc.get_objects())
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1001, 10001):
            jf(x, float(i))
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        more_objects = len(gc.get_objects()) - objects
    assert fulmen.cache_misses(jf) == 1 + fulmen.frontend.jit.RECOMPILE_LIMIT
    assert len(jf._cache) == 1 + fulmen.frontend.jit.RECOMPILE_LIMIT
    assert grown < 64 * 1024, f"{grown} bytes more after 9,000 calls"
    assert more_objects < 100, f"{more_objects} more objects after 9,000 calls"
    warnings = [r.getMessage() for r in caplog.records if r.name == "fulmen" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "'scale' (argument 1)" in warnings[0] and "eagerly" in warnings[0] and "tensor" in warnings[0]
    torch.testing.assert_close(jf(x, 2.0), x * 2.0)  # a value compiled before still hits
    assert fulmen.cache_misses(jf) == 1 + fulmen.frontend.jit.RECOMPILE_LIMIT


def test_a_keyword_that_changes_every_call_is_named(caplog):
    jf, x = _jit(lambda x, *, gain: x * gain), torch.ones(2)
    with caplog.at_level(logging.WARNING, logger="fulmen"):
        for i in range(20):
            torch.testing.assert_close(jf(x, gain=float(i)), x * float(i))
    warnings = [r.getMessage() for r in caplog.records if r.name == "fulmen" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'gain'" in warnings[0]


def test_changing_shapes_keep_compiling_within_the_bound(monkeypatch):
    monkeypatch.setattr(fulmen.frontend.jit, "MAX_CACHE_ENTRIES", 4)
    jf = _jit(lambda x: x * 2, dynamic=False)
    for n in [*range(1, 11), 1, 2]:  # 1 and 2 were dropped: compiled again
        x = torch.ones(n)
        torch.testing.assert_close(jf(x), x * 2)
        assert len(jf._cache) <= 4
    assert fulmen.cache_misses(jf) == 12


def test_new_ranks_keep_the_size_histories_within_the_bound(monkeypatch):
    monkeypatch.setattr(fulmen.frontend.jit, "MAX_CACHE_ENTRIES", 4)
    jf = _jit(lambda x: x * 2)
    for rank in range(1, 11):
        x = torch.ones((2,) * rank)
        torch.testing.assert_close(jf(x), x * 2)
    assert len(jf._cache) <= 4 and len(jf._histories) <= 4


def test_the_cache_drops_the_least_recently_used_program(monkeypatch):
    monkeypatch.setattr(fulmen.frontend.jit, "MAX_CACHE_ENTRIES", 3)
    jf = _jit(lambda x: x * 2, dynamic=False)
    for n in (1, 2, 3, 1, 4):  # 1 was used again after 2 and 3: 2 is dropped for 4
        jf(torch.ones(n))
    assert fulmen.cache_misses(jf) == 4
    jf(torch.ones(1))
    jf(torch.ones(3))
    assert fulmen.cache_misses(jf) == 4
    jf(torch.ones(2))
    assert fulmen.cache_misses(jf) == 5


# ---- the printed prologue is the check that runs ----

SCALE = 2.0


def _program(x, n, s, pair, *rest, mode="a"):
    y = x * n + s * SCALE + pair[0] * pair[1]
    return y if mode == "a" else -y


def _calling(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, and the code objects of the prologues that ran during it."""
    ran = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith("<fulmen prologue"):
            ran.append(frame.f_code)

    sys.setprofile(profile)
    try:
        out = fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return out, ran


def _assert_runs_what_it_prints(jf, *args, **kwargs):
    jf(*args, **kwargs)
    printed = str(fulmen.last_prologue_traces(jf)[0])
    out, ran = _calling(jf, *args, **kwargs)  # a hit
    assert [c.co_name for c in ran][:1] == ["prologue"] and len({c.co_filename for c in ran}) == 1
    assert "".join(linecache.getlines(ran[0].co_filename)) == printed  # the text of the functions that ran
    assert ("check_globals" in [c.co_name for c in ran]) == ("def check_globals():" in printed)
    return out, printed


def test_the_printed_prologue_is_the_source_of_the_check_that_ran():
    x, y = torch.randn(2, 3), torch.randn(3)
    jf = _jit(_program)
    out, printed = _assert_runs_what_it_prints(jf, x, 3, 0.5, (y, 2), mode="b")
    torch.testing.assert_close(out, _program(x, 3, 0.5, (y, 2), mode="b"))
    for expected in ("x: cpu float32[2, 3]", "n: 3", "s: 0.5", "pair: a tuple of 2", "pair_1: 2", "'mode'",
                     "global state", "def check_globals():", "if not (check_globals()):", "the global SCALE"):
        assert expected in printed, expected

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh())
    out, printed = _assert_runs_what_it_prints(_jit(model), x)
    torch.testing.assert_close(out, model(x))
    assert "version == " in printed and "cpu float32[4, 3], requires_grad" in printed

    jd = _jit(lambda a, b: a @ b, dynamic=True)
    a, b = torch.randn(3, 5), torch.randn(5, 2)
    out, printed = _assert_runs_what_it_prints(jd, a, b)
    torch.testing.assert_close(out, a @ b)
    assert "a: cpu float32[?, ?]" in printed and "the guards on the dynamic sizes" in printed


def _failing_check(check, inputs) -> str:
    """The line of the prologue ``check`` that rejects ``inputs``."""
    lines = []

    def tracer(frame, event, arg):
        if frame.f_code is not check.__code__:
            return None
        if event == "line":
            lines.append(frame.f_lineno)
        return tracer

    sys.settrace(tracer)
    try:
        assert check(*inputs) is None
    finally:
        sys.settrace(None)
    text = [linecache.getline(check.__code__.co_filename, n).strip() for n in lines]
    checks = [t for t in text if t.startswith("if not (")]
    return checks[-1]


def _violations(x, y):
    """Calls of _program, each breaking one fact its prologue checks (the first call is the one compiled)."""
    base = dict(args=(x, 3, 0.5, (y, 2)), kwargs=dict(mode="a"))

    def changed(*args, **kwargs):
        return dict(args=args, kwargs=kwargs)

    yield "compiled", base, contextlib.nullcontext()
    yield "one more argument", changed(x, 3, 0.5, (y, 2), 7, mode="a"), contextlib.nullcontext()
    yield "shape", changed(torch.randn(1, 3), 3, 0.5, (y, 2), mode="a"), contextlib.nullcontext()
    yield "dtype", changed(x.double(), 3, 0.5, (y, 2), mode="a"), contextlib.nullcontext()
    yield "requires_grad", changed(x.detach().requires_grad_(), 3, 0.5, (y, 2), mode="a"), contextlib.nullcontext()
    yield "lazy negative view", changed(torch._neg_view(-x), 3, 0.5, (y, 2), mode="a"), contextlib.nullcontext()
    with torch.inference_mode():
        inference = x.clone()
    yield "inference tensor", changed(inference, 3, 0.5, (y, 2), mode="a"), contextlib.nullcontext()
    yield "a float for an int", changed(x, 3.0, 0.5, (y, 2), mode="a"), contextlib.nullcontext()
    yield "another float", changed(x, 3, 0.25, (y, 2), mode="a"), contextlib.nullcontext()
    yield "a list for a tuple", changed(x, 3, 0.5, [y, 2], mode="a"), contextlib.nullcontext()
    yield "inner tensor", changed(x, 3, 0.5, (y[:1], 2), mode="a"), contextlib.nullcontext()
    yield "one tensor twice", changed(x, 3, 0.5, (x, 2), mode="a"), contextlib.nullcontext()
    yield "inner int", changed(x, 3, 0.5, (y, 5), mode="a"), contextlib.nullcontext()
    yield "no keyword", changed(x, 3, 0.5, (y, 2)), contextlib.nullcontext()
    yield "keyword value", changed(x, 3, 0.5, (y, 2), mode="b"), contextlib.nullcontext()
    yield "grad mode", base, torch.no_grad()
    yield "default dtype", base, _default_dtype(torch.float64)
    yield "autocast", base, torch.autocast("cpu", dtype=torch.bfloat16)
    yield "global", base, _global_scale(3.0)


@contextlib.contextmanager
def _default_dtype(dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def _global_scale(value):
    global SCALE
    previous, SCALE = SCALE, value
    try:
        yield
    finally:
        SCALE = previous


def test_a_call_that_breaks_any_printed_check_recompiles_and_matches_eager():
    x, y = torch.randn(2, 3), torch.randn(2, 3)  # one shape: passing x for y breaks only the identity check
    jf = _jit(_program, dynamic=False)
    failed = set()
    check = None
    for what, call, context in _violations(x, y):
        misses = fulmen.cache_misses(jf)
        with context:
            if check is not None:
                failed.add(_failing_check(check, (call["args"], call["kwargs"])))
            out = jf(*call["args"], **call["kwargs"])
            torch.testing.assert_close(out, _program(*call["args"], **call["kwargs"]), msg=what)
        if check is None:
            printed, check = str(fulmen.last_prologue_traces(jf)[0]), jf._last_entry.check
        else:
            assert fulmen.cache_misses(jf) == misses + 1, what
    checks = {line.strip() for line in printed.splitlines() if line.strip().startswith("if not (")}
    assert failed == checks, f"checks no call broke: {checks - failed}"


def test_a_size_that_breaks_the_printed_size_guard_recompiles():
    def f(a):
        return a[:4] * 2 if a.shape[0] > 4 else a * 3

    jf = _jit(f, dynamic=True)
    a = torch.randn(6, 2)
    torch.testing.assert_close(jf(a), f(a))
    check, printed = jf._last_entry.check, str(fulmen.last_prologue_traces(jf)[0])
    assert "the guards on the dynamic sizes" in printed
    b = torch.randn(3, 2)
    assert "s" in _failing_check(check, ((b,), {}))  # the size guard, not the tensor's metadata
    torch.testing.assert_close(jf(b), f(b))
    assert fulmen.cache_misses(jf) == 2


def test_a_module_call_that_breaks_its_printed_checks_recompiles():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5))
    jm, x = _jit(model), torch.randn(2, 3)
    with torch.no_grad():
        model.eval()
        torch.testing.assert_close(jm(x), model(x))
        check, printed = jm._fulmen_jitted._last_entry.check, str(fulmen.last_prologue_traces(jm)[0])
        state = jm._fulmen_jitted.state
        assert "0_weight: cpu float32[4, 3], requires_grad" in printed
        model[0].weight.requires_grad_(False)  # the parameter's check
        assert "0_weight" in _failing_check(check, (state.version, state.tensors(), (x,), {}))
        torch.testing.assert_close(jm(x), model(x))
        model.train()  # the structure's version: dropout is on
        out = jm(x)
        assert fulmen.cache_misses(jm) == 3
        assert "version ==" in _failing_check(check, (state.version, state.tensors(), (x,), {}))
        dense = model[0](x)
        torch.testing.assert_close(torch.where(out == 0, 0.0, 2 * dense), out)


def _calls():
    x = torch.randn(2, 3)
    values = [1, 2, True, 1.0, 0.0, -0.0, float("nan"), -float("nan"), "a", None, x, x.double(), torch.randn(3, 2),
              x.detach().requires_grad_(), torch._neg_view(x), torch.randn(2, dtype=torch.complex64).conj(),
              (x, 1), (x, 1.0), [x, 1], (x, (1, 2)), {"a": x}, {"b": x}, {"a": x, "b": 1}, Cfg(1.0), Cfg(-0.0),
              FrozenCfg(0.0), Plain(2.0), {1, 2}, frozenset({3}), bytearray(b"a"), np.array([1.0]),
              np.array([1.0], dtype=np.float32), torch.float32, torch.device("cpu"), slice(1, 2), math.inf,
              # non-contiguous, keyed by strides: transposed, sliced, expanded (same shapes as the ones above)
              torch.randn(2, 3).t(), torch.randn(3, 4)[:, ::2], torch.randn(3).expand(2, 3)]
    calls = []
    for v in values:
        calls += [((x, v), {}), ((x,), {"k": v}), ((x, v, v), {})]
    return calls + [((), {}), ((x,), {"k": 1, "j": 2}), ((x,), {"j": 2, "k": 1})]


def test_a_prologue_accepts_exactly_the_calls_whose_key_is_its_key():
    # the dictionary lookup by key is a fast first step only while it agrees with the prologue that runs
    from fulmen.frontend.cache import args_key, global_state_key
    from fulmen.frontend.prologue import build_prologue

    calls = _calls()
    keyed = []
    for args, kwargs in calls:
        flat = []
        keyed.append(((args_key(args, kwargs, flat), global_state_key()), flat))
    for (args, kwargs), (key, flat) in zip(calls, keyed):
        check = build_prologue(key, [f"a{i}" for i in range(len(args))]).check
        for (other_args, other_kwargs), (other_key, other_flat) in zip(calls, keyed):
            accepted = check(other_args, other_kwargs)
            assert (accepted is not None) == (other_key == key), (args, kwargs, other_args, other_kwargs)
            if accepted is not None:
                assert len(accepted) == len(other_flat) and all(a is b for a, b in zip(accepted, other_flat))


def test_a_call_under_another_default_device_recompiles():
    # factory calls without device= make tensors on the default device: a program traced without a device
    # context must not be reused inside `with torch.device("meta")`, where eager makes meta tensors
    def f(x):
        return x * 2, torch.ones(3)

    jf, x = fulmen.jit(f, executors=["torch"]), torch.randn(3)
    assert jf(x)[1].device.type == "cpu"
    with torch.device("meta"):
        assert f(x)[1].device.type == "meta"
        assert jf(x)[1].device.type == "meta"
    assert jf(x)[1].device.type == "cpu"
    assert fulmen.cache_misses(jf) == 2


def test_a_module_argument_whose_parameter_or_submodule_is_replaced_recompiles():
    # traced code reaches a passed-in module's parameters and submodules through nn.Module.__getattr__ and reads
    # them by identity: the key holds which ones the module has now
    def f(x, m):
        return m(x)

    jf, x = fulmen.jit(f, executors=["torch"]), torch.ones(1, 2)
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    torch.testing.assert_close(jf(x, m), f(x, m))
    m[0].weight = torch.nn.Parameter(torch.zeros(2, 2))
    torch.testing.assert_close(jf(x, m), f(x, m))
    with torch.no_grad():
        m[0].bias.fill_(-5.0)  # values change in place: the same program reads them
    torch.testing.assert_close(jf(x, m), f(x, m))
    m[1] = torch.nn.Sigmoid()
    torch.testing.assert_close(jf(x, m), f(x, m))
    m[0].bias = None
    torch.testing.assert_close(jf(x, m), f(x, m))
    assert fulmen.cache_misses(jf) == 4
    jf(x, m)
    assert fulmen.cache_misses(jf) == 4
