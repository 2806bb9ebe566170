"""Data-dependent sizes: a mixture-of-experts layer whose router sends each token to one expert (boolean-mask
gather and scatter per expert) and a loss over the tokens a mask keeps; eager vs torch.compile vs fulmen.jit, one
training step (forward and backward) per call, in one process.

Each call gets other tokens, so each expert receives another number of tokens: fulmen traces those counts as
data-dependent sizes (``u0``) and compiles once (the script checks its cache counters); torch.compile, with its
defaults, breaks the graph at the data-dependent ops. Implementations are timed in turns (round robin); each
figure is the median over repeats of the mean time per call in one repeat.

    python benchmarks/bench_data_dependent.py
    python benchmarks/bench_data_dependent.py --tokens 1024 --repeats 11 --no-torch-compile --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import fulmen


class MoE(nn.Module):
    """Top-1 routing: ``out[mask_e] = expert_e(x[mask_e]) * gate`` for each expert, then a masked loss."""

    def __init__(self, dim: int, hidden: int, experts: int, classes: int):
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
                                     for _ in range(experts))
        self.head = nn.Linear(dim, classes)

    def forward(self, x, targets, keep):
        probs = self.router(x).softmax(-1)
        gate, choice = probs.max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            out[mask] = expert(x[mask]) * gate[mask].unsqueeze(-1)
        logits = self.head(out + x)
        return F.cross_entropy(logits[keep], targets[keep])  # the loss over the tokens kept


def step(model: nn.Module) -> Callable:
    def run(x, targets, keep):
        model.zero_grad(set_to_none=True)
        loss = model(x, targets, keep)
        loss.backward()
        return loss

    return run


def time_per_call_ms(call: Callable[[], object], calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        call()
    return (time.perf_counter_ns() - start) / calls / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--calls", type=int, default=10, help="calls per repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-torch-compile", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    torch.manual_seed(0)
    classes = 10
    reference = MoE(args.dim, args.hidden, args.experts, classes)
    batches = []
    for _ in range(4):  # other tokens each call: other counts per expert and kept
        x = torch.randn(args.tokens, args.dim)
        batches.append((x, torch.randint(0, classes, (args.tokens,)), torch.rand(args.tokens) > 0.3))

    def copy() -> MoE:
        model = MoE(args.dim, args.hidden, args.experts, classes)
        model.load_state_dict(reference.state_dict())
        return model

    models = {"eager": copy()}
    impls = {"eager": step(models["eager"])}
    if not args.no_torch_compile:
        models["torch.compile"] = copy()
        impls["torch.compile"] = step(torch.compile(models["torch.compile"]))
    models["fulmen.jit"] = copy()
    jitted = fulmen.jit(models["fulmen.jit"], compile="sync")
    impls["fulmen.jit"] = step(jitted)

    expected = [impls["eager"](*b).item() for b in batches]
    calls: dict[str, Callable] = {}
    first_ms: dict[str, float] = {}
    for name, impl in impls.items():
        start = time.perf_counter()
        losses = [impl(*b).item() for b in batches]  # first calls: trace / compile
        first_ms[name] = 1e3 * (time.perf_counter() - start)
        for got, want in zip(losses, expected):
            assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), (name, got, want)
        counter = iter(range(10**9))
        calls[name] = lambda impl=impl, counter=counter: impl(*batches[next(counter) % len(batches)])
        print(f"  {name}: first {len(batches)} calls {first_ms[name]:.0f} ms", file=sys.stderr)
    grads = {n: [p.grad for p in m.parameters()] for n, m in models.items()}
    for name, g in grads.items():
        for a, b in zip(g, grads["eager"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    samples: dict[str, list[float]] = {n: [] for n in calls}
    for _ in range(args.repeats):
        for name, call in calls.items():
            samples[name].append(time_per_call_ms(call, args.calls))
    misses = fulmen.cache_misses(jitted)
    assert misses == 1, f"fulmen.jit recompiled when only the data changed: {misses} compilations"

    results = {n: statistics.median(s) for n, s in samples.items()}
    print(f"MoE top-1 ({args.experts} experts, {args.tokens} tokens x {args.dim}) + masked loss, training step, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, ms in results.items():
        print(f"  {name:<14} {ms:8.2f} ms/step  speedup {results['eager'] / ms:.2f} (eager time / this time)  "
              f"min {min(samples[name]):8.2f} ms  first calls {first_ms[name]:.0f} ms")
    print(f"  fulmen.jit compilations: {misses} for {len(batches)} data patterns")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_ms": results, "min_ms": {n: min(s) for n, s in samples.items()},
                       "first_calls_ms": first_ms, "fulmen_compilations": misses,
                       "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
