"""What a jitted module's compiled program depends on beyond its tensors, and how a call sees that it changed.

A compiled module program depends on more than its parameters' shapes: which submodules there are, plain
attributes its ``forward`` reads (``self.scale = 3.0``), hooks, tensors held as plain attributes. Walking the
module tree to compare them costs about 2 us per module, too much for every call. So a call first runs the check
``watch`` returned with the last snapshot (``fulmen.frontend.tree_guard``: the versions of every dictionary of
the tree and of the global module hooks, and every module's class; one C++ guard check once the tree stayed
unchanged for a few calls); only when that fails does
it take a :func:`snapshot` of the tree again and, when the snapshot differs, re-key (``fulmen.frontend.module``).
Nothing in torch is patched for it: ``import fulmen`` and a live jitted module leave torch's objects as they are.
(While fulmen traces, ``nn.Module.__setattr__``/``__delattr__`` are wrapped to record module writes:
``fulmen.frontend.module_writes``.)

What a snapshot holds, for every module in the tree: its identity and class, the keys of its parameters and
buffers (which slots hold the same tensor, not the tensors themselves: a replaced parameter of the same
shape reuses the program), its plain attributes of simple types (bool, int, float, str, bytes, None, enums,
``torch.dtype``/``torch.device``, classes, tuples of these; tensors, functions and modules by identity),
``training``, and the ids of its forward and backward hooks; plus the global module hooks. A plain object held as
an attribute (a Hugging Face ``PretrainedConfig``, a dataclass: anything with a ``__dict__`` that is not a module,
tensor, function or class) is recorded by identity and by its members, as above, with lists, tuples and dicts of
those by value and the plain objects it holds in turn (``config.text_config``), up to ``OBJECT_DEPTH`` levels and
``OBJECT_ITEMS`` members: library code such as a Hugging Face ``forward`` reads ``self.config.use_cache`` or
``self.config.pad_token_id`` on every call, and ``global_guard`` does not follow library code. The check watches
those objects' ``__dict__`` versions too, so ``config.pad_token_id = 3`` or ``set_attn_implementation("sdpa")``
re-keys (a changed member the program never read recompiles too: sound, at the cost of one compile). Attributes
that compiled programs assign on every call are outputs, not structure (``mark_program_output``). Not seen: a
list or dict attribute of a module changed in place (``self.sizes.append(3)``) and globals a ``forward`` reads
(``fulmen.frontend.global_guard`` guards those). Members of ``__slots__`` count as members (the check compares
them by identity on every call: a slot write changes no dict version). An object deeper or larger than those
limits is recorded by the versions of the dicts (and the slot values) of every plain object it reaches, up to
``WATCHED_OBJECTS``, and the check watches them all: a write anywhere in it recompiles; past that limit a warning
says what is not seen.
"""

from __future__ import annotations

import enum
import functools
import gc
import itertools
import logging
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.nn.modules import module as _torch_module

from fulmen.frontend import tree_guard

log = logging.getLogger("fulmen")

# ---- snapshots (taken only when the check failed) ----

_serials: dict[int, tuple[weakref.ref, int]] = {}
_next_serial = 0


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _serials.get(key)
    if entry is not None and entry[0] is ref:
        del _serials[key]


def identity(obj: Any) -> Any:
    """A number naming ``obj`` for as long as it lives, never reused by a later object (unlike ``id``)."""
    global _next_serial
    key = id(obj)
    entry = _serials.get(key)
    if entry is not None and entry[0]() is obj:
        return entry[1]
    try:
        ref = weakref.ref(obj, lambda r, k=key: _forget(k, r))
    except TypeError:  # builtins and the like: not collected while a module holds them
        return ("id", key)
    _next_serial += 1
    _serials[key] = (ref, _next_serial)
    return _next_serial


_SIMPLE = (bool, int, str, bytes, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
_BY_IDENTITY = (torch.Tensor, types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_MISSING = object()


def attribute_value(v: Any) -> Any:
    """What a snapshot records of a plain attribute: its value for simple types, its identity for tensors,
    functions and modules, ``_MISSING`` (not recorded) for anything else."""
    t = type(v)
    if t in _SIMPLE:
        return (t, v)
    if t is float:
        return (float, v if v == v else "nan")  # nan != nan would make every snapshot new
    if t is tuple:
        items = tuple(attribute_value(x) for x in v)
        return _MISSING if _MISSING in items else (tuple, items)
    if isinstance(v, (enum.Enum, type)):
        return (t, v)
    if isinstance(v, (*_BY_IDENTITY, nn.Module)):
        return (t, "is", identity(v))
    return _MISSING


class StandIn:
    """A value fulmen puts in a module's ``__dict__`` for a while in place of what eager code reads there (the
    router that ``fulmen.jit(model).generate`` installs as ``forward``): a snapshot records what it stands for,
    so the tree's structure is the same with it in place or not, and a user's own value under it is seen."""

    __slots__ = ()

    def stands_for(self) -> Any:
        """The value it replaced, or ``tree_guard.MISSING_KEY`` where the key was absent."""
        raise NotImplementedError


#: How many levels of plain objects held by a module a snapshot follows (a config, its sub-configs).
OBJECT_DEPTH = 3
#: How many members (counting list and dict items) of one plain object a snapshot records at most; beyond that
#: the object is recorded by identity only.
OBJECT_ITEMS = 1024
_NOT_PLAIN = (
    type,
    types.FunctionType,
    types.MethodType,
    types.ModuleType,
    functools.partial,
    nn.Module,
    torch.Tensor,
    StandIn,
)


_plain_classes: dict[type, bool] = {}  # a dict, not lru_cache: a snapshot asks about every attribute of a tree


def _plain_class(cls: type) -> bool:
    """Whether a snapshot records the members of instances of ``cls``: not containers, modules, tensors, functions
    or classes, and not torch's or fulmen's own objects (a ``DeviceMesh``, hook handles, distributed state), which
    are not configuration and may change as they run."""
    known = _plain_classes.get(cls)
    if known is None:
        module = getattr(cls, "__module__", None) or ""
        known = not (
            issubclass(cls, (*_NOT_PLAIN, dict, list, tuple, set, frozenset, enum.Enum))
            or cls in _SIMPLE
            or module.partition(".")[0] in ("torch", "fulmen", "builtins")
        )
        _plain_classes[cls] = known
    return known


def plain_object_members(v: Any) -> list[tuple[str, Any]] | None:
    """The members of ``v`` (its ``__dict__``'s items, then its set ``__slots__`` members) when it is a plain
    object whose members a snapshot records (a config), else None. Read without running ``__getattr__`` or
    properties."""
    if not _plain_class(type(v)):
        return None
    attrs = _instance_dict(v)
    slots = tree_guard.slot_descriptors(type(v))
    if type(attrs) is not dict and not slots:
        return None
    members = list(attrs.items()) if type(attrs) is dict else []
    return members + tree_guard.slot_values(v, slots) if slots else members


def _instance_dict(v: Any) -> dict | None:
    """``v.__dict__`` without running ``__getattr__`` (a ``__slots__`` object has none)."""
    try:
        return object.__getattribute__(v, "__dict__")
    except (AttributeError, TypeError):
        return None


def _member_value(v: Any, depth: int, budget: list[int]) -> Any:
    """What a snapshot records of a member of a plain object: as ``attribute_value``, plus lists, tuples and dicts
    of such values by value and plain objects by their members (``_MISSING`` where the budget ran out)."""
    budget[0] -= 1
    if budget[0] < 0:
        return _MISSING
    recorded = attribute_value(v)
    if recorded is not _MISSING:
        return recorded
    t = type(v)
    if t in (list, tuple):
        items = tuple(_member_value(x, depth, budget) for x in v)
        return _MISSING if _MISSING in items else (t, items)
    if t is dict:
        items = tuple((attribute_value(k), _member_value(x, depth, budget)) for k, x in v.items())
        return _MISSING if any(_MISSING in kv for kv in items) else (dict, items)
    members = plain_object_members(v)
    if members is None:
        return _MISSING
    if depth <= 0:  # deeper than recorded by value: by the versions of what it reaches, which the check watches
        return _watched_record(v)
    return _object_value(v, members, depth - 1, budget)


def _object_value(v: Any, members: list[tuple[str, Any]], depth: int, budget: list[int]) -> tuple:
    recorded_members = []
    for key, x in members:
        recorded = _member_value(x, depth, budget)
        if budget[0] < 0:
            return _watched_record(v)
        if recorded is not _MISSING:
            recorded_members.append((key, recorded))
    return (type(v), "object", identity(v), tuple(recorded_members))


#: How many plain objects the check watches from one attribute of a module, at any depth (past OBJECT_DEPTH or
#: OBJECT_ITEMS, by their dicts' versions and their slots' values); beyond that a change is not seen (logged).
WATCHED_OBJECTS = 4096
_warned_unwatched: set[type] = set()


def _reachable(v: Any, found: dict[int, Any], limit: int) -> bool:
    """Add to ``found`` (id -> object) the plain objects ``v`` reaches through members, lists, tuples and dicts,
    ``v`` itself included; False where more than ``limit`` were found."""
    stack = [v]
    while stack:
        x = stack.pop()
        t = type(x)
        if t in (list, tuple):
            stack.extend(x)
        elif t is dict:
            stack.extend(x.values())
        elif id(x) not in found and (members := plain_object_members(x)) is not None:
            if len(found) >= limit:
                return False
            found[id(x)] = x
            stack.extend(m for _, m in members)
    return True


def _watched_record(v: Any) -> tuple:
    """A plain object too large or too deep to record by value: by the version of every dict and the values of
    every ``__slots__`` member of the objects it reaches, so that any write to them makes another snapshot."""
    found: dict[int, Any] = {}
    if not _reachable(v, found, WATCHED_OBJECTS):
        _warn_unwatched(v)
    state = []
    for x in found.values():
        attrs = _instance_dict(x)
        state.append((tree_guard.dict_version(attrs) if type(attrs) is dict else None,
                      tuple(id(m) for _, m in tree_guard.slot_values(x, tree_guard.slot_descriptors(type(x))))))
    return (type(v), "object", identity(v), "watched by version", tuple(state))


def _warn_unwatched(v: Any) -> None:
    if type(v) not in _warned_unwatched:
        _warned_unwatched.add(type(v))
        log.warning("fulmen: a %s held by a jitted module reaches more than %d plain objects; changes beyond them "
                    "between calls are not seen and keep the compiled program. Pass such values as arguments, or "
                    "call fulmen.jit again after changing them.", type(v).__name__, WATCHED_OBJECTS)


def object_dicts(modules: list[nn.Module]) -> tuple[list[dict], list[Any]]:
    """The ``__dict__`` of every plain object a snapshot of ``modules`` records (a config, at any depth), each once,
    and those of them with ``__slots__`` members (which the check compares by value)."""
    found: dict[int, Any] = {}
    known = _plain_classes.get
    for mod in modules:
        for v in list(mod.__dict__.values()):
            t = type(v)
            if known(t) or (t not in _plain_classes and _plain_class(t)):
                reached: dict[int, Any] = {}
                if not _reachable(v, reached, WATCHED_OBJECTS):
                    _warn_unwatched(v)
                found.update(reached)
    dicts = [d for x in found.values() if type(d := _instance_dict(x)) is dict]
    return dicts, [x for x in found.values() if tree_guard.slot_descriptors(type(x))]


def snapshot_records(v: Any) -> bool:
    """Whether a module's snapshot records a plain attribute holding ``v`` (so a change to it is seen)."""
    return attribute_value(v) is not _MISSING


def _module_entry(name: str, mod: nn.Module, tensor_index: dict[int, int], objects: dict[int, tuple]) -> tuple:
    slots = []
    for dict_name in ("_parameters", "_buffers"):
        for key, t in getattr(mod, dict_name).items():
            # which slots hold the same tensor, not which tensor: replacing one with another of the same shape
            # (the call's key checks shape, dtype, device, requires_grad) reuses the compiled program
            slots.append((key, None if t is None else tensor_index.setdefault(id(t), len(tensor_index))))
        slots.append(None)
    attrs = []
    outputs = _program_outputs.get(mod, {})
    for key, v in mod.__dict__.items():
        last = outputs.get(key, _MISSING)
        if last is not _MISSING and (last is _UNREAD or last is v):
            # a program output, not structure; one that code may read counts as such only while it holds what the
            # program assigned (before that, its None or absence may have chosen a branch of the trace)
            if last is v:
                attrs.append((key, "program output"))
            continue
        if isinstance(v, StandIn):
            v = v.stands_for()
            if v is tree_guard.MISSING_KEY:
                continue
        recorded = attribute_value(v)
        if recorded is _MISSING and (members := plain_object_members(v)) is not None:
            # a config shared by every layer is recorded in full once per snapshot, then by identity
            recorded = objects.get(id(v))
            if recorded is None:
                recorded = objects[id(v)] = _object_value(v, members, OBJECT_DEPTH - 1, [OBJECT_ITEMS])
            else:
                recorded = recorded[:3]
        if recorded is not _MISSING:
            attrs.append((key, recorded))
    hooks = tuple(tuple(getattr(mod, h, ())) for h in _HOOK_DICTS)
    return (name, identity(mod), (type(mod), _class_methods(type(mod))), tuple(slots), tuple(attrs), hooks)


def _class_methods(cls: type) -> tuple:
    """The methods (functions, properties, other descriptors) of ``cls`` and its bases below ``nn.Module``, by
    identity: replacing one (``Block.forward = patched``) changes what a call runs. Plain class attributes are not
    recorded (a counter written on every call would make every snapshot new); the guard on globals checks those
    the user's code reads."""
    classes = _module_classes(cls)
    version = tuple(tree_guard.dict_version(_class_dict(c)) for c in classes)
    cached = _methods.get(cls)
    if cached is None or cached[0] != version or None in version:
        methods = tuple((c.__qualname__, k, id(v)) for c in classes for k, v in vars(c).items()
                        if callable(v) or hasattr(v, "__get__"))
        cached = _methods[cls] = (version, methods)
    return cached[1]


_methods: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> (its dict's version, its methods)


def _class_dict(cls: type) -> dict:
    """The dictionary behind ``cls.__dict__`` (a read-only view; the same dict for the class's life)."""
    return next(d for d in gc.get_referents(cls.__dict__) if type(d) is dict)


def _module_classes(cls: type) -> list[type]:
    return [c for c in cls.__mro__ if c not in _FIXED_CLASSES and issubclass(c, nn.Module)]


_FIXED_CLASSES = frozenset((nn.Module, object))


def class_dicts(modules: list[nn.Module]) -> list[dict]:
    """The dictionaries behind the ``__dict__`` of the modules' classes (``_class_methods``), each once: a write to
    a class attribute changes its version."""
    found: dict[int, dict] = {}
    for cls in {type(m) for m in modules}:
        for c in _module_classes(cls):
            if id(c) not in found:
                found[id(c)] = _class_dict(c)
    return list(found.values())


#: module -> {name: the tensor a program last assigned} for the plain attributes that compiled programs assign on
#: every call (``self.last = y``); ``_UNREAD`` for those no code reads, left out of snapshots altogether
_program_outputs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_UNREAD = object()
_UNASSIGNED = object()


def mark_program_output(mod: nn.Module, name: str, read: bool) -> None:
    """``mod.name`` is assigned by a compiled program on every call; ``read``: some code may read it."""
    outputs = _program_outputs.setdefault(mod, {})
    last = outputs.get(name, _MISSING)
    if last is _MISSING or (read and last is _UNREAD):
        outputs[name] = _UNASSIGNED if read else _UNREAD
    tree_guard.mark_owned(mod, "__dict__")


def program_outputs(mod: nn.Module) -> dict:
    """The dictionary ``assign_program_output`` keeps for ``mod``."""
    return _program_outputs.setdefault(mod, {})


def assign_program_output(mod: nn.Module, outputs: dict, name: str, value: Any) -> None:
    """Set ``mod.name`` to what a compiled program returned for it (straight into ``__dict__``: no structure
    change). Where code may read it and it held something else before (None, nothing, the user's tensor), the
    module's snapshot changes: the write is left for the next call's check to see, and it looks."""
    attrs = mod.__dict__
    last = outputs.get(name, _UNREAD)
    seen = last is _UNREAD or attrs.get(name, _MISSING) is last
    if last is not _UNREAD:
        outputs[name] = value
    if seen:
        tree_guard.write_owned(attrs, name, value)
    else:
        attrs[name] = value


def tree_modules(root: nn.Module) -> list[nn.Module]:
    """The modules of ``root``'s tree, each once, with the original inside each fulmen.jit wrapper in it and the
    modules held in plain lists, tuples and dicts (``held_modules``)."""
    seen: dict[int, nn.Module] = {}
    for _, mod in named_tree(root, remove_duplicate=True):
        seen[id(mod)] = mod
        inner = mod.__dict__.get("_fulmen_module")
        if isinstance(inner, nn.Module):
            seen.setdefault(id(inner), inner)
    return list(seen.values())


def named_tree(root: nn.Module, remove_duplicate: bool = False) -> list[tuple[str, nn.Module]]:
    """``root.named_modules()``, followed by the modules held in plain lists, tuples and dicts of the tree's
    modules and their own trees (``self.blocks = [nn.Dropout()]``: not submodules, so ``root.train()`` does not
    reach them, but ``forward`` calls them and reads their ``training``), named ``blocks[0]``."""
    named = list(root.named_modules(remove_duplicate=remove_duplicate))
    registered = {id(m) for _, m in named}
    i = 0
    while i < len(named):
        name, mod = named[i]
        i += 1
        for attr, v in mod.__dict__.items():
            if type(v) not in (list, tuple, dict) or attr.startswith("_"):
                continue
            for key, held in v.items() if type(v) is dict else enumerate(v):
                if isinstance(held, nn.Module) and id(held) not in registered:
                    prefix = f"{name}.{attr}[{key!r}]" if name else f"{attr}[{key!r}]"
                    sub = list(held.named_modules(prefix=prefix, remove_duplicate=remove_duplicate))
                    registered.update(id(m) for _, m in sub)
                    named += sub
    return named


def watch(root: nn.Module, previous: Callable[[], bool] | None = None) -> tuple[tuple, Callable[[], bool]]:
    """``root``'s snapshot, and a check that is true on a later call while the tree is still the one the snapshot
    describes (``fulmen.frontend.tree_guard``; ``previous``: the check it replaces). The check records the tree as
    it is before the snapshot reads it: a change made while the snapshot is taken fails it."""
    modules = tree_modules(root)
    dicts, slotted = object_dicts(modules)
    check = tree_guard.build(modules, previous, dicts + class_dicts(modules), slotted)
    taken = snapshot(root)
    if [id(m) for m in tree_modules(root)] != [id(m) for m in modules]:  # changed before the check recorded it
        check = tree_guard.never
    return taken, check


class _StructureWatch:
    """A module passed to a jitted function as an argument (or held in one): which structure it has now, as a
    small number (the same for the same snapshot), the snapshot retaken only when its check fails."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.serial = next(_watch_serials)  # never reused: a key holding it never matches another watch's
        self.versions: dict[tuple, int] = {}
        self.check: Callable[[], bool] = tree_guard.never
        self.version = -1
        self.last: tuple | None = None  # the last snapshot taken

    def current(self) -> int:
        if not self.check():
            taken, self.check = watch(self.module, self.check)
            version = self.versions.get(taken)
            if version is None:  # the same structure when only attributes no code reads were assigned by programs
                last = self.last
                same = last is not None and differs_only_in(last, taken, _unread_outputs(self.module))
                version = self.versions[taken] = self.version if same else len(self.versions)
            self.version, self.last = version, taken
        return self.version


def _unread_outputs(root: nn.Module) -> frozenset:
    """(identity of a module, attribute) for each attribute of ``root``'s tree that compiled programs assign and no
    code reads (``mark_program_output``): its value is no part of the structure."""
    return frozenset((identity(m), name) for m in tree_modules(root)
                     for name, last in _program_outputs.get(m, {}).items() if last is _UNREAD)


_watch_serials = itertools.count()
#: The modules whose structure was asked for last (``structure``), by id; bounded, as each holds its module
_structures: dict[int, _StructureWatch] = {}
_MAX_STRUCTURES = 64


def structure(module: nn.Module) -> tuple[int, int]:
    """A key part naming ``module``'s tree structure as a snapshot describes it (train/eval, plain attributes,
    configs, hooks, tied tensors): equal for the same structure, checked by dictionary versions between calls."""
    found = _structures.get(id(module))
    if found is None or found.module is not module:
        found = _structures[id(module)] = _StructureWatch(module)
        while len(_structures) > _MAX_STRUCTURES:
            _structures.pop(next(iter(_structures)), None)
    return (found.serial, found.current())  # versions count per watch, which a new one restarts


def snapshot(root: nn.Module) -> tuple:
    """Everything about ``root``'s tree a compiled program may depend on, beyond the tensors' own metadata."""
    tensor_index: dict[int, int] = {}
    objects: dict[int, tuple] = {}
    entries = []
    tree = named_tree(root)
    for _, mod in tree:
        if isinstance(mod, _LazyGraphModule):
            # a lazy GraphModule puts its generated forward on its class at its first call, which eager would do at
            # this call too: generated now, the class's methods are recorded as every later call sees them
            mod.real_recompile()
    for name, mod in tree:
        entries.append(_module_entry(name, mod, tensor_index, objects))
        inner = mod.__dict__.get("_fulmen_module")  # a fulmen.jit wrapper inside: its original's hooks count
        if isinstance(inner, nn.Module):
            entries.append(_module_entry(name + ".<original>", inner, tensor_index, objects))
    global_hooks = tuple(tuple(getattr(_torch_module, f"_global_{h[1:]}", ())) for h in _HOOK_DICTS)
    return (tuple(entries), global_hooks)


def differs_only_in(old: tuple, new: tuple, written: frozenset) -> bool:
    """Whether two snapshots of a tree differ only in plain attributes listed in ``written`` (pairs of a module's
    ``identity`` and an attribute name)."""
    if old[1] != new[1] or len(old[0]) != len(new[0]):
        return False
    for before, after in zip(old[0], new[0]):
        if before[:4] != after[:4] or before[5] != after[5]:
            return False
        if before[4] != after[4]:
            old_attrs, new_attrs = dict(before[4]), dict(after[4])
            for key in old_attrs.keys() | new_attrs.keys():
                if old_attrs.get(key) != new_attrs.get(key) and (after[1], key) not in written:
                    return False
    return True


def _object_record(r: Any) -> bool:
    return type(r) is tuple and len(r) == 4 and r[1] == "object" and type(r[3]) is tuple


def _changed_member(name: str, path: str, old: Any, new: Any) -> str:
    """That attribute ``path`` of ``name`` changed, ``path`` extended to the first member that differs where both
    records are of the same plain object, with the values when they are simple (``attribute
    'config.pad_token_id' of the module changed from None to 3``)."""
    while _object_record(old) and _object_record(new) and old[2] == new[2]:
        before, after = dict(old[3]), dict(new[3])
        key = next((k for k in {**before, **after} if before.get(k) != after.get(k)), None)
        if key is None:
            break
        path, old, new = f"{path}.{key}", before.get(key), after.get(key)
    if "." in path and all(type(r) is tuple and len(r) == 2 and type(r[0]) is type for r in (old, new)):
        return f"attribute {path!r} of {name} changed from {old[1]!r} to {new[1]!r}"
    return f"attribute {path!r} of {name} changed"


def describe_change(old: tuple | None, new: tuple) -> str:
    """Which part of a module tree differs between two snapshots, in words (for the recompile reason)."""
    if old is None:
        return "the module changed"
    if old[1] != new[1]:
        return "a global module hook was added or removed"
    old_entries = {e[0]: e for e in old[0]}
    for entry in new[0]:
        name = f"submodule {entry[0]!r}" if entry[0] else "the module"
        before = old_entries.get(entry[0])
        if before is None:
            return f"{name} was added"
        if before[1] == entry[1] and before[2][0] is entry[2][0] and before[2] != entry[2]:
            return f"a method of {entry[2][0].__qualname__} (the class of {name}) was replaced"
        if before[1:3] != entry[1:3]:
            return f"{name} was replaced" if entry[0] else "the module's class changed"
        if before[3] != entry[3]:
            return f"a parameter or buffer of {name} was added, removed or tied differently"
        if before[4] != entry[4]:
            old_attrs, new_attrs = dict(before[4]), dict(entry[4])
            for key in {**old_attrs, **new_attrs}:
                if old_attrs.get(key) != new_attrs.get(key):
                    if key == "training":
                        return f"the train/eval mode of {name}"
                    return _changed_member(name, key, old_attrs.get(key), new_attrs.get(key))
        if before[5] != entry[5]:
            return f"a hook was added to or removed from {name}"
    return "a submodule was removed"


# ---- what fulmen.jit cannot run ----

_BACKWARD_GLOBALS = (("_global_backward_hooks", "torch.nn.modules.module.register_module_full_backward_hook"),
                     ("_global_backward_pre_hooks",
                      "torch.nn.modules.module.register_module_full_backward_pre_hook"))


def _hook_name(hook) -> str:
    code = getattr(hook, "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"{getattr(hook, '__qualname__', type(hook).__name__)}{where}"


def check_no_backward_hooks(root: nn.Module) -> None:
    """Module backward hooks run when PyTorch's autograd reaches a module's inputs; a fulmen program has no
    module boundaries in its backward, so it would silently skip them. Raise instead."""
    for attr, registration in _BACKWARD_GLOBALS:
        hooks = getattr(_torch_module, attr, {})
        if hooks:
            raise NotImplementedError(
                f"fulmen.jit cannot run the global module backward hook {_hook_name(next(iter(hooks.values())))} "
                f"(registered with {registration}): the compiled backward has no module boundaries, so the hook "
                "would silently not run. Use torch.compile(model, backend=\"fulmen\"), which runs module backward "
                "hooks, or remove the hook while using fulmen.jit.")
    for name, mod in root.named_modules():
        for dict_name in ("_backward_hooks", "_backward_pre_hooks"):
            hooks = getattr(mod, dict_name, None)
            if not hooks:
                continue
            if dict_name == "_backward_pre_hooks":
                registration = "register_full_backward_pre_hook"
            elif mod._is_full_backward_hook:
                registration = "register_full_backward_hook"
            else:
                registration = "register_backward_hook"
            where = f"submodule {name!r} ({type(mod).__name__})" if name else f"the module ({type(mod).__name__})"
            raise NotImplementedError(
                f"fulmen.jit cannot run the backward hook {_hook_name(next(iter(hooks.values())))} registered "
                f"with {registration} on {where}: the compiled backward has no module boundaries, so the hook "
                "would silently not run and gradients could differ from eager. Use "
                "torch.compile(model, backend=\"fulmen\"), which runs module backward hooks, or remove the hook "
                "(handle.remove()) while using fulmen.jit"
                + (", or register it on the fulmen.jit wrapper, which runs it around the compiled program."
                   if not name else "."))
