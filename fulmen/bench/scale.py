"""The LLM-scale measurement: training steps of llama-1b and gpt2-124m under eager, ``torch.compile`` (default and
``max-autotune-no-cudagraphs``) and fulmen, each backend in a fresh process, within a time budget.

    python -m fulmen.bench.scale --out gpu-results             # on one CUDA device (benchmarks/gpu_check.sh scale)
    python -m fulmen.bench.scale --out /tmp/scale --toy        # the same code on a CPU at toy size

Writes ``scale.json`` (every row's fields, the environment, each measurement's wall time and limit) and
``scale.md`` (a markdown table) to ``--out``. Every measurement runs ``fulmen bench``'s runner
(``fulmen.bench.runner``) in its own process with empty compiler caches, stopped after its share of the budget
and recorded as timed out; the costly ``max-autotune`` measurements run last, so that a long one cannot crowd out
the others. Model FLOPs and MFU are defined in ``fulmen.bench.flops``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fulmen.bench.flops import device_name, matmul_parameters
from fulmen.bench.models import meta_model, size_overrides
from fulmen.bench.runner import BACKENDS, BenchConfig, BenchRow, add_speedups, run_benchmark

#: Each model's batch: 8,192 tokens a step for both, a usual micro-batch at this size on one 80 GB card.
MODELS = {"llama-1b": 4, "gpt2-124m": 8}
SCALE_BACKENDS = ("eager", "torch.compile", "torch.compile-max-autotune", "fulmen")
#: The most seconds one measurement (a fresh process: import, build, compile, warm-up, timed steps) may take.
TIME_LIMITS_S = {"eager": 90.0, "torch.compile": 180.0, "torch.compile-max-autotune": 180.0, "fulmen": 180.0}
#: A measurement is not started with less than this left of the budget.
MIN_START_S = 30.0
#: --toy: the same code at a size a CPU runs in seconds.
#: One CPU thread: on a shared machine, PyTorch's threads waiting for one another would make the steps' times
#: measure the machine's load.
TOY = {
    "n_layer": 2,
    "width": 128,
    "seq_len": 64,
    "batch_size": 2,
    "device": "cpu",
    "steps": 2,
    "warmup": 1,
    "threads": 1,
}


@dataclass
class Job:
    model: str
    backend: str


def plan(models: Sequence[str], backends: Sequence[str]) -> list[Job]:
    """Measurements in the order they run: every model under the quick backends, then under max-autotune."""
    slow = [b for b in backends if "max-autotune" in b]
    return [Job(m, b) for m in models for b in backends if b not in slow] + [Job(m, b) for b in slow for m in models]


def _config(args: argparse.Namespace, job: Job, timeout_s: float) -> BenchConfig:
    return BenchConfig(
        model=job.model,
        mode="train",
        backend=job.backend,
        steps=args.steps,
        warmup=args.warmup,
        batch_size=args.batch_size or MODELS[job.model],
        device=args.device,
        dtype="bfloat16" if args.precision == "bf16" else "float32",
        isolate=True,
        warm_cache=args.warm_cache,
        threads=args.threads,
        optimizer="adamw-fused",
        n_layer=args.n_layer,
        width=args.width,
        seq_len=args.seq_len,
        autocast=args.precision == "bf16-autocast",
        checkpoint=args.checkpoint,
        interleave=False,
        timeout_s=timeout_s,
    )


def run_scale(args: argparse.Namespace) -> tuple[list[BenchRow], list[dict]]:
    """Every planned measurement within ``args.budget`` seconds; returns the rows and each one's wall time."""
    deadline = time.perf_counter() + args.budget
    rows, jobs = [], []
    for job in plan(args.models, args.backends):
        left = deadline - time.perf_counter()
        limit = min(TIME_LIMITS_S[job.backend] * args.limit_scale, left)
        config = _config(args, job, limit)
        if left < MIN_START_S:
            row = BenchRow(
                model=job.model,
                mode="train",
                backend=job.backend,
                device=config.device,
                dtype=config.dtype,
                batch_size=config.batch_size,
                steps=config.steps,
                precision=config.precision,
                checkpoint=config.checkpoint,
                error=f"not run: {max(left, 0.0):.0f} s of the {args.budget:.0f} s budget left",
            )
            wall = 0.0
        else:
            print(f"[{job.model} {job.backend}] fresh process, at most {limit:.0f} s", file=sys.stderr, flush=True)
            start = time.perf_counter()
            row = run_benchmark(config)
            wall = time.perf_counter() - start
            done = row.error or f"{row.median_ms:.1f} ms/step, {row.tokens_per_s or 0:.0f} tokens/s"
            print(f"[{job.model} {job.backend}] {done} ({wall:.0f} s)", file=sys.stderr, flush=True)
        rows.append(row)
        jobs.append({"model": job.model, "backend": job.backend, "limit_s": round(limit, 1), "wall_s": round(wall, 1)})
    add_speedups(rows)
    return rows, jobs


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def markdown(rows: Sequence[BenchRow], environment: dict) -> str:
    """The results as a markdown table, with the ratios the targets are stated in."""
    compiled = {r.model: r.median_ms for r in rows if r.backend == "torch.compile" and r.median_ms}
    head = (
        "| model | backend | step ms | tokens/s | MFU % | x eager | x torch.compile | peak GiB | first step s "
        "| fully compiled s | host ms | device busy ms | calls per step | max diff | note |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]

    def f(value, spec):
        return "-" if value is None else format(value, spec)

    for r in rows:
        peak = r.peak_mb / 1024 if r.peak_mb is not None else None
        mfu = r.mfu * 100 if r.mfu is not None else None
        cells = [
            r.model,
            r.backend,
            f(r.median_ms, ".1f"),
            f(r.tokens_per_s, ",.0f"),
            f(mfu, ".1f"),
            f(r.speedup, ".2f"),
            f(_ratio(compiled.get(r.model), r.median_ms), ".2f"),
            f(peak, ".2f"),
            f(r.first_result_s, ".1f"),
            f(r.compiled_s, ".1f"),
            f(r.host_ms, ".1f"),
            f(r.device_busy_ms, ".1f"),
            _calls(r.calls_per_step),
            f(r.max_diff, ".1e"),
            r.error or "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    env = environment
    lines += [
        "",
        f"{env['device_name']}; torch {env['torch']}, triton {env['triton']}, fulmen {env['fulmen']}; "
        f"{env['precision']}, fused AdamW, {env['steps']} timed steps after {env['warmup']} warm-up "
        f"(medians), each backend in a fresh process with empty compiler caches. x eager, x torch.compile: "
        f"that backend's step time over the row's (above 1: the row is faster). MFU against the card's "
        f"dense bf16 peak, model FLOPs 6N + 12LHQT per token (fulmen.bench.flops). host ms: until the step's "
        f"Python returned (before synchronizing); device busy ms: the kernels' time in a step (profiler); calls "
        f"per step: fulmen's fused regions + other calls, forward / backward, or torch.compile's graphs "
        f"(fulmen.bench.step_profile).",
    ]
    return "\n".join(lines) + "\n"


def _calls(calls: dict | None) -> str:
    """``4+0 / 3+1`` (fused regions + other calls, forward / backward), ``2 graphs``, or ``-``."""
    if not calls:
        return "-"
    if "graphs" in calls:
        return f"{calls['graphs']} graph{'' if calls['graphs'] == 1 else 's'}"
    parts = [
        f"{calls[f'{p}_regions']}+{calls[f'{p}_other_calls']}"
        for p in ("forward", "backward")
        if f"{p}_regions" in calls
    ]
    return " / ".join(parts)


def parameters(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """Each model's parameters at the size measured: all (each once), and those ``fulmen.bench.flops`` counts."""
    counts = {}
    for name in args.models:
        model = meta_model(name, **size_overrides(name, args.n_layer, args.width, args.seq_len))
        counts[name] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "matmul_parameters": matmul_parameters(model),
        }
    return counts


def environment(args: argparse.Namespace) -> dict:
    import fulmen

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "fulmen": fulmen.__version__,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "device": args.device,
        "device_name": device_name(args.device),
        "precision": args.precision,
        "checkpoint": args.checkpoint,
        "steps": args.steps,
        "warmup": args.warmup,
        "budget_s": args.budget,
        "toy": args.toy,
        "n_layer": args.n_layer,
        "width": args.width,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "models": parameters(args),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fulmen.bench.scale", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for scale.json and scale.md")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--backends", default=",".join(SCALE_BACKENDS), help=f"comma-separated, of {', '.join(BACKENDS)}")
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", choices=("fp32", "bf16", "bf16-autocast"), default="bf16-autocast")
    p.add_argument("--checkpoint", action="store_true", help="recompute each block in the backward")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch-size", type=int, help="for every model (default: MODELS, 8,192 tokens a step)")
    p.add_argument("--n-layer", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument(
        "--budget",
        type=float,
        default=float(os.environ.get("SCALE_BUDGET_S", 450)),
        help="seconds for all measurements (default 450, or $SCALE_BUDGET_S)",
    )
    p.add_argument("--limit-scale", type=float, default=1.0, help="multiplies every per-backend time limit")
    p.add_argument("--warm-cache", action="store_true", help="keep the usual compiler caches")
    p.add_argument("--threads", type=int, help="PyTorch CPU threads of each measurement (default: PyTorch's)")
    p.add_argument("--toy", action="store_true", help="a CPU dry run: " + ", ".join(f"{k}={v}" for k, v in TOY.items()))
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.toy:
        for key, value in TOY.items():
            if getattr(args, key) in (None, parser.get_default(key)):
                setattr(args, key, value)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [m for m in args.models if m not in MODELS] + [b for b in args.backends if b not in TIME_LIMITS_S]
    if bad:
        parser.error(
            f"unknown model or backend {', '.join(map(repr, bad))}; models: {', '.join(MODELS)}; "
            f"backends: {', '.join(TIME_LIMITS_S)}"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    env = environment(args)
    for name, count in env["models"].items():
        print(
            f"{name}: {count['parameters']:,} parameters ({count['matmul_parameters']:,} in matrix products)",
            file=sys.stderr,
            flush=True,
        )
    rows, jobs = run_scale(args)
    table = markdown(rows, env)
    print(table)
    with open(os.path.join(args.out, "scale.json"), "w") as f:
        json.dump({"environment": env, "jobs": jobs, "rows": [r.to_dict() for r in rows]}, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "scale.md"), "w") as f:
        f.write(table)
    return 1 if any(r.error and not r.error.startswith(("timed out", "not run")) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
