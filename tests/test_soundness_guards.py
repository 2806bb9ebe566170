"""Soundness of what a compiled program assumes about the Python world around it: values its code reads from
objects (class and module attributes, nested configs, deep helpers), global module hooks, and the ambient
context (default dtype, default device) its fused regions compile under. Each test compares with eager."""

from __future__ import annotations

import torch
from torch import nn

import fulmen

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
