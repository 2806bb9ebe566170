"""Attributes that traced code writes on ``nn.Module`` objects: program outputs set on every call, state read
before it is written, modules a plain jitted function reaches, and failed traces leaving modules untouched.
Each test compares with eager in float64 (``fulmen.frontend.module_writes``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fulmen
from fulmen.core.proxies import DataDependentError, Proxy


def _x(*shape) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def _no_proxies(mod: nn.Module) -> bool:
    return not any(isinstance(v, Proxy) for m in mod.modules()
                   for d in (m.__dict__, m._parameters, m._buffers) for v in d.values())


class _Keep(nn.Module):
    """Keeps a detached activation on a plain attribute that none of its methods reads."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3, dtype=torch.float64)
        self.kept = None

    def forward(self, x):
        y = self.fc(x)
        self.kept = y.detach() * 2
        return y


_MODEL = _Keep()


def _through_a_global(x):
    return _MODEL(x).relu()


def _through_an_argument(model, x):
    return model(x) * 3


@pytest.mark.parametrize("reach", ["global", "argument"])
def test_attribute_of_a_module_a_plain_function_calls_is_set_on_every_call(reach):
    torch.manual_seed(0)
    model = _MODEL if reach == "global" else _Keep()
    jitted = fulmen.jit(_through_a_global if reach == "global" else _through_an_argument)
    for _ in range(3):
        x = _x(2, 3)
        out = jitted(x) if reach == "global" else jitted(model, x)
        expected = model.fc(x).relu() if reach == "global" else model.fc(x) * 3
        torch.testing.assert_close(out, expected)
        assert type(model.kept) is torch.Tensor  # a real tensor, never a tracing placeholder
        torch.testing.assert_close(model.kept, model.fc(x).detach() * 2)
    assert fulmen.cache_misses(jitted) == 1
    assert _no_proxies(model)


class _Last(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("last", torch.zeros(3, dtype=torch.float64))

    def forward(self, x):
        self.last = x * 2
        return x + 1


_BUFFERED = _Last()


def test_buffer_reassigned_on_a_module_a_plain_function_calls_raises_and_is_restored():
    before = _BUFFERED.last
    with pytest.raises(NotImplementedError, match=r"buffer 'last'.*fulmen\.jit\(module\)"):
        fulmen.jit(lambda x: _BUFFERED(x))(_x(3))
    assert _BUFFERED.last is before  # left as it was
    # compiling the module itself assigns the buffer on every call
    jm = fulmen.jit(_BUFFERED)
    x = _x(3)
    torch.testing.assert_close(jm(x), x + 1)
    torch.testing.assert_close(_BUFFERED.last, x * 2)


class _LazyNone(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = None

    def forward(self, x):
        if self.cache is None:
            self.cache = x.detach()
        return x + self.cache


class _LazyHasattr(nn.Module):
    def forward(self, x):
        if not hasattr(self, "cache"):
            self.cache = x.detach()
        return x + self.cache


@pytest.mark.parametrize("cls", [_LazyNone, _LazyHasattr])
def test_attribute_initialized_on_the_first_call_is_read_on_later_calls(cls):
    # the first trace takes the branch that sets it; later calls must not (eager: x + first x)
    jm, eager = fulmen.jit(cls()), cls()
    for value in (1.0, 5.0, 7.0):
        x = torch.full((2,), value, dtype=torch.float64)
        torch.testing.assert_close(jm(x), eager(x))
    assert fulmen.cache_misses(jm) == 2
    assert "attribute 'cache'" in fulmen.compile_stats(jm).last_recompile_reason
    # a tensor the user assigns is read from then on, not the one the program captured
    jm.original_module.cache = eager.cache = torch.full((2,), 100.0, dtype=torch.float64)
    x = torch.full((2,), 2.0, dtype=torch.float64)
    torch.testing.assert_close(jm(x), eager(x))


class _Child(nn.Module):
    def forward(self, x):
        self.seen = x.detach()
        return x * 2


class _Parent(nn.Module):
    """Branches on whether its child kept something on a previous call."""

    def __init__(self):
        super().__init__()
        self.child = _Child()
        self.child.seen = None

    def forward(self, x):
        before = self.child.seen
        y = self.child(x)
        return y if before is None else y * 3


def test_attribute_a_parent_module_reads_before_the_call_sets_it():
    jm, eager = fulmen.jit(_Parent()), _Parent()
    for value in (1.0, 2.0, 3.0):
        x = torch.full((2,), value, dtype=torch.float64)
        torch.testing.assert_close(jm(x), eager(x))


def test_attribute_written_and_read_in_the_same_call_matches_eager():
    class Reuse(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3, dtype=torch.float64)

        def forward(self, x):
            self.h = self.fc(x)
            return self.h.tanh() + self.h

    torch.manual_seed(0)
    m = Reuse()
    eager, jm = copy.deepcopy(m), fulmen.jit(m)
    for _ in range(3):
        x = _x(2, 3)
        jm(x).sum().backward()
        eager(x).sum().backward()
        torch.testing.assert_close(m.h, eager.h)
        torch.testing.assert_close(m.fc.weight.grad, eager.fc.weight.grad)
    assert fulmen.cache_misses(jm) <= 2  # the second call may recompile once: h held None before the first


def test_a_failed_trace_leaves_the_modules_as_they_were():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.kept = None
            self.calls = 0

        def forward(self, x):
            self.kept = x * 2
            self.calls += 1
            return x + x.numpy().sum()  # a NumPy copy of a traced value: cannot be traced

    m = DataDependent()
    with pytest.raises(DataDependentError):
        fulmen.jit(m)(_x(3))
    assert m.kept is None and m.calls == 0
    assert _no_proxies(m)


def test_tensor_written_straight_into_dict_raises_instead_of_leaking():
    class Sneaky(nn.Module):
        def forward(self, x):
            self.__dict__["kept"] = x * 2
            return x + 1

    m = Sneaky()
    with pytest.raises(NotImplementedError, match="self.kept = "):
        fulmen.jit(m)(_x(3))
    assert "kept" not in m.__dict__


def test_container_of_traced_tensors_on_an_attribute_is_not_kept_and_warns(caplog):
    class Pairs(nn.Module):
        def __init__(self):
            super().__init__()
            self.pair = None

        def forward(self, x):
            y = x * 2
            self.pair = (y, 3)  # only tensors themselves become program outputs
            return y + 1

    m = Pairs()
    with caplog.at_level("WARNING", logger="fulmen"):
        x = _x(3)
        torch.testing.assert_close(fulmen.jit(m)(x), x * 2 + 1)
    assert m.pair is None and _no_proxies(m)
    assert any("'pair'" in r.getMessage() and "traced values" in r.getMessage() for r in caplog.records)
