"""Overlapping communication with computation: start each collective early, wait for it late.

A collective is two operations in a trace (``fulmen.torch.collectives``): one that starts it and ``wait_tensor``.
Eager code usually waits at once (``dist.all_reduce(t)`` blocks). A trace compiler sees the whole program, so it
can do better: ``schedule_communication`` reorders the trace -- another topological order of its data
dependencies -- so that every collective starts as soon as its input is computed and every wait runs only when
nothing that does not need its result is left to run. The ranks' data travels while the computation runs.

The order is ``fusion_groups``'s (``fulmen.executors.partition``), with the operations that must keep their order
(random draws, at any depth of a decomposition: ``fulmen.core.draws``; opaque calls, in-place updates, side effects,
the collectives themselves, which every rank must issue in the same order) kept in order, and every other operation
free to move. Fusion sorts again with the same rules,
so fused regions neither swallow a wait nor hold up a collective's start.

Collectives holding large buffers (FSDP2's parameter all-gathers and gradient reduce-scatters, tagged ``PREFETCH`` and
``ONE_IN_FLIGHT``) are the exception: one of each symbol is in flight at a time, as FSDP2 runs them, so started all
at once they would not hold every unit's full-size parameters or gradients together. Before sorting, each is moved
up past the collectives that must wait for the previous one of its symbol anyway (``_prefetches_first``), so the
backward's re-gather of a unit can start while the unit before it computes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from fulmen.core.draws import draws
from fulmen.core.proxies import Proxy
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

_NOT_COMMUNICATION = (OpTags.RANDOM_OP, OpTags.SIDE_EFFECT, OpTags.FALLBACK, OpTags.IN_PLACE)
_ORDERED = (*_NOT_COMMUNICATION, OpTags.COMMUNICATION)


def communicates(trace: Trace) -> bool:
    """Whether the trace holds a collective."""
    return any(OpTags.COMMUNICATION in b.sym.tags for b in trace.bound_symbols)


def has_work(trace: Trace) -> bool:
    """Whether ``schedule_communication`` would reorder ``trace``: overlap is on and the trace communicates."""
    return enabled.get() and communicates(trace)


def _free(bsym: BoundSymbol) -> bool:
    """Free to move: no tag that orders it, and no draw in its decomposition (a user's operator calling dropout
    carries no random tag of its own, and eager's draws happen in program order)."""
    return not any(t in bsym.sym.tags for t in _ORDERED) and not draws(bsym)


def schedule_communication(trace: Trace) -> Trace:
    """``trace`` with each collective started as early and waited for as late as its data dependencies allow."""
    if not has_work(trace):
        return trace
    order = [b for _, run in fusion_groups(_prefetches_first(trace.bound_symbols), _free) for b in run]
    return trace.derive("Overlap communication", order)


def _bounded(bsym: BoundSymbol) -> bool:
    """A collective start of which one is in flight at a time (``PREFETCH``, ``ONE_IN_FLIGHT``)."""
    tags = bsym.sym.tags
    return (OpTags.PREFETCH in tags or OpTags.ONE_IN_FLIGHT in tags) and OpTags.WAIT not in tags


def _passable(bsym: BoundSymbol, after_wait: set[str]) -> bool:
    """Whether a bounded collective may be issued before ``bsym``: a free operation, a wait, or a functional
    collective that reads what the previous one's wait made (it cannot start before that wait, while the one moved
    can start right after it). Never an in-place update, a random draw, an opaque call."""
    tags = bsym.sym.tags
    if _free(bsym) or (OpTags.WAIT in tags and not any(t in tags for t in _NOT_COMMUNICATION)):
        return True
    return (OpTags.COMMUNICATION in tags and not any(t in tags for t in _NOT_COMMUNICATION)
            and any(isinstance(p, Proxy) and p.name in after_wait for p in bsym.flat_args))


def _prefetches_first(bsyms: list[BoundSymbol]) -> list[BoundSymbol]:
    """``bsyms`` with each bounded collective (and the free operations it needs) moved up towards the previous one
    of its symbol, past the collectives that need that one's wait (the backward's re-gather of a unit
    past the reduce-scatter of the unit before it): it can start at that wait, they only later. Collectives keep
    their order otherwise, and since the moves depend only on the program's collectives and the data flow between
    them, every rank issues its collectives in the same order. The scheduler then starts each one where the previous
    one's wait runs (``fulmen.executors.partition``)."""
    order = list(bsyms)
    previous: dict[str, BoundSymbol] = {}
    for bsym in bsyms:
        if not _bounded(bsym):
            continue
        before = previous.get(bsym.sym.id)
        if before is not None:
            lo = next(i for i, b in enumerate(order) if b is before) + 1
            here = next(i for i, b in enumerate(order) if b is bsym)
            order = _hoist(order, lo, here, _made_after_wait(order[lo:here], before))
        previous[bsym.sym.id] = bsym
    return order


def _made_after_wait(window: list[BoundSymbol], start: BoundSymbol) -> set[str]:
    """The names in ``window`` computed from the result of ``start``'s wait."""
    made = {p.name for p in start.flat_proxy_outs}
    after: set[str] = set()
    for b in window:
        reads = {p.name for p in b.flat_args if isinstance(p, Proxy)}
        if reads & after or (OpTags.WAIT in b.sym.tags and reads & made):
            after.update(p.name for p in b.flat_proxy_outs)
    return after


def _hoist(order: list[BoundSymbol], lo: int, here: int, after_wait: set[str]) -> list[BoundSymbol]:
    """``order`` with ``order[here]`` and the operations between ``lo`` and it that it needs moved to ``lo``, or as
    close to it as the operations in between allow (``_passable``)."""
    needed = {p.name for p in order[here].flat_args if isinstance(p, Proxy)}
    moved = [here]
    for i in range(here - 1, lo - 1, -1):
        b = order[i]
        feeds = any(p.name in needed for p in b.flat_proxy_outs)
        if not feeds:
            if not _passable(b, after_wait):
                lo = i + 1
                break
            continue
        if not _free(b):  # needs a collective's result or an ordered operation: it stays, and so does what follows
            lo = i + 1
            break
        moved.append(i)
        needed.update(p.name for p in b.flat_args if isinstance(p, Proxy))
    moved = [i for i in reversed(moved) if i >= lo]
    taken = set(moved)
    rest = [b for i, b in enumerate(order[lo:here + 1], lo) if i not in taken]
    return order[:lo] + [order[i] for i in moved] + rest + order[here + 1:]
