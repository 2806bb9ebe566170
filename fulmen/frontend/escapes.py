"""Traced tensors that the user's code leaves in Python containers the compiled program does not return.

A forward hook that collects activations (``feats.append(out)``, ``acts[name] = out.detach()``), a function that
logs into a global list or appends to a list it was passed: eager puts a real tensor there on every call. While
tracing, what lands there is a proxy, and the compiled program repeats only the tensor computation, so the caller
would find a placeholder after the first call and nothing after later ones. ``check_no_escapes`` looks where such
code can store by name (the closure cells and globals of the traced function, of the user code that ran, of the
forward hooks of the modules it reaches; the lists and dicts passed in; lists and dicts kept as attributes of the
jitted module's tree), takes the proxies out again and raises an error naming the container, rather than return a
result whose side effects differ from eager's.
"""

from __future__ import annotations

import collections
import dis
import functools
import logging
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.nn.modules import module as _torch_module

from fulmen.core.proxies import Proxy
from fulmen.frontend.attribute_lookup import code_names, is_user_class, is_user_function

log = logging.getLogger("fulmen")
_warned: set = set()

#: How deep into nested containers a store is looked for (``acts[layer][step] = out``).
_MAX_DEPTH = 3
_CONTAINERS = (list, dict, set, collections.deque)
_LRU_CACHE = functools._lru_cache_wrapper
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks")
_GLOBAL_HOOK_TABLES = ("_global_forward_pre_hooks", "_global_forward_hooks")


#: What must not outlive a trace: proxies, and the symbolic ints of one (``fulmen.frontend.dynamic``), which stand
#: for each call's value only inside the program.
_TRACED = (Proxy, torch.SymInt)


def _holds_proxy(x: Any, depth: int = 0) -> bool:
    if isinstance(x, _TRACED):
        return True
    if depth >= _MAX_DEPTH or isinstance(x, (str, bytes, int, float, bool, type(None), torch.Tensor)):
        return False
    if isinstance(x, dict):
        return any(_holds_proxy(v, depth + 1) or isinstance(k, _TRACED) for k, v in x.items())
    if isinstance(x, (list, tuple, set, frozenset, collections.deque)):
        return any(_holds_proxy(v, depth + 1) for v in x)
    if _user_object(x) or _user_class(x):
        return any(_holds_proxy(v, depth + 1) for v in vars(x).values())
    return False


def _user_object(x: Any) -> bool:
    return (
        not isinstance(x, (type, torch.nn.Module))
        and is_user_class(type(x))
        and isinstance(getattr(x, "__dict__", None), dict)
    )


def _user_class(x: Any) -> bool:
    return isinstance(x, type) and is_user_class(x)


def _drop_proxies(x: Any) -> None:
    """Take the proxies out of a container the user's code stored them in (they must not outlive the trace)."""
    if isinstance(x, list):
        x[:] = [v for v in x if not isinstance(v, _TRACED)]
    elif isinstance(x, collections.deque):
        kept = [v for v in x if not isinstance(v, _TRACED)]
        x.clear()
        x.extend(kept)
    elif isinstance(x, set):
        x.difference_update([v for v in x if isinstance(v, _TRACED)])
    elif isinstance(x, dict):  # an entry holding one deeper (an optimizer's state per parameter) goes too
        for k in [k for k, v in x.items() if _holds_proxy(v, 1) or isinstance(k, _TRACED)]:
            del x[k]
    elif _user_object(x) or _user_class(x):
        for k in [k for k, v in vars(x).items() if isinstance(v, _TRACED)]:
            delattr(x, k)


class _Search:
    """The named places user code can store into, found from functions, and which of them hold proxies."""

    def __init__(self):
        self.seen: set[int] = set()
        self.functions: set[int] = set()
        self.places: list[tuple[str, Any]] = []  # (how the code names it, the container or object)
        self.caches: list[tuple[str, Any]] = []  # functools.lru_cache / functools.cache wrappers named
        self.classes: set[int] = set()  # user classes whose attributes are watched (``user_class``)

    def found(self) -> list[tuple[str, Any]]:
        return [(where, v) for where, v in self.places if _holds_proxy(v)]

    def value(self, where: str, v: Any) -> None:
        if id(v) in self.seen:
            return
        self.seen.add(id(v))
        if isinstance(v, torch.nn.Module):
            self.module_tree(v)
        elif isinstance(v, (types.FunctionType, types.MethodType, functools.partial)):
            self.function(v)
        elif isinstance(v, _LRU_CACHE):
            self.caches.append((where, v))
            self.function(getattr(v, "__wrapped__", None))
        elif isinstance(v, _CONTAINERS):
            self.places.append((where, v))
        elif isinstance(v, torch.optim.Optimizer):  # its state (momentum buffers, Adam's moments) outlives the call
            self.places.append((f"the state of the optimizer {where}", v.state))
        elif _user_object(v):
            self.places.append((where, v))
            self.user_class(type(v))
        elif _user_class(v):
            self.user_class(v)

    def user_class(self, cls: type) -> None:
        """A user class and its user bases: their attributes (``type(self).n += 1``, ``Cls.cache[k] = v``) outlive
        the call like globals do, and the list, dict and set attributes they hold."""
        for c in cls.__mro__:
            if not is_user_class(c) or id(c) in self.classes:
                continue
            self.classes.add(id(c))
            self.seen.add(id(c))
            self.places.append((f"the class {c.__qualname__}", c))
            for name, v in vars(c).items():
                if isinstance(v, _CONTAINERS) and id(v) not in self.seen:
                    self.seen.add(id(v))
                    self.places.append((f"{c.__qualname__}.{name} (a class attribute)", v))

    def function(self, f: Any) -> None:
        if isinstance(f, functools.partial):
            inner = f.func.__func__ if isinstance(f.func, types.MethodType) else f.func
            if is_user_function(inner):  # not fulmen's own partials (the FSDP2 program binds its proxies so)
                for i, v in enumerate((*f.args, *f.keywords.values())):
                    self.value(f"an argument bound by functools.partial ({i})", v)
            f = f.func
        if isinstance(f, types.MethodType):
            self.value(f"{f.__qualname__}'s self", f.__self__)
            f = f.__func__
        if not is_user_function(f) or id(f) in self.functions:
            return
        self.functions.add(id(f))
        code = f.__code__
        for name, cell in zip(code.co_freevars, f.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            self.value(f"{name!r} (a closure variable of {code.co_qualname})", contents)
        self.code(code, f.__globals__)

    def code(self, code: types.CodeType, globals_: dict) -> None:
        for name in code_names(code):
            if name in globals_:
                self.value(f"{name!r} (a global read by {code.co_qualname})", globals_[name])

    def module_tree(self, root: torch.nn.Module) -> None:
        for mod in root.modules():
            self.seen.add(id(mod))
            self.user_class(type(mod))
            self.hooks(mod.__dict__, f"{type(mod).__name__}")
            for name, v in mod.__dict__.items():
                if isinstance(v, _CONTAINERS) and not name.startswith("_") and id(v) not in self.seen:
                    self.seen.add(id(v))
                    self.places.append((f"{type(mod).__name__}.{name}", v))

    def hooks(self, tables: dict, owner: str) -> None:
        for table in _HOOK_TABLES + _GLOBAL_HOOK_TABLES:
            for hook in tables.get(table, {}).values():
                self.function(hook)


def _state(x: Any) -> tuple:
    """What a container or object holds, shallowly, by identity (a write replaces an item or adds one)."""
    if isinstance(x, dict):
        return tuple((id(k), id(v)) for k, v in x.items())
    if isinstance(x, (list, collections.deque)):
        return tuple(map(id, x))
    if isinstance(x, set):
        return tuple(sorted(map(id, x)))
    return tuple((k, id(v)) for k, v in vars(x).items())


def _searched(fns: Iterable[Callable], own: Iterable[torch.nn.Module], objects: Iterable[Any] = ()) -> _Search:
    """The places reachable from torch's global module hooks, the jitted module tree and the traced functions."""
    search = _Search()
    search.hooks(vars(_torch_module), "global")
    for mod in own:
        search.module_tree(mod)
    for fn in fns:
        search.function(fn)
    for obj in objects:
        search.value(type(obj).__name__, obj)
    return search


class ContainerStates:
    """The containers and objects that the traced function, the modules' forward hooks and the jitted module's
    list and dict attributes name, as they are before tracing: ``changed`` lists those the trace wrote to."""

    def __init__(self, fns: Iterable[Callable], own: Iterable[torch.nn.Module]):
        search = _searched(fns, own)
        self._before = [(where, v, _state(v)) for where, v in search.places]
        self._caches = [(where, v, v.cache_info().currsize) for where, v in search.caches]

    def changed(self, codes: Iterable[types.CodeType] = ()) -> list[str]:
        """What the trace wrote to; a class by the attributes it set or deleted, with the line that did (found in
        ``codes``, the user code that ran) where one names the attribute."""
        out = []
        for where, v, state in self._before:
            now = _state(v)
            if now == state:
                continue
            if not isinstance(v, type):
                out.append(where)
                continue
            before, after = dict(state), dict(now)
            for name in sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k)):
                out.append(f"the class attribute {v.__qualname__}.{name}{_stored_at(codes, name)}")
        return out

    def clear_grown_caches(self) -> None:
        """Empty the ``functools.lru_cache`` caches that grew while tracing: what they stored was computed on
        proxies (``causal_mask(n)`` building a mask), which a later trace would use as a value of its own and eager
        code would get back in place of a tensor. A cache only saves work, so emptying it changes no result."""
        for where, cached, size in self._caches:
            if cached.cache_info().currsize > size:
                cached.cache_clear()
                log.info(
                    "fulmen: emptied the cache of %s (functools.lru_cache): it stored values computed while tracing",
                    where,
                )


def _stored_at(codes: Iterable[types.CodeType], name: str) -> str:
    """`` (line FILE:N)`` of the first attribute store or delete of ``name`` in ``codes``."""
    for code in codes:
        if name not in code.co_names:
            continue
        for ins in dis.get_instructions(code):
            if ins.opname in ("STORE_ATTR", "DELETE_ATTR") and ins.argval == name:
                return f" (line {code.co_filename}:{ins.positions.lineno})"
    return ""


def argument_containers(args: tuple, kwargs: dict, names: list[str]) -> list[tuple[str, Any, list]]:
    """The lists and dicts the traced function receives (``names``: its parameters'), with their items now
    (compared by ``check_no_escapes``: the function gets copies holding proxies, so what it adds to them would not
    reach the caller's)."""
    named = [(names[i] if i < len(names) else f"argument {i}", a) for i, a in enumerate(args)]
    named += list(kwargs.items())
    return [(name, a, _items(a)) for name, a in named if isinstance(a, (list, dict))]


def _items(x: list | dict) -> list:
    return list(x) if isinstance(x, list) else list(x.items())


def _same_items(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (x[0] is y[0] and x[1] is y[1]) if isinstance(x, tuple) and isinstance(y, tuple) else x is y
        for x, y in zip(a, b)
    )


def check_no_escapes(
    fns: Iterable[Callable],
    containers: list[tuple[str, Any, list]],
    codes: Iterable[tuple[types.CodeType, dict]],
    own: Iterable[torch.nn.Module],
    objects: Iterable[Any] = (),
) -> None:
    """Raise (after removing them) where the code traced stored proxies in a list, dict, set or user object that
    the program does not return: ``fns`` the traced function (and the user's function behind it), ``containers``
    the lists and dicts it received (``argument_containers``), ``codes`` the user code that ran with its globals,
    ``own`` the jitted module's tree, ``objects`` others the code used (the optimizers it stepped)."""
    search = _searched(fns, own, objects)
    for code, globals_ in codes:
        search.code(code, globals_)
    for name, a, before in containers:
        if not _same_items(before, _items(a)):
            raise NotImplementedError(
                f"the function changes the {type(a).__name__} passed as {name!r} (adds, removes or replaces items); "
                "it receives a copy while traced, and a compiled program does not repeat Python side effects, so "
                "the caller's would not change. Return the new items instead, or pass them in a Python object "
                "(an instance of your own class), whose changes fulmen repeats on every call."
            )
    found = search.found()
    if not found:
        return
    for _, container in found:
        _drop_proxies(container)
    where = found[0][0]
    raise NotImplementedError(
        f"the function stores a tensor it computes in {where}, a Python "
        f"{type(found[0][1]).__name__} outside the values it returns; a compiled program repeats only the "
        "tensor computation, so that container would not be updated on later calls (a forward hook collecting "
        "activations, a list of losses). Return the tensor from the function (or from the module's forward) and "
        'store it outside, or use torch.compile(model, backend="fulmen"), whose Dynamo repeats such side effects.'
    )


def warn_on_changes(fn: Callable, states: ContainerStates, codes: Iterable[types.CodeType] = ()) -> None:
    """Warn (once per function and containers) where the trace changed a list, dict, set, object or class without
    leaving a traced tensor there (``stats.append(correct.item())``, ``type(self).calls += 1``): a compiled
    program does not repeat it. ``codes``: the user code that ran, where the line that wrote is looked for."""
    changed = states.changed(codes)
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if changed and (name, tuple(changed)) not in _warned:
        _warned.add((name, tuple(changed)))
        log.warning(
            "fulmen: %s changes %s while being traced; the compiled program does not repeat Python side "
            "effects, so later calls leave it as it is. Make the change outside the compiled function (on "
            "the values it returns).",
            name,
            ", ".join(changed),
        )


class PythonStateWatch:
    """What ``fulmen.frontend.tracing.trace_program`` checks of the Python state around one trace: built before
    the function runs (``roots``: the traced function and the user's function behind it; ``args``/``kwargs``: the
    proxied arguments, ``names`` their parameters; ``own``: the jitted module's tree), ``check`` after it returned
    (``codes``: the recorder's user code and globals), ``clear_grown_caches`` whether it returned or raised."""

    def __init__(self, roots: tuple, args: tuple, kwargs: dict, names: list[str], own: Iterable[torch.nn.Module],
                 objects: list | None = None):
        self.roots, self.own = roots, own
        self.objects = objects if objects is not None else []  # filled while tracing (the optimizers stepped)
        self.containers = argument_containers(args, kwargs, names)
        self.states = ContainerStates(roots, own)

    def check(self, codes: dict) -> None:
        pairs = [(code, globals_) for code, (globals_, _) in codes.items()]
        check_no_escapes(self.roots, self.containers, pairs, self.own, self.objects)
        roots = [getattr(getattr(f, "__func__", f), "__code__", None) for f in self.roots]
        warn_on_changes(self.roots[-1], self.states, [*codes, *filter(None, roots)])

    def drop_escaped(self, codes: dict) -> None:
        """After a trace that raised: the proxies the code stored where it outlives the call (an optimizer's state
        made on its first step) are taken out again, so the caller's objects hold no placeholders."""
        search = _searched(self.roots, self.own, self.objects)
        for code, (globals_, _) in codes.items():
            search.code(code, globals_)
        for _, container in search.found():
            _drop_proxies(container)

    def clear_grown_caches(self) -> None:
        self.states.clear_grown_caches()
