"""Bookkeeping symbols: lines of an execution trace that compute nothing.

``DEL`` (``del t1, t2`` after a value's last use) is the one such symbol. It carries ``OpTags.BOOKKEEPING``,
which is what passes match on: executors never claim it, fusion carries it along, counts of operations skip it.
Passes that reorder operations (fusion's grouping, the communication scheduler) move each with the ``del`` lines
leading it (``operations``) and walk their dependencies both ways (``dependents``).
"""

from __future__ import annotations

from collections.abc import Sequence

from fulmen.core.symbol import BoundSymbol, OpTags, Symbol

DEL = Symbol(
    name="del",
    id="del",
    is_prim=True,
    module=None,
    tags=(OpTags.BOOKKEEPING,),
    python_printer=lambda bsym, printer: "del " + ", ".join(p.name for p in bsym.flat_args),
)


def is_bookkeeping(bsym: BoundSymbol) -> bool:
    """Whether ``bsym`` computes nothing (a ``del``)."""
    return OpTags.BOOKKEEPING in bsym.sym.tags


def operations(bsyms: Sequence[BoundSymbol]) -> tuple[list[list[BoundSymbol]], list[BoundSymbol]]:
    """The operations of ``bsyms``, each with the bookkeeping (``del``) that leads it; and the trailing bookkeeping:
    what a pass that reorders operations moves as one."""
    nodes: list[list[BoundSymbol]] = []
    pending: list[BoundSymbol] = []
    for b in bsyms:
        pending.append(b)
        if OpTags.BOOKKEEPING not in b.sym.tags:
            nodes.append(pending)
            pending = []
    return nodes, pending


def dependents(deps: list[set[int]]) -> list[list[int]]:
    """The inverse of ``deps`` (each operation's dependencies, by position): for each operation, the positions of
    the operations that depend on it."""
    users: list[list[int]] = [[] for _ in deps]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    return users
