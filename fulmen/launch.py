"""Run a function on several local processes joined in one torch.distributed process group (tests, benchmarks).

``run_on_ranks(fn, *args)`` starts ``world_size`` fresh processes (spawned, so no thread or CUDA state is inherited),
joins them in a process group over 127.0.0.1 and calls ``fn(rank, world_size, *args)`` on each. It returns the
ranks' results in rank order, or raises with the failing rank's traceback; a run past ``timeout`` seconds is killed.
``fn`` must be importable by name (a module-level function), and its arguments and results picklable.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, backend, timeout, threads, fn, args, results) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world_size)
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # by value (plain pickle): tensors sent through shared memory would vanish with this process
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001  (reported to the parent, which raises it)
        results.put((rank, False, traceback.format_exc()))


def run_on_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    backend: str = "gloo",
    timeout: float = 240.0,
    threads: int = 1,
) -> list[Any]:
    """``[fn(0, world_size, *args), fn(1, world_size, *args), ...]``, each run on its own process (see module doc)."""
    if world_size < 1:
        raise ValueError(f"run_on_ranks: world_size must be at least 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, backend, timeout, threads, fn, args, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outs: dict[int, Any] = {}
    try:
        while len(outs) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"run_on_ranks: {fn.__qualname__} did not finish on ranks "
                    f"{sorted(set(range(world_size)) - set(outs))} within {timeout:.0f} s"
                )
            try:
                rank, ok, out = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outs and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"run_on_ranks: rank {dead[0]} of {fn.__qualname__} exited with code "
                        f"{procs[dead[0]].exitcode} before reporting a result"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(f"run_on_ranks: rank {rank} of {fn.__qualname__} failed:\n{out}")
            outs[rank] = pickle.loads(out)
    finally:
        for p in procs:
            p.join(timeout=5 if len(outs) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [outs[r] for r in range(world_size)]
