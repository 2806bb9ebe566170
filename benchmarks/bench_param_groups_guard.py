"""The cost of checking a jitted optimizer step's parameter lists (``fulmen.frontend.training_state``'s
``OptimizerParameters``) on every call: the step's whole guard with that check and without it, in one process, for
SGD over models of 2, 20 and 200 parameters (torch executor). Each figure is the median over rounds of the best
of repeats of the mean time per call.

    python benchmarks/bench_param_groups_guard.py
"""

from __future__ import annotations

import statistics
import timeit

import torch
from torch import nn

import fulmen
from fulmen.frontend.global_guard import GlobalGuard
from fulmen.frontend.training_state import OptimizerParameters


def per_call_us(check, calls: int = 2000) -> float:
    return statistics.median(min(timeit.repeat(check, number=calls, repeat=5)) / calls * 1e6 for _ in range(3))


def measure(layers: int) -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    step = fulmen.jit(opt.step, executors=["torch"])
    step()
    guard = next(iter(step._cache.values())).globals_guard
    without = GlobalGuard([item for item in guard.items if type(item.holder) is not OptimizerParameters])
    assert guard.check() and without.check()
    with_check, without_check = per_call_us(guard.check), per_call_us(without.check)
    print(
        f"{2 * layers} parameters, {len(guard.items)} guard items: {with_check:.2f} us, without the parameter "
        f"check {without_check:.2f} us (+{with_check - without_check:.2f} us)"
    )


if __name__ == "__main__":
    for layers in (1, 10, 100):
        measure(layers)
