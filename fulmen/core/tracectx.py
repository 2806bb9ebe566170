"""The trace being built: a stack, since tracing one function may trace another (a jitted module's call inside
a jitted function). Its own module so that proxies and symbols, which ``fulmen.core.trace`` builds on, read it
with a plain global lookup."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fulmen.core.trace import Trace

_tracectx_stack: list[Trace] = []


def get_tracectx() -> Trace | None:
    return _tracectx_stack[-1] if _tracectx_stack else None


@contextlib.contextmanager
def tracectx(trace: Trace) -> Iterator[Trace]:
    _tracectx_stack.append(trace)
    try:
        yield trace
    finally:
        _tracectx_stack.pop()
