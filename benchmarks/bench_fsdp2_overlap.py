"""FSDP2 training step with and without communication overlap: gpt-small on 2 CPU ranks (gloo), one process each.

Compared in one run, each rank holding all three models at once and timing them in turns (round robin), so that
load drifts hit all alike:

- eager: ``fully_shard`` on each block, then on the model (FSDP2's own hooks and collectives);
- fulmen, no overlap: ``fulmen.jit(model, compile="sync", overlap_communication=False)``: each unit's all-gather
  started and waited for where the unit begins, each reduce-scatter waited for where it was started;
- fulmen, overlap: the same with ``overlap_communication=True``: each unit's all-gather started while the unit
  before it computes (one in flight), each reduce-scatter started when its unit's gradients are complete and
  waited for at the end of the backward.

A step is forward, backward and an SGD step on batches that differ by rank. Reported per rank: the median step
time over the repeats, the peak memory (``fulmen.bench.memory``'s CPU measure: the tensors the step starts with,
this rank's shards, plus the step's peak allocations), and, from a profile of one step on the rank's main thread,
where the communication went: the collectives started, the time some collective was in flight while the thread
computed (communication hidden behind computation) and the time the thread was blocked in ``wait_tensor``
(communication not hidden). For fulmen, "traces MB" is what rank 0's forward and backward execution traces hold at
their peak (``fulmen.transforms.liveness.peak_live``: the schedule's own cost, without the allocator's noise).

    python benchmarks/bench_fsdp2_overlap.py
    python benchmarks/bench_fsdp2_overlap.py --repeats 15 --batch-size 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

VARIANTS = {"eager": None, "fulmen, no overlap": False, "fulmen, overlap": True}


def _make_step(overlap: bool | None, batch_size: int, rank: int):
    from torch.distributed.fsdp import fully_shard

    import fulmen
    from fulmen.bench.models import build

    model, make_inputs = build("gpt-small", seed=0)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    wrapped = model if overlap is None else fulmen.jit(model, compile="sync", overlap_communication=overlap)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    idx, targets = make_inputs(batch_size, targets=True)
    idx = (idx + rank) % model.config.vocab_size  # each rank its own batch

    def step():
        _, loss = wrapped(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, model, opt, (idx, targets), wrapped


def _communication_profile(step) -> dict:
    """One step profiled: collectives started, ms some collective was in flight outside ``wait_tensor`` (hidden
    behind computation), ms blocked in ``wait_tensor``. Each start has one wait, so the number in flight is the
    starts minus the waits finished so far; no pairing of starts with waits is needed."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = []
    for e in prof.events():  # all on the calling thread: fulmen's forward and (CPU) backward code starts and waits
        if e.name.endswith("c10d_functional::wait_tensor"):
            events.append((e.time_range.start, "wait_start"))
            events.append((e.time_range.end, "wait_end"))
        elif "c10d_functional::" in e.name and e.name.rsplit("::", 1)[-1] in (
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "all_reduce",
        ):
            events.append((e.time_range.end, "start"))
    events.sort()
    in_flight = starts = 0
    hidden = blocked = 0.0
    last = None
    waiting = False
    for t, kind in events:
        if last is not None and in_flight and not waiting:
            hidden += t - last
        if waiting:
            blocked += t - last
        last = t
        if kind == "start":
            in_flight += 1
            starts += 1
        elif kind == "wait_start":
            waiting = True
        else:
            waiting = False
            in_flight -= 1
    return {"collectives": starts, "hidden_ms": hidden / 1e3, "blocked_ms": blocked / 1e3}


def _schedule_peaks(wrapped) -> tuple[float, float]:
    """MB the forward's and the backward's execution traces hold at their peak (``fulmen.transforms.liveness``):
    what the schedule itself costs, read off the traces."""
    import fulmen
    from fulmen.transforms.liveness import peak_live

    traces = (fulmen.last_traces(wrapped)[-1], fulmen.last_backward_traces(wrapped)[-1])
    return tuple(peak_live(t).bytes / 2**20 for t in traces)


def _rank(rank: int, world_size: int, opts: dict) -> dict:
    from fulmen.bench.memory import cpu_step_peak_bytes, state_tensors, tensor_bytes
    from fulmen.executors import inductor

    steps = {name: _make_step(overlap, opts["batch_size"], rank) for name, overlap in VARIANTS.items()}
    losses = {}
    for name, (step, *_) in steps.items():
        for _ in range(1 + opts["warmup"]):
            losses[name] = step().item()
    inductor.wait_for_compilations()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(opts["repeats"]):
        for name, (step, *_) in steps.items():
            torch.distributed.barrier()  # the ranks start each measurement together
            start = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - start) * 1e3)
    out = {}
    for name, (step, model, opt, inputs, wrapped) in steps.items():
        held = [t.to_local() if hasattr(t, "to_local") else t for t in state_tensors(model, opt, inputs)]
        torch.distributed.barrier()
        peak = tensor_bytes(held) + cpu_step_peak_bytes(step)
        torch.distributed.barrier()
        profile = _communication_profile(step) if VARIANTS[name] is not None else None
        out[name] = {
            "step_ms": statistics.median(times[name]),
            "peak_mb": peak / 2**20,
            "loss": losses[name],
            "profile": profile,
            "schedule_mb": _schedule_peaks(wrapped) if VARIANTS[name] is not None else None,
        }
    return out


def main() -> None:
    from fulmen.launch import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2)
    opts = vars(parser.parse_args())
    results = run_on_ranks(_rank, opts, world_size=2, timeout=1800)
    print(
        f"gpt-small FSDP2 training step, 2 ranks (gloo, 1 CPU thread each), batch {opts['batch_size']} per rank; "
        f"median ms over {opts['repeats']} steps, timed in turns"
    )
    print(
        f"{'':20s} {'step ms (per rank)':>20s} {'peak MB (per rank)':>20s} {'loss':>8s} {'traces MB':>12s}   "
        "collectives, ms in flight while computing / ms blocked in waits (per rank)"
    )
    for name in VARIANTS:
        rows = [r[name] for r in results]
        step = " / ".join(f"{r['step_ms']:.1f}" for r in rows)
        peak = " / ".join(f"{r['peak_mb']:.1f}" for r in rows)
        comm = ""
        if rows[0]["profile"] is not None:
            comm = f"{rows[0]['profile']['collectives']}, " + " ; ".join(
                f"{r['profile']['hidden_ms']:.1f} / {r['profile']['blocked_ms']:.1f}" for r in rows
            )
        sched = rows[0]["schedule_mb"]
        sched = f"{sched[0]:.1f} / {sched[1]:.1f}" if sched is not None else ""
        print(f"{name:20s} {step:>20s} {peak:>20s} {rows[0]['loss']:8.4f} {sched:>12s}   {comm}")
    print(f"1-minute load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
