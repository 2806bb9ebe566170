"""The host cost of each compiled region call of a training step, split into fulmen's dispatch and the rest.

Trains llama-1b's code at toy size (default 2 layers, width 128, 64 tokens, batch 2, bf16 autocast, one thread)
under ``fulmen.jit(model, compile="sync")``, records one call's arguments of every fused region, then times each
region, medians of ``--calls`` calls, in turns:

- ``region``: the call as the program makes it (``FusedRegion.__call__``: the layout check, then the compiled
  callable);
- ``compiled``: the compiled callable alone (Inductor's ``call``: its input checks, allocations and kernels);
- ``dispatch``: ``region - compiled``, fulmen's own cost per call;
- ``size_checks``: what the compiled callable's ``assert_size_stride`` lines cost (the callable timed with them
  replaced by a function that does nothing, subtracted from ``compiled``), with how many it runs;
- ``guard`` and ``assert``: alone, the region's steady-layout check (``FusedRegion.fast``: one C++ check of every
  input) and one ``assert_size_stride`` of its first input, which on a loaded machine resolve what the differences
  of whole calls above cannot (a kernel of a millisecond varies by tens of microseconds).

    python benchmarks/bench_region_calls.py
    python benchmarks/bench_region_calls.py --n-layer 4 --width 256 --calls 300
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def _interleaved_us(variants: dict, calls: int) -> dict[str, float]:
    """The median time of each variant in microseconds, the variants called in turns (so load changes hit all)."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(calls):
        for name, run in variants.items():
            t0 = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) * 1e6 for name, s in samples.items()}


def _unchecked(fn, call_args, scope: dict, checks) -> None:
    scope["assert_size_stride"] = _nothing
    try:
        fn(list(call_args))
    finally:
        scope["assert_size_stride"] = checks


def _record_calls(regions) -> dict:
    """Swap each region's class ``__call__`` for one that records the region's first arguments."""
    from fulmen.executors.inductor import FusedRegion

    seen: dict = {}
    real = FusedRegion.__call__

    def recording(self, *args):
        seen.setdefault(self, args)
        return real(self, *args)

    FusedRegion.__call__ = recording
    return seen, lambda: setattr(FusedRegion, "__call__", real)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    import fulmen
    from fulmen.bench.models import build, size_overrides
    from fulmen.executors.inductor import ex

    model, make_inputs = build("llama-1b", seed=0, **size_overrides("llama-1b", args.n_layer, args.width, args.seq_len))
    inputs = make_inputs(2, targets=True)
    jitted = fulmen.jit(model, compile="sync")

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = jitted(*inputs)
        loss.backward()

    step()
    seen, restore = _record_calls(ex.regions)
    step()
    restore()
    print(
        f"llama-1b code, {args.n_layer} layers, width {args.width}, {args.seq_len} tokens, bf16 autocast; "
        f"medians of {args.calls} calls in turns, us"
    )
    head = ("region", "inputs", "region", "compiled", "dispatch", "size_checks", "guard", "assert")
    print(f"{head[0]:24s} " + " ".join(f"{h:>9s}" for h in head[1:]))
    for region, call_args in sorted(seen.items(), key=lambda kv: kv[0].name):
        fn = region.fast[1] if region.fast is not None else next(iter(region.variants.values()), None)
        if fn is None:
            continue
        inner = getattr(fn, "__wrapped__", fn)
        scope = getattr(getattr(inner, "__func__", inner), "__globals__", {})
        checks = scope.get("assert_size_stride")
        count = _asserts(inner)
        variants = {"region": lambda: region(*call_args), "compiled": lambda: fn(list(call_args))}
        if checks is not None:
            variants["unchecked"] = lambda: _unchecked(fn, call_args, scope, checks)
        with torch.no_grad():
            for run in variants.values():
                run()
            t = _interleaved_us(variants, args.calls)
        t_region, t_compiled = t["region"], t["compiled"]
        t_unchecked = t.get("unchecked", t_compiled)
        first = call_args[0]
        alone = {"assert": lambda: checks(first, tuple(first.shape), first.stride(), "input")} if checks else {}
        if region.fast is not None:
            alone["guard"] = lambda: region.fast[0].check(*call_args)
        t_alone = _interleaved_us(alone, args.calls * 10) if alone else {}
        print(
            f"{region.name:24s} {len(call_args):6d} {t_region:9.1f} {t_compiled:9.1f} {t_region - t_compiled:9.1f} "
            f"{t_compiled - t_unchecked:8.1f} ({count}) {t_alone.get('guard', float('nan')):7.2f} "
            f"{t_alone.get('assert', float('nan')):7.2f}"
        )
    return 0


def _nothing(*args) -> None:
    return None


def _asserts(fn) -> int:
    import inspect

    try:
        return inspect.getsource(fn).count("assert_size_stride(")
    except (OSError, TypeError):
        return -1


if __name__ == "__main__":
    sys.exit(main())
