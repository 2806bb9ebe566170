"""Seeing changes to a jitted module's structure at the cost of one integer compare per call.

A compiled module program depends on more than its parameters' shapes: which submodules there are, plain
attributes its ``forward`` reads (``self.scale = 3.0``), hooks, tensors held as plain attributes. Walking the
module tree to check them costs ~2 µs per module per call (135 µs for a 56-module GPT), far above the
per-call budget. Instead, the methods through which such changes are made (``nn.Module.__setattr__``,
``__delattr__``, ``register_parameter``, ``register_buffer``, ``add_module``, the hook registrations,
``RemovableHandle.remove``, the containers' in-place edits) are wrapped to bump a process-wide ``epoch`` after
a change to a module some jitted program watches. A call compares the epoch it last saw with the current one;
only when it moved does it take a :func:`snapshot` of the tree again and, when that differs, re-key
(``fulmen.frontend.module``).

The wrappers are in place only while they are needed: from the first snapshot of a module (which watches it)
until the last watched module is collected, and while some thread's trace records module writes
(``recording_writes``). ``import fulmen`` changes nothing in torch, and a process whose jitted modules are gone
has torch's methods back. No public PyTorch API reports a plain attribute write (``self.scale = 3.0``,
``eval()``), and checking every module's dictionaries on each call costs time in proportion to the tree.

What a snapshot holds, for every module in the tree: its identity and class, the keys of its parameters and
buffers (which slots hold the same tensor, not the tensors themselves: a replaced parameter of the same
shape reuses the program), its plain attributes of simple types (bool, int, float, str, bytes, None, enums,
``torch.dtype``/``torch.device``, classes, tuples of these; tensors, functions and modules by identity),
``training``, and the ids of its forward and backward hooks; plus the global module hooks. Attributes that
compiled programs assign on every call are outputs, not structure (``mark_program_output``). Not seen: a
list, dict or other object changed in place (``self.sizes.append(3)``, ``self.config.dropout = 0.2``),
globals a ``forward`` reads, and writes straight into ``module._parameters`` / ``_buffers`` / ``_modules``
that bypass the methods above (a new tensor there is still read, as it is read on every call).

While fulmen traces, the ``__setattr__``/``__delattr__`` wrappers also report each write to ``write_recorders``
(``fulmen.frontend.module_writes``, through ``recording_writes``).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import threading
import types
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module
from torch.utils.hooks import RemovableHandle

#: Bumped after every change that can matter to a watched module (and after any hook removal).
epoch = 0
# ids of the modules some jitted program's last snapshot saw; a change to another module is not a change of
# any watched tree, except through a watched module (attaching it), which bumps
# (weakly: an id leaves the set when its module dies, so a new object at that address is not taken for it)
_watched: dict[int, weakref.ref] = {}
_installed = False
_lock = threading.RLock()
#: While fulmen traces, by tracing thread's id: called with (module, name) before every attribute write or delete
#: that thread makes on any module (``fulmen.frontend.module_writes``). Empty when no thread traces.
write_recorders: dict[int, Any] = {}
#: Thread id -> how many fulmen traces that thread is inside (``fulmen.frontend.tracing`` sets torch.compiler's
#: is_compiling flag for them).
tracing_threads: dict[int, int] = {}


def _bump() -> None:
    global epoch
    epoch += 1


def _traced_elsewhere() -> bool:
    """Whether torch.compiler's is_compiling flag, which is one for the process, may be on only because fulmen
    traces in another thread: this thread is not tracing, and must record its changes."""
    return bool(tracing_threads) and threading.get_ident() not in tracing_threads


def _on_module(method):
    """``method`` (of ``nn.Module`` or a container), bumping the epoch after it changed a watched module."""

    @functools.wraps(method)
    def changing(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        if (not torch.compiler.is_compiling() or _traced_elsewhere()) and id(self) in _watched:
            _bump()
        return result

    changing.__fulmen_wrapped__ = method
    return changing


def _on_setattr(method):
    # A code object of its own: Dynamo refuses to inline nn.Module methods whose code it does not know, except
    # __setattr__ and __delattr__, which it recognizes by identity -- and it compares code objects. Under Dynamo
    # the bump is skipped (is_compiling() is a constant there), so it inlines just the original. While fulmen
    # traces (which sets the same flag), only the tracing thread skips it.
    @functools.wraps(method)
    def __setattr__(self, name, value):
        if write_recorders:
            recorder = write_recorders.get(threading.get_ident())
            if recorder is not None:
                recorder(self, name)
        method(self, name, value)
        if (not torch.compiler.is_compiling() or _traced_elsewhere()) and id(self) in _watched:
            _bump()

    __setattr__.__fulmen_wrapped__ = method
    return __setattr__


def _on_delattr(method):
    @functools.wraps(method)
    def __delattr__(self, name):
        if write_recorders:
            recorder = write_recorders.get(threading.get_ident())
            if recorder is not None:
                recorder(self, name)
        method(self, name)
        if (not torch.compiler.is_compiling() or _traced_elsewhere()) and id(self) in _watched:
            _bump()

    __delattr__.__fulmen_wrapped__ = method
    return __delattr__


def _always(fn):
    """``fn`` (a global hook registration, a handle's ``remove``), bumping the epoch after it ran."""

    @functools.wraps(fn)
    def changing(*args, **kwargs):
        result = fn(*args, **kwargs)
        _bump()
        return result

    changing.__fulmen_wrapped__ = fn
    return changing


_MODULE_METHODS = (
    (nn.Module, ("__setattr__", "__delattr__", "register_parameter", "register_buffer", "add_module",
                 "register_module", "register_forward_hook", "register_forward_pre_hook",
                 "register_full_backward_hook", "register_full_backward_pre_hook", "register_backward_hook")),
    # edits that write the containers' _modules dictionary directly
    (nn.Sequential, ("insert",)),
    (nn.ModuleList, ("insert",)),
    (nn.ModuleDict, ("__delitem__", "clear")),
)
_GLOBAL_HOOK_REGISTRATIONS = ("register_module_forward_pre_hook", "register_module_forward_hook",
                              "register_module_backward_hook", "register_module_full_backward_pre_hook",
                              "register_module_full_backward_hook")


def _install() -> None:
    """Wrap the methods that change a module's structure (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    for owner, name, wrap in _targets():
        original = owner.__dict__.get(name)
        if original is not None and not hasattr(original, "__fulmen_wrapped__"):
            setattr(owner, name, wrap(original))


def _uninstall() -> None:
    """Put torch's methods back where the wrappers are still the ones in place (one wrapped again by someone
    else stays, and keeps working: it calls the original)."""
    global _installed
    if not _installed:
        return
    _installed = False
    for owner, name, _ in _targets():
        current = owner.__dict__.get(name)
        original = getattr(current, "__fulmen_wrapped__", None)
        if original is not None:
            setattr(owner, name, original)


def _targets():
    for cls, names in _MODULE_METHODS:
        for name in names:
            yield cls, name, {"__setattr__": _on_setattr, "__delattr__": _on_delattr}.get(name, _on_module)
    for name in _GLOBAL_HOOK_REGISTRATIONS:
        yield _torch_module, name, _always
    yield RemovableHandle, "remove", _always


def _release_if_unused() -> None:
    if not _watched and not _recording:
        _uninstall()


#: How many fulmen traces record module writes right now (``recording_writes``).
_recording = 0


@contextlib.contextmanager
def recording_writes(recorder) -> Any:
    """Report this thread's writes to module attributes to ``recorder`` for the block (the ``__setattr__`` and
    ``__delattr__`` wrappers are in place while any thread is inside such a block)."""
    global _recording
    thread = threading.get_ident()
    with _lock:
        _recording += 1
        _install()
    saved = write_recorders.get(thread)
    write_recorders[thread] = recorder
    try:
        yield
    finally:
        if saved is None:
            del write_recorders[thread]
        else:
            write_recorders[thread] = saved
        with _lock:
            _recording -= 1
            _release_if_unused()


# ---- snapshots (taken only when the epoch moved) ----

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


def snapshot_records(v: Any) -> bool:
    """Whether a module's snapshot records a plain attribute holding ``v`` (so a change to it is seen)."""
    return attribute_value(v) is not _MISSING


def _module_entry(name: str, mod: nn.Module, tensor_index: dict[int, int]) -> tuple:
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
        recorded = attribute_value(v)
        if recorded is not _MISSING:
            attrs.append((key, recorded))
    hooks = tuple(tuple(getattr(mod, h, ())) for h in _HOOK_DICTS)
    return (name, identity(mod), type(mod), tuple(slots), tuple(attrs), hooks)


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


def program_outputs(mod: nn.Module) -> dict:
    """The dictionary ``assign_program_output`` keeps for ``mod``."""
    return _program_outputs.setdefault(mod, {})


def assign_program_output(mod: nn.Module, outputs: dict, name: str, value: Any) -> None:
    """Set ``mod.name`` to what a compiled program returned for it (straight into ``__dict__``: no structure
    change); where code may read it and it held something else before (None, nothing, the user's tensor), the
    module's snapshot changes, so the epoch moves and the next call looks."""
    attrs = mod.__dict__
    last = outputs.get(name, _UNREAD)
    if last is not _UNREAD:
        if attrs.get(name, _MISSING) is not last and id(mod) in _watched:
            _bump()
        outputs[name] = value
    attrs[name] = value


def _watch(mod: nn.Module) -> None:
    key = id(mod)
    if key not in _watched:
        with _lock:
            _watched[key] = weakref.ref(mod, lambda _, key=key: _unwatch(key))
            _install()


def _unwatch(key: int) -> None:
    """A watched module died (a weakref callback; the lock is reentrant, for a collection that starts while this
    thread holds it: every holder makes ``_watched`` or ``_recording`` non-empty before it installs)."""
    with _lock:
        _watched.pop(key, None)
        _release_if_unused()


def snapshot(root: nn.Module) -> tuple:
    """Everything about ``root``'s tree a compiled program may depend on, beyond the tensors' own metadata;
    marks the tree's modules watched."""
    tensor_index: dict[int, int] = {}
    entries = []
    for name, mod in root.named_modules(remove_duplicate=False):
        _watch(mod)
        entries.append(_module_entry(name, mod, tensor_index))
        inner = mod.__dict__.get("_fulmen_module")  # a fulmen.jit wrapper inside: its original's hooks count
        if isinstance(inner, nn.Module):
            _watch(inner)
            entries.append(_module_entry(name + ".<original>", inner, tensor_index))
    global_hooks = tuple(tuple(getattr(_torch_module, f"_global_{h[1:]}", ())) for h in _HOOK_DICTS)
    return (tuple(entries), global_hooks)


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
                    return f"attribute {key!r} of {name} changed"
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
