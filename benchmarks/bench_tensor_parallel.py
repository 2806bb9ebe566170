"""Tensor parallelism under fulmen.jit: a training step of an MLP stack on 2 CPU ranks (gloo), one process each.

Each block is ``x + down(gelu(up(x)))`` with ``up`` column-wise and ``down`` row-wise parallel
(``parallelize_module``). Compared, in one run, timed in turns (round robin, a barrier before each step) so that
load drifts hit all alike, median step time (forward + backward) per rank:

- eager: PyTorch's DTensor dispatch (sharding propagation on every call);
- fulmen, torch executor: ``fulmen.jit(model, executors=["torch"])``, the DTensor program traced once into local
  operations and functional collectives (``fulmen/frontend/dtensor_program.py``);
- fulmen, fused: ``fulmen.jit(model, compile="sync")``.

    python benchmarks/bench_tensor_parallel.py
    python benchmarks/bench_tensor_parallel.py --width 64 --depth 2 --batch 8 --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

from fulmen.launch import run_on_ranks


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _model(mesh, width: int, depth: int) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(*(Block(width) for _ in range(depth)))
    for block in model:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _rank(rank, world_size, width, depth, batch, repeats):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fulmen

    mesh = init_device_mesh("cpu", (world_size,))
    x = torch.randn(batch, width)
    models = {
        "eager": _model(mesh, width, depth),
        "fulmen, torch executor": fulmen.jit(_model(mesh, width, depth), executors=["torch"]),
        "fulmen, fused": fulmen.jit(_model(mesh, width, depth), compile="sync"),
    }

    def step(model):
        model(x).square().mean().backward()

    for model in models.values():  # trace, compile, warm up
        for _ in range(3):
            step(model)
    times = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            step(model)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    results = run_on_ranks(_rank, args.width, args.depth, args.batch, args.repeats, timeout=600)
    print(f"width {args.width}, depth {args.depth}, batch {args.batch}: median ms per step (rank 0 / rank 1)")
    for name in results[0]:
        ms = [r[name] for r in results]
        speed = [r["eager"] / r[name] for r in results]
        print(f"  {name:24s} {ms[0]:8.2f} / {ms[1]:8.2f}   eager / this: {speed[0]:.2f}x / {speed[1]:.2f}x")


if __name__ == "__main__":
    main()
