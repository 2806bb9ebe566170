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


def _size_sources(gm: torch.fx.GraphModule) -> dict[int, tuple[int, int]] | None:
    """For a graph Dynamo compiled with dynamic shapes, its ``SymInt`` inputs are sizes of its tensor inputs:
    ``{position of the int: (position of a tensor, dim)}``, or None if some int is not such a size. (The
    example inputs Dynamo passes are real tensors; the placeholders' metadata holds the symbolic ones.)"""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    example_inputs = [n.meta.get("example_value") for n in placeholders]
    sources: dict[int, tuple[int, int]] = {}
    for i, e in enumerate(example_inputs):
        if not isinstance(e, torch.SymInt):
            continue
        expr = str(e.node.expr)
        sources[i] = next(((j, d) for j, t in enumerate(example_inputs) if isinstance(t, torch.Tensor)
                           for d, size in enumerate(t.shape)
                           if isinstance(size, torch.SymInt) and str(size.node.expr) == expr), None)
        if sources[i] is None:
            return None
    return sources


def fulmen_backend(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None,
                   **kwargs) -> Callable:
    """Compile one Dynamo graph with ``fulmen.jit``; options are passed to it (e.g. ``executors=``).

    ``torch.compile(model, backend="fulmen", options={"executors": ["torch"], "compile": "sync"})`` hands the
    dictionary over as ``options``; keyword arguments (a backend made with ``functools.partial``) work too.

    When Dynamo hands over a graph with dynamic shapes, its size inputs (``s27: torch.SymInt``) are read from the
    tensors inside the compiled function instead of being passed in: fulmen keys integers by value, so passing
    them would compile a program per size, while a size read from a tensor follows fulmen's own dynamic sizes
    (one more compilation when a dimension first changes, then none).
    """
    from fulmen.core.proxies import DataDependentError
    from fulmen.frontend.jit import JittedFunction

    sources = _size_sources(gm) or {}
    kept = [i for i in range(len(example_inputs)) if i not in sources]  # the inputs fulmen is passed
    position = {i: k for k, i in enumerate(kept)}

    def run_graph(*passed):  # runs only while fulmen traces: not on the per-call path
        return gm(*[passed[position[sources[i][0]]].shape[sources[i][1]] if i in sources else passed[position[i]]
                    for i in range(len(example_inputs))])

    run_graph.__name__ = "dynamo_graph"
    jitted = JittedFunction(run_graph, **{**(options or {}), **kwargs})
    jitted._guard_reads = False  # Dynamo guards the globals the user's code read; the graph's own are its constants

    select = (lambda args: [args[i] for i in kept]) if sources else (lambda args: args)
    eager = None  # set when fulmen cannot trace the graph: Dynamo's graph then runs as it is

    def compiled(*args):
        nonlocal eager
        if eager is None:
            try:
                return jitted(*select(args))
            except DataDependentError as e:
                # Dynamo passes a Python float that changes between calls as a 0-d tensor read with .item() inside
                # the graph; fulmen has no symbolic floats. Tracing has no side effects, so eager PyTorch can run it.
                log.warning("fulmen: a Dynamo graph needs a tensor's value while tracing (%s); it runs with eager "
                            "PyTorch from now on", str(e).splitlines()[0])
                eager = gm
        return eager(*args)

    compiled._fulmen_jitted = jitted
    log.debug("fulmen: compiling a Dynamo graph with %d nodes", len(gm.graph.nodes))
    return compiled
