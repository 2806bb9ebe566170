"""How many bytes of tensors an execution trace holds at each step: what a schedule costs in memory, read off the
trace (no run, no allocator).

A tensor is counted from the operation that makes it to the ``del`` of its last name. Views (``OpTags.VIEW``), waits
(``OpTags.WAIT``, whose result is the collective's buffer) and in-place updates return their first tensor argument's
memory, so their results add nothing and keep that memory alive as long as any of its names is. A collective in
flight holds its inputs until its wait, whatever the trace deletes before. A reshape that
copies is counted as a view, so the figures are a lower bound; the trace's own inputs are not counted (the caller
holds them), but what the trace unpacks from a list it is given (the backward's saved tensors, freed as the backward
deletes them) is.

    peak = peak_live(fulmen.last_backward_traces(model)[-1])
    print(peak.bytes, peak.position, peak.names[:5])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fulmen.core.bookkeeping import is_bookkeeping
from fulmen.core.proxies import Proxy, TensorProxy
from fulmen.core.symbol import BoundSymbol, OpTags
from fulmen.core.symbolic import size_hint
from fulmen.core.trace import Trace

_ALIASING = (OpTags.VIEW, OpTags.WAIT, OpTags.IN_PLACE)


@dataclass(frozen=True)
class Peak:
    """The most bytes alive at once, after which operation (its position in ``trace.bound_symbols``), and the
    names of the tensors holding them, largest first (one name per memory: the one that made it)."""

    bytes: int
    position: int
    names: tuple[str, ...]


def nbytes(p: TensorProxy) -> int:
    """The bytes of a tensor of ``p``'s shape and dtype (symbolic sizes at the values traced)."""
    return math.prod(size_hint(s) for s in p.shape) * p.dtype.itemsize


def _aliases(bsym: BoundSymbol, owner: dict[str, str]) -> str | None:
    """The memory (its maker's name) that ``bsym``'s results share, or None where they are new tensors."""
    if not any(t in bsym.sym.tags for t in _ALIASING):
        return None
    first = next((p for p in bsym.flat_args if isinstance(p, TensorProxy)), None)
    return owner.get(first.name) if first is not None else None


def peak_live(trace: Trace) -> Peak:
    """The peak of the bytes ``trace`` holds (see the module doc)."""
    owner: dict[str, str] = {}  # a name -> the name of the tensor whose memory it is
    names_of: dict[str, set[str]] = {}  # a memory -> its names alive
    size: dict[str, int] = {}
    in_flight: dict[str, list[str]] = {}  # a collective's result -> the memories of its inputs, held until its wait
    alive = 0
    peak = Peak(0, -1, ())

    def release(memory: str, name: str) -> None:
        nonlocal alive
        names_of[memory].discard(name)
        if not names_of[memory]:
            alive -= size.pop(memory)
            del names_of[memory]

    for i, bsym in enumerate(trace.bound_symbols):
        if is_bookkeeping(bsym):  # ``del``: a memory is freed with its last name
            for p in bsym.flat_args:
                memory = owner.pop(p.name, None) if isinstance(p, Proxy) else None
                if memory is not None:
                    release(memory, p.name)
            continue
        tags = bsym.sym.tags
        if OpTags.WAIT in tags:
            for p in bsym.flat_args:
                for memory in in_flight.pop(p.name, ()) if isinstance(p, Proxy) else ():
                    release(memory, "in flight: " + p.name)
        elif OpTags.COMMUNICATION in tags and bsym.flat_proxy_outs:
            result = bsym.flat_proxy_outs[0].name
            held = {owner[p.name] for p in bsym.flat_args if isinstance(p, TensorProxy) and p.name in owner}
            in_flight[result] = sorted(held)
            for memory in held:
                names_of[memory].add("in flight: " + result)
        shared = _aliases(bsym, owner)
        for p in bsym.flat_proxy_outs:
            if not isinstance(p, TensorProxy) or p.name in owner:
                continue
            memory = shared if shared is not None else p.name
            owner[p.name] = memory
            if memory not in names_of:
                names_of[memory] = set()
                size[memory] = nbytes(p)
                alive += size[memory]
            names_of[memory].add(p.name)
        if alive > peak.bytes:
            peak = Peak(alive, i, tuple(sorted(size, key=size.__getitem__, reverse=True)))
    return peak
