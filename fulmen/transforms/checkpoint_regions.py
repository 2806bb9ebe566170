"""Activation checkpointing: the values of ``torch.utils.checkpoint`` regions are recomputed in the backward.

Tracing records each checkpointed region as a ``CheckpointRegion`` (``fulmen.frontend.checkpointing``): the names of
the values its operations defined. After linearization, ``checkpoint_choices`` names the values the backward must
not read from the forward: those a region defined and that no operation outside the region reads (nor the
program returns). ``remat.choose_saved`` then recomputes them from what enters the region, whatever their
operations cost (matrix products included), as eager's checkpoint does: the region's intermediates are never
saved, its inputs and the values that leave it are. Exceptions, also as in eager's results:

- random draws are saved, never drawn again, so the backward sees the forward's (eager's) numbers;
- operations with side effects, in-place updates and opaque operations keep their results;
- a value the backward compares bit for bit (``remat.bit_exact_reads``) is saved unless recomputing it
  reproduces its bits;
- the result of an operation a selective-checkpointing policy saves (``CheckpointRegion.saved_by_policy``) is
  never recomputed: it is saved when the backward (or a recomputation) needs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fulmen.core.proxies import TensorProxy


@dataclass(eq=False)
class CheckpointRegion:
    """One checkpointed region of a trace: the names of the values its operations defined (at the top level of the
    trace), and of those whose operation the selective-checkpointing policy saves."""

    names: frozenset[str]
    saved_by_policy: frozenset[str] = frozenset()


def checkpoint_choices(
    nodes: Sequence, regions: Sequence[CheckpointRegion], outputs: Iterable[TensorProxy]
) -> tuple[set[str], set[str]]:
    """(names of the values defined inside a checkpointed region that only the region reads: recomputed; names of
    the results of operations a selective-checkpointing policy saves: never recomputed). ``nodes`` are the
    linearized forward's ``linearize.Node`` (each whole symbol with the leaves the backward reasons about)."""
    if not regions:
        return set(), set()
    readers: dict[str, set[int]] = {}  # value -> indices of the nodes that read it
    for i, node in enumerate(nodes):
        for leaf in node.leaves():
            for p in leaf.flat_args:
                readers.setdefault(p.name, set()).add(i)
    returned = {p.name for p in outputs}
    recomputed: set[str] = set()
    kept: set[str] = set()
    for region in regions:
        inside = {i for i, node in enumerate(nodes) if any(p.name in region.names for p in node.bsym.flat_proxy_outs)}
        for i in inside:
            outs = nodes[i].bsym.defined_outs
            if any(p.name in region.saved_by_policy for p in outs):
                kept.update(p.name for p in outs)
                continue
            for leaf in nodes[i].leaves():
                recomputed.update(
                    p.name for p in leaf.defined_outs if p.name not in returned and readers.get(p.name, set()) <= inside
                )
    return recomputed - kept, kept
