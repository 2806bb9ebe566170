"""What ``fulmen.compile_stats(f)`` returns: a jitted function's counters, phase times and last traces."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fulmen.core.trace import Trace


@dataclass
class CompileStats:
    """What ``fulmen.compile_stats(f)`` returns: counters, per-phase times and the last traces."""

    cache_hits: int = 0
    cache_misses: int = 0
    calls: int = 0
    last_trace_time_ms: float = 0.0
    last_prologue_traces: list[Trace] = field(default_factory=list)
    recompile_reasons: list[str] = field(default_factory=list)  # why each compilation after the first happened
    _last_compile_time_ms: float = 0.0
    _phase_times_ms: dict[str, float] = field(default_factory=dict)
    _last_traces: list[Trace] = field(default_factory=list)
    _last_steps: list[str] = field(default_factory=list)
    _backward_traces: Callable[[], list[Trace]] | None = None
    _backward_steps: Callable[[], list[str]] | None = None
    _settle: Callable[[], Any] | None = None  # compiles a program whose first call ran on PyTorch autograd
    _deferred: int = 0  # programs whose first call ran on PyTorch autograd, not compiled yet

    @property
    def last_recompile_reason(self) -> str | None:
        return self.recompile_reasons[-1] if self.recompile_reasons else None

    def __repr__(self) -> str:
        """A short table: counters, then the last compilation's time per phase (the traces are left out: they
        are ``last_traces`` and friends). Reading it compiles nothing."""
        rows = [
            ("calls", f"{self.calls}"),
            ("cache hits", f"{self.cache_hits}"),
            ("cache misses", f"{self.cache_misses}"),
        ]
        if self.last_recompile_reason is not None:
            rows.append(("last recompile", self.last_recompile_reason))
        if self._settle is not None:
            rows.append(("note", "the first call ran on PyTorch autograd; fulmen's program compiles at the next"))
        rows += [(f"{phase} ms", f"{ms:.2f}") for phase, ms in self._phase_times_ms.items()]
        rows.append(("traces", f"{len(self._last_traces)} (fulmen.last_traces(f))"))
        width = max(len(name) for name, _ in rows)
        return "CompileStats(\n" + "".join(f"  {name:<{width}}  {value}\n" for name, value in rows) + ")"

    @property
    def pending_compilations(self) -> int:
        """Compilations not finished: this function's programs whose first call ran on PyTorch autograd and that
        compile at their next call (``fulmen.frontend.warm_start``), plus the fused regions queued or compiling in
        the background, across the process."""
        from fulmen.executors.inductor_compile import pending_compilations

        return self._deferred + pending_compilations()

    def _settled(self) -> CompileStats:
        if self._settle is not None:
            self._settle()  # records the compiled program's traces and times here, and clears _settle
        return self

    @property
    def last_compile_time_ms(self) -> float:
        return self._settled()._last_compile_time_ms

    @property
    def phase_times_ms(self) -> dict[str, float]:
        return self._settled()._phase_times_ms

    @property
    def last_traces(self) -> list[Trace]:
        """The traces of the last compilation, computation trace first, execution trace last."""
        return self._settled()._last_traces

    @property
    def last_trace_steps(self) -> list[str]:
        """The names of the pipeline steps that built ``last_traces``, one to one ("trace": the computation
        trace; ``fulmen.frontend.compile``)."""
        return self._settled()._last_steps

    @property
    def last_backward_trace_steps(self) -> list[str]:
        """The names of the steps that built ``last_backward_traces``, one to one."""
        self._settled()
        return list(self._backward_steps()) if self._backward_steps is not None else []

    @property
    def last_backward_traces(self) -> list[Trace]:
        """The last compilation's backward traces: those of the backward that ran last (before any backward ran,
        the backward for every output is compiled to show them). Empty when nothing is differentiated."""
        self._settled()
        return list(self._backward_traces()) if self._backward_traces is not None else []


def get_stats(fn) -> CompileStats:
    target = getattr(fn, "_fulmen_jitted", fn)
    stats = getattr(target, "_stats", None)
    if stats is None:
        raise TypeError(f"{type(fn).__name__} was not compiled by fulmen.jit; there are no traces or statistics for it")
    return stats
