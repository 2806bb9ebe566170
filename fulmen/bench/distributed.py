"""``fulmen bench --mode distributed``: a data-parallel training step on N local CPU ranks (gloo).

Each row is one wrapper (DDP, or FSDP2's ``fully_shard``) under one backend, with the model wrapped as a user
of that backend would write it:

- ``eager``: ``DDP(model)``; ``fully_shard`` on each block, then on the model;
- ``torch.compile``: ``torch.compile(DDP(model))``; ``torch.compile(model)`` after ``fully_shard``;
- ``fulmen``: ``fulmen.jit(DDP(model))`` (DDP's forward runs eagerly around the compiled model on every call);
  ``fulmen.jit(model)`` after ``fully_shard``.

A step is forward, backward and an SGD step, on batches that differ by rank. Every row runs in the same
``world_size`` processes (``fulmen.launch.run_on_ranks``), one after another; the step time is the median over
``steps`` timed steps, taken per rank, and the peak memory is ``fulmen.bench.memory``'s CPU measure of one more
step, per rank (the tensors the step starts with, this rank's shards for FSDP2, plus the step's peak allocations;
DDP's gradient buckets, allocated when DDP is built, are not counted). A row that fails on a rank shows its error
instead of numbers.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch

DIST_WRAPPERS = ("ddp", "fsdp2")
DIST_BACKENDS = ("eager", "torch.compile", "fulmen")


@dataclass
class DistConfig:
    model: str = "gpt-small"
    wrappers: tuple[str, ...] = DIST_WRAPPERS
    backends: tuple[str, ...] = DIST_BACKENDS
    world_size: int = 2
    steps: int = 10
    warmup: int = 2
    batch_size: int = 2
    threads: int = 1
    timeout: float = 1800.0


@dataclass
class DistRow:
    wrapper: str
    backend: str
    step_ms: list[float | None] = field(default_factory=list)  # per rank
    peak_mb: list[float | None] = field(default_factory=list)
    loss: float | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _wrap(model: torch.nn.Module, wrapper: str, backend: str):
    import fulmen

    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        if backend == "fulmen":
            return fulmen.jit(DDP(model), compile="sync")
        return torch.compile(DDP(model)) if backend == "torch.compile" else DDP(model)
    from torch.distributed.fsdp import fully_shard

    blocks = model.layers if hasattr(model, "layers") else model.transformer.h  # Llama, GPT
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    if backend == "fulmen":
        return fulmen.jit(model, compile="sync")
    return torch.compile(model) if backend == "torch.compile" else model


def _one_row(rank: int, config: DistConfig, wrapper: str, backend: str) -> dict:
    from fulmen.bench.memory import cpu_step_peak_bytes, state_tensors, tensor_bytes
    from fulmen.bench.models import build

    model, make_inputs = build(config.model, seed=0)
    wrapped = _wrap(model, wrapper, backend)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    idx, targets = make_inputs(config.batch_size, targets=True)
    idx, targets = (idx + rank) % model.config.vocab_size, targets  # each rank its own batch

    def step():
        _, loss = wrapped(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(1 + config.warmup):
        loss = step()
    times = []
    for _ in range(config.steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    # as fulmen bench's other modes count it: what the step starts holding (this rank's shard of a DTensor), plus
    # the step's peak net allocations
    held = [t.to_local() if hasattr(t, "to_local") else t for t in state_tensors(model, opt, (idx, targets))]
    peak = tensor_bytes(held) + cpu_step_peak_bytes(step)
    return {"step_ms": statistics.median(times) * 1e3, "peak_mb": peak / 2**20, "loss": loss.item()}


def _rank_rows(rank: int, world_size: int, config: DistConfig) -> list[dict]:
    """On each rank: every (wrapper, backend) row in turn; a failing row records its error and the next one runs."""
    out = []
    for wrapper in config.wrappers:
        for backend in config.backends:
            try:
                out.append(_one_row(rank, config, wrapper, backend))
            except Exception as e:  # noqa: BLE001  (the row shows it)
                line = str(e).strip().splitlines()[0] if str(e).strip() else ""
                out.append({"error": f"{type(e).__name__}: {line}"[:300], "trace": traceback.format_exc()})
            torch._dynamo.reset()
    return out


def run_distributed(config: DistConfig) -> list[DistRow]:
    """The rows of ``config``, measured on ``config.world_size`` spawned local ranks."""
    from fulmen.launch import run_on_ranks

    per_rank = run_on_ranks(
        _rank_rows, config, world_size=config.world_size, timeout=config.timeout, threads=config.threads
    )
    rows = []
    names = [(w, b) for w in config.wrappers for b in config.backends]
    for i, (wrapper, backend) in enumerate(names):
        results = [r[i] for r in per_rank]
        row = DistRow(wrapper, backend)
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            row.error = errors[0]
        else:
            row.step_ms = [r["step_ms"] for r in results]
            row.peak_mb = [r["peak_mb"] for r in results]
            row.loss = results[0]["loss"]
        rows.append(row)
    return rows


def format_distributed_table(rows: list[DistRow]) -> str:
    lines = [f"{'wrapper':<8} {'backend':<14} {'step ms (per rank)':<22} {'peak MB (per rank)':<22} {'loss':>8}"]
    for r in rows:
        if r.error:
            lines.append(f"{r.wrapper:<8} {r.backend:<14} failed: {r.error}")
            continue
        steps = " / ".join(f"{t:.1f}" for t in r.step_ms)
        peaks = " / ".join(f"{m:.1f}" for m in r.peak_mb)
        lines.append(f"{r.wrapper:<8} {r.backend:<14} {steps:<22} {peaks:<22} {r.loss:>8.4f}")
    return "\n".join(lines)


def cmd_bench_distributed(args) -> int:
    """``fulmen bench --mode distributed``: the table of ``run_distributed`` for each ``--model``."""
    from fulmen.bench.models import CONFIGS, MLPConfig

    models = args.model or ["gpt-small"]
    backends = tuple(args.backends or DIST_BACKENDS)
    bad = [m for m in models if m not in CONFIGS or isinstance(CONFIGS[m], MLPConfig)]
    bad += [b for b in backends if b not in DIST_BACKENDS]
    if bad:
        print(
            f"fulmen bench --mode distributed: cannot run {', '.join(map(repr, bad))}; models: the built-in GPT "
            f"and LLaMA ones, backends: {', '.join(DIST_BACKENDS)}",
            file=sys.stderr,
        )
        return 2
    failed = False
    for model in models:
        config = DistConfig(
            model=model,
            backends=backends,
            steps=args.steps,
            warmup=args.warmup,
            batch_size=args.batch_size,
            threads=args.threads or 1,
        )
        rows = run_distributed(config)
        failed |= any(r.error for r in rows)
        print(
            f"{model}, {config.world_size} CPU ranks (gloo), {config.threads} thread(s) per rank, batch "
            f"{config.batch_size} per rank; medians of {config.steps} steps (forward, backward, SGD step)"
        )
        print(format_distributed_table(rows))
        print(f"1-minute load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    return 1 if failed else 0
