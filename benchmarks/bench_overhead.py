"""Per-call overhead: ``a + b * a`` on 2x2 CPU tensors, eager vs fulmen.jit vs torch.compile, in one process.

The tensors are tiny, so the time per call is almost all framework overhead (argument checks, cache lookup,
the Python wrapper), not arithmetic. Implementations are timed in turns (round robin) so that drifts in machine
load hit all of them alike; each figure is the median over repeats of the mean time per call in one repeat.

Target (issue 2): fulmen at most 15 us per call above eager.

    python benchmarks/bench_overhead.py                 # all three
    python benchmarks/bench_overhead.py --no-torch-compile --repeats 31 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

import fulmen

TARGET_US_ABOVE_EAGER = 15.0


def fn(a, b):
    return a + b * a


def time_per_call_us(call: Callable[[], object], calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        call()
    return (time.perf_counter_ns() - start) / calls / 1e3


def build(with_torch_compile: bool, with_fulmen_backend: bool) -> dict[str, Callable]:
    a, b = torch.randn(2, 2), torch.randn(2, 2)
    factories: dict[str, Callable[[], Callable]] = {"eager": lambda: fn, "fulmen.jit": lambda: fulmen.jit(fn)}
    if with_torch_compile:
        factories["torch.compile (inductor)"] = lambda: torch.compile(fn)
    if with_fulmen_backend:
        factories['torch.compile (backend="fulmen")'] = lambda: torch.compile(fn, backend="fulmen")
    expected = fn(a, b)
    ready: dict[str, Callable] = {}
    for name, make in factories.items():
        start = time.perf_counter()
        try:
            impl = make()
            out = impl(a, b)  # first call: trace / compile
            first_ms = 1e3 * (time.perf_counter() - start)
        except Exception as e:  # a backend that is not there yet is reported, not fatal
            print(f"  {name}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:100]})", file=sys.stderr)
            continue
        torch.testing.assert_close(out, expected)
        print(f"  {name}: first call {first_ms:.1f} ms", file=sys.stderr)
        ready[name] = (lambda impl=impl: impl(a, b))
    return ready


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per repeat")
    parser.add_argument("--repeats", type=int, default=21, help="repeats (the median is reported)")
    parser.add_argument("--no-torch-compile", action="store_true", help="skip torch.compile (saves ~15 s)")
    parser.add_argument("--fulmen-backend", action="store_true", help='also time torch.compile(backend="fulmen")')
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)

    print("compiling...", file=sys.stderr)
    impls = build(not args.no_torch_compile, args.fulmen_backend)
    for call in impls.values():  # warm-up
        time_per_call_us(call, args.calls // 4)
    samples: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(args.repeats):
        for name, call in impls.items():
            samples[name].append(time_per_call_us(call, args.calls))

    medians = {name: statistics.median(s) for name, s in samples.items()}
    eager = medians["eager"]
    print(f"\nper-call time of a + b * a on 2x2 float32 CPU tensors "
          f"(median of {args.repeats} x {args.calls} calls, torch {torch.__version__})\n")
    print(f"{'implementation':<34} {'median us':>10} {'min us':>8} {'max us':>8} {'above eager':>12}")
    for name, s in samples.items():
        print(f"{name:<34} {medians[name]:>10.2f} {min(s):>8.2f} {max(s):>8.2f} {medians[name] - eager:>+12.2f}")
    above = medians["fulmen.jit"] - eager
    verdict = "met" if above <= TARGET_US_ABOVE_EAGER else "MISSED"
    print(f"\ntarget: fulmen.jit <= eager + {TARGET_US_ABOVE_EAGER:.0f} us -> {above:+.2f} us: {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_us": medians, "samples_us": samples, "target_met": above <= TARGET_US_ABOVE_EAGER},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
