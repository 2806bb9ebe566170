"""A training program's first call on PyTorch autograd; fulmen's own forward and backward from the second call.

Differentiating a trace and preparing its backward (autodiff, the forward/backward split, fusion of both traces)
is most of what a first training call costs on top of eager (figures: docs/performance.md, "First call"). When
every operation
of the computation trace is a torch callable that PyTorch's autograd differentiates exactly as it does in eager,
the first call runs the trace with the torch executor under PyTorch autograd instead -- the operations eager
runs, in eager's order, with eager's gradients. The second call compiles the forward and backward program (its
fused regions then compile as usual) and runs it from then on; asking for the traces or the statistics compiles
it at once.

It applies only where nothing can differ from eager:

- the ``warm_start`` option is on (``fulmen.core.options``; ``FULMEN_WARM_START=0`` turns it off);
- the compile mode is "async", the default (with "sync" every call runs the compiled program, and with "off",
  which the test suite uses, every call runs fulmen's own forward and backward);
- the executors are the default ones (the torch executor and Inductor's fusion) and no pipeline step was added:
  any other executor may claim operations, and a step may rewrite them, which the first call would then not use;
- every operation runs as its torch callable (a torch-language symbol declared ``torch_executable`` or an opaque
  torch op), was not recorded under ``torch.no_grad()``, and has no grad rule registered by the user;
- the trace mutates no input in place;
- it has no ``torch.utils.checkpoint`` region: PyTorch autograd would save everything the region computes, and a
  program checkpointed to fit in memory must not need more at its first step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from fulmen.core.ambient import Ambient
from fulmen.core.options import JitOptions
from fulmen.core.symbol import BoundSymbol, OpTags
from fulmen.core.trace import Trace
from fulmen.executors import inductor, torchex
from fulmen.executors.base import Executor
from fulmen.executors.inductor_compile import compile_mode, compile_mode_set
from fulmen.frontend.compile import CompiledProgram, PipelineRun, compile_inference, computation_steps
from fulmen.transforms import linearize

log = logging.getLogger("fulmen")

_DEFAULT_EXECUTORS = (torchex.ex, inductor.ex)


def applies(trace: Trace, executors: Sequence[Executor], options: JitOptions) -> bool:
    """Whether ``trace``'s first call may run on PyTorch autograd (the conditions in the module docstring)."""
    if not options.warm_start or compile_mode.get() != "async" or trace.has_mutations or trace.checkpoint_regions:
        return False
    if any(ex not in _DEFAULT_EXECUTORS for ex in executors) or options.steps:
        return False
    return all(differentiated_as_in_eager(bsym) for bsym in trace.bound_symbols)


def differentiated_as_in_eager(bsym: BoundSymbol) -> bool:
    """Whether PyTorch autograd differentiates ``bsym`` run by the torch executor as eager does: a torch callable run
    as it is, not recorded under ``torch.no_grad()``, with no grad rule of the user's."""
    sym = bsym.sym
    if bsym.no_grad or linearize.has_user_rule(sym):
        return False
    as_torch = sym.torch_executable and sym.torch_fns and sym.id not in torchex.ex.implmap
    return bool(as_torch or OpTags.FALLBACK in sym.tags)


def deferred_training(trace: Trace, options: JitOptions, compile_training: Callable[[], CompiledProgram],
                      on_ready: Callable[[CompiledProgram], None]) -> CompiledProgram:
    """A program whose first call runs ``trace`` under PyTorch autograd; ``compile_training()`` builds the real one
    at the second call (or at ``program.settle()``) and hands it to ``on_ready(real)``, which puts it in
    the cache in this program's place; a call that still holds this program runs the real one from then on.
    This program itself is never changed: its traces stay those of the first call's."""
    run = PipelineRun([torchex.ex], options)
    start = time.perf_counter()
    warm = compile_inference(computation_steps(trace, run), run)  # no grad mode of its own: PyTorch records it
    timings = {"warm_start": (time.perf_counter() - start) * 1e3}
    mode = compile_mode.get()
    ambient = Ambient.capture()  # settle may run under other defaults (asking for the traces)
    real: CompiledProgram | None = None
    warm_ran = False
    lock = threading.RLock()  # threads whose calls settle at once compile once; calls after that take no lock

    def settle() -> CompiledProgram:
        nonlocal real
        with lock:
            if real is None:
                with compile_mode_set(mode), ambient.applied():
                    compiled = compile_training()
                compiled.timings_ms = {**timings, **compiled.timings_ms}
                log.debug("fulmen: compiled the forward and backward of %s after its first call ran on PyTorch "
                          "autograd", trace.fn_name)
                real = compiled  # last: a call that reads it on another thread finds the program complete
                on_ready(real)
        return real

    def run_program(flat: list) -> Any:
        nonlocal warm_ran
        if real is not None:
            return real.run(flat)
        if not warm_ran:
            warm_ran = True
            return warm.run(flat)
        return settle().run(flat)

    return CompiledProgram(forward=warm.forward, traces=warm.traces, steps=warm.steps, timings_ms=timings,
                           run=run_program, backward_traces=lambda: settle().backward_traces(),
                           settle=settle)
