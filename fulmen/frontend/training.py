"""Training: a forward and a backward trace, connected to PyTorch autograd by one ``torch.autograd.Function``.

``compile_training(trace, executors)`` differentiates the computation trace (``transforms.split``), runs the
execution pipeline on the forward and the backward, and returns a ``CompiledProgram`` whose ``run`` calls
``FulmenFunction.apply``. ``loss.backward()`` then reaches the backward trace; PyTorch does the rest as in
eager: ``.grad`` accumulation, hooks, ``retain_graph``, inputs that do not require grad.

Saved tensors: inputs and outputs of the function go through ``ctx.save_for_backward`` (no reference cycle
through outputs, and PyTorch's check that they were not modified in place); the other saved tensors are
held in a list on ``ctx`` that the backward empties, so each is freed right after its last use in the
backward -- unless the graph is retained. Outputs that get no gradient reach the backward as ``None``; a
backward trace is built, when the backward first runs, for each combination of present cotangents that occurs
(usually one).

An input that requires grad and is updated in place is returned as an output too, the caller's tensor itself,
marked dirty (``ForwardBackward.dirty``): autograd then gives it this function as its history, as an eager
in-place op would.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fulmen.core.ambient import Ambient
from fulmen.core.options import JitOptions
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbolic import is_symbolic, symbolic_value
from fulmen.core.trace import Trace
from fulmen.executors.base import Executor
from fulmen.executors.inductor_compile import call_leaving_a_core, compile_mode, compile_mode_set
from fulmen.frontend.compile import BACKWARD_STEPS, CompiledProgram, PipelineRun, added_steps, compile_inference
from fulmen.frontend.cudagraphs import GraphedProgram, graphed
from fulmen.transforms.split import ForwardBackward, split_forward_backward


def _keep_graph() -> bool:
    try:
        return bool(torch._C._autograd._get_current_graph_task_keep_graph())
    except Exception:  # a private API: when it is missing, keep everything (correct, frees later)
        return True


class _Runtime:
    """What the autograd function needs at run time (one per compiled program).

    The backward is compiled when it first runs, for the combination of cotangents that is present
    (``loss.backward()`` on a model returning ``(logits, loss)`` gives ``logits`` none), so no backward
    that never runs is ever compiled -- or handed to a fusion executor's background compiler."""

    def __init__(self, fb: ForwardBackward, executors: Sequence[Executor], forward, timings, options: JitOptions):
        self.fb = fb
        self.executors = executors
        self.options = options
        self.forward = forward
        self.n_outputs = len(fb.outputs)
        self.differentiable = list(fb.differentiable)
        self.dirty = list(fb.dirty)  # (input index, output index): return the input there, marked dirty
        self.views = list(fb.views)  # (output index, input index): may share the input's memory
        dirty_outputs = {k for _, k in fb.dirty}
        self.non_differentiable = [i for i in range(self.n_outputs)
                                   if i not in set(fb.differentiable) and i not in dirty_outputs]
        # save_for_backward takes the function's own inputs and outputs; a dirty output's value is returned as the
        # input tensor, and a snapshot of an overwritten input is neither
        names = {a.name for a in fb.forward.args}
        names |= {o.name for i, o in enumerate(fb.outputs) if i not in dirty_outputs}
        returned = fb.forward.output[self.n_outputs:]
        self.ctx_saved = [i for i, p in enumerate(returned) if p.name in names]
        self.list_saved = [i for i, p in enumerate(returned) if p.name not in names]
        self.n_saved = len(fb.saved)
        self.n_inputs = len(fb.forward.args)
        self.backwards: dict[tuple[bool, ...], Any] = {}
        self.traces: dict[tuple[bool, ...], list[Trace]] = {}
        self.steps: dict[tuple[bool, ...], list[str]] = {}  # the names of the steps that built each of traces
        self.latest: tuple[bool, ...] | None = None
        self.timings = timings
        self.compile_mode = compile_mode.get()  # the jitted function's: the backward's regions compile alike
        self.ambient = Ambient.capture()  # the defaults traced under; the backward may run under others
        self.graphs: GraphedProgram | None = None  # set when the program replays as CUDA graphs

    def backward_for(self, present: tuple[bool, ...]):
        fn = self.backwards.get(present)
        if fn is None:
            fn = self._compile(present)
        return fn

    def _compile(self, present: tuple[bool, ...]):
        everything = (True,) * len(self.differentiable)
        try:
            start = time.perf_counter()
            run = PipelineRun(self.executors, self.options)
            with self.ambient.applied():
                trace = run.record("backward_split", self.fb.backward_trace(present))
            self.timings["backward_split"] = self.timings.get("backward_split", 0.0) + (
                time.perf_counter() - start) * 1e3
            steps = (*BACKWARD_STEPS, *added_steps(self.executors, self.options, "backward"))
            with compile_mode_set(self.compile_mode), self.ambient.applied():
                fn = run.execution(run.run(steps, trace))
            for k, v in run.timings.items():
                self.timings[f"backward_{k}"] = self.timings.get(f"backward_{k}", 0.0) + v
            self.traces[present], self.steps[present] = run.traces, run.names
        except RuntimeError:  # the saved values do not cover this backward: give the absent outputs zeros
            if present == everything:
                raise
            fn = self._with_zeros(present)
        self.backwards[present] = fn
        self.latest = present if present in self.traces else everything
        return fn

    def last_traces(self) -> list[Trace]:
        """The traces of the backward compiled last; before any backward ran, those of the backward that gets
        every cotangent (compiled now, for inspection)."""
        if self.latest is None:
            self.backward_for((True,) * len(self.differentiable))
        return self.traces[self.latest]

    def last_steps(self) -> list[str]:
        """The names of the steps that built ``last_traces()``, one to one."""
        self.last_traces()
        return self.steps[self.latest]

    def _with_zeros(self, present):
        full = self.backward_for((True,) * len(self.differentiable))
        outs = [self.fb.outputs[i] for i in self.differentiable]

        def backward(saved, cts):
            it = iter(cts)
            filled = [next(it) if p else torch.zeros(tuple(o.shape), dtype=o.dtype, device=str(o.device))
                      for p, o in zip(present, outs)]
            return full(saved, filled)

        return backward


_DOUBLE_BACKWARD = (
    "fulmen: differentiating the gradients of a fulmen-compiled function (double backward: autograd.grad or "
    ".backward() through gradients computed with create_graph=True, gradgradcheck) is not supported: its backward "
    "is a compiled trace, not a graph autograd can differentiate again. Run the part whose higher-order gradients "
    "you need eagerly (without fulmen.jit / torch.compile), or call fulmen.jit on a function that computes the "
    "first gradients itself (fulmen.grad).")


class _NoDoubleBackward(torch.autograd.Function):
    """With ``create_graph=True`` the gradients get this node: differentiating them raises a clear error.

    Its first ``n_anchors`` inputs connect it to everything the gradients depend on (``_anchors``), so that the
    engine reaches it on the way to any of those, also for ``autograd.grad(..., inputs=...)``."""

    @staticmethod
    def forward(ctx, n_anchors, *tensors):
        return tuple(g.view_as(g) for g in tensors[n_anchors:])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_DOUBLE_BACKWARD)


def _anchors(ctx, saved: Sequence, cts: Sequence) -> list[torch.Tensor]:
    """Tensors that require grad through which a graph built now reaches what the gradients of ``ctx``'s node
    depend on: the cotangents, the saved tensors (unpacked, they carry their history), and the function's inputs
    -- leaves as themselves; for an input with a history that no saved tensor reaches, the leaves below it."""
    anchors = [t for t in (*cts, *saved) if isinstance(t, torch.Tensor) and t.requires_grad]
    reached = {(t.grad_fn, t.output_nr) for t in anchors if t.grad_fn is not None}
    if any(node is ctx for node, _ in reached):  # a saved output: its history is this node, which reaches all
        return anchors
    seen: set = set()
    stack = [(node, nr) for node, nr in ctx.next_functions if node is not None and (node, nr) not in reached]
    while stack:
        node, _ = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf itself
        if isinstance(variable, torch.Tensor):
            anchors.append(variable)
        else:
            stack.extend(node.next_functions)
    return anchors


def _as_views(outs: Sequence, views: list[tuple[int, int]], inputs: Sequence) -> list:
    """Outputs that share memory with an input, made views autograd knows of: an executor may return ``x[0]`` as a
    plain tensor over ``x``'s memory, and an in-place update of it must fail as it does in eager, not silently
    change ``x`` behind autograd's back."""
    outs = list(outs)
    for k, j in views:
        o, x = outs[k], inputs[j]
        shared = o.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        if shared and o._base is None and o.dtype == x.dtype:
            outs[k] = x.as_strided(o.size(), o.stride(), o.storage_offset())
    return outs


class FulmenFunction(torch.autograd.Function):
    """Runs a compiled forward; its backward runs the compiled backward trace."""

    @staticmethod
    def forward(ctx, runtime: _Runtime, *inputs):
        if runtime.graphs is None:
            results, pending = runtime.forward(*inputs), None
        else:
            results, pending = runtime.graphs.run(inputs)
        n = runtime.n_outputs
        outs = results[:n]
        if runtime.dirty:
            outs = list(outs)
            for j, k in runtime.dirty:
                outs[k] = inputs[j]  # holds the new value already (prims.copy_ wrote it)
            ctx.mark_dirty(*[inputs[j] for j, _ in runtime.dirty])
        if runtime.views:
            outs = _as_views(outs, runtime.views, inputs)
        ctx.runtime = runtime
        ctx.fulmen_pending = pending  # a CUDA graph replay whose saved tensors the backward still needs
        ctx.save_for_backward(*[results[n + i] for i in runtime.ctx_saved])
        ctx.fulmen_saved = [results[n + i] for i in runtime.list_saved]
        if runtime.non_differentiable:
            ctx.mark_non_differentiable(*[outs[i] for i in runtime.non_differentiable])
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        runtime: _Runtime = ctx.runtime
        stale = runtime.fb.modified_saved
        if stale is not None and any(grads[runtime.differentiable[k]] is not None for k in stale[1]):
            raise RuntimeError(stale[0])
        listed = ctx.fulmen_saved
        if listed is None:
            raise RuntimeError(
                "Trying to backward through the graph a second time (or directly access saved tensors after they "
                "have already been freed). Saved intermediate values of the graph are freed when you call "
                ".backward() or autograd.grad(). Specify retain_graph=True if you need to backward through the "
                "graph a second time or if you need to access saved tensors after calling backward.")
        from_ctx = ctx.saved_tensors
        saved: list[Any] = [None] * runtime.n_saved
        for i, t in zip(runtime.ctx_saved, from_ctx):
            saved[i] = t
        for i, t in zip(runtime.list_saved, listed):
            saved[i] = t
        # create_graph=True: under grad mode the saved tensors come back with their history
        anchors = _anchors(ctx, from_ctx, grads) if torch.is_grad_enabled() else None
        keep = _keep_graph()
        if not keep:
            ctx.fulmen_saved = None
            listed.clear()
        del listed, from_ctx
        cts = [grads[i] for i in runtime.differentiable]
        present = tuple(c is not None for c in cts)
        pending = ctx.fulmen_pending
        if not any(present):
            input_grads = None
        else:
            with torch.no_grad():
                fn = runtime.backward_for(present)
                given = [c for c in cts if c is not None]
                if pending is None:
                    input_grads = call_leaving_a_core(fn, saved, given)
                else:
                    input_grads = runtime.graphs.backward(pending, present, fn, saved, given)
        if pending is not None and not keep:  # the next replay may overwrite the saved tensors now
            pending.release()
        if input_grads is None:
            return (None,) * (1 + runtime.n_inputs)
        given = [g for g in input_grads if g is not None] if anchors else None
        if given:
            wrapped = iter(_NoDoubleBackward.apply(len(anchors), *anchors, *given))
            input_grads = [next(wrapped) if g is not None else None for g in input_grads]
        return (None, *input_grads)


def _output_builder(trace: Trace, fb: ForwardBackward):
    """``build(function outputs, inputs)``: the program's output structure. An input returned unchanged is
    returned itself, as eager returns it (``x.conj()`` of a real ``x``, ``lambda x: x``), not the view
    autograd.Function would make: its gradient then reaches the caller's tensor directly, as in eager. (An input
    updated in place is returned under its new value's name: a dirty output of the function.)"""
    inputs = {a.name: i for i, a in enumerate(trace.args)}
    index = {p.name: i for i, p in enumerate(fb.outputs)}

    def slot(x):
        if isinstance(x, torch.SymInt) and is_symbolic(x):  # n + 1, x.shape[0]: each call's value, from its inputs
            return (None, None, None, symbolic_value(x, trace.args))
        if not isinstance(x, TensorProxy):
            return (None, None, x, None)
        if x.name in inputs:
            return (None, inputs[x.name], None, None)
        return (index[x.name], None, None, None)

    if isinstance(trace.output, TensorProxy) and slot(trace.output)[0] is not None:
        return lambda outs, flat: outs[0]
    # a torch.Size of plain ints is returned as it is: torch's pytree would unflatten it into a plain tuple
    leaves, spec = tree_flatten(trace.output, is_leaf=_concrete_size)
    slots = [slot(x) for x in leaves]

    def build(outs, flat):
        return tree_unflatten([outs[i] if i is not None else flat[j] if j is not None else v if f is None else f(flat)
                               for i, j, v, f in slots], spec)

    return build


def _concrete_size(x: Any) -> bool:
    return type(x) is torch.Size and all(type(d) is int for d in x)


def compile_training(trace: Trace, run: PipelineRun, *, cuda_graphs: str | None = None) -> CompiledProgram:
    """Differentiate ``trace`` (already through the computation steps of ``run``) with respect to its inputs that
    require grad and compile forward and backward (replayed as CUDA graphs, logged under the name ``cuda_graphs``,
    when it is given and the program qualifies: ``fulmen.frontend.cudagraphs``)."""
    executors, timings = run.executors, run.timings
    start = time.perf_counter()
    fb = split_forward_backward(trace, executors)
    elapsed = (time.perf_counter() - start) * 1e3
    if fb is None:  # no output depends on an input that requires grad: nothing to differentiate
        timings["autodiff"] = elapsed
        program = compile_inference(trace, run, cuda_graphs=cuda_graphs)
        run_with_grad = program.run

        def run_without_grad(flat: list) -> Any:
            # as an inference program: kernels that write into given outputs (Inductor's extern mm(out=...)) refuse
            # inputs that require grad while grad mode is on
            with torch.no_grad():
                return run_with_grad(flat)

        program.run = run_without_grad
        return program
    forward = run.execution(run.record("autodiff", fb.forward, elapsed))
    runtime = _Runtime(fb, executors, forward, timings, run.options)
    if cuda_graphs:
        runtime.graphs = graphed(forward, [trace, run.traces[-1]], cuda_graphs, runtime.n_outputs)
    build = _output_builder(trace, fb)
    apply = FulmenFunction.apply
    unreached = fb.unreached

    def run_program(flat: list) -> Any:
        if unreached:
            passed = list(flat)
            for i in unreached:
                passed[i] = passed[i].detach()
            return build(apply(runtime, *passed), flat)
        return build(apply(runtime, *flat), flat)

    return CompiledProgram(forward=forward, traces=run.traces, backward_traces=runtime.last_traces,
                           num_saved=len(fb.saved), output_spec=build, timings_ms=timings,
                           runtime=runtime, run=run_program, steps=run.names)
