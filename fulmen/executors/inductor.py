"""The inductor executor: fuse regions of a trace with PyTorch's Inductor and call the generated code directly.

``fusion_pass`` groups consecutive operations Inductor handles well into regions. Each region becomes one
``FusedRegion`` callable in the execution trace. A region starts out running its operations one by one with
the torch executor; its Inductor compilation runs in a background thread (or right away with
``compile="sync"``) and swaps in when ready, so the first call never waits for a compiler. Inductor's
output code is specialized to its inputs' strides, so a region keeps one compiled variant per stride
pattern it has seen. Inductor's FX graph cache keeps compiled regions on disk for later processes.

Random operations stay outside regions (so results draw from torch's generator exactly as in eager), and
so do side effects and opaque ops.
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from fulmen.core.codegen import compile_trace
from fulmen.core.codeutils import outputs_of
from fulmen.core.proxies import Proxy, TensorProxy
from fulmen.core.symbol import BoundSymbol, OpTags, Symbol
from fulmen.core.trace import Trace
from fulmen.executors.base import FusionExecutor, claim_symbols, get_always_executors, register_executor

log = logging.getLogger("fulmen.inductor")

#: "async" (default): regions compile in the background while the torch executor runs them;
#: "sync": each region compiles before its first call returns (tests, benchmarks).
compile_mode: contextvars.ContextVar[str] = contextvars.ContextVar("fulmen_compile_mode", default="async")

_NOT_FUSED = (OpTags.RANDOM_OP, OpTags.SIDE_EFFECT, OpTags.FALLBACK, OpTags.DEVICE_OP)
MAX_STRIDE_VARIANTS = 4
MIN_REGION_SIZE = 2

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _compile_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fulmen-inductor")
        return _pool


_shutting_down = False


@atexit.register
def _stop_compiling() -> None:
    """At interpreter exit, drop queued compilations instead of starting new ones."""
    global _shutting_down
    _shutting_down = True
    if _pool is not None:
        _pool.shutdown(wait=False, cancel_futures=True)


def pending_compilations() -> int:
    """Region compilations queued or running (0 once every region seen so far is compiled or failed)."""
    return sum(1 for r in ex.regions for f in r.pending.values() if f is not None and not f.done())


def wait_for_compilations(timeout: float | None = None) -> None:
    """Block until every queued region compilation has finished (benchmarks use this)."""
    pool = _pool
    if pool is None:
        return
    done = threading.Event()
    pool.submit(done.set)
    done.wait(timeout)


def _inductor_compile(fn: Callable, example: list[torch.Tensor]) -> Callable:
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*example)
    compiled = compile_fx_inner(gm, example)
    return getattr(compiled, "current_callable", compiled)


class FusedRegion:
    """One fused region: runs eagerly until its Inductor kernel for the current input strides is ready."""

    def __init__(self, name: str, eager: Callable, source: str):
        self.name = name
        self.eager = eager
        self.source = source
        self.variants: dict[tuple, Callable] = {}
        self.pending: dict[tuple, Future | None] = {}
        self.failed = False
        self.compile_seconds = 0.0
        self.mode = compile_mode.get()

    def __call__(self, *args):
        key = tuple(a.stride() for a in args)
        fn = self.variants.get(key)
        if fn is not None:
            return fn(list(args))
        if not self.failed and key not in self.pending and len(self.pending) < MAX_STRIDE_VARIANTS:
            self._schedule(key, args)
            fn = self.variants.get(key)
            if fn is not None:
                return fn(list(args))
        return self.eager(*args)

    def _schedule(self, key: tuple, args: tuple) -> None:
        # example inputs with the same metadata and strides; tracing is fake, so values do not matter
        example = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device) for a in args]
        if self.mode == "sync":
            self.pending[key] = None
            self._compile(key, example)
        else:
            self.pending[key] = _compile_pool().submit(self._compile, key, example)

    def _compile(self, key: tuple, example: list[torch.Tensor]) -> None:
        if _shutting_down:
            return
        start = time.perf_counter()
        try:
            fn = _inductor_compile(self.eager, example)
        except Exception as e:  # keep running the region with the torch executor, and say so
            self.failed = True
            if _shutting_down:  # the interpreter is exiting: nothing will call this region again
                return
            log.warning("fulmen: Inductor could not compile %s (%s: %s); it keeps running with the torch "
                        "executor", self.name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return
        self.compile_seconds += time.perf_counter() - start
        self.variants[key] = fn

    @property
    def ready(self) -> bool:
        return bool(self.variants) or self.failed


def _region_io(region: list[BoundSymbol], later: list[BoundSymbol], trace_outputs: set[str]):
    defined: dict[str, Proxy] = {}
    inputs: dict[str, Proxy] = {}
    for bsym in region:
        for p in bsym.flat_args:
            if p.name not in defined and p.name not in inputs:
                inputs[p.name] = p
        for p in bsym.flat_proxy_outs:
            defined[p.name] = p
    used_later = {p.name for b in later for p in b.flat_args} | trace_outputs
    outputs = [p for name, p in defined.items() if name in used_later]
    return list(inputs.values()), outputs


class InductorExecutor(FusionExecutor):
    """Fuses regions of elementwise, reduction, shape and matmul operations with Inductor."""

    def __init__(self):
        super().__init__("inductor", version=torch.__version__)
        self._count = 0
        self.regions: list[FusedRegion] = []

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        sym = bsym.sym
        if any(t in sym.tags for t in _NOT_FUSED) or sym.executor is not None:
            return False
        if not (sym.is_prim and "torch_impl" in sym.extra) and not sym.extra.get("torch_executable"):
            return False
        return all(isinstance(p, TensorProxy) for p in bsym.flat_proxy_outs) and bool(bsym.flat_proxy_outs)

    def fusion_pass(self, trace: Trace) -> Trace:
        torch_executors = list(get_always_executors())
        outputs = {p.name for p in outputs_of(trace.output)}
        new: list[BoundSymbol] = []
        bsyms = trace.bound_symbols
        i = 0
        while i < len(bsyms):
            if trace.claims.get(id(bsyms[i])) is not self:
                new.append(bsyms[i])
                i += 1
                continue
            j = i
            while j < len(bsyms) and trace.claims.get(id(bsyms[j])) is self:
                j += 1
            region = bsyms[i:j]
            if len(region) < MIN_REGION_SIZE:
                new.extend(self._unfused(trace, region, torch_executors))
            else:
                new.append(self._fuse(trace, region, bsyms[j:], outputs, torch_executors))
            i = j
        out = trace.derive(trace.provenance or "Fusion", new)
        return out

    def _unfused(self, trace: Trace, region: list[BoundSymbol], executors) -> list[BoundSymbol]:
        sub = trace.derive("region", region)
        return claim_symbols(sub, executors).bound_symbols

    def _fuse(self, trace: Trace, region: list[BoundSymbol], later: list[BoundSymbol], trace_outputs: set[str],
              executors: Sequence) -> BoundSymbol:
        inputs, outputs = _region_io(region, later, trace_outputs)
        name = f"inductor_fusion_{self._count}"
        self._count += 1
        sub = trace.derive("region", region)
        sub.fn_name = name
        sub.args = inputs
        sub.output = tuple(outputs)
        claimed = claim_symbols(sub, executors)
        eager, source = compile_trace(claimed)
        fused = FusedRegion(name, eager, source)
        self.regions.append(fused)
        sym = Symbol(name=name, id=name, is_prim=True, is_fusion=True, impl=fused, executor=self)
        return BoundSymbol(sym, tuple(inputs), {}, tuple(outputs), tuple(region))


ex = InductorExecutor()
register_executor(ex)


def fusion_stats() -> dict[str, Any]:
    """How many regions exist, how many are compiled, and the total compile time (for benchmarks)."""
    regions = ex.regions
    return {
        "regions": len(regions),
        "compiled": sum(1 for r in regions if r.variants),
        "failed": sum(1 for r in regions if r.failed),
        "compile_seconds": sum(r.compile_seconds for r in regions),
    }
