"""Rematerialization: which forward values to save for the backward and which to recompute there.

The backward reads some forward values. Each can be saved (it stays alive from the forward to the backward)
or, when it comes out of cheap operations (elementwise math, views, dtype conversions, constants), recomputed
in the backward from other values. The choice is a minimum cut, as in AOTAutograd's partitioner:

- every tensor value ``v`` is an edge ``v_in -> v_out`` whose capacity is its size in bytes (saving it costs
  that much memory; inputs cost nothing, the caller keeps them alive anyway -- except those the forward
  overwrites in place, which are saved as a copy);
- a cheap operation producing ``v`` from ``u`` adds ``u_out -> v_in`` (infinite): recomputing ``v`` needs ``u``;
- values that cannot be recomputed (matrix products, reductions, random numbers, inputs) hang off the source,
  the values the backward reads go to the sink.

The cut edges are the saved values; everything on the sink side is recomputed in the backward, just before
its first use, by the coarsest symbol that computes it (``coarsen``). Ties go to saving the later value, so
nothing is recomputed unless that saves memory.

A recomputed floating point value is equal to the forward's, not identical to it: the backward's kernel may
evaluate the same expression differently (Inductor fuses it with other operations, vectorizes it another way,
contracts a multiply-add). That matters where the backward turns bits into a decision: ``amax``'s gradient
compares the input with the saved maximum for equality, and a recomputed input that differs in its last bit
matches nowhere (max_pool2d of a GELU lost half its gradient). ``bit_exact_reads`` finds the values a backward
reads through such a decision (an operation with floating point inputs and no floating point output:
comparisons, ``isnan``, ``argmax``, and the data movement in front of them); ``choose_saved`` recomputes those
only through operations that reproduce bits exactly (data movement, integer arithmetic, comparisons) and saves
them rather than redo floating point arithmetic.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from fulmen.core import dtypes
from fulmen.core.draws import draws
from fulmen.core.proxies import Proxy, TensorProxy
from fulmen.core.symbol import BoundSymbol, OpTags
from fulmen.core.symbolic import size_hint

_INF = 1 << 62
#: The op groups rematerialization reads: cheap ones are recomputed where that saves memory; costly ones (matrix
#: products, reductions) and those that must run exactly once are always saved.
_CHEAP_TAGS = frozenset((OpTags.ELEMENTWISE, OpTags.SHAPE_OP, OpTags.VIEW))
_COSTLY_TAGS = frozenset((OpTags.MATMUL_OP, OpTags.REDUCTION))
#: Operations that must run exactly once (or compute nothing): never recomputed, checkpointed or not.
_ONCE_TAGS = frozenset((OpTags.RANDOM_OP, OpTags.SIDE_EFFECT, OpTags.FALLBACK, OpTags.DONT_DCE, OpTags.IN_PLACE,
                        OpTags.BOOKKEEPING, OpTags.COMMUNICATION, OpTags.WAIT))
_NEVER_TAGS = _ONCE_TAGS | _COSTLY_TAGS


def is_recomputable(bsym: BoundSymbol) -> bool:
    """Cheap, deterministic operations the backward may run again instead of keeping their results."""
    sym = bsym.sym
    if draws(bsym):  # a composite's own tags need not say so (a user's operator calling dropout)
        return False
    if OpTags.RECOMPUTABLE in sym.tags:  # declared so by the op (FSDP2's parameter all-gather and its wait)
        return True
    if not _NEVER_TAGS.isdisjoint(sym.tags):
        return False
    # A creation prim makes its values from its arguments alone; a torch-level creation symbol (linspace) may do
    # floating point arithmetic whose bits another kernel need not reproduce, and is judged by its parts.
    if sym.is_prim and OpTags.CREATION in sym.tags:
        return True
    return not _CHEAP_TAGS.isdisjoint(sym.tags)


def _is_float(p) -> bool:
    return isinstance(p, TensorProxy) and (dtypes.is_float_dtype(p.dtype) or dtypes.is_complex_dtype(p.dtype))


def _moves_data(bsym: BoundSymbol) -> bool:
    """Copies, views and rearrangements of elements: the output's bits are bits of the input."""
    tags = bsym.sym.tags
    return OpTags.ELEMENTWISE not in tags and (OpTags.SHAPE_OP in tags or OpTags.VIEW in tags)


def _decides(bsym: BoundSymbol) -> bool:
    """An operation whose result depends on its floating point inputs discretely (no floating point output)."""
    outs = bsym.flat_proxy_outs
    return bool(outs) and any(_is_float(p) for p in bsym.flat_args) and not any(_is_float(p) for p in outs)


def _reproduces_bits(bsym: BoundSymbol) -> bool:
    """Run again on the same bits, any kernel gives the same bits: data movement, and operations that do no
    floating point arithmetic (integer and boolean math, comparisons, creation from integers)."""
    return _moves_data(bsym) or not any(_is_float(p) for p in bsym.flat_args) or _decides(bsym)


def _leaf_calls(bsyms: Sequence[BoundSymbol]):
    for b in bsyms:
        if b.subsymbols:
            yield from _leaf_calls(b.subsymbols)
        else:
            yield b


def bit_exact_reads(bsyms: Sequence[BoundSymbol]) -> set[str]:
    """Names of the values ``bsyms`` (a backward) reads whose exact bits decide its result: the floating point
    inputs of operations with no floating point output, and what data movement in front of those reads."""
    exact: set[str] = set()
    for b in reversed(list(_leaf_calls(bsyms))):
        if _decides(b) or (_moves_data(b) and any(p.name in exact for p in b.flat_proxy_outs)):
            exact.update(p.name for p in b.flat_args if isinstance(p, TensorProxy))
    return exact


def _exact_closure(exact: Iterable[str], producer: dict[str, BoundSymbol],
                   inputs: set[str]) -> tuple[set[str], set[str]]:
    """(the values whose bits matter: ``exact`` and what a bit-reproducing producer of one reads, recursively;
    those of them a recomputation would not reproduce)."""
    closure: set[str] = set()
    pinned: set[str] = set()
    stack = [n for n in exact if n in producer]
    while stack:
        n = stack.pop()
        if n in closure:
            continue
        closure.add(n)
        b = producer.get(n)
        if b is None or n in inputs or not is_recomputable(b):
            continue
        if _reproduces_bits(b):
            stack.extend(p.name for p in b.flat_args if isinstance(p, TensorProxy))
        else:
            pinned.add(n)
    return closure, pinned


def _nbytes(p: TensorProxy) -> int:
    # the sizes traced, also for symbolic sizes: a cost heuristic must not add guards (compare symbolic sizes)
    n = 1
    for s in p.shape:
        n *= size_hint(s)
    return n * p.dtype.itemsize


class _FlowGraph:
    """Edmonds-Karp max flow on a small graph; ``reachable`` gives the source side of the minimum cut."""

    def __init__(self):
        self.adj: dict = {}

    def add(self, u, v, cap: int) -> None:
        eu, ev = self.adj.setdefault(u, []), self.adj.setdefault(v, [])
        eu.append([v, cap, len(ev)])
        ev.append([u, 0, len(eu) - 1])

    def max_flow(self, s, t) -> int:
        """Dinic's algorithm: a breadth-first level graph, then blocking flows along it (the first call of a
        training program runs this on every forward, so it must be fast on a few thousand edges)."""
        adj = self.adj
        total = 0
        while True:
            level = {s: 0}
            queue = deque([s])
            while queue:
                u = queue.popleft()
                for v, cap, _ in adj.get(u, ()):
                    if cap > 0 and v not in level:
                        level[v] = level[u] + 1
                        queue.append(v)
            if t not in level:
                return total
            pointer = {u: 0 for u in level}
            while True:
                pushed = self._augment(s, t, level, pointer)
                if not pushed:
                    break
                total += pushed
                if total >= _INF:
                    raise RuntimeError("rematerialization: a value the backward needs can be neither saved nor "
                                       "recomputed")

    def _augment(self, s, t, level, pointer) -> int:
        """Push one path's worth of flow along the level graph (iterative depth-first search); 0 when none is left."""
        adj = self.adj
        path: list[tuple] = []  # (tail, edge) of the edges taken so far
        u = s
        while True:
            if u == t:
                push = min(edge[1] for _, edge in path)
                for _, edge in path:
                    edge[1] -= push
                    adj[edge[0]][edge[2]][1] += push  # the reverse edge
                return push
            edges = adj.get(u, ())
            i, next_level = pointer[u], level[u] + 1
            while i < len(edges) and not (edges[i][1] > 0 and level.get(edges[i][0]) == next_level):
                i += 1
            pointer[u] = i
            if i < len(edges):
                path.append((u, edges[i]))
                u = edges[i][0]
                continue
            if not path:
                return 0
            level[u] = -1  # a dead end: not visited again in this phase
            u, _ = path.pop()
            pointer[u] += 1

    def reachable(self, s) -> set:
        seen, queue = {s}, deque([s])
        while queue:
            u = queue.popleft()
            for v, cap, _ in self.adj.get(u, ()):
                if cap > 0 and v not in seen:
                    seen.add(v)
                    queue.append(v)
        return seen


def choose_saved(leaves: Sequence[BoundSymbol], inputs: Iterable[Proxy], needed: Iterable[str], *,
                 recompute: bool = True, overwritten: Iterable[str] = (), exact: Iterable[str] = (),
                 checkpointed: Iterable[str] = (), kept: Iterable[str] = (),
                 returned: Iterable[str] = ()) -> tuple[list[Proxy], dict[str, BoundSymbol]]:
    """(values to save, ``{name: producer}`` of the values to recompute) so that the backward can read ``needed``.

    ``leaves`` are the forward's finest-grained bound symbols in order; ``inputs`` the forward's inputs, of which
    the forward updates ``overwritten`` in place (saving one costs a copy). The backward must read the very bits
    the forward computed for ``exact`` (``bit_exact_reads``): those are recomputed only by operations that
    reproduce bits. ``checkpointed`` values (``checkpoint_regions.checkpoint_choices``) are recomputed whatever
    their operations cost, unless those are never recomputed (random draws, side effects, in-place updates);
    ``kept`` values are never recomputed. ``returned`` values are the forward's outputs: the caller holds them
    (a model's logits), so saving one costs nothing, as for an input.
    """
    proxies: dict[str, Proxy] = {p.name: p for p in inputs}
    input_names = set(proxies)
    free = (input_names - set(overwritten)) | set(returned)
    producer: dict[str, BoundSymbol] = {}
    for b in leaves:
        for o in b.defined_outs:
            producer.setdefault(o.name, b)
            proxies.setdefault(o.name, o)
    needed = [n for n in dict.fromkeys(needed) if n in proxies]
    if not recompute:
        return [proxies[n] for n in needed], {}

    # values whose producer would not reproduce the bits the backward relies on: saved, never recomputed
    _, pinned = _exact_closure(exact, producer, input_names)

    checkpointed, kept = set(checkpointed), set(kept)

    def forced(name: str) -> bool:
        """A checkpointed value: recomputed, never saved, if its producer may run again."""
        b = producer.get(name)
        return name in checkpointed and b is not None and name not in input_names and name not in pinned \
            and _ONCE_TAGS.isdisjoint(b.sym.tags) and not draws(b)

    def cheap(name: str) -> bool:
        b = producer.get(name)
        return forced(name) or (b is not None and name not in input_names and name not in pinned
                                and name not in kept and is_recomputable(b))

    # only the values the backward's needs can be recomputed from matter
    relevant: list[str] = []
    seen: set[str] = set()
    stack = list(needed)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        relevant.append(n)
        if cheap(n):
            for p in producer[n].flat_args:
                if isinstance(p, TensorProxy):
                    proxies.setdefault(p.name, p)  # values from outside the leaves count as inputs
                    stack.append(p.name)

    side = _source_side(relevant, needed, proxies, producer, cheap, forced, free, input_names)
    return _read_cut(needed, side, proxies, producer)


def _source_side(relevant: list[str], needed: list[str], proxies: dict[str, Proxy], producer: dict[str, BoundSymbol],
                 cheap, forced, free: set[str], input_names: set[str]) -> set:
    """The source side of a minimum cut of the graph whose cut edges are the values to save: each value is an
    edge of its size from its ``in`` to its ``out`` node (free for inputs the forward does not overwrite and for
    returned values; never cut when ``forced``: a checkpointed value), fed by the source when it cannot be
    recomputed, else by its producer's inputs."""
    # Capacities are bytes, scaled so that among values of equal size the later one is cheaper to save: a tie
    # between saving a value and recomputing it from an earlier one of the same size goes to saving.
    position = {name: i for i, name in enumerate(proxies)}
    scale = len(position) + 2

    def cost(n: str, p: TensorProxy) -> int:
        return _nbytes(p) * scale + (scale - 1 - position[n])

    g = _FlowGraph()
    source, sink = ("source",), ("sink",)
    for n in relevant:
        p = proxies[n]
        if not isinstance(p, TensorProxy):
            g.add(source, (n, "in"), _INF)
            g.add((n, "in"), (n, "out"), 0)
            continue
        if cheap(n):
            for u in producer[n].flat_args:
                if isinstance(u, TensorProxy):
                    g.add((u.name, "out"), (n, "in"), _INF)
            weight = _INF if forced(n) else 0 if n in free else cost(n, p)
        else:
            g.add(source, (n, "in"), _INF)
            weight = 0 if n in free or (n not in producer and n not in input_names) else cost(n, p)
        g.add((n, "in"), (n, "out"), weight)
    for n in needed:
        g.add((n, "out"), sink, _INF)
    g.max_flow(source, sink)
    return g.reachable(source)


def _read_cut(needed: list[str], side: set, proxies: dict[str, Proxy],
              producer: dict[str, BoundSymbol]) -> tuple[list[Proxy], dict[str, BoundSymbol]]:
    """(values to save, in forward order; ``{name: producer}`` of those to recompute) from the cut's source side,
    walking back from what the backward needs."""
    saved: dict[str, Proxy] = {}
    recomputed: dict[str, BoundSymbol] = {}
    stack, seen = list(needed), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if (n, "in") in side:
            saved[n] = proxies[n]
        else:
            recomputed[n] = producer[n]
            stack.extend(p.name for p in producer[n].flat_args if isinstance(p, TensorProxy))
    order = {name: i for i, name in enumerate(proxies)}
    return sorted(saved.values(), key=lambda p: order[p.name]), recomputed


def coarsen(nodes: Sequence, saved: Iterable[str], producers: dict[str, BoundSymbol],
            exact: Iterable[str] = ()) -> dict[str, BoundSymbol]:
    """Recompute with whole symbols where possible: ``ltorch.repeat_interleave`` as one call rather than the
    three prims of its decomposition. ``nodes`` are ``linearize.Node`` (``bsym``, ``parts``, ``leaves()``).

    A node replaces the producers of its outputs when all its leaves are recomputable and everything it reads
    is saved or recomputed anyway -- and, for an output whose bits matter (``exact``, as for ``choose_saved``),
    when all its leaves reproduce bits: it may compute that output from values that are saved for its parts.
    """
    available = set(saved) | set(producers)
    coarse = dict(producers)
    exact, _ = _exact_closure(exact, producers, set())

    for node in nodes:
        # Only the symbols the program itself called: a decomposition may call torch-language symbols with
        # arguments their torch function would not take (clamp calls maximum with a Python number).
        if node.parts is not None:
            # values the symbol passes through unchanged keep their own producers: recomputing them with this
            # symbol would read the value it is meant to define
            outs = [p.name for p in node.bsym.defined_outs]
            leaves = node.leaves()
            if any(n in producers for n in outs) and all(a.name in available for a in node.bsym.flat_args) \
                    and all(is_recomputable(leaf) for leaf in leaves) \
                    and (exact.isdisjoint(outs) or all(_reproduces_bits(leaf) for leaf in leaves)):
                coarse.update({n: node.bsym for n in outs if n in producers})
    return coarse


def with_recompute(bsyms: Sequence[BoundSymbol], available: Iterable[str], producers: dict[str, BoundSymbol],
                   also_read: Iterable[str] = (), *, strict: bool = True) -> list[BoundSymbol]:
    """``bsyms`` with the producers of values they (and then ``also_read``) read but do not have inserted just
    before their first use. With ``strict=False`` a value with no producer is taken to be defined earlier."""
    have = set(available)
    out: list[BoundSymbol] = []
    emitted: set[int] = set()

    def ensure(name: str) -> None:
        if name in have:
            return
        b = producers.get(name)
        if b is None and not strict:  # defined outside these symbols (an earlier value of the enclosing trace)
            have.add(name)
            return
        if b is None:
            raise RuntimeError(f"rematerialization: the backward reads {name}, which is neither saved nor "
                               "recomputable")
        if id(b) in emitted:
            return
        emitted.add(id(b))
        for p in b.flat_args:
            ensure(p.name)
        out.append(b)
        have.update(p.name for p in b.flat_proxy_outs)

    for b in bsyms:
        for p in b.flat_args:
            ensure(p.name)
        out.append(b)
        have.update(p.name for p in b.flat_proxy_outs)
    for name in also_read:
        ensure(name)
    return out
