"""``torch.compile(model, backend="fulmen")``: Dynamo captures graphs, fulmen compiles each one.

Dynamo breaks the program where Python needs real values (data-dependent control flow, unsupported
Python) and hands each captured FX graph to this backend. Its nodes call torch functions, which reach
fulmen's torch language on proxies exactly as user code does, so each graph goes through the same
pipeline as ``fulmen.jit`` (autodiff, executors, fusion, caching). The backend is registered through the
``torch_dynamo_backends`` entry point, so the string "fulmen" works after ``pip install``.
"""

from __future__ import annotations

import logging
import operator
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger("fulmen.dynamo")


@dataclass
class BackendStats:
    """What ``backend_stats()`` returns: the Dynamo graphs fulmen's backend was handed.

    ``graphs`` counts the graphs handed over; ``eager_graphs`` those that run with eager PyTorch because fulmen could
    not trace them (``eager_reasons`` says why, one line each); ``compilations`` the programs fulmen compiled for
    them (the sum of each graph's cache misses); ``per_graph`` the compilations of each graph in the order Dynamo
    handed them over. A test asserts with it that graphs reached fulmen and how often they compiled, rather than
    trusting that no silent eager fallback happened.
    """

    graphs: int = 0
    eager_graphs: int = 0
    compilations: int = 0
    per_graph: list[int] = field(default_factory=list)
    eager_reasons: list[str] = field(default_factory=list)


class _GraphRecord:
    __slots__ = ("eager_reason", "jitted")

    def __init__(self, jitted):
        self.jitted = jitted
        self.eager_reason: str | None = None


# One record per graph handed to the backend since the last reset_backend_stats(), dropped when the compiled function
# Dynamo held is collected.
_records: dict[int, _GraphRecord] = {}
_records_lock = threading.Lock()


def _remember(compiled: Callable, record: _GraphRecord) -> None:
    key = id(record)
    with _records_lock:
        _records[key] = record
    weakref.finalize(compiled, _forget, key)


def _forget(key: int) -> None:
    with _records_lock:
        _records.pop(key, None)


def reset_backend_stats() -> None:
    """Forget the graphs handed over so far: ``backend_stats()`` counts from here (call it with
    ``torch._dynamo.reset()``; the graphs Dynamo drops then linger until Python's cycle collector frees them)."""
    with _records_lock:
        _records.clear()


def backend_stats() -> BackendStats:
    """Counters of the Dynamo graphs handed to ``backend="fulmen"`` since ``reset_backend_stats()``, leaving out
    those whose compiled function was freed (see ``BackendStats``).

    >>> torch._dynamo.reset(); reset_backend_stats()
    >>> model.forward = torch.compile(model.forward, backend="fulmen"); model.generate(ids)
    >>> s = backend_stats(); assert s.graphs and not s.eager_graphs
    """
    with _records_lock:
        records = list(_records.values())
    per_graph = [r.jitted._stats.cache_misses for r in records]
    reasons = [r.eager_reason for r in records if r.eager_reason is not None]
    return BackendStats(graphs=len(records), eager_graphs=len(reasons), compilations=sum(per_graph),
                        per_graph=per_graph, eager_reasons=reasons)


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


def _dynamic_dims(gm: torch.fx.GraphModule, kept: list[int]) -> dict[int, frozenset]:
    """The dims Dynamo made dynamic, as ``{index among the tensors of the inputs kept: dims}``: the placeholders'
    example values hold symbolic sizes where Dynamo compiled the graph for every size."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    dims: dict[int, frozenset] = {}
    flat = 0
    for i in kept:
        e = placeholders[i].meta.get("example_value") if i < len(placeholders) else None
        if not isinstance(e, torch.Tensor):
            continue
        symbolic = frozenset(d for d, size in enumerate(e.shape)
                             if isinstance(size, torch.SymInt) and size.node.expr.free_symbols)
        if symbolic:
            dims[flat] = symbolic
        flat += 1
    return dims


def _dynamic_ints(gm: torch.fx.GraphModule, kept: list[int]) -> frozenset[int]:
    """The int inputs Dynamo made dynamic (a cache length no tensor's size gives), as int slots of the call among
    the inputs kept (``fulmen.frontend.dynamic.map_call_ints``: the ints in argument order)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    slots, slot = set(), 0
    for i in kept:
        e = placeholders[i].meta.get("example_value") if i < len(placeholders) else None
        if isinstance(e, torch.SymInt) or type(e) is int:
            if isinstance(e, torch.SymInt) and e.node.expr.free_symbols:
                slots.add(slot)
            slot += 1
    return frozenset(slots)


def _functorch_calls(gm: torch.fx.GraphModule) -> list[str]:
    """The names of the functorch transform primitives (``_add_batch_dim``, ``_vmap_increment_nesting``, ...) that
    ``gm`` calls, in order, without repeats."""
    names: dict[str, None] = {}
    for node in gm.graph.nodes:
        module = getattr(node.target, "__module__", None) or ""
        if node.op == "call_function" and module.startswith(("torch._functorch", "torch._C._functorch")):
            names[getattr(node.target, "__name__", str(node.target))] = None
    return list(names)


def _without_transforms(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule | None:
    """``gm`` retraced by ``make_fx``, which runs torch.func's batching rules and leaves a graph of aten operations
    without transform primitives. The user's tensors are not touched: only fake copies run. With static sizes the
    copies come from a fake mode of its own; a graph Dynamo made dynamic is retraced symbolically on its
    placeholders' fake values, in Dynamo's shape environment, so whatever the batching rules assume about a
    symbolic size becomes one of Dynamo's guards for this graph (as Inductor's own retrace of it would)."""
    from torch._guards import tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    examples = [n.meta.get("example_value") for n in placeholders]
    if any(isinstance(x, torch.SymInt) for x in example_inputs) or any(
            isinstance(s, torch.SymInt) for x in examples if isinstance(x, torch.Tensor) for s in x.shape):
        if len(examples) != len(example_inputs) or any(e is None for e in examples):
            return None
        try:
            retraced = make_fx(gm, tracing_mode="symbolic")(*examples)
        except Exception as e:  # noqa: BLE001 - the graph then runs as Dynamo captured it, counted as eager
            log.info("fulmen: make_fx could not retrace a dynamic graph's transforms symbolically: %s", e)
            return None
        for node, example in zip((n for n in retraced.graph.nodes if n.op == "placeholder"), examples):
            node.meta["example_value"] = example  # what _size_sources and _dynamic_dims read
        return retraced
    with tracing(None):  # a fake mode of its own: Dynamo's shape environment must not see this trace
        mode = FakeTensorMode()
        fakes = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
        with mode:
            return make_fx(gm, tracing_mode="real")(*fakes)


def _traceable(gm: torch.fx.GraphModule, example_inputs: list) -> tuple[torch.fx.GraphModule, list[str], bool]:
    """``(graph fulmen traces, the transform primitives left in it, whether it is an aten graph)``. vmap/grad levels
    inside a graph (Mamba's associative_scan runs torch's vmap) act on the tensors the graph passes them, which
    fulmen's traced tensors cannot stand for; the same graph with the batching rules applied (aten operations on
    unbatched tensors) can be traced, with static or symbolic sizes (``_without_transforms``). A graph ``make_fx``
    cannot retrace keeps its primitives: PyTorch runs it (counted in ``backend_stats().eager_graphs``)."""
    transforms = _functorch_calls(gm)
    retraced = _without_transforms(gm, example_inputs) if transforms else None
    if retraced is None:
        return gm, transforms, False
    log.info("fulmen: a Dynamo graph calls torch.func's transform primitives (%s); compiling it as make_fx "
             "retraced it with their batching rules applied", ", ".join(transforms))
    return retraced, [], True


def _jitted_graph(gm: torch.fx.GraphModule, n_inputs: int, sources: dict, kept: list[int], options: dict,
                  aten: bool = False):
    """``fulmen.jit`` of the graph, taking the inputs at ``kept`` and reading the sizes at ``sources`` from them.
    An aten graph (``aten``: one ``make_fx`` retraced) runs its aten operations as their torch-level forms
    (``TorchCalls``), so fulmen traces them through its own symbols: an aten overload reaching the tracer is one
    opaque operation, which nothing fuses and whose gradient PyTorch's autograd computes op by op."""
    from fulmen.frontend.aten_graph import TorchCalls
    from fulmen.frontend.jit import JittedFunction

    position = {i: k for k, i in enumerate(kept)}
    run = (lambda *args: TorchCalls(gm, differentiable=True).run(*args)) if aten else gm

    def run_graph(*passed):  # runs only while fulmen traces: not on the per-call path
        return run(*[passed[position[sources[i][0]]].shape[sources[i][1]] if i in sources else passed[position[i]]
                     for i in range(n_inputs)])

    run_graph.__name__ = "dynamo_graph"
    jitted = JittedFunction(run_graph, **options)
    jitted._guard_reads = False  # Dynamo guards the globals the user's code read; the graph's own are its constants
    if jitted.dynamic is None:  # the dims Dynamo compiled for every size are symbolic in fulmen's first compilation
        jitted._marked_dims = _dynamic_dims(gm, kept)
        jitted._marked_ints = _dynamic_ints(gm, kept)
    jitted._split_points = False  # a value the graph reads (.item()) is a float Dynamo passes anew on each call
    return jitted


def _selector(kept: list[int]) -> Callable:
    """``args -> the args at kept`` (a sequence), picked in C on the per-call path."""
    if len(kept) > 1:
        return operator.itemgetter(*kept)
    return lambda args: tuple(args[i] for i in kept)  # itemgetter of one index gives the item, not a tuple


def fulmen_backend(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None,
                   **kwargs) -> Callable:
    """Compile one Dynamo graph with ``fulmen.jit``; options are passed to it (e.g. ``executors=``).

    ``torch.compile(model, backend="fulmen", options={"executors": ["torch"], "compile": "sync"})`` hands the
    dictionary over as ``options``; keyword arguments (a backend made with ``functools.partial``) work too.

    When Dynamo hands over a graph with dynamic shapes, its size inputs (``s27: torch.SymInt``) are read from the
    tensors inside the compiled function instead of being passed in, and the sizes and the other int inputs Dynamo
    made dynamic (a cache's length) are symbolic in fulmen's first compilation of the graph (``_marked_dims``,
    ``_marked_ints``): one program serves every size and value.
    """
    from fulmen.core.proxies import DataDependentError
    from fulmen.frontend import dynamo_dtensor

    if dynamo_dtensor.holds_dtensors(gm, example_inputs):
        # DTensor operations run with PyTorch's DTensor dispatch; fulmen compiles the plain-tensor parts between
        return dynamo_dtensor.split_at_dtensors(gm, lambda part, examples: fulmen_backend(part, examples, options,
                                                                                          **kwargs))

    gm, transforms, aten = _traceable(gm, example_inputs)
    sources = _size_sources(gm) or {}
    kept = [i for i in range(len(example_inputs)) if i not in sources]  # the inputs fulmen is passed
    jitted = _jitted_graph(gm, len(example_inputs), sources, kept, {**(options or {}), **kwargs}, aten)
    select = _selector(kept) if sources else (lambda args: args)
    record = _GraphRecord(jitted)
    eager = None  # set when fulmen cannot trace the graph: Dynamo's graph then runs as it is
    if transforms:
        record.eager_reason = f"the graph calls torch.func's transform primitives ({', '.join(transforms)})"
        log.warning("fulmen: a Dynamo graph runs with eager PyTorch, not compiled: %s", record.eager_reason)
        eager = gm

    def compiled(*args):
        nonlocal eager
        if eager is None:
            try:
                return jitted(*select(args))
            except DataDependentError as e:
                # Dynamo passes a Python float that changes between calls as a 0-d tensor read with .item() inside
                # the graph; fulmen has no symbolic floats. Tracing has no side effects, so eager PyTorch can run it.
                reason = str(e).splitlines()[0]
                log.warning("fulmen: a Dynamo graph needs a tensor's value while tracing (%s); it runs with eager "
                            "PyTorch from now on", reason)
                record.eager_reason = reason
                eager = gm
        return eager(*args)

    compiled._fulmen_jitted = jitted
    _remember(compiled, record)
    log.debug("fulmen: compiling a Dynamo graph with %d nodes", len(gm.graph.nodes))
    return compiled
