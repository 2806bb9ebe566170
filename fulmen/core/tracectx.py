"""The trace being built, per thread: tracing one function may trace another (a jitted module's call inside a
jitted function), and two threads may trace at once, each into its own trace. Its own module so that proxies
and symbols, which ``fulmen.core.trace`` builds on, read it with a plain global lookup."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fulmen.core.trace import Trace


class _TraceState(threading.local):
    # the class attribute is each thread's starting value: a thread that never traced reads None without a
    # per-thread __init__
    trace: Trace | None = None


#: ``current.trace``: the trace this thread is building, or None (``get_tracectx()``; the hottest callers,
#: ``Symbol.__call__`` and ``Proxy.__init__``, read the attribute and save a call).
current = _TraceState()
_state = current


def get_tracectx() -> Trace | None:
    """The trace this thread is building, or None."""
    return _state.trace


@contextlib.contextmanager
def tracectx(trace: Trace) -> Iterator[Trace]:
    """Make ``trace`` this thread's current trace for the ``with`` block; the enclosing one comes back after."""
    state = _state
    outer = state.trace
    state.trace = trace
    try:
        yield trace
    finally:
        state.trace = outer
