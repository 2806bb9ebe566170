"""Opaque torch functions that write their arguments.

Some ATen functions without a torch-language rule update tensors they are given rather than (or besides) returning
new ones: ``torch._foreach_lerp_(ema, params, w)`` (EMA updates), ``torch._foreach_clamp_min_`` (``clip_grad_value_``),
``torch.fused_moving_avg_obs_fake_quant`` (the running minimum, maximum, scale and zero point of a QAT observer).
Recorded as a plain opaque op, such a call would be a pure function to every pass: dead-code elimination drops it
when nothing reads its result, and the backward, which runs the op again under PyTorch's autograd, would update the
statistics a second time. The ATen schema says which arguments are written (``Tensor(a!)``, ``Tensor(a!)[]``), so
such a call is recorded as its functional form, as a custom op that mutates is (``fulmen.torch.custom_ops``): one
opaque op running the function on copies of the written tensors and returning the copies, whose values then
replace the arguments' (``fulmen.torch.inplace.mutate``), so later reads, the write-back to the caller's tensors
and every pass see the update, and running it again writes only copies.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch

from fulmen.core.proxies import TensorProxy, _user_location
from fulmen.core.utils import RunsEagerly, check

#: callable -> ((position, name, is a list), ...) of the arguments its schema writes, or () when none or unknown
_written: dict = {}
#: callable -> its functional recorder
_recorders: dict = {}


def _schemas(func: Callable) -> list:
    if isinstance(func, torch._ops.OpOverload):
        return [func._schema]
    if isinstance(func, torch._ops.OpOverloadPacket):
        return [getattr(func, name)._schema for name in func.overloads()]
    # torch.foo, torch.linalg.foo, torch.Tensor.foo (functions of torch's C modules, methods of its C tensor): the
    # ATen operator of that name (torch.linalg.multi_dot is aten::linalg_multi_dot)
    if _of_torch_c(func):
        try:
            return list(torch._C._jit_get_schemas_for_operator(f"aten::{func.__name__}"))
        except RuntimeError:
            return []
    return []


def _of_torch_c(func: Callable) -> bool:
    if isinstance(func, types.BuiltinFunctionType):
        owner = func.__self__
        return (
            owner is None
            or isinstance(owner, type)
            or (isinstance(owner, types.ModuleType) and owner.__name__.startswith("torch._C"))
        )
    return isinstance(func, types.MethodDescriptorType) and func.__objclass__ is torch._C.TensorBase


def _writes_of(schema) -> tuple | None:
    """The positional arguments ``schema`` writes, or None for an ``out=`` form (writes keyword-only arguments)."""
    written = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            if a.kwarg_only:
                return None
            written.append((i, a.name, isinstance(a.type, torch.ListType)))
    return tuple(written)


def written_arguments(func: Callable) -> tuple:
    """``((position, name, is_list), ...)``: the positional arguments ``func``'s ATen schema writes; ``()`` when it
    writes none, has no schema, or its forms disagree on which (left to the plain opaque op)."""
    found = _written.get(func)
    if found is None:
        forms = {w for w in map(_writes_of, _schemas(func)) if w is not None}
        found = forms.pop() if len(forms) == 1 else ()
        _written[func] = found
    return found


def computes_tensors(func: Callable) -> bool:
    """Whether ``func`` is an ATen function whose every form returns tensors (``torch._foreach_norm``): called on
    tensors the traced code reads from globals, it is an operation of the program, not a constant of it."""
    forms = [s for s in _schemas(func) if _writes_of(s) is not None]
    return bool(forms) and all(s.returns and all(_is_tensors(r.type) for r in s.returns) for s in forms)


def _is_tensors(t) -> bool:
    return isinstance(t, torch.TensorType) or (
        isinstance(t, torch.ListType) and isinstance(t.getElementType(), torch.TensorType)
    )


def _copy(x):
    from fulmen.torch.fallback import _laid_out_copy

    if isinstance(x, (list, tuple)):
        return [_copy(t) for t in x]
    return _laid_out_copy(x) if isinstance(x, torch.Tensor) else x


def _argument(args: tuple, kwargs: dict, position: int, name: str):
    return args[position] if position < len(args) else kwargs.get(name)


def _functional(func: Callable, written: tuple) -> Callable:
    """``func`` run on copies of the tensors it writes: returns ``(its result, (the written copies, ...))``."""

    def functional(*args, **kwargs):
        args, kwargs = list(args), dict(kwargs)
        copies = []
        for position, name, _ in written:
            if position < len(args):
                args[position] = _copy(args[position])
                copies.append(args[position])
            elif name in kwargs:
                kwargs[name] = _copy(kwargs[name])
                copies.append(kwargs[name])
        return func(*args, **kwargs), tuple(copies)

    name = getattr(func, "__name__", "op").rstrip("_")
    functional.__name__ = functional.__qualname__ = f"{name}_functional"
    functional.__module__ = "fulmen.torch.argument_writes"
    # a kernel may resize what it writes where its fake kernel does not (a per-channel observer's scale, [1] before
    # its first call): the torch executor checks the first call's results against the meta
    functional.kernel_may_disagree_with_fake = True
    functional.writes_of = func  # the kernel it runs: its layout rule (fulmen.torch.kernel_layouts) is this one's
    return functional


def recorder(func: Callable) -> Callable:
    """What a traced call of ``func`` (which writes the arguments ``written_arguments`` names) records."""
    rec = _recorders.get(func)
    if rec is not None:
        return rec
    from fulmen.torch.fallback import opaque_symbol

    written = written_arguments(func)
    sym = opaque_symbol(_functional(func, written))

    def record_writes(*args, **kwargs):
        from fulmen.torch.inplace import mutate

        targets = [_argument(args, kwargs, position, name) for position, name, _ in written]
        out, new_values = sym(*args, **kwargs)
        for (_, name, is_list), target, new in zip(written, targets, new_values):
            for t, value in zip(target, new) if is_list else ((target, new),):
                check(
                    isinstance(t, torch.Tensor),
                    lambda: (
                        f"{getattr(func, '__name__', func)} writes {name!r}, which is not a tensor ({type(t).__name__})"
                    ),
                    TypeError,
                )
                if tuple(t.shape) != tuple(value.shape):
                    raise _resizes(func, name, t, value)
                mutate(t, value)
        returned = _returned_argument(func)
        # torch.relu_(t) returns t itself, as eager's in-place functions do
        return out if returned is None else targets[returned]

    record_writes.__name__ = sym.name
    _recorders[func] = record_writes
    return record_writes


def _resizes(func: Callable, name: str, target: torch.Tensor, new: TensorProxy) -> RunsEagerly:
    # a per-channel observer's first call resizes its scale from [1] to one per channel; a program cannot give a
    # tensor a new shape, and the next call, keyed by the new shape, compiles
    return RunsEagerly(
        f"{getattr(func, '__name__', func)} resizes its argument {name!r} from {list(target.shape)} to "
        f"{list(new.shape)} (at {_user_location()}); a compiled program cannot change a tensor's shape in place, so "
        "calls with these shapes run eagerly"
    )


def _returned_argument(func: Callable) -> int | None:
    """Which written argument (an index into ``written_arguments``) every form of ``func`` returns itself, if any."""
    found = set()
    for schema in _schemas(func):
        if not _writes_of(schema):
            continue
        sets = [a.alias_info.before_set for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        if not schema.returns and len(sets) == 1 and isinstance(schema.arguments[0].type, torch.ListType):
            found.add(0)  # torch._foreach_add_(xs, 1) declares no result and returns xs
            continue
        ret = schema.returns[0].alias_info if len(schema.returns) == 1 else None
        found.add(sets.index(ret.before_set) if ret is not None and ret.before_set in sets else None)
    return found.pop() if len(found) == 1 else None
