"""One decode step of Hugging Face ``generate()``, replayed: the forward's time and its Python and C calls per backend.

A tiny Llama (``fulmen.bench.hf``) generates greedily; the forward call that decodes at cache length ``--length``
is captured (its keyword arguments and the cache's tensors), and then replayed under eager PyTorch,
``torch.compile`` (Inductor), ``fulmen.jit`` and ``backend="fulmen"``, the cache put back after each call. The
replays are timed in turns, in this thread's CPU time (so that other processes on a shared machine change the
figures less than wall time would), and each backend's calls are counted with ``sys.setprofile``: the number of
Python functions and C functions one forward calls does not depend on the machine's load.

    python benchmarks/bench_decode_step.py --length 24 --repeats 200
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable

import torch

import fulmen
from fulmen.bench.generate import GenerateConfig, _build, _generate


def capture_step(length: int) -> tuple[torch.nn.Module, torch.Tensor, dict, list]:
    """A model, its prompt, the keyword arguments of its decode call at cache length ``length``, and the cache's
    state then."""
    model, ids = _build(GenerateConfig(model="hf:llama", prompt_len=16, new_tokens=length - 14))
    captured: dict = {}
    forward = model.forward

    @functools.wraps(forward)  # generate() passes the arguments forward's signature names
    def grab(*args, **kwargs):
        cache, tokens = kwargs.get("past_key_values"), kwargs.get("input_ids")
        if not captured and tokens is not None and tokens.shape[1] == 1 and cache.get_seq_length() == length:
            captured["kwargs"] = dict(kwargs)
            captured["state"] = [(layer, layer.keys, layer.values) for layer in cache.layers]
        return forward(*args, **kwargs)

    model.forward = grab
    _generate(model, ids, length - 14)
    del model.forward
    return model, ids, captured["kwargs"], captured["state"]


def backends(model: torch.nn.Module, ids: torch.Tensor, kwargs: dict, length: int) -> dict[str, Callable]:
    """Each backend's call of the captured step, after generations through it (so that it runs the program
    generate() reaches in its steady state: fulmen's with the cache length symbolic, Dynamo's dynamic graph)."""
    jitted = fulmen.jit(model, compile="sync")
    compiled = torch.compile(model.forward)
    backend = torch.compile(model.forward, backend="fulmen", options={"compile": "sync"})
    for forward in (compiled, backend):
        model.forward = forward
        for _ in range(2):
            _generate(model, ids, length - 14)
        del model.forward
    for _ in range(2):
        _generate(jitted, ids, length - 14)
    return {
        "eager": lambda: model(**kwargs),
        "torch.compile": lambda: compiled(**kwargs),
        "fulmen.jit": lambda: jitted(**kwargs),
        'backend="fulmen"': lambda: backend(**kwargs),
    }


def count_calls(call: Callable[[], object]) -> Counter:
    counts: Counter = Counter()

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            counts[event] += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=24, help="the cache length of the decode step (at least 17)")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, ids, kwargs, state = capture_step(args.length)

    def restore():
        for layer, keys, values in state:
            layer.keys, layer.values = keys, values

    calls = backends(model, ids, kwargs, args.length)
    times: dict[str, list[float]] = {name: [] for name in calls}
    counts = {}
    with torch.no_grad():
        restore()
        reference = calls["eager"]().logits
        restore()
        for name, call in calls.items():
            for _ in range(3):
                call()
                restore()
            torch.testing.assert_close(call().logits, reference, rtol=1e-4, atol=1e-4, msg=name)
            restore()
            counts[name] = count_calls(call)
            restore()
        for _ in range(args.repeats):
            for name, call in calls.items():
                start = time.thread_time_ns()
                call()
                times[name].append((time.thread_time_ns() - start) / 1e3)
                restore()
    print(
        f"one decode step of hf:llama at cache length {args.length}, batch 1, 1 thread; CPU time of this thread, "
        f"median and 10th percentile of {args.repeats} replays in turns; calls counted with sys.setprofile"
    )
    print(f"{'backend':18s} {'median us':>10s} {'p10 us':>8s} {'Python calls':>13s} {'C calls':>8s}")
    for name, values in times.items():
        values.sort()
        print(
            f"{name:18s} {statistics.median(values):10.1f} {values[len(values) // 10]:8.1f} "
            f"{counts[name]['call']:13d} {counts[name]['c_call']:8d}"
        )


if __name__ == "__main__":
    main()
