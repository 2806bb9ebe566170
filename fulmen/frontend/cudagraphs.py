"""CUDA graphs: a compiled program's forward, and its backward, replayed as one graph launch each.

A small model on a big GPU is bound by the host: a training step of the 4-layer GPT of ``fulmen bench`` launches
hundreds of kernels, each costing Python and driver time, while the GPU finishes its work in less.
A CUDA graph records the launches of one call and replays all of them with one. ``fulmen.jit(model,
cuda_graphs=True)`` turns this on (it is opt-in, like ``torch.compile``'s ``mode="reduce-overhead"``: a graph
keeps its memory between calls, and programs whose inputs move on every call gain nothing).

What is graphed, and when -- anything in doubt runs without the graph, and the log says why:

- A program qualifies when every tensor it touches lives on the same CUDA device, it has no random operation
  and no side effect, it updates no input in place, and its sizes are exact (not dynamic).
- It is captured once no fused region is still compiling and it has run ``WARMUP_CALLS`` times since, so every
  kernel is compiled, loaded and autotuned; one more run on the capture stream warms that stream up.
- Inputs: a tensor found at the same address with the same strides on the calls before the capture is read
  where it lives (parameters, buffers, a batch the caller refills in place); the graph copies every other
  input into a buffer of its own. When a tensor read in place moves, the graph is dropped and captured again,
  copying that input from then on; after ``MAX_CAPTURES`` captures the program stops using graphs.
- Outputs are copied out of the graph's memory, which the next replay overwrites, so nothing the caller keeps
  changes under it.
- Training: the tensors the forward saves for the backward stay in the graph's memory until the backward has
  run. A forward called while an earlier replay's backward is still pending (two forwards, then two backwards)
  runs without the graph. The backward is captured at its first call after a replayed forward, in the same
  memory pool, and its gradients are copied out before autograd accumulates them.
- Memory: a graph keeps the tensors its forward saves and its gradients between calls, and cuBLAS keeps a
  workspace for the capture stream (32 MiB on Hopper) on each thread that captures, so a graphed training step
  holds more memory than eager (figures: docs/performance.md, "CUDA graphs").
- A capture that fails (a host synchronization such as ``.item()``, an operation CUDA graphs cannot record)
  is logged, and the program runs without graphs from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from fulmen.core.draws import is_draw
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags
from fulmen.core.trace import Trace
from fulmen.executors.inductor_compile import pending_compilations

log = logging.getLogger("fulmen")

#: Calls without the graph, after every fused region is compiled, before the capture.
WARMUP_CALLS = 2
#: Captures of one program (a new one each time an input read in place moves) before it stops using graphs.
MAX_CAPTURES = 3

_stats = {"captures": 0, "replays": 0, "ungraphed_calls": 0, "failed_captures": 0}


def graph_stats() -> dict[str, int]:
    """Process-wide counters: graphs captured (forward and backward), replays, calls of graphed programs that
    ran without their graph, and captures that failed."""
    return dict(_stats)


def why_not_graphed(traces: list[Trace]) -> str | None:
    """Why these traces (the computation trace and a program's execution trace) cannot be replayed as a CUDA
    graph, or None when they can."""
    if any(t.has_mutations for t in traces):
        return "it updates an input in place"
    devices = set()
    for trace in traces:
        for p in trace.args:
            if isinstance(p, TensorProxy):
                devices.add(str(p.device))
        stack = list(trace.bound_symbols)
        while stack:
            bsym = stack.pop()
            # an operation that may draw (attention with dropout) draws only if its decomposition does
            if is_draw(bsym):
                return f"it draws random numbers ({bsym.sym.name})"
            if OpTags.SIDE_EFFECT in bsym.sym.tags:
                return f"it has a side effect ({bsym.sym.name})"
            if OpTags.COMMUNICATION in bsym.sym.tags:  # a start hands its wait a work object: not captured
                return f"it communicates with other processes ({bsym.sym.name})"
            for p in (*bsym.flat_args, *bsym.flat_proxy_outs):
                if isinstance(p, TensorProxy):
                    devices.add(str(p.device))
            stack.extend(bsym.subsymbols)
    if len(devices) != 1 or not next(iter(devices)).startswith("cuda"):
        return f"its tensors are not all on one CUDA device ({', '.join(sorted(devices)) or 'no tensors'})"
    return None


def graphed(forward: Callable, traces: list[Trace], name: str, n_outputs: int | None) -> GraphedProgram | None:
    """``forward`` wrapped to replay as CUDA graphs, or None (and a warning) when its traces do not qualify."""
    reason = why_not_graphed(traces)
    if reason is not None:
        log.warning("fulmen: %s runs without CUDA graphs: %s", name, reason)
        return None
    return GraphedProgram(forward, name, n_outputs)


def _layout(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.stride()


class _Pending:
    """A replayed forward whose saved tensors (in the graph's memory) the backward still needs. It is released
    by the backward that frees them, or when autograd drops the graph."""

    __slots__ = ("owner", "generation", "released")

    def __init__(self, owner: GraphedProgram, generation: int):
        self.owner = owner
        self.generation = generation
        self.released = False
        owner.pending += 1

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.owner.pending -= 1

    def __del__(self):
        self.release()


class _Capture:
    """One captured forward: its graph, the buffers it reads and writes, and the backwards captured after it."""

    def __init__(self, graph, pool, stream, static_inputs, static_results, copied: set[int]):
        self.graph = graph
        self.pool = pool
        self.stream = stream
        self.static_inputs = static_inputs
        self.static_results = static_results
        # what each replay checks (the layouts of the inputs read in place) and does (copy the others in)
        self.read_in_place = [(i, _layout(t)) for i, t in enumerate(static_inputs) if i not in copied]
        self.copy_into = [(i, static_inputs[i]) for i in sorted(copied)]
        self.input_index = {id(t): i for i, t in enumerate(static_inputs)}  # an input returned as it is
        self.backwards: dict[tuple, Any] = {}  # present cotangents -> (graph, static cotangents, static grads)


class GraphedProgram:
    """Runs ``forward(*inputs)`` (and, for training, the backward functions given to ``backward``) as CUDA graphs.

    ``n_outputs``: how many leading results are the program's outputs (copied out); the rest are saved for the
    backward and stay in the graph's memory. For inference, ``n_outputs`` is None and the whole result (any
    structure of tensors) is copied out.
    """

    def __init__(self, forward: Callable, name: str, n_outputs: int | None):
        self.forward = forward
        self.name = name
        self.n_outputs = n_outputs
        self.copied: set[int] = set()  # inputs copied into the graph's buffers on every replay
        self.layouts: list[tuple] | None = None
        self.moved: set[int] = set()  # inputs whose address or strides changed during the warm-up
        self.ready_calls = 0
        self.captures = 0
        self.current: _Capture | None = None
        self.generation = 0
        self.pending = 0
        self.disabled = False
        self.backward_disabled = False

    # ---- forward ----
    def run(self, inputs: tuple) -> tuple[Any, _Pending | None]:
        """The forward's results, and for training a ``_Pending`` when they come from the graph (else None)."""
        cap = self.current
        if cap is not None:
            if self.pending == 0:
                if self._in_place(cap, inputs):
                    return self._replay(cap, inputs)
            _stats["ungraphed_calls"] += 1
            return self.forward(*inputs), None
        if self.disabled or not self._warm(inputs):
            if not self.disabled:
                _stats["ungraphed_calls"] += 1
            return self.forward(*inputs), None
        return self._capture(inputs)

    def _in_place(self, cap: _Capture, inputs: tuple) -> bool:
        moved = [i for i, layout in cap.read_in_place if _layout(inputs[i]) != layout]
        if not moved:
            return True
        self._drop(f"input {moved[0]} moved")
        self.moved.update(moved)
        self.layouts = None
        return False

    def _warm(self, inputs: tuple) -> bool:
        """Count a call without the graph; True when the program is ready to be captured on this call."""
        layouts = [_layout(t) for t in inputs]
        if self.layouts is not None:
            self.moved.update(i for i, (a, b) in enumerate(zip(layouts, self.layouts)) if a != b)
        self.layouts = layouts
        if pending_compilations():
            self.ready_calls = 0
            return False
        self.ready_calls += 1
        return self.ready_calls > WARMUP_CALLS

    def _capture(self, inputs: tuple):
        if self.captures >= MAX_CAPTURES:
            self._disable(f"its inputs kept moving after {self.captures} captures")
            return self.forward(*inputs), None
        copied = set(self.moved) | self.copied
        overlapping = [i for i in sorted(copied) if not _dense(inputs[i])]
        if overlapping:  # no buffer can hold a copy with the same strides
            self._disable(f"input {overlapping[0]} moves between calls and overlaps itself in memory")
            return self.forward(*inputs), None
        stream = _capture_stream(inputs[0].device if inputs else torch.device("cuda"))
        try:
            static_inputs = tuple(_buffer_like(t) if i in copied else t for i, t in enumerate(inputs))
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm the capture stream up (cuBLAS workspaces, lazy loads)
                self.forward(*static_inputs)
            torch.cuda.current_stream().wait_stream(stream)
            if pending_compilations():  # the warm-up met a new kernel: capture once it is compiled
                self.ready_calls = 0
                return self.forward(*inputs), None
            pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                static_results = self.forward(*static_inputs)
        except Exception as e:
            _stats["failed_captures"] += 1
            _recover(stream)
            self._disable(_describe(e))
            return self.forward(*inputs), None
        self.copied = copied
        self.current = _Capture(graph, pool, stream, static_inputs, static_results, copied)
        self.captures += 1
        self.generation += 1
        _stats["captures"] += 1
        log.debug("fulmen: captured a CUDA graph of %s (%d of %d inputs copied on each replay)", self.name,
                  len(copied), len(inputs))
        return self._replay(self.current, inputs)

    def _replay(self, cap: _Capture, inputs: tuple):
        for i, buffer in cap.copy_into:
            buffer.copy_(inputs[i])
        cap.graph.replay()
        _stats["replays"] += 1
        results = cap.static_results
        if self.n_outputs is None:  # inference: hand back copies (an input returned as it is stays itself)
            index = cap.input_index
            return tree_map_only(torch.Tensor, lambda t: inputs[index[id(t)]] if id(t) in index else t.clone(),
                                 results), None
        n = self.n_outputs
        outs = [r.clone() if isinstance(r, torch.Tensor) else r for r in results[:n]]
        return (*outs, *results[n:]), _Pending(self, self.generation)

    # ---- backward ----
    def backward(self, pending: _Pending, present: tuple, fn: Callable, saved: list, cts: list):
        """The backward of a replayed forward: ``fn(saved, cts)`` as a graph (captured on its first call). The
        caller releases ``pending`` once the saved tensors may be overwritten."""
        cap = self.current
        captured = None
        if cap is not None and pending.generation == self.generation and not self.backward_disabled:
            captured = cap.backwards.get(present)
            if captured is None and not pending_compilations():
                captured = self._capture_backward(cap, present, fn, cts)
        if captured is None:
            _stats["ungraphed_calls"] += 1
            return fn(saved, cts)
        graph, static_cts, static_grads = captured
        for s, c in zip(static_cts, cts):
            s.copy_(c)
        graph.replay()
        _stats["replays"] += 1
        return [g.clone() if isinstance(g, torch.Tensor) else g for g in static_grads]

    def _capture_backward(self, cap: _Capture, present: tuple, fn: Callable, cts: list):
        saved = list(cap.static_results[self.n_outputs:])
        stream = cap.stream
        try:
            static_cts = [_buffer_like(c) for c in cts]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn(list(saved), list(static_cts))
            torch.cuda.current_stream().wait_stream(stream)
            if pending_compilations():  # the warm-up met a new kernel: capture once it is compiled
                return None
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=cap.pool, stream=stream, capture_error_mode="thread_local"):
                static_grads = fn(list(saved), list(static_cts))
        except Exception as e:
            _stats["failed_captures"] += 1
            _recover(stream)
            self.backward_disabled = True
            log.warning("fulmen: the backward of %s runs without a CUDA graph: %s", self.name, _describe(e))
            return None
        _stats["captures"] += 1
        cap.backwards[present] = (graph, static_cts, static_grads)
        return cap.backwards[present]

    # ---- giving up ----
    def _drop(self, reason: str) -> None:
        log.info("fulmen: dropping the CUDA graph of %s (%s); it is captured again", self.name, reason)
        self.current = None
        self.ready_calls = 0

    def _disable(self, reason: str) -> None:
        self.current = None
        self.disabled = True
        log.warning("fulmen: %s runs without CUDA graphs: %s", self.name, reason)


_streams: dict[torch.device, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream each device captures on. cuBLAS keeps a workspace (32 MiB on Hopper) for every stream and
    thread that runs a matmul, for as long as the process lives; one capture stream keeps that to one more per
    thread (the main one, which captures forwards, and autograd's, which captures backwards)."""
    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device=device)
    return stream


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory exactly once in some order of its dimensions (what a buffer
    created with ``empty_strided(t.size(), t.stride())`` can hold a copy of)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.size(), t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _buffer_like(t: torch.Tensor) -> torch.Tensor:
    """A buffer holding a copy of ``t``, with its strides where no two elements share memory (a cotangent
    expanded from a scalar gets a dense buffer)."""
    if _dense(t):
        buf = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    else:
        buf = torch.empty(t.size(), dtype=t.dtype, device=t.device)
    buf.copy_(t)
    return buf


def _recover(stream) -> None:
    """Undo what a failed capture leaves behind. PyTorch ends a capture's bookkeeping of the random generators
    only when the capture succeeds; until a capture does, every random draw outside graphs fails ("Offset
    increment outside graph capture encountered unexpectedly"). An empty capture ends it."""
    try:
        torch.cuda.synchronize()
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream, capture_error_mode="thread_local"):
            pass
    except Exception as e:  # the program still runs without graphs; say what may be left broken
        log.warning("fulmen: could not reset CUDA's graph-capture state after a failed capture (%s); random "
                    "operations may fail from now on", _describe(e))


def _describe(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
