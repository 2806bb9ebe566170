"""Per-call overhead of a jitted module as its tree grows: eager vs fulmen.jit on modules of 1, 20 and 56
submodules with tiny tensors, timed in turns (round robin), each figure the median over repeats; and, alone, the
check a cache hit makes that the module tree did not change, and the revalidation a call pays after it changed.

    python benchmarks/bench_module_overhead.py [--repeats 21] [--calls 500] [--json out.json]

To compare two versions of fulmen, run it once with each on the path (``PYTHONPATH=...``), alternately.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import fulmen
from fulmen.bench.models import build


def _models() -> dict[str, tuple[nn.Module, tuple]]:
    linear = nn.Linear(4, 4)
    out = {"Linear (1 module)": (linear, (torch.randn(2, 4),))}
    for layers in (1, 4):
        model, make_inputs = build("gpt-tiny", n_layer=layers, n_embd=8, n_head=2, vocab_size=16, block_size=4)
        out[f"gpt-tiny, {layers} layer(s) ({len(list(model.modules()))} modules)"] = (model, make_inputs(1))
    return out


def _time_us(call: Callable[[], object], calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        call()
    return (time.perf_counter_ns() - start) / calls / 1e3


def _structure_check(jitted) -> Callable[[], object]:
    """The check a cache hit makes that the module tree did not change (this fulmen's, or the epoch compare of
    versions that wrapped torch's methods instead)."""
    state = jitted._fulmen_jitted.state
    if hasattr(state, "check"):
        return lambda: state.check()
    from fulmen.frontend import module_guard

    return lambda: state.epoch != module_guard.epoch


def _revalidation(jitted) -> Callable[[], object]:
    """What a call pays after the tree changed: a snapshot, and (this fulmen) building the check again."""
    state = jitted._fulmen_jitted.state
    return state.revalidate


def measure(repeats: int, calls: int) -> dict[str, dict[str, float]]:
    results = {}
    with torch.no_grad():
        for name, (model, args) in _models().items():
            model.eval()
            jitted = fulmen.jit(model, executors=["torch"], compile="off")
            torch.testing.assert_close(jitted(*args), model(*args))
            jitted(*args)
            impls = {
                "eager": lambda m=model, a=args: m(*a),
                "fulmen.jit": lambda m=jitted, a=args: m(*a),
                "structure check": _structure_check(jitted),
            }
            for impl in impls.values():  # warm up
                _time_us(impl, calls)
            times: dict[str, list[float]] = {k: [] for k in impls}
            for _ in range(repeats):
                for key, impl in impls.items():
                    times[key].append(_time_us(impl, calls))
            medians = {k: statistics.median(v) for k, v in times.items()}
            medians["above eager"] = medians["fulmen.jit"] - medians["eager"]
            revalidate = _revalidation(jitted)
            medians["revalidation"] = statistics.median(_time_us(revalidate, 5) for _ in range(repeats))
            assert fulmen.cache_misses(jitted) == 1, "every timed call should be a cache hit"
            results[name] = medians
            print(f"{name:36s} " + "  ".join(f"{k} {v:.2f} us" for k, v in medians.items()), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--json", help="write the medians to this file")
    opts = parser.parse_args()
    torch.set_num_threads(1)  # tiny tensors: one thread, and no spinning workers on a shared machine
    print(f"fulmen from {fulmen.__file__}")
    results = measure(opts.repeats, opts.calls)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
