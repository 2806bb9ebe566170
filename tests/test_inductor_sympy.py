"""The shortcut for Inductor's index simplification: it answers exactly as ``sympy.simplify`` does, it is installed
in Inductor's ``sizevars`` module only, and Inductor generates the same code with it as without it."""

import random
from contextlib import nullcontext

import pytest
import sympy
import torch

import fulmen
from fulmen.executors import inductor, inductor_compile, inductor_sympy

FloorDiv = pytest.importorskip("torch.utils._sympy.functions").FloorDiv

# Inductor's loop variables are nonnegative integers named x0, x1, ... (and d0, d1, ... in its dependency analysis)
_SYMBOLS = [sympy.Symbol(f"{p}{i}", integer=True, nonnegative=True) for p in "xd" for i in range(5)]
_COEFFICIENTS = [1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 768, 1024, 4096, 8192, 32768, 98304]


def _random_index(rng: random.Random) -> sympy.Expr:
    symbols = rng.sample(_SYMBOLS, rng.randint(1, 5))
    coefficients = [rng.choice(_COEFFICIENTS + [rng.randint(1, 10**6)]) for _ in symbols]
    if rng.random() < 0.7:
        coefficients[rng.randrange(len(symbols))] = 1
    constant = rng.choice([0, 0, 1, 16, 32, 64, 256, rng.randint(0, 10**6)])
    return sum(c * s for c, s in zip(coefficients, symbols)) + constant


def test_plain_linear_indices_come_back_as_sympy_simplify_returns_them():
    rng = random.Random(0)
    shortcut = 0
    for _ in range(150):
        index = _random_index(rng)
        expected = sympy.simplify(index)
        with inductor_sympy.shortcut_here():
            got = inductor_sympy.simplify(index)
        assert sympy.srepr(got) == sympy.srepr(expected), index
        shortcut += inductor_sympy.is_plain_linear(index)
    assert shortcut > 50, "the random indices should mostly take the shortcut"


@pytest.mark.parametrize("make", [
    lambda x, y: 2 * x + 4 * y,  # a common factor: simplify may take it out
    lambda x, y: x - y,
    lambda x, y: 8 * x + y - 3,
    lambda x, y: 8 * x + FloorDiv(y, 4),
    lambda x, y: x * y + 1,
    lambda x, y: sympy.Integer(7),
    lambda x, y: sympy.Rational(1, 2) * x + y,
], ids=["common-factor", "negative-coefficient", "negative-constant", "floordiv", "product", "constant", "rational"])
def test_other_expressions_go_to_sympy(make):
    x, y = _SYMBOLS[:2]
    expr = make(x, y)
    assert not inductor_sympy.is_plain_linear(expr)
    assert sympy.srepr(inductor_sympy.simplify(expr)) == sympy.srepr(sympy.simplify(expr))


@pytest.fixture
def fresh_sizevars():
    """Inductor's ``sizevars`` module as PyTorch ships it, restored afterwards as the test found it."""
    from torch._inductor import sizevars

    saved = sizevars.sympy
    sizevars.sympy = sympy
    _clear_index_caches(sizevars)
    yield sizevars
    sizevars.sympy = saved
    _clear_index_caches(sizevars)


def _clear_index_caches(sizevars):
    for fn in (sizevars.simplify_index_in_vec_range, sizevars.stride_at, sizevars.stride_at_vec_range):
        fn.cache_clear()


def test_shortcut_touches_inductors_sizevars_only_while_lowering(fresh_sizevars):
    with inductor_sympy.shortcut_here():
        namespace = fresh_sizevars.sympy
        assert namespace.simplify is inductor_sympy.simplify
        assert namespace.Symbol is sympy.Symbol and namespace.Wild is sympy.Wild
        assert sympy.simplify is not inductor_sympy.simplify, "sympy itself must not change"
        with inductor_sympy.shortcut_here():
            assert fresh_sizevars.sympy is namespace, "a nested block changes nothing"
        assert fresh_sizevars.sympy is namespace, "the outer block still lowers"
    assert fresh_sizevars.sympy is sympy, "sizevars sees sympy again once no lowering runs"


def _gqa_scores(q, k):
    # each of 2 key heads serves 4 query heads, then a transpose and a reshape: strided, broadcast indices
    kk = k[:, :, None].expand(2, 2, 4, 16, 32).reshape(2, 8, 16, 32)
    s = (q * kk).transpose(1, 2).reshape(2, 16, 256)
    return torch.softmax(s, -1) * 2.0 + s.sum(-1, keepdim=True)


def test_inductor_generates_the_same_code_with_the_shortcut(fresh_sizevars, monkeypatch):
    """Inductor names its generated module by a hash of the module's source (C++ kernels included), so the same
    file means the same code."""
    from torch._inductor import config

    taken = []
    real, shortcut_here = inductor_sympy.is_plain_linear, inductor_sympy.shortcut_here
    monkeypatch.setattr(inductor_sympy, "is_plain_linear", lambda e: taken.append(real(e)) or taken[-1])
    q, k = torch.randn(2, 8, 16, 32), torch.randn(2, 2, 16, 32)
    token = inductor.compile_mode.set("sync")
    files = []
    try:
        with config.patch(fx_graph_cache=False):  # Inductor lowers the graph both times
            for shortcut in (False, True):
                monkeypatch.setattr(inductor_compile, "_kernels", {})  # and fulmen compiles it both times
                # the first compilation runs without the shortcut (_lower imports it at each lowering)
                monkeypatch.setattr(inductor_sympy, "shortcut_here", shortcut_here if shortcut else nullcontext)
                fresh_sizevars.sympy = sympy
                _clear_index_caches(fresh_sizevars)
                jf = fulmen.jit(_gqa_scores, executors=["inductor"])
                torch.testing.assert_close(jf(q, k), _gqa_scores(q, k))
                (region,) = [b.sym.impl for b in fulmen.last_traces(jf)[-1].bound_symbols if b.sym.is_fusion]
                (call,) = region.variants.values()
                files.append(call.__func__.__code__.co_filename)
    finally:
        inductor.compile_mode.reset(token)
    assert any(taken), "the second compilation should have taken the shortcut"
    assert files[0] == files[1]


def test_the_shortcut_answers_only_on_a_lowering_thread(monkeypatch):
    """Outside ``shortcut_here()`` (a torch.compile of the user's beside fulmen's background compiler) the
    installed ``simplify`` is sympy's, search included."""
    asked = []
    real = inductor_sympy.is_plain_linear
    monkeypatch.setattr(inductor_sympy, "is_plain_linear", lambda e: asked.append(e) or real(e))
    x, y = _SYMBOLS[:2]
    assert sympy.srepr(inductor_sympy.simplify(8 * x + y)) == sympy.srepr(sympy.simplify(8 * x + y))
    assert asked == []
    with inductor_sympy.shortcut_here():
        assert inductor_sympy.simplify(8 * x + y) == 8 * x + y
    assert asked == [8 * x + y]
