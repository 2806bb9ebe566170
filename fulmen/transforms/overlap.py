"""Overlapping communication with computation: start each collective early, wait for it late.

A collective is two operations in a trace (``fulmen.torch.collectives``): one that starts it and ``wait_tensor``.
Eager code usually waits at once (``dist.all_reduce(t)`` blocks). A trace compiler sees the whole program, so it
can do better: ``schedule_communication`` reorders the trace -- another topological order of its data
dependencies -- so that every collective starts as soon as its input is computed and every wait runs only when
nothing that does not need its result is left to run. The ranks' data travels while the computation runs.

The order is ``fusion_groups``'s (``fulmen.executors.partition``), with the operations that must keep their order
(random draws, opaque calls, in-place updates, side effects, the collectives themselves, which every rank must issue
in the same order) kept in order, and every other operation free to move. Fusion sorts again with the same rules,
so fused regions neither swallow a wait nor hold up a collective's start.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from fulmen.core.symbol import BoundSymbol, OpTags
from fulmen.core.trace import Trace
from fulmen.executors.partition import fusion_groups

#: Whether the compilation in progress overlaps communication (``JitOptions.overlap_communication``, set around
#: the execution pipeline by ``overlapping``); off, traces keep their collectives where the program made them.
enabled: ContextVar[bool] = ContextVar("fulmen_overlap_communication", default=True)


@contextmanager
def overlapping(on: bool) -> Iterator[None]:
    """Overlap communication (or not) in the pipeline steps run inside the block, fusion's ordering included."""
    token = enabled.set(bool(on))
    try:
        yield
    finally:
        enabled.reset(token)

_ORDERED = (OpTags.RANDOM_OP, OpTags.SIDE_EFFECT, OpTags.FALLBACK, OpTags.IN_PLACE, OpTags.COMMUNICATION)


def communicates(trace: Trace) -> bool:
    """Whether the trace holds a collective."""
    return any(OpTags.COMMUNICATION in b.sym.tags for b in trace.bound_symbols)


def has_work(trace: Trace) -> bool:
    """Whether ``schedule_communication`` would reorder ``trace``: overlap is on and the trace communicates."""
    return enabled.get() and communicates(trace)


def _free(bsym: BoundSymbol) -> bool:
    return not any(t in bsym.sym.tags for t in _ORDERED)


def schedule_communication(trace: Trace) -> Trace:
    """``trace`` with each collective started as early and waited for as late as its data dependencies allow."""
    if not has_work(trace):
        return trace
    order = [b for _, run in fusion_groups(trace.bound_symbols, _free) for b in run]
    return trace.derive("Overlap communication", order)
