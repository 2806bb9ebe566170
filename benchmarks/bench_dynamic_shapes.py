"""First call vs a call at a new sequence length, gpt-small, with exact sizes (``dynamic=False``) and automatic
dynamic sizes (the default): inference and a training step, medians over a few fresh processes' worth of runs.

    python benchmarks/bench_dynamic_shapes.py --repeats 3

Each repeat builds a new ``fulmen.jit`` and calls it at sequence lengths 128, 64, 96, 112: with exact sizes every
call compiles; with dynamic sizes the second call compiles once with a symbolic length and the later ones reuse it.
The process pays one-time costs (Inductor/Dynamo imports, sympy) in its first dynamic compilation; a warm-up
repeat that is not counted absorbs them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fulmen
from fulmen.bench.models import build

LENGTHS = (128, 64, 96, 112)


def one_run(dynamic: bool | None, train: bool) -> list[float]:
    model, _ = build("gpt-small")
    jm = fulmen.jit(model, executors=[], dynamic=dynamic)
    gen = torch.Generator().manual_seed(0)
    times, misses = [], 0
    for t in LENGTHS:
        idx = torch.randint(0, 4096, (2, t), generator=gen)
        targets = torch.randint(0, 4096, (2, t), generator=gen)
        start = time.perf_counter()
        if train:
            _, loss = jm(idx, targets)
            loss.backward()
        else:
            with torch.no_grad():
                jm(idx)
        elapsed = time.perf_counter() - start
        stats = fulmen.compile_stats(jm)
        compiled = stats.cache_misses > misses
        misses = stats.cache_misses
        times.append((elapsed, stats.last_compile_time_ms / 1e3 if compiled else 0.0))
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for train in (False, True):
        for dynamic in (False, None):
            one_run(dynamic, train)  # warm-up: imports and one-time initialisation
            runs = [one_run(dynamic, train) for _ in range(args.repeats)]
            calls = [statistics.median(r[i][0] for r in runs) * 1e3 for i in range(len(LENGTHS))]
            compiles = [statistics.median(r[i][1] for r in runs) * 1e3 for i in range(len(LENGTHS))]
            label = f"{'train' if train else 'infer'} dynamic={dynamic!s:5}"
            print(label, "  ".join(f"T={t}: {m:6.0f} ms (compile {c:4.0f})" for t, m, c in zip(LENGTHS, calls,
                                                                                               compiles)))


if __name__ == "__main__":
    main()
