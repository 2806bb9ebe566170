"""The gradient table: how each symbol is differentiated, in one place, keyed by symbol id.

A row holds at most one entry per *source*. ``linearize`` asks ``candidates(sym_id, executors)`` and takes the
first entry whose checker accepts the call and whose rule does not decline (``NotImplemented``), in this order:

1. an executor's rule (``register_implementation(..., grad_transform=)``), for the compilation's executors in
   their priority order;
2. ``register_grad`` (seed 001: the rule runs the forward and uses ``get_grad`` / ``put_grad``);
3. ``register_augmented_forward`` + ``register_backward`` (seed 000);
4. fulmen's own rules for torch-level symbols (``grad_rules.py``);
5. a prim's VJP (``autodiff.py``).

A symbol no entry covers is differentiated by PyTorch's autograd when it is an opaque (fallback) op, and
otherwise through its decomposition. An entry of convention ``NONE`` (or the ``NON_DIFFERENTIABLE`` tag) says
the symbol's outputs carry no gradient. Every registration API writes here; nothing else holds a rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from fulmen.core.symbol import Symbol


class Convention(Enum):
    """How a rule is called."""

    TRANSFORM = "transform"  # rule(*args, **kwargs): computes the forward, get_grad / put_grad inside
    RULE_ARGS = "rule_args"  # rule(RuleArgs): as TRANSFORM, the arguments bound to the symbol's signature
    AUGMENTED = "augmented"  # rule(*args, **kwargs) -> (primal, saved); backward(*saved, *cotangents) -> grads
    VJP = "vjp"  # rule(bsym, cotangent) -> one gradient (or None) per parameter of the prim
    NONE = "none"  # not differentiable: the outputs carry no gradient


class Source(Enum):
    """Where an entry came from; the lookup order after executors' entries is this enum's order."""

    REGISTER_GRAD = "register_grad"
    AUGMENTED = "augmented"
    BUILTIN = "builtin"
    PRIM = "prim"


_SOURCES = tuple(Source)


@dataclass(frozen=True)
class GradEntry:
    """One way to differentiate a symbol. ``checker`` takes what the rule takes (the call's arguments, or
    ``RuleArgs`` for ``RULE_ARGS``) and says whether the rule covers the call."""

    rule: Callable | None
    convention: Convention
    backward: Callable | None = None  # AUGMENTED only
    checker: Callable | None = None


#: sym id -> {Source or executor object: entry}; executors are keyed by identity (two unregistered executors
#: may share a name)
_rows: dict[Any, dict[Any, GradEntry]] = {}


def sym_id(sym_or_id: Any) -> Any:
    """The table's key for a symbol or an id."""
    return sym_or_id.id if isinstance(sym_or_id, Symbol) else sym_or_id


def get(sym_or_id: Any, source: Any) -> GradEntry | None:
    """The entry ``source`` (a ``Source`` or an executor) gave the symbol, if any."""
    row = _rows.get(sym_id(sym_or_id))
    return row.get(source) if row is not None else None


def put(sym_or_id: Any, source: Any, entry: GradEntry | None) -> GradEntry | None:
    """Set (``None``: remove) the entry of ``source`` for the symbol; returns the entry it replaces."""
    key = sym_id(sym_or_id)
    row = _rows.setdefault(key, {})
    old = row.pop(source, None)
    if entry is not None:
        row[source] = entry
    elif not row:
        del _rows[key]
    return old


def put_augmented(sym_or_id: Any, *, forward: Callable | None = None, backward: Callable | None = None) -> None:
    """Add the forward or the backward half of a seed-000 rule (each registered by its own decorator)."""
    entry = get(sym_or_id, Source.AUGMENTED) or GradEntry(None, Convention.AUGMENTED)
    changes = {"rule": forward} if forward is not None else {}
    changes |= {"backward": backward} if backward is not None else {}
    put(sym_or_id, Source.AUGMENTED, replace(entry, **changes))


def mark_non_differentiable(*ids: Any) -> None:
    """Declare symbols (by id) whose outputs carry no gradient."""
    for i in ids:
        put(i, Source.PRIM, GradEntry(None, Convention.NONE))


def is_non_differentiable(sym_or_id: Any) -> bool:
    entry = get(sym_or_id, Source.PRIM)
    return entry is not None and entry.convention is Convention.NONE


def candidates(sym_or_id: Any, executors: Sequence = ()) -> list[GradEntry]:
    """The symbol's entries in lookup order (see the module docstring); ``NONE`` entries are left out."""
    row = _rows.get(sym_or_id.id if isinstance(sym_or_id, Symbol) else sym_or_id)
    if not row:
        return []
    found = [row[ex] for ex in executors if ex in row]
    found += [e for source in _SOURCES if (e := row.get(source)) is not None and e.convention is not Convention.NONE]
    return found


def has_user_rule(sym_or_id: Any) -> bool:
    """Whether ``register_grad`` or a seed-000 augmented forward/backward covers the symbol."""
    row = _rows.get(sym_id(sym_or_id)) or {}
    return Source.REGISTER_GRAD in row or Source.AUGMENTED in row


class VJPRules(Mapping):
    """The prims' VJP entries as a mapping ``prim id -> rule(bsym, cotangent)``: reads and writes go to the
    table (``autodiff.vjp_rules``)."""

    def __getitem__(self, pid):
        entry = get(pid, Source.PRIM)
        if entry is None or entry.convention is not Convention.VJP:
            raise KeyError(pid)
        return entry.rule

    def __setitem__(self, pid, rule: Callable) -> None:
        put(pid, Source.PRIM, GradEntry(rule, Convention.VJP))

    def __delitem__(self, pid) -> None:
        if pid not in self:
            raise KeyError(pid)
        put(pid, Source.PRIM, None)

    def __iter__(self):
        return iter([k for k, row in _rows.items() if (e := row.get(Source.PRIM)) and e.convention is Convention.VJP])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, pid) -> bool:
        entry = get(pid, Source.PRIM)
        return entry is not None and entry.convention is Convention.VJP


def rows() -> Mapping[Any, Mapping[Any, GradEntry]]:
    """A read-only view of the whole table (for inspection and tests)."""
    return _rows
