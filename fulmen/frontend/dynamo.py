"""``torch.compile(model, backend="fulmen")``: Dynamo captures graphs, fulmen compiles each one.

Dynamo breaks the program where Python needs real values (data-dependent control flow, unsupported
Python) and hands each captured FX graph to this backend. Its nodes call torch functions, which reach
fulmen's torch language on proxies exactly as user code does, so each graph goes through the same
pipeline as ``fulmen.jit`` (autodiff, executors, fusion, caching). The backend is registered through the
``torch_dynamo_backends`` entry point, so the string "fulmen" works after ``pip install``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger("fulmen.dynamo")


def fulmen_backend(gm: torch.fx.GraphModule, example_inputs: list, **options) -> Callable:
    """Compile one Dynamo graph with ``fulmen.jit``; options are passed to it (e.g. ``executors=``)."""
    from fulmen.frontend.jit import JittedFunction

    def run_graph(*args):
        return gm(*args)

    run_graph.__name__ = "dynamo_graph"
    jitted = JittedFunction(run_graph, **options)

    def compiled(*args):
        return jitted(*args)

    compiled._fulmen_jitted = jitted
    log.debug("fulmen: compiling a Dynamo graph with %d nodes", len(gm.graph.nodes))
    return compiled
