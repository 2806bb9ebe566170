"""Whether a module tree is still as it was when a program was keyed on it, checked on every call without
patching torch.

Every structural change to a module goes through one of its dictionaries: ``__dict__`` (plain attributes,
``training``), ``_parameters``, ``_buffers``, ``_modules`` and the four hook dictionaries; the global module hooks
live in dictionaries of ``torch.nn.modules.module``. CPython gives each dict a version tag that changes on every
write (PEP 509; what Dynamo's ``DICT_VERSION`` guard reads), so a tree whose dictionaries all kept their versions
has not changed, whoever wrote and however (``setattr``, ``register_*``, a container edit, ``handle.remove()``,
a direct ``module._parameters[k] = p``, another thread). ``build`` records the versions, and the type of every
module (``module.__class__ = X`` writes no dict). A call compares them with a Python loop; once the tree stayed
unchanged for ``_STABLE_CALLS`` calls, with one PyTorch C++ guard tree (a version guard per dict, a type guard per
module), whose build costs several snapshots and so is not paid by a tree that changes on every call. A small
tree stays with the loop while ``torch._dynamo`` is not loaded (the guard trees need it; Inductor and
``torch.compile`` load it), sparing a plain jitted call the import.

Dictionaries fulmen itself writes on every call (``owned``: a module attribute a program assigns, a buffer it
rebinds) cannot be checked by version. They are compared by content: the same keys, each value the same object,
where fulmen's own writes (``write_owned``) update what every guard expects. A write by anyone else, before or
after fulmen's, leaves the dict holding something no guard expects.

A dict fulmen writes only for a while (``swap_owned``: ``generate``'s router puts ``forward`` in a model's
``__dict__`` and removes it after) keeps being checked by version, in Python: the swap tells each check that held
the dict's version before it the version it leaves. A check that did not (someone wrote the dict since) is not
told, and fails.
"""

from __future__ import annotations

import logging
import operator
import sys
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.nn.modules import module as _torch_module

try:
    from torch._C._dynamo import guards as _guards

    _dict_version = _guards.dict_version
except (ImportError, AttributeError):  # a torch without Dynamo's guards: every call walks the tree
    _guards = _dict_version = None


def _versions_track_writes() -> bool:
    """Whether this Python's dict versions change on every write (PEP 509's tag, which later Pythons may drop):
    where they do not, no check is trusted and every call walks the tree."""
    d: dict = {}
    seen = [_dict_version(d)]
    for write in (lambda: d.__setitem__("a", 1), lambda: d.__setitem__("a", 2), lambda: d.pop("a")):
        write()
        seen.append(_dict_version(d))
    return len(set(seen)) == len(seen)


if _guards is not None and not _versions_track_writes():
    _guards = _dict_version = None

log = logging.getLogger("fulmen")

#: The dictionaries of a module through which its structure changes.
MODULE_DICTS = (
    "_parameters",
    "_buffers",
    "_modules",
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
)
_GLOBAL_DICTS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)
#: Trees with at most this many dictionaries are checked in Python while ``torch._dynamo`` is not loaded.
_PYTHON_CHECK_LIMIT = 64
#: Calls a tree must stay unchanged for before its C++ guard tree is built.
_STABLE_CALLS = 16


def never() -> bool:
    """The check of a tree that must be looked at again."""
    return False


# ---- dictionaries fulmen writes on every call ----

_owned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> names of its dicts fulmen writes
_expectations: dict[int, list[weakref.ref]] = {}  # id(dict) -> the _Expected of live guards over it
_swapped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> names of its dicts swap_owned writes
_version_watchers: dict[int, list[weakref.ref]] = {}  # id(dict) -> live TreeChecks comparing its version
_lock = threading.Lock()


MISSING_KEY = object()  # swap_owned's "no such key"


def mark_owned(mod: nn.Module, dict_name: str) -> None:
    """Compiled programs write ``mod``'s ``dict_name`` (``"__dict__"`` or ``"_buffers"``) on every call."""
    with _lock:
        _owned.setdefault(mod, set()).add(dict_name)


def mark_swapped(mod: nn.Module, dict_name: str) -> None:
    """fulmen puts values in ``mod``'s ``dict_name`` for a while with ``swap_owned`` (the router of ``generate``):
    checks built from now on keep comparing its version in Python (never in the C++ tree), so that the swap can
    tell them the version it leaves."""
    with _lock:
        _swapped.setdefault(mod, set()).add(dict_name)


class _Expected:
    """What a guard expects an owned dictionary to hold: its keys in order and each value by identity. ``state``
    is one attribute, replaced whole when fulmen adds or removes a key (``swap_owned``), so a check in another
    thread never pairs the keys of one state with the values of another."""

    __slots__ = ("d", "state", "__weakref__")

    def __init__(self, d: dict):
        items = tuple(d.items())  # one read under the GIL
        self.d = d
        keys = tuple(k for k, _ in items)
        self.state = (keys, [v for _, v in items], {k: i for i, k in enumerate(keys)})

    def holds(self) -> bool:
        keys, values, _ = self.state
        d = self.d
        return tuple(d) == keys and all(map(operator.is_, d.values(), values))

    def wrote(self, key: str, value: Any) -> None:
        """``d[key] = value`` happened, as a dict does it: an existing key keeps its place, a new one goes last."""
        keys, values, index = self.state
        i = index.get(key)
        if i is not None:
            values[i] = value
        else:
            self.state = (keys + (key,), [*values, value], {**index, key: len(keys)})

    def removed(self, key: str) -> None:
        keys, values, index = self.state
        i = index.get(key)
        if i is not None:
            keys = keys[:i] + keys[i + 1 :]
            self.state = (keys, values[:i] + values[i + 1 :], {k: j for j, k in enumerate(keys)})


def _expect(d: dict) -> _Expected:
    expected = _Expected(d)
    with _lock:
        refs = [r for r in _expectations.get(id(d), ()) if r() is not None]
        refs.append(weakref.ref(expected))
        _expectations[id(d)] = refs
    return expected


def _expecting(d: dict) -> list[_Expected]:
    """The live guards' expectations of ``d`` (call with ``_lock`` held)."""
    found = []
    for ref in _expectations.get(id(d), ()):
        expected = ref()
        if expected is not None and expected.d is d:
            found.append(expected)
    return found


def write_owned(d: dict, key: str, value: Any) -> None:
    """``d[key] = value`` by fulmen on a call, told to the guards that compare ``d`` by content. Stored first: a
    write by another thread after it makes ``d`` differ from what they expect, and one before it is overwritten,
    as the eager call would overwrite it. Only keys the guards already expect: a new key fails them."""
    d[key] = value
    if _expectations.get(id(d)):
        with _lock:
            for expected in _expecting(d):
                if key in expected.state[2]:
                    expected.wrote(key, value)


def swap_owned(d: dict, key: str, value: Any) -> Any:
    """Put ``value`` in ``d[key]`` for a while (``MISSING_KEY``: remove the key), fulmen's write that its guards
    expect, and return what ``d`` held there (``MISSING_KEY`` for nothing), to be put back the same way. Guards
    comparing ``d`` by content learn the new content, those comparing its version (``mark_swapped``) the new
    version. Unlike ``write_owned``, the value replaced is not fulmen's own: a guard that did not expect ``d`` as
    it was (a user wrote it since the guard was built) is not told, so it still fails and the change is looked
    at."""
    with _lock:
        holding = [e for e in _expecting(d) if e.holds()]
        version = _dict_version(d) if _guards is not None else None
        checks = [c for r in _version_watchers.get(id(d), ()) if (c := r()) is not None and c.expects(d, version)]
        before = d.get(key, MISSING_KEY)
        if value is MISSING_KEY:
            d.pop(key, None)
        else:
            d[key] = value
        for expected in holding:
            if value is MISSING_KEY:
                expected.removed(key)
            else:
                expected.wrote(key, value)
        if checks:
            version = _dict_version(d)
            for check in checks:
                check.expect_version(d, version)
    return before


def dict_version(d: dict) -> int | None:
    """``d``'s version tag (PEP 509), None where this Python or torch cannot read it."""
    return _dict_version(d) if _dict_version is not None else None


# ---- objects with __slots__: no dict version to read, so their members are compared on every call ----

_slot_descriptors: dict[type, tuple] = {}


def slot_descriptors(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, member descriptor) of every ``__slots__`` member of ``cls`` and its bases: reading one runs no user
    code (a property of the same name would)."""
    found = _slot_descriptors.get(cls)
    if found is None:
        pairs: dict[str, Any] = {}
        for c in cls.__mro__:
            slots = c.__dict__.get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name.startswith("__") and not name.endswith("__"):  # a private name, stored mangled
                    name = f"_{c.__name__.lstrip('_')}{name}"
                desc = c.__dict__.get(name)
                if type(desc) is types.MemberDescriptorType:
                    pairs.setdefault(name, desc)
        found = _slot_descriptors[cls] = tuple(pairs.items())
    return found


def slot_values(obj: Any, descriptors: tuple[tuple[str, Any], ...]) -> list[tuple[str, Any]]:
    """(name, value) of ``obj``'s set ``__slots__`` members."""
    out = []
    for name, desc in descriptors:
        try:
            out.append((name, desc.__get__(obj)))
        except AttributeError:  # not set
            pass
    return out


class _SlotValues:
    """What a check expects an object's ``__slots__`` members to hold, each by identity."""

    __slots__ = ("obj", "descriptors", "values")

    def __init__(self, obj: Any):
        self.obj, self.descriptors = obj, slot_descriptors(type(obj))
        self.values = [v for _, v in slot_values(obj, self.descriptors)], type(obj)

    def holds(self) -> bool:
        values, cls = self.values
        obj = self.obj
        return type(obj) is cls and all(map(operator.is_, [v for _, v in slot_values(obj, self.descriptors)], values))


# ---- the check ----


def _module_dicts(mod: nn.Module) -> list[tuple[str, Any]]:
    attrs = mod.__dict__
    return [("__dict__", attrs)] + [(name, attrs.get(name)) for name in MODULE_DICTS]


def build(
    modules: Sequence[nn.Module],
    previous: Callable[[], bool] | None = None,
    objects: Sequence[dict] = (),
    slotted: Sequence[Any] = (),
) -> Callable[[], bool]:
    """A function saying whether ``modules`` (a tree's, each once) and the global module hooks are as they are now:
    the same types, and every dictionary unchanged. Call it before reading the tree, so a change made meanwhile
    fails it. ``previous``: the check it replaces, whose C++ guard tree it keeps where that still holds.
    ``objects``: the ``__dict__`` of each plain object the tree's snapshot records members of (a config);
    ``slotted``: such objects with ``__slots__`` members, compared member by member."""
    if _guards is None:
        return never
    dicts = [vars(_torch_module), *(getattr(_torch_module, name) for name in _GLOBAL_DICTS)]
    owned_dicts: list[dict] = []
    swapped: list[int] = []
    for mod in modules:
        owned, swaps = _owned.get(mod, ()), _swapped.get(mod, ())
        for name, d in _module_dicts(mod):
            if not isinstance(d, dict):  # a ScriptModule's wrappers: no version to check
                return never
            if name in owned:
                owned_dicts.append(d)
            else:
                if name in swaps:
                    swapped.append(len(dicts))
                dicts.append(d)
    dicts.extend(objects)
    previous = previous if isinstance(previous, TreeCheck) else None
    check = TreeCheck(tuple(modules), tuple(dicts), owned_dicts, previous, frozenset(swapped))
    check.slots = tuple(map(_SlotValues, slotted))
    return check


class TreeCheck:
    """The check ``build`` returns. The versions of ``dicts`` are compared in a Python loop until the tree stayed
    unchanged for ``_STABLE_CALLS`` calls; then those that did not change at the last rebuild go into one C++ guard
    tree (with the modules' types), the others stay in the loop. A rebuild keeps the previous C++ tree when none
    of its dicts changed: a dict that changes often (a ``forward`` that ``generate`` routes, parameters FSDP2
    swaps in) costs a version read per call, not a new tree per change. The tree is built only where the tree is
    large or ``torch._dynamo`` is loaded anyway (its guard managers need it)."""

    def __init__(self, modules: tuple, dicts: tuple, owned_dicts: list, previous: TreeCheck | None,
                 swapped: frozenset[int] = frozenset()):
        self.modules, self.dicts = modules, dicts
        self.types = tuple(map(type, modules))
        self.versions = tuple(map(_dict_version, dicts))
        self.expected = [_expect(d) for d in owned_dicts]
        self.swapped = swapped  # dicts swap_owned writes: compared in Python, told each version it leaves
        if swapped:
            _watch_versions(self, [dicts[i] for i in swapped])
        self.slots: tuple[_SlotValues, ...] = ()  # objects with __slots__ members (``build``)
        self.passed = 0
        self.promote = "torch._dynamo.guards" in sys.modules or len(dicts) > _PYTHON_CHECK_LIMIT
        self.changed: frozenset[int] = frozenset()  # dicts written since the previous check was built
        self.tree = self.tree_inputs = None
        self.tree_indices: frozenset[int] = frozenset()
        if previous is not None and previous.types == self.types and _same_objects(previous.dicts, dicts):
            self.changed = frozenset(i for i, (a, b) in enumerate(zip(previous.versions, self.versions)) if a != b)
            if previous.tree is not None and not (self.changed & previous.tree_indices):
                self.tree, self.tree_inputs = previous.tree, previous.tree_inputs
                self.tree_indices = previous.tree_indices
        self._loosen()

    def _loosen(self) -> None:
        loose = [i for i in range(len(self.dicts)) if i not in self.tree_indices]
        # one attribute, so that a call in another thread never pairs the dicts of one with the versions of another
        self.loose = (tuple(self.dicts[i] for i in loose), tuple(self.versions[i] for i in loose))

    def __call__(self) -> bool:
        if self.tree is not None:
            if not self.tree.check(self.tree_inputs):
                return False
        elif tuple(map(type, self.modules)) != self.types:
            return False
        loose_dicts, loose_versions = self.loose
        if tuple(map(_dict_version, loose_dicts)) != loose_versions:
            return False
        if self.expected and not all(e.holds() for e in self.expected):
            return False
        if self.slots and not all(s.holds() for s in self.slots):
            return False
        if self.tree is None and self.promote:
            self.passed += 1
            if self.passed == _STABLE_CALLS:
                return self._build_tree()
        return True

    def expects(self, d: dict, version: int) -> bool:
        """Whether this check compares ``d``'s version in Python and holds it at ``version``."""
        dicts, versions = self.loose
        return any(x is d and v == version for x, v in zip(dicts, versions))

    def expect_version(self, d: dict, version: int) -> None:
        """fulmen's own write (``swap_owned``) left ``d`` at ``version``: expect that from now on."""
        dicts, versions = self.loose
        self.versions = tuple(version if x is d else v for x, v in zip(self.dicts, self.versions))
        self.loose = (dicts, tuple(version if x is d else v for x, v in zip(dicts, versions)))

    def _build_tree(self) -> bool:
        indices = frozenset(range(len(self.dicts))) - self.changed - self.swapped
        values = [*self.modules, *(self.dicts[i] for i in sorted(indices))]
        inputs = tuple(tuple(values[i : i + 32]) for i in range(0, len(values), 32))
        tree = _guard_tree(inputs)
        if tuple(map(_dict_version, self.dicts)) != self.versions or tuple(map(type, self.modules)) != self.types:
            return False  # changed while the tree was built: it may hold a later version
        self.tree_inputs, self.tree_indices = inputs, indices
        self.tree = tree  # last: a call in another thread that sees it finds its inputs
        self._loosen()
        return True


def _watch_versions(check: TreeCheck, dicts: list[dict]) -> None:
    ref = weakref.ref(check)
    with _lock:
        for d in dicts:
            refs = [r for r in _version_watchers.get(id(d), ()) if r() is not None]
            refs.append(ref)
            _version_watchers[id(d)] = refs


def _same_objects(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _guard_tree(inputs: tuple):
    """A C++ ``RootGuardManager`` over ``inputs`` (tuples of at most 32 values, so that no manager has many
    children to search while it is built): a version guard on every dict, a type guard on every module."""
    from torch._dynamo.guards import GuardManagerType  # loads torch._dynamo (its guard managers need it)

    kind = GuardManagerType.GUARD_MANAGER
    root = _guards.RootGuardManager()
    for i, chunk in enumerate(inputs):
        manager = root.tuple_getitem_manager(i, f"[{i}]", chunk, kind)
        for j, value in enumerate(chunk):
            leaf = manager.tuple_getitem_manager(j, f"[{i}][{j}]", value, kind)
            if isinstance(value, dict):
                leaf.add_dict_version_guard(value, ["a module dictionary changed"], None)
            else:
                leaf.add_type_match_guard(id(type(value)), ["a module's class changed"], None)
    return root
