"""What a benchmark's training step is made of, beside its time: how many compiled calls it makes, how long the host
takes to issue it, and how long the device computes.

Issue 46 asks why fulmen's step is slower or faster than ``torch.compile``'s; a step time alone cannot say. A step
bound by the host (Python, dispatch, kernel launches) runs as long as the host takes to issue it whatever the
kernels are, and one bound by the device runs as long as its kernels. So ``fulmen bench`` rows record:

- ``calls_per_step``: fulmen's fused regions and its other calls, forward and backward (from the execution traces:
  each of their lines runs once a step); for ``torch.compile``, the graphs Dynamo compiled (one forward and one
  backward call each, without graph breaks);
- ``host_ms`` and ``host_cpu_ms``: the median time until the step's Python returned (on CUDA, before the final
  synchronization: the device may still be working) and the thread's CPU time in it;
- ``device_busy_ms``: on CUDA, the kernels' time in one step (the profiler's self CUDA time, two steps averaged).
  ``median_ms`` minus it is the time the device waited for the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def timed_step(step: Callable[[], Any], device: torch.device) -> tuple[float, float, float]:
    """(wall seconds of the whole step, wall seconds until its Python returned, the thread's CPU seconds in it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0, c0 = time.perf_counter(), time.thread_time()
    step()
    host, cpu = time.perf_counter() - t0, time.thread_time() - c0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, host, cpu


def calls_per_step(backend: str, wrapped: Any) -> dict[str, int] | None:
    """The compiled calls of one step (see the module's doc); None for eager or when nothing was compiled."""
    if backend.startswith("fulmen"):
        return _fulmen_calls(wrapped)
    if backend.startswith("torch.compile"):
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        return {"graphs": graphs} if graphs else None
    return None


def _fulmen_calls(wrapped: Any) -> dict[str, int] | None:
    import fulmen
    from fulmen.core.bookkeeping import is_bookkeeping

    found: dict[str, int] = {}
    try:
        parts = {"forward": fulmen.last_traces(wrapped), "backward": fulmen.last_backward_traces(wrapped)}
    except (TypeError, ValueError, RuntimeError):  # not compiled by fulmen.jit (the Dynamo backend), or no trace
        return None
    for part, traces in parts.items():
        if not traces:
            continue
        ops = [b for b in traces[-1].bound_symbols if not is_bookkeeping(b)]
        regions = sum(1 for b in ops if b.sym.is_fusion)
        found[f"{part}_regions"] = regions
        found[f"{part}_other_calls"] = len(ops) - regions
    return found or None


def device_busy_ms(step: Callable[[], Any], device: torch.device, steps: int = 2) -> float | None:
    """On CUDA, the milliseconds the device spends in kernels during one step (``steps`` profiled, averaged);
    None elsewhere or where the profiler records no device time."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize(device)
        busy_us = sum(e.self_device_time_total for e in prof.key_averages())
    except RuntimeError:  # the profiler could not attach to the device (CUPTI): the row keeps its other figures
        return None
    return busy_us / 1e3 / steps if busy_us else None
