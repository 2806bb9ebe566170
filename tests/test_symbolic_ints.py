"""Ints of the arguments that change between calls are traced as symbolic ints (fulmen.frontend.dynamic): one more
compilation serves every value the traced code's guards accept, and every call matches eager."""

import logging
import math
import numbers
import operator

import pytest
import torch

import fulmen


def _jit(fn, **options):
    return fulmen.jit(fn, executors=["torch"], **options)


def _grows(x, n):
    return x[:n] * n + x[-n:].sum() + torch.zeros(n, dtype=x.dtype)


def test_an_int_argument_that_grows_every_call_compiles_twice_and_matches_eager():
    jf, x = _jit(_grows), torch.randn(12)
    for n in range(2, 10):
        torch.testing.assert_close(jf(x, n), _grows(x, n), rtol=0, atol=0)
    assert fulmen.cache_misses(jf) == 2
    assert fulmen.compile_stats(jf).recompile_reasons[0] == "int n changed 2 -> 3: marked dynamic"
    # the program reads the int from its input: no value of it is baked in
    assert "n.shape[0]" in str(fulmen.last_traces(jf)[-1])


def test_a_keyword_int_and_ints_in_containers_become_symbolic():
    def fn(x, sizes, *, offset):
        return x[offset : offset + sizes[0]] * sizes[1]

    jf, x = _jit(fn), torch.randn(20)
    for i in range(2, 7):
        torch.testing.assert_close(jf(x, [i, i + 1], offset=i), fn(x, [i, i + 1], offset=i), rtol=0, atol=0)
    assert fulmen.cache_misses(jf) == 2


def test_an_int_in_python_control_flow_is_guarded_and_a_failed_guard_recompiles(caplog):
    def fn(x, n):
        if n > 4:  # a guard on n, never the value traced baked in
            return x * 2
        return x * 3

    jf, x = _jit(fn), torch.randn(3)
    with caplog.at_level(logging.INFO, logger="fulmen"):
        for n in (2, 3, 4, 5, 6, 3):
            torch.testing.assert_close(jf(x, n), fn(x, n), rtol=0, atol=0)
    # 2: exact; 3: symbolic with n <= 4 (serves 4 and 3); 5: that guard fails, symbolic with n > 4 (serves 6)
    assert fulmen.cache_misses(jf) == 3
    reasons = fulmen.compile_stats(jf).recompile_reasons
    assert "guards of the entry compiled with dynamic sizes failed" in reasons[-1], reasons
    assert any("recompiling" in r.getMessage() and "guards" in r.getMessage() for r in caplog.records)


def test_a_range_over_an_int_specializes_it_and_each_value_still_matches_eager():
    def fn(x, n):
        out = x
        for i in range(n):  # range() needs the value: a guard that n equals it
            out = out + i
        return out

    jf, x = _jit(fn), torch.randn(3)
    for n in (2, 3, 4, 3):
        torch.testing.assert_close(jf(x, n), fn(x, n), rtol=0, atol=0)
    assert fulmen.cache_misses(jf) == 3  # 3 hits the program compiled for it


def test_an_int_used_as_a_size_and_returned_is_the_calls_own_value():
    def fn(x, n):
        y = x.new_ones(n, 2) * x.sum()
        return y.reshape(-1), n * 2 + 1, y.shape[0]

    jf, x = _jit(fn), torch.randn(4)
    for n in (3, 5, 8):
        got, want = jf(x, n), fn(x, n)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        assert got[1:] == want[1:] and all(type(v) is int for v in got[1:])
    assert fulmen.cache_misses(jf) == 2


class _Window:
    """A counter kept beside a tensor, as a sliding-window cache keeps cumulative_length."""

    def __init__(self, keys: torch.Tensor, seen: int):
        self.keys = keys
        self.seen = seen


def _step(x, window):
    window.seen += x.shape[0]
    window.keys = torch.cat([window.keys, x])[-3:]
    return window.keys.sum() * window.seen


def test_an_int_the_program_writes_back_into_an_object_gets_each_calls_value():
    jf = _jit(_step)
    eager, compiled = _Window(torch.zeros(3), 2), _Window(torch.zeros(3), 2)
    for i in range(6):
        x = torch.full((1,), float(i))
        torch.testing.assert_close(jf(x, compiled), _step(x, eager), rtol=0, atol=0)
        assert type(compiled.seen) is int and compiled.seen == eager.seen
        torch.testing.assert_close(compiled.keys, eager.keys, rtol=0, atol=0)
    assert fulmen.cache_misses(jf) == 2
    assert eager.seen == 8


class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, n):
        return self.lin(x)[:n]


def test_a_modules_int_argument_becomes_symbolic():
    model = _Head()
    jm, x = _jit(model), torch.randn(6, 4)
    with torch.no_grad():
        for n in (2, 3, 4, 5):
            torch.testing.assert_close(jm(x, n), model(x, n), rtol=0, atol=0)
    assert fulmen.cache_misses(jm) == 2


def test_dynamic_false_keeps_ints_exact():
    jf, x = _jit(_grows, dynamic=False), torch.randn(12)
    for n in (2, 3, 4):
        torch.testing.assert_close(jf(x, n), _grows(x, n), rtol=0, atol=0)
    assert fulmen.cache_misses(jf) == 3


@pytest.mark.parametrize("values", [(2.0, 3.0, 4.0), (True, False, True)], ids=["floats", "bools"])
def test_floats_and_bools_keep_value_keys(values):
    jf, x = _jit(lambda x, v: x * v), torch.randn(3)
    for v in values:
        torch.testing.assert_close(jf(x, v), x * v, rtol=0, atol=0)
    assert fulmen.cache_misses(jf) == len(set(values))
    assert "n.shape" not in str(fulmen.last_traces(jf)[-1])


def test_ints_of_zero_and_one_specialize():
    jf, x = _jit(_grows), torch.randn(12)
    for n in (1, 2, 1):  # 2 after 1: symbolic; 1 again: the program compiled for it
        torch.testing.assert_close(jf(x, n), _grows(x, n), rtol=0, atol=0)
    assert fulmen.cache_misses(jf) == 2
    torch.testing.assert_close(jf(x, 5), _grows(x, 5), rtol=0, atol=0)
    assert fulmen.cache_misses(jf) == 2


def test_gradients_through_a_symbolic_int_match_eager_and_a_returned_int_is_the_calls_own():
    def fn(x, n):
        return (x[:n] * n).sin().sum() + x[-n:].pow(2).sum(), n + 1

    jf = _jit(fn)
    for n in (2, 3, 5):
        x = torch.randn(10, dtype=torch.float64, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        out, m = jf(x, n)
        want, m_ref = fn(x_ref, n)
        out.backward()
        want.backward()
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(x.grad, x_ref.grad)
        assert type(m) is int and m == m_ref
    assert fulmen.cache_misses(jf) == 2


_SEEN = []


def _remembers(x, n):
    _SEEN.append(n)  # a Python side effect: done while tracing only, as fulmen warns
    return x * n


class _Remembers(torch.nn.Module):
    def forward(self, x, n):
        self.last = n * 2  # a plain attribute: set while tracing only, as fulmen warns
        return x[:n]


@pytest.mark.parametrize("where", ["global", "module attribute"])
def test_a_symbolic_int_never_leaks_into_python_state_the_program_does_not_update(where):
    # a SymInt stands for each call's value only inside the program; where the code leaves one elsewhere, the
    # symbolic compilation gives up (logged) and ints stay exact: the state holds the ints tracing saw, as before
    _SEEN.clear()
    model = _Remembers()
    jf, x = (_jit(_remembers), torch.randn(3)) if where == "global" else (_jit(model), torch.randn(6))
    for n in (2, 3, 4):
        want = _remembers(x, n) if where == "global" else x[:n]
        torch.testing.assert_close(jf(x, n), want, rtol=0, atol=0)
    left = _SEEN if where == "global" else [model.last]
    assert left and all(type(v) is int for v in left), left


def test_an_int_dynamo_made_dynamic_is_symbolic_in_the_backends_first_compilation():
    import torch._dynamo

    from fulmen.frontend.dynamo import backend_stats, reset_backend_stats

    def fn(x, n):
        return x[:n] * n

    torch._dynamo.reset()
    reset_backend_stats()
    compiled = torch.compile(fn, backend="fulmen", options={"executors": ["torch"]})
    x = torch.randn(10)
    for n in range(3, 9):  # 3: Dynamo's static graph; 4: its graph with n a SymInt input, then reused
        torch.testing.assert_close(compiled(x, n), fn(x, n), rtol=0, atol=0)
    stats = backend_stats()
    assert stats.graphs == 2 and stats.per_graph == [1, 1] and stats.eager_graphs == 0, stats


def test_code_that_needs_a_plain_int_keeps_ints_exact_and_sizes_dynamic(caplog):
    def fn(x, n):
        return x + torch.tensor(n)  # torch.tensor takes Python numbers only: symbolic ints give up, logged

    jf = _jit(fn)
    with caplog.at_level(logging.WARNING, logger="fulmen"):
        for n in (2, 3, 4):
            torch.testing.assert_close(jf(torch.ones(5), n), fn(torch.ones(5), n), rtol=0, atol=0)
        for size in (6, 7, 8):  # sizes still become dynamic: one more compilation, then none
            torch.testing.assert_close(jf(torch.ones(size), 4), fn(torch.ones(size), 4), rtol=0, atol=0)
    assert fulmen.cache_misses(jf) == 4
    assert any("symbolic ints failed" in r.getMessage() for r in caplog.records)


# ---- Python that asks what an int is, or turns it into text, sees what eager sees ----
_TYPE_BRANCHES = {
    "isinstance": lambda x, n: x * 2 if isinstance(n, int) else x * 3,
    "type is": lambda x, n: x * 2 if type(n) is int else x * 3,
    "type ==": lambda x, n: x * 2 if type(n) == int else x * 3,  # noqa: E721 (the comparison under test)
    "in a returned value": lambda x, n: (x * n, type(n).__name__),
}

# (guards of the symbolic path: before ints became symbolic every value was compiled exactly, so these held there)
_CONVERSIONS = {
    "str": lambda x, n: (x * n, str(n)),
    "f-string": lambda x, n: (x + 1, f"window {n}"),
    "%d": lambda x, n: (x * 2, "%d" % n),
    "repr": lambda x, n: (x, repr(n)),
    "format spec": lambda x, n: (x, format(n, "03d")),
    "str of n / 2": lambda x, n: (x, str(n / 2)),
    "str of n > 3": lambda x, n: (x, str(n > 3)),
    "text picks a branch": lambda x, n: x * 2 if str(n) == "3" else x,
    "hash": lambda x, n: x * (hash(n) % 5),
    "in a set": lambda x, n: x * 2 if n in {2, 3} else x * 3,
    "dict key": lambda x, n: x * {2: 5.0, 3: 7.0, 4: 9.0, 5: 1.0}[n],
    "list index": lambda x, n: x * [1.0, 2.0, 3.0, 4.0, 5.0, 6.0][n],
    "list repeat": lambda x, n: x * len([0] * n),
    "math.sqrt": lambda x, n: x * math.sqrt(n),
    "math.floor": lambda x, n: x * math.floor(n / 2),
    "operator.index": lambda x, n: x[: operator.index(n)],
}


def _same(got, want):
    if isinstance(want, tuple):
        assert type(got) is tuple and len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:
        assert type(got) is type(want) and got == want, (got, want)


@pytest.mark.parametrize("name", list(_TYPE_BRANCHES))
def test_a_type_check_on_an_int_takes_eagers_branch_for_every_value(name, caplog):
    fn = _TYPE_BRANCHES[name]
    jf, x = _jit(fn), torch.randn(3)
    with caplog.at_level(logging.WARNING, logger="fulmen"):
        for n in (2, 3, 4, 5):
            _same(jf(x, n), fn(x, n))
    # the symbolic trace took another path than the exact one: the ints stay exact, and fulmen says why
    assert any("not an int" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("name", list(_CONVERSIONS))
def test_an_int_turned_into_text_a_key_or_an_index_matches_eager_for_every_value(name):
    fn = _CONVERSIONS[name]
    jf, x = _jit(fn), torch.randn(8)
    for n in (2, 3, 4, 5, 3):
        _same(jf(x, n), fn(x, n))


def test_text_of_an_int_specializes_it_and_the_rest_of_its_uses_stay_symbolic():
    def fn(x, n, m):
        return x[:m] * m, f"step {n}"

    jf, x = _jit(fn), torch.randn(10)
    for n, m in ((2, 2), (3, 3), (3, 4), (3, 5), (4, 6)):
        _same(jf(x, n, m), fn(x, n, m))
    # (2, 2): exact; (3, 3): symbolic with n == 3 (text needs it), serves m = 4, 5; (4, 6): n == 4
    assert fulmen.cache_misses(jf) == 3


def test_the_value_of_a_symbolic_int_that_never_becomes_text_is_not_guarded():
    jf, x = _jit(_grows), torch.randn(12)
    for n in (2, 3, 4):
        jf(x, n)
    assert fulmen.cache_misses(jf) == 2  # the check against the exact trace costs no compilation


@pytest.mark.parametrize("check", ["isinstance", "type is"])
def test_a_type_check_on_a_dynamic_size_takes_eagers_branch_for_every_size(check):
    def fn(x):
        n = x.shape[0]
        is_int = isinstance(n, int) if check == "isinstance" else type(n) is int
        return x.sum() if is_int else x.mean()

    jf = _jit(fn)
    for size in (3, 4, 5, 6):
        x = torch.randn(size)
        torch.testing.assert_close(jf(x), fn(x), rtol=0, atol=0)


def test_text_of_a_data_dependent_size_is_refused_naming_the_line():
    def fn(x):
        y = x[x > 0]
        return y * 2, f"{y.shape[0]} positive"  # eager: "2 positive"; only the running program knows the count

    with pytest.raises(fulmen.DataDependentError, match="test_symbolic_ints.py"):
        _jit(fn)(torch.tensor([1.0, -1.0, 2.0]))


def test_a_size_made_dynamic_after_another_is_checked_again():
    def fn(x):
        return x.sum(1) * 2 if isinstance(x.shape[0], int) else x.sum(1) * 3  # eager: always * 2

    jf = _jit(fn)
    for shape in ((2, 3), (2, 4), (2, 5), (3, 6), (4, 7), (5, 5)):  # the lengths go dynamic, then the batch size
        x = torch.randn(shape)
        torch.testing.assert_close(jf(x), fn(x), rtol=0, atol=0)


# ---- the check against exact traces is made at two values: paths that agree at one value differ at the other ----
_AGREE_AT_ONE_VALUE = {
    "isinstance": lambda x, n: x * (n if isinstance(n, int) else 2),  # at 2 both paths multiply by 2
    "isinstance of an ABC": lambda x, n: x * (n if isinstance(n, numbers.Integral) else 2),
    "type is": lambda x, n: x * (n if type(n) is int else 2),
    "__class__": lambda x, n: x * (n if n.__class__ is int else 2),
    "isinstance SymInt": lambda x, n: x * (2 if isinstance(n, torch.SymInt) else n),
    "identity": lambda x, n: x * (2 if n is operator.index(3) else 1),  # small ints are one object in CPython
}


@pytest.mark.parametrize("name", list(_AGREE_AT_ONE_VALUE))
def test_a_type_check_whose_paths_agree_at_the_first_value_takes_eagers_branch_at_the_next(name):
    fn = _AGREE_AT_ONE_VALUE[name]
    jf, x = _jit(fn), torch.randn(3)
    for n in (2, 3, 4, 5):
        _same(jf(x, n), fn(x, n))


def test_a_type_check_in_a_branch_compiled_after_a_guard_failed_is_checked_too():
    def fn(x, n):
        k = n if isinstance(n, int) else (n if n < 5 else 5)  # the symbolic path agrees with eager below 5 and at 5
        return x * k

    jf, x = _jit(fn), torch.randn(3)
    for n in (2, 3, 4, 5, 6, 7):
        _same(jf(x, n), fn(x, n))


class _Counter:
    """A cache that holds no tensor before the first call: the second call's structure is new, and its int is symbolic
    from that compilation on (state carried between calls), checked at the second call's value first."""

    def __init__(self, seen: int):
        self.keys, self.seen = None, seen


def _counts(x, c):
    c.seen += 1
    c.keys = x.repeat(3) if c.keys is None else torch.cat([c.keys, x])[-3:]
    return c.keys * (c.seen if isinstance(c.seen, int) else 4)  # agrees with eager at 4, the second call's value


def test_an_int_carried_between_calls_is_checked_at_a_value_other_than_the_one_compiled_for():
    jf, x = _jit(_counts), torch.randn(1)
    eager, compiled = _Counter(2), _Counter(2)
    for _ in range(5):
        _same(jf(x, compiled), _counts(x, eager))
        assert compiled.seen == eager.seen


def test_the_check_at_a_second_value_costs_no_compilation_for_a_program_that_passes_it():
    # a guard of the check's cost (it held before the check existed): the exact traces it compares add no cache miss
    def fn(x, n, m):
        return x[:n] * m + x[-m:].sum()

    jf, x = _jit(fn), torch.randn(12)
    for n, m in ((2, 2), (3, 3), (4, 5), (6, 2), (3, 7)):
        _same(jf(x, n, m), fn(x, n, m))
    assert fulmen.cache_misses(jf) == 2


# ---- operations whose arguments hold a symbolic int are fused: the region reads the int from its carrier ----
def _decode_like(cache, x, n):
    pos = torch.arange(n, n + 2).float()  # a creation whose arguments hold the int
    y = cache[:, :n] * 2 + x  # a slice by it
    return (y.sin() * 3).sum(1) + pos.sum()


def _fused(jf) -> tuple[list, list]:
    """The last program's fused regions, and its operations outside them."""
    ops = [b for b in fulmen.last_traces(jf)[-1].bound_symbols if b.sym.name not in ("del", "python_return")]
    return [b for b in ops if b.sym.is_fusion], [b.sym.name for b in ops if not b.sym.is_fusion]


def test_operations_whose_arguments_hold_a_symbolic_int_join_the_region_and_match_eager():
    jf, cache, x = fulmen.jit(_decode_like, compile="off"), torch.randn(3, 16), torch.randn(3, 1)
    for n in (2, 3, 4, 7, 9, 3):
        torch.testing.assert_close(jf(cache, x, n), _decode_like(cache, x, n), rtol=0, atol=0)
    assert fulmen.cache_misses(jf) == 2
    regions, outside = _fused(jf)
    assert len(regions) == 1 and not outside, outside
    assert "n" in [p.name for p in regions[0].args]  # the int's carrier, from whose size the region reads it


def test_a_backward_using_a_symbolic_int_is_one_region_and_its_gradients_match_eager():
    def fn(x, n):
        m = n * 2  # the backward reads it from n's carrier, saved for it
        return (x[:m].sin() * m).sum()

    jf = fulmen.jit(fn, compile="off")
    for n in (2, 3, 4):
        x = torch.randn(10, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        jf(x, n).backward()
        fn(x_eager, n).backward()
        torch.testing.assert_close(x.grad, x_eager.grad, rtol=1e-6, atol=1e-6)
    backward = [b for b in fulmen.last_backward_traces(jf)[-1].bound_symbols if b.sym.name not in ("del",)]
    computing = [b.sym.name for b in backward if b.sym.name not in ("unpack_and_clear", "python_return")]
    assert len(computing) == 1 and computing[0].startswith("inductor_fusion"), computing


@pytest.mark.slow
def test_a_region_holding_a_symbolic_int_compiles_a_bounded_number_of_kernels():
    from fulmen.executors import inductor_compile

    jf, cache, x = fulmen.jit(_decode_like, compile="sync"), torch.randn(3, 16), torch.randn(3, 1)
    before = len(inductor_compile._kernels)
    for n in range(2, 12):
        torch.testing.assert_close(jf(cache, x, n), _decode_like(cache, x, n), rtol=1e-5, atol=1e-5)
    kernels = list(inductor_compile._kernels.values())[before:]
    # the exact program's region; the symbolic program's region at its first value, then with the int symbolic
    assert len(kernels) <= 3, len(kernels)
    (region,) = _fused(jf)[0]
    assert region.sym.impl.dynamic is not None and region.sym.impl.dynamic.fn is not None


@pytest.mark.parametrize("dynamic", [None, True], ids=["sizes made dynamic", "dynamic from the first call"])
def test_a_type_check_on_a_size_whose_paths_agree_at_the_first_size_takes_eagers_branch_at_the_next(dynamic):
    def fn(x):
        k = x.shape[0] if isinstance(x.shape[0], int) else 4  # at 4 both paths multiply by 4
        return x.sum() * k

    jf = _jit(fn, dynamic=dynamic)
    for size in (4, 5, 6, 7):
        x = torch.randn(size)
        torch.testing.assert_close(jf(x), fn(x), rtol=0, atol=0)
