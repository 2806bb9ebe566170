"""Grouping a trace's fusible operations into as few regions as its dependencies allow.

A fusion executor can only compile operations that run back to back, but tracing order interleaves them
with operations it does not take (an opaque op, a random op, a call another executor claimed).
``fusion_groups`` reorders the trace into another valid order -- a topological sort of its data
dependencies -- that keeps fusible operations together: it runs every ready operation of one kind before
switching to the other kind, and the other kind first. Each maximal run of fusible operations becomes one
group. Because groups are contiguous in a topological order, fusing them can never create a cycle.

What the sort never changes:

- the relative order of the operations that are not fused (random operations keep drawing from the
  generator in eager's order; opaque operations and other executors' calls keep their order);
- anything across a side effect (``OpTags.SIDE_EFFECT``): operations before it stay before it, those after
  stay after;
- anything across a collective or its wait (``OpTags.COMMUNICATION``): where communication overlaps computation,
  ``fulmen.transforms.overlap`` has placed them already (each collective started early, each wait late, the
  computation in the program's order), and fusion keeps that; without overlap they stay where the program made
  them (FSDP2's all-gathers at each unit's start would otherwise all run first, holding every unit's parameters at
  once);
- where comments are: each stays right before the operation it preceded.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from fulmen.core.bookkeeping import dependents, operations
from fulmen.core.proxies import Proxy, TensorProxy
from fulmen.core.symbol import BoundSymbol, OpTags
from fulmen.prims import PrimIDs


def fusion_groups(
    bsyms: Sequence[BoundSymbol], fusible: Callable[[BoundSymbol], bool]
) -> list[tuple[bool, list[BoundSymbol]]]:
    """``bsyms`` reordered into ``(is_fusible, operations)`` runs; fusible runs are the candidate regions."""
    nodes, pending = operations(bsyms)
    n = len(nodes)
    kinds = [fusible(node[-1]) for node in nodes]
    deps = _order_dependencies(nodes, kinds)
    users = dependents(deps)
    missing = [len(d) for d in deps]
    ready: tuple[list[int], list[int]] = ([], [])  # (not fusible, fusible), each a heap of trace positions
    for i in range(n):
        if not missing[i]:
            heapq.heappush(ready[kinds[i]], i)

    groups: list[tuple[bool, list[BoundSymbol]]] = []
    kind = False
    while ready[0] or ready[1]:
        if not ready[kind]:
            kind = not kind
        run: list[BoundSymbol] = []
        queue = ready[kind]
        while queue:
            i = heapq.heappop(queue)
            run.extend(nodes[i])
            for u in users[i]:
                missing[u] -= 1
                if not missing[u]:
                    heapq.heappush(ready[kinds[u]], u)
        groups.append((kind, run))
        kind = not kind
    if sum(len(run) for _, run in groups) + len(pending) != len(bsyms):
        raise AssertionError("fusion_groups lost operations: the trace's dependencies have a cycle")
    if pending:  # trailing comments
        groups.append((False, pending))
    return groups


_BARRIERS = (OpTags.SIDE_EFFECT, OpTags.COMMUNICATION)


def _order_dependencies(nodes: list[list[BoundSymbol]], kinds: list[bool]) -> list[set[int]]:
    """Data dependencies, plus: unfused operations keep their order, and nothing crosses a side effect or a
    collective (``_BARRIERS``)."""
    deps = _data_dependencies([node[-1] for node in nodes])
    last_unfused = -1
    barrier = -1
    for i, node in enumerate(nodes):
        if barrier >= 0:
            deps[i].add(barrier)
        if not kinds[i]:
            if last_unfused >= 0:
                deps[i].add(last_unfused)
            last_unfused = i
        if any(t in node[-1].sym.tags for t in _BARRIERS):
            deps[i].update(range(barrier + 1, i))
            barrier = i
    return deps


#: The shortest run of operations ``split_repeats`` treats as a repeated block (a model's layer).
MIN_PERIOD = 8


def _signatures(ops: Sequence[BoundSymbol], period: int | None, phase: int = 0) -> list[int]:
    """What makes two operations interchangeable in a repeated block: the symbol, the constants, and for each
    tensor its metadata and where it was computed. With ``period`` None, only the symbol, constants and metadata.
    With a period, the run is cut into blocks of ``period`` operations starting at ``phase``, and a tensor
    computed in the operation's own block counts by how many operations back it was computed; one computed
    before the block (the previous layer's output, a table every layer reads, such as rotary embeddings, an
    input of the run) counts as coming from outside, wherever it was computed. So the first layer matches the
    others even though the tables it reads were computed just before it, in the model's prologue."""
    defined_at: dict[str, int] = {}

    def arg(x, i: int, block_start: int):
        if isinstance(x, TensorProxy):
            shape = tuple(s if type(s) is int else str(s) for s in x.shape)  # SymInts do not hash
            if period is None:
                return ("T", shape, x.dtype)
            j = defined_at.get(x.name)
            return ("T", shape, x.dtype, None if j is None or j < block_start else i - j)
        if isinstance(x, Proxy):
            return ("P", type(x).__name__)
        if isinstance(x, (tuple, list)):
            return tuple(arg(v, i, block_start) for v in x)
        return repr(x)

    sigs = []
    for i, op in enumerate(ops):
        block_start = i - (i - phase) % period if period else 0
        sigs.append(
            hash(
                (
                    op.sym.id,
                    tuple(arg(a, i, block_start) for a in op.args),
                    tuple((k, arg(v, i, block_start)) for k, v in op.kwargs.items()),
                )
            )
        )
        for p in op.flat_proxy_outs:
            defined_at[p.name] = i
    return sigs


def operations_key(ops: Sequence[BoundSymbol]) -> tuple[int, ...]:
    """Equal for two runs of the same operations on tensors of the same metadata (constants included), whatever
    the values' names and where they come from."""
    return tuple(_signatures(ops, None))


def _may_repeat(sigs: list[int], period: int) -> bool:
    """Whether ``period`` equal pairs ``(i, i + period)`` in a row exist: a cheap test before the full scan.

    Such a run of pairs covers ``period`` consecutive positions, so it holds a multiple of ``period``; only the
    runs through those positions need measuring. Most periods fail at every multiple, at ``n / period`` tests.
    """
    last = len(sigs) - period - 1  # the last position that has a pair
    for i in range(0, last + 1, period):
        if sigs[i] != sigs[i + period]:
            continue
        lo = hi = i
        while lo > 0 and sigs[lo - 1] == sigs[lo - 1 + period]:
            lo -= 1
        while hi < last and sigs[hi + 1] == sigs[hi + 1 + period]:
            hi += 1
        if hi - lo + 1 >= period:
            return True
    return False


def _best_repeat(sigs: list[int], periods) -> tuple[int, int, int]:
    """(operations covered, period, start) of the longest run of equal consecutive blocks."""
    n = len(sigs)
    best = (0, 0, 0)
    for period in periods:
        if not _may_repeat(sigs, period):
            continue
        run = 0
        for i in range(n - period - 1, -1, -1):  # run = how many equal pairs (i, i + period) start at i
            run = run + 1 if sigs[i] == sigs[i + period] else 0
            if run >= period:
                covered = (run // period + 1) * period
                if covered > best[0]:
                    best = (covered, period, i)
    return best


def split_repeats(ops: Sequence[BoundSymbol]) -> list[list[BoundSymbol]]:
    """Split a run of fusible operations at the boundaries of its longest repeated block, if it has one.

    A model's identical layers leave a periodic run of operations. Cut at the period, each layer becomes a
    region with the same code as the others, so they share one compiled kernel: Inductor compiles one layer
    instead of all of them. Any contiguous piece of the run is a valid region, so this never creates a
    cycle; it only gives up fusing across the cuts. The period is found on the operations alone, then
    confirmed with the data flow inside the block.

    Common-subexpression elimination leaves the first layer different from the others where every layer
    took the same view of the run's inputs (a LLaMA backward broadcasts its rotary tables once, in the first
    layer it differentiates, and the later layers read those). Such shared views read nothing computed in the
    run (views of views of the inputs included: ``cos[:T]``, then its broadcasts), so they may run first: when
    the run repeats better without them, they move to the front, and the first layer matches the others. (Only
    views: they cost nothing wherever they run, while moving a shared computation would keep its result alive
    from the front to its last reader.)
    """
    if len(ops) < 2 * MIN_PERIOD:
        return [list(ops)]
    covered, period, start = _repeat(ops)
    shared = _shared_from_inputs(ops)
    if shared:
        rest = [op for op in ops if id(op) not in shared]
        alt = _repeat(rest)
        if alt[0] > covered:
            front = [op for op in ops if id(op) in shared]
            ops, (covered, period, start) = front + rest, (alt[0], alt[1], alt[2] + len(front))
    if not covered:
        return [list(ops)]
    pieces = [list(ops[:start])] if start else []
    for k in range(start, start + covered, period):
        pieces.append(list(ops[k : k + period]))
    if start + covered < len(ops):
        pieces.append(list(ops[start + covered :]))
    return pieces


def _repeat(ops: Sequence[BoundSymbol]) -> tuple[int, int, int]:
    """(operations covered, period, start) of the longest run of equal consecutive blocks of ``ops``."""
    if len(ops) < 2 * MIN_PERIOD:
        return (0, 0, 0)
    covered, period, start = _best_repeat(_signatures(ops, None), range(MIN_PERIOD, len(ops) // 2 + 1))
    if covered:
        # confirmed with the data flow inside blocks aligned on the repeat the operations alone suggest
        covered, period, start = _best_repeat(_signatures(ops, period, start % period), (period,))
    return covered, period, start


def _is_view(op: BoundSymbol) -> bool:
    """An operation that takes a view of its input (``OpTags.VIEW``; a reshape copies where the strides do not
    allow a view)."""
    return OpTags.VIEW in op.sym.tags


def _has_in_place(ops: Sequence[BoundSymbol]) -> bool:
    return any(OpTags.IN_PLACE in op.sym.tags for op in ops)


def _shared_from_inputs(ops: Sequence[BoundSymbol]) -> set[int]:
    """The views (by ``id``) of values from outside the run that more than one operation reads, with the views
    of outside values they are taken of; none where the run holds an in-place operation (moving a read across it
    would change what it reads).

    A view of a view of an input counts as a view of the input: a LLaMA backward broadcasts ``cos[:T]``, a slice
    of its rotary table, and the slice must move with the broadcasts that read it (it is a new view even where
    ``T`` is the whole table, as in eager)."""
    if _has_in_place(ops):
        return set()
    made = {p.name for op in ops for p in op.flat_proxy_outs}
    readers: dict[str, int] = {}
    for op in ops:
        for p in op.flat_args:
            if isinstance(p, Proxy):
                readers[p.name] = readers.get(p.name, 0) + 1
    # views reading only outside values or such views' results, with the views of this kind each one reads
    of_inputs: dict[str, int] = {}  # output name -> index of the view that made it
    reads: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        args = [p.name for p in op.flat_args if isinstance(p, Proxy)]
        if _is_view(op) and op.flat_proxy_outs and all(a not in made or a in of_inputs for a in args):
            reads[i] = [of_inputs[a] for a in args if a in of_inputs]
            of_inputs.update((p.name, i) for p in op.flat_proxy_outs)
    moved: set[int] = set()
    stack = [i for i in reads if any(readers.get(p.name, 0) > 1 for p in ops[i].flat_proxy_outs)]
    while stack:  # a shared view and every view it is taken of
        i = stack.pop()
        if i not in moved:
            moved.add(i)
            stack.extend(reads[i])
    return {id(ops[i]) for i in moved}


def sums_after_other_readers(ops: Sequence[BoundSymbol]) -> list[BoundSymbol]:
    """``ops`` (one region, in a valid order) reordered so that each sum runs after the region's other readers of
    its input, unless one of them needs the sum's result.

    Inductor lowers a region's operations in order. A sum lowered first computes its input's elementwise
    producers inside the reduction; a matmul lowered later makes Inductor store that input all the same, so the
    producers run twice: a bias gradient (``sum(gelu_backward(g, x), 0)``, then ``gelu_backward(g, x) @ w``)
    became a column reduction that recomputed the GELU's derivative from three inputs. Lowered after the matmul,
    the sum reads the stored tensor. A reader of a view of the input counts too (the weight gradient's
    ``g.T @ x``). The order changes nothing else: every operation still follows its inputs, and the sum's input
    is alive until its last reader either way.
    """
    if _has_in_place(ops):
        return list(ops)  # moving a read across an in-place update would change what it reads
    n = len(ops)
    readers: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        for p in op.flat_args:
            if isinstance(p, Proxy):
                readers.setdefault(p.name, []).append(i)
    deps = _data_dependencies(ops)
    users = dependents(deps)

    key = [float(i) for i in range(n)]
    for i, op in enumerate(ops):
        if op.sym.id is not PrimIDs.SUM or not op.flat_args:
            continue
        after: set[int] = set()  # everything that needs the sum's result
        stack = [i]
        while stack:
            for u in users[stack.pop()]:
                if u not in after:
                    after.add(u)
                    stack.append(u)
        others = [
            j
            for name in _views_of(ops, op.flat_args[0].name)
            for j in readers.get(name, ())
            if j > i and j not in after and ops[j].sym.id is not PrimIDs.SUM
        ]
        if others:
            key[i] = max(others) + 0.5
    if key == sorted(key):
        return list(ops)

    missing = [len(d) for d in deps]
    ready = [(key[i], i) for i in range(n) if not missing[i]]
    heapq.heapify(ready)
    order: list[BoundSymbol] = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(ops[i])
        for u in users[i]:
            missing[u] -= 1
            if not missing[u]:
                heapq.heappush(ready, (key[u], u))
    if len(order) != n:
        raise AssertionError("sums_after_other_readers lost operations: the region's dependencies have a cycle")
    return order


def _data_dependencies(ops: Sequence[BoundSymbol]) -> list[set[int]]:
    """For each operation, the positions of the operations in ``ops`` that produce what it reads."""
    producer: dict[str, int] = {}
    deps: list[set[int]] = [set() for _ in ops]
    for i, op in enumerate(ops):
        for p in op.flat_args:
            j = producer.get(p.name) if isinstance(p, Proxy) else None
            if j is not None:
                deps[i].add(j)
        for p in op.flat_proxy_outs:
            producer[p.name] = i
    return deps



def _views_of(ops: Sequence[BoundSymbol], name: str) -> set[str]:
    """``name`` and the names of the views ``ops`` take of it, of those views, and so on."""
    names = {name}
    for op in ops:
        if _is_view(op) and any(isinstance(p, Proxy) and p.name in names for p in op.flat_args):
            names.update(p.name for p in op.flat_proxy_outs)
    return names
