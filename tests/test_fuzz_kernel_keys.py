"""Inductor's process-wide kernel cache keys a region by its code and the objects that code calls. An object that
died must never let a new object at its reused address select its kernel (the executor cache had that bug: an
opaque ``while_loop`` body ran in place of ``x.cfloat()``)."""

import types

import torch

from fulmen.executors.inductor import _code_key

_SOURCE = "def region(x):\n    return op(x)\n"
_CODE = compile(_SOURCE, "<region>", "exec").co_consts[0]


def test_a_kernel_key_never_names_a_new_object_at_a_dead_one_s_address():
    seen: dict[tuple, object] = {}
    for i in range(300):
        impl = torch.sin if i % 2 else torch.cos
        op = lambda x, impl=impl: impl(x)  # noqa: E731  (a new object each round, freed at its end)
        key = _code_key(types.FunctionType(_CODE, {"op": op}), _SOURCE, {"x"})
        assert seen.setdefault(key, impl) is impl, f"round {i}: a new callable got the kernel key of a dead one"
        del op
