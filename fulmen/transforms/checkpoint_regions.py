"""Activation checkpointing: the values of ``torch.utils.checkpoint`` regions are recomputed in the backward.

Tracing records each checkpointed region as a ``CheckpointRegion`` (``fulmen.frontend.checkpointing``): the names of
the values its operations defined. After linearization, ``checkpoint_choices`` names the values the backward must
not read from the forward: those a region defined and that no operation outside the region reads (nor the
program returns). ``remat.choose_saved`` then recomputes them from what enters the region, whatever their
operations cost (matrix products included), as eager's checkpoint does: the region's intermediates are never
saved, its inputs and the values that leave it are. Exceptions, also as in eager's results:

- a random draw on the CPU is drawn again from the generator state the forward saw before it (saved: a few
  kilobytes), leaving the generator as it was, as eager's ``preserve_rng_state``; elsewhere the draw is saved;
- operations with side effects, in-place updates and opaque operations keep their results;
- a value the backward compares bit for bit (``remat.bit_exact_reads``) is saved unless recomputing it
  reproduces its bits;
- the result of an operation a selective-checkpointing policy saves (``CheckpointRegion.saved_by_policy``) is
  never recomputed: it is saved when the backward (or a recomputation) needs it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from fulmen import prims
from fulmen.core.devices import to_torch_device
from fulmen.core.draws import draws
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol, OpTags, Symbol
from fulmen.core.trace import Trace, tracectx


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


# ---------------------------------------------------------------------------------------------------------
# random draws inside a region: recomputed from the generator state the forward saw, as eager's checkpoint does


def _replay(torch_impl, state: torch.Tensor, *args, **kwargs):
    """``torch_impl(*args, **kwargs)`` drawn with the CPU generator set to ``state``, leaving the caller's
    generator as it was (``preserve_rng_state`` of eager's checkpoint)."""
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state)
        return torch_impl(*args, **kwargs)


_REPLAYS: dict = {}


def _replay_symbol(sym: Symbol) -> Symbol:
    replay = _REPLAYS.get(sym.id)
    if replay is None:
        from fulmen.executors.torchex import ex as torch_ex

        replay = Symbol(
            name=f"replay_{sym.name}",
            meta=None,
            id=f"checkpoint.replay_{sym.name}",
            is_prim=True,
            impl=functools.partial(_replay, sym.torch_impl),
            executor=torch_ex,
            skip_meta_check=True,
        )
        _REPLAYS[sym.id] = replay
    return replay


def _replayable(leaf: BoundSymbol, recomputed: set[str]) -> bool:
    """A random prim on the CPU whose outputs a checkpointed region alone reads."""
    outs = leaf.defined_outs
    return (
        OpTags.RANDOM_OP in leaf.sym.tags
        and leaf.sym.is_prim
        and leaf.sym.torch_impl is not None
        and bool(outs)
        and all(p.name in recomputed for p in outs)
        and all(isinstance(p, TensorProxy) and to_torch_device(p.device).type == "cpu" for p in outs)
    )


def replay_random_draws(nodes: list, recomputed: set[str], trace: Trace) -> dict[int, BoundSymbol]:
    """For each CPU random draw of a checkpointed region (``recomputed``): a node reading the generator's state is
    inserted into ``nodes`` (the forward) just before the symbol that draws, and ``{id(draw): replay}`` is returned,
    a symbol that draws again from that state, for rematerialization to recompute the draw with. Only symbols that
    draw once qualify (the state before the symbol is the state before its draw)."""
    replays: dict[int, BoundSymbol] = {}
    i = 0
    while i < len(nodes):
        node = nodes[i]
        # every leaf that draws counts (a user's composite among them): the state before the node is the state
        # before its one draw only if nothing else in it draws
        drawing = [leaf for leaf in node.leaves() if draws(leaf)]
        if len(drawing) == 1 and _replayable(drawing[0], recomputed):
            draw = drawing[0]
            scope: list[BoundSymbol] = []
            with tracectx(trace):
                trace.scopes.append(scope)
                try:
                    state = prims.get_rng_state()
                finally:
                    trace.scopes.pop()
            nodes.insert(i, type(node)(bsym=scope[0]))
            replays[id(draw)] = _replay_symbol(draw.sym).bind(state, *draw.args, output=draw.output, **draw.kwargs)
            i += 1
        i += 1
    return replays
