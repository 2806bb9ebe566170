"""``fulmen.jit(module)`` sees the changes a user makes to the module between calls, as eager does.

Replacing submodules, plain attributes the forward reads, hooks, buffers assigned inside forward, the wrapper's
own attributes; nested jitted modules; lazy modules. Each test compares with eager in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fulmen
from fulmen.frontend import module_guard


def _counts(f) -> tuple[int, int]:
    return fulmen.cache_hits(f), fulmen.cache_misses(f)


def _x(*shape) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4, dtype=torch.float64)
        self.scale = 2.0
        self.act = nn.ReLU()
        self.mask = torch.ones(4, dtype=torch.float64)  # a plain tensor attribute, not a buffer

    def forward(self, x):
        return self.act(self.fc(x)) * self.scale * self.mask


def test_replaced_submodule_is_read_and_gets_gradients():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    jm, x = fulmen.jit(m), _x(3, 4)
    torch.testing.assert_close(jm(x), m(x))
    old = m[2]
    m[2] = nn.Linear(4, 2).double()
    torch.testing.assert_close(jm(x), m(x))
    jm(x).sum().backward()
    expected = copy.deepcopy(m)
    expected.zero_grad()
    expected(x).sum().backward()
    torch.testing.assert_close(m[2].weight.grad, expected[2].weight.grad)
    assert old.weight.grad is None
    # the same structure again (same shapes): the program is reused, reading the current tensors
    misses = fulmen.cache_misses(jm)
    m[2] = old
    torch.testing.assert_close(jm(x), m(x))
    assert fulmen.cache_misses(jm) == misses


def test_parameter_removed_and_added_back():
    m = nn.Linear(4, 3, dtype=torch.float64)
    jm, x = fulmen.jit(m), _x(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(jm(x), m(x))
        m.bias = None
        torch.testing.assert_close(jm(x), m(x))
        m.bias = nn.Parameter(_x(3))
        torch.testing.assert_close(jm(x), m(x))
        del m.bias
        m.register_parameter("bias", nn.Parameter(_x(3)))
        torch.testing.assert_close(jm(x), m(x))


def test_replaced_parameter_of_the_same_shape_is_read_without_recompiling():
    m = nn.Linear(4, 3, dtype=torch.float64)
    jm, x = fulmen.jit(m), _x(2, 4)
    jm(x)
    m.weight = nn.Parameter(_x(3, 4))
    torch.testing.assert_close(jm(x), m(x))
    assert _counts(jm) == (1, 1)


@pytest.mark.parametrize("change", ["attribute", "parameterless submodule", "forward hook", "tensor attribute"])
def test_python_state_the_forward_reads_is_seen(change):
    torch.manual_seed(0)
    m = _Scaled()
    jm, x = fulmen.jit(m), _x(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(jm(x), m(x))
        if change == "attribute":
            m.scale = 3.0
        elif change == "parameterless submodule":
            m.act = nn.Tanh()
        elif change == "forward hook":
            handle = m.fc.register_forward_hook(lambda mod, args, out: out * 10)
        else:
            m.mask = torch.zeros(4, dtype=torch.float64)
        torch.testing.assert_close(jm(x), m(x))
        assert fulmen.cache_misses(jm) == 2
        if change == "forward hook":
            handle.remove()
            torch.testing.assert_close(jm(x), m(x))


def test_toggling_an_attribute_reuses_both_compilations_and_says_why():
    m = _Scaled()
    jm, x = fulmen.jit(m), _x(3, 4)
    with torch.no_grad():
        for scale in (2.0, 3.0, 2.0, 3.0):
            m.scale = scale
            torch.testing.assert_close(jm(x), m(x))
    assert _counts(jm) == (2, 2)
    assert fulmen.compile_stats(jm).last_recompile_reason == "attribute 'scale' of the module changed"


def test_train_eval_of_a_submodule_recompiles_and_toggles_back():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).double()
    jm, x = fulmen.jit(m), _x(3, 4)
    with torch.no_grad():
        jm(x)
        m[1].eval()
        torch.testing.assert_close(jm(x), m(x))
        m.train()
        jm(x)
        m[1].eval()
        torch.testing.assert_close(jm(x), m(x))
    assert _counts(jm) == (2, 2)
    assert fulmen.compile_stats(jm).last_recompile_reason == "the train/eval mode of submodule '1'"


def test_calls_without_changes_do_not_walk_the_module(monkeypatch):
    walks = []
    snapshot = module_guard.snapshot
    monkeypatch.setattr(module_guard, "snapshot", lambda root: walks.append(root) or snapshot(root))
    m = _Scaled()
    jm, x = fulmen.jit(m), _x(3, 4)
    with torch.no_grad():
        jm(x)
        jm(x)
        walks.clear()
        for _ in range(5):
            jm(x)
        other = nn.Linear(2, 2)  # a module no jitted program watches
        other.scale = 5.0
        jm(x)
        assert walks == []
        m.scale = 5.0
        jm(x)
        assert len(walks) == 1


def test_wrapper_attribute_writes_reach_the_original():
    m = _Scaled()
    jm, x = fulmen.jit(m), _x(3, 4)
    jm.scale = 3.0
    assert m.scale == 3.0 and "scale" not in jm.__dict__
    with torch.no_grad():
        torch.testing.assert_close(jm(x), m.act(m.fc(x)) * 3.0)
    jm.act = nn.Tanh()
    assert isinstance(m.act, nn.Tanh)
    del jm.scale
    assert not hasattr(m, "scale")
    d = nn.Dropout(0.5)
    jd = fulmen.jit(d)
    d.eval()
    assert jd.training is False
    jd.train()
    assert d.training is True
    jd.training = False
    assert d.training is False


def test_wrapper_indexes_and_iterates_as_the_original():
    m = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    jm = fulmen.jit(m)
    assert jm[0] is m[0] and len(jm) == 2 and list(jm) == list(m) and bool(jm)
    assert bool(fulmen.jit(nn.Linear(2, 2)))  # a module without __len__ is true
    d = fulmen.jit(nn.ModuleDict({"a": nn.ReLU()}))
    assert "a" in d
    jm[1] = nn.Tanh()
    assert isinstance(m[1], nn.Tanh)


@pytest.mark.parametrize("registration", ["full", "full_pre", "legacy", "global"])
def test_module_backward_hooks_raise_instead_of_being_dropped(registration):
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).double()
    jm, x = fulmen.jit(m), _x(3, 4)
    jm(x).sum().backward()  # no hook yet: compiled

    def cut(mod, grad_input, grad_output):
        return (grad_input[0] * 0,)

    if registration == "full":
        handle = m[1].register_full_backward_hook(cut)
    elif registration == "full_pre":
        handle = m[1].register_full_backward_pre_hook(lambda mod, grad_output: (grad_output[0] * 0,))
    elif registration == "legacy":
        handle = m[1].register_backward_hook(cut)
    else:
        handle = torch.nn.modules.module.register_module_full_backward_hook(cut)
    try:
        with pytest.raises(NotImplementedError, match="backend=\"fulmen\""):
            jm(x)
    finally:
        handle.remove()
    jm(x).sum().backward()  # removed: runs compiled again


def test_backward_hook_on_the_wrapper_runs_around_the_compiled_program():
    m = nn.Linear(4, 2, dtype=torch.float64)
    jm, x = fulmen.jit(m), _x(3, 4).requires_grad_()
    seen = []
    jm.register_full_backward_hook(lambda mod, grad_input, grad_output: seen.append(grad_output[0].clone()))
    jm(x).sum().backward()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], torch.ones(3, 2, dtype=torch.float64))


class _Remember(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("last", torch.zeros(3, dtype=torch.float64))

    def forward(self, x):
        out = x + self.last
        self.last = x * 2
        return out


def test_buffer_assigned_in_forward_reaches_the_module():
    jm, eager = fulmen.jit(_Remember()), _Remember()
    for i in range(3):
        x = torch.full((3,), float(i + 1), dtype=torch.float64)
        torch.testing.assert_close(jm(x), eager(x))
        torch.testing.assert_close(jm.original_module.last, eager.last)
    assert _counts(jm) == (2, 1)
    assert jm.last is jm.original_module.last


def test_buffer_assigned_a_non_tensor_in_forward_raises():
    class Clear(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("last", torch.zeros(3))

        def forward(self, x):
            self.last = None
            return x * 2

    m = Clear()
    with pytest.raises(NotImplementedError, match="'last'"):
        fulmen.jit(m)(torch.ones(3))
    assert isinstance(m.last, torch.Tensor)  # the module is left as it was


def test_jitted_module_inside_a_jitted_module_is_traced_inline():
    torch.manual_seed(0)
    inner_module = nn.Linear(4, 4, dtype=torch.float64)
    inner = fulmen.jit(inner_module)
    outer = fulmen.jit(nn.Sequential(nn.Linear(4, 4, dtype=torch.float64), inner, nn.Tanh()))
    eager = nn.Sequential(copy.deepcopy(outer[0]), copy.deepcopy(inner_module), nn.Tanh())
    x = _x(2, 4)
    torch.testing.assert_close(outer(x), eager(x))
    outer(x).sum().backward()
    eager(x).sum().backward()
    torch.testing.assert_close(inner_module.weight.grad, eager[1].weight.grad)
    torch.testing.assert_close(inner(x), inner_module(x))  # the inner one still works on its own


def test_jitted_function_inside_a_jitted_function_is_traced_inline():
    inner = fulmen.jit(lambda a: a * 2 + 1)
    outer = fulmen.jit(lambda a, b: inner(a) * b)
    a, b = _x(3), _x(3)
    torch.testing.assert_close(outer(a, b), (a * 2 + 1) * b)
    assert len(fulmen.last_traces(outer)) > 0


def test_lazy_module_initializes_on_its_first_call():
    torch.manual_seed(0)
    m = nn.Sequential(nn.LazyLinear(3, dtype=torch.float64), nn.ReLU())
    jm, x = fulmen.jit(m), _x(2, 5)
    first = jm(x)
    assert m[0].weight.shape == (3, 5)
    torch.testing.assert_close(first, m(x))
    torch.testing.assert_close(jm(x), m(x))
    assert fulmen.cache_misses(jm) == 1


def test_buffer_assigned_in_a_training_forward_matches_eager():
    class Running(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3, dtype=torch.float64)
            self.register_buffer("last", torch.zeros(3, dtype=torch.float64))

        def forward(self, x):
            out = self.fc(x) + self.last
            self.last = out.detach().sum(0) * 0.5
            return out

    torch.manual_seed(0)
    m = Running()
    eager, jm = copy.deepcopy(m), fulmen.jit(m)
    for _ in range(3):
        x = _x(2, 3)
        jm(x).square().sum().backward()
        eager(x).square().sum().backward()
        torch.testing.assert_close(m.last, eager.last)
        torch.testing.assert_close(m.fc.weight.grad, eager.fc.weight.grad)


class _Recorder(nn.Module):
    """Keeps its last activation on a plain attribute, as models that expose attention maps do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4, dtype=torch.float64)
        self.last = None

    def forward(self, x):
        y = self.fc(x)
        self.last = y.detach() * 2
        return y.relu()


def test_tensor_assigned_to_a_plain_attribute_is_set_on_every_call():
    torch.manual_seed(0)
    m = nn.Sequential(_Recorder(), nn.Tanh())
    jm = fulmen.jit(m)
    for _ in range(3):
        x = _x(2, 4)
        torch.testing.assert_close(jm(x), m(x))
        got = m[0].last
        assert type(got) is torch.Tensor  # a real tensor, never a tracing placeholder
        torch.testing.assert_close(got, m[0].fc(x).detach() * 2)
    # the attribute is a program output, not structure: a train/eval round trip reuses the programs
    m.eval()
    jm(_x(2, 4))
    m.train()
    jm(_x(2, 4))
    assert fulmen.cache_misses(jm) == 2


def test_state_read_and_reassigned_in_forward_asks_for_a_buffer():
    class Running(nn.Module):
        def __init__(self):
            super().__init__()
            self.total = torch.zeros(4, dtype=torch.float64)  # a plain attribute, not a buffer

        def forward(self, x):
            self.total = self.total + x.sum(0)
            return x * 2

    m = Running()
    with pytest.raises(NotImplementedError, match="register_buffer"):
        fulmen.jit(m)(_x(2, 4))
    assert type(m.total) is torch.Tensor and m.total.abs().sum() == 0  # left as it was


def test_python_attribute_changed_while_tracing_warns(caplog):
    class Counting(nn.Module):
        def forward(self, x):
            self.calls = getattr(self, "calls", 0) + 1
            return x + 1

    with caplog.at_level("WARNING", logger="fulmen"):
        fulmen.jit(Counting())(_x(2))
    assert any("changed the attribute 'calls'" in r.getMessage() for r in caplog.records)
