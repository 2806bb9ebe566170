"""Objects that hold tensors: passed into traced code, updated by it, created and returned by it.

A Hugging Face cache is the model case: ``DynamicCache`` holds a list of layers, each holding ``keys`` and
``values``; a forward call appends to them (``self.keys = torch.cat([self.keys, k], -2)``) or writes into them in
place (``StaticCache``: ``self.keys.index_copy_(2, pos, k)``), and returns the cache in its output.

- Passed in: the cache key walks an instance of a user class (``fulmen.frontend.cache.object_key``): its class,
  member names, lists and dicts, and its tensors, which are inputs like any other (keyed by shape, dtype, device;
  their sizes may become dynamic). The prologue checks the same structure on every call. While tracing, proxies
  stand in the caller's objects in place of their tensors (``ObjectSwaps``); when the function returns, every object
  (and list and dict inside one) is put back as it was, and what the function left in it is replayed by every call
  of the program: members rebound (to tensors the program returns, to the call's own objects, to objects rebuilt
  from a template, or to constants) and lists and dicts refilled, in place, so the caller's object ends as eager
  leaves it. Writes into the caller's tensors are copied back as for any input (``tracing._write_back_mutated_inputs``).
- Created and returned (directly or inside tuples, lists, dicts, ``ModelOutput``): replaced in the program's output
  by a marker; the program returns the tensors the object holds, and every call builds a new object of the same class
  with the same members (``ObjectResults.finish``).

The program's output is then ``(result with markers, [object tensors])``; the prologue returns, after the tensor
inputs, the call's objects the program updates or returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fulmen.core.proxies import Proxy, TensorProxy
from fulmen.core.symbolic import SYMBOLIC_TYPES, is_symbolic
from fulmen.frontend.cache import OBJECT, _slots, is_holder, is_tensor_key, member_names, member_values, value_key
from fulmen.frontend.dynamic import IntInputs

_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined by Python code
#: What a returned object is replaced by in the program's output; each call puts the rebuilt object back there.
_MARKER = 0
#: How many values a template may hold (an object graph larger than that is not rebuilt: an error).
_MAX_TEMPLATE = 100_000


class _Holder:
    """One of the caller's objects, lists or dicts that held proxies while tracing: its state before and after."""

    __slots__ = ("obj", "saved_dict", "saved_slots", "saved_items", "swapped", "ints")

    def __init__(self, obj: Any):
        self.obj = obj
        if isinstance(obj, list):
            self.saved_items = list(obj)
        elif isinstance(obj, dict):
            self.saved_items = list(obj.items())
        else:
            attrs = getattr(obj, "__dict__", None)
            self.saved_dict = dict(attrs) if attrs is not None else None
            self.saved_slots = [(n, _slot(obj, n)) for n in _slots(type(obj))]
        self.swapped: list[tuple[Any, Any]] = []
        self.ints: dict[Any, tuple[int, int]] = {}  # member -> (its int slot, its value), for ints it held

    def state(self) -> list[tuple[Any, Any]]:
        """(name, value) pairs: members of an object, (index, item) of a list, (key, value) of a dict."""
        obj = self.obj
        if isinstance(obj, list):
            return list(enumerate(obj))
        if isinstance(obj, dict):
            return list(obj.items())
        return list(zip(member_names(obj), member_values(obj)))

    def restore(self) -> None:
        obj = self.obj
        if isinstance(obj, list):
            obj[:] = self.saved_items
        elif isinstance(obj, dict):
            _refill(obj, self.saved_items)
        else:
            if self.saved_dict is not None:
                attrs = obj.__dict__
                attrs.clear()
                attrs.update(self.saved_dict)
            for name, value in self.saved_slots:
                _set_slot(obj, name, value)


_UNSET = object()


def _slot(obj: Any, name: str) -> Any:
    try:
        return object.__getattribute__(obj, name)
    except AttributeError:
        return _UNSET


def _set_slot(obj: Any, name: str, value: Any) -> None:
    if value is _UNSET:
        if _slot(obj, name) is not _UNSET:
            object.__delattr__(obj, name)
    else:
        object.__setattr__(obj, name, value)


def _refill(d: dict, items: list[tuple[Any, Any]]) -> None:
    """Give ``d`` exactly ``items``, through its own ``__setitem__`` (a ``ModelOutput`` keeps its attributes in step
    with its items; it forbids ``clear``, which only a changed set of keys needs: done as its builtin base does)."""
    if list(d) != [k for k, _ in items]:
        base = next(b for b in type(d).__mro__ if not b.__flags__ & _HEAPTYPE and issubclass(b, dict))
        base.clear(d)
    for k, v in items:
        d[k] = v


def _set_member(obj: Any, name: str, value: Any) -> None:
    """Set a member without the class's ``__setattr__``: its side effects were traced and are replayed as members."""
    attrs = getattr(obj, "__dict__", None)
    if attrs is not None and name not in _slots(type(obj)):
        attrs[name] = value
    else:
        object.__setattr__(obj, name, value)


def _del_member(obj: Any, name: str) -> None:
    attrs = getattr(obj, "__dict__", None)
    if attrs is not None and name in attrs:
        del attrs[name]
    elif _slot(obj, name) is not _UNSET:
        object.__delattr__(obj, name)


class ObjectSwaps:
    """While tracing: the caller's objects with proxies in place of their tensors, in the order the cache key's walk
    numbers them (``fulmen.frontend.cache.object_key``), so that the prologue can name the same ones."""

    def __init__(self, tensor_proxy: Callable[[torch.Tensor, str], TensorProxy],
                 int_input: IntInputs | None = None):
        self.tensor_proxy = tensor_proxy  # makes the next flat input (tracing.proxify)
        self.int_input = int_input if int_input is not None else IntInputs()  # numbers ints, gives symbolic ones
        self.holders: list[_Holder] = []
        self.seen: dict[int, int] = {}  # as the key's walk: id -> holder index

    def enter(self, x: Any, name: str) -> Any:
        """Swap proxies into ``x``, an instance of a user class met among the arguments (not inside another)."""
        key = value_key(x, [], dict(self.seen))
        if type(key) is tuple and len(key) == 4 and key[0] == OBJECT:
            self._object(x, key, name)
        return x  # an alias of an object met before, or one keyed by identity (its tensors are read as captured)

    def _register(self, x: Any) -> _Holder:
        self.seen[id(x)] = len(self.seen)
        holder = _Holder(x)
        self.holders.append(holder)
        return holder

    def _object(self, x: Any, key: tuple, name: str) -> None:
        _, _, names, keys = key
        holder = self._register(x)
        values = member_values(x)
        swapped = []
        for v, n, k in zip(values, names, keys):
            if type(v) is int and k == (int, v):
                holder.ints[n] = (self.int_input.count, v)
            swapped.append(self._member(v, k, f"{name}_{n}"))
        holder.swapped = list(zip(names, swapped))
        for n, v, s in zip(names, values, swapped):
            if s is not v:
                _set_member(x, n, s)

    def _member(self, v: Any, k: Any, name: str) -> Any:
        if is_tensor_key(k):
            return self.tensor_proxy(v, name)
        if type(k) is not tuple:
            return v
        if type(v) is int and k == (int, v):
            return self.int_input(v, name)
        if len(k) == 4 and k[0] == OBJECT:
            self._object(v, k, name)
            return v
        if len(k) != 2 or not isinstance(k[0], type) or type(k[1]) is not tuple:
            return v
        t, keys = k
        if issubclass(t, list):
            holder = self._register(v)
            swapped = [self._member(e, ke, f"{name}_{i}") for i, (e, ke) in enumerate(zip(v, keys))]
            holder.swapped = list(enumerate(swapped))
            for i, (e, s) in enumerate(zip(v, swapped)):
                if s is not e:
                    v[i] = s
            return v
        if issubclass(t, dict):
            holder = self._register(v)
            items = list(v.items())
            swapped = [(key, self._member(e, ke, f"{name}_{key}")) for (key, e), (_, ke) in zip(items, keys)]
            holder.swapped = swapped
            for (key, e), (_, s) in zip(items, swapped):
                if s is not e:
                    v[key] = s
            return v
        if issubclass(t, tuple) and t is not torch.Size:
            new = [self._member(e, ke, f"{name}_{i}") for i, (e, ke) in enumerate(zip(v, keys))]
            if all(a is b for a, b in zip(new, v)):
                return v
            return t(*new) if hasattr(v, "_fields") else t(new)
        return v

    def restore(self) -> list[list[tuple[Any, Any]]]:
        """Put the caller's objects back as they were before tracing; returns the state each was left in."""
        finals = [h.state() for h in self.holders]
        for h in reversed(self.holders):  # an object met twice (an alias) ends as it was first found
            h.restore()
        return finals

    def settle(self, result: Any) -> tuple[Any, ObjectResults | None]:
        """After the traced function returned: put the caller's objects back as they were, and describe what every
        call does with objects. Returns the program's result (``(result with markers, [object tensors])`` when
        objects are involved) and that description (None when none are)."""
        finals = self.restore()
        builder = _Templates({id(h.obj): i for i, h in enumerate(self.holders)})
        effects, rebound, rebound_ints = [], [], []
        for i, (h, final) in enumerate(zip(self.holders, finals)):
            if len(final) == len(h.swapped) and all(a[0] == b[0] and a[1] is b[1] for a, b in zip(final, h.swapped)):
                continue
            kind = "list" if isinstance(h.obj, list) else "dict" if isinstance(h.obj, dict) else "object"
            if kind == "object":  # the members rebound, added and removed
                before = dict(h.swapped)
                changed = [(n, builder.node(v)) for n, v in final if before.get(n, _UNSET) is not v]
                removed = tuple(n for n in before if n not in dict(final))
                rebound += [(before[n], v) for n, v in final
                            if isinstance(before.get(n), TensorProxy) and isinstance(v, TensorProxy)]
                rebound_ints += [(h.ints[n][0], h.ints[n][1], v) for n, v in final
                                 if n in h.ints and type(v) is int and v != h.ints[n][1]]
            else:  # a list or dict: refilled whole, in place
                changed, removed = [(n, builder.node(v)) for n, v in final], ()
            effects.append((i, kind, changed, removed))
        placed: list[tuple[tuple, Any]] = []
        result = builder.extract(result, (), placed)
        if not effects and not placed:
            return result, None
        used = sorted(builder.holders_used | {i for i, *_ in effects})
        objects = ObjectResults(effects=effects, placed=placed, holders=tuple(used), n_tensors=len(builder.tensors),
                                rebound=[(old.name, tuple(old.shape), tuple(new.shape)) for old, new in rebound],
                                rebound_ints=rebound_ints)
        return (result, builder.tensors), objects


class _Templates:
    """Turns values found after tracing into templates (nodes) that each call builds its values from."""

    def __init__(self, holder_ids: dict[int, int]):
        self.holder_ids = holder_ids
        self.tensors: list[TensorProxy] = []
        self.holders_used: set[int] = set()
        self.memo: dict[int, tuple] = {}  # objects rebuilt: id -> node, so that sharing and cycles are kept
        self.size = 0

    def extract(self, x: Any, path: tuple, placed: list) -> Any:
        """``x`` with every object the program must build replaced by the marker, its path and node in ``placed``."""
        if isinstance(x, (TensorProxy, torch.Tensor)):
            return x
        if isinstance(x, (tuple, list)) and not isinstance(x, torch.Size):
            new = [self.extract(v, (*path, i), placed) for i, v in enumerate(x)]
            if all(a is b for a, b in zip(new, x)):
                return x
            return type(x)(*new) if hasattr(x, "_fields") else type(x)(new)
        if isinstance(x, dict):
            changed = {k: self.extract(v, (*path, k), placed) for k, v in x.items()}
            if all(changed[k] is v for k, v in x.items()):
                return x
            for k, v in changed.items():  # a dict subclass (ModelOutput) keeps its type: written in place
                x[k] = v
            return x
        if id(x) in self.holder_ids or (is_holder(x) and _holds_proxies(x, self.holder_ids)):
            placed.append((path, self.node(x)))
            return _MARKER
        return x

    def node(self, v: Any) -> tuple:
        self.size += 1
        if self.size > _MAX_TEMPLATE:
            raise NotImplementedError(
                "fulmen.jit: an object the function updates or returns reaches more than "
                f"{_MAX_TEMPLATE} values; fulmen cannot rebuild it on every call. Return its tensors instead.")
        if isinstance(v, TensorProxy) or (isinstance(v, torch.SymInt) and is_symbolic(v)):
            # a symbolic int (``n + 1`` of a symbolic ``n``): returned by the program, the value of each call
            self.tensors.append(v)
            return ("tensor", len(self.tensors) - 1)
        if isinstance(v, SYMBOLIC_TYPES):  # a known constant, or a SymFloat/SymBool: its value, guarded
            return ("constant", int(v) if isinstance(v, torch.SymInt) else bool(v) if isinstance(v, torch.SymBool)
                    else float(v))
        i = self.holder_ids.get(id(v))
        if i is not None:
            self.holders_used.add(i)
            return ("holder", i)
        if isinstance(v, Proxy):
            raise NotImplementedError(f"fulmen.jit: the function left a traced {type(v).__name__} in an object; "
                                      "fulmen can keep traced tensors in objects, not other traced values")
        if isinstance(v, (tuple, list)) and not isinstance(v, torch.Size):
            return ("sequence", type(v), hasattr(v, "_fields"), [self.node(e) for e in v])
        if type(v) is dict:
            return ("dict", dict, [(k, self.node(e)) for k, e in v.items()])
        if is_holder(v):
            node = self.memo.get(id(v))
            if node is not None:
                return node
            _check_rebuildable(type(v))
            members: list = []
            items: list = []
            node = self.memo[id(v)] = ("object", len(self.memo), type(v), members, items)
            members += [(n, self.node(m)) for n, m in zip(member_names(v), member_values(v))]
            if isinstance(v, dict):  # a dict subclass (a ModelOutput inside an object): its items too
                items += [(k, self.node(e)) for k, e in v.items()]
            return node
        return ("constant", v)


def _holds_proxies(x: Any, holder_ids: dict[int, int], depth: int = 0) -> bool:
    """Whether ``x`` holds traced values or the caller's objects (a few levels deep): then each call builds it."""
    if isinstance(x, Proxy) or id(x) in holder_ids:
        return True
    if depth > 8:
        return False
    if isinstance(x, (tuple, list, set)):
        return any(_holds_proxies(v, holder_ids, depth + 1) for v in x)
    if isinstance(x, dict):
        return any(_holds_proxies(v, holder_ids, depth + 1) for v in x.values())
    if is_holder(x):
        return any(_holds_proxies(v, holder_ids, depth + 1) for v in member_values(x))
    return False


def _check_rebuildable(cls: type) -> None:
    try:
        cls.__new__(cls)
    except Exception as e:
        raise NotImplementedError(
            f"fulmen.jit: the function returns (or stores in an argument) a {cls.__name__} object holding traced "
            f"tensors, and fulmen cannot create one to rebuild it on every call ({cls.__name__}.__new__(cls) raised "
            f"{type(e).__name__}: {e}). Return its tensors instead, or register the class with torch.utils._pytree."
        ) from None


def _new(cls: type) -> Any:
    return cls.__new__(cls)


def _build(node: tuple, tensors: list, holders: dict[int, Any], memo: dict[int, Any]) -> Any:
    kind = node[0]
    if kind == "tensor":
        return tensors[node[1]]
    if kind == "constant":
        return node[1]
    if kind == "holder":
        return holders[node[1]]
    if kind == "sequence":
        _, t, named, items = node
        values = [_build(n, tensors, holders, memo) for n in items]
        return t(*values) if named else t(values)
    if kind == "dict":
        return {k: _build(n, tensors, holders, memo) for k, n in node[2]}
    _, index, cls, members, items = node  # an object: made first, so that a cycle back to it finds it
    obj = memo.get(index)
    if obj is not None:
        return obj
    obj = memo[index] = _new(cls)
    if items:
        base = next(b for b in cls.__mro__ if not b.__flags__ & _HEAPTYPE and issubclass(b, dict))
        for k, n in items:
            base.__setitem__(obj, k, _build(n, tensors, holders, memo))
    for name, n in members:
        _set_member(obj, name, _build(n, tensors, holders, memo))
    return obj


def _place(container: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    step, rest = path[0], path[1:]
    new = _place(container[step], rest, value)
    if isinstance(container, tuple):
        items = list(container)
        items[step] = new
        return type(container)(*items) if hasattr(container, "_fields") else type(container)(items)
    container[step] = new
    return container


@dataclass
class ObjectResults:
    """What every call of a program does with objects: ``effects`` (holder index, kind, [(member, node)], removed
    members) update the caller's objects; ``placed`` (path in the result, node) are objects put into the result;
    ``holders``: the indices of the call's holders the prologue returns after the tensor inputs."""

    effects: list
    placed: list
    holders: tuple[int, ...]
    n_tensors: int
    # (input name, its shape, the shape of the tensor the program rebinds its member to): state carried between
    # calls, such as a KV cache growing by one token per call (fulmen.frontend.jit makes such sizes dynamic)
    rebound: list[tuple[str, tuple, tuple]]
    # (int slot, its value, the int the program rebinds its member to): a counter carried between calls, such as
    # a sliding-window cache's cumulative_length (fulmen.frontend.jit makes such ints symbolic)
    rebound_ints: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)


    def finish(self, out: Any, holder_values) -> Any:
        result, tensors = out
        holders = dict(zip(self.holders, holder_values))
        memo: dict[int, Any] = {}
        for i, kind, changed, removed in self.effects:
            obj = holders[i]
            if kind == "object":
                for name in removed:
                    _del_member(obj, name)
                for name, node in changed:
                    _set_member(obj, name, _build(node, tensors, holders, memo))
            elif kind == "list":
                obj[:] = [_build(node, tensors, holders, memo) for _, node in changed]
            else:
                _refill(obj, [(k, _build(node, tensors, holders, memo)) for k, node in changed])
        for path, node in self.placed:
            result = _place(result, path, _build(node, tensors, holders, memo))
        return result

