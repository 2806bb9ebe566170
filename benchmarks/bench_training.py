"""Training step benchmark: eager PyTorch vs ``fulmen.jit`` with only the torch executor.

One step is forward, ``loss.backward()`` and an AdamW step, on the built-in GPT and LLaMA-style models
(``fulmen.bench.models``). Eager and fulmen run side by side in one process on identical copies of the model,
their steps interleaved so that machine noise hits both alike; the figures are the median step times, their
ratio, and the median of the per-pair ratios (each fulmen step over the eager step just before it).

Peak memory (CPU): one extra steady-state step of each runs under ``torch.profiler`` with
``profile_memory=True`` (``fulmen.bench.memory.cpu_step_peak_bytes``); the peak is the bytes held when the
step starts (parameters, gradients, optimizer state, inputs) plus the highest running total of allocations
minus frees through PyTorch's CPU allocator during the step. On CUDA, ``torch.cuda.max_memory_allocated``.

    python benchmarks/bench_training.py                      # gpt-small and llama-small, batch 4
    python benchmarks/bench_training.py --models llama-small --batch 2 --steps 20
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import fulmen
from fulmen.bench.memory import cpu_step_peak_bytes, state_tensors, tensor_bytes
from fulmen.bench.models import build


def _step_fn(model, optimizer, inputs):
    def step():
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(*inputs)
        loss.backward()
        optimizer.step()
        return loss

    return step


def _peak_bytes(step, model, optimizer, inputs, device: str) -> int:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    held = tensor_bytes(state_tensors(model, optimizer, inputs))
    return held + cpu_step_peak_bytes(step)


def bench(name: str, batch: int, steps: int, warmup: int, device: str) -> dict:
    model, make_inputs = build(name, device=device)
    inputs = make_inputs(batch, targets=True)
    eager_model = model
    fulmen_model = copy.deepcopy(model)
    jitted = fulmen.jit(fulmen_model, executors=[])  # the torch executor only
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    fulmen_opt = torch.optim.AdamW(fulmen_model.parameters(), lr=1e-3)
    eager_step = _step_fn(eager_model, eager_opt, inputs)
    fulmen_step = _step_fn(jitted, fulmen_opt, inputs)

    eager_step()
    start = time.perf_counter()
    fulmen_step()  # the first call traces and compiles
    compile_s = time.perf_counter() - start
    for _ in range(warmup):
        eager_step()
        fulmen_step()
    times = {"eager": [], "fulmen": []}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(steps):
        for label, step in (("eager", eager_step), ("fulmen", fulmen_step)):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times[label].append(time.perf_counter() - t0)
    eager_ms = statistics.median(times["eager"]) * 1e3
    fulmen_ms = statistics.median(times["fulmen"]) * 1e3
    # each fulmen step against the eager step just before it: robust to load that drifts during the run
    paired = statistics.median(f / e for f, e in zip(times["fulmen"], times["eager"]))
    eager_peak = _peak_bytes(eager_step, eager_model, eager_opt, inputs, device)
    fulmen_peak = _peak_bytes(fulmen_step, fulmen_model, fulmen_opt, inputs, device)
    eager_loss, fulmen_loss = eager_step().item(), fulmen_step().item()
    return dict(model=name, batch=batch, eager_ms=eager_ms, fulmen_ms=fulmen_ms, ratio=fulmen_ms / eager_ms,
                paired_ratio=paired,
                eager_peak_mb=eager_peak / 2**20, fulmen_peak_mb=fulmen_peak / 2**20,
                memory_ratio=fulmen_peak / eager_peak, compile_s=compile_s,
                saved=fulmen.compile_stats(jitted).last_backward_traces and len(
                    fulmen.last_backward_traces(jitted)[0].bound_symbols[0].output),
                loss_diff=abs(eager_loss - fulmen_loss))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt-small,llama-small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}; memory: "
          + ("torch.cuda.max_memory_allocated" if args.device.startswith("cuda") else
             "live state + peak net CPU-allocator bytes in one step (torch.profiler)"))
    header = (f"{'model':<12} {'batch':>5} {'eager ms':>9} {'fulmen ms':>9} {'ratio':>6} {'paired':>6} {'eager MB':>9} "
              f"{'fulmen MB':>9} {'mem ratio':>9} {'saved':>5} {'compile s':>9} {'|dloss|':>8}")
    print(header)
    for name in args.models.split(","):
        r = bench(name.strip(), args.batch, args.steps, args.warmup, args.device)
        print(f"{r['model']:<12} {r['batch']:>5} {r['eager_ms']:>9.2f} {r['fulmen_ms']:>9.2f} {r['ratio']:>6.3f} "
              f"{r['paired_ratio']:>6.3f} "
              f"{r['eager_peak_mb']:>9.1f} {r['fulmen_peak_mb']:>9.1f} {r['memory_ratio']:>9.3f} {r['saved']:>5} "
              f"{r['compile_s']:>9.2f} {r['loss_diff']:>8.1e}")


if __name__ == "__main__":
    main()
