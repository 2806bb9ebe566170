"""Cache keys: everything a compiled program depends on, computed cheaply on every call.

A key holds each tensor's shape, dtype, device and requires_grad (and a lazy conjugate or negative bit), the
values of non-tensor arguments, the structure of containers, and the global state tracing read: grad mode,
autocast and the default dtype. Tensors found along the way are collected in call order; they are the program's inputs.

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
        dtype = x.dtype
        # a lazy view (z.conj(), z.conj().imag) flips values with a bit that compiled code would ignore
        if x.is_neg() or (dtype.is_complex and x.is_conj()):
            return (x.shape, (dtype, "conj" if x.is_conj() else "neg"), x.device, x.requires_grad)
        return (x.shape, dtype, x.device, x.requires_grad)
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


def state_key(tensors: list[torch.Tensor], flat: list[torch.Tensor]) -> tuple:
    """The key of a module's parameters and buffers (never lazy conjugate or negative views)."""
    flat += tensors
    return tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in tensors)


def is_tensor_key(x: Any) -> bool:
    """Whether ``x`` is the part of a key describing one tensor (``value_key``)."""
    return type(x) is tuple and len(x) == 4 and type(x[0]) is torch.Size


def tensor_keys(key: Any, out: list | None = None) -> list[tuple]:
    """The parts of a key describing tensors, in flat-input order."""
    out = out if out is not None else []
    if is_tensor_key(key):
        out.append(key)
    elif type(key) is tuple:
        for v in key:
            tensor_keys(v, out)
    return out


def lazy_view_inputs(key: Any) -> list[int]:
    """Positions, among the flat inputs, of the tensors whose key says they carry a lazy conjugate or negative bit
    (``value_key``): a program gets them resolved (``resolve_conj``/``resolve_neg``)."""
    return [i for i, k in enumerate(tensor_keys(key)) if type(k[1]) is tuple]


def resolving_lazy_views(run, positions: list[int], written: frozenset[int]):
    """``run`` given resolved copies of the inputs at ``positions`` (conjugate or negative views, whose bit compiled
    code would ignore); those the program writes to are copied back into the caller's tensors, as eager writes
    through such views."""

    def run_resolved(flat):
        flat = list(flat)
        originals = [flat[i] for i in positions]
        for i in positions:
            flat[i] = flat[i].resolve_conj().resolve_neg()
        result = run(flat)
        for i, original in zip(positions, originals):
            if i in written:
                original.copy_(flat[i])
        return result

    return run_resolved


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
