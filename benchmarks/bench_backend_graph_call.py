"""The host cost of one Dynamo graph call: ``backend="fulmen"``'s compiled function against Inductor's.

A tiny Llama generates greedily through ``torch.compile(model.forward)`` twice, once with Inductor and once with
fulmen's backend; the callable each backend returned for the decode graph (with the cache length dynamic) is kept
with the arguments Dynamo passed it at every cache length. Then each callable is called directly, without
Dynamo's frame and guards (the same for both), in this thread's CPU time, in turns:

- the same arguments every call (a layout seen last call), and the lengths in turn (a new layout every call, as
  in ``generate()``);
- fulmen's parts: its prologue, its program, and its fused region keyed input by input against keyed by the
  growing check (``FusedRegion._key``).

    python benchmarks/bench_backend_graph_call.py --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fulmen.executors.inductor as inductor_executor
from fulmen.bench.generate import GenerateConfig, _build, _generate
from fulmen.executors.inductor import FusedRegion
from fulmen.executors.inductor_dynamic import layout_key
from fulmen.frontend.dynamo import fulmen_backend


def capture(new_tokens: int) -> dict[str, dict[int, tuple]]:
    """``{backend: {cache length: (compiled callable, its arguments)}}`` for the dynamic decode graph."""
    from torch._inductor.compile_fx import compile_fx

    model, ids = _build(GenerateConfig(model="hf:llama", prompt_len=16, new_tokens=new_tokens))
    forward, seen = model.forward, {}

    def capturing(name, compiler):
        def backend(gm, example_inputs):
            compiled = compiler(gm, example_inputs)
            dynamic = any(isinstance(x, torch.SymInt) for x in example_inputs)

            def call(*args):
                caches = [a.shape[2] for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
                if dynamic and caches:  # the decode graph: its cache inputs are [batch, heads, length, head dim]
                    seen.setdefault(name, {})[caches[0]] = (compiled, args)
                return compiled(*args)

            return call

        return backend

    backends = {"inductor": compile_fx, "fulmen": lambda gm, ex: fulmen_backend(gm, ex, {"compile": "sync"})}
    for name, compiler in backends.items():
        model.forward = torch.compile(forward, backend=capturing(name, compiler))
        for _ in range(3):
            _generate(model, ids, new_tokens)
        del model.forward
    return seen


def timed(calls: dict, repeats: int, number: int) -> dict[str, list[float]]:
    """Microseconds per call of each ``calls[name]`` (a function making ``n`` calls), in turns."""
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, n) in calls.items():
            start = time.thread_time_ns()
            for _ in range(number):
                fn()
            times[name].append((time.thread_time_ns() - start) / (number * n) / 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--number", type=int, default=20, help="rounds over the cache lengths per repeat")
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    seen = capture(args.new_tokens)
    torch.set_grad_enabled(False)  # as generate() calls the graphs: the programs were compiled for no_grad
    # the lengths the last decode graph of each backend ran (the first decode step can be a graph of its own)
    last = {name: calls[max(calls)][0] for name, calls in seen.items()}
    lengths = sorted(set.intersection(*({n for n, (c, _) in seen[name].items() if c is last[name]} for name in seen)))
    entry = last["fulmen"]._fulmen_jitted._last_entry  # the program with the length symbolic

    def flat(n):
        return entry.check(tuple(a for a in seen["fulmen"][n][1] if isinstance(a, torch.Tensor)), {})

    lengths = [n for n in lengths if flat(n) is not None]  # not the first length, if it has a program of its own
    ind, ful = [seen["inductor"][n] for n in lengths], [seen["fulmen"][n] for n in lengths]
    flats = [flat(n) for n in lengths]
    (region,) = [v for v in entry.program.forward.__globals__.values() if isinstance(v, FusedRegion)]
    region_args: list[tuple] = []
    original = FusedRegion.__call__

    def spy(self, *a):
        if self is region:
            region_args.append(a)
        return original(self, *a)

    FusedRegion.__call__ = spy
    for flat in flats:
        entry.run(flat)
    FusedRegion.__call__ = original

    def each(calls):
        return lambda: [f(*a) for f, a in calls]

    def region_with(growing: bool):
        def run():
            if not growing:
                region.growing, region._growing_builds = None, inductor_executor.MAX_FAST_BUILDS
            elif region.growing is None:  # built where the symbolic kernel is found for a new layout: here at once
                region._growing_builds = 0
                region._grow(region_args[-1], layout_key(region_args[-1]))
            for a in region_args:
                region(*a)

        return run

    calls = {
        "Inductor's compiled graph, lengths in turn": (each(ind), len(ind)),
        "fulmen's compiled graph, lengths in turn": (each(ful), len(ful)),
        "Inductor's compiled graph, same length": (each([ind[-1]] * len(ind)), len(ind)),
        "fulmen's compiled graph, same length": (each([ful[-1]] * len(ful)), len(ful)),
        "fulmen's prologue": (lambda: [entry.check(tuple(flat), {}) for flat in flats], len(flats)),
        "fulmen's program, lengths in turn": (lambda: [entry.run(flat) for flat in flats], len(flats)),
        "its region, keyed input by input": (region_with(False), len(region_args)),
        "its region, keyed by the growing check": (region_with(True), len(region_args)),
    }
    times = timed(calls, args.repeats, args.number)
    print(
        f"cache lengths {lengths[0]}-{lengths[-1]}, {len(region_args[0])} region inputs; us per call, thread CPU time"
    )
    for name, values in times.items():
        print(f"{name:45s} min {min(values):8.2f}  median {statistics.median(values):8.2f}")


if __name__ == "__main__":
    main()
