"""Cache keys never reuse a compilation traced for other values (fulmen/frontend/cache.py), the cache is bounded
and stops recompiling for an argument that changes on every call (fulmen/frontend/jit.py), and the printed prologue
is the check that runs (fulmen/frontend/prologue.py)."""

import dataclasses
import math

import numpy as np
import pytest
import torch

import fulmen


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
    assert [jf(x, Cfg(v)).item() for v in range(1, 6)] == [1.0, 2.0, 3.0, 4.0, 5.0]
    jf(x, Cfg(1))
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
