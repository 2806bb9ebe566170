"""Dynamo graphs that hold DTensors (tensor parallel modules, FSDP2 parameters): split into the parts that compute
on DTensors, which PyTorch runs with DTensor's own dispatch (sharding propagation and collectives), and the parts
on plain tensors between them, which fulmen compiles.

A DTensor's operations are not traced by fulmen (no traced tensor stands for one), so a graph that takes or makes
DTensors cannot be compiled whole. Each node is classed by the fake values Dynamo recorded (``example_value``): a
node that makes a DTensor, or reads one, is a DTensor node (``to_local`` is one; the nodes after it that read only
plain values are not). The graph is cut, in its own order, wherever the class changes, so each part only reads
values of parts before it. PyTorch's autograd joins the parts, as it joins a compiled program with the eager code
around it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch
from torch.fx.passes.split_module import split_module

log = logging.getLogger("fulmen.dynamo")


def _dtensor_class() -> type | None:
    # no DTensor exists unless its module was imported: checking costs nothing for programs that never use one
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def holds_dtensors(gm: torch.fx.GraphModule, example_inputs: list) -> bool:
    """Whether ``gm`` takes or makes DTensors."""
    dtensor = _dtensor_class()
    if dtensor is None:
        return False
    values = [*example_inputs, *(n.meta.get("example_value") for n in gm.graph.nodes)]
    return any(isinstance(v, dtensor) for v in torch.utils._pytree.tree_leaves(values))


def _dtensor_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes that make a DTensor or read one (``to_local`` reads one and makes a plain tensor: the nodes after
    it that read only plain values are plain)."""
    dtensor = _dtensor_class()
    makes = {
        n
        for n in gm.graph.nodes
        if any(isinstance(v, dtensor) for v in torch.utils._pytree.tree_leaves(n.meta.get("example_value")))
    }
    return {n for n in gm.graph.nodes if n in makes or any(i in makes for i in n.all_input_nodes)}


class _Compiled(torch.nn.Module):
    """A compiled part, callable where the split graph calls a submodule."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def split_at_dtensors(gm: torch.fx.GraphModule, compile_part: Callable) -> torch.fx.GraphModule:
    """``gm`` as a graph of parts: the DTensor parts as Dynamo captured them, each plain part replaced by
    ``compile_part(part_graph, example_inputs)`` (fulmen's backend)."""
    dtensor_nodes = _dtensor_nodes(gm)
    part, kind = [0], [None]
    parts: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        is_dtensor = node in dtensor_nodes
        if kind[0] is not None and is_dtensor != kind[0]:
            part[0] += 1
        kind[0] = is_dtensor
        parts[node] = part[0]
    split = split_module(gm, None, lambda node: parts[node], keep_original_order=True)
    dtensor_parts = {parts[n] for n in dtensor_nodes if n in parts}
    compiled = 0
    for name, sub in list(split.named_children()):
        index = int(name.rpartition("_")[2])
        if index in dtensor_parts:
            continue
        examples = [n.meta.get("example_value") for n in sub.graph.nodes if n.op == "placeholder"]
        setattr(split, name, _Compiled(compile_part(sub, examples)))
        compiled += 1
    log.warning(
        "fulmen: a Dynamo graph holds DTensors: its %d DTensor parts run with PyTorch (DTensor's dispatch), "
        "its %d plain-tensor parts compile",
        len(dtensor_parts),
        compiled,
    )
    return split
