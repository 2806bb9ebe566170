"""A jitted optimizer step (``clip_grad_norm_`` + SGD) of a small model: compiles over a training loop, and the time
per call of the step against eager's, in one process.

The step reads ``p.grad`` of parameters it does not receive. ``zero_grad()`` (set_to_none, the default) and the next
backward put new gradient objects there before every step; the program reads them on every call
(``fulmen.frontend.training_state``). The per-call figure is timed with the gradients left in place between calls
(no backward), so it is the step's own cost: eager's Python optimizer code vs the jitted program with its prologue.
Implementations run in turns; each figure is the median over repeats of the mean time per call in one repeat.

    python benchmarks/bench_grad_reads.py
    python benchmarks/bench_grad_reads.py --steps 10 --repeats 21 --calls 500
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import fulmen


def make(jit: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)

    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return model, opt, fulmen.jit(update, executors=["torch"]) if jit else update


def compiles_over_loop(steps: int) -> int:
    model, opt, step = make(True)
    for i in range(steps):
        opt.zero_grad()
        model(torch.full((5, 3), float(i))).sum().backward()
        step()
    return fulmen.cache_misses(step)


def per_call_us(repeats: int, calls: int) -> dict[str, float]:
    steps = {}
    for name, jit in (("eager", False), ("fulmen.jit", True)):
        model, opt, step = make(jit)
        model(torch.ones(5, 3)).sum().backward()
        step()
        steps[name] = step
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter_ns()
            for _ in range(calls):
                step()
            times[name].append((time.perf_counter_ns() - start) / calls / 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    print(f"compiles over {args.steps} steps (zero_grad set_to_none): {compiles_over_loop(args.steps)}")
    medians = per_call_us(args.repeats, args.calls)
    for name, us in medians.items():
        print(f"{name}: {us:.2f} us per step")
    print(f"fulmen.jit - eager: {medians['fulmen.jit'] - medians['eager']:+.2f} us")


if __name__ == "__main__":
    main()
