"""LM head + cross-entropy training step: eager vs fulmen with the ``fused_linear_ce`` executor.

    python benchmarks/bench_lm_head.py [--hidden 1024] [--vocab 32000] [--tokens 4096] [--repeat 5]

One step = forward (``F.linear`` then ``F.cross_entropy``, mean reduction) and ``loss.backward()`` into
hidden, weight and bias (float32, CPU). Reports:

- peak memory: the highest net bytes allocated through PyTorch's CPU allocator during one step, measured with
  ``torch.profiler.profile(profile_memory=True)`` (``fulmen.bench.memory.cpu_step_peak_bytes``): every
  allocation and free in time order, running sum, maximum. The inputs and parameters that exist before the
  step are not counted (they are the same for both); the gradients the step creates are.
- median wall time of ``--repeat`` steps after one warm-up step (compilation excluded);
- the largest absolute difference of the loss and of each gradient from eager.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import fulmen
from fulmen.bench.memory import cpu_step_peak_bytes


def lm_head_loss(hidden, weight, bias, target):
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits, target)


def make_step(fn, hidden, weight, bias, target):
    def step():
        for t in (hidden, weight, bias):
            t.grad = None
        loss = fn(hidden, weight, bias, target)
        loss.backward()
        return loss.detach()

    return step


def run(hidden_size: int, vocab: int, tokens: int, repeat: int) -> dict:
    torch.manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size) / hidden_size ** 0.5).requires_grad_()
    bias = torch.zeros(vocab, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,))
    jitted = fulmen.jit(lm_head_loss, executors=["fused_linear_ce"])
    results = {}
    grads = {}
    for name, fn in (("eager", lm_head_loss), ("fulmen", jitted)):
        step = make_step(fn, hidden, weight, bias, target)
        loss = step()  # warm-up (compiles fulmen)
        grads[name] = [loss] + [t.grad.clone() for t in (hidden, weight, bias)]
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        for t in (hidden, weight, bias):
            t.grad = None
        peak = cpu_step_peak_bytes(step)
        results[name] = {"median_s": statistics.median(times), "peak_bytes": peak}
    errors = [(a - b).abs().max().item() for a, b in zip(grads["fulmen"], grads["eager"])]
    results["max_abs_error"] = dict(zip(("loss", "grad_hidden", "grad_weight", "grad_bias"), errors))
    results["trace"] = str(fulmen.last_traces(jitted)[-1])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--show-trace", action="store_true")
    args = parser.parse_args()
    r = run(args.hidden, args.vocab, args.tokens, args.repeat)
    mib = 1 << 20
    eager, fused = r["eager"], r["fulmen"]
    print(f"LM head + cross_entropy, hidden {args.hidden}, vocab {args.vocab}, {args.tokens} tokens, float32 CPU, "
          f"{torch.get_num_threads()} threads")
    print(f"{'':8}{'median step':>14}{'peak memory':>16}")
    for name, v in (("eager", eager), ("fulmen", fused)):
        print(f"{name:8}{v['median_s'] * 1e3:11.0f} ms{v['peak_bytes'] / mib:12.0f} MiB")
    print(f"fulmen/eager: time {fused['median_s'] / eager['median_s']:.2f}x, "
          f"peak memory {fused['peak_bytes'] / eager['peak_bytes']:.2f}x")
    print("max abs error vs eager: " + ", ".join(f"{k} {v:.2e}" for k, v in r["max_abs_error"].items()))
    if args.show_trace:
        print(r["trace"])


if __name__ == "__main__":
    main()
