"""Where a GPU training step's time goes, and where its cold compilation goes, in one call of a lent machine.

Two parts, each in this process (run the script once per model):

- ``timeline``: ``fulmen.jit`` with background compilation, as ``fulmen bench`` runs it, from empty caches when
  the caller gives it fresh ``TORCHINDUCTOR_CACHE_DIR``/``TRITON_CACHE_DIR``. Prints when each region's Inductor
  lowering started and ended (seconds after ``fulmen.jit``), the first step, and when the last region swapped in.
- ``step``: a training step (zero_grad, forward, backward, fused AdamW) for eager and fulmen (``compile="sync"``):
  the median over 30 synchronized steps, kernel launches and device-busy time of one step (``torch.profiler``),
  and the Python functions with the most time of their own over 10 steps (cProfile). A step whose device time is
  far under its wall time is bound by the host: launches and Python, not the GPU.

    python benchmarks/profile_gpu.py --model gpt-small                    # both parts, CUDA
    python benchmarks/profile_gpu.py --model gpt-tiny --device cpu --part step
    python benchmarks/profile_gpu.py --model llama-1b --precision bf16-autocast --batch-size 4 --part step
    python benchmarks/profile_gpu.py --model llama-1b --n-layer 2 --width 128 --seq-len 64 --device cpu --part step
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

import fulmen
import fulmen.executors.inductor_compile as inductor_compile
from fulmen.bench.models import build_any, size_overrides
from fulmen.bench.runner import OPTIMIZERS, _make_step, _sync, _timed  # fulmen bench's own step and timing

_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def timeline(model, inputs, optimizer, device: torch.device, autocast: torch.device | None) -> None:
    start = time.perf_counter()
    lower = inductor_compile._lower

    def timed_lower(fn, example, *args, **kwargs):  # whatever else _lower takes, passed on
        t = time.perf_counter()
        try:
            return lower(fn, example, *args, **kwargs)
        finally:
            print(f"  lowering {t - start:7.2f} -> {time.perf_counter() - start:7.2f} s ({len(example)} inputs)",
                  flush=True)

    inductor_compile._lower = timed_lower
    try:
        step, steps = _make_step(fulmen.jit(model), "train", inputs, optimizer, autocast), 0
        while steps < 3 or inductor_compile.pending_compilations():
            step()
            _sync(device)
            steps += 1
            if steps == 1:
                print(f"first step done {time.perf_counter() - start:.2f} s after fulmen.jit", flush=True)
    finally:
        inductor_compile._lower = lower
    print(f"fully compiled {time.perf_counter() - start:.2f} s after fulmen.jit, {steps} steps taken; "
          f"{inductor_compile.kernel_stats()}")


def step_profile(model, inputs, optimizer, device: torch.device, top: int, autocast: torch.device | None) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for label, run in (("eager", model), ("fulmen", fulmen.jit(model, compile="sync"))):
        step = _make_step(run, "train", inputs, optimizer, autocast)
        for _ in range(5):
            step()
        times = [_timed(step, device) for _ in range(30)]
        with profile(activities=activities) as prof:
            step()
            _sync(device)
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in _LAUNCHES)
        busy = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3
        print(f"\n== {label}: median step {statistics.median(times) * 1e3:.2f} ms; one profiled step: "
              f"{launches} kernel launches, device busy {busy:.2f} ms")
        print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(10):
            step()
        _sync(device)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
        print(out.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small", help="a built-in model (default gpt-small)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--part", choices=("timeline", "step", "both"), default="both")
    parser.add_argument("--top", type=int, default=25, help="cProfile rows to print (default 25)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "bf16-autocast"), default="fp32")
    parser.add_argument("--n-layer", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--seq-len", type=int)
    args = parser.parse_args()
    device = torch.device(args.device)
    sized = (args.n_layer, args.width, args.seq_len) != (None, None, None)
    overrides = size_overrides(args.model, args.n_layer, args.width, args.seq_len) if sized else {}
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model, make_inputs = build_any(args.model, device=device, dtype=dtype, seed=0, **overrides)
    autocast = device if args.precision == "bf16-autocast" else None
    inputs = make_inputs(args.batch_size, targets=True)
    optimizer = OPTIMIZERS["adamw-fused"](model.parameters())
    print(f"{args.model} on {device}, {args.precision}, torch {torch.__version__}")
    if args.part in ("timeline", "both"):
        timeline(model, inputs, optimizer, device, autocast)
    if args.part in ("step", "both"):
        step_profile(model, inputs, optimizer, device, args.top, autocast)


if __name__ == "__main__":
    main()
