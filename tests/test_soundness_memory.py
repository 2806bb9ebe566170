"""No memory growth on the cache-hit path: 10,000 calls of a compiled function (and of a compiled module with a
backward each call) allocate nothing that stays alive.

Measured after a warm-up (compilation, first-call caches) with tracemalloc, which sees every Python-level allocation,
and with the number of objects the garbage collector tracks (tensors among them, so a leaked tensor shows there).
The bounds are tens of KiB and 50 objects for the whole 10,000 calls: one object leaked per call fails.
"""

from __future__ import annotations

import gc
import tracemalloc

import torch
from torch import nn

import fulmen

CALLS = 10_000
# What the 10,000 calls may leave behind in total. The smallest Python object is 16-24 bytes, so one leaked per call
# is 160 KiB or more; PyTorch's autograd recycles buffers of its own, whose count at any moment moves by a few
# hundred blocks (tens of KiB) whatever the number of calls.
MAX_GROWTH_BYTES = 64 * 1024
MAX_GROWTH_OBJECTS = 50


def _growth(step, warmup: int = 500) -> tuple[int, int]:
    """Bytes and gc-tracked objects added by ``CALLS`` calls of ``step``. The warm-up runs under tracemalloc too:
    memory allocated before tracing starts and recycled later (free lists, autograd's buffers) would otherwise
    count as new."""
    for _ in range(warmup):
        step()
    tracemalloc.start()
    try:
        for _ in range(warmup):
            step()
        gc.collect()
        objects_before = len(gc.get_objects())
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(CALLS):
            step()
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
        objects_after = len(gc.get_objects())
    finally:
        tracemalloc.stop()
    return after - before, objects_after - objects_before


def test_cache_hits_of_a_function_do_not_grow_memory():
    def f(x, y, scale: float):
        return torch.relu(x @ y) * scale + x.sum(-1, keepdim=True)

    jitted = fulmen.jit(f, executors=["torch"])
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    jitted(x, y, 0.5)
    hits = fulmen.cache_hits(jitted)
    grew_bytes, grew_objects = _growth(lambda: jitted(x, y, 0.5))
    assert fulmen.cache_hits(jitted) - hits == CALLS + 1000  # every measured call was a cache hit
    assert grew_bytes < MAX_GROWTH_BYTES, f"{grew_bytes} bytes more after {CALLS} cache hits"
    assert grew_objects < MAX_GROWTH_OBJECTS, f"{grew_objects} more live objects after {CALLS} cache hits"


def test_cache_hits_of_a_module_with_backward_do_not_grow_memory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    jitted = fulmen.jit(model, executors=["torch"])
    x = torch.randn(4, 8)

    def step():
        for p in model.parameters():
            p.grad = None
        jitted(x).sum().backward()

    step()
    hits = fulmen.cache_hits(jitted)
    grew_bytes, grew_objects = _growth(step)
    assert fulmen.cache_hits(jitted) - hits == CALLS + 1000
    assert all(p.grad is not None for p in model.parameters())
    assert grew_bytes < MAX_GROWTH_BYTES, f"{grew_bytes} bytes more after {CALLS} training steps"
    assert grew_objects < MAX_GROWTH_OBJECTS, f"{grew_objects} more live objects after {CALLS} training steps"
