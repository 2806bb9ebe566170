"""Frontend soundness: what a compiled program assumes about its caller's objects holds on every call, or the
call recompiles, falls back, warns or raises, naming the line (never a silently stale or wrong result)."""

import functools
import os
import sysconfig

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fulmen


# ---- an argument that is one of the module's own parameters or buffers (m(m.weight)) ----
class _Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))

    def forward(self, x):
        return F.linear(x, self.weight), x is self.weight


class _Stats(nn.Module):
    """Updates its buffer in place, then reads its argument (and writes to the argument, then reads the buffer)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running", torch.arange(3.0))

    def forward(self, x, write_arg: bool):
        if write_arg:
            x.add_(1)
            return self.running * 2
        self.running.mul_(3)
        return x + 1


def test_argument_that_is_a_parameter_is_that_input():
    torch.manual_seed(0)
    eager = _Linear()
    m = _Linear()
    m.load_state_dict(eager.state_dict())
    jm = fulmen.jit(m, executors=["torch"])
    x = torch.randn(2, 3, dtype=torch.float64)
    for arg_of in (lambda mod: x, lambda mod: mod.weight, lambda mod: x, lambda mod: mod.weight):
        out, same = jm(arg_of(m))
        expected, expected_same = eager(arg_of(eager))
        assert same is expected_same
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        torch.testing.assert_close(m.weight.grad, eager.weight.grad, rtol=1e-12, atol=1e-12)
    assert fulmen.cache_misses(jm) == 2  # one program for an argument, one for the weight itself


def test_write_through_argument_that_is_a_buffer_is_read_through_the_buffer():
    eager, m = _Stats(), _Stats()
    jm = fulmen.jit(m, executors=["torch"])
    for write_arg in (True, False, True, False):
        torch.testing.assert_close(jm(m.running, write_arg), eager(eager.running, write_arg))
        torch.testing.assert_close(m.running, eager.running)


# ---- class attributes written or read by traced code ----
class _Registry:
    calls = 0
    seen: dict = {}
    scale = 2.0


class _Counting(nn.Module):
    instances_called = 0
    factor = 3.0

    def forward(self, x):
        type(self).instances_called += 1
        _Registry.seen["last"] = "forward"
        return x * self.factor * type(self).factor + _Registry.scale


def test_class_attribute_writes_warn_naming_the_attribute_and_line(caplog):
    jm = fulmen.jit(_Counting(), executors=["torch"])
    with caplog.at_level("WARNING", logger="fulmen"):
        jm(torch.ones(2))
    text = caplog.text
    assert "_Counting.instances_called" in text and "test_frontend_soundness.py:" in text
    assert "_Registry.seen" in text


def _bump(x):
    _Registry.calls += 1
    return x + 1


def test_class_attribute_counter_in_a_function_warns(caplog):
    with caplog.at_level("WARNING", logger="fulmen"):
        fulmen.jit(_bump, executors=["torch"])(torch.ones(2))
    assert "the class attribute _Registry.calls" in caplog.text


def test_class_attribute_read_that_changed_between_calls_recompiles():
    # a guard (reads were already keyed before the writes above warned): watching the classes keeps them keyed
    m = _Counting()
    jm = fulmen.jit(m, executors=["torch"])
    x = torch.ones(2)
    try:
        for factor, scale in ((3.0, 2.0), (5.0, 2.0), (5.0, -1.0), (3.0, 2.0)):
            _Counting.factor, _Registry.scale = factor, scale
            torch.testing.assert_close(jm(x), m(x))
    finally:
        _Counting.factor, _Registry.scale = 3.0, 2.0


# ---- configuration objects a library forward reads: __slots__, deep, large ----
_LIBRARY_SOURCE = """
import torch

class Block(torch.nn.Module):
    def __init__(self, config, path):
        super().__init__()
        self.config, self.path = config, path

    def forward(self, x):
        c = self.config
        for name in self.path:
            c = getattr(c, name)
        return x * c
"""


def _library_block(config, path):
    """A module whose forward is library code (fulmen's guard on globals does not follow it), reading
    ``config.<path>``: only the module's own snapshot can see the value change."""
    namespace: dict = {}
    filename = os.path.join(sysconfig.get_paths()["purelib"], "fulmen_test_frontend_soundness_block.py")
    exec(compile(_LIBRARY_SOURCE, filename, "exec"), namespace)
    return namespace["Block"](config, tuple(path.split(".")))


class _Slotted:
    __slots__ = ("scale", "inner")

    def __init__(self, scale=2.0, inner=None):
        self.scale, self.inner = scale, inner


class _Node:
    def __init__(self, **members):
        self.__dict__.update(members)


def _deep(levels: int) -> _Node:
    node = _Node(scale=2.0)
    for _ in range(levels):
        node = _Node(sub=node)
    return node


def _large() -> _Node:
    return _Node(scale=2.0, **{f"m{i}": i for i in range(2000)})


@pytest.mark.parametrize(
    "config, path, change",
    [
        (_Slotted(), "scale", lambda c: setattr(c, "scale", -3.0)),
        (_Node(cfg=_Slotted(inner=_Slotted())), "cfg.inner.scale", lambda c: setattr(c.cfg.inner, "scale", -3.0)),
        (_deep(6), "sub.sub.sub.sub.sub.sub.scale", lambda c: setattr(c.sub.sub.sub.sub.sub.sub, "scale", -3.0)),
        (_large(), "scale", lambda c: setattr(c, "scale", -3.0)),
    ],
    ids=["slots", "nested-slots", "deep", "large"],
)
def test_config_member_changed_between_calls_recompiles(config, path, change):
    m = _library_block(config, path)
    jm = fulmen.jit(m, executors=["torch"])
    x = torch.randn(3)
    for _ in range(20):  # past the calls after which the check of the tree is built in C++
        torch.testing.assert_close(jm(x), m(x))
    change(config)
    torch.testing.assert_close(jm(x), m(x))
    torch.testing.assert_close(jm(x), m(x))
    assert fulmen.cache_misses(jm) == 2


# ---- torch.inference_mode() entered inside the traced function ----
def _inference_block(x, w):
    with torch.inference_mode():
        y = x * 2
    return y, y.is_inference()


def _inference_then_autograd(x, w):
    with torch.inference_mode():
        y = x * 2
    return (y * w).sum()


def _inference_then_inplace(x, w):
    with torch.inference_mode():
        y = x * 2
    return y.add_(w)


def test_values_made_under_inference_mode_inside_are_inference_tensors():
    jf = fulmen.jit(_inference_block, executors=["torch"])
    x, w = torch.randn(3), torch.randn(3)
    for _ in range(2):
        out, flag = jf(x, w)
        expected, expected_flag = _inference_block(x, w)
        assert flag is expected_flag is True
        assert out.is_inference() and not out.requires_grad
        torch.testing.assert_close(out, expected)
    assert fulmen.cache_hits(jf) == 0  # such calls run eagerly
    with torch.inference_mode():  # the mode is already on: entering it again changes nothing, and compiles
        for _ in range(2):
            out, flag = jf(x, w)
            assert flag is True and out.is_inference()
    assert fulmen.cache_hits(jf) == 1


@pytest.mark.parametrize(
    "fn, message",
    [
        (_inference_then_autograd, "Inference tensors cannot be saved for backward"),
        (_inference_then_inplace, "Inplace update to inference tensor outside"),
    ],
)
def test_misused_inference_values_raise_eagers_error(fn, message):
    x, w = torch.randn(3), torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match=message):
        fn(x, w)
    jf = fulmen.jit(fn, executors=["torch"])
    for _ in range(2):
        with pytest.raises(RuntimeError, match=message):
            jf(x, w)


# ---- functools.partial: the bound arguments can change after the jit ----
def _scaled(x, cfg, sizes, scale=1.0):
    return x * cfg["s"] * sizes[0] * scale


def test_partial_bound_arguments_changed_between_calls():
    cfg, sizes = {"s": 2.0}, [3.0]
    p = functools.partial(_scaled, cfg=cfg, sizes=sizes, scale=1.0)
    jp = fulmen.jit(p, executors=["torch"])
    x = torch.randn(3)
    for change in (
        lambda: None,
        lambda: cfg.update(s=-1.0),
        lambda: sizes.__setitem__(0, 5.0),
        lambda: p.keywords.__setitem__("scale", 0.5),
        lambda: cfg.update(s=2.0),
    ):
        change()
        torch.testing.assert_close(jp(x), p(x))
    w = torch.randn(3)
    q = functools.partial(torch.mul, w)  # a bound tensor is an input, not a constant
    jq = fulmen.jit(q, executors=["torch"])
    torch.testing.assert_close(jq(x), q(x))
    w.mul_(3)
    torch.testing.assert_close(jq(x), q(x))


# ---- module structure the tree check must see: held modules, class methods ----
class _Holder(nn.Module):
    def __init__(self, container):
        super().__init__()
        self.held = container(nn.Dropout(0.5))  # a plain container: not a submodule, but called by forward

    def forward(self, x):
        return self.held[0](x)


@pytest.mark.parametrize("container", [lambda m: [m], lambda m: {0: m}], ids=["list", "dict"])
def test_training_of_modules_held_in_plain_containers(container):
    m = _Holder(container)
    jm = fulmen.jit(m, executors=["torch"])
    x = torch.randn(4, 8)
    for mode in (False, True, False):
        m.held[0].train(mode)
        torch.manual_seed(0)
        out = jm(x)
        torch.manual_seed(0)
        torch.testing.assert_close(out, m(x))


def test_method_replaced_on_the_module_class():
    class Block(nn.Module):
        def forward(self, x):
            return x * 2

    m = Block()
    jm = fulmen.jit(m, executors=["torch"])
    x = torch.randn(3)
    torch.testing.assert_close(jm(x), m(x))
    Block.forward = lambda self, x: x * 8
    torch.testing.assert_close(jm(x), m(x))
    assert "a method of" in fulmen.compile_stats(jm).last_recompile_reason


class _Scaler:
    def __call__(self, x):
        return x * 2


_scaler = _Scaler()


def _calls_scaler(x):
    return _scaler(x) + 1


def test_call_method_replaced_on_a_global_objects_class():
    jf = fulmen.jit(_calls_scaler, executors=["torch"])
    x = torch.randn(3)
    original = _Scaler.__call__
    try:
        torch.testing.assert_close(jf(x), _calls_scaler(x))
        _Scaler.__call__ = lambda self, x: x * 8
        torch.testing.assert_close(jf(x), _calls_scaler(x))
    finally:
        _Scaler.__call__ = original
    torch.testing.assert_close(jf(x), _calls_scaler(x))


def _default_list(x, scales=[2.0]):  # a mutable default, changed in place below
    return x * scales[0]


def test_mutable_default_argument_changed_in_place():
    jf = fulmen.jit(_default_list, executors=["torch"])
    x = torch.randn(3)
    torch.testing.assert_close(jf(x), _default_list(x))
    _default_list.__defaults__[0][0] = -4.0
    try:
        torch.testing.assert_close(jf(x), _default_list(x))
    finally:
        _default_list.__defaults__[0][0] = 2.0


# ---- modules reached through arguments, global containers and objects: their structure is watched ----
def _call_module(x, m):
    return m(x)


_GLOBAL_LAYERS = [nn.Dropout(0.5)]


def _call_global_layer(x):
    return _GLOBAL_LAYERS[0](x)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 2.0

    def forward(self, x):
        return x * self.scale


def _same_draws(jf, f, *args):
    torch.manual_seed(0)
    out = jf(*args)
    torch.manual_seed(0)
    torch.testing.assert_close(out, f(*args))


def test_module_argument_train_mode_and_attributes_changed():
    jf = fulmen.jit(_call_module, executors=["torch"])
    x, drop, scaled = torch.randn(4, 8), nn.Dropout(0.5), _Scaled()
    for mode in (False, True, False):
        drop.train(mode)
        _same_draws(jf, _call_module, x, drop)
    for scale in (2.0, -1.0):
        scaled.scale = scale
        _same_draws(jf, _call_module, x, scaled)


def test_module_in_a_global_list_train_mode_changed():
    jf = fulmen.jit(_call_global_layer, executors=["torch"])
    x = torch.randn(4, 8)
    try:
        for mode in (False, True, False):
            _GLOBAL_LAYERS[0].train(mode)
            _same_draws(jf, _call_global_layer, x)
    finally:
        _GLOBAL_LAYERS[0].train()
