"""Where a training step's time goes, phase by phase, for eager and fulmen, each in its own process.

A step is ``zero_grad``, forward, ``loss.backward()`` and the optimizer's step, as in ``fulmen bench --mode train``
(the same ``--optimizer`` choices, fused AdamW by default).
Each backend runs in a fresh Python process (``compile="sync"``, so every region is compiled before timing)
and times each phase of every step, counting the minor page faults each phase takes (``getrusage``). The
processes take turns, eager then fulmen, for ``--rounds`` rounds; figures are medians over a process's steps,
then the median over rounds.

Why separate processes: in one process the backends share glibc's heap, so the memory one of them frees,
keeps or returns to the kernel changes how often the other faults pages in. ``fulmen bench`` interleaves
steps in one process for its speed-up column (machine noise hits both alike); this script shows what each
backend does on its own, and where (a page fault costs about 1-2 us, zeroing included: 2,000 a step is
2-4 ms on a 2-core CPU).

    python benchmarks/bench_step_phases.py                       # gpt-small, batch 2, 3 rounds
    python benchmarks/bench_step_phases.py --model llama-small --rounds 5 --steps 60
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PHASES = ("zero_grad", "forward", "backward", "optimizer")

_CHILD = r"""
import json, resource, statistics, sys, time
import torch, fulmen
from fulmen.bench.models import build_any
from fulmen.bench.runner import OPTIMIZERS

backend, model_name, optimizer_name = sys.argv[1:4]
batch, warmup, steps = (int(a) for a in sys.argv[4:7])
model, make_inputs = build_any(model_name, seed=0)
model.train(True)
inputs = make_inputs(batch, targets=True)
optimizer = OPTIMIZERS[optimizer_name](model.parameters())
run = model if backend == "eager" else fulmen.jit(model, compile="sync")
phases = ("zero_grad", "forward", "backward", "optimizer")
times = {p: [] for p in phases}
faults = {p: [] for p in phases}

def step(record):
    outputs = None  # (logits, loss), both alive until the step ends, as in fulmen bench's step
    def forward():
        nonlocal outputs
        outputs = run(*inputs)
    actions = (lambda: optimizer.zero_grad(set_to_none=True), forward, lambda: outputs[1].backward(), optimizer.step)
    for phase, action in zip(phases, actions):
        t0, f0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        action()
        if record:
            times[phase].append((time.perf_counter() - t0) * 1e3)
            faults[phase].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)

for _ in range(warmup):
    step(False)
for _ in range(steps):
    step(True)
row = {"ms": {p: statistics.median(times[p]) for p in phases},
       "faults": {p: statistics.median(faults[p]) for p in phases},
       "step_ms": statistics.median([sum(times[p][i] for p in phases) for i in range(steps)]),
       "step_faults": statistics.median([sum(faults[p][i] for p in phases) for i in range(steps)])}
print("FULMEN_PHASES_ROW " + json.dumps(row))
"""


def run_once(backend: str, args) -> dict:
    env = dict(os.environ)
    env.pop("FULMEN_COMPILE", None)
    cmd = [sys.executable, "-c", _CHILD, backend, args.model, args.optimizer,
           str(args.batch_size), str(args.warmup), str(args.steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    for line in done.stdout.splitlines():
        if line.startswith("FULMEN_PHASES_ROW "):
            return json.loads(line.split(" ", 1)[1])
    raise RuntimeError(f"the measuring process for {backend} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--optimizer", default="adamw-fused", help="a key of fulmen.bench.runner.OPTIMIZERS")
    parser.add_argument("--rounds", type=int, default=3, help="processes per backend, taken in turns")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per process")
    parser.add_argument("--json", help="write every round's figures to this file")
    args = parser.parse_args()

    backends = ("eager", "fulmen")
    rounds: dict[str, list[dict]] = {b: [] for b in backends}
    for r in range(args.rounds):
        for b in backends:
            print(f"[round {r + 1}/{args.rounds}] {b}...", file=sys.stderr, flush=True)
            rounds[b].append(run_once(b, args))

    def med(b: str, *path: str) -> float:
        values = []
        for row in rounds[b]:
            for key in path:
                row = row[key]
            values.append(row)
        return statistics.median(values)

    print(f"{args.model} train, batch {args.batch_size}, {args.optimizer}: medians over {args.rounds} processes per "
          f"backend, {args.steps} steps each (ms, and page faults per step)")
    header = f"{'backend':8s}" + "".join(f"{p:>20s}" for p in PHASES) + f"{'step':>20s}{'speedup':>9s}"
    print(header)
    eager_ms = med("eager", "step_ms")
    for b in backends:
        cells = "".join(f"{med(b, 'ms', p):10.1f} {med(b, 'faults', p):7.0f}f  " for p in PHASES)
        step = med(b, "step_ms")
        print(f"{b:8s}{cells}{step:10.1f} {med(b, 'step_faults'):7.0f}f  {eager_ms / step:7.3f}")
    print("speedup = eager time / the backend's time (above 1: faster than eager)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds}, f, indent=2)


if __name__ == "__main__":
    main()
