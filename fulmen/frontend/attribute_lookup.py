"""Where Python's attribute lookup finds a value, and which code is the user's.

``load_chains`` lists the attribute chains a code object loads (``cfgmod.SCALE``, ``self.cfg.sub.mult``);
``lookup`` resolves one link of such a chain the way ``object.__getattribute__`` would -- an object's
``__dict__`` or ``__slots__``, its class's MRO, a user module's globals, a submodule -- without running any code,
and says which dictionary entries hold the value or must stay missing for the read to give the same value again.
``fulmen.frontend.global_guard`` turns those into the checks a cached program runs before it is reused.
"""

from __future__ import annotations

import dis
import functools
import os
import sys
import sysconfig
import types
from typing import Any

import torch

from fulmen.core.proxies import is_library_file
from fulmen.frontend import module_guard

MISSING = object()
#: The owner of a check that reads a ``__slots__`` member of the object itself (not a dictionary entry).
SLOT = object()


def _installed_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(d + os.sep for d in dirs)


_INSTALLED = _installed_dirs()


@functools.lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    """Code the user may change between calls: not torch, fulmen, an installed package or the standard library."""
    if is_library_file(filename):
        return False
    if filename.startswith("<"):  # exec'd code, notebooks ("<ipython-input-...>"), but not frozen stdlib modules
        return not filename.startswith("<frozen")
    return not os.path.realpath(filename).startswith(_INSTALLED)


def is_user_function(f: Any) -> bool:
    return isinstance(f, types.FunctionType) and is_user_file(f.__code__.co_filename)


_CHAIN_ROOTS = {"LOAD_GLOBAL": "global", "LOAD_DEREF": "cell", "LOAD_CLASSDEREF": "cell", "LOAD_FAST": "local"}


@functools.lru_cache(maxsize=4096)
def load_chains(code: types.CodeType) -> frozenset[tuple[str, ...]]:
    """``(root, name, attribute, ...)`` for each attribute chain ``code`` (and the code nested in it) loads: from a
    global (``cfgmod.SCALE``, ``K.scale``), a closure variable (``root`` "cell") or a local (``root`` "local",
    followed only for a method's ``self``, ``self.cfg.sub.mult``, and the traced function's arguments)."""
    chains, chain = set(), None
    for ins in dis.get_instructions(code):
        root = _CHAIN_ROOTS.get(ins.opname)
        if root is not None:
            if chain is not None:
                chains.add(chain)
            chain = (root, ins.argval)
        elif chain is not None and ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            chain += (ins.argval,)
        elif ins.opname not in ("CACHE", "EXTENDED_ARG", "PUSH_NULL"):
            if chain is not None:
                chains.add(chain)
            chain = None
    if chain is not None:
        chains.add(chain)
    chains = {c for c in chains if len(c) > 2}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            chains |= load_chains(const)
    return frozenset(chains)


_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python (a builtin type is not)


@functools.lru_cache(maxsize=4096)
@functools.lru_cache(maxsize=4096)
def code_names(code: types.CodeType) -> frozenset[str]:
    """The global and attribute names a code object and the code nested in it (comprehensions, lambdas) use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= code_names(const)
    return frozenset(names)


def is_user_class(cls: type) -> bool:
    """A class defined in the user's code (not in torch, fulmen, installed packages or C)."""
    if not cls.__flags__ & _HEAPTYPE:
        return False
    file = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return file is None or is_user_file(file)


def is_user_module(module: types.ModuleType) -> bool:
    file = getattr(module, "__file__", None)
    return file is not None and is_user_file(file)


def kind(owner: Any) -> str:
    if isinstance(owner, type):
        return f"class {owner.__qualname__}"
    if isinstance(owner, types.ModuleType):
        return f"module {owner.__name__}"
    return f"{type(owner).__name__} object"


def lookup(obj: Any, attr: str, covered: set[int]) -> tuple[list, Any, Any] | None:
    """Where Python's attribute lookup finds ``obj.attr``: ``(checks, value, instance)``. ``checks`` are
    ``(dict, owner, present)``: the key ``attr`` of that ``__dict__`` holds the value (``present``) or stays
    missing (an instance's ``__dict__`` before its class's, a subclass's before its base's), so that a later
    ``K.scale = 5`` or ``inst.scale = 5`` is seen. ``instance``: the ``self`` of a method the value is. None when
    the value comes from code (a property, ``__getattr__``) or from a library module or class, which are not the
    user's to change between calls. Modules in ``covered`` have their plain attributes and submodules checked by
    their structure snapshot (``module_guard``): those need no check here."""
    if isinstance(obj, types.ModuleType):
        attrs = obj.__dict__
        if not is_user_module(obj) or attr not in attrs:
            return None
        return [(attrs, obj, True)], attrs[attr], MISSING
    if attr == "__class__":
        return [], type(obj), MISSING
    if attr.startswith("__") and attr.endswith("__"):
        return None
    is_class = isinstance(obj, type)
    if type(obj).__getattribute__ not in (object.__getattribute__, type.__getattribute__):
        return None  # a class of its own lookup: code decides what the read gives
    mro = obj.__mro__ if is_class else type(obj).__mro__
    definer = next((klass for klass in mro if attr in klass.__dict__), None)
    in_class = definer.__dict__[attr] if definer is not None else MISSING
    checks: list = []
    if not is_class:
        found = _on_instance(obj, attr, definer, in_class, covered, checks)
        if found is not _FROM_CLASS:
            return found
    elif in_class is MISSING:
        return None
    return _from_class(obj, is_class, mro, definer, in_class, checks)


#: ``_on_instance``'s answer when the value is the class's (the lookup goes on in ``_from_class``)
_FROM_CLASS = object()


def _on_instance(obj: Any, attr: str, definer, in_class, covered: set[int], checks: list):
    """The lookup's answer when the instance decides it (its ``__dict__``, a property, a slot, a submodule), else
    ``_FROM_CLASS`` with the check that the instance's ``__dict__`` stays without ``attr`` added to ``checks``."""
    if in_class is not MISSING and hasattr(type(in_class), "__set__"):  # a property or slot: code runs
        if type(in_class) is property and is_user_class(definer):  # its getter is followed, with this self
            return [(definer.__dict__, definer, True)], in_class, obj
        if type(in_class) is types.MemberDescriptorType and is_user_class(definer):  # __slots__
            value = getattr(obj, attr, MISSING)
            return None if value is MISSING else ([(obj, SLOT, True)], value, MISSING)
        return None
    attrs = getattr(obj, "__dict__", None)
    module = isinstance(obj, torch.nn.Module)
    if type(attrs) is dict:
        if attr in attrs:
            value = attrs[attr]
            snapshot_checks = module and id(obj) in covered and module_guard.snapshot_records(value)
            return ([] if snapshot_checks else [(attrs, obj, True)]), value, MISSING
        if not (module and id(obj) in covered):
            checks.append((attrs, obj, False))
    if in_class is MISSING:
        if module and attr in obj._modules:  # a submodule: its ancestor's snapshot or watch checks it
            value = obj._modules[attr]
            return ([] if id(obj) in covered else [(obj._modules, obj, True)]), value, MISSING
        return None
    return _FROM_CLASS


def _from_class(obj: Any, is_class: bool, mro, definer, in_class, checks: list):
    """The lookup's answer for a value a user class defines: the classes before it in the MRO stay without the
    attribute, and the definer keeps it; a method's ``self`` (or ``cls``) is returned with it."""
    if not is_user_class(definer):
        return None
    for klass in mro:
        if klass is definer:
            break
        if is_user_class(klass):
            checks.append((klass.__dict__, klass, False))
    checks.append((definer.__dict__, definer, True))
    if isinstance(in_class, (staticmethod, classmethod)):
        return checks, in_class.__func__, (obj if is_class else type(obj)) if isinstance(in_class, classmethod) \
            else MISSING
    if isinstance(in_class, types.FunctionType):
        return checks, in_class, MISSING if is_class else obj
    if hasattr(type(in_class), "__get__"):  # another descriptor: what it returns is code's to decide
        return None
    return checks, in_class, MISSING

