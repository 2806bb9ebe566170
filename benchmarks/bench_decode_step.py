"""One decode step of Hugging Face ``generate()``, replayed: the forward's time and its Python and C calls per backend.

A tiny Llama (``fulmen.bench.hf``) generates greedily; the forward call that decodes at cache length ``--length``
is captured (its keyword arguments and the cache's tensors), and then replayed under eager PyTorch,
``torch.compile`` (Inductor), ``fulmen.jit`` and ``backend="fulmen"``, the cache put back after each call. The
replays are timed in turns, in this thread's CPU time (so that other processes on a shared machine change the
figures less than wall time would), and each backend's calls are counted with ``sys.setprofile``: the number of
Python functions and C functions one forward calls does not depend on the machine's load.

    python benchmarks/bench_decode_step.py --length 24 --repeats 200
    python benchmarks/bench_decode_step.py --length 24 --steps 8  # the cache length changes every call, as in generate
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


def capture_steps(length: int, steps: int = 1) -> tuple[torch.nn.Module, torch.Tensor, list[tuple[dict, list]]]:
    """A model, its prompt, and for ``steps`` consecutive decode calls from cache length ``length`` on: the call's
    keyword arguments and the cache's state then."""
    model, ids = _build(GenerateConfig(model="hf:llama", prompt_len=16, new_tokens=length + steps - 15))
    captured: dict = {}
    forward = model.forward

    @functools.wraps(forward)  # generate() passes the arguments forward's signature names
    def grab(*args, **kwargs):
        cache, tokens = kwargs.get("past_key_values"), kwargs.get("input_ids")
        at = cache.get_seq_length() if cache is not None else 0
        if at not in captured and tokens is not None and tokens.shape[1] == 1 and length <= at < length + steps:
            captured[at] = (dict(kwargs), [(layer, layer.keys, layer.values) for layer in cache.layers])
        return forward(*args, **kwargs)

    model.forward = grab
    _generate(model, ids, length + steps - 15)
    del model.forward
    return model, ids, [captured[at] for at in sorted(captured)]


def backends(model: torch.nn.Module, ids: torch.Tensor, length: int) -> dict[str, Callable[[dict], object]]:
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
        "eager": lambda kwargs: model(**kwargs),
        "torch.compile": lambda kwargs: compiled(**kwargs),
        "fulmen.jit": lambda kwargs: jitted(**kwargs),
        'backend="fulmen"': lambda kwargs: backend(**kwargs),
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
    parser.add_argument(
        "--steps",
        type=int,
        default=1,
        help="replay this many consecutive decode steps in turn, so that the cache length changes every call",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, ids, steps = capture_steps(args.length, args.steps)

    def restore(step):
        for layer, keys, values in step[1]:
            layer.keys, layer.values = keys, values

    calls = backends(model, ids, args.length + args.steps - 1)
    times: dict[str, list[float]] = {name: [] for name in calls}
    counts: dict[str, Counter] = {name: Counter() for name in calls}
    with torch.no_grad():
        references = []
        for step in steps:
            restore(step)
            references.append(calls["eager"](step[0]).logits)
        for name, call in calls.items():
            for step, reference in [*zip(steps, references)] * 2:
                restore(step)
                got = call(step[0]).logits
                torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4, msg=name)
            for step in steps:
                restore(step)
                counts[name] += count_calls(lambda: call(step[0]))  # noqa: B023  (called at once)
        for repeat in range(args.repeats):
            step = steps[repeat % len(steps)]
            for name, call in calls.items():
                restore(step)
                start = time.thread_time_ns()
                call(step[0])
                times[name].append((time.thread_time_ns() - start) / 1e3)
    print(
        f"one decode step of hf:llama at cache length {args.length} (replaying {args.steps} consecutive steps in "
        f"turn), batch 1, 1 thread; CPU time of this thread, median and 10th percentile of {args.repeats} replays "
        f"in turns; calls per step counted with sys.setprofile"
    )
    print(f"{'backend':18s} {'median us':>10s} {'p10 us':>8s} {'Python calls':>13s} {'C calls':>8s}")
    for name, values in times.items():
        values.sort()
        print(
            f"{name:18s} {statistics.median(values):10.1f} {values[len(values) // 10]:8.1f} "
            f"{counts[name]['call'] / len(steps):13.0f} {counts[name]['c_call'] / len(steps):8.0f}"
        )


if __name__ == "__main__":
    main()
