"""Communication overlap: several independent matmul + all-reduce branches on 2 CPU ranks (gloo), one process each.

Each branch computes ``tanh(x @ w_i)`` and all-reduces it; the results are combined at the end. Eager's
``dist.all_reduce`` blocks, so each all-reduce waits before the next matmul starts. fulmen records each collective
as a start and a wait and (``fulmen.transforms.overlap``) starts each as soon as its input exists and waits only
when the results are needed, so the next branches' matmuls run while the data travels. Compared, in one run,
timed in turns (round robin) so that load drifts hit all alike, median over repeats of the mean time per call:

- eager: ``dist.all_reduce`` (blocking), as written;
- eager async: the same with ``async_op=True`` and every wait at the end (the overlap written by hand);
- fulmen, no overlap: ``fulmen.jit(..., overlap_communication=False)`` (collectives where the program made them);
- fulmen: the default (overlap on);
each fulmen variant without fusion (``executors=["torch"]``) and with it (``compile="sync"``).

    python benchmarks/bench_collective_overlap.py
    python benchmarks/bench_collective_overlap.py --branches 6 --rows 128 --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def program(x, ws):
    out = []
    for w in ws:
        h = torch.tanh(x @ w)
        dist.all_reduce(h)
        out.append(h)
    return torch.stack(out).sum(0)


def program_async(x, ws):
    out, works = [], []
    for w in ws:
        h = torch.tanh(x @ w)
        works.append(dist.all_reduce(h, async_op=True))
        out.append(h)
    for work in works:
        work.wait()
    return torch.stack(out).sum(0)


def _time_ms(fn, args, calls: int) -> float:
    dist.barrier()  # the ranks start each measurement together
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls * 1e3


def _rank(rank: int, world_size: int, opts: dict) -> dict:
    import fulmen
    from fulmen.executors import inductor

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(opts["rows"], opts["width"], generator=gen)
    ws = [
        torch.randn(opts["width"], opts["width"], generator=gen) / opts["width"] ** 0.5 for _ in range(opts["branches"])
    ]
    args = (x, ws)
    no_overlap = fulmen.jit(program, executors=["torch"], overlap_communication=False)
    fused_no_overlap = fulmen.jit(program, compile="sync", overlap_communication=False)
    candidates = {
        "eager": program,
        "eager async": program_async,
        "fulmen, no overlap": no_overlap,
        "fulmen": fulmen.jit(program, executors=["torch"]),
        "fulmen fused, no overlap": fused_no_overlap,
        "fulmen fused": fulmen.jit(program, compile="sync"),
    }
    expected = program(*args)
    for name, fn in candidates.items():
        torch.testing.assert_close(fn(*args), expected, rtol=1e-5, atol=1e-5, msg=name)
    inductor.wait_for_compilations()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(opts["repeats"]):
        for name, fn in candidates.items():
            times[name].append(_time_ms(fn, args, opts["calls"]))
    # per repeat, eager's time over each variant's, measured back to back: a ratio a load drift hits less than
    # the times themselves
    ratios = {name: statistics.median(e / t for e, t in zip(times["eager"], ts)) for name, ts in times.items()}
    return {name: (statistics.median(t), ratios[name]) for name, t in times.items()}


def main() -> None:
    from fulmen.launch import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--calls", type=int, default=5)
    opts = vars(parser.parse_args())
    results = run_on_ranks(_rank, opts, world_size=2, timeout=900)
    print(
        f"{opts['branches']} branches of tanh(x @ w) + all_reduce, x {opts['rows']}x{opts['width']}, "
        f"2 ranks (gloo, 1 CPU thread each); median ms per call over {opts['repeats']} repeats"
    )
    for name in results[0]:
        per_rank = [r[name][0] for r in results]
        ratio = min(r[name][1] for r in results)
        print(
            f"  {name:26s} {max(per_rank):8.2f} ms   (ranks: {', '.join(f'{t:.2f}' for t in per_rank)})"
            f"   speedup {ratio:.2f}"
        )
    print("speedup = eager time / fulmen time, the median over repeats of the ratio within a repeat (slower rank)")


if __name__ == "__main__":
    main()
