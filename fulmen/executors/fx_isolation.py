"""FX tracing done while fulmen lowers a region, kept to the thread that lowers it.

Inductor's own passes trace small functions with ``torch.fx.Tracer.trace`` (the pattern matcher's ``fwd_only``, the
loop bodies' ``symbolic_trace``). For as long as such a trace lasts, FX changes what every thread of the process
sees: it replaces ``torch.nn.Module.__call__`` and ``__getattr__`` with its recording wrappers (a leaf module called
from another thread returns an FX proxy and adds a node to the graph being traced) and sets its process-wide
"symbolic tracing" flag, under which Dynamo refuses to run any ``torch.compile``'d function ("Detected that you are
using FX to symbolically trace a dynamo-optimized function"). fulmen lowers regions on a background thread while the
program keeps running: a training step of a ``torch.compile(DDP(model))`` that met such a moment failed on that rank
only, and the other ranks then waited in, or mismatched, the next collective.

``fx_tracing_kept_to_this_thread()`` is entered around a lowering. While any lowering runs, ``Tracer.trace`` and
``_Patcher.patch_method`` are replaced by versions that behave exactly as before on every thread that is not
lowering; on a lowering thread, the trace sets a flag of its own (a copy of ``Tracer.trace`` whose globals are a
copy of its module's namespace) and each method it patches dispatches on the calling thread, so other threads keep
calling the original. The replacements are removed when the last lowering ends.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
from collections.abc import Callable, Iterator

import torch.fx._symbolic_trace as _fx

_lock = threading.Lock()
_lowering: dict[int, int] = {}  # thread id -> nesting depth of lowerings on it
_installed: tuple[Callable, Callable] | None = None  # the original Tracer.trace and _Patcher.patch_method


def _flag_setting_trace(trace: Callable) -> types.FunctionType | None:
    """FX's own ``Tracer.trace`` behind ``trace``: Dynamo replaces the class attribute with a wrapper that keeps Dynamo
    out of it (the wrapper holds it in its closure); None if it cannot be found."""
    for _ in range(8):
        if isinstance(trace, types.FunctionType) and trace.__globals__ is vars(_fx):
            return trace if "_is_fx_tracing_flag" in trace.__code__.co_names else None
        cells = [c.cell_contents for c in getattr(trace, "__closure__", None) or () if c.cell_contents is not None]
        inner = getattr(trace, "__wrapped__", None) or next(
            (f for f in cells if isinstance(f, types.FunctionType) and f.__code__.co_name == "trace"), None
        )
        if inner is None:
            return None
        trace = inner
    return None


def _private_flag_copy(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with globals of its own: its ``global _is_fx_tracing_flag`` writes go to the copy, not the module.
    (Called on a lowering thread, which runs no Dynamo-compiled code, it needs no wrapper keeping Dynamo out.)"""
    namespace = dict(fn.__globals__)
    namespace["_is_fx_tracing_flag"] = False
    copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def _only_on_thread(owner: int, patched: Callable, original: Callable) -> Callable:
    @functools.wraps(patched)
    def dispatch(*args, **kwargs):
        return (patched if threading.get_ident() == owner else original)(*args, **kwargs)

    return dispatch


def _install() -> None:
    global _installed
    trace, patch_method = _fx.Tracer.trace, _fx._Patcher.patch_method
    own = _flag_setting_trace(trace)
    private_trace = _private_flag_copy(own) if own is not None else trace

    @functools.wraps(trace)
    def thread_aware_trace(self, *args, **kwargs):
        return (private_trace if threading.get_ident() in _lowering else trace)(self, *args, **kwargs)

    @functools.wraps(patch_method)
    def thread_aware_patch_method(self, cls, name, new_fn, *args, **kwargs):
        me = threading.get_ident()
        if me in _lowering:
            new_fn = _only_on_thread(me, new_fn, getattr(cls, name))
        return patch_method(self, cls, name, new_fn, *args, **kwargs)

    _installed = (trace, patch_method)
    _fx.Tracer.trace = thread_aware_trace
    _fx._Patcher.patch_method = thread_aware_patch_method


def _uninstall() -> None:
    global _installed
    _fx.Tracer.trace, _fx._Patcher.patch_method = _installed
    _installed = None


@contextlib.contextmanager
def fx_tracing_kept_to_this_thread() -> Iterator[None]:
    """For the block, FX traces made on this thread change nothing that other threads see (see the module doc)."""
    me = threading.get_ident()
    with _lock:
        if not _lowering:
            _install()
        _lowering[me] = _lowering.get(me, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _lowering[me] -= 1
            if not _lowering[me]:
                del _lowering[me]
            if not _lowering:
                _uninstall()
