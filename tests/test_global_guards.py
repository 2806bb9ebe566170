"""A compiled program follows the globals and closure variables its code reads, as eager does.

Each test changes a value between calls (rebinding a global, a ``nonlocal``, a config attribute, a list in place,
a global module's parameter) and compares with eager; it also checks that unchanged values reuse the program.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch
from torch import nn

import fulmen

SCALE = 2.0


def _counts(f) -> tuple[int, int]:
    return fulmen.cache_hits(f), fulmen.cache_misses(f)


def _x(*shape) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def _namespace(source: str) -> dict:
    """Functions defined in a fresh globals dict, so a test can change their globals without touching others."""
    ns = {"torch": torch, "nn": nn}
    exec(compile(source, "<test globals>", "exec"), ns)
    return ns


def _scaled(x):
    return x * SCALE


def test_module_global_rebound_recompiles_and_old_value_reuses_its_program():
    global SCALE
    x = _x(4)
    j = fulmen.jit(_scaled)
    try:
        torch.testing.assert_close(j(x), x * 2.0)
        j(x)
        assert _counts(j) == (1, 1)
        SCALE = 3.0
        torch.testing.assert_close(j(x), x * 3.0)
        assert fulmen.cache_misses(j) == 2
        reason = fulmen.compile_stats(j).last_recompile_reason
        assert "SCALE" in reason and "2.0" in reason and "3.0" in reason
        SCALE = 2.0  # back to the first value: its program is reused
        torch.testing.assert_close(j(x), x * 2.0)
        assert fulmen.cache_misses(j) == 2
    finally:
        SCALE = 2.0


def test_number_type_is_part_of_the_value():
    # 2 and 2.0 are equal, but an int tensor times 2.0 is float, times 2 stays int
    ns = _namespace("K = 2\ndef f(x):\n    return x * K\n")
    j, x = fulmen.jit(ns["f"]), torch.arange(4)
    assert j(x).dtype == torch.int64
    ns["K"] = 2.0
    out = j(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x * 2.0)


def test_nan_global_does_not_recompile_every_call():
    ns = _namespace("FILL = float('nan')\ndef f(x):\n    return torch.where(x > 0, x, FILL)\n")
    j, x = fulmen.jit(ns["f"]), _x(8)
    for _ in range(3):
        torch.testing.assert_close(j(x), ns["f"](x), equal_nan=True)
    assert fulmen.cache_misses(j) == 1


def test_closure_variable_changed_by_nonlocal():
    def make():
        scale = 2.0

        def f(x):
            return x * scale

        def set_scale(v):
            nonlocal scale
            scale = v

        return f, set_scale

    f, set_scale = make()
    j, x = fulmen.jit(f), _x(4)
    torch.testing.assert_close(j(x), x * 2.0)
    set_scale(5.0)
    torch.testing.assert_close(j(x), x * 5.0)
    assert "closure variable scale" in fulmen.compile_stats(j).last_recompile_reason


def test_global_read_by_a_helper_function_and_a_method():
    ns = _namespace(
        "GAIN = 1.0\n"
        "def gain():\n    return GAIN\n"
        "def f(x):\n    return x * gain()\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 4).double()\n"
        "    def factor(self):\n        return GAIN + 1\n"
        "    def forward(self, x):\n        return self.fc(x) * self.factor()\n")
    m = ns["M"]()
    jf, jm, x = fulmen.jit(ns["f"]), fulmen.jit(m), _x(2, 4)
    torch.testing.assert_close(jf(x), x)
    torch.testing.assert_close(jm(x), m(x))
    ns["GAIN"] = 4.0
    torch.testing.assert_close(jf(x), x * 4.0)
    torch.testing.assert_close(jm(x), m(x))
    jm(x).sum().backward()
    grad = m.fc.weight.grad.clone()
    m.zero_grad()
    m(x).sum().backward()
    torch.testing.assert_close(grad, m.fc.weight.grad)


def test_global_function_rebound():
    ns = _namespace("ACT = torch.relu\ndef f(x):\n    return ACT(x)\n")
    j, x = fulmen.jit(ns["f"]), _x(8)
    torch.testing.assert_close(j(x), torch.relu(x))
    ns["ACT"] = torch.tanh
    torch.testing.assert_close(j(x), torch.tanh(x))
    assert "ACT" in fulmen.compile_stats(j).last_recompile_reason


def test_config_object_attribute_and_list_changed_in_place():
    ns = _namespace("def f(x):\n    return x * cfg.alpha + sum(SIZES)\n")
    ns["cfg"] = types.SimpleNamespace(alpha=0.5, unused=[1])
    ns["SIZES"] = [1.0, 2.0]
    j, x = fulmen.jit(ns["f"]), _x(4)
    torch.testing.assert_close(j(x), x * 0.5 + 3.0)
    ns["cfg"].alpha = 0.7
    torch.testing.assert_close(j(x), x * 0.7 + 3.0)
    assert "alpha" in fulmen.compile_stats(j).last_recompile_reason
    ns["SIZES"].append(3.0)
    torch.testing.assert_close(j(x), x * 0.7 + 6.0)
    ns["cfg"].unused.append(2)  # an attribute the code does not name: not checked
    j(x)
    assert fulmen.cache_misses(j) == 3



def test_config_attribute_read_with_getattr_and_a_string_name():
    ns = _namespace(
        "def f(x):\n"
        "    y = x * getattr(cfg, 'scale', 1.0)\n"
        "    if hasattr(cfg, 'shift'):\n"
        "        y = y + cfg.shift\n"
        "    return y * getattr(cfg, 'gain', 1.0)\n")
    ns["cfg"] = types.SimpleNamespace(scale=2.0)
    j, x = fulmen.jit(ns["f"]), _x(4)
    torch.testing.assert_close(j(x), ns["f"](x))
    j(x)
    assert _counts(j) == (1, 1)
    guard_lines = "\n".join(str(t) for t in fulmen.last_prologue_traces(j))
    assert "the attribute shift of the global cfg (module ?) is not set" in guard_lines
    ns["cfg"].scale = 3.0  # named only by a string: still checked by value
    torch.testing.assert_close(j(x), x * 3.0)
    assert "scale" in fulmen.compile_stats(j).last_recompile_reason
    ns["cfg"].shift = 1.0  # was absent when traced: hasattr now takes the other branch
    torch.testing.assert_close(j(x), x * 3.0 + 1.0)
    reason = fulmen.compile_stats(j).last_recompile_reason
    assert "shift" in reason and "was set to 1.0" in reason
    ns["cfg"].gain = 0.5  # getattr's default was used when traced
    torch.testing.assert_close(j(x), (x * 3.0 + 1.0) * 0.5)
    del ns["cfg"].gain, ns["cfg"].shift
    ns["cfg"].scale = 2.0  # back to the first configuration: its program is reused
    misses = fulmen.cache_misses(j)
    torch.testing.assert_close(j(x), x * 2.0)
    assert fulmen.cache_misses(j) == misses


def test_config_attribute_read_with_getattr_in_a_module_method():
    class Block(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.cfg = cfg

        def forward(self, x):
            return x * getattr(self.cfg, "scale", 1.0)

    cfg = types.SimpleNamespace()
    m = Block(cfg)
    jm, x = fulmen.jit(m), _x(3)
    torch.testing.assert_close(jm(x), x)
    cfg.scale = 4.0
    torch.testing.assert_close(jm(x), x * 4.0)
    cfg.scale = 5.0
    torch.testing.assert_close(jm(x), x * 5.0)
    assert fulmen.cache_misses(jm) == 3


def test_long_flat_containers_are_compared_by_value():
    ns = _namespace("def f(x):\n    return x * WEIGHTS[3] + CFG['shift']\n")
    ns["WEIGHTS"] = [float(i) for i in range(1000)]
    ns["CFG"] = {f"k{i}": i for i in range(200)} | {"shift": 0.5}
    j, x = fulmen.jit(ns["f"]), _x(4)
    torch.testing.assert_close(j(x), x * 3.0 + 0.5)
    j(x)
    assert _counts(j) == (1, 1)
    ns["WEIGHTS"][3] = 7.0  # in place, in a list longer than the 64 items compared item by item
    torch.testing.assert_close(j(x), x * 7.0 + 0.5)
    reason = fulmen.compile_stats(j).last_recompile_reason
    assert "WEIGHTS" in reason and "1000 items" in reason
    ns["CFG"]["shift"] = 1.5
    torch.testing.assert_close(j(x), x * 7.0 + 1.5)
    ns["WEIGHTS"].append(1.0)
    torch.testing.assert_close(j(x), x * 7.0 + 1.5)
    assert fulmen.cache_misses(j) == 4
    ns["WEIGHTS"].pop()  # back to the second program's values
    j(x)
    assert fulmen.cache_misses(j) == 4


def test_named_entries_of_a_dict_holding_tensors():
    ns = _namespace("def f(x):\n    return x * CFG['scale'] + CFG['W'] + CFG.get('bias', 0.0)\n")
    ns["CFG"] = {"scale": 2.0, "W": torch.ones(4, dtype=torch.float64), "unused": 1}
    j, x = fulmen.jit(ns["f"]), _x(4)
    torch.testing.assert_close(j(x), ns["f"](x))
    ns["CFG"]["unused"] = 2  # not named by the code: the program is reused
    j(x)
    assert _counts(j) == (1, 1)
    ns["CFG"]["scale"] = 3.0
    torch.testing.assert_close(j(x), ns["f"](x))
    assert "the entry scale of the global CFG" in fulmen.compile_stats(j).last_recompile_reason
    ns["CFG"]["bias"] = 1.0  # missing when traced: .get took its default
    torch.testing.assert_close(j(x), ns["f"](x))
    assert "the entry bias of the global CFG (module ?) was set to 1.0" in fulmen.compile_stats(j).last_recompile_reason
    assert fulmen.cache_misses(j) == 3


def test_a_container_too_long_to_compare_warns(caplog):
    ns = _namespace("def f(x):\n    return x * TABLE[5]\n")
    ns["TABLE"] = list(range(5000))
    x = _x(3)
    with caplog.at_level(logging.WARNING, logger="fulmen"):
        torch.testing.assert_close(fulmen.jit(ns["f"])(x), x * 5)
    assert "TABLE" in caplog.text and "5000 items" in caplog.text and "identity only" in caplog.text

def test_global_tensor_rebound_and_changed_requires_grad():
    ns = _namespace("def f(x):\n    return (x * W).sum()\n")
    ns["W"] = torch.ones(4, dtype=torch.float64)
    j, x = fulmen.jit(ns["f"]), _x(4)
    torch.testing.assert_close(j(x), x.sum())
    ns["W"] = torch.full((4,), 3.0, dtype=torch.float64)
    torch.testing.assert_close(j(x), 3 * x.sum())
    ns["W"].requires_grad_()  # the program was compiled without autograd for it
    j(x).backward()
    torch.testing.assert_close(ns["W"].grad, x)
    assert "requiring grad" in fulmen.compile_stats(j).last_recompile_reason


def test_global_module_parameter_replaced_and_mode_changed():
    ns = _namespace("def f(x):\n    return enc(x).sum()\n")
    enc = ns["enc"] = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).double()
    enc.eval()
    j, x = fulmen.jit(ns["f"]), _x(3, 4)
    torch.testing.assert_close(j(x), ns["f"](x))
    enc[0].weight = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    torch.testing.assert_close(j(x), ns["f"](x))
    assert "replaced" in fulmen.compile_stats(j).last_recompile_reason
    enc.train()  # dropout now drops: compare the structure of the result, not values
    out = j(x)
    assert fulmen.cache_misses(j) == 3
    assert "train/eval" in fulmen.compile_stats(j).last_recompile_reason
    enc.eval()  # the eval program again, reused
    torch.testing.assert_close(j(x), ns["f"](x))
    assert fulmen.cache_misses(j) == 3
    assert out.shape == ()


def test_unchanged_globals_are_hits_and_modules_are_not_checked():
    ns = _namespace("import math\ndef f(x):\n    return torch.sin(x) * math.pi\n")
    j, x = fulmen.jit(ns["f"]), _x(4)
    for _ in range(5):
        j(x)
    assert _counts(j) == (4, 1)
    assert fulmen.compile_stats(j).last_prologue_traces[0] is not None
    assert "check_globals" not in str(fulmen.compile_stats(j).last_prologue_traces[0])


def test_prologue_lists_the_globals_checked():
    j = fulmen.jit(_scaled)
    j(_x(2))
    prologue = str(fulmen.compile_stats(j).last_prologue_traces[0])
    assert "check_globals" in prologue and "the global SCALE" in prologue


def test_assigning_a_global_while_traced_warns(caplog):
    ns = _namespace("calls = 0\ndef f(x):\n    global calls\n    calls += 1\n    return x + calls\n")
    with caplog.at_level(logging.WARNING, logger="fulmen"):
        fulmen.jit(ns["f"])(_x(2))
    assert any("assigns the global or nonlocal variable(s) calls" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("value", [(1, 2), {"a": 1.0}, torch.float16, None, "mean"])
def test_value_kinds_compared_by_value(value):
    ns = _namespace("def f(x):\n    return x + len(repr(V))\n")
    ns["V"] = value
    j, x = fulmen.jit(ns["f"]), _x(2)
    torch.testing.assert_close(j(x), ns["f"](x))
    ns["V"] = [value, value]
    torch.testing.assert_close(j(x), ns["f"](x))
    assert fulmen.cache_misses(j) == 2


def test_config_object_held_by_a_module():
    class Block(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.cfg = cfg
            self.fc = nn.Linear(4, 4).double()

        def forward(self, x):
            return self.fc(x) * self.cfg.scale

    cfg = types.SimpleNamespace(scale=2.0)
    m = nn.Sequential(Block(cfg), Block(cfg))
    jm, x = fulmen.jit(m), _x(2, 4)
    torch.testing.assert_close(jm(x), m(x))
    cfg.scale = 0.5
    torch.testing.assert_close(jm(x), m(x))
    assert "scale" in fulmen.compile_stats(jm).last_recompile_reason
    m[1].cfg = types.SimpleNamespace(scale=3.0)  # a config object replaced on one block
    torch.testing.assert_close(jm(x), m(x))
    assert fulmen.cache_misses(jm) == 3


_RNG_SOURCE = """
import random
from random import uniform

def layer_drop(x):
    if random.random() < 0.5:  # LayerDrop the Python way: frozen into the trace
        return x
    return x * 2

def scaled(x):
    return x * uniform(0.5, 1.5)

def with_torch(x):  # drawn on every call: nothing to warn about
    return x * torch.rand(()) + x.sum() * 0.0

def not_a_draw(x):  # the module named, no generator call
    return x * random.__name__.count("r")
"""


@pytest.mark.parametrize("name, draw", [("layer_drop", "random.random"), ("scaled", "random.uniform"),
                                        ("with_torch", None), ("not_a_draw", None)])
def test_python_random_draws_while_traced_warn(caplog, name, draw):
    fn = _namespace(_RNG_SOURCE)[name]
    with caplog.at_level(logging.WARNING, logger="fulmen"):
        fulmen.jit(fn)(_x(3))
    warned = [r.getMessage() for r in caplog.records if "draws with" in r.getMessage()]
    if draw is None:
        assert not warned
    else:
        assert len(warned) == 1 and f"draws with {draw}" in warned[0] and "torch.rand" in warned[0]


def test_numpy_random_draws_while_traced_warn(caplog):
    np = pytest.importorskip("numpy")
    ns = _namespace("def noisy(x):\n    return x * float(np.random.rand())\n\n"
                    "def seeded(x):\n    return x + float(rng.normal())\n")
    ns["np"], ns["rng"] = np, np.random.default_rng(0)
    with caplog.at_level(logging.WARNING, logger="fulmen"):
        fulmen.jit(ns["noisy"])(_x(3))
        fulmen.jit(ns["seeded"])(_x(3))
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "draws with numpy.random.rand" in messages and "Generator's normal" in messages
