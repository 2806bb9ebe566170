"""Soundness of what a compiled program assumes about the Python world around it: values its code reads from
objects (class and module attributes, nested configs, deep helpers), global module hooks, and the ambient
context (default dtype, default device) its fused regions compile under. Each test compares with eager."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
import torch
from torch import nn

import fulmen
from fulmen.core.ambient import Ambient
from fulmen.executors.inductor_compile import wait_for_compilations

_global_hooks = torch.nn.modules.module


def _x(*shape) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------------
# global module hooks: eager runs each once per module call


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3)).double()


def test_global_forward_hook_applies_once_per_module_call():
    model, x = _mlp(), _x(2, 4)
    jitted = fulmen.jit(model, executors=["torch"])
    seen = []

    def add_one(mod, args, out):
        seen.append(mod)
        return out + 1

    handle = _global_hooks.register_module_forward_hook(add_one)
    try:
        expected = model(x)  # +1 after each Linear, the ReLU and the Sequential
        for _ in range(2):
            seen.clear()
            torch.testing.assert_close(jitted(x), expected)
            assert not any(m is jitted for m in seen), "the global hook ran on the fulmen.jit wrapper too"
    finally:
        handle.remove()
    torch.testing.assert_close(jitted(x), model(x))


def test_global_forward_pre_hook_applies_once_per_module_call():
    model, x = _mlp(), _x(2, 4)
    jitted = fulmen.jit(model, executors=["torch"])
    handle = _global_hooks.register_module_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    try:
        expected = model(x)
        torch.testing.assert_close(jitted(x), expected)
        torch.testing.assert_close(jitted(x), expected)
    finally:
        handle.remove()
    torch.testing.assert_close(jitted(x), model(x))


def test_hooks_registered_on_the_wrapper_still_run_around_it():
    model, x = _mlp(), _x(2, 4)
    jitted = fulmen.jit(model, executors=["torch"])
    jitted.register_forward_pre_hook(lambda mod, args: (args[0] + 1,))
    jitted.register_forward_hook(lambda mod, args, out: out * 3)
    handle = _global_hooks.register_module_forward_hook(lambda mod, args, out: out - 0.5)
    try:
        expected = model(x + 1) * 3  # the wrapper's own hooks around the model's call, which runs the global one
        torch.testing.assert_close(jitted(x), expected)
        torch.testing.assert_close(jitted(x), expected)
    finally:
        handle.remove()


class _WritesFirstInput(nn.Module):
    def forward(self, a, b):
        a.add_(1)
        return a * b


def test_a_call_run_eagerly_runs_the_module_hooks_once():
    # aliased inputs that the program writes run eagerly (logged): still through the module's __call__
    model = _WritesFirstInput()
    model.register_forward_hook(lambda mod, args, out: out * 10)
    jitted = fulmen.jit(model, executors=["torch"])
    handle = _global_hooks.register_module_forward_hook(lambda mod, args, out: out + 1)
    try:
        a, b = _x(3), _x(3)
        expected = model(a.clone(), b)
        torch.testing.assert_close(jitted(a, b), expected)  # compiled
        x = _x(3)
        y = x.clone()
        torch.testing.assert_close(jitted(x, x), model(y, y))
    finally:
        handle.remove()


# ---------------------------------------------------------------------------------------------------------
# values read from Python objects: every attribute chain the traced code loads is guarded


def _recompiles_with(j, x, expected, *words, args=()) -> None:
    misses = fulmen.cache_misses(j)
    torch.testing.assert_close(j(x, *args), expected)
    assert fulmen.cache_misses(j) == misses + 1
    reason = fulmen.compile_stats(j).last_recompile_reason
    assert all(w in reason for w in words), reason


def test_class_attribute_read_through_the_class(caplog):
    class K:
        scale = 2.0

    def f(x):
        return x * K.scale

    j, x = fulmen.jit(f, executors=["torch"]), _x(4)
    torch.testing.assert_close(j(x), x * 2.0)
    j(x)
    assert fulmen.cache_misses(j) == 1
    K.scale = 5.0
    with caplog.at_level(logging.INFO, logger="fulmen"):
        _recompiles_with(j, x, x * 5.0, "scale", "2.0", "5.0")
    assert any("recompiling" in r.getMessage() and "K.scale" in r.getMessage() for r in caplog.records)
    K.scale = 2.0  # back: the first program is reused
    torch.testing.assert_close(j(x), x * 2.0)
    assert fulmen.cache_misses(j) == 2


class _Scaled(nn.Module):
    scale = 2.0

    def forward(self, x):
        return x * self.__class__.scale + self.scale


class _Base:
    scale = 2.0


class _Derived(_Base):
    pass


def test_class_attribute_read_through_self_and_self_class():
    model, x = _Scaled(), _x(4)
    j = fulmen.jit(model, executors=["torch"])
    torch.testing.assert_close(j(x), model(x))
    _Scaled.scale = 3.0
    try:
        _recompiles_with(j, x, x * 3.0 + 3.0, "scale")
        model.scale = 7.0  # an instance attribute now shadows the class's for self.scale only
        torch.testing.assert_close(j(x), x * 3.0 + 7.0)
    finally:
        _Scaled.scale = 2.0


def test_class_attribute_of_an_instance_and_a_subclass_shadowing_its_base():
    obj = _Derived()

    def f(x):
        return x * obj.scale

    j, x = fulmen.jit(f, executors=["torch"]), _x(4)
    torch.testing.assert_close(j(x), x * 2.0)
    try:
        _Base.scale = 4.0
        _recompiles_with(j, x, x * 4.0, "scale")
        _Derived.scale = 6.0  # the subclass now defines it: it shadows the base's
        _recompiles_with(j, x, x * 6.0, "scale")
        obj.scale = 8.0  # and the instance shadows both
        _recompiles_with(j, x, x * 8.0, "scale")
    finally:
        _Base.scale = 2.0
        del _Derived.scale


def test_attribute_of_an_imported_user_module(tmp_path, monkeypatch):
    (tmp_path / "fulmen_soundness_cfgmod.py").write_text("SCALE = 2.0\nSHIFT = 1.0\n\ndef shift():\n    return SHIFT\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import fulmen_soundness_cfgmod as cfgmod

    def f(x):
        return x * cfgmod.SCALE + cfgmod.shift()

    j, x = fulmen.jit(f, executors=["torch"]), _x(4)
    torch.testing.assert_close(j(x), x * 2.0 + 1.0)
    cfgmod.SCALE = 3.0
    _recompiles_with(j, x, x * 3.0 + 1.0, "SCALE", "2.0", "3.0")
    cfgmod.SHIFT = -1.0  # read by a function of the module, called through the module
    _recompiles_with(j, x, x * 3.0 - 1.0, "SHIFT")


class _Sub:
    def __init__(self):
        self.mult = 2.0


class _Config:
    def __init__(self):
        self.sub = _Sub()


class _Configured(nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = _Config()
        self.lin = nn.Linear(4, 4).double()

    def forward(self, x):
        return self.lin(x) * self.cfg.sub.mult


def test_nested_config_attribute_of_a_module():
    model, x = _Configured(), _x(2, 4)
    j = fulmen.jit(model, executors=["torch"])
    torch.testing.assert_close(j(x), model(x))
    model.cfg.sub.mult = 4.0
    _recompiles_with(j, x, model(x), "mult", "2.0", "4.0")
    model.cfg.sub = _Sub()  # a new object holding the first value: the first program again
    torch.testing.assert_close(j(x), model(x))
    assert fulmen.cache_misses(j) == 3  # rebinding sub is a change (its identity is checked)


DEEP_SCALE = 2.0


def _level6():
    return DEEP_SCALE


def _level5():
    return _level6()


def _level4():
    return _level5()


def _level3():
    return _level4()


def _level2():
    return _level3()


def _level1():
    return _level2()


def _deep(x):
    return x * _level1()


def test_global_read_by_a_helper_six_calls_deep():
    global DEEP_SCALE
    j, x = fulmen.jit(_deep, executors=["torch"]), _x(4)
    torch.testing.assert_close(j(x), x * 2.0)
    try:
        DEEP_SCALE = 3.0
        _recompiles_with(j, x, x * 3.0, "DEEP_SCALE")
    finally:
        DEEP_SCALE = 2.0


class _Inner(nn.Module):
    factor = 2.0

    def helper(self):
        return self.factor


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()

    def forward(self, x):
        return x * self.inner.helper()


def test_method_of_a_submodule_reading_a_class_attribute():
    model, x = _Outer(), _x(4)
    j = fulmen.jit(model, executors=["torch"])
    torch.testing.assert_close(j(x), x * 2.0)
    for _ in range(3):
        j(x)
    assert fulmen.cache_misses(j) == 1  # unchanged values reuse the program
    _Inner.factor = 5.0
    try:
        _recompiles_with(j, x, x * 5.0, "factor")
    finally:
        _Inner.factor = 2.0


# ---------------------------------------------------------------------------------------------------------
# fused regions compile under the default dtype they were traced under, whenever they compile

_F64 = {"rtol": 1e-12, "atol": 1e-12}  # float64 results computed in float32 differ by about 1e-7


def _int_division(i):
    return (i / 3).sin() * 2  # int / int: the result's dtype is the default dtype


def _compiled_variants(j) -> int:
    regions = [b.sym.impl for b in fulmen.last_traces(j)[-1].bound_symbols
               if hasattr(getattr(b.sym, "impl", None), "variants")]
    return sum(len(r.variants) for r in regions)


@pytest.mark.parametrize("mode", ["async", "sync", None])
def test_region_compiled_after_the_default_dtype_changed_keeps_the_traced_one(mode):
    i = torch.arange(12).reshape(3, 4)
    saved = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        expected = _int_division(i)
        j = fulmen.jit(_int_division, **({} if mode is None else {"compile": mode}))
        torch.testing.assert_close(j(i), expected, **_F64)
        # the background compiler works while the program's thread runs under another default dtype
        torch.set_default_dtype(torch.float32)
        wait_for_compilations(timeout=300)
        torch.set_default_dtype(torch.float64)
        for _ in range(2):  # a region set aside for that is queued again by its next call
            out = j(i)
            assert out.dtype == torch.float64
            torch.testing.assert_close(out, expected, **_F64)
            wait_for_compilations(timeout=300)
        if mode is not None:
            assert _compiled_variants(j) == 1, "the region was not compiled: the test would not test it"
    finally:
        torch.set_default_dtype(saved)


def _scaled_sum(x, i):
    return (x * (i / 3).sin()).sum()


def test_backward_compiled_under_another_default_dtype_keeps_the_traced_one():
    i = torch.arange(12).reshape(3, 4)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    saved = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        (expected,) = torch.autograd.grad(_scaled_sum(x, i), x)
        j = fulmen.jit(_scaled_sum, compile="sync")
        out = j(x, i)
        torch.set_default_dtype(torch.float32)  # the backward (and its regions) compile when it first runs
        (grad,) = torch.autograd.grad(out, x)
        assert grad.dtype == torch.float64
        torch.testing.assert_close(grad, expected, **_F64)
    finally:
        torch.set_default_dtype(saved)


def test_same_region_code_traced_under_two_default_dtypes_gets_two_kernels():
    i = torch.arange(12).reshape(3, 4)
    saved = torch.get_default_dtype()
    try:
        for dtype in (torch.float32, torch.float64):  # the same region text; kernels are shared by text and layout
            torch.set_default_dtype(dtype)
            j = fulmen.jit(_int_division, compile="sync")
            out = j(i)
            assert out.dtype == dtype
            torch.testing.assert_close(out, _int_division(i), **(_F64 if dtype == torch.float64 else {}))
            assert _compiled_variants(j) == 1
    finally:
        torch.set_default_dtype(saved)


class _Heads:
    def __init__(self):
        self.width, self.heads = 8, 2

    @property
    def head_dim(self):
        return self.width // self.heads


class _TypeScaled(nn.Module):
    scale = 2.0

    def __init__(self):
        super().__init__()
        self.cfg = _Heads()

    def forward(self, x):
        return x.view(-1, self.cfg.head_dim) * type(self).scale


def test_class_attribute_read_through_type_self_and_a_config_property():
    model, x = _TypeScaled(), _x(8)
    j = fulmen.jit(model, executors=["torch"])
    torch.testing.assert_close(j(x), model(x))
    try:
        _TypeScaled.scale = 3.0
        _recompiles_with(j, x, model(x), "scale")
        model.cfg.heads = 4  # read by the property's getter: the view's shape changes
        _recompiles_with(j, x, model(x), "heads")
    finally:
        _TypeScaled.scale = 2.0


class _Options:
    def __init__(self):
        self.scale = 2.0


def _scaled_by(x, options):
    return x * options.scale


def test_attribute_of_an_object_passed_as_an_argument():
    options, x = _Options(), _x(4)
    j = fulmen.jit(_scaled_by, executors=["torch"])
    torch.testing.assert_close(j(x, options), x * 2.0)
    j(x, options)
    assert fulmen.cache_misses(j) == 1
    options.scale = 5.0  # the same object, changed in place: the call's key holds its contents
    _recompiles_with(j, x, x * 5.0, "options", "scale", "2.0", "5.0", args=(options,))


class _Comprehension(nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = _Config()

    def forward(self, x):
        # self is a cell here: the comprehension (a nested function) reads it too
        return sum(x * self.cfg.sub.mult for _ in range(2))


def test_config_read_through_self_captured_by_a_comprehension():
    model, x = _Comprehension(), _x(4)
    j = fulmen.jit(model, executors=["torch"])
    torch.testing.assert_close(j(x), model(x))
    model.cfg.sub.mult = 3.0
    _recompiles_with(j, x, model(x), "mult")


@dataclasses.dataclass(slots=True)
class _SlotConfig:
    scale: float = 2.0


SLOT_CONFIG = _SlotConfig()


def _slot_scaled(x):
    return x * SLOT_CONFIG.scale


def test_attribute_of_a_slots_dataclass_config():
    j, x = fulmen.jit(_slot_scaled, executors=["torch"]), _x(4)
    torch.testing.assert_close(j(x), x * 2.0)
    j(x)
    assert fulmen.cache_misses(j) == 1
    try:
        SLOT_CONFIG.scale = 3.0
        _recompiles_with(j, x, x * 3.0, "SLOT_CONFIG.scale", "2.0", "3.0")
    finally:
        SLOT_CONFIG.scale = 2.0


def test_compile_settings_are_applied_for_a_block_on_any_thread_and_restored():
    with torch.device("meta"):  # per thread: a background compiler starts from the CPU
        device_only = Ambient.capture()
    seen = []

    def compile_elsewhere():
        with device_only.applied():
            seen.append(torch.ones(1).device.type)
        seen.append(torch.ones(1).device.type)

    worker = threading.Thread(target=compile_elsewhere)
    worker.start()
    worker.join()
    assert seen == ["meta", "cpu"]

    before = Ambient.capture()
    try:
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_float32_matmul_precision("high")
        traced = Ambient.capture()
    finally:
        torch.set_default_dtype(before.dtype)
        torch.use_deterministic_algorithms(before.deterministic[0], warn_only=before.deterministic[1])
        torch.set_float32_matmul_precision(before.matmul_precision)
    assert not traced.matches() and traced.key() != before.key()  # kernels compiled under each are not shared
    with traced.applied():
        assert traced.matches()
        assert torch.ones(1).dtype == torch.float64
    assert Ambient.capture().key() == before.key()


class _Reshaper(nn.Module):
    def __init__(self):
        super().__init__()
        self.sizes = [2, 2]

    def forward(self, x):
        return x.view(*self.sizes) * 2


def test_list_attribute_of_the_module_changed_in_place():
    model, x = _Reshaper(), _x(4)
    j = fulmen.jit(model, executors=["torch"])
    torch.testing.assert_close(j(x), model(x))
    model.sizes[:] = [1, 4]  # not an attribute write: the structure check does not see it
    _recompiles_with(j, x, model(x), "sizes", "[2, 2]", "[1, 4]")


def test_warm_started_program_compiled_under_another_default_dtype_keeps_the_traced_one():
    i = torch.arange(12).reshape(3, 4)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    saved = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        expected_out = _scaled_sum(x, i)
        (expected,) = torch.autograd.grad(expected_out, x)
        j = fulmen.jit(_scaled_sum, compile="async")  # the first call runs on PyTorch autograd
        j(x, i)
        torch.set_default_dtype(torch.float32)
        fulmen.last_traces(j)  # compiles the forward and backward now, under float32
        torch.set_default_dtype(torch.float64)
        for _ in range(3):  # the regions compile in the background meanwhile
            out = j(x, i)
            (grad,) = torch.autograd.grad(out, x)
            assert out.dtype == grad.dtype == torch.float64
            torch.testing.assert_close(out, expected_out, **_F64)
            torch.testing.assert_close(grad, expected, **_F64)
            wait_for_compilations(timeout=300)
        assert _compiled_variants(j) == 1, "the forward's region was not compiled: the test would not test it"
    finally:
        torch.set_default_dtype(saved)


_SIGNED = 0.0
_NOT_A_NUMBER = float("nan")


def test_a_global_float_changed_from_zero_to_minus_zero_recompiles():
    # 1 / 0.0 is +inf and 1 / -0.0 is -inf: the guard compares floats by sign as well as value
    global _SIGNED

    def f(x):
        return x / _SIGNED

    jitted, x = fulmen.jit(f, executors=["torch"]), torch.ones(2)
    try:
        assert torch.equal(jitted(x), f(x))
        _SIGNED = -0.0
        assert torch.equal(jitted(x), f(x))
        assert torch.isneginf(jitted(x)).all()
    finally:
        _SIGNED = 0.0


def test_a_global_nan_does_not_recompile_every_call():
    def f(x):
        return x + _NOT_A_NUMBER

    jitted, x = fulmen.jit(f, executors=["torch"]), torch.ones(2)
    for _ in range(3):
        assert torch.isnan(jitted(x)).all()
    assert fulmen.cache_misses(jitted) == 1
