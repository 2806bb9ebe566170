"""Training steps of eager, torch.compile and fulmen copies of one model, taken in turn in one process.

``fulmen bench --isolate`` measures each backend in fresh processes. That is the honest way to time compilation,
but a step's time varies by a few milliseconds from one process to the next on a shared 2-core machine, more
than the difference between two compilers. Here every backend gets its own copy of the model (same seed, same
inputs, the same fused AdamW step), all are compiled first (fulmen with ``compile="sync"``), and then the copies
step in turn, so every backend sees the same machine state. Figures are medians of the steps, and each
backend's ratio to eager.

    python benchmarks/bench_interleaved.py                       # gpt-small, 60 steps each
    python benchmarks/bench_interleaved.py --model llama-small --steps 100
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fulmen
from fulmen.bench.models import build_any
from fulmen.bench.runner import OPTIMIZERS

BACKENDS = ("eager", "torch.compile", "fulmen")


def make_step(model_name: str, backend: str, warmup: int):
    model, make_inputs = build_any(model_name, device=torch.device("cpu"), dtype=torch.float32, seed=0)
    model.train()
    inputs = make_inputs(2, targets=True)
    optimizer = OPTIMIZERS["adamw-fused"](model.parameters())
    if backend == "fulmen":
        run = fulmen.jit(model, compile="sync")
    elif backend == "torch.compile":
        run = torch.compile(model)
    else:
        run = model

    def step():
        optimizer.zero_grad(set_to_none=True)
        _, loss = run(*inputs)
        loss.backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per backend (default 60)")
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    steps = {b: make_step(args.model, b, args.warmup) for b in BACKENDS}
    times: dict[str, list[float]] = {b: [] for b in BACKENDS}
    for _ in range(args.steps):
        for backend, step in steps.items():
            start = time.perf_counter()
            step()
            times[backend].append(time.perf_counter() - start)
    eager = statistics.median(times["eager"])
    print(f"{args.model}, training step, {args.steps} interleaved steps each, {torch.get_num_threads()} threads")
    for backend in BACKENDS:
        median = statistics.median(times[backend])
        print(f"  {backend:<14} {median * 1e3:8.2f} ms  speedup {eager / median:5.3f}")
    print("speedup = eager time / the backend's time, steps interleaved in this process (above 1: faster than eager)")


if __name__ == "__main__":
    main()
