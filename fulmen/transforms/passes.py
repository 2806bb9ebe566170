"""Cleanup passes: dead-code elimination, common-subexpression elimination, and ``del`` after last use."""

from __future__ import annotations

from fulmen.core.bookkeeping import DEL
from fulmen.core.codeutils import outputs_of
from fulmen.core.draws import draws
from fulmen.core.proxies import Proxy, TensorProxy
from fulmen.core.symbol import BoundSymbol, OpTags
from fulmen.core.symbolic import SYMBOLIC_TYPES, expr_of
from fulmen.core.trace import Trace
from fulmen.prims import PrimIDs


def _keeps(bsym: BoundSymbol) -> bool:
    tags = bsym.sym.tags
    return OpTags.SIDE_EFFECT in tags or OpTags.DONT_DCE in tags


def checks_values(bsym: BoundSymbol) -> bool:
    """Whether ``bsym`` may raise on its inputs' values: an op tagged ``CHECKS_VALUES`` (an index that can be out of
    bounds), or a composite whose decomposition holds one. Unused, it still decides whether the program raises."""
    if OpTags.CHECKS_VALUES in bsym.sym.tags:
        return True
    return any(checks_values(s) for s in bsym.subsymbols)


def use_counts(trace: Trace) -> dict[str, int]:
    """How many times each value is read: as an argument of a bound symbol, or by being returned."""
    counts: dict[str, int] = {}
    for b in trace.bound_symbols:
        for p in b.flat_args:
            counts[p.name] = counts.get(p.name, 0) + 1
    for p in outputs_of(trace.output):
        counts[p.name] = counts.get(p.name, 0) + 1
    return counts


def dce(trace: Trace, *, provenance: str = "Dead Code Elimination") -> Trace:
    """Drop bound symbols none of whose outputs are needed (side effects, random draws and ops that may raise on
    values are always kept; the last test runs only for unused ones, so a program without them pays nothing)."""
    needed = {p.name for p in outputs_of(trace.output)}
    kept: list[BoundSymbol] = []
    for bsym in reversed(trace.bound_symbols):
        outs = bsym.flat_proxy_outs
        if _keeps(bsym) or draws(bsym) or any(p.name in needed for p in outs) or (not outs and bsym.sym is not DEL) \
                or (outs and checks_values(bsym)):
            kept.append(bsym)
            needed.update(p.name for p in bsym.flat_args)
    kept.reverse()
    return trace.derive(provenance, kept)


def _cse_key(bsym: BoundSymbol):
    # a symbol that can draw is never merged (even where this call draws nothing), nor one whose call draws
    if (bsym.sym.tags and (OpTags.RANDOM_OP in bsym.sym.tags or _keeps(bsym))) or draws(bsym):
        return None

    def freeze(x):
        if isinstance(x, Proxy):
            return ("p", x.name)
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, tuple(freeze(v) for v in x))
        if isinstance(x, dict):
            return ("d", tuple((k, freeze(v)) for k, v in x.items()))
        if isinstance(x, SYMBOLIC_TYPES):  # hash() would specialize it (a guard); its expression is hashable
            return (type(x).__name__, expr_of(x))
        try:
            hash(x)
        except TypeError:
            return ("id", id(x))
        return (type(x).__name__, x)

    return (id(bsym.sym), freeze(bsym.args), freeze(bsym.kwargs))


#: Ops whose result may share memory with an argument when run (views, no-op conversions, opaque torch calls).
MAY_ALIAS = frozenset((OpTags.VIEW, OpTags.SHAPE_OP, OpTags.DEVICE_OP, OpTags.FALLBACK))


def overwritten_inputs(trace: Trace) -> dict[str, TensorProxy]:
    """``{input name: new value}`` of the inputs the program writes back into (its ``prims.copy_`` write-backs)."""
    return {b.args[1].name: b.args[0] for b in trace.bound_symbols if b.sym.id is PrimIDs.COPY_}


def _returned_memory(trace: Trace) -> set[str]:
    """Names of the values whose memory a returned tensor may share: the outputs and, through ops that may alias,
    what they were made from."""
    producer = {p.name: b for b in trace.bound_symbols for p in b.flat_proxy_outs}
    found: set[str] = set()
    stack = [p.name for p in outputs_of(trace.output)]
    while stack:
        name = stack.pop()
        if name in found:
            continue
        found.add(name)
        bsym = producer.get(name)
        if bsym is not None and not MAY_ALIAS.isdisjoint(bsym.sym.tags):
            stack.extend(p.name for p in bsym.flat_args)
    return found


def cse(trace: Trace, *, provenance: str = "Common Subexpression Elimination") -> Trace:
    """Reuse the result of an identical earlier call (same symbol, same arguments); random ops are never merged.

    Two calls that both make (the memory of) returned tensors are not merged either: eager returns independent
    tensors there (``return a + 1, a + 1``), and an in-place update of one must not show in the other.
    """
    seen: dict = {}
    swap: dict[str, Proxy] = {}
    out: list[BoundSymbol] = []
    returned = _returned_memory(trace)
    for bsym in trace.bound_symbols:
        if swap:
            bsym = bsym.from_bsym_swap_proxies(swap, skip_output=True)
        key = _cse_key(bsym)
        earlier = seen.get(key) if key is not None else None
        if earlier is not None and any(p.name in returned for p in bsym.flat_proxy_outs) and any(
                p.name in returned for p in earlier.flat_proxy_outs):
            earlier = None
            key = None  # keep the first call as the one later duplicates reuse
        if earlier is not None:
            for old, new in zip(bsym.flat_proxy_outs, earlier.flat_proxy_outs):
                swap[old.name] = new
            continue
        if key is not None:
            seen[key] = bsym
        out.append(bsym)
    new = trace.derive(provenance, out)
    if swap:
        def sub(x):
            if isinstance(x, Proxy):
                return swap.get(x.name, x)
            if isinstance(x, (tuple, list)):
                return type(x)(sub(v) for v in x)
            if isinstance(x, dict):
                return {k: sub(v) for k, v in x.items()}
            return x

        new.output = sub(new.output)
    return new


def del_last_used(trace: Trace, *, provenance: str = "Delete Last Used") -> Trace:
    """Insert ``del`` right after each value's last use so memory is released as early as in eager."""
    returned = {p.name for p in outputs_of(trace.output)}
    last_use: dict[str, int] = {}
    for i, bsym in enumerate(trace.bound_symbols):
        for p in bsym.flat_args:
            last_use[p.name] = i
    for a in trace.args:
        last_use.setdefault(a.name, -1)
    to_delete: dict[int, list[Proxy]] = {}
    seen: set[str] = set()
    proxies: dict[str, Proxy] = {a.name: a for a in trace.args}
    unused: set[str] = set()
    for i, bsym in enumerate(trace.bound_symbols):
        for p in bsym.flat_proxy_outs:
            proxies.setdefault(p.name, p)
            if p.name not in last_use and p.name not in returned:
                unused.add(p.name)
    for name, i in last_use.items():
        if name in returned or name in seen:
            continue
        seen.add(name)
        to_delete.setdefault(i, []).append(proxies.get(name))
    out: list[BoundSymbol] = []
    if -1 in to_delete:
        dels = [p for p in to_delete[-1] if p is not None]
        if dels:
            out.append(BoundSymbol(DEL, tuple(dels), {}, None))
    for i, bsym in enumerate(trace.bound_symbols):
        out.append(bsym)
        dels = [p for p in to_delete.get(i, []) if p is not None]
        if dels:
            out.append(BoundSymbol(DEL, tuple(dels), {}, None))
    new = trace.derive(provenance, out)
    new.unused_outputs = unused
    return new
