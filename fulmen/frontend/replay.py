"""Replaying a decomposition recorded earlier in the same trace, instead of running it again.

A model's layers call the same torch operations on tensors of the same shapes over and over: a 4-layer GPT calls
``layer_norm`` 9 times and ``scaled_dot_product_attention`` 4 times, each time on inputs that differ only in name.
A torch-language symbol's decomposition depends on nothing but its arguments' metadata and values (and the grad
mode and default dtype), so the second and later calls can copy the bound symbols of the first with fresh proxies
in place of its intermediate values. The copy is what running the decomposition again would record, name for
name: fresh proxies are named in the order the first call made them. A copy costs a fraction of a run while
tracing, and tracing is most of what a model's first call costs beyond eager's (figures: docs/performance.md,
"Tracing").

Only calls made by user code (the outermost scope) are remembered, and only when copying cannot differ from
running:

- every argument is a tensor proxy with concrete sizes, a number, a string, None, a dtype, a device, or a tuple or
  list of those; the key holds each tensor's sizes, dtype, device, requires_grad, strides and lazy bits, and
  which arguments are the same tensor;
- the call captured no tensor and updated nothing in place (checked as it returns);
- nothing in its decomposition has a post hook (view ops: aliasing and strides) other than the elementwise ops'
  (``layout_only``: a copy gives each value it makes the strides the recorded one had, which the arguments'
  strides in the key decide), draws random numbers, has a side effect or is an opaque torch op, and every proxy
  it reads is an argument or a value it made (checked when a second call with the same key comes: most calls
  come once, and never pay for it).

Switches a decomposition might read besides its arguments (``torch.backends`` flags) are taken not to change
between two calls of one trace. The ``replay`` option (``fulmen.jit(f, replay=False)``, or ``FULMEN_REPLAY=0``)
off runs every call.
"""

from __future__ import annotations

from typing import Any

import torch

from fulmen.core.codeutils import outputs_of
from fulmen.core.draws import is_draw
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, OpTags, Symbol
from fulmen.core.trace import Trace
from fulmen.torch.shape import layout_of, set_strides

_NEVER_COPIED = frozenset((OpTags.SIDE_EFFECT, OpTags.FALLBACK, OpTags.IN_PLACE, OpTags.COMMUNICATION))
_SCALARS = frozenset((int, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout))


class _Unkeyable(Exception):
    pass


def _describe(x: Any, parts: list, tensors: list[TensorProxy], seen: dict[int, int]) -> None:
    kind = type(x)
    if kind is TensorProxy:
        index = seen.get(id(x))
        if index is not None:
            parts.append(index)  # the same tensor as an earlier argument
            return
        shape = tuple(x.shape)
        if any(type(s) is not int for s in shape) or x.replaced_by is not None:
            raise _Unkeyable
        seen[id(x)] = len(tensors)
        tensors.append(x)
        parts.append((shape, x.dtype, x.device, x.requires_grad, x.origin, layout_of(x), x.lazy_bits))
    elif kind is float:
        parts.append((float, repr(x)))  # 0.0 and -0.0 are equal keys otherwise
    elif kind is complex:
        parts.append((complex, repr(x)))
    elif kind in _SCALARS:
        parts.append((kind, x))
    elif kind is tuple or kind is list or kind is torch.Size:
        parts.append((kind, len(x)))
        for v in x:
            _describe(v, parts, tensors, seen)
    else:
        raise _Unkeyable


class Replays:
    """The decompositions recorded so far in one trace (kept by its ``UserTracer``), by the key of their call."""

    def __init__(self, trace: Trace):
        self.trace = trace
        # key -> the recipe, the first call (compiled into a recipe when a second call comes), or None: not replayable
        self._recorded: dict[tuple, _Recipe | tuple[BoundSymbol, list[TensorProxy]] | None] = {}

    def lookup(self, sym: Symbol, args: tuple, kwargs: dict) -> Call | None:
        """The call of ``sym`` on these arguments, with ``bsym`` set when it is a copy of an earlier one; None when
        it can be neither copied nor remembered."""
        if (sym.post_hook is not None and not getattr(sym.post_hook, "layout_only", False)) or sym.is_prim:
            return None
        parts: list = [sym, torch.is_grad_enabled(), torch.get_default_dtype()]
        tensors: list[TensorProxy] = []
        seen: dict[int, int] = {}
        try:
            _describe(args, parts, tensors, seen)
            for name, value in kwargs.items():
                parts.append(name)
                _describe(value, parts, tensors, seen)
        except _Unkeyable:
            return None
        key = tuple(parts)
        recipe = self._recorded.get(key, False)
        if recipe is False:
            return Call(self, key, tensors)
        if type(recipe) is tuple:  # the second call: compile the first (most calls come once: they never pay this)
            bsym, template = recipe
            made: dict[int, tuple] = {}
            recipe = self._recorded[key] = (_Recipe(bsym, template, made)
                                            if _replayable(bsym, {id(t) for t in template}, made) else None)
        if recipe is None:
            return None
        call = Call(self, key, tensors)
        call.bsym = recipe.replay(tensors, self.trace)
        return call


class Call:
    """One call looked up in ``Replays``: ``bsym`` is its copy, or None and ``remember(bsym)`` follows the run."""

    __slots__ = ("replays", "key", "tensors", "bsym", "n_args", "mutations")

    def __init__(self, replays: Replays, key: tuple, tensors: list[TensorProxy]):
        self.replays, self.key, self.tensors = replays, key, tensors
        self.bsym: BoundSymbol | None = None
        self.n_args, self.mutations = len(replays.trace.args), replays.trace.mutations

    def remember(self, bsym: BoundSymbol) -> None:
        """Keep ``bsym``, just recorded by running the call, for later calls with the same key, unless the call
        captured a tensor (a new input of the trace) or updated a value in place. The rest of what copying needs
        (``_replayable``) is checked when a second call comes."""
        trace = self.replays.trace
        exact = len(trace.args) == self.n_args and trace.mutations == self.mutations
        self.replays._recorded[self.key] = (bsym, self.tensors) if exact else None


def _replayable(bsym: BoundSymbol, known: set[int], made: dict[int, tuple]) -> bool:
    """Whether every operation in ``bsym`` may be copied and reads only ``known`` proxies (the arguments, then the
    values made inside). ``made`` gets each value it makes, in the order they were made: (name prefix, sizes,
    dtype, device, requires_grad). In-place updates inside the call were ruled out when it was remembered; later
    ones (of its arguments or results) do not matter: a copy reads the new call's arguments and makes new values."""
    sym, tags = bsym.sym, bsym.sym.tags
    if (sym.post_hook is not None and not getattr(sym.post_hook, "layout_only", False)) \
            or not _NEVER_COPIED.isdisjoint(tags):
        return False
    if is_draw(bsym):  # a composite that merely can draw is looked into below
        return False
    for p in bsym.flat_args:
        if type(p) is not TensorProxy or id(p) not in known:
            return False
    for sub in bsym.subsymbols:
        if not _replayable(sub, known, made):
            return False
    for p in bsym.flat_proxy_outs:
        if id(p) in known:
            continue  # an argument returned as it is
        if type(p) is not TensorProxy or p.view_of is not None or p.lazy_bits is not None:
            return False
        known.add(id(p))
        made[id(p)] = (p.name.rstrip("0123456789") or "t", p.shape, p.dtype, p.device, p.requires_grad, layout_of(p))
    return True


# How a recipe rebuilds one argument or output: kept as it is (numbers, tuples of numbers), the proxy in a slot,
# a copy (a list: the copies must not share one the caller may change), or rebuilt around its proxies.
_KEEP, _SLOT, _COPY, _REBUILD = range(4)


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class _Recipe:
    """A recorded call compiled for copying: its values become slots (the arguments first, then the values the
    decomposition made, in the order it made them) and each bound symbol a tuple of how to rebuild its parts."""

    __slots__ = ("fresh", "root")

    def __init__(self, bsym: BoundSymbol, tensors: list[TensorProxy], made: dict[int, tuple]):
        slots = {id(t): i for i, t in enumerate(tensors)}
        for i, key in enumerate(made):
            slots[key] = len(tensors) + i
        self.fresh = list(made.values())
        self.root = _compile(bsym, slots)

    def replay(self, tensors: list[TensorProxy], trace: Trace) -> BoundSymbol:
        slots = list(tensors)
        for prefix, shape, dtype, device, requires_grad, strides in self.fresh:  # named in the order running it would
            p = TensorProxy(trace.make_name(prefix), shape=shape, dtype=dtype, device=device,
                            requires_grad=requires_grad)
            if strides is not None:
                set_strides(p, strides)
            slots.append(p)
        return _build(self.root, slots)


def _spec(x: Any, slots: dict[int, int]) -> tuple[int, Any]:
    if type(x) is TensorProxy:
        return _SLOT, slots[id(x)]
    if type(x) is list and all(type(v) in _SCALARS or type(v) is float for v in x):
        return _COPY, x
    if isinstance(x, (tuple, list, dict)) and (outputs_of(x) or _holds_mutable(x)):
        return _REBUILD, _template(x, slots)
    return _KEEP, x


def _holds_mutable(x: Any) -> bool:
    if isinstance(x, (list, dict)):
        return True
    return isinstance(x, tuple) and any(_holds_mutable(v) for v in x)


class _Struct:
    """A tuple type's value holding proxies (``torch.return_types.topk``, a namedtuple), rebuilt as that type."""

    __slots__ = ("kind", "items")

    def __init__(self, kind: type, items: list):
        self.kind, self.items = kind, items


def _template(x: Any, slots: dict[int, int]) -> Any:
    """``x`` with its proxies replaced by slots."""
    kind = type(x)
    if kind is TensorProxy:
        return _Slot(slots[id(x)])
    if kind is tuple or kind is list:
        return kind(_template(v, slots) for v in x)
    if kind is dict:
        return {k: _template(v, slots) for k, v in x.items()}
    if isinstance(x, tuple):
        return _Struct(kind, [_template(v, slots) for v in x])
    return x


def _fill(x: Any, slots: list) -> Any:
    kind = type(x)
    if kind is _Slot:
        return slots[x.index]
    if kind is tuple or kind is list:
        return kind(_fill(v, slots) for v in x)
    if kind is dict:
        return {k: _fill(v, slots) for k, v in x.items()}
    if kind is _Struct:
        items = [_fill(v, slots) for v in x.items]
        return x.kind(*items) if hasattr(x.kind, "_fields") else x.kind(items)
    return x


def _compile(bsym: BoundSymbol, slots: dict[int, int]) -> tuple:
    return (bsym.sym, tuple(_spec(a, slots) for a in bsym.args),
            tuple((k, *_spec(v, slots)) for k, v in bsym.kwargs.items()), _spec(bsym.output, slots),
            tuple(_compile(s, slots) for s in bsym.subsymbols), bsym.no_grad)


def _value(how: int, x: Any, slots: list) -> Any:
    if how == _KEEP:
        return x
    if how == _SLOT:
        return slots[x]
    if how == _COPY:
        return x.copy()
    return _fill(x, slots)


def _build(recipe: tuple, slots: list) -> BoundSymbol:
    sym, args, kwargs, output, subsymbols, no_grad = recipe
    return BoundSymbol(sym, tuple([_value(how, x, slots) for how, x in args]),
                       {k: _value(how, x, slots) for k, how, x in kwargs}, _value(*output, slots),
                       tuple([_build(s, slots) for s in subsymbols]), no_grad=no_grad)
