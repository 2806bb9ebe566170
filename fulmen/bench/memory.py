"""Peak memory of one benchmark step, measured honestly on CUDA and on CPU.

CUDA: ``torch.cuda.max_memory_allocated`` over the timed steps (reset just before them). It counts every
tensor alive at the peak, weights, gradients and optimizer state included; cached-but-free allocator blocks
are not counted.

CPU: PyTorch keeps no peak counter for the CPU allocator, so one extra steady-state step runs under
``torch.profiler.profile(profile_memory=True)``, which records every allocation and free made through
PyTorch's CPU allocator (by any thread, including Inductor-generated code, which allocates through it).
The peak is the bytes of the tensors the benchmark holds when the step starts (parameters, buffers,
gradients, optimizer state, inputs; each storage counted once) plus the highest running total of
allocations minus frees during the step. Memory that bypasses PyTorch's allocator (oneDNN scratch space,
Python objects) is not counted.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator

import torch

CUDA_METHOD = "torch.cuda.max_memory_allocated over the timed steps"
CPU_METHOD = "live state + peak net CPU-allocator bytes in one step (torch.profiler profile_memory)"


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or key == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total



def saved_tensors(out: torch.Tensor) -> list[torch.Tensor]:
    """The tensors fulmen's autograd nodes on ``out``'s history keep for the backward."""
    found, stack, seen = [], [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if hasattr(node, "fulmen_saved"):
            found += [t for t in (*node.saved_tensors, *(node.fulmen_saved or ())) if isinstance(t, torch.Tensor)]
        stack += [n for n, _ in node.next_functions]
    return found

def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, inputs: tuple) -> list:
    tensors: list[torch.Tensor] = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    tensors += [x for x in inputs if isinstance(x, torch.Tensor)]
    return tensors


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (C++ warnings and banners) while the block runs."""
    try:
        fd = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


def cpu_step_peak_bytes(step: Callable[[], object]) -> int:
    """The highest net bytes allocated through PyTorch's CPU allocator while ``step()`` runs."""
    from torch.profiler import ProfilerActivity, profile

    # Kineto prints banners, and the CPU allocator warns about blocks freed that were allocated before
    # profiling started (expected here: the step frees the previous step's gradients).
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return peak
