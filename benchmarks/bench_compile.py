"""Where a cold Inductor compilation of a training step goes, measured in fresh Python processes.

Each run is a new interpreter with an empty Inductor cache directory and, unless ``--warm-headers``, a fresh
temporary directory (Inductor keeps its precompiled C++ headers under ``<tmp>/torchinductor_<user>``). The
child imports torch and fulmen, times importing Dynamo and Inductor, then runs one training step of a built-in
model under ``fulmen.jit(model, compile="sync")``, timing each region's compilation, and counts the C++
libraries Inductor built. Figures are medians over the runs.

It answers "why does fully compiling take this long" with numbers the team can rerun: the fixed cost of
Inductor's imports, the precompiled headers' first build, and how the rest splits across fulmen's shared
kernels. ``fulmen bench`` gives the end-to-end comparison with eager and ``torch.compile``.

    python benchmarks/bench_compile.py                          # gpt-small, 3 runs, cold headers
    python benchmarks/bench_compile.py --model llama-small --warm-headers --runs 1
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
import glob, json, os, sys, time
import torch, fulmen
from fulmen.bench.models import build_any
from fulmen.executors import inductor_compile

t0 = time.perf_counter()
import torch._dynamo
import torch._inductor.compile_fx
imports = time.perf_counter() - t0

kernels = []
compile_batch = inductor_compile._compile
def timed(jobs):
    start = time.perf_counter()
    try:
        return compile_batch(jobs)
    finally:
        kernels.append(time.perf_counter() - start)
inductor_compile._compile = timed

model, make_inputs = build_any(sys.argv[1], seed=0)
model.train(True)
inputs = make_inputs(2, targets=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
jitted = fulmen.jit(model, compile="sync")
start = time.perf_counter()
_, loss = jitted(*inputs)
loss.backward()
optimizer.step()
first_step = time.perf_counter() - start
libraries = len(glob.glob(os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "**", "*.so"), recursive=True))
row = {"imports_s": imports, "first_step_s": first_step, "kernels_s": kernels, "libraries": libraries,
       "isa_probe_skipped": inductor_compile._vector_isa_known()}
print("FULMEN_COMPILE_ROW " + json.dumps(row))
"""


def run_once(model: str, warm_headers: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="fulmen-bench-compile-") as scratch:
        env = dict(os.environ)
        env.pop("FULMEN_COMPILE", None)
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(scratch, "inductor")
        if not warm_headers:
            env["TMPDIR"] = os.path.join(scratch, "tmp")
            os.makedirs(env["TMPDIR"])
        done = subprocess.run([sys.executable, "-c", _CHILD, model], capture_output=True, text=True, env=env,
                              stdin=subprocess.DEVNULL)
        for line in done.stdout.splitlines():
            if line.startswith("FULMEN_COMPILE_ROW "):
                return json.loads(line.split(" ", 1)[1])
        raise RuntimeError(f"the measuring process failed (exit {done.returncode}):\n{done.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small", help="a built-in model (default gpt-small)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warm-headers", action="store_true",
                        help="keep Inductor's precompiled headers from earlier runs (the usual case after the first "
                             "compilation on a machine)")
    parser.add_argument("--json", metavar="FILE", help="also write the raw figures to FILE")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")

    rows = []
    for i in range(args.runs):
        print(f"run {i + 1}/{args.runs} ...", file=sys.stderr, flush=True)
        rows.append(run_once(args.model, args.warm_headers))

    def med(key):
        return statistics.median(r[key] for r in rows)

    n_kernels = len(rows[0]["kernels_s"])
    per_kernel = [statistics.median(r["kernels_s"][k] for r in rows) for k in range(n_kernels)]
    headers = "warm" if args.warm_headers else "cold"
    print(f"{args.model} training step, compile='sync', precompiled headers {headers}, median of {args.runs} "
          f"fresh processes")
    print(f"  first step (everything compiled):  {med('first_step_s'):6.2f} s")
    print(f"  importing Dynamo and Inductor:     {med('imports_s'):6.2f} s  (before the step, not in it)")
    print(f"  shared kernels compiled:           {n_kernels:6d}    "
          + ", ".join(f"{s:.2f} s" for s in per_kernel)
          + ("" if args.warm_headers else "  (parsing the headers until the precompiled one is built beside them)"))
    print(f"  C++ libraries Inductor built:      {int(med('libraries')):6d}")
    print(f"  vector-ISA probe skipped:          {'yes' if rows[0]['isa_probe_skipped'] else 'no'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "warm_headers": args.warm_headers, "runs": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
