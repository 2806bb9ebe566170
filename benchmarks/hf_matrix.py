"""The Hugging Face family matrix as a table: family x (fulmen.jit, torch.compile backend) x (forward, train step),
with each cell's status against eager and the median time of eager, torch.compile (Inductor) and fulmen.

Families are built as in tests/test_hf_matrix.py (fulmen/bench/hf_families.py: shipped configs, tiny sizes, eval
mode). A cell's status is ``pass`` when fulmen's outputs (and, for the train step, the loss and every parameter's
gradient) match eager within the matrix's tolerances (fulmen/bench/hf_matrix.py) and, for the backend, fulmen
compiled every graph Dynamo captured; otherwise ``fail(<reason>)``. A forward is one call under ``no_grad``; a
train step is forward, ``loss.backward()`` and zeroing the gradients. Times are medians over ``--repeat`` calls
after two warm-up calls, taken in turns across the implementations, all in one process::

    python benchmarks/hf_matrix.py                                   # every family, with torch.compile
    python benchmarks/hf_matrix.py --families llama,bert --no-inductor --no-cache
    python benchmarks/hf_matrix.py --clock cpu --threads 1     # on a machine other jobs share
    python benchmarks/hf_matrix.py --generate                  # and greedy generate() where the family has it
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch._dynamo

from fulmen.bench.hf_families import FAMILIES
from fulmen.bench.hf_matrix import (
    check_backend_graphs,
    compare_grads,
    compare_outputs,
    compile_model,
    watch_backend_fallbacks,
)


def _forward(model, kwargs):
    def call():
        with torch.no_grad():
            return model(**kwargs)
    return call


def _train_step(model, params, kwargs):
    def call():
        out = model(**kwargs)
        out.loss.backward()
        for p in params:
            p.grad = None
        return out
    return call


def _reason(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"fail({type(e).__name__}: {first[:60]})"


def _prepare(name: str, path: str | None, build: Callable, kwargs: dict, reference: dict | None,
             fulmen_options: dict) -> dict:
    """``{mode: (status, call or None)}`` for one model: eager when path is None, "inductor", "jit" or "backend".
    Each call has run twice (compiling, and the other grad mode's entry) and, for fulmen, been checked."""
    model = build()
    params = list(model.parameters())
    graphs: list = []
    # Dynamo's caches are not reset here: the family's models compiled earlier are timed afterwards, in turns
    if path == "inductor":
        compiled = torch.compile(model)
    elif path is not None:
        compiled, graphs = compile_model(model, path, reset=False, **fulmen_options)
    else:
        compiled = model
    prepared = {}
    for mode in ("forward", "train"):
        try:
            with watch_backend_fallbacks() as fallbacks:
                if mode == "forward":
                    call = _forward(compiled, kwargs)
                    out = call()
                else:
                    out = compiled(**kwargs)
                    out.loss.backward()
                if reference is not None:  # a fulmen path: check against eager before timing
                    compare_outputs(out, reference[mode][0], name)
                    if mode == "train":
                        compare_grads(model, reference["train"][1], name)
                    if path == "backend":
                        check_backend_graphs(graphs, fallbacks, name)
                if mode == "train":
                    for p in params:
                        p.grad = None
                    call = _train_step(compiled, params, kwargs)
                call()
            prepared[mode] = ("pass", call)
        except Exception as e:  # noqa: BLE001 - the table records every failure and goes on
            prepared[mode] = (_reason(e), None)
    return prepared


GENERATIVE = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
NEW_TOKENS = 8


def _generate_kwargs(kwargs: dict) -> dict:
    """The family's inputs as a greedy ``generate`` of exactly ``NEW_TOKENS`` tokens (no labels)."""
    return {**{k: v for k, v in kwargs.items() if k != "labels"}, "max_new_tokens": NEW_TOKENS,
            "min_new_tokens": NEW_TOKENS, "do_sample": False}


def _prepare_generate(path: str | None, build: Callable, kwargs: dict, expected, fulmen_options: dict) -> tuple:
    """``(status, call or None)`` for greedy generation, wrapped the way each path is used for decoding: the model's
    forward compiled (``torch.compile``, the fulmen backend) or the model jitted (``fulmen.jit(model).generate``).
    A fulmen path passes when its tokens are eager's and, for the backend, no Dynamo graph ran eagerly."""
    import fulmen
    from fulmen.frontend.dynamo import backend_stats, reset_backend_stats

    model = build()
    gen = _generate_kwargs(kwargs)
    if path == "inductor":
        model.forward = torch.compile(model.forward)
    elif path == "jit":
        model = fulmen.jit(model, **fulmen_options)
    elif path == "backend":
        reset_backend_stats()
        model.forward = torch.compile(model.forward, backend="fulmen", options=fulmen_options)

    def call():
        with torch.no_grad():
            return model.generate(**gen)

    try:
        tokens = call()
        if expected is not None and not torch.equal(tokens, expected):
            return "fail(tokens differ from eager's)", None
        if path == "backend" and backend_stats().eager_graphs:
            return f"fail(eager graph: {backend_stats().eager_reasons[0][:50]})", None
        call()
        # what a second generate() found compiled: the bound the issue asks for (the prompt, then decode programs
        # reused for every later token)
        if path == "backend":
            return f"pass ({backend_stats().graphs} graphs, {backend_stats().compilations} programs)", call
        if path == "jit":
            return f"pass ({fulmen.compile_stats(model).cache_misses} programs)", call
        return "pass", call
    except Exception as e:  # noqa: BLE001 - the table records every failure and goes on
        return _reason(e), None


def run_family(name: str, repeat: int, inductor: bool, config: dict, fulmen_options: dict,
               clock: Callable[[], float] = time.perf_counter, generate: bool = False) -> dict:
    """``{impl: {mode: (status, median ms or None)}}``; the implementations are timed in turns (round robin),
    so that a change in the machine's load hits all of them alike."""
    family = FAMILIES[name]

    def build():
        return family.build(**config)

    # Every family's forward goes through the same transformers wrapper frame: without a reset per family,
    # Dynamo would reach its recompile limit on it a few families in and run that frame eagerly from then on.
    torch._dynamo.reset()
    ref = build()
    kwargs = family.inputs(ref.config)
    with torch.no_grad():
        expected_forward = ref(**kwargs)
    expected_train = ref(**kwargs)
    expected_train.loss.backward()
    reference = {"forward": (expected_forward, None), "train": (expected_train, ref)}
    prepared = {"eager": _prepare(name, None, build, kwargs, None, fulmen_options)}
    if inductor:
        prepared["inductor"] = _prepare(name, "inductor", build, kwargs, None, fulmen_options)
    for path in ("jit", "backend"):
        prepared[path] = _prepare(name, path, build, kwargs, reference, fulmen_options)
    if generate and family.model_cls.endswith(GENERATIVE):
        with torch.no_grad():
            expected_tokens = ref.generate(**_generate_kwargs(kwargs))
        for impl in prepared:
            path = None if impl == "eager" else impl
            reference_tokens = None if impl in ("eager", "inductor") else expected_tokens
            prepared[impl]["generate"] = _prepare_generate(path, build, kwargs, reference_tokens, fulmen_options)
    times: dict = {(impl, mode): [] for impl, cells in prepared.items() for mode, (_, call) in cells.items() if call}
    for _ in range(repeat):
        for (impl, mode), samples in times.items():
            start = clock()
            prepared[impl][mode][1]()
            samples.append((clock() - start) * 1e3)
    return {impl: {mode: (status, statistics.median(times[impl, mode]) if call else None)
                   for mode, (status, call) in cells.items()} for impl, cells in prepared.items()}


def _ms(cell: tuple | None) -> str:
    return "-" if cell is None or cell[1] is None else f"{cell[1]:.1f}"


def table(results: dict[str, dict]) -> str:
    modes = ("forward", "train", "generate") if any("generate" in c["eager"] for c in results.values()) else (
        "forward", "train")
    header = {"forward": "forward | fwd ms eager / inductor / fulmen",
              "train": "train step | train ms eager / inductor / fulmen",
              "generate": f"generate {NEW_TOKENS} | gen ms eager / inductor / fulmen"}
    lines = ["| family | path | " + " | ".join(header[m] for m in modes) + " |", "|---|---|" + "---|---|" * len(modes)]
    for name, cells in results.items():
        for path in ("jit", "backend"):
            row = [name, path]
            for mode in modes:
                if mode not in cells[path]:
                    row += ["-", "-"]
                    continue
                status = cells[path][mode][0]
                times = " / ".join(_ms(cells.get(k, {}).get(mode)) for k in ("eager", "inductor", path))
                row += [status, times]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all)")
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per cell after the warm-up")
    parser.add_argument("--no-inductor", action="store_true", help="skip torch.compile with Inductor (slow)")
    parser.add_argument("--no-cache", action="store_true", help="build the models with use_cache=False")
    parser.add_argument("--generate", action="store_true",
                        help=f"add greedy generate() of {NEW_TOKENS} tokens for the generative families")
    parser.add_argument("--executors", default=None, help="fulmen executors, comma-separated (default: all)")
    parser.add_argument("--compile", default="sync", help="fulmen's compile mode for fused regions")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's intra-op threads (1 keeps idle worker threads from adding CPU time)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall time, or this process's CPU time (steadier on a machine other jobs share)")
    args = parser.parse_args(argv)
    names = [n for n in args.families.split(",") if n]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; available: {', '.join(FAMILIES)}")
    fulmen_options = {"compile": args.compile}
    if args.executors:
        fulmen_options["executors"] = args.executors.split(",")
    config = {"use_cache": False} if args.no_cache else {}
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # One family puts the graphs of every compiled path (torch.compile's and the backend's forward, train step and
    # generate, the last three graphs each) on the transformers wrapper frame that all its forwards go through, a
    # frame one Dynamo cache serves; at Dynamo's default limit (8) the later paths' calls would run that frame
    # eagerly, which a user compiling one path never sees. Each path's own graphs stay bounded (the generate cells
    # report them).
    torch._dynamo.config.recompile_limit = 64
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    results = {}
    for name in names:
        start = time.perf_counter()
        clock = time.perf_counter if args.clock == "wall" else time.process_time
        results[name] = run_family(name, args.repeat, not args.no_inductor, config, fulmen_options, clock,
                                   generate=args.generate)
        print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    print(f"times: median {args.clock} ms over {args.repeat} calls, {torch.get_num_threads()} threads")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
