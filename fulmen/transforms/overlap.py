"""Overlapping communication with computation: start each collective early, wait for it late.

A collective is two operations in a trace (``fulmen.torch.collectives``): one that starts it and ``wait_tensor``.
Eager code usually waits at once (``dist.all_reduce(t)`` blocks). A trace compiler sees the whole program, so it
can do better: ``schedule_communication`` reorders the trace -- another topological order of its data
dependencies -- so that every collective starts as soon as its input is computed and every wait runs just before
the first reader of its result. The ranks' data travels while the computation runs.

The order is the program's, with the communication moved (``_list_schedule``): each collective starts as soon as
its inputs exist (what it needs is computed before the rest, in the program's order), each wait runs just before
its first reader, and the computation in between runs while the data travels. The computation otherwise keeps the
program's order: running an operation early only because it is
ready (a recomputation from saved tensors, ready at the top of the backward) would hold its result, and every other
such one's, until its reader, all at once. Operations that must keep their order (random draws, at any depth of a
decomposition: ``fulmen.core.draws``; opaque calls, in-place updates, side effects, the collectives themselves,
which every rank must issue in the same order) keep it. Fusion (``fulmen.executors.partition``) then groups the
computation between collectives without moving anything across one.

Collectives holding large buffers (FSDP2's parameter all-gathers and gradient reduce-scatters, tagged ``PREFETCH`` and
``ONE_IN_FLIGHT``) are the exception: one of each symbol is in flight at a time, as FSDP2 runs them, so started all
at once they would not hold every unit's full-size parameters or gradients together. Before sorting, each is moved
up past the collectives that must wait for the previous one of its symbol anyway (``_prefetches_first``), so the
backward's re-gather of a unit can start while the unit before it computes. Overlap then costs one unit's gathered
parameters (the next unit's, prefetched) and one reduce-scatter in flight, as FSDP2's own prefetching does.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from fulmen.core.bookkeeping import dependents, operations
from fulmen.core.draws import draws
from fulmen.core.proxies import Proxy
from fulmen.core.symbol import BoundSymbol, OpTags
from fulmen.core.trace import Trace

#: Whether the compilation in progress overlaps communication (``JitOptions.overlap_communication``, set around
#: the execution pipeline by ``overlapping``); off, traces keep their collectives where the program made them.
enabled: ContextVar[bool] = ContextVar("fulmen_overlap_communication", default=True)


@contextmanager
def overlapping(on: bool) -> Iterator[None]:
    """Overlap communication (or not) in the pipeline steps run inside the block (``has_work``)."""
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
    return trace.derive("Overlap communication", _list_schedule(_prefetches_first(trace.bound_symbols)))


def _list_schedule(bsyms: list[BoundSymbol]) -> list[BoundSymbol]:
    """``bsyms`` reordered: the program's order, but each collective started as soon as it is ready and each wait
    run just before its first reader would (see ``_keys``). A list schedule: of the ready operations, the one with
    the lowest key runs next."""
    nodes, trailing = operations(bsyms)
    ops = [node[-1] for node in nodes]
    deps, data = _dependencies(ops)
    data_users = dependents(data)
    urgent = _one_in_flight(ops, deps, data, data_users)
    keys = _keys(ops, data_users, urgent)
    users = dependents(deps)
    missing = [len(d) for d in deps]
    ready = [(keys[i], i) for i in range(len(ops)) if not missing[i]]
    heapq.heapify(ready)
    order: list[BoundSymbol] = []
    while ready:
        _, i = heapq.heappop(ready)
        order.extend(nodes[i])
        for u in users[i]:
            missing[u] -= 1
            if not missing[u]:
                heapq.heappush(ready, (keys[u], u))
    if len(order) != len(bsyms) - len(trailing):
        raise AssertionError("schedule_communication lost operations: the trace's dependencies have a cycle")
    return order + trailing


def _keys(ops: list[BoundSymbol], data_users: list[list[int]], urgent: set[int]) -> list[tuple[int, float]]:
    """Each operation's place in the schedule, ``(class, position)``, lowest first among the ready ones.

    - A collective's start, and a wait in ``urgent`` (the previous reduce-scatter of one in flight), run as soon as
      they are ready (class -1).
    - What a start needs comes next (class 0), in the program's order, so each collective starts as soon as its
      inputs can be computed; the rest of the computation after it (class 1), in the program's order.
    - A wait runs just before its first reader would (a start that reads it counts as what it needs), so what runs
      before that reader runs while the data travels.

    Computation keeps the program's order otherwise: running an operation early only because it is ready (a
    recomputation from saved tensors, ready at the top of the backward) would hold its result, and every other such
    one's, until its reader."""
    keys: list[tuple[int, float]] = [(1, float(i)) for i in range(len(ops))]
    for i in reversed(range(len(ops))):
        if i in urgent or _is_start(ops[i]):
            keys[i] = (-1, float(i))
        elif OpTags.WAIT in ops[i].sym.tags:
            first = min(((0, float(u)) if _is_start(ops[u]) else keys[u] for u in data_users[i]), default=(1, i))
            keys[i] = (first[0], first[1] - 0.5)
        elif any(keys[u][0] <= 0 and OpTags.WAIT not in ops[u].sym.tags for u in data_users[i]):
            keys[i] = (0, float(i))
    return keys


def _is_start(bsym: BoundSymbol) -> bool:
    tags = bsym.sym.tags
    return OpTags.COMMUNICATION in tags and OpTags.WAIT not in tags


def _dependencies(ops: list[BoundSymbol]) -> tuple[list[set[int]], list[set[int]]]:
    """What each operation waits for: the operations making what it reads (also returned alone, its data
    dependencies); the previous ordered operation (random draws, opaque calls, in-place updates, collectives; not
    waits, which only block until their data is there); and everything before the last side effect, which nothing
    crosses."""
    producer: dict[str, int] = {}
    data: list[set[int]] = []
    for i, op in enumerate(ops):
        data.append({producer[p.name] for p in op.flat_args if isinstance(p, Proxy) and p.name in producer})
        producer.update((p.name, i) for p in op.flat_proxy_outs)
    deps = [set(d) for d in data]
    last_ordered = barrier = -1
    for i, op in enumerate(ops):
        if barrier >= 0:
            deps[i].add(barrier)
        if not _free(op) and OpTags.WAIT not in op.sym.tags:
            if last_ordered >= 0:
                deps[i].add(last_ordered)
            last_ordered = i
        if OpTags.SIDE_EFFECT in op.sym.tags:
            deps[i].update(range(barrier + 1, i))
            barrier = i
    return deps, data


def _one_in_flight(
    ops: list[BoundSymbol], deps: list[set[int]], data: list[set[int]], data_users: list[list[int]]
) -> set[int]:
    """Adds to ``deps`` that each ``PREFETCH`` or ``ONE_IN_FLIGHT`` collective starts after the wait of the previous
    one of its symbol (where that adds no cycle). A ``PREFETCH`` one's input is computed after that wait too (the
    concatenation of a unit's shards, not every unit's at the top). A ``ONE_IN_FLIGHT`` one's previous wait also
    waits for this one's input and is then no longer put off: it runs, and this one starts, as soon as that input
    is computed. Returns those waits."""
    urgent: set[int] = set()
    previous: dict[str, int] = {}
    for i, op in enumerate(ops):
        if not _bounded(op):
            continue
        before = previous.get(op.sym.id)
        previous[op.sym.id] = i
        if before is None:
            continue
        inputs = data[i]
        for w in data_users[before]:
            if OpTags.WAIT not in ops[w].sym.tags or _reaches(deps, w, i):
                continue
            deps[i].add(w)
            if OpTags.PREFETCH in op.sym.tags:
                deps_of = (j for j in inputs if not (OpTags.WAIT in ops[j].sym.tags or _is_start(ops[j])))
                for j in deps_of:
                    if not _reaches(deps, w, j):
                        deps[j].add(w)
            else:
                deps[w].update(j for j in inputs if not _reaches(deps, j, w))
                urgent.add(w)
    return urgent



def _reaches(deps: list[set[int]], src: int, target: int) -> bool:
    """Whether ``src`` depends on ``target``, directly or through other operations."""
    seen, stack = {src}, [src]
    while stack:
        for j in deps[stack.pop()]:
            if j == target:
                return True
            if j not in seen:
                seen.add(j)
                stack.append(j)
    return False


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
    return (
        OpTags.COMMUNICATION in tags
        and not any(t in tags for t in _NOT_COMMUNICATION)
        and any(isinstance(p, Proxy) and p.name in after_wait for p in bsym.flat_args)
    )


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
    rest = [b for i, b in enumerate(order[lo : here + 1], lo) if i not in taken]
    return order[:lo] + [order[i] for i in moved] + rest + order[here + 1 :]
