"""The trace being built, and the tracer building it, per thread: tracing one function may trace another (a jitted
module's call inside a jitted function), and two threads may trace at once, each into its own trace. Its own module
so that proxies and symbols, which ``fulmen.core.trace`` builds on, read it with a plain global lookup; the context
managers that set it are in ``fulmen.core.tracer``."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fulmen.core.trace import Trace
    from fulmen.core.tracer import Tracer


class _TraceState(threading.local):
    # the class attributes are each thread's starting values: a thread that never traced reads None without a
    # per-thread __init__
    trace: Trace | None = None
    tracer: Tracer | None = None  # the tracer recording into ``trace`` (set together, by fulmen.core.tracer.tracing)


#: ``current.trace``: the trace this thread is building, or None (``get_tracectx()``); ``current.tracer``: the tracer
#: building it. The hottest callers, ``Symbol.__call__`` and ``Proxy.__init__``, read the attribute and save a call.
current = _TraceState()
_state = current


def get_tracectx() -> Trace | None:
    """The trace this thread is building, or None."""
    return _state.trace
