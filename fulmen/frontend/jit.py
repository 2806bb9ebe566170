"""``fulmen.jit``: trace on first call, compile, cache by what the program depends on, call fast after."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fulmen.core.trace import Trace
from fulmen.executors.base import Executor, resolve_executors
from fulmen.frontend.cache import args_key, global_state_key
from fulmen.frontend.compile import CompiledProgram, compile_inference
from fulmen.frontend.tracing import InputSpec, trace_program
from fulmen.transforms.autocast import current_policies

log = logging.getLogger("fulmen")

#: How many distinct compilations of one function before fulmen warns that recompiles repeat.
RECOMPILE_WARNING_THRESHOLD = 8


@dataclass
class CacheEntry:
    program: CompiledProgram
    spec: InputSpec
    computation_trace: Trace
    prologue: Trace | None = None


@dataclass
class CompileStats:
    """What ``fulmen.compile_stats(f)`` returns: counters, per-phase times and the last traces."""

    cache_hits: int = 0
    cache_misses: int = 0
    calls: int = 0
    last_trace_time_ms: float = 0.0
    last_compile_time_ms: float = 0.0
    phase_times_ms: dict[str, float] = field(default_factory=dict)
    last_traces: list[Trace] = field(default_factory=list)
    last_backward_traces: list[Trace] = field(default_factory=list)
    last_prologue_traces: list[Trace] = field(default_factory=list)
    last_recompile_reason: str | None = None


class JittedFunction:
    """A function compiled by ``fulmen.jit``; call it like the original."""

    def __init__(self, fn: Callable, executors: Sequence[Executor | str] | None = None, *,
                 add_torch_executor: bool = True, disable_torch_autograd: bool = False, **options):
        if not callable(fn):
            raise TypeError(f"fulmen.jit expects a function or an nn.Module, but got {type(fn).__name__}")
        if options:
            raise TypeError(f"fulmen.jit got unexpected keyword argument(s) {sorted(options)}; it accepts executors=, "
                            "add_torch_executor= and disable_torch_autograd=")
        self.fn = fn
        # add_torch_executor=False keeps exactly the executors given (the seeds' fulmen.compile form);
        # a symbol none of them can run then fails with "Could not find executor for bound symbol ...".
        self.executors = resolve_executors(executors, add_always=add_torch_executor)
        self.disable_torch_autograd = disable_torch_autograd
        self._cache: dict[Any, CacheEntry] = {}
        self._stats = CompileStats()
        self._last_key = None
        functools.update_wrapper(self, fn, updated=())

    # ---- the call path (keep it short: it runs on every call) ----
    def __call__(self, *args, **kwargs):
        flat: list[torch.Tensor] = []
        key = (args_key(args, kwargs, flat), global_state_key())
        entry = self._cache.get(key)
        stats = self._stats
        stats.calls += 1
        if entry is None:
            entry = self._compile(key, args, kwargs)
        else:
            stats.cache_hits += 1
        if entry.spec.captured:
            flat += entry.spec.captured
        return entry.program.run(flat)

    def _needs_grad(self, flat_proxies) -> bool:
        return (not self.disable_torch_autograd) and torch.is_grad_enabled() and any(
            p.requires_grad for p in flat_proxies)

    def _trace(self, args, kwargs) -> tuple[Trace, InputSpec]:
        return trace_program(self.fn, args, kwargs)

    def _compile(self, key, args, kwargs) -> CacheEntry:
        stats = self._stats
        stats.cache_misses += 1
        if self._cache:
            stats.last_recompile_reason = _describe_key_change(self._last_key, key)
            if len(self._cache) >= RECOMPILE_WARNING_THRESHOLD:
                log.warning("fulmen: %s has been compiled %d times; the latest recompile was caused by %s",
                            getattr(self.fn, "__name__", self.fn), len(self._cache) + 1,
                            stats.last_recompile_reason)
        start = time.perf_counter()
        autocast_devices = [p.device_type for p in current_policies()]
        trace, spec = self._trace(args, kwargs)
        # executors may rewrite the computation trace before autodiff (fused_linear_ce replaces linear followed by
        # cross_entropy with one symbol whose gradient is computed chunk by chunk)
        for ex in self.executors:
            transform = getattr(ex, "transform_trace", None)
            if transform is not None:
                trace = transform(trace)
        traced = time.perf_counter()
        if self._needs_grad(spec.tensor_proxies):
            from fulmen.frontend.training import compile_training

            program = compile_training(trace, self.executors)
        else:
            program = compile_inference(trace, self.executors)
        if autocast_devices:
            program.run = _without_autocast(program.run, autocast_devices)
        done = time.perf_counter()
        entry = CacheEntry(program=program, spec=spec, computation_trace=trace,
                           prologue=_prologue_trace(trace, key))
        self._cache[key] = entry
        self._last_key = key
        stats.last_trace_time_ms = (traced - start) * 1e3
        stats.last_compile_time_ms = (done - start) * 1e3
        stats.phase_times_ms = {"trace": stats.last_trace_time_ms, **program.timings_ms}
        stats.last_traces = [trace, *program.traces[1:]] if program.traces else [trace]
        stats.last_backward_traces = list(program.backward_traces)
        stats.last_prologue_traces = [entry.prologue] if entry.prologue is not None else []
        return entry


def _without_autocast(run: Callable, device_types: list[str]) -> Callable:
    """The trace already holds autocast's casts; running it under autocast again would cast twice."""

    def run_without_autocast(flat):
        with contextlib.ExitStack() as stack:
            for device_type in device_types:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            return run(flat)

    return run_without_autocast


def _describe_key_change(old, new) -> str:
    if old is None:
        return "a first call"
    (old_args, old_state), (new_args, new_state) = old, new
    if old_state != new_state:
        names = ["grad mode", "default dtype", "CPU autocast", "CUDA autocast", "CPU autocast dtype",
                 "CUDA autocast dtype"]
        changed = [n for n, a, b in zip(names, old_state, new_state) if a != b]
        return "a change of " + ", ".join(changed)
    if len(old_args) == 4 and len(new_args) == 4 and isinstance(old_args[0], tuple) and all(
            isinstance(v, bool) for v in old_args[0]):  # a module: (training flags, identities, state, arguments)
        parts = ("a submodule's train/eval mode", "a parameter or buffer was replaced",
                 "a parameter or buffer changed shape, dtype, device or requires_grad")
        for part, a, b in zip(parts, old_args[:3], new_args[:3]):
            if a != b:
                return part
        old_args, new_args = old_args[3], new_args[3]
    if len(old_args) != len(new_args):
        return f"a different number of arguments ({len(old_args)} -> {len(new_args)})"
    for i, (a, b) in enumerate(zip(old_args, new_args)):
        if a != b:
            return f"argument {i} changed from {_short(a)} to {_short(b)}"
    return "a changed argument"


def _short(k) -> str:
    text = repr(k)
    return text if len(text) < 120 else text[:117] + "..."


def _prologue_trace(trace: Trace, key) -> Trace:
    """A readable record of what a later call must match to reuse this compilation."""
    from fulmen.core.symbol import Symbol

    pro = Trace("prologue")
    pro.args = list(trace.args)
    check = Symbol(name="check_tensor_metadata", id="check_tensor_metadata", is_prim=True, module="prologue")
    for p in trace.args:
        pro.bound_symbols.append(check.bind(p, tuple(p.shape), str(p.device), p.dtype, p.requires_grad,
                                            output=None))
    state = Symbol(name="check_global_state", id="check_global_state", is_prim=True, module="prologue")
    grad, default_dtype, cpu_ac, cuda_ac, *_ = key[1]
    pro.bound_symbols.append(state.bind(output=None, grad_enabled=grad, default_dtype=default_dtype,
                                        autocast_cpu=cpu_ac, autocast_cuda=cuda_ac))
    pro.provenance = "Prologue (what a call must match to reuse the compiled program)"
    return pro


def get_stats(fn) -> CompileStats:
    target = getattr(fn, "_fulmen_jitted", fn)
    stats = getattr(target, "_stats", None)
    if stats is None:
        raise TypeError(f"{type(fn).__name__} was not compiled by fulmen.jit; there are no traces or statistics "
                        "for it")
    return stats
