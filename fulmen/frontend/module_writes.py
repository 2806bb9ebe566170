"""What traced code writes to ``nn.Module`` attributes, and what the compiled program does about it.

Any module can be written to while fulmen traces: the jitted module's own submodules, and modules a plain jitted
function reaches (a global model, a module passed as an argument). While some thread traces (``recording_writes``),
``nn.Module.__setattr__`` and ``__delattr__`` are wrapped to report each write to the ``ModuleWrites`` recorder of
the tracing thread, which keeps the first value each (module, name) held; the wrappers call torch's methods
unchanged for every other thread, and torch's own methods are back once the last trace ended. After the traced
function returned, ``settle`` puts every module back as it was and decides, name by name:

- a traced tensor assigned to a plain attribute (``self.attn_map = weights``) is a program output: the program
  returns it and every call assigns it (``assigner``), as eager does. The snapshot of the module's structure
  leaves it out (``module_guard.mark_program_output``), so train/eval round trips reuse programs. Where some code
  may read the name (``if self.cache is None: ...``), the trace may have branched on its old value: it counts as
  an output only while it holds what a program assigned, and a call that finds anything else recompiles;
- a traced tensor replacing a tensor the trace read is state carried between calls (the program would keep
  reading the tensor it captured): an error that asks for a buffer. Assigning back the proxy that stands for the
  tensor read (``self.t = self.t.to(x.device)`` where ``to`` returns its input, as in Hugging Face's rotary
  embeddings) leaves the attribute as eager leaves it: nothing is written;
- a parameter or buffer reassigned on a module that is not the jitted module's (whose buffers are program inputs,
  handled by ``fulmen.frontend.module``): an error, restoring it;
- any other value: a warning (later calls do not repeat Python side effects), the value left as set.

When tracing fails, every write is undone: the user's modules are left as they were before the call.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import logging
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from fulmen.core.proxies import Proxy, TensorProxy, has_proxy
from fulmen.core.shared_patch import SharedPatch
from fulmen.core.symbolic import contains_symbolic
from fulmen.frontend import module_guard
from fulmen.frontend.global_guard import string_constants

log = logging.getLogger("fulmen")
_MISSING = object()
_DICTS = ("_parameters", "_buffers", "_modules")


# ---- recording the writes of the tracing threads ----

#: While fulmen traces, by tracing thread's id: called with (module, name) before every attribute write or delete
#: that thread makes on any module. Empty when no thread traces.
write_recorders: dict[int, Any] = {}


def _on_setattr(method):
    # A code object of its own named __setattr__: Dynamo inlines nn.Module's __setattr__ and __delattr__, which it
    # recognizes by identity and by their code, and refuses other nn.Module methods whose code it does not know.
    @functools.wraps(method)
    def __setattr__(self, name, value):
        if write_recorders:
            recorder = write_recorders.get(threading.get_ident())
            if recorder is not None:
                recorder(self, name)
        method(self, name, value)

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

    __delattr__.__fulmen_wrapped__ = method
    return __delattr__


_WRAPPERS = (("__setattr__", _on_setattr), ("__delattr__", _on_delattr))


def _install() -> None:
    for name, wrap in _WRAPPERS:
        original = nn.Module.__dict__[name]
        if not hasattr(original, "__fulmen_wrapped__"):
            setattr(nn.Module, name, wrap(original))


def _uninstall() -> None:
    """Put torch's methods back where the wrappers are still the ones in place (one wrapped again by someone else
    stays, and keeps working: it calls the original)."""
    for name, _ in _WRAPPERS:
        original = getattr(nn.Module.__dict__[name], "__fulmen_wrapped__", None)
        if original is not None:
            setattr(nn.Module, name, original)


_WRAPPED = SharedPatch(_install, _uninstall)


@contextlib.contextmanager
def recording_writes(recorder) -> Any:
    """Report this thread's writes to module attributes to ``recorder`` for the block (the ``__setattr__`` and
    ``__delattr__`` wrappers are in place while any thread is inside such a block)."""
    thread = threading.get_ident()
    with _WRAPPED:
        saved = write_recorders.get(thread)
        write_recorders[thread] = recorder
        try:
            yield
        finally:
            if saved is None:
                del write_recorders[thread]
            else:
                write_recorders[thread] = saved


def _locate(mod: nn.Module, name: str) -> tuple[str, Any]:
    """Where ``mod.name`` lives (one of ``_DICTS``, ``"__dict__"`` or ``"missing"``) and its value."""
    attrs = mod.__dict__
    for dict_name in _DICTS:
        d = attrs.get(dict_name)
        if d is not None and name in d:
            return dict_name, d[name]
    if name in attrs:
        return "__dict__", attrs[name]
    return "missing", _MISSING


def _put(mod: nn.Module, name: str, where: str, value: Any) -> None:
    """Set ``mod.name`` back to ``value`` in ``where`` (``"missing"``: remove it), bypassing ``__setattr__``."""
    now, _ = _locate(mod, name)
    if now != "missing":
        del (mod.__dict__ if now == "__dict__" else mod.__dict__[now])[name]
    if where != "missing":
        (mod.__dict__ if where == "__dict__" else mod.__dict__[where])[name] = value


def _initializing(frame, mod: nn.Module) -> bool:
    """Whether the write comes from ``mod``'s ``__init__`` (a module the traced code creates), a few calls up."""
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is mod:
            return True
        frame = frame.f_back
    return False


#: Code whose writes to a module are no side effect of the traced program: an FX ``GraphModule`` generates its Python
#: code (``_code``, ``_lineno_map``, ...) from its graph, a lazy one at its first call, which may be inside a trace
#: (Dynamo hands the ``torch.compile`` backend such modules). What it writes follows from the graph, so it is left
#: as written, unreported.
_DERIVED_STATE_WRITERS = frozenset({torch.fx.GraphModule.recompile.__code__})


class ModuleWrites:
    """Records, for the thread tracing, the value each written (module, name) held before its first write, and
    which code wrote it. Modules created while tracing are the traced code's own: not recorded."""

    def __init__(self):
        self._thread = threading.get_ident()
        self._before: dict[tuple[int, str], tuple[nn.Module, str, str, Any, str]] = {}
        self._new: dict[int, nn.Module] = {}  # held until the trace ends, so their ids are not reused
        self._derived: dict[tuple[int, str], nn.Module] = {}  # written by _DERIVED_STATE_WRITERS
        self._scope = None

    def __call__(self, mod: nn.Module, name: str) -> None:
        if threading.get_ident() != self._thread or (id(mod), name) in self._before or id(mod) in self._new:
            return
        writer = sys._getframe(2)  # 1: nn.Module.__setattr__ (the wrapper above)
        if writer.f_code in _DERIVED_STATE_WRITERS:
            self._derived[(id(mod), name)] = mod
            return
        if _initializing(writer, mod):
            self._new[id(mod)] = mod
            return
        self._before[(id(mod), name)] = (mod, name, *_locate(mod, name), writer.f_code.co_qualname)

    def __enter__(self) -> ModuleWrites:
        self._scope = recording_writes(self)
        self._scope.__enter__()
        return self

    def __exit__(self, exc_type, *_) -> None:
        self._scope.__exit__(None, None, None)
        if exc_type is not None:  # the call failed: leave every module as it was before it
            self.undo()

    def written(self) -> frozenset[tuple[Any, str]]:
        """(``module_guard.identity`` of the module, name) of every module attribute the trace wrote: the program's
        own doing, which a snapshot taken after the trace may differ from the one before it in."""
        writes = [(mod, name) for mod, name, *_ in self._before.values()]
        writes += [(mod, name) for (_, name), mod in self._derived.items()]
        return frozenset((module_guard.identity(mod), name) for mod, name in writes)

    def undo(self) -> None:
        for mod, name, where, old, _ in self._before.values():
            if not isinstance(old, Proxy):  # a jitted module's parameter or buffer, swapped for its proxy: put back
                _put(mod, name, where, old)  # by fulmen.frontend.module

    def settle(self, own: frozenset[int], captured: dict[int, TensorProxy], codes: Iterable[types.CodeType],
               state: dict[int, torch.Tensor] | None = None) -> list[tuple[nn.Module, str, TensorProxy]]:
        """After the traced call: restore what the program must not leave set, raise for what it cannot compile,
        and return the program outputs (module, name, traced value), marked as such in ``module_guard``. ``own``:
        ids of the jitted module's tree; ``captured``: the tensors the trace captured (id -> proxy); ``codes``: the user
        code that ran; ``state``: the jitted module's parameters and buffers by the id of the proxy standing for
        each while tracing."""
        outputs = []
        try:
            for mod, name, where, old, writer in self._before.values():
                now, new = _locate(mod, name)
                if new is old and now == where:
                    continue
                if "_parameters" in (where, now) or "_buffers" in (where, now):
                    if id(mod) in own:
                        continue  # a program input: fulmen.frontend.module assigns or rejects it
                    _put(mod, name, where, old)
                    what = "parameter" if "_parameters" in (where, now) else "buffer"
                    raise NotImplementedError(
                        f"{writer} assigned the {what} {name!r} of a {type(mod).__name__} that is not the "
                        f"module fulmen.jit compiles; such a module's {what}s are read as they are when traced. "
                        f"Update it in place (self.{name}.copy_(...)), or compile the module itself: "
                        "fulmen.jit(module).")
                if isinstance(new, TensorProxy) and now == "__dict__":
                    _put(mod, name, where, old)
                    if isinstance(old, torch.Tensor) and captured.get(id(old)) is new:
                        continue  # the tensor it held, assigned back: eager leaves the attribute as it was
                    if isinstance(old, torch.Tensor) and id(old) in captured:
                        raise NotImplementedError(
                            f"{writer} reads the tensor attribute {name!r} of a {type(mod).__name__} and assigns it "
                            "a new tensor (state carried between calls); fulmen.jit keeps such state in buffers: "
                            f"register it with self.register_buffer({name!r}, tensor, persistent=False) in "
                            "__init__; fulmen.jit(module) then updates the buffer on every call.")
                    outputs.append((mod, name, _may_read(type(mod), name, codes), new))
                    continue
                if contains_symbolic(new, shapes=False):  # a symbolic int stands for each call's value only inside
                    _put(mod, name, where, old)  # the program: this trace compiles no such program (exact ints)
                    raise NotImplementedError(f"{writer} sets the attribute {name!r} of a {type(mod).__name__} to a "
                                              "value computed from a symbolic int")
                if state:
                    found, real = _with_real_state(new, state)
                    if found:  # built from the module's own parameters and buffers: what eager leaves, kept
                        _put(mod, name, now, real)
                        continue
                if has_proxy(new):  # a traced number or a container of traced values: nothing real to keep
                    _put(mod, name, where, old)
                    log.warning("fulmen: %s set the attribute %r of a %s to a %s holding traced values; fulmen.jit "
                                "returns only tensors assigned to attributes, so it is left as it was. Assign the "
                                "tensors themselves, or return the value.", writer, name, type(mod).__name__,
                                type(new).__name__)
                elif not isinstance(new, torch.Tensor):  # a real tensor (not computed by the trace) stays as set
                    log.warning("fulmen: %s changed the attribute %r of a %s while being traced; the compiled "
                                "program does not repeat Python side effects, so later calls leave it as it is",
                                writer, name, type(mod).__name__)
        except BaseException:
            self.undo()
            raise
        for mod, name, read, _ in outputs:
            module_guard.mark_program_output(mod, name, read)
        return [(mod, name, value) for mod, name, _, value in outputs]


def _with_real_state(value: Any, state: dict[int, torch.Tensor]) -> tuple[bool, Any]:
    """``value`` with each proxy of a parameter or buffer (also one a weak reference points to) replaced by the
    tensor it stands for, and whether there was one; (False, value) when it holds any other traced value.

    A module may keep Python structures derived from its own parameters (``nn.RNNBase._flat_weights`` and its weak
    references, rebuilt by ``forward`` when the parameters it sees are not those it saw last, as the proxies are):
    with the real tensors put back it holds what eager would leave, and what every later call would write again
    (a call with other parameters or buffers has another key, and traces again)."""
    found = False

    def real(v):
        nonlocal found
        if isinstance(v, Proxy):
            t = state.get(id(v))
            if t is None:
                raise LookupError
            found = True
            return t
        if isinstance(v, weakref.ReferenceType):
            target = v()
            return weakref.ref(real(target)) if isinstance(target, Proxy) else v
        if type(v) in (list, tuple):
            return type(v)(real(x) for x in v)
        if type(v) is dict:
            return {k: real(x) for k, x in v.items()}
        return v

    try:
        value = real(value)
    except LookupError:
        return False, value
    return found, value


def check_no_proxies_left(modules: Iterable[nn.Module]) -> None:
    """A traced tensor written straight into a module's ``__dict__`` (not through ``setattr``) is not seen by the
    recorder: remove it and raise rather than leave a placeholder on the user's module."""
    for mod in modules:
        for name, value in list(mod.__dict__.items()):
            if isinstance(value, Proxy):
                del mod.__dict__[name]
                raise NotImplementedError(
                    f"{type(mod).__name__} wrote a traced tensor into its __dict__[{name!r}] directly; fulmen.jit "
                    f"follows attribute writes made with setattr: write self.{name} = ... instead.")


# ---- which names code may read ----

_LOADS = frozenset(("LOAD_ATTR", "LOAD_METHOD"))


@functools.lru_cache(maxsize=4096)
def _code_reads(code: types.CodeType) -> frozenset[str]:
    """The attribute names ``code`` (and the code nested in it) loads, and the names its string constants hold
    (``getattr(self, "cache", None)``, ``hasattr``)."""
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in _LOADS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_reads(const)
    return frozenset(names) | string_constants(code)


def _functions(value: Any) -> list[Callable]:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if f is not None]
    value = getattr(value, "__wrapped__", value)
    return [value] if isinstance(value, types.FunctionType) else []


@functools.lru_cache(maxsize=1024)
def _class_reads(cls: type) -> frozenset[str]:
    """What the methods of ``cls`` and its bases (not PyTorch's) may read."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object or (klass.__module__ or "").startswith("torch."):
            continue
        for value in vars(klass).values():
            for f in _functions(value):
                names |= _code_reads(f.__code__)
    return frozenset(names)


def _may_read(cls: type, name: str, codes: Iterable[types.CodeType]) -> bool:
    """Whether some code may read ``name``: a method of the module's class, or user code that ran while tracing
    (a parent module's ``forward`` reading ``self.block.cache``)."""
    return name in _class_reads(cls) or any(name in _code_reads(code) for code in codes)


# ---- every call ----


def assigner(outputs: tuple[tuple[nn.Module, str], ...]) -> Callable[[Any], None]:
    """``assign(values)``: each of a program's extra output values assigned to its module attribute, as the eager
    call did (``fulmen.frontend.runner`` calls it after the program)."""
    slots = [(mod, module_guard.program_outputs(mod), name) for mod, name in outputs]
    assign = module_guard.assign_program_output

    def assign_all(values) -> None:
        for (mod, last, name), value in zip(slots, values):
            assign(mod, last, name, value)

    return assign_all
