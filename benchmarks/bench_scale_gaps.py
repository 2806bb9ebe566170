"""The CPU side of issue 46's gaps: what fulmen's training step of the llama-1b code does that torch.compile's does
not, at toy size, in one process.

For eager, ``torch.compile`` and ``fulmen.jit(compile="sync")`` (every region compiled before timing), a training
step (zero_grad, forward under the chosen precision, backward, fused AdamW) of ``fulmen bench``'s llama-1b at
``--n-layer/--width/--seq-len`` prints:

- calls per step: fulmen's fused regions and the other calls of its forward and backward programs (by executor),
  against torch.compile's two compiled graphs; and the Inductor kernels each generated (``generated_kernel_count``);
- host cost per region call: the median time of one ``FusedRegion.__call__`` at ``--tiny`` size (1 layer, width
  64, 8 tokens, batch 1), where kernels do almost no work, so a call's time is the Python and dispatch around it;
  the same size's step time for each backend says what a host-bound (GPU) step pays in all;
- bytes the forward leaves alive for the backward (saved tensors plus the logits and loss every backend returns),
  from the CPU allocator's events (``torch.profiler``, ``profile_memory``): the net bytes allocated by the forward;
- the median step time of each, steps interleaved.

    python benchmarks/bench_scale_gaps.py                              # 2 layers, width 128, 64 tokens, fp32
    python benchmarks/bench_scale_gaps.py --precision bf16-autocast --steps 10
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

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
    """Counts and times ``FusedRegion.__call__`` while installed (a context manager)."""

    def __init__(self):
        self.times: list[float] = []
        self._original = inductor.FusedRegion.__call__

    def __enter__(self):
        original, times = self._original, self.times

        def timed(region, *args):
            t0 = time.perf_counter()
            out = original(region, *args)
            times.append(time.perf_counter() - t0)
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
    times: dict[str, list[float]] = {b: [] for b in steps}
    for _ in range(args.steps):
        for backend, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[backend].append(time.perf_counter() - t0)
    for backend in steps:
        found[backend]["step_ms"] = statistics.median(times[backend]) * 1e3
    return found


def region_call_cost(args) -> float:
    """Median seconds of one fused-region call at tiny size, where its kernels do almost no work."""
    tiny = argparse.Namespace(**{**vars(args), "batch_size": 1})
    _, _, step, _ = _setup(tiny, size_overrides("llama-1b", n_layer=1, width=64, seq_len=8), "fulmen")
    for _ in range(3):
        step()
    with RegionTimer() as timer:
        for _ in range(args.steps):
            step()
    return statistics.median(timer.times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--precision", choices=("fp32", "bf16-autocast"), default="fp32")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per backend, interleaved")
    args = parser.parse_args()
    sizes = size_overrides("llama-1b", args.n_layer, args.width, args.seq_len)
    print(
        f"llama-1b code at {sizes}, batch {args.batch_size}, {args.precision}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads"
    )
    found = measure(args, sizes)
    for backend, row in found.items():
        print(
            f"{backend:14s} step {row['step_ms']:8.1f} ms; Inductor kernels generated {row['kernels']:4d}; "
            f"fused-region calls per step {row['region_calls']:3d}; forward leaves "
            f"{row['forward_net_bytes'] / 2**20:7.2f} MiB alive"
        )
        for part in ("forward_calls", "backward_calls"):
            if part in row:
                print(f"{'':14s} {part.replace('_', ' ')} by executor: {row[part]}")
    print(f"one fused-region call at tiny size (host cost): {region_call_cost(args) * 1e6:.1f} us (median)")


if __name__ == "__main__":
    main()
