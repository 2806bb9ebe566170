"""The ``fulmen`` command: ``fulmen bench``, ``fulmen examine`` and ``fulmen demo``.

    fulmen demo                                     # the README's main job: a GPT traced, compared, timed
    fulmen bench --model gpt-small --mode train --backends eager,torch.compile,fulmen
    fulmen bench --mode generate --prompt-len 16 --new-tokens 16   # HF generate(): first token, decode tokens/s
    fulmen examine --model llama-tiny               # what fulmen made of a model
    fulmen examine mypackage.models:make_example    # make_example() -> (fn_or_module, args[, kwargs])
    fulmen fuzz --seconds 300 --seed 0 --executors torch   # random programs, fulmen vs eager (fulmen.fuzz)

Exit codes: 0 success, 1 a run failed (demo/examine), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import torch

from fulmen.bench.generate import (
    GENERATE_BACKENDS,
    GenerateConfig,
    format_generate_table,
    generate_model_names,
    run_generate,
)
from fulmen.bench.models import CONFIGS, GPTConfig, LlamaConfig, build_any, model_names, size_overrides
from fulmen.bench.runner import (
    BACKENDS,
    DTYPES,
    MODES,
    OPTIMIZERS,
    BenchConfig,
    BenchRow,
    add_speedups,
    combine_repeats,
    run_benchmark,
)
from fulmen.bench.summary import summarize

DEFAULT_BACKENDS = "eager,fulmen"
DEFAULT_GENERATE_BACKENDS = "eager,torch.compile,fulmen,torch.compile-fulmen"
DEFAULT_GENERATE_MODEL = "hf:llama"

# ---------------------------------------------------------------------------------------------------------------
# Progress display and the results table
# ---------------------------------------------------------------------------------------------------------------


class ProgressDisplay:
    """Status lines on stderr: rewritten in place on a terminal, one line per phase otherwise."""

    def __init__(self, stream: TextIO | None = None, *, enabled: bool = True):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_phase: str | None = None

    def run(self, label: str) -> Callable[[str, int | None, int | None], None]:
        self._last_phase = None

        def update(phase: str, done: int | None = None, total: int | None = None) -> None:
            if not self.enabled:
                return
            if self.tty:
                counts = f" {done}/{total} steps" if done is not None and total else ""
                self.stream.write(f"\r\033[K[{label}] {phase}...{counts}")
                self.stream.flush()
            elif phase != self._last_phase:
                counts = f" ({total} steps)" if total and done == 0 else ""
                self.stream.write(f"[{label}] {phase}{counts}...\n")
                self.stream.flush()
            self._last_phase = phase

        return update

    def finish(self, label: str, row: BenchRow) -> None:
        if not self.enabled:
            return
        if row.error:
            text = f"[{label}] failed: {row.error}"
        else:
            text = f"[{label}] done: {row.median_ms:.2f} ms/step, first result {row.first_result_s:.2f} s"
        self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.stream.flush()


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value == float("inf"):
        return "inf"
    return format(value, spec)


def _fmt_mb(mb: float | None) -> str:
    return _fmt(mb, ".1f" if mb is None or mb >= 10 else ".3f")


#: The one ratio convention of fulmen's outputs and docs, stated under every table that shows a ratio.
SPEEDUP = "speedup = eager time / fulmen time (above 1: faster than eager)"
BENCH_SPEEDUP_NOTE = ("speedup = eager time / the row's time, eager's steps interleaved with the row's own in the "
                      "same process (above 1: faster than eager)")


def format_table(rows: Sequence[BenchRow]) -> str:
    """An aligned text table of benchmark rows (numbers right-aligned; errors in the last column)."""
    headers = ["model", "mode", "backend", "median ms", "speedup", "first result s", "compiled s", "peak MB",
               "max diff", "tokens/s", "MFU %", "error"]
    numeric = {3, 4, 5, 6, 7, 8, 9, 10}
    body = []
    for r in rows:
        body.append([r.model, r.mode, r.backend, _fmt(r.median_ms, ".2f"), _fmt(r.speedup, ".2f"),
                     _fmt(r.first_result_s, ".3f"), _fmt(r.compiled_s, ".3f"), _fmt_mb(r.peak_mb),
                     _fmt(r.max_diff, ".1e"), _fmt(r.tokens_per_s, ".0f"),
                     _fmt(r.mfu * 100 if r.mfu is not None else None, ".1f"), r.error or ""])
    # columns no row has a figure in (tokens/s of the MLP, MFU on a CPU) are left out
    keep = [i for i in range(len(headers)) if i not in (9, 10) or any(b[i] != "-" for b in body)]
    headers, body = [headers[i] for i in keep], [[b[i] for i in keep] for b in body]
    numeric = {keep.index(i) for i in numeric if i in keep}
    if not any(r.error for r in rows):
        headers, body = headers[:-1], [b[:-1] for b in body]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(headers)]

    def line(cells):
        out = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(b) for b in body)])


# ---------------------------------------------------------------------------------------------------------------
# Argument parsing
# ---------------------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, but errors raise instead of exiting, so ``main`` can return 2 from within a test."""

    def error(self, message: str):
        raise _UsageError(self, message)


class _UsageError(Exception):
    def __init__(self, parser: argparse.ArgumentParser, message: str):
        super().__init__(message)
        self.parser = parser


def _csv(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}")
        bad = [t for t in items if t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, bad))}; choose from "
                                             f"{', '.join(choices)}")
        return list(dict.fromkeys(items))

    parse.__name__ = what  # argparse names the type in its messages
    return parse


def _int_at_least(minimum: int, kind: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind} integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a {kind} integer, got {value}")
        return value

    parse.__name__ = f"{kind} integer"  # argparse names the type in its messages
    return parse


_positive = _int_at_least(1, "positive")
_non_negative = _int_at_least(0, "non-negative")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fulmen", description="fulmen: a source-to-source compiler for PyTorch programs.")
    sub = parser.add_subparsers(dest="command", metavar="{bench,examine,demo,report,fuzz}", parser_class=_Parser)
    models = model_names()
    parser.subcommands = {"bench": _add_bench(sub, models), "examine": _add_examine(sub, models),
                          "demo": _add_demo(sub, models), "fuzz": _add_fuzz(sub), "report": _add_report(sub, models)}
    return parser


def _add_bench(sub, models: list[str]) -> argparse.ArgumentParser:
    """``fulmen bench``: time built-in models under each backend."""
    bench = sub.add_parser("bench", help="time built-in models under eager, torch.compile and fulmen",
                           description="Benchmark built-in models. Timings are medians of --steps steps after "
                                       "warm-up; first-result and compile times are wall times from wrapping the model "
                                       "(use --isolate for a fresh process per measurement).")
    bench.add_argument("--model", type=_csv(models, "model"),
                       help=f"comma-separated models (default: gpt-small,llama-small,mlp; with --mode generate: "
                            f"{DEFAULT_GENERATE_MODEL}, or one of {','.join(generate_model_names())}; all: "
                            f"{','.join(models)})")
    bench.add_argument("--mode", choices=[*MODES, "both", "generate", "distributed"], default="both",
                       help="inference (forward, no grad), train (forward, backward, optimizer step), both, "
                            "generate (Hugging Face generate(): time to first token and decode tokens/s), or "
                            "distributed (DDP and FSDP2 training step on 2 CPU ranks, fulmen.bench.distributed)")
    bench.add_argument("--backends", type=_csv(list(dict.fromkeys([*BACKENDS, *GENERATE_BACKENDS])), "backend"),
                       help=f"comma-separated backends (default: {DEFAULT_BACKENDS}; available: "
                            f"{','.join(BACKENDS)}; with --mode generate: {DEFAULT_GENERATE_BACKENDS} by default, "
                            f"available: {','.join(GENERATE_BACKENDS)}); torch.compile takes tens of seconds per "
                            "model on a CPU")
    bench.add_argument("--prompt-len", type=_positive, default=32,
                       help="--mode generate: prompt tokens per sequence (default 32)")
    bench.add_argument("--new-tokens", type=_int_at_least(2, "2-or-larger"), default=32,
                       help="--mode generate: tokens generated per sequence (default 32)")
    bench.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw-fused",
                       help="the optimizer of a training step, the same under every backend (default adamw-fused, "
                            "PyTorch's fastest AdamW; adamw: what torch.optim.AdamW picks by itself, a for-loop "
                            "on CPU)")
    bench.add_argument("--steps", type=_positive, default=20, help="timed steps (default 20)")
    bench.add_argument("--warmup", type=_non_negative, default=3,
                       help="untimed steps after the first (default 3; the second always runs, and its result is "
                       "checked against eager's too)")
    bench.add_argument("--batch-size", type=_positive, default=2, help="batch size (default 2)")
    _add_device_args(bench)
    _add_scale_args(bench)
    bench.add_argument("--json", metavar="PATH|-", help="also write results as JSON to PATH ('-': stdout, and the "
                                                        "table goes to stderr)")
    bench.add_argument("--isolate", action="store_true",
                       help="run each measurement in a fresh Python process with empty Inductor caches "
                            "(precompiled headers included), for honest first-call and compile times")
    bench.add_argument("--repeat", type=_positive, default=1, metavar="N",
                       help="with --isolate, measure each row in N fresh processes, taken in turns across backends, "
                            "and show each figure's median (default 1)")
    bench.add_argument("--warm-cache", action="store_true",
                       help="with --isolate, keep the usual Inductor cache and precompiled headers")
    bench.add_argument("--threads", type=_positive, help="torch CPU threads (default: torch's choice)")
    bench.add_argument("--quiet", action="store_true", help="no progress display")
    bench.add_argument("--verbose", action="store_true", help="print tracebacks of failing measurements")
    return bench


#: --precision: (weights' dtype, bfloat16 autocast of the forward)
PRECISIONS = {"fp32": ("float32", False), "bf16": ("bfloat16", False), "bf16-autocast": ("float32", True)}


def _add_scale_args(bench: argparse.ArgumentParser) -> None:
    """The options of LLM-scale runs (``fulmen.bench.scale``): the same model code at any size and precision."""
    bench.add_argument("--n-layer", type=_positive, help="transformer blocks of a built-in GPT or LLaMA")
    bench.add_argument("--width", type=_positive,
                       help="model width of a built-in GPT or LLaMA (a multiple of its head size; heads and LLaMA's "
                            "SwiGLU size follow)")
    bench.add_argument("--seq-len", type=_positive, help="tokens per sequence of a built-in GPT or LLaMA")
    bench.add_argument("--precision", choices=list(PRECISIONS),
                       help="fp32 (the default), bf16 (bfloat16 weights, as --dtype bfloat16) or bf16-autocast "
                            "(float32 master weights, forward under torch.autocast(bfloat16))")
    bench.add_argument("--checkpoint", action="store_true",
                       help="recompute each transformer block in the backward (torch.utils.checkpoint)")
    bench.add_argument("--timeout", type=_positive, metavar="S",
                       help="with --isolate, stop a measurement after S seconds and record it as timed out")


def _scale_config(args: argparse.Namespace) -> dict:
    """BenchConfig fields from the LLM-scale options."""
    return {"n_layer": args.n_layer, "width": args.width, "seq_len": args.seq_len, "checkpoint": args.checkpoint,
            "autocast": args.precision == "bf16-autocast", "timeout_s": args.timeout}


def _check_scale_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    scaled = args.n_layer or args.width or args.seq_len or args.precision or args.checkpoint
    if scaled and args.mode in ("generate", "distributed"):
        raise _UsageError(parser, f"--n-layer, --width, --seq-len, --precision and --checkpoint do not apply to "
                                  f"--mode {args.mode}")
    if args.precision:
        if args.dtype != "float32":
            raise _UsageError(parser, "give --precision or --dtype, not both")
        args.dtype = PRECISIONS[args.precision][0]
    for model in args.model if args.n_layer or args.width or args.seq_len else ():
        try:
            size_overrides(model, args.n_layer, args.width, args.seq_len)
        except ValueError as e:
            raise _UsageError(parser, str(e)) from None
    if args.checkpoint and not all(isinstance(CONFIGS.get(m), (GPTConfig, LlamaConfig)) for m in args.model):
        raise _UsageError(parser, "--checkpoint applies to the built-in GPT and LLaMA models")


def _add_examine(sub, models: list[str]) -> argparse.ArgumentParser:
    """``fulmen examine``: trace a model or function and summarize the trace."""
    examine = sub.add_parser("examine", help="trace a model or function with fulmen and summarize the trace",
                             description="Trace with fulmen.jit and summarize: ops by kind, the executor of each, "
                                         "fallback (opaque) ops, trace and compile times. TARGET is "
                                         "MODULE:FUNCTION, where FUNCTION() returns (fn_or_module, args) or "
                                         "(fn_or_module, args, kwargs); MODULE is a dotted name or a .py path.")
    examine.add_argument("target", nargs="?", metavar="MODULE:FUNCTION")
    examine.add_argument("--model", choices=models, help="a built-in model instead of TARGET")
    examine.add_argument("--mode", choices=MODES, default="inference")
    examine.add_argument("--batch-size", type=_positive, default=2)
    _add_device_args(examine)
    examine.add_argument("--executors", help="comma-separated executor names for fulmen.jit, in priority order "
                                             "(default: fulmen's default executors)")
    examine.add_argument("--trace", action="store_true", help="also print the whole execution trace")
    return examine


def _add_demo(sub, models: list[str]) -> argparse.ArgumentParser:
    """``fulmen demo``: trace a built-in GPT, compare with eager and time both."""
    demo = sub.add_parser("demo", help="the main job: trace a built-in GPT, summarize, compare with eager, time",
                          description="Build a small GPT, compile it with fulmen.jit, print a summary of its trace, "
                                      "compare fulmen's output with eager PyTorch's and time both.")
    demo.add_argument("--model", choices=models, default="gpt-small")
    demo.add_argument("--batch-size", type=_positive, default=2)
    demo.add_argument("--calls", type=_positive, default=10, help="timed calls per backend (default 10)")
    demo.add_argument("--lines", type=_non_negative, default=12, help="execution-trace lines to show (default 12)")
    _add_device_args(demo)
    return demo


def _add_fuzz(sub) -> argparse.ArgumentParser:
    """``fulmen fuzz``: random small programs, fulmen.jit against eager."""
    fuzz = sub.add_parser("fuzz", help="differential fuzzing: random small programs, fulmen.jit against eager",
                          description="Generate random small programs from consecutive seeds, run each eagerly and "
                                      "with fulmen.jit (forward and gradients, first call and cache hit) and print a "
                                      "minimized reproducer for the first mismatch of each kind, then counts.")
    fuzz.add_argument("--seconds", type=_positive, default=60, help="how long to generate programs (default 60)")
    fuzz.add_argument("--seed", type=_non_negative, default=0, help="the first program's seed (default 0)")
    fuzz.add_argument("--executors", choices=["torch", "default"], default="torch",
                      help="torch: executors=['torch']; default: fulmen's default executors, fused regions compiled "
                           "before the call returns (slow on a CPU)")
    fuzz.add_argument("--max-ops", type=_positive, default=6, help="statements per program at most (default 6)")
    fuzz.add_argument("--mode", type=_csv(["extended", "wide", "hunt"], "mode"), default=[],
                      help="comma-separated generator modes: extended (layouts, nn ops), wide (grad-mode regions, "
                           "promotion, out=), hunt (view chains written in place, narrow integers, NaN/inf/-0.0, "
                           "random ops, conv/norm/pool, complex)")
    fuzz.add_argument("--batch", type=_positive, default=1,
                      help="programs checked as one merged program (one compilation for many: use 8-16 with "
                           "--executors default); a failing batch is re-checked program by program")
    fuzz.add_argument("--restyle", action="store_true",
                      help="later calls change the inputs' layouts and dtypes (the cache must tell them apart)")
    fuzz.set_defaults(device="cpu")
    return fuzz


def _add_report(sub, models: list[str]) -> argparse.ArgumentParser:
    """``fulmen report``: one HTML page of what fulmen did with a built-in model."""
    report = sub.add_parser("report", help="write one HTML page showing what fulmen did with a built-in model",
                            description="Compile a built-in model with fulmen.jit, time and profile it against eager "
                                        "PyTorch, and write a self-contained HTML page: the pipeline of traces with "
                                        "their diffs, the fused regions, per-region and per-op times, peak memory, "
                                        f"recompilations. {SPEEDUP}.")
    report.add_argument("--model", choices=models, default="gpt-small")
    report.add_argument("--mode", choices=MODES, default="inference")
    report.add_argument("--batch-size", type=_positive, default=2)
    report.add_argument("--steps", type=_positive, default=10, help="timed steps per backend (default 10)")
    report.add_argument("--executors", help="comma-separated executor names for fulmen.jit, in priority order "
                                            "(default: fulmen's default executors)")
    report.add_argument("--path", default="report.html", help="where to write the page (default report.html)")
    _add_device_args(report)
    return report


def _bench_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill ``--model`` and ``--backends`` by mode, and reject what the mode cannot run."""
    if args.mode == "distributed":  # fulmen.bench.distributed checks its own
        return
    generate = args.mode == "generate"
    if args.model is None:
        args.model = [DEFAULT_GENERATE_MODEL] if generate else ["gpt-small", "llama-small", "mlp"]
    if args.backends is None:
        args.backends = (DEFAULT_GENERATE_BACKENDS if generate else DEFAULT_BACKENDS).split(",")
    models, backends = (generate_model_names(), GENERATE_BACKENDS) if generate else (model_names(), BACKENDS)
    what = "--mode generate" if generate else f"--mode {args.mode}"
    for option, given, known in (("--model", args.model, models), ("--backends", args.backends, backends)):
        bad = [g for g in given if g not in known]
        if bad:
            raise _UsageError(parser, f"argument {option}: {', '.join(map(repr, bad))} cannot run with {what}; "
                                      f"choose from {', '.join(known)}")
    if generate and args.isolate:
        raise _UsageError(parser, "--isolate does not apply to --mode generate (its rows run in this process)")


def _add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")


def _check_device(parser: argparse.ArgumentParser, device: str) -> None:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise _UsageError(parser, f"argument --device: unknown device {device!r}; use cpu or cuda") from None
    if dev.type not in ("cpu", "cuda"):
        raise _UsageError(parser, f"argument --device: fulmen bench runs on cpu or cuda, not {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise _UsageError(parser, "argument --device: CUDA was requested but torch.cuda.is_available() is False")


# ---------------------------------------------------------------------------------------------------------------
# fulmen bench
# ---------------------------------------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    if args.mode == "generate":
        return cmd_bench_generate(args)
    if args.mode == "distributed":
        from fulmen.bench.distributed import cmd_bench_distributed

        return cmd_bench_distributed(args)
    modes = list(MODES) if args.mode == "both" else [args.mode]
    if args.threads:
        torch.set_num_threads(args.threads)  # for the environment line; each measurement sets it too
    progress = ProgressDisplay(enabled=not args.quiet)
    busy = _busy_warning()
    if busy:
        print(busy, file=sys.stderr)
    rows: list[BenchRow] = []
    repeat = args.repeat
    for model in args.model:
        for mode in modes:
            runs: dict[str, list[BenchRow]] = {backend: [] for backend in args.backends}
            for turn in range(repeat):  # in turns, so that a slow spell of a shared machine hits every backend
                for backend in args.backends:
                    label = f"{model} {mode} {backend}" + (f" ({turn + 1}/{repeat})" if repeat > 1 else "")
                    config = BenchConfig(model=model, mode=mode, backend=backend, steps=args.steps,
                                         warmup=args.warmup, batch_size=args.batch_size, device=args.device,
                                         dtype=args.dtype, isolate=args.isolate, warm_cache=args.warm_cache,
                                         threads=args.threads, optimizer=args.optimizer, **_scale_config(args))
                    row = run_benchmark(config, progress.run(label), verbose=args.verbose)
                    progress.finish(label, row)
                    runs[backend].append(row)
            rows += [combine_repeats(r) if repeat > 1 else r[0] for r in runs.values()]
    add_speedups(rows)

    table_stream = sys.stderr if args.json == "-" else sys.stdout
    print(format_table(rows), file=table_stream)
    print(BENCH_SPEEDUP_NOTE + ".", file=table_stream)
    if not args.isolate:
        note = "first-result times measured in one process (caches may be warm; --isolate for fresh processes)"
    elif repeat == 1:
        note = "first-result times from a fresh process per measurement"
    else:
        note = f"every figure the median of {repeat} fresh processes per row"
    if "train" in modes:
        note += f"; every backend's training step ends with the same {args.optimizer} optimizer step"
    print(f"\n{_environment_line(args.device)}; {note}.", file=table_stream)
    if args.json:
        payload = {"environment": _environment(args), "rows": [r.to_dict() for r in rows]}
        text = json.dumps(payload, indent=2, allow_nan=False)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0


def cmd_bench_generate(args: argparse.Namespace) -> int:
    """``fulmen bench --mode generate``: one row per (model, backend), in turns as ``--backends`` lists them."""
    if args.threads:
        torch.set_num_threads(args.threads)
    progress = ProgressDisplay(enabled=not args.quiet)
    busy = _busy_warning()
    if busy:
        print(busy, file=sys.stderr)
    rows = []
    for model in args.model:
        for backend in args.backends:
            label = f"{model} generate {backend}"
            config = GenerateConfig(model=model, backend=backend, prompt_len=args.prompt_len,
                                    new_tokens=args.new_tokens, batch_size=args.batch_size, steps=args.steps,
                                    warmup=args.warmup, device=args.device, dtype=args.dtype, threads=args.threads)
            row = run_generate(config, progress.run(label), verbose=args.verbose)
            if not args.quiet:
                done = row.error or f"first token {row.ttft_ms:.2f} ms, decode {row.decode_tok_s or 0:.1f} tokens/s"
                print(f"[{label}] {'failed: ' if row.error else 'done: '}{done}", file=sys.stderr)
            rows.append(row)
    table_stream = sys.stderr if args.json == "-" else sys.stdout
    print(format_generate_table(rows), file=table_stream)
    load = _load_average()
    print(f"\ngreedy generate(), batch {args.batch_size}, prompt {args.prompt_len} tokens, {args.new_tokens} new "
          f"tokens; medians of {args.steps} steps; first token = generate(max_new_tokens=1); decode tok/s from "
          f"the difference with generate(max_new_tokens={args.new_tokens}); x eager: the row's figure over eager's, "
          f"eager's generations interleaved with the row's; tokens: the first generate's tokens against eager's."
          f"\n{_environment_line(args.device)}"
          + (f"; 1-minute load average {load:.1f} on {os.cpu_count()} cores" if load is not None else "") + ".",
          file=table_stream)
    if args.json:
        env = {**_environment(args), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
        text = json.dumps({"environment": env, "rows": [r.to_dict() for r in rows]}, indent=2, allow_nan=False)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 1 if any(r.error or r.tokens_match is False for r in rows) else 0


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _busy_warning() -> str | None:
    load, cores = _load_average(), os.cpu_count() or 1
    if load is not None and load > 0.75 * cores:
        return (f"warning: the machine is busy (1-minute load average {load:.1f} on {cores} cores); CPU timings "
                "will be noisy, and multi-threaded eager kernels suffer most")
    return None


def _environment(args: argparse.Namespace) -> dict:
    import fulmen

    env = {"fulmen": fulmen.__version__, "torch": torch.__version__, "python": sys.version.split()[0],
           "device": args.device, "dtype": args.dtype, "cpu_threads": torch.get_num_threads(),
           "isolate": bool(args.isolate), "repeat": args.repeat, "batch_size": args.batch_size, "steps": args.steps,
           "warmup": args.warmup, "optimizer": args.optimizer, "cpu_count": os.cpu_count(),
           "load_average_1min": _load_average()}
    if args.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
    return env


def _environment_line(device: str) -> str:
    where = torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU, {torch.get_num_threads()} threads"
    return f"torch {torch.__version__}, {where}"


# ---------------------------------------------------------------------------------------------------------------
# fulmen examine / fulmen demo: trace summaries
# ---------------------------------------------------------------------------------------------------------------


def _load_target(target: str) -> tuple[Any, tuple, dict]:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:FUNCTION, got {target!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        spec = importlib.util.spec_from_file_location("_fulmen_examine_target", module_name)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot load {module_name!r} as a Python file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{module_name!r} has no callable named {attr!r}")
    made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3) or not callable(made[0]):
        raise ValueError(f"{target}() must return (fn_or_module, args) or (fn_or_module, args, kwargs)")
    fn, fn_args = made[0], tuple(made[1])
    kwargs = dict(made[2]) if len(made) == 3 else {}
    return fn, fn_args, kwargs


def _finish_background_compilation(jitted: Any, call: Callable[[], Any], start: float, *,
                                   limit_s: float = 300.0) -> float | None:
    """Keep calling until no region of ``jitted`` is still compiling in the background; the seconds since
    ``start`` when that happened, or None when nothing was compiling."""
    from fulmen.bench.runner import BACKENDS

    pending = BACKENDS["fulmen"].pending
    if pending(jitted) == 0:
        return None
    print(f"   ({pending(jitted)} fused regions compiling in the background; calling until they are ready)")
    while pending(jitted):
        if time.perf_counter() - start > limit_s:
            print(f"   (still compiling after {limit_s:.0f} s; continuing without waiting)")
            return None
        call()
        time.sleep(0.05)
    return time.perf_counter() - start


def _resolve_executor_names(text: str) -> list:
    """Executors by name; a name not yet registered is looked for as the module ``fulmen.executors.<name>``."""
    from fulmen.executors.base import get_all_executors, get_executor

    names = [n.strip() for n in text.split(",") if n.strip()]
    result = []
    for n in names:
        if n not in {e.name for e in get_all_executors()}:
            try:
                importlib.import_module(f"fulmen.executors.{n}")
            except ImportError:
                pass
        result.append(get_executor(n))  # raises ValueError naming the registered executors
    return result


def cmd_examine(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import fulmen

    if (args.target is None) == (args.model is None):
        raise _UsageError(parser, "give either MODULE:FUNCTION or --model NAME (exactly one)")
    train = args.mode == "train"
    if args.model is not None:
        model, make_inputs = build_any(args.model, device=args.device, dtype=DTYPES[args.dtype])
        model.train(train)
        fn, fn_args, kwargs, name = model, make_inputs(args.batch_size, targets=train), {}, args.model
    else:
        try:
            fn, fn_args, kwargs = _load_target(args.target)
        except (ImportError, ValueError, OSError) as e:
            raise _UsageError(parser, f"cannot load {args.target}: {e}") from None
        name = args.target
    executors = None
    if args.executors:
        try:
            executors = _resolve_executor_names(args.executors)
        except ValueError as e:
            raise _UsageError(parser, f"argument --executors: {e}") from None
    jitted = fulmen.jit(fn, executors=executors)
    start = time.perf_counter()
    try:
        with torch.set_grad_enabled(train):
            result = jitted(*fn_args, **kwargs)
            if train:
                loss = result[1] if isinstance(result, tuple) else result
                loss.backward()
    except Exception as e:
        print(f"fulmen examine: tracing {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"{name}: first call took {time.perf_counter() - start:.2f} s")
    if not train:
        with torch.no_grad():
            done = _finish_background_compilation(jitted, lambda: jitted(*fn_args, **kwargs), start)
        if done is not None:
            print(f"{name}: fully compiled {done:.2f} s after the first call started")
    summarize(jitted, name=name)
    if args.trace:
        print()
        print(fulmen.last_traces(jitted)[-1])
    return 0


def _trace_body(text: str) -> list[str]:
    """The lines of a printed trace from its ``def`` on, without comments (argument types, decompositions)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.startswith("def ")), 0)
    body = lines[start + 1:]
    skip = 0
    while skip < len(body) and body[skip].startswith("  # "):
        skip += 1
    # Decompositions print as comments indented under their op; the excerpt keeps the ops themselves.
    return lines[start:start + 1] + [ln for ln in body[skip:] if not ln.lstrip().startswith("#")]


def _median_call_ms(fns: Sequence[Callable[[], Any]], calls: int, device: torch.device) -> list[float]:
    """Median ms per call of each function; calls alternate between them so that load from other processes on
    the machine affects every function alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(calls):
        for fn, bucket in zip(fns, times):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            bucket.append(time.perf_counter() - t0)
    return [statistics.median(b) * 1e3 for b in times]


def cmd_report(args: argparse.Namespace) -> int:
    import fulmen

    device = torch.device(args.device)
    model, make_inputs = build_any(args.model, device=device, dtype=DTYPES[args.dtype])
    train = args.mode == "train"
    model.train(train)
    inputs = make_inputs(args.batch_size, targets=True) if train else make_inputs(args.batch_size)
    options = {"executors": _resolve_executor_names(args.executors)} if args.executors else {}
    with torch.set_grad_enabled(train):
        # a training step's backward starts from the loss, the second output of the built-in models
        path = fulmen.report(model, *inputs, path=args.path, steps=args.steps, backward=train,
                             loss=(lambda out: out[1]) if train else None, **options)
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB): open it in a browser")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import fulmen

    device = torch.device(args.device)
    model, make_inputs = build_any(args.model, device=device, dtype=DTYPES[args.dtype])
    model.eval()
    (idx,) = make_inputs(args.batch_size)
    n_params = sum(p.numel() for p in model.parameters())
    cfg = CONFIGS.get(args.model, "a Hugging Face config")
    print(f"== {args.model}: {n_params / 1e6:.2f} M parameters, {type(model).__name__}, {cfg}")
    what = "token ids" if idx.dtype == torch.long else "a batch"
    print(f"   input: {what} {tuple(idx.shape)} on {device}, {args.dtype}, inference (torch.no_grad)\n")

    jitted = fulmen.jit(model)
    with torch.no_grad():
        start = time.perf_counter()
        try:
            got = jitted(idx)
        except Exception as e:
            print(f"fulmen.jit failed on {args.model}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        first_s = time.perf_counter() - start
        print(f"== fulmen.jit(model): first call (trace, transforms, codegen, run) took {first_s:.2f} s")
        done = _finish_background_compilation(jitted, lambda: jitted(idx), start)
        if done is not None:
            print(f"   fully compiled {done:.2f} s after the first call started")
        summarize(jitted, name=args.model)
        final = fulmen.last_traces(jitted)[-1]
        shown = _trace_body(str(final))
        print(f"\n== execution trace, first {min(args.lines, len(shown))} of {len(shown)} lines, decompositions "
              "left out (print(fulmen.last_traces(model)[-1]) shows all):")
        for ln in shown[:args.lines]:
            print("   " + (ln if len(ln) <= 150 else ln[:147] + "..."))

        expected = model(idx)
        diff = (got.float() - expected.float()).abs().max().item()
        tol = 1e-4 if DTYPES[args.dtype] == torch.float32 else 5e-2
        verdict = "OK" if diff <= tol else "MISMATCH"
        print(f"\n== fulmen vs eager: max abs difference of the outputs {diff:.2e} (tolerance {tol:.0e}): {verdict}")

        warm = 2
        for _ in range(warm):
            model(idx), jitted(idx)
        eager_ms, fulmen_ms = _median_call_ms([lambda: model(idx), lambda: jitted(idx)], args.calls, device)
    print(f"== median time per call over {args.calls} calls, interleaved: eager {eager_ms:.2f} ms, fulmen "
          f"{fulmen_ms:.2f} ms; speedup {eager_ms / fulmen_ms:.2f} ({SPEEDUP})")
    print("   a picture of what fulmen did: fulmen report --model " + args.model)
    return 0 if verdict == "OK" else 1


# ---------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fulmen`` console script; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        sub = parser.subcommands[args.command]
        _check_device(sub, args.device)
        if args.command == "bench":
            _bench_defaults(sub, args)
            if args.warm_cache and not args.isolate:
                raise _UsageError(sub, "--warm-cache only applies with --isolate")
            if args.repeat > 1 and not args.isolate:
                raise _UsageError(sub, "--repeat only applies with --isolate (in one process, every call after the "
                                       "first finds warm caches)")
            if args.timeout and not args.isolate:
                raise _UsageError(sub, "--timeout only applies with --isolate (a measurement in this process cannot "
                                       "be stopped)")
            _check_scale_args(sub, args)
            return cmd_bench(args)
        if args.command == "examine":
            return cmd_examine(args, sub)
        if args.command == "report":
            return cmd_report(args)
        if args.command == "fuzz":
            from fulmen.fuzz import run_fuzz

            summary = run_fuzz(args.seconds, seed=args.seed, executors=args.executors, max_ops=args.max_ops,
                               modes=tuple(args.mode), batch=args.batch, restyle=args.restyle)
            return 1 if summary.mismatches else 0
        return cmd_demo(args)
    except _UsageError as e:
        e.parser.print_usage(sys.stderr)
        print(f"{e.parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
