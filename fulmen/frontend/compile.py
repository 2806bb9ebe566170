"""From a computation trace to runnable code: the pipeline, as lists of named trace -> trace steps.

A compilation runs, in order (``docs/architecture.md`` draws it):

1. the computation steps: each listed executor's ``steps`` and the ``steps=`` given to ``fulmen.jit`` whose stage
   is "computation" (``fused_linear_ce`` rewrites linear + cross_entropy here, before autodiff);
2. when training, ``autodiff``: the forward trace of the forward/backward split (``fulmen.frontend.training``);
3. ``EXECUTION_PIPELINE`` on that trace, with the "execution" steps inserted before its last step; then the
   trace becomes Python code. Each backward trace, when it first runs, goes through ``BACKWARD_STEPS`` (and the
   "backward" steps given) and then ``EXECUTION_PIPELINE``.

Every step's trace is kept under the step's name: ``fulmen.last_traces(f)`` lists the traces and
``fulmen.compile_stats(f).last_trace_steps`` their names, one to one ("trace" names the computation trace).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fulmen.core.codegen import compile_trace
from fulmen.core.options import JitOptions
from fulmen.core.steps import Step
from fulmen.core.trace import Trace, check_trace
from fulmen.executors.base import Executor, FusionExecutor, claim_symbols, fuse_regions
from fulmen.frontend.containers import rebuilder
from fulmen.frontend.cudagraphs import graphed
from fulmen.transforms.accumulate import accumulate_embedding_grads
from fulmen.transforms.overlap import has_work, overlapping, schedule_communication
from fulmen.transforms.passes import cse, dce, del_last_used
from fulmen.transforms.scale_pushdown import push_scale_past_matmuls
from fulmen.transforms.sparse_gradients import keep_sparse_gradients


def _has_fusion(executors: Sequence[Executor]) -> bool:
    return any(isinstance(ex, FusionExecutor) for ex in executors)


#: From a trace of torch-level symbols to the trace that runs; the "execution" steps go before the last one.
EXECUTION_PIPELINE: tuple[Step, ...] = (
    Step("dce", lambda t, executors: dce(t), "execution"),
    Step("claim", lambda t, executors: claim_symbols(t, executors, fuse=False), "execution"),
    Step("cse", lambda t, executors: cse(t), "execution"),
    Step("dce_after_claim", lambda t, executors: dce(t, provenance="Dead Code Elimination (after claiming)"),
         "execution"),
    # collectives started as early as their inputs allow, waited as late as their readers allow
    Step("overlap", lambda t, executors: schedule_communication(t), "execution", for_trace=has_work),
    Step("fusion", lambda t, executors: fuse_regions(t, executors), "execution", when=_has_fusion),
    Step("del_last_used", lambda t, executors: del_last_used(t), "execution"),
)

#: Run on each backward trace before ``EXECUTION_PIPELINE``: sparse gradients kept off fused regions, gradients of
#: embedding lookups accumulated in one index_put, and scalar scales moved past matrix products onto the smaller side.
BACKWARD_STEPS: tuple[Step, ...] = (
    Step("keep_sparse_gradients", lambda t, executors: keep_sparse_gradients(t), "backward"),
    Step("accumulate_embedding_grads", lambda t, executors: accumulate_embedding_grads(t), "backward"),
    Step("push_scale_past_matmuls", lambda t, executors: push_scale_past_matmuls(t), "backward"),
)

def added_steps(executors: Sequence[Executor], options: JitOptions, stage: str) -> list[Step]:
    """The steps of ``stage`` the executors declare (in their order), then those given to ``fulmen.jit``."""
    return [s for s in (*(s for ex in executors for s in ex.steps), *options.steps) if s.stage == stage]


@dataclass
class PipelineRun:
    """One run of the pipeline: the traces built so far with the names of the steps that built them."""

    executors: Sequence[Executor]
    options: JitOptions = field(default_factory=JitOptions)  # the defaults: from the environment, read now
    timings: dict[str, float] = field(default_factory=dict)
    traces: list[Trace] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    def record(self, name: str, trace: Trace, elapsed_ms: float | None = None) -> Trace:
        """Keep ``trace`` as the result of step ``name`` (checked when the options ask for it)."""
        if elapsed_ms is not None:
            trace.elapsed_ms = elapsed_ms
            self.timings[name] = self.timings.get(name, 0.0) + elapsed_ms
        if self.options.check_traces:
            check_trace(trace)
        self.traces.append(trace)
        self.names.append(name)
        return trace

    def run(self, steps: Sequence[Step], trace: Trace) -> Trace:
        """Run each step that applies to these executors on the trace the one before it built."""
        for step in steps:
            if not step.applies(self.executors):
                continue
            start = time.perf_counter()
            if step.for_trace is not None and not step.for_trace(trace):
                continue
            out = step.fn(trace, self.executors)
            if not isinstance(out, Trace):
                raise TypeError(f"pipeline step {step.name!r} returned {type(out).__name__}; a step returns a Trace")
            trace = self.record(step.name, out, (time.perf_counter() - start) * 1e3)
        return trace

    def execution(self, trace: Trace) -> Callable:
        """``EXECUTION_PIPELINE`` (with the "execution" steps added) on ``trace``, then its Python code."""
        extra = added_steps(self.executors, self.options, "execution")
        with overlapping(self.options.overlap_communication):
            final = self.run((*EXECUTION_PIPELINE[:-1], *extra, EXECUTION_PIPELINE[-1]), trace)
        start = time.perf_counter()
        fn, _ = compile_trace(final, comments=False)  # str(trace) still prints the decompositions
        self.timings["codegen"] = self.timings.get("codegen", 0.0) + (time.perf_counter() - start) * 1e3
        return fn


def computation_steps(trace: Trace, run: PipelineRun) -> Trace:
    """The computation trace (recorded as "trace") through the "computation" steps."""
    run.record("trace", trace)
    return run.run(added_steps(run.executors, run.options, "computation"), trace)


def execution_pipeline(trace: Trace, executors: Sequence[Executor], timings: dict[str, float],
                       options: JitOptions | None = None) -> tuple[Callable, list[Trace]]:
    """``EXECUTION_PIPELINE`` on ``trace`` alone: the callable and the traces, ``trace`` first (``options``: the
    defaults, from the environment, when not given)."""
    run = PipelineRun(executors, options if options is not None else JitOptions(), timings)
    run.record("trace", trace)
    return run.execution(trace), run.traces


@dataclass
class CompiledProgram:
    """What a cache entry runs: the forward callable; when training, the backward is compiled when it first runs
    and ``backward_traces()`` gives the traces of the one compiled last. ``steps`` names ``traces`` one to one."""

    forward: Callable
    traces: list[Trace]
    backward_traces: Callable[[], list[Trace]] | None = None
    num_saved: int = 0
    output_spec: Any = None
    timings_ms: dict[str, float] = field(default_factory=dict)
    run: Callable | None = None  # run(flat_tensors) -> output; set by whoever builds the program
    steps: list[str] = field(default_factory=list)
    #: a training program's backward runtime (``fulmen.frontend.training``): its compiled backward and statistics
    runtime: Any = None
    #: a warm-started program's ``settle()``: compiles the real program now and returns it (``warm_start``)
    settle: Callable[[], CompiledProgram] | None = None

    def __call__(self, flat: list) -> Any:
        return self.run(flat)


def compile_inference(trace: Trace, run: PipelineRun, *, cuda_graphs: str | None = None) -> CompiledProgram:
    """The program of ``trace`` (already through the computation steps of ``run``) without gradients."""
    fn = run.execution(trace)
    program = CompiledProgram(forward=fn, traces=run.traces, timings_ms=run.timings, steps=run.names)
    graphs = graphed(fn, [trace, run.traces[-1]], cuda_graphs, None) if cuda_graphs else None
    if _has_custom_containers(trace.output):
        # Generated code returns plain tuples/dicts; give the caller back e.g. a Hugging Face ModelOutput.
        rebuild = rebuilder(trace.output)
        call = (lambda flat: graphs.run(flat)[0]) if graphs is not None else (lambda flat: fn(*flat))
        program.run = lambda flat: rebuild(call(flat))
    elif graphs is not None:
        program.run = lambda flat: graphs.run(flat)[0]
    else:
        program.run = lambda flat: fn(*flat)
    return program


def _has_custom_containers(x) -> bool:
    if type(x) in (tuple, list):
        return any(_has_custom_containers(v) for v in x)
    if type(x) is dict:
        return any(_has_custom_containers(v) for v in x.values())
    return isinstance(x, (tuple, list, dict))
