"""``torch.library`` custom ops inside traced programs, with no registration on fulmen's side.

A ``torch.library.custom_op`` (or ``triton_op``) called on proxies -- as the ``CustomOpDef`` object or as
``torch.ops.ns.name`` -- is recorded as one symbol named after the op, printed as the op itself::

    t0 = torch.ops.lynx_cortex.softmax.default(x)  # t0: "cpu f32[2, 600]"

Its metadata comes from the op's fake implementation (``@op.register_fake``), the torch executor runs it by
calling the op, and its gradient is the op's own ``register_autograd`` formula (``fulmen.transforms.custom_op_grads``,
which this module tells of each symbol it makes: ``when_symbol_made``). Ops that mutate arguments
(``mutates_args``) are functionalized: a functional symbol runs the op on clones of the mutated arguments and
returns their new values, which then replace the arguments (``fulmen.torch.inplace.mutate``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags, Symbol
from fulmen.core.utils import check

#: qualified op name ("ns::name") -> what proxies' torch calls of the op record
_recorders: dict[str, Callable] = {}

_made: list[tuple[Symbol, Any]] = []  # (symbol, CustomOpDef) of each op that mutates nothing, in the order made
_when_made: list[Callable[[Symbol, Any], None]] = []


def when_symbol_made(callback: Callable[[Symbol, Any], None]) -> None:
    """Call ``callback(symbol, opdef)`` for the symbol of every custom op that mutates nothing, made so far or later:
    how a higher layer attaches what it keeps per op (``fulmen.transforms.custom_op_grads`` registers the op's
    ``register_autograd`` formula as the symbol's gradient)."""
    _when_made.append(callback)
    for sym, opdef in list(_made):
        callback(sym, opdef)


def _opdefs() -> dict:
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # an older torch without CustomOpDef: nothing is a custom op
        return {}
    return OPDEFS


def _qualname(func: Any) -> str | None:
    if isinstance(func, torch._ops.OpOverload):
        return func._name
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name
    return getattr(func, "_qualname", None) if type(func).__name__ == "CustomOpDef" else None


def custom_op_def(func: Any):
    """The ``CustomOpDef`` behind a custom op given as the object, an ``OpOverload`` or an ``OpOverloadPacket``;
    ``None`` for anything else (aten ops included)."""
    name = _qualname(func)
    if name is None:
        return None
    opdef = _opdefs().get(name)
    if opdef is None:
        return None
    if isinstance(func, torch._ops.OpOverload) and func is not opdef._opoverload:
        return None
    return opdef


def is_custom_op(func: Any) -> bool:
    return custom_op_def(func) is not None


def record(func: Any) -> Callable:
    """The callable that records ``func`` (a custom op in any of its forms) into the current trace."""
    opdef = custom_op_def(func)
    check(opdef is not None, lambda: f"{func!r} is not a torch.library custom op", TypeError)
    recorder = _recorders.get(opdef._qualname)
    if recorder is None:
        recorder = _recorders[opdef._qualname] = _make_recorder(opdef)
    return recorder


# ---------------------------------------------------------------------------------------------------------
# arguments

def _schema_parts(opdef) -> tuple[list, list]:
    schema = opdef._opoverload._schema
    return ([a for a in schema.arguments if not a.kwarg_only], [a for a in schema.arguments if a.kwarg_only])


def normalize_arguments(opdef, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(positional inputs, keyword-only inputs)`` as the dispatcher hands them to ``setup_context``: every
    schema argument present, defaults filled in, keywords given for positional parameters moved into place."""
    positional, kw_only = _schema_parts(opdef)
    name = opdef._qualname
    check(len(args) <= len(positional), lambda: f"{name}() takes {len(positional)} positional arguments but "
          f"{len(args)} were given", TypeError)
    known = {a.name for a in positional} | {a.name for a in kw_only}
    unknown = sorted(set(kwargs) - known)
    check(not unknown, lambda: f"{name}() got unexpected keyword argument(s) {unknown}", TypeError)
    out = list(args)
    for a in positional[len(args):]:
        if a.name in kwargs:
            out.append(kwargs[a.name])
        else:
            check(a.has_default_value(), lambda: f"{name}() missing required argument {a.name!r}", TypeError)
            out.append(a.default_value)
    kw = {a.name: kwargs[a.name] if a.name in kwargs else a.default_value for a in kw_only}
    return tuple(out), kw


def mutated_arguments(opdef) -> list[str]:
    """Names of the arguments the op writes to (its ``mutates_args``)."""
    schema = opdef._opoverload._schema
    return [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]


# ---------------------------------------------------------------------------------------------------------
# metadata

def _check_fake(opdef) -> None:
    check(getattr(opdef, "_abstract_fn", None) is not None, lambda: (
        f"the custom op {opdef._qualname} has no fake implementation, so fulmen cannot compute the shapes and "
        f"dtypes of its outputs while tracing. Add one with @{opdef._name}.register_fake (or "
        f"torch.library.register_fake({opdef._qualname!r})): a function taking the same arguments and returning "
        "empty tensors of the right shape, dtype and device, e.g. `return torch.empty_like(x)`."), RuntimeError)


def _meta(opdef, func: Callable) -> Callable:
    from fulmen.torch.fallback import _fake_meta

    fake = _fake_meta(func, opdef._qualname.replace("::", "."))

    def meta(*args, **kwargs):
        _check_fake(opdef)
        out = fake(*args, **kwargs)
        return _no_grad_flags(out)

    return meta


def _no_grad_flags(out):
    if isinstance(out, TensorProxy):
        out.requires_grad = False
        return out
    if isinstance(out, (tuple, list)):
        return type(out)(_no_grad_flags(o) for o in out)
    return out


# ---------------------------------------------------------------------------------------------------------
# symbols

def _pure_symbol(opdef) -> Symbol:
    op = opdef._opoverload
    ns, name = opdef._qualname.split("::")
    sym = Symbol(name=f"{name}.{op._overloadname}", meta=_meta(opdef, op), id=f"custom_op:{ns}.{name}",
                 is_prim=True, tags=(OpTags.FALLBACK,), module=f"torch.ops.{ns}", torch_fns=(op,),
                 torch_impl=op)  # the torch executor calls the op itself; traces print torch.ops.ns.name.default
    _made.append((sym, opdef))
    for callback in _when_made:
        callback(sym, opdef)
    return sym


def _functional_symbol(opdef, mutated: list[str]) -> Symbol:
    """A symbol running a mutating op on clones: returns (the op's output, new values of mutated arguments)."""
    op = opdef._opoverload
    positional, _ = _schema_parts(opdef)
    index = {a.name: i for i, a in enumerate(positional)}

    def functional(*args, **kwargs):
        args, kwargs = list(args), dict(kwargs)
        written = []
        for n in mutated:
            if n in index and index[n] < len(args):
                args[index[n]] = args[index[n]].clone()
                written.append(args[index[n]])
            else:
                kwargs[n] = kwargs[n].clone()
                written.append(kwargs[n])
        return op(*args, **kwargs), tuple(written)

    ns, name = opdef._qualname.split("::")
    functional.__name__ = functional.__qualname__ = f"{name}_functional"

    def meta(*args, **kwargs):
        _check_fake(opdef)
        out = _meta(opdef, functional)(*args, **kwargs)
        return out[0], tuple(out[1])

    sym = Symbol(name=f"{name}_functional", meta=meta, id=f"custom_op:{ns}.{name}.functional", is_prim=True,
                 tags=(OpTags.FALLBACK,), module=None, torch_fns=(functional,), torch_impl=functional)
    return sym


def _make_recorder(opdef) -> Callable:
    mutated = mutated_arguments(opdef)
    if not mutated:
        return _pure_symbol(opdef)
    sym = _functional_symbol(opdef, mutated)

    def record_mutating(*args, **kwargs):
        from fulmen.torch.inplace import mutate

        pos, kw = normalize_arguments(opdef, args, kwargs)
        positional, _ = _schema_parts(opdef)
        by_name = {a.name: v for a, v in zip(positional, pos)} | kw
        out, new_values = sym(*args, **kwargs)
        for n, new in zip(mutated, new_values):
            target = by_name[n]
            check(isinstance(target, TensorProxy), lambda: f"{opdef._qualname} mutates {n!r}, which is not a "
                  f"tensor ({type(target).__name__})", TypeError)
            mutate(target, new)
        return out

    record_mutating.__name__ = sym.name
    return record_mutating
