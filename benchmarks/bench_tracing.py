"""Compile time of a GPT forward: tracing plus every transform and code generation, no kernel compiler.

A 4-layer, 256-wide GPT (``gpt-small`` from ``fulmen.bench.models``; a local copy of the same shape when that
module is missing) is compiled by ``fulmen.jit`` with only the torch executor, under ``torch.no_grad()`` (the
inference pipeline). Each repeat uses a fresh ``fulmen.jit`` wrapper, so nothing is cached between repeats;
the first repeat also pays one-time costs (imports, first use of each symbol) and is shown separately.
Times come from ``fulmen.compile_stats`` and exclude running the compiled program.

Target (issue 2): under 0.3 s.

    python benchmarks/bench_tracing.py
    python benchmarks/bench_tracing.py --training      # also time the training pipeline (autodiff, split)
    python benchmarks/bench_tracing.py --profile 30    # cProfile one compilation, print the top 30 functions
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import fulmen

TARGET_S = 0.3


# ---- a local GPT, used only when fulmen.bench.models is not there ----

class _Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(batch, seq, width))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class _LocalGPT(nn.Module):
    def __init__(self, layers=4, width=256, heads=4, vocab=4096, seq=128):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(layers: int, width: int, batch: int):
    try:
        from fulmen.bench.models import build
    except ImportError:
        model = _LocalGPT(layers=layers, width=width)
        return model, (torch.randint(0, 4096, (batch, 128)),), "local GPT"
    model, make_inputs = build("gpt-small", n_layer=layers, n_embd=width)
    return model, make_inputs(batch), "fulmen.bench.models gpt-small"


def compile_once(model: nn.Module, inputs: tuple, executors, training: bool) -> dict:
    jm = fulmen.jit(model, executors=executors)
    start = time.perf_counter()
    if training:
        jm(*inputs)
    else:
        with torch.no_grad():
            jm(*inputs)
    wall_ms = (time.perf_counter() - start) * 1e3
    stats = fulmen.compile_stats(jm)
    traces = fulmen.last_traces(jm)
    return {
        "compile_ms": stats.last_compile_time_ms,
        "wall_first_call_ms": wall_ms,
        "phases_ms": dict(stats.phase_times_ms),
        "symbols": len(traces[0].bound_symbols),
        "final_symbols": len(traces[-1].bound_symbols),
    }


def report(title: str, runs: list[dict]) -> dict:
    cold, warm = runs[0], runs[1:] or runs
    median = statistics.median(r["compile_ms"] for r in warm)
    phases = sorted({p for r in runs for p in r["phases_ms"]}, key=lambda p: list(runs[-1]["phases_ms"]).index(p)
                    if p in runs[-1]["phases_ms"] else 99)
    print(f"\n{title}: {cold['symbols']} symbols traced, {cold['final_symbols']} in the final trace")
    print(f"{'phase':<24} {'first (ms)':>11} {'median (ms)':>12}")
    for p in phases:
        med = statistics.median(r["phases_ms"].get(p, 0.0) for r in warm)
        print(f"{p:<24} {cold['phases_ms'].get(p, 0.0):>11.1f} {med:>12.1f}")
    print(f"{'total compile':<24} {cold['compile_ms']:>11.1f} {median:>12.1f}")
    print(f"{'first call wall':<24} {cold['wall_first_call_ms']:>11.1f} "
          f"{statistics.median(r['wall_first_call_ms'] for r in warm):>12.1f}   (includes running the program)")
    verdict = "met" if median / 1e3 < TARGET_S else "MISSED"
    print(f"target: < {TARGET_S} s -> median {median / 1e3:.3f} s: {verdict}")
    return {"median_compile_ms": median, "first_compile_ms": cold["compile_ms"], "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--executors", choices=["torch", "default"], default="torch",
                        help="torch: only the torch executor (no kernel compiler); default: fulmen's default list")
    parser.add_argument("--training", action="store_true", help="also time the training pipeline")
    parser.add_argument("--profile", type=int, metavar="N", default=0,
                        help="cProfile one warm compilation and print the N most expensive functions")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)

    executors = [] if args.executors == "torch" else None
    model, inputs, source = make_model(args.layers, args.width, args.batch)
    params = sum(p.numel() for p in model.parameters())
    print(f"{source}: {args.layers} layers, width {args.width}, {params / 1e6:.1f} M parameters, "
          f"input {tuple(inputs[0].shape)}; executors: {args.executors}; torch {torch.__version__}")

    results = {}
    modes = [("inference (torch.no_grad)", False)] + ([("training", True)] if args.training else [])
    for title, training in modes:
        try:
            runs = [compile_once(model, inputs, executors, training) for _ in range(args.repeats)]
        except Exception as e:
            print(f"\n{title}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        results[title] = report(title, runs)

    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        compile_once(model, inputs, executors, False)
        profiler.disable()
        print(f"\ncProfile of one inference compilation (top {args.profile} by cumulative time):")
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(args.profile)
        print(f"top {args.profile} by own time:")
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(args.profile)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
