"""A decode-like step whose operations take a symbolic int (a cache sliced by its length, positions from
``arange(n)``) under ``fulmen.jit(compile="sync")`` against eager, one CPU thread, ``n`` new on every call.

    PYTHONPATH=. python benchmarks/bench_symbolic_fusion.py

Prints microseconds per call, medians of 15 rounds of 200 calls. Compare two versions of fulmen by running it with
each on PYTHONPATH, alternating, in fresh processes.
"""

from __future__ import annotations

import statistics
import time

import torch

import fulmen


def step(cache, x, n):
    pos = torch.arange(n, n + 1).float()
    k = cache[:, :, :n]
    s = (x @ k.transpose(-1, -2)) * 0.125 + pos
    return torch.softmax(s, -1) @ k


def _per_call_us(fn, cache, x) -> float:
    rounds = []
    for _ in range(15):
        start = time.perf_counter()
        for n in range(40, 240):
            fn(cache, x, n)
        rounds.append((time.perf_counter() - start) / 200 * 1e6)
    return statistics.median(rounds)


def main() -> None:
    torch.set_num_threads(1)
    jitted = fulmen.jit(step, compile="sync")
    cache, x = torch.randn(1, 4, 512, 32), torch.randn(1, 4, 1, 32)
    for n in range(8, 40):
        torch.testing.assert_close(jitted(cache, x, n), step(cache, x, n), rtol=1e-4, atol=1e-5)
    print(f"us per call: fulmen {_per_call_us(jitted, cache, x):.1f}, eager {_per_call_us(step, cache, x):.1f}")


if __name__ == "__main__":
    main()
