"""Guards on the globals and closure variables a traced function read.

A compiled program has the values that the user's Python code read while tracing baked in: ``x * SCALE``
records the number, ``x + W`` reads that tensor object, ``ACT(x)`` traces that function. When the user rebinds
such a name, eager runs the new value; the compiled program would not. So tracing records which user code ran
(``ReadRecorder``), and ``build_guard`` turns what that code can read from its module globals and closure cells
into one generated function that a call checks before reusing the program. A failed check recompiles (and the
program compiled for the old values stays cached, for when they come back).

What is found: the names each user code object that issued a torch call refers to (``co_names``, including its
comprehensions and nested functions), the default arguments of the functions followed (``__defaults__``,
``__kwdefaults__``, which eager reads at every call), and every attribute chain it loads from a global, a closure
variable, its ``self`` or an argument of the traced function (``cfgmod.SCALE``, ``K.scale``, ``self.cfg.sub.mult``,
``self.__class__.scale``, ``options.scale``); for a method, the attributes of its class it names
(``type(self).scale``). Each link of a chain is checked where Python's attribute lookup finds it: an object's
``__dict__`` (and, for a class attribute, that the instance and the classes before the defining one in the MRO
still lack it), a user class's ``__dict__``, a user module's globals, a ``__slots__`` member. A user property's
getter is followed with the same ``self``; any other link computed by code (``__getattr__``, a descriptor) or
found in torch, a library module or a library class ends the chain. The user functions and methods that names
and chains reach are followed in turn,
with no depth limit (each code object once per ``self``). Plain attributes and submodules of the jitted module's
tree, and of modules reached through a global, are left to their structure snapshot (``module_guard``), which
sees their changes with one C++ check of the tree's dictionaries per call. What is compared:

- numbers, strings, ``None``, dtypes, devices, enums, and tuples, lists and dicts of those (up to 64 items):
  by type and value (so ``SIZES.append(3)`` is seen); flat tuples and lists of numbers and strings of up to
  4,096 items, and dicts of up to 1,024, by value with one C-level ``==`` (about 2 ns an item for a list, 13 for
  a dict; an item replaced by an equal number of another type, ``7.0`` by ``7``, goes unseen); longer tuples and
  lists by identity, with a warning;
- a dict compared by identity (too large, or holding tensors or objects): also the entries the code names with
  a string constant (``CFG["lr"]``), by value when simple, and when the code calls ``.get`` those named entries
  that were missing stay missing;
- modules (``torch``, ``math``): not at all;
- anything else (tensors, functions, classes, modules' ``nn.Module`` objects, other objects): by identity, and
  for a plain object (a config), the attributes the code names whose values are simple, by value
  (``cfg.dropout = 0.2`` is seen). The code names an attribute with ``cfg.dropout``, or with a string constant
  (``getattr(cfg, "dropout", 0.0)``): when the code calls ``getattr`` or ``hasattr``, an attribute named by a
  constant that the object did not have is checked to stay absent (setting ``cfg.dropout`` later is seen).

Code in torch, fulmen and installed packages (site-packages, the standard library) is not followed: its globals
are not the user's to change between calls.
"""

from __future__ import annotations

import dis
import enum
import functools
import logging
import math
import operator
import random
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

from fulmen.core.proxies import TensorProxy
from fulmen.frontend import module_guard
from fulmen.frontend.ambient_flags import ENVIRONMENT_NAMES, environment, environment_change, flags_named
from fulmen.frontend.attribute_lookup import (
    MISSING,
    SLOT,
    code_names,
    is_user_class,
    is_user_file,
    is_user_function,
    kind,
    load_chains,
    lookup,
)
from fulmen.frontend.training_state import OptimizerParameters, describe_grad, grad_check, grad_facts, grad_meta_or_none

log = logging.getLogger("fulmen")

#: How many items a list, tuple or dict may hold to be compared by value (larger ones: by identity).
MAX_VALUE_ITEMS = 64
#: How many items a flat list or tuple (dict) of numbers and strings may hold to be compared by value with one
#: ``==``: bounded so that the comparison stays a small part of a call (its cost: docs/performance.md).
MAX_FLAT_ITEMS = 4096
MAX_FLAT_DICT_ITEMS = 1024

_SCALARS = (int, float, bool, str, bytes, complex, type(None))
_ATOMS = (torch.dtype, torch.device, torch.memory_format, torch.layout, enum.Enum)


# ---------------------------------------------------------------------------------------------------------
# while tracing: which user code ran


class ReadRecorder:
    """Called at every torch call user code makes while tracing; records the user frames on the stack (up to the
    tracer's own frame), once each."""

    def __init__(self, fn: Callable, boundary):
        self.fn = fn
        self._seen = {boundary}  # frames already walked (held until the trace ends: ids of dead frames are reused)
        self.codes: dict[types.CodeType, tuple[dict, type | None]] = {}  # code -> (its globals, type of its self)
        self.selves: dict[tuple, tuple[types.CodeType, Any]] = {}  # each method frame's code and self

    def __call__(self) -> None:
        frame = sys._getframe(1)
        seen = self._seen
        while frame is not None and frame not in seen:
            seen.add(frame)
            code = frame.f_code
            if is_user_file(code.co_filename):
                owner = None
                if code.co_argcount and code.co_varnames[0] == "self":
                    instance = frame.f_locals.get("self")
                    owner = type(instance)
                    self.selves.setdefault((id(instance), code), (code, instance))
                self.codes.setdefault(code, (frame.f_globals, owner))
            frame = frame.f_back

    def close(self) -> None:
        """Let go of the frames walked (the codes and selves stay, for ``build_guard``)."""
        self._seen = set()


# ---------------------------------------------------------------------------------------------------------
# after tracing: what that code can read, and the guard


class _Item:
    """One thing to check: where it is read from (``source``: a ``"key"`` of the dictionary ``holder`` -- module
    globals, an object's ``__dict__`` --, a closure ``"cell"``, the captured ``"tensor"`` itself, or a torch flag's
    reader to ``"call"``, ``fulmen.frontend.ambient_flags``), and ``how`` it
    is compared with ``value``: ``"=="`` (type and value), ``"is"`` (identity), ``"module"`` (identity, and the
    module's structure and tensors: ``value`` is a ``_ModuleWatch``), ``"meta"`` (a tensor's metadata), ``"grad"``
    (a tensor like the one ``value`` was made from: ``training_state.grad_facts``),
    ``"absent"`` (the key must stay missing) or ``"flat"`` (a long flat container: ``value`` is its type and a
    copy, compared with one ``==``)."""

    __slots__ = ("where", "source", "holder", "name", "value", "how")

    def __init__(self, where: str, source: str, holder: Any, name: str, value: Any, how: str):
        self.where, self.source, self.holder, self.name, self.value, self.how = where, source, holder, name, value, how

    def read(self) -> Any:
        if self.source == "key":
            if type(self.holder) in (list, tuple):  # an item of a list of modules (``_Collector.add``)
                return self.holder[self.name] if self.name < len(self.holder) else MISSING
            return self.holder.get(self.name, MISSING)
        if self.source == "slot":  # a __slots__ member: its descriptor reads it, no user code runs
            return getattr(self.holder, self.name, MISSING)
        if self.source == "cell":
            try:
                return self.holder.cell_contents
            except ValueError:  # an empty cell
                return MISSING
        if self.source == "call":  # a torch flag's reader (fulmen.frontend.ambient_flags)
            return self.holder()
        return _tensor_meta(self.holder)

    def holds(self) -> bool:
        value = self.read()
        if self.how == "absent":
            return value is MISSING
        if self.how == "module":
            return value is self.value.module and self.value()
        if self.how == "flat":
            return type(value) is self.value[0] and value == self.value[1]
        if self.how == "grad":
            return isinstance(value, torch.Tensor) and grad_meta_or_none(value) == self.value[0]
        return value is self.value if self.how == "is" else _same(value, self.value)


def _tensor_meta(t: torch.Tensor) -> tuple:
    return (t.shape, t.dtype, t.device, t.requires_grad)


class _ModuleWatch:
    """A module that the traced code reached through a global or closure: the program captured its parameters and
    buffers as they were, so a changed tree (a replaced parameter, a new submodule, ``eval()``) must recompile.
    Compared in full only when the tree's check (``module_guard.watch``) fails, as for jitted modules."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.state, self.check = self._state()

    def _state(self) -> tuple[tuple, Callable[[], bool]]:
        snapshot, check = module_guard.watch(self.module, getattr(self, "check", None))
        tensors = [t for m in self.module.modules() for d in (m._parameters, m._buffers) for t in d.values()]
        return (snapshot, tuple(id(t) for t in tensors)), check

    def __call__(self) -> bool:
        if self.check():
            return True
        state, check = self._state()
        if state != self.state:
            return False
        self.check = check
        return True


def _simple(v: Any, budget: list[int]) -> bool:
    """Whether ``v`` is compared by value: scalars, atoms, and small tuples, lists and dicts of them."""
    budget[0] -= 1
    if budget[0] < 0:
        return False
    t = type(v)
    if t in _SCALARS or isinstance(v, _ATOMS):
        return True
    if t in (tuple, list, frozenset, set):
        return all(_simple(x, budget) for x in v)
    if t is dict:
        return all(_simple(k, budget) and _simple(x, budget) for k, x in v.items())
    return False


_FLAT_SCALARS = (int, float, bool, str)


def _flat(v: Any) -> bool:
    """A list, tuple or dict of numbers and strings too long for ``_simple``, short enough to compare by value."""
    t = type(v)
    if t not in (list, tuple, dict) or len(v) > (MAX_FLAT_DICT_ITEMS if t is dict else MAX_FLAT_ITEMS):
        return False
    items = (x for kv in v.items() for x in kv) if t is dict else v
    return all(type(x) in _FLAT_SCALARS for x in items)


def _flat_key(v: Any) -> tuple:
    """What a flat container is compared by: its type and its items, by ``==`` (C-level, about 2 ns an item for a
    list; item types are not compared, so replacing ``7.0`` by ``7`` in place goes unseen)."""
    return type(v), type(v)(v)  # a copy of the same type, so that == compares it with the live container


def _copy(v: Any) -> Any:
    t = type(v)
    if t is list:
        return [_copy(x) for x in v]
    if t is dict:
        return {k: _copy(x) for k, x in v.items()}
    if t is set:
        return set(v)
    if t is tuple:  # a tuple holding a list or dict (``f.__defaults__ == ([2.0],)``): a copy of those
        copied = tuple([_copy(x) for x in v])
        return copied if any(map(operator.is_not, copied, v)) else v
    return v


def _same(a: Any, b: Any) -> bool:
    """Equal with equal types all the way down (``1`` and ``1.0`` trace differently); NaN equals NaN."""
    t = type(a)
    if t is not type(b):
        return False
    if t in (tuple, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if t is dict:
        return a.keys() == b.keys() and all(_same(x, b[k]) for k, x in a.items())
    if t is float:
        if a != a:
            return b != b
        return a == b and (a != 0.0 or math.copysign(1.0, a) == math.copysign(1.0, b))  # 0.0 and -0.0 differ
    return a == b


def _plain_object(v: Any) -> bool:
    """A config-like object whose attributes are worth comparing (not a class, function, module or tensor)."""
    return (isinstance(getattr(v, "__dict__", None), dict) and not isinstance(
        v, (type, types.FunctionType, types.MethodType, types.ModuleType, torch.nn.Module, torch.Tensor)))


def _called_object(v: Any) -> bool:
    """An instance of a user class other than a module (``nn.Module.__call__`` is torch's; the module's structure
    check covers its ``forward``), as a callable the traced code may call."""
    return not isinstance(v, (type, torch.nn.Module, types.FunctionType)) and is_user_class(type(v))


def _holder_id(holder: Any, owner: Any) -> int:
    """What names the dictionary ``holder``: itself, or for a class's ``__dict__`` (a view made at each access) the
    class."""
    return id(holder) if type(holder) is dict or owner is None else id(owner)


class _Collector:
    def __init__(self, covered: Iterable[torch.nn.Module] = (), walked: Iterable[Any] = ()):
        # ids of the objects passed in whose whole structure the call's key and prologue check
        # (fulmen.frontend.objects): reads through them need no check here
        self.walked: set[int] = {id(x) for x in walked}
        self.items: list[_Item] = []
        self._keys: set = set()
        self._codes: set = set()
        self._alive: list = []  # objects named by id in _keys and _codes, kept alive until the guard is built
        # ids of the modules whose plain attributes and submodules a structure snapshot already checks
        self.covered: set[int] = {id(m) for m in covered}

    def absent(self, where: str, holder: Any, name: str, owner: Any = None) -> None:
        """Check that ``holder`` (a ``__dict__``) stays without the key ``name``."""
        key = ("key", _holder_id(holder, owner), name)
        if key not in self._keys:
            self._keys.add(key)
            self._alive.append(owner)
            self.items.append(_Item(f"{where}, not set on the {kind(owner)}", "key", holder, name, None, "absent"))

    def add(self, where: str, source: str, holder: Any, name: str, value: Any, names: frozenset[str],
            absent: frozenset[str] = frozenset(), owner: Any = None) -> None:
        """Check ``value``, read from ``holder``; ``names`` are the attributes the reading code names, ``absent``
        those it may look up dynamically (``getattr(cfg, "name", default)``), checked to stay missing. ``owner``:
        the object ``holder`` belongs to, when ``holder`` is a view made for this read (a class's
        ``__dict__``)."""
        key = (source, _holder_id(holder, owner), name)
        if key in self._keys or isinstance(value, types.ModuleType):
            return
        self._keys.add(key)
        self._alive.append(owner)
        if _simple(value, [MAX_VALUE_ITEMS]):
            self.items.append(_Item(where, source, holder, name, _copy(value), "=="))
        elif _flat(value):
            self.items.append(_Item(where, source, holder, name, _flat_key(value), "flat"))
        elif isinstance(value, torch.nn.Module):
            self.items.append(_Item(where, source, holder, name, _ModuleWatch(value), "module"))
            self.covered.update(id(m) for m in value.modules())
        else:
            self.items.append(_Item(where, source, holder, name, value, "is"))
            if isinstance(value, torch.optim.Optimizer):
                self.optimizer(where, value)
            if _plain_object(value):  # a config object: the attributes this code names
                self.attributes(where, vars(value), names, absent)
            elif type(value) is dict:  # CFG["lr"] in a dict that holds tensors or objects: the entries named
                self.attributes(where, value, names, absent, kind="entry")
            elif type(value) in (list, tuple) and len(value) > MAX_FLAT_ITEMS:
                _warn_identity_only(where, value)
            if type(value) in (list, tuple, dict):  # LAYERS[0](x): each module held, watched as a global one is
                for i, v in value.items() if type(value) is dict else enumerate(value):
                    if isinstance(v, torch.nn.Module):
                        self.add(f"{where}[{i!r}]", "key", value, i, v, frozenset())

    def optimizer(self, where: str, opt: torch.optim.Optimizer) -> None:
        """An optimizer's parameters, by identity (``OptimizerParameters``), and hyperparameters, by value: its step
        reads them as Python numbers (``group["lr"]``, changed by an LR scheduler); the program holds traced values."""
        if ("call", id(opt), "params") not in self._keys:
            self._keys.add(("call", id(opt), "params"))
            where_params = f"the parameter lists of {where} (param_groups and each group's params, by identity)"
            self.items.append(_Item(where_params, "call", OptimizerParameters(opt), where, True, "=="))
        for i, group in enumerate(opt.param_groups):
            for k, v in group.items():
                if k != "params" and type(k) is str and _simple(v, [MAX_VALUE_ITEMS]):
                    self.add(f"{where}.param_groups[{i}][{k!r}]", "key", group, k, v, frozenset())

    def attributes(self, where: str, attrs: dict, names: frozenset[str], absent: frozenset[str],
                   kind: str = "attribute") -> None:
        """Check the entries of ``attrs`` (an object's ``__dict__``, or a dict) named in ``names`` whose values are
        simple, and that those in ``absent`` that are missing stay missing."""
        for attr in sorted(names & {k for k in attrs if type(k) is str}):
            v = attrs[attr]
            if _simple(v, [MAX_VALUE_ITEMS]):
                self.add(f"the {kind} {attr} of {where}", "key", attrs, attr, v, frozenset())
        for attr in sorted(absent - attrs.keys()):
            key = ("key", id(attrs), attr)
            if key not in self._keys:
                self._keys.add(key)
                self.items.append(_Item(f"the {kind} {attr} of {where}", "key", attrs, attr, None, "absent"))

    def flags(self, names: frozenset[str]) -> None:
        """Check the torch flags code using ``names`` may read (``torch.are_deterministic_algorithms_enabled()``),
        by value: the branch it took on one is baked into the program."""
        for where, reader in flags_named(names):
            key = ("call", id(reader), where)
            if key not in self._keys:
                self._keys.add(key)
                self.items.append(_Item(where, "call", reader, where, reader(), "=="))
        if names & ENVIRONMENT_NAMES and "environ" not in self._keys:
            self._keys.add("environ")
            self.items.append(_Item("os.environ", "call", environment, "os.environ", _flat_key(environment()), "flat"))

    def code(self, code: types.CodeType, globals_: dict, owner: type | None, instance: Any = MISSING,
             cells: dict | None = None, arguments: dict | None = None) -> None:
        """What ``code`` can read: the globals it names, and every attribute chain it loads from a global, a
        closure variable (``cells``), its ``self`` (``instance``, when known) or, for the traced function itself,
        an argument (``arguments``: an object passed in, ``cfg.scale``), followed into the user functions and
        methods those reach, however deep."""
        key = (code, id(globals_), owner, id(instance))
        if key in self._codes:
            return
        self._codes.add(key)
        self._alive.append(instance)  # the id above names it only while it lives
        names = code_names(code)
        attrs, absent = _attribute_names(code)
        module = globals_.get("__name__", "?")
        self.flags(names)
        for name in sorted(names):
            value = globals_.get(name, MISSING)
            if value is MISSING:
                continue
            _warn_on_python_rng(code, name, value)
            self.add(f"the global {name} (module {module})", "key", globals_, name, value, attrs, absent)
            self.follow(value)
        if owner is not None and is_user_class(owner):
            self.class_attributes(code, owner)
        if owner is not None and instance is MISSING:  # self.helper() where self is not known: by the class
            for name in sorted(names):
                method = _class_attr(owner, name)
                if is_user_function(method):
                    self.code(method.__code__, method.__globals__, owner)
        for root, name, *chain in sorted(load_chains(code)):
            if root == "global":
                value, context = globals_.get(name, MISSING), f"a global of module {module}"
            elif root == "cell" and cells is not None and name in cells:
                value, context = cells[name], f"a closure variable of {code.co_qualname}"
            # a cell of this code (self used by a nested function, lambda or comprehension) is one of its locals
            elif arguments is not None and name in arguments:
                value, context = arguments[name], f"the argument {name} of {code.co_qualname}"
            elif code.co_argcount and code.co_varnames[0] == name:
                value, context = instance, f"{name} is a {type(instance).__name__}, in {code.co_qualname}"
            else:
                continue
            if value is not MISSING:
                self.chain(name, context, value, chain, attrs, absent)

    def chain(self, path: str, context: str, obj: Any, chain: list[str], names: frozenset[str],
              absent: frozenset[str]) -> None:
        """Guard each link of ``obj.a.b.c`` where its value comes from (an object's, a class's or a user module's
        ``__dict__``), and follow what it reaches; stop where the value comes from code (a property, whose getter
        is followed instead, ``__getattr__``), a library module or class, or a tensor."""
        for attr in chain:
            if id(obj) in self.walked and attr in (getattr(obj, "__dict__", None) or ()):
                return  # an instance member: the prologue checks it (its class attributes are checked below)
            found = lookup(obj, attr, self.covered)
            if found is None:
                return
            checks, obj, follow_as = found
            path = f"{path}.{attr}"
            self.checks(f"{path} ({context})", attr, checks, obj, names, absent)
            self.follow(obj, follow_as)
            if type(obj) in _SCALARS or isinstance(obj, (*_ATOMS, torch.Tensor, property)):
                return

    def checks(self, where: str, attr: str, checks: list, value: Any, names: frozenset[str],
               absent: frozenset[str]) -> None:
        for holder, owner, present in checks:
            if owner is SLOT:
                self.add(where, "slot", holder, attr, value, names, absent)
            elif present:
                self.add(where, "key", holder, attr, value, names, absent, owner=owner)
            else:
                self.absent(where, holder, attr, owner)

    def class_attributes(self, code: types.CodeType, owner: type) -> None:
        """The attributes of ``owner`` (a method's class) that ``code`` names, found on a user class:
        ``type(self).scale``, ``cls.scale``, ``getattr(self, "scale")`` read them without an attribute chain."""
        names, absent = _attribute_names(code)
        for name in sorted(names):
            found = lookup(owner, name, self.covered)
            if found is not None:
                checks, value, _ = found
                self.checks(f"{owner.__qualname__}.{name} (a class attribute, read in {code.co_qualname})", name,
                            checks, value, names, absent)

    def follow(self, value: Any, instance: Any = MISSING) -> None:
        """The code a value read can run: a user function (with ``instance`` as its ``self``), a bound method."""
        if isinstance(value, types.MethodType):
            value, instance = value.__func__, value.__self__
        elif isinstance(value, property):  # what the getter reads
            value = value.fget
        elif _called_object(value):  # helper(x) runs type(helper).__call__, which a later call may find replaced
            definer = next((k for k in type(value).__mro__ if "__call__" in k.__dict__), None)
            if definer is not None and is_user_class(definer):
                method = definer.__dict__["__call__"]
                self.add(f"{definer.__qualname__}.__call__ (the method a call of a {type(value).__qualname__} runs)",
                         "key", definer.__dict__, "__call__", method, frozenset(), owner=definer)
                value, instance = method, value
        if is_user_function(value):
            self.function(value, instance)

    def function(self, fn: types.FunctionType, instance: Any = MISSING, owner: type | None = None,
                 arguments: dict | None = None) -> None:
        attrs, absent = _attribute_names(fn.__code__)
        cells = {}
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            cells[name] = value
            self.add(f"the closure variable {name} of {fn.__qualname__}", "cell", cell, name, value, attrs, absent)
            self.follow(value)
        for name in ("__defaults__", "__kwdefaults__"):  # eager reads them at every call: f.__defaults__ = (w,)
            value = getattr(fn, name)
            if value is not None:
                self.add(f"the default arguments of {fn.__qualname__}", "slot", fn, name, value, attrs, absent)
        if owner is None and instance is not MISSING:
            owner = type(instance)
        self.code(fn.__code__, fn.__globals__, owner, instance, cells, arguments)


_DYNAMIC_LOOKUPS = frozenset(("getattr", "hasattr", "get"))
_warned_identity: set = set()


def _warn_identity_only(where: str, value: Any) -> None:
    if where not in _warned_identity:
        _warned_identity.add(where)
        log.warning("fulmen: %s (a %s of %d items) is read by the traced code and is checked by identity only, "
                    "being longer than %d items: changing it in place does not recompile. Rebind it to a new %s "
                    "to make the next call recompile, or pass the values in as arguments.", where,
                    type(value).__name__, len(value), MAX_FLAT_ITEMS, type(value).__name__)


@functools.lru_cache(maxsize=4096)
def _attribute_names(code: types.CodeType) -> tuple[frozenset[str], frozenset[str]]:
    """The attribute names a code object (and the code nested in it) may read from an object: the names it uses
    (``cfg.dropout``) and its identifier string constants (``getattr(cfg, "dropout", 0.0)``); and the constants
    alone when it calls ``getattr``, ``hasattr`` or a ``get`` method (names whose absence it may test), else
    nothing."""
    names = code_names(code)
    constants = string_constants(code)
    return names | constants, constants if names & _DYNAMIC_LOOKUPS else frozenset()


@functools.lru_cache(maxsize=4096)
def string_constants(code: types.CodeType) -> frozenset[str]:
    """The string constants of ``code`` and the code nested in it that could name an attribute or a key."""
    found = {c for c in code.co_consts if isinstance(c, str) and c.isidentifier()}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= string_constants(const)
    return frozenset(found)


def _class_attr(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None



def _root_function(fn: Any) -> tuple[types.FunctionType | None, type | None]:
    """The user function behind ``fn``, and the class of its ``self`` when it is a bound method."""
    owner = type(fn.__self__) if isinstance(fn, types.MethodType) else None
    fn = getattr(fn, "__func__", fn)
    return (fn, owner) if is_user_function(fn) else (None, None)


class GlobalGuard:
    """``check()`` is True while every global and closure value the traced code read is what it was."""

    def __init__(self, items: list[_Item]):
        self.items = items
        self.check = _generate(items)

    def explain(self) -> str:
        for item in self.items:
            if not item.holds():
                now = item.read()
                if item.how == "absent":
                    return f"{item.where} was set to {_short(now)}"
                if now is MISSING:
                    return f"{item.where} was deleted"
                if item.how == "module" and now is item.value.module:
                    return f"{item.where} changed ({_module_change(item.value)})"
                if item.how in ("is", "module"):
                    return f"{item.where} was rebound to another {type(now).__name__} object"
                if item.how == "meta":
                    return f"{item.where} changed from {_short_meta(item.value)} to {_short_meta(now)}"
                if item.how == "grad":
                    meta = grad_meta_or_none(now) if isinstance(now, torch.Tensor) else None
                    now_text = describe_grad(meta) if meta is not None else _short(now)
                    return f"{item.where} changed from {describe_grad(item.value[0])} to {now_text}"
                if item.holder is environment:
                    return environment_change(item.value[1], now)
                if type(item.holder) is OptimizerParameters:
                    return f"{item.where} changed: {item.holder.change()}"
                if item.how == "flat":
                    kind, n = item.value[0].__name__, len(item.value[1])
                    now_text = f"{len(now)} items" if type(now) is item.value[0] else _short(now)
                    return f"{item.where} changed (a {kind} of {n} items when traced, now {now_text})"
                return f"{item.where} changed from {_short(item.value)} to {_short(now)}"
        return "a global or closure variable changed"

    def tensor_ids(self) -> frozenset[int]:
        """The ids of the tensors checked by identity (a global or closure variable holding one): alive, with
        these ids, while the guard holds."""
        return frozenset(
            id(item.value)
            for item in self.items
            if item.how == "is" and isinstance(item.value, torch.Tensor) and not isinstance(item.value, TensorProxy)
        )

    def describe(self) -> list[str]:
        """One line per value checked, for the prologue trace."""
        lines = []
        for item in self.items:
            if item.how == "meta":
                lines.append(f"{item.where}: {_short_meta(item.value)}")
            elif item.how == "grad":
                lines.append(f"{item.where}: {describe_grad(item.value[0])} (read as an input on each call)")
            elif item.how == "module":
                lines.append(f"{item.where} is {type(item.value.module).__name__} (structure and tensors unchanged)")
            elif item.how == "absent":
                lines.append(f"{item.where} is not set")
            elif item.how == "flat":
                lines.append(f"{item.where} == a {item.value[0].__name__} of {len(item.value[1])} items")
            else:
                lines.append(f"{item.where} {'is' if item.how == 'is' else '=='} {_short(item.value)}")
        return lines


def _module_change(watch: _ModuleWatch) -> str:
    snapshot = watch._state()[0][0]
    if snapshot != watch.state[0]:
        return module_guard.describe_change(watch.state[0], snapshot)
    return "a parameter or buffer was replaced by another tensor"


def _short_meta(meta: tuple) -> str:
    shape, dtype, device, requires_grad = meta
    grad = ", requiring grad" if requires_grad else ""
    return f"{str(dtype).removeprefix('torch.')}{list(shape)} on {device}{grad}"


def _short(v: Any) -> str:
    text = repr(v) if not isinstance(v, torch.Tensor) else f"tensor{tuple(v.shape)}"
    return text if len(text) <= 60 else text[:57] + "..."


def _generate(items: list[_Item]) -> Callable[[], bool]:
    """One function comparing every item: about 40 ns each on the per-call path."""
    env: dict[str, Any] = {"_same": _same}
    terms = []
    for i, item in enumerate(items):
        env[f"h{i}"], env[f"v{i}"] = item.holder, item.value
        # a missing name or an empty cell raises, and the guard fails. A name is pasted as a literal only when it
        # is a plain str (a str subclass in a namespace could print anything as its repr); else it is bound
        key = repr(item.name) if type(item.name) is str else f"n{i}"
        if key == f"n{i}":
            env[key] = item.name
        read = {"key": f"h{i}[{key}]", "cell": f"h{i}.cell_contents", "tensor": f"h{i}",
                "slot": f"getattr(h{i}, {key})", "call": f"h{i}()"}[item.source]
        if item.how == "is":
            terms.append(f"{read} is v{i}")
        elif item.how == "absent":
            terms.append(f"{key} not in h{i}")
        elif item.how == "flat":
            kind, items = item.value
            env[f"t{i}"], env[f"v{i}"] = kind, items
            terms.append(f"(type(x := {read}) is t{i} and len(x) == {len(items)} and x == v{i})")
        elif item.how == "module":
            env[f"m{i}"] = item.value.module
            terms.append(f"({read} is m{i} and v{i}())")
        elif item.how == "grad":
            terms.append(grad_check(read, i, item.value, env))
        elif item.how == "meta":
            shape, dtype, device, requires_grad = item.value
            env[f"s{i}"], env[f"d{i}"], env[f"e{i}"], env[f"r{i}"] = shape, dtype, device, requires_grad
            terms.append(f"(h{i}.shape == s{i} and h{i}.dtype is d{i} and h{i}.requires_grad is r{i} "
                         f"and h{i}.device == e{i})")
        elif type(item.value) in _SCALARS or isinstance(item.value, _ATOMS):
            env[f"t{i}"] = type(item.value)
            same = f"x == v{i}" if item.value == item.value else "x != x"  # NaN is NaN
            if type(item.value) is float and item.value == 0.0:  # 0.0 and -0.0 differ (1 / x)
                same = f"_same(x, v{i})"
            terms.append(f"(type(x := {read}) is t{i} and {same})")
        else:
            terms.append(f"_same({read}, v{i})")
    body = "\n        and ".join(terms) or "True"
    source = f"def guard():\n    try:\n        return ({body})\n    except Exception:\n        return False\n"
    exec(compile(source, "<fulmen global guard>", "exec"), env)
    env["guard"].source = source  # the prologue prints this text and runs it (fulmen.frontend.prologue)
    return env["guard"]


def build_guard(recorder: ReadRecorder, captured: list[tuple[str, torch.Tensor]],
                covered: Iterable[torch.nn.Module] = (), arguments: dict | None = None,
                walked: Iterable[Any] = (), flag_names: frozenset[str] = frozenset(),
                grads: Iterable[tuple[torch.Tensor, Any, str]] = (),
                optimizers: Iterable[torch.optim.Optimizer] = (),
                grads_at_call: Iterable[torch.Tensor] = ()) -> GlobalGuard | None:
    """The guard for what the code recorded while tracing can read, and for the metadata of the tensors the
    program captured (``captured``: their names in the trace, and the tensors); None when there is nothing to
    check. ``covered``: the jitted module's tree, whose structure snapshot already checks its plain attributes.
    ``arguments``: the traced function's arguments by parameter name (an object passed in is keyed by identity,
    so the attributes the code reads from it are checked here). ``walked``: objects passed in whose structure the
    prologue checks (``fulmen.frontend.objects``): what is read through them is not checked again. ``flag_names``:
    the names of the torch flags the program's beliefs depend on, though its code names none of them (the layout
    of a convolution of a channels_last input, ``torch.kernel_layouts.flag_names_read``). ``grads``: (tensor,
    its ``.grad`` as read, where) for the gradients the code read of tensors that are not inputs: a call must find the
    same gradient object (or None) there, or it compiles again; except for the tensors in ``grads_at_call``, whose
    ``.grad`` the program reads as an input on every call (``fulmen.frontend.training_state.GradOf``): a call must
    find a gradient with the traced one's metadata there. ``optimizers``: those whose ``step()`` ran while tracing,
    whose hyperparameters are checked by value."""
    collector = _Collector(covered, walked)
    collector.flags(flag_names)
    seen: set[int] = set()
    called = frozenset(map(id, grads_at_call))
    for owner, grad, where in grads:
        if id(owner) not in seen:
            seen.add(id(owner))
            if id(owner) in called:  # an input read on every call: a new gradient object like this one is fine
                collector.items.append(_Item(f"the .grad of a tensor read at {where}", "slot", owner, "grad",
                                             grad_facts(grad), "grad"))
            else:
                collector.items.append(_Item(f"the .grad of a tensor read at {where}", "slot", owner, "grad", grad,
                                             "is"))
    for opt in optimizers:
        collector.optimizer(f"the optimizer {type(opt).__name__}", opt)
    for name, t in captured:  # read by identity on every call, but traced for this shape, dtype and device
        collector.items.append(_Item(f"the captured tensor {name}", "tensor", t, name, _tensor_meta(t), "meta"))
    root, owner = _root_function(recorder.fn)
    if root is not None:
        collector.function(root, getattr(recorder.fn, "__self__", MISSING), owner, arguments)
    for code, instance in recorder.selves.values():  # methods: their self's attributes (self.cfg.sub.mult)
        collector.code(code, recorder.codes[code][0], type(instance), instance)
    for code, (globals_, owner) in recorder.codes.items():
        collector.code(code, globals_, owner)
    recorder.selves = {}
    _warn_on_global_writes(recorder.codes)
    return GlobalGuard(collector.items) if collector.items else None


_warned_writes: set = set()
_STORE_GLOBAL = dis.opmap["STORE_GLOBAL"]
_STORE_DEREF = dis.opmap["STORE_DEREF"]


def _warn_on_global_writes(codes) -> None:
    """Warn once per code object that assigns a global, or a variable of an enclosing function (``nonlocal``):
    such a write outlives the call, and a compiled program does not repeat it."""
    for code in codes:
        ops = code.co_code[::2]  # the opcodes: dis is far slower
        if code in _warned_writes or (_STORE_GLOBAL not in ops and not (code.co_freevars and _STORE_DEREF in ops)):
            continue
        stored = sorted({ins.argval for ins in dis.get_instructions(code) if ins.opname == "STORE_GLOBAL" or (
            ins.opname == "STORE_DEREF" and ins.argval in code.co_freevars)})
        if stored:
            _warned_writes.add(code)
            log.warning("fulmen: %s assigns the global or nonlocal variable(s) %s while being traced; the compiled "
                        "program does not repeat Python side effects, so later calls do not assign them (and "
                        "values computed from them stay those of the traced call)", code.co_qualname,
                        ", ".join(stored))


# Python's and NumPy's random number generators: a draw while tracing is a constant of the compiled program
_PYTHON_RNG_CALLS = frozenset(("random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample",
                               "gauss", "normalvariate", "betavariate", "expovariate", "triangular", "getrandbits"))
_NUMPY_RNG_CALLS = _PYTHON_RNG_CALLS | frozenset(("rand", "randn", "random_sample", "normal", "binomial",
                                                  "permutation", "integers", "standard_normal", "bernoulli"))
_warned_rng: set = set()


@functools.lru_cache(maxsize=4096)
def _attribute_chains(code: types.CodeType) -> frozenset[tuple[str, ...]]:
    """``(global, attribute, ...)`` for each ``np.random.rand``-like load in ``code`` and the code nested in it."""
    chains, chain = set(), None
    for ins in dis.get_instructions(code):
        if ins.opname == "LOAD_GLOBAL":
            chain = (ins.argval,)
        elif chain is not None and ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            chain += (ins.argval,)
        elif ins.opname not in ("CACHE", "EXTENDED_ARG"):
            if chain is not None:
                chains.add(chain)
            chain = None
    if chain is not None:
        chains.add(chain)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            chains |= _attribute_chains(const)
    return frozenset(chains)


def _python_rng(code: types.CodeType, name: str, value: Any) -> str | None:
    """What the global ``name`` (holding ``value``) lets ``code`` draw outside torch, if anything: ``random.random``,
    ``from random import uniform``, ``np.random.rand``, a generator object's methods."""
    numpy = sys.modules.get("numpy")
    generators = (random.Random,) if numpy is None else (random.Random, numpy.random.RandomState,
                                                        numpy.random.Generator)
    owner = getattr(value, "__self__", None)
    if isinstance(owner, generators) or (numpy is not None and owner is numpy.random.mtrand):
        return f"{type(owner).__module__}.{getattr(value, '__name__', 'draw')}"
    for chain in _attribute_chains(code):
        if chain[0] != name:
            continue
        if value is random and chain[1:2] and chain[1] in _PYTHON_RNG_CALLS:
            return "random." + chain[1]
        if numpy is not None and value is numpy and chain[1:2] == ("random",) and chain[2:3] \
                and chain[2] in _NUMPY_RNG_CALLS:
            return "numpy.random." + chain[2]
        if isinstance(value, generators) and chain[1:2] and chain[1] in _NUMPY_RNG_CALLS:
            return f"a {type(value).__name__}'s {chain[1]}"
    return None


def _warn_on_python_rng(code: types.CodeType, name: str, value: Any) -> None:
    if (code, name) in _warned_rng or isinstance(value, _SCALARS):
        return
    draw = _python_rng(code, name, value)
    if draw is not None:
        _warned_rng.add((code, name))
        log.warning("fulmen: %s draws with %s (Python's or NumPy's generator, through the global %r) while being "
                    "traced; the compiled program keeps the number drawn then, it does not draw a new one on every "
                    "call. Draw with torch (torch.rand, torch.randint, torch.randperm), which the program repeats "
                    "on every call, or draw outside the compiled function and pass the result in.",
                    code.co_qualname, draw, name)
