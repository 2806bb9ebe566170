"""What checking a symbolic trace against exact ones costs (fulmen.frontend.same_program), beside the compilation
with symbolic ints it checks: a small Mistral's ``generate`` through ``fulmen.jit`` (the decode program's cache length
is symbolic), the torch executor, one process.

    PYTHONPATH=. python benchmarks/bench_symbolic_check.py [--layers 4]

Prints the milliseconds of each check and of each compilation with symbolic sizes or ints (which includes the
check). Compare two versions of fulmen by running it with each on PYTHONPATH, alternating, in fresh processes.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import fulmen
from fulmen.frontend import jit as jit_module


def _timed(times: list, fn):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.append((time.perf_counter() - start) * 1e3)

    return timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    checks: list[float] = []
    builds: list[float] = []
    jit_module.check_symbolic_trace = _timed(checks, jit_module.check_symbolic_trace)
    compile_symbolic = jit_module.JittedFunction._compile_symbolic
    jit_module.JittedFunction._compile_symbolic = lambda self, *a: _timed(builds, compile_symbolic)(self, *a)
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = transformers.MistralForCausalLM(config).eval()
    jitted = fulmen.jit(model, executors=["torch"])
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        tokens = jitted.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(tokens, model.generate(ids, max_new_tokens=8, do_sample=False))
    print(
        f"compilations {fulmen.cache_misses(jitted)}; check ms {[round(t, 1) for t in checks]}; compilation with "
        f"symbolic ints ms {[round(t, 1) for t in builds]}"
    )


if __name__ == "__main__":
    main()
