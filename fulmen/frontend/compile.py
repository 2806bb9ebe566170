"""From a computation trace to runnable code: the pipeline of named trace -> trace steps.

``PIPELINE`` lists the steps for inference; training inserts autodiff and the forward/backward split
(``fulmen.transforms.autodiff``) before claiming. Every step's trace is kept for ``last_traces``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fulmen.core.codegen import compile_trace
from fulmen.core.trace import Trace, check_trace
from fulmen.executors.base import Executor, FusionExecutor, claim_symbols, fuse_regions
from fulmen.frontend.cudagraphs import graphed
from fulmen.transforms.overlap import communicates, schedule_communication
from fulmen.transforms.passes import cse, dce, del_last_used

#: Set by tests: run ``check_trace`` after every step.
CHECK_TRACES = False


@dataclass
class CompiledProgram:
    """What a cache entry runs: the forward callable; when training, the backward is compiled when it first runs
    and ``backward_traces()`` gives the traces of the one compiled last."""

    forward: Callable
    traces: list[Trace]
    backward_traces: Callable[[], list[Trace]] | None = None
    num_saved: int = 0
    output_spec: Any = None
    timings_ms: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    run: Callable | None = None  # run(flat_tensors) -> output; set by whoever builds the program

    def __call__(self, flat: list) -> Any:
        return self.run(flat)


def _step(traces: list[Trace], timings: dict[str, float], name: str, fn: Callable[[Trace], Trace]) -> Trace:
    start = time.perf_counter()
    out = fn(traces[-1])
    elapsed = (time.perf_counter() - start) * 1e3
    out.elapsed_ms = elapsed
    timings[name] = timings.get(name, 0.0) + elapsed
    if CHECK_TRACES:
        check_trace(out)
    traces.append(out)
    return out


def execution_pipeline(trace: Trace, executors: Sequence[Executor], timings: dict[str, float],
                       traces: list[Trace] | None = None) -> tuple[Callable, list[Trace]]:
    """DCE, claim by executors, CSE, DCE again, overlap communication, fuse regions, delete last uses, then generate
    code."""
    traces = traces if traces is not None else [trace]
    if traces[-1] is not trace:
        traces.append(trace)
    _step(traces, timings, "dce", lambda t: dce(t))
    _step(traces, timings, "claim", lambda t: claim_symbols(t, executors, fuse=False))
    _step(traces, timings, "cse", lambda t: cse(t))
    trace = _step(traces, timings, "dce", lambda t: dce(t, provenance="Dead Code Elimination (after claiming)"))
    if communicates(trace):
        _step(traces, timings, "overlap", schedule_communication)
    if any(isinstance(ex, FusionExecutor) for ex in executors):
        _step(traces, timings, "fusion", lambda t: fuse_regions(t, executors))
    final = _step(traces, timings, "del_last_used", lambda t: del_last_used(t))
    start = time.perf_counter()
    fn, _ = compile_trace(final, comments=False)  # str(trace) still prints the decompositions
    timings["codegen"] = timings.get("codegen", 0.0) + (time.perf_counter() - start) * 1e3
    return fn, traces


def compile_inference(trace: Trace, executors: Sequence[Executor], *,
                      cuda_graphs: str | None = None) -> CompiledProgram:
    timings: dict[str, float] = {}
    fn, traces = execution_pipeline(trace, executors, timings)
    program = CompiledProgram(forward=fn, traces=traces, timings_ms=timings)
    graphs = graphed(fn, [trace, traces[-1]], cuda_graphs, None) if cuda_graphs else None
    if graphs is not None:
        fn = lambda *flat: graphs.run(flat)[0]  # noqa: E731
    program.run = lambda flat: fn(*flat)
    if _has_custom_containers(trace.output):
        # Generated code returns plain tuples/dicts; give the caller back e.g. a Hugging Face ModelOutput.
        from torch.utils._pytree import tree_flatten, tree_unflatten

        spec = tree_flatten(trace.output)[1]
        program.run = lambda flat: tree_unflatten(tree_flatten(fn(*flat))[0], spec)
    return program


def _has_custom_containers(x) -> bool:
    if type(x) in (tuple, list):
        return any(_has_custom_containers(v) for v in x)
    if type(x) is dict:
        return any(_has_custom_containers(v) for v in x.values())
    return isinstance(x, (tuple, list, dict))
