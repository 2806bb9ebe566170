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
    return not any(t in bsym.sym.tags for t in _ORDERED)


def schedule_communication(trace: Trace) -> Trace:
    """``trace`` with each collective started as early and waited for as late as its data dependencies allow."""
    if not has_work(trace):
        return trace
    order = [b for _, run in fusion_groups(_prefetches_first(trace.bound_symbols), _free) for b in run]
    return trace.derive("Overlap communication", order)


def _passable(bsym: BoundSymbol) -> bool:
    """Whether a prefetch may be issued before ``bsym``: a free operation, or a functional collective (a start or a
    wait; no in-place update, no opaque call)."""
    tags = bsym.sym.tags
    return _free(bsym) or (OpTags.COMMUNICATION in tags and not any(t in tags for t in _NOT_COMMUNICATION))


def _prefetches_first(bsyms: list[BoundSymbol]) -> list[BoundSymbol]:
    """``bsyms`` with each ``PREFETCH`` collective (and the free operations it needs) moved up to just after the
    previous one, past other collectives that it does not depend on (the backward's reduce-scatters): collectives
    keep their order otherwise, and since the moves depend only on the program's collectives and the data flow
    between them, every rank issues its collectives in the same order. The scheduler then starts each one where the
    previous one's readers begin (``fulmen.executors.partition``)."""
    order = list(bsyms)
    previous = None
    for bsym in bsyms:
        if OpTags.PREFETCH not in bsym.sym.tags or OpTags.WAIT in bsym.sym.tags:
            continue
        if previous is not None:
            here = next(i for i, b in enumerate(order) if b is bsym)
            order = _hoist(order, next(i for i, b in enumerate(order) if b is previous) + 1, here)
        previous = bsym
    return order


def _hoist(order: list[BoundSymbol], lo: int, here: int) -> list[BoundSymbol]:
    """``order`` with ``order[here]`` and the operations between ``lo`` and it that it needs moved to ``lo``, or as
    close to it as the operations in between allow."""
    needed = {p.name for p in order[here].flat_args if isinstance(p, Proxy)}
    moved = [here]
    for i in range(here - 1, lo - 1, -1):
        b = order[i]
        feeds = any(p.name in needed for p in b.flat_proxy_outs)
        if not feeds:
            if not _passable(b):  # an in-place update, a random draw, an opaque call: nothing crosses it
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
