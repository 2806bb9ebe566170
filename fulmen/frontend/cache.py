"""Cache keys: everything a compiled program depends on, computed cheaply on every call.

A key holds each tensor's shape, dtype, device and requires_grad, the values of non-tensor arguments,
the structure of containers, and the global state tracing read: grad mode, autocast and the default
dtype. Tensors found along the way are collected in call order; they are the program's inputs.

A key says nothing about inputs sharing memory: a program is traced as if they did not. For a program that
writes to its inputs that matters (``f(x, x)`` writing to its first argument and reading its second), so such
a program checks, per call, whether an input it writes to shares memory with another (``aliases_written_input``).
"""

from __future__ import annotations

from typing import Any

import torch

from fulmen.core.trace import Trace
from fulmen.transforms.passes import overwritten_inputs

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


def global_state_key() -> tuple:
    return (
        torch.is_grad_enabled(),
        torch.get_default_dtype(),
        torch.is_autocast_enabled("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None,
        torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None,
    )


def value_key(x: Any, flat: list[torch.Tensor]) -> Any:
    """A hashable description of ``x``; tensors are appended to ``flat``."""
    t = type(x)
    if t is _Tensor or t is _Parameter or isinstance(x, _Tensor):
        flat.append(x)
        return (x.shape, x.dtype, x.device, x.requires_grad)
    if t in (int, float, bool, str) or x is None:
        return (t, x)
    if t is tuple or t is list:
        return (t, tuple(value_key(v, flat) for v in x))
    if t is dict:
        return (dict, tuple((k, value_key(v, flat)) for k, v in x.items()))
    if isinstance(x, tuple):  # namedtuple
        return (t, tuple(value_key(v, flat) for v in x))
    if isinstance(x, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return x
    try:
        hash(x)
        return (t, x)
    except TypeError:
        # An unhashable object is keyed by identity: a different object recompiles. (Mutating it in place
        # between calls is not seen; pass such values as tensors or hashable values.)
        return (t, "id", id(x))


def args_key(args: tuple, kwargs: dict, flat: list[torch.Tensor]) -> tuple:
    key = tuple(value_key(a, flat) for a in args)
    if kwargs:
        key += (("kwargs",) + tuple((k, value_key(v, flat)) for k, v in kwargs.items()),)
    return key


def written_inputs(trace: Trace) -> frozenset[int]:
    """Positions, among a trace's inputs, of those its program writes to."""
    names = overwritten_inputs(trace)
    return frozenset(i for i, p in enumerate(trace.args) if p.name in names)


def aliases_written_input(flat: list[torch.Tensor], written: frozenset[int], start: int = 0) -> bool:
    """Whether an input at a ``written`` position shares memory with another input. Inputs before ``start`` (a
    module's parameters and buffers, keyed by identity) are checked only against the written ones."""
    if len(flat) < 2:
        return False
    targets: set[int] = set()
    for i in written:
        ptr = flat[i].untyped_storage().data_ptr()
        if ptr:  # 0: no memory (an empty tensor)
            if ptr in targets:
                return True
            targets.add(ptr)
    return bool(targets) and any(
        j not in written and flat[j].untyped_storage().data_ptr() in targets for j in range(start, len(flat)))
