"""Where the time to a fully compiled training step goes, phase by phase, in fresh Python processes.

Each run is a new interpreter that trains one step of a built-in model (default: llama-1b's code at 2 layers,
width 128, 64 tokens, batch 2, bf16 autocast, one PyTorch thread) under ``fulmen.jit(model, compile="sync")``,
so that the step returns fully compiled. Timers around fulmen's and Inductor's entry points split its wall time:

- ``aten_graph``: fulmen's ``make_fx``-style capture of each region's aten graph (``inductor_graph``);
- ``graph_cache``: fulmen's cache of those graphs (``inductor_graph_cache``: key, load, store), where present;
- ``inductor``: ``compile_fx_inner`` (Inductor's FX graph cache lookup, and on a miss its lowering and codegen),
  less the two below where they run inside it (each timer excludes the timed calls inside it);
- ``isa_probe``: Inductor's vector-instruction probes (``cpu_vec_isa``);
- ``cpp_build``: the C++ build of the batch's kernels (``inductor_cpp.MergedBuild.build``);
- ``other``: the step's rest: fulmen's tracing and transforms, running the step, imports on first use.

``--cache cold`` gives each run an empty Inductor cache directory and temporary directory (no precompiled
headers); ``--cache warm`` first fills one cache directory in an untimed run, then times runs that reuse it.

    python benchmarks/bench_compile_phases.py --cache warm --runs 2
    python benchmarks/bench_compile_phases.py --cache cold --runs 1 --json /tmp/cold.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
import fulmen
from fulmen.bench.models import build, size_overrides
from fulmen.executors import inductor_compile, inductor_cpp, inductor_graph

spent, counts, stack = {}, {}, []

def timed(owner, name, phase):
    # time spent in owner.name, less the time of the timed calls inside it (each second counts once)
    original = getattr(owner, name)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        stack.append(0.0)
        try:
            return original(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            spent[phase] = spent.get(phase, 0.0) + elapsed - stack.pop()
            counts[phase] = counts.get(phase, 0) + 1
            if stack:
                stack[-1] += elapsed
    setattr(owner, name, wrapper)

timed(inductor_graph, "aten_graph", "aten_graph")
timed(inductor_graph, "symbolic_aten_graph", "aten_graph")
timed(inductor_cpp.MergedBuild, "build", "cpp_build")
try:
    from fulmen.executors import inductor_graph_cache
    for name in ("region_key", "load", "store", "rebuild"):
        timed(inductor_graph_cache, name, "graph_cache")
    timed(inductor_compile, "_entry_to_keep", "graph_cache")
except ImportError:
    pass
import torch._inductor.compile_fx as compile_fx, torch._inductor.cpu_vec_isa as vec_isa
timed(compile_fx, "compile_fx_inner", "inductor")
timed(vec_isa.VecISA, "check_build", "isa_probe")

name, n_layer, width, seq_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model, make_inputs = build(name, seed=0, **size_overrides(name, n_layer, width, seq_len))
inputs = make_inputs(2, targets=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
jitted = fulmen.jit(model, compile="sync")
start = time.perf_counter()
with torch.autocast("cpu", dtype=torch.bfloat16):
    _, loss = jitted(*inputs)
loss.backward()
optimizer.step()
total = time.perf_counter() - start
stats = fulmen.executors.inductor.fusion_stats()
row = {"fulmen": fulmen.__file__, "total_s": total, "regions": stats["regions"], "kernels": stats["kernels"],
       "compiled": stats["kernels_compiled"], "captures": counts.get("aten_graph", 0), **spent}
print("FULMEN_PHASES_ROW " + json.dumps(row))
"""

PHASES = ("aten_graph", "graph_cache", "inductor", "isa_probe", "cpp_build", "other")


def run_once(args: argparse.Namespace, cache_dir: str | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="fulmen-bench-phases-") as scratch:
        env = dict(os.environ)
        env.pop("FULMEN_COMPILE", None)
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir or os.path.join(scratch, "inductor")
        if cache_dir is None:  # cold: no precompiled headers either
            env["TMPDIR"] = os.path.join(scratch, "tmp")
            os.makedirs(env["TMPDIR"])
        argv = [sys.executable, "-c", _CHILD, args.model, str(args.n_layer), str(args.width), str(args.seq_len)]
        # run outside the checkout: ``python -c`` puts the working directory ahead of PYTHONPATH on sys.path
        done = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, cwd=scratch)
        for line in done.stdout.splitlines():
            if line.startswith("FULMEN_PHASES_ROW "):
                return _phases(json.loads(line.split(" ", 1)[1]))
        raise RuntimeError(f"the measuring process failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def _phases(row: dict) -> dict:
    for phase in PHASES[:-1]:
        row.setdefault(phase, 0.0)
    row["other"] = row["total_s"] - sum(row[p] for p in PHASES[:-1])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--cache", choices=("cold", "warm"), default="warm")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument(
        "--cache-dir",
        help="with --cache warm: the cache directory to reuse (default: a new one, filled by an untimed run first)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the raw figures to FILE")
    args = parser.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory(prefix="fulmen-bench-phases-warm-") as warm:
        cache_dir = None
        if args.cache == "warm":
            cache_dir = args.cache_dir or warm
            if not args.cache_dir:
                print("filling the cache ...", file=sys.stderr, flush=True)
                fill = run_once(args, cache_dir)
                print(
                    "  filling run (empty Inductor cache, the usual precompiled headers): "
                    + ", ".join(f"{p} {fill[p]:.2f} s" for p in ("total_s", *PHASES)),
                    flush=True,
                )
        for i in range(args.runs):
            print(f"run {i + 1}/{args.runs} ...", file=sys.stderr, flush=True)
            rows.append(run_once(args, cache_dir))
    print(
        f"{args.model} ({args.n_layer} layers, width {args.width}, {args.seq_len} tokens, bf16 autocast) training "
        f"step, compile='sync', {args.cache} cache, median of {args.runs} fresh processes; "
        f"{rows[0]['regions']} regions, {rows[0]['kernels']} kernels, {rows[0]['captures']} graphs captured"
    )
    for phase in ("total_s", *PHASES):
        print(f"  {phase:12s} {statistics.median(r[phase] for r in rows):7.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
