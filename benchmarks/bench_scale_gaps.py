"""The CPU side of issue 46's gaps: what fulmen's training step of the llama-1b code does that torch.compile's does
not, at toy size, in one process.

For eager, ``torch.compile`` and ``fulmen.jit(compile="sync")`` (every region compiled before timing), a training
step (zero_grad, forward under the chosen precision, backward, fused AdamW) of ``fulmen bench``'s llama-1b at
``--n-layer/--width/--seq-len`` prints:

- calls per step: fulmen's fused regions and the other calls of its forward and backward programs (by executor),
  against torch.compile's two compiled graphs; and the Inductor kernels each generated (``generated_kernel_count``);
- host cost: at tiny size (1 layer, width 64, 8 tokens, batch 1, a 256-token vocabulary), where kernels do
  almost no work, the CPU time of one ``FusedRegion.__call__`` and of a whole step for each backend: what a
  host-bound (GPU) step pays in Python and dispatch;
- bytes the forward leaves alive for the backward (saved tensors plus the logits and loss every backend returns),
  from the CPU allocator's events (``torch.profiler``, ``profile_memory``): the net bytes allocated by the forward;
- the median step time of each, steps interleaved.

Times are the calling thread's CPU time (``time.thread_time``) with one PyTorch thread (``--threads``), so that
kernels run in that thread and a loaded machine's waits for a core do not count; wall times are printed beside.

    python benchmarks/bench_scale_gaps.py                              # 2 layers, width 128, 64 tokens, fp32
    python benchmarks/bench_scale_gaps.py --precision bf16-autocast --steps 10
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable

import torch

import fulmen
from fulmen.bench.memory import _quiet_stderr
from fulmen.bench.models import build, size_overrides
from fulmen.bench.runner import OPTIMIZERS, _make_step
from fulmen.executors import inductor


def _calls_by_executor(trace) -> collections.Counter:
    """Calls of an execution trace by executor name (bookkeeping lines have no executor and are not counted)."""
    names = (getattr(b.sym.executor, "name", None) for b in trace.bound_symbols)
    return collections.Counter(n for n in names if n)


class RegionTimer:
    """Counts ``FusedRegion.__call__`` and records each call's thread CPU time while installed (a context
    manager)."""

    def __init__(self):
        self.times: list[float] = []
        self.calls: list[tuple] = []  # (region, args) of each call
        self._original = inductor.FusedRegion.__call__

    def __enter__(self):
        original, times, calls = self._original, self.times, self.calls

        def timed(region, *args):
            t0 = time.thread_time()
            out = original(region, *args)
            times.append(time.thread_time() - t0)
            calls.append((region, args))
            return out

        inductor.FusedRegion.__call__ = timed
        return self

    def __exit__(self, *exc):
        inductor.FusedRegion.__call__ = self._original


def _forward_net_bytes(run, inputs, autocast: torch.device | None) -> int:
    """Net bytes the CPU allocator holds after a forward that it did not hold before (what the backward keeps)."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is not None):
            out = run(*inputs)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    del out
    return sum(e.nbytes() for e in events)


def _setup(args, sizes: dict, backend: str):
    model, make_inputs = build("llama-1b", seed=0, **sizes)
    inputs = make_inputs(args.batch_size, targets=True)
    optimizer = OPTIMIZERS["adamw-fused"](model.parameters())
    if backend == "torch.compile":
        torch._dynamo.reset()
        run = torch.compile(model)
    elif backend == "fulmen":
        run = fulmen.jit(model, compile="sync")
    else:
        run = model
    autocast = torch.device("cpu") if args.precision == "bf16-autocast" else None
    return run, inputs, _make_step(run, "train", inputs, optimizer, autocast), autocast


def _step_times(steps: dict, count: int) -> dict[str, tuple[float, float]]:
    """Per backend, the median (thread CPU ms, wall ms) of ``count`` steps, backends in turns."""
    times: dict[str, list[tuple[float, float]]] = {b: [] for b in steps}
    for _ in range(count):
        for backend, step in steps.items():
            c0, t0 = time.thread_time(), time.perf_counter()
            step()
            times[backend].append((time.thread_time() - c0, time.perf_counter() - t0))
    return {
        b: (statistics.median(c for c, _ in v) * 1e3, statistics.median(w for _, w in v) * 1e3)
        for b, v in times.items()
    }


def measure(args, sizes: dict) -> dict:
    """Per backend: kernels generated, calls per step, forward's net bytes, step times (interleaved)."""
    from torch._inductor import metrics

    found: dict[str, dict] = {}
    steps = {}
    for backend in ("eager", "torch.compile", "fulmen"):
        before = metrics.generated_kernel_count
        run, inputs, step, autocast = _setup(args, sizes, backend)
        for _ in range(3):
            step()
        row = found[backend] = {"kernels": metrics.generated_kernel_count - before}
        with RegionTimer() as timer:
            step()
        row["region_calls"] = len(timer.times)
        if backend == "fulmen":
            row["forward_calls"] = dict(_calls_by_executor(fulmen.last_traces(run)[-1]))
            row["backward_calls"] = dict(_calls_by_executor(fulmen.last_backward_traces(run)[-1]))
        row["forward_net_bytes"] = _forward_net_bytes(run, inputs, autocast)
        steps[backend] = step
    for backend, (cpu_ms, wall_ms) in _step_times(steps, args.steps).items():
        found[backend]["step_cpu_ms"], found[backend]["step_ms"] = cpu_ms, wall_ms
    return found


def dispatch_cost(calls: list[tuple], repeats: int = 200) -> dict[str, float]:
    """Median thread CPU seconds of one region call, in turns: through ``FusedRegion.__call__`` with its steady
    layout found by the C++ check (``check``), the same with that check dropped so that the Python key finds it
    (``key``), and the compiled Inductor callable called directly (``direct``). ``check`` or ``key`` minus
    ``direct`` is fulmen's own dispatch per region call."""
    found: dict[str, list[float]] = {"check": [], "key": [], "direct": []}
    with torch.no_grad():  # as inside fulmen's autograd.Function, where regions run
        _call_in_turns(calls, repeats, found)
    return {k: statistics.median(v) for k, v in found.items()}


def _call_in_turns(calls: list[tuple], repeats: int, found: dict[str, list[float]]) -> None:
    for region, args in calls:
        key = tuple((a.shape, a.stride()) for a in args)
        compiled = region.variants.get(key)
        if compiled is None:
            continue
        region.forget_fast()
        region(*args), region(*args)  # the same layout twice: the C++ check is built
        fast = region.fast
        for _ in range(repeats // len(calls) + 1):
            region.fast = fast
            t0 = time.thread_time()
            region(*args)
            t1 = time.thread_time()
            region.fast, region._fast_builds = None, inductor.MAX_FAST_BUILDS  # the key finds it, nothing rebuilt
            region(*args)
            t2 = time.thread_time()
            compiled(list(args))
            t3 = time.thread_time()
            found["check"].append(t1 - t0)
            found["key"].append(t2 - t1)
            found["direct"].append(t3 - t2)
        region.forget_fast()


def host_costs(args) -> tuple[float, dict, dict[str, float]]:
    """At tiny size, where kernels do almost no work: the median CPU seconds of one fused-region call, each
    backend's step (thread CPU ms, wall ms), and ``dispatch_cost`` of the regions."""
    tiny = argparse.Namespace(**{**vars(args), "batch_size": 1})
    sizes = {**size_overrides("llama-1b", n_layer=1, width=64, seq_len=8), "vocab_size": 256}
    steps = {b: _setup(tiny, sizes, b)[2] for b in ("eager", "torch.compile", "fulmen")}
    for step in steps.values():
        for _ in range(3):
            step()
    with RegionTimer() as timer:
        for _ in range(args.steps):
            steps["fulmen"]()
    steps["fulmen, key lookup"] = _keyed(steps["fulmen"])
    return statistics.median(timer.times), _step_times(steps, args.steps), dispatch_cost(timer.calls)


def _keyed(step: Callable[[], object]) -> Callable[[], object]:
    """``step`` with every region's steady-layout C++ check set aside, so that the Python key finds each region's
    kernel (``FusedRegion.__call__`` as it was before the check), and put back after."""

    def keyed():
        regions = list(inductor.ex.regions)
        saved = [(r.fast, r._fast_builds) for r in regions]
        for r in regions:
            r.fast, r._fast_builds = None, inductor.MAX_FAST_BUILDS
        try:
            return step()
        finally:
            for r, (fast, builds) in zip(regions, saved):
                r.fast, r._fast_builds = fast, builds

    return keyed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--precision", choices=("fp32", "bf16-autocast"), default="fp32")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per backend, interleaved")
    parser.add_argument("--threads", type=int, default=1, help="PyTorch CPU threads (default 1)")
    parser.add_argument("--host-only", action="store_true", help="only the tiny-size host costs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = size_overrides("llama-1b", args.n_layer, args.width, args.seq_len)
    print(
        f"llama-1b code at {sizes}, batch {args.batch_size}, {args.precision}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads"
    )
    found = {} if args.host_only else measure(args, sizes)
    for backend, row in found.items():
        print(
            f"{backend:14s} step {row['step_cpu_ms']:8.1f} ms CPU ({row['step_ms']:.1f} wall); Inductor kernels "
            f"generated {row['kernels']:4d}; "
            f"fused-region calls per step {row['region_calls']:3d}; forward leaves "
            f"{row['forward_net_bytes'] / 2**20:7.2f} MiB alive"
        )
        for part in ("forward_calls", "backward_calls"):
            if part in row:
                print(f"{'':14s} {part.replace('_', ' ')} by executor: {row[part]}")
    region_s, tiny, cost = host_costs(args)
    print(
        f"tiny size (1 layer, width 64, 8 tokens, batch 1, vocabulary 256): one fused-region call "
        f"{region_s * 1e6:.0f} us CPU; "
        "steps " + ", ".join(f"{b} {c:.2f} ms CPU ({w:.2f} wall)" for b, (c, w) in tiny.items())
    )
    direct = cost["direct"]
    print(
        f"fulmen's dispatch per region call: {(cost['check'] - direct) * 1e6:.1f} us CPU with the steady layout's "
        f"C++ check, {(cost['key'] - direct) * 1e6:.1f} us through the Python key ({cost['check'] * 1e6:.0f} and "
        f"{cost['key'] * 1e6:.0f} us through FusedRegion.__call__, {direct * 1e6:.0f} us calling the compiled "
        "Inductor callable directly)"
    )


if __name__ == "__main__":
    main()
