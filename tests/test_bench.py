"""The built-in models, the benchmark runner and the ``fulmen`` command line."""

from __future__ import annotations

import json
import re

import pytest
import torch

import fulmen
from fulmen.bench import cli
from fulmen.bench.memory import cpu_step_peak_bytes, tensor_bytes
from fulmen.bench.models import CONFIGS, GPT, MLP, Llama, build
from fulmen.bench.runner import BenchConfig, BenchRow, add_speedups, combine_repeats, run_benchmark
from fulmen.core.ambient import Ambient

TINY = ["gpt-tiny", "llama-tiny", "mlp-tiny"]


# ---- models ----

@pytest.mark.parametrize("name", TINY)
def test_model_forward_backward_eager(name):
    model, make_inputs = build(name)
    out = model(*make_inputs(3))
    logits, loss = model(*make_inputs(3, targets=True))
    torch.testing.assert_close(out, logits)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f"parameters without a finite gradient: {missing}"
    if name != "mlp-tiny":
        cfg = CONFIGS[name]
        assert out.shape == (3, cfg.block_size, cfg.vocab_size)
        # Random weights and uniform random targets: the loss is close to log(vocab).
        assert abs(loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.5


def test_build_is_deterministic_and_seeded():
    a, make_a = build("gpt-tiny", seed=3)
    b, make_b = build("gpt-tiny", seed=3)
    c, _ = build("gpt-tiny", seed=4)
    torch.testing.assert_close(a(*make_a(2)), b(*make_b(2)), rtol=0, atol=0)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert torch.equal(make_a(2)[0], make_b(2)[0])


def test_model_structure():
    gpt, _ = build("gpt-small")
    assert isinstance(gpt, GPT) and len(gpt.transformer.h) == 4 and gpt.config.n_embd == 256
    assert gpt.transformer.wte.weight is gpt.lm_head.weight  # tied
    llama, _ = build("llama-small")
    assert isinstance(llama, Llama)
    assert llama.layers[0].attention.k_proj.out_features == 2 * 256 // 8  # grouped-query: 2 kv heads
    assert llama.output.weight is not llama.tok_embeddings.weight  # untied
    assert isinstance(build("mlp")[0], MLP)


def test_causal_models_ignore_the_future():
    for name in ("gpt-tiny", "llama-tiny"):
        model, make_inputs = build(name)
        (idx,) = make_inputs(1)
        changed = idx.clone()
        changed[0, -1] = (idx[0, -1] + 1) % CONFIGS[name].vocab_size
        torch.testing.assert_close(model(idx)[:, :-1], model(changed)[:, :-1])


def test_build_rejects_unknown_model():
    with pytest.raises(ValueError, match="unknown model 'gpt-huge'"):
        build("gpt-huge")


def test_build_overrides_and_dtype():
    model, make_inputs = build("llama-tiny", dtype=torch.bfloat16, n_layer=1)
    assert len(model.layers) == 1
    assert model(*make_inputs(1)).dtype == torch.bfloat16


# ---- fulmen on the models ----

@pytest.mark.parametrize("name", TINY)
def test_fulmen_jit_matches_eager_inference(name):
    model, make_inputs = build(name)
    model.eval()
    inputs = make_inputs(2)
    with torch.no_grad():
        expected = model(*inputs)
        got = fulmen.jit(model)(*inputs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# ---- memory measurement ----

def test_cpu_step_peak_counts_temporaries():
    x = torch.randn(256, 256)

    def step():
        y = x @ x  # 256 KiB alive ...
        z = y + 1  # ... plus 256 KiB
        del y
        return z * 2

    peak = cpu_step_peak_bytes(step)
    assert 2 * x.nbytes <= peak <= 4 * x.nbytes
    assert tensor_bytes([x, x[1:], x.view(-1)]) == x.nbytes  # shared storage counted once


# ---- the runner ----

def test_runner_eager_and_fulmen_rows():
    rows = [run_benchmark(BenchConfig(model="mlp-tiny", mode="inference", backend=b, steps=3, warmup=1))
            for b in ("eager", "fulmen")]
    add_speedups(rows)
    for row in rows:
        assert row.error is None, row.error
        assert row.median_ms > 0 and row.min_ms <= row.median_ms
        assert row.first_result_s > 0 and row.compiled_s >= row.first_result_s
        assert row.peak_mb >= row.state_mb > 0
        assert row.max_diff <= 1e-5
    assert rows[0].speedup == 1.0 and rows[0].eager_median_ms == rows[0].median_ms
    # fulmen's speed-up is taken against eager steps interleaved with its own, in its process
    assert rows[1].eager_median_ms > 0
    assert rows[1].speedup == pytest.approx(rows[1].eager_median_ms / rows[1].median_ms)
    # rows without interleaved eager steps (older JSON) fall back to the eager row
    rows[1].eager_median_ms = None
    add_speedups(rows)
    assert rows[1].speedup == pytest.approx(rows[0].median_ms / rows[1].median_ms)


def test_cuda_graph_backends_wrap_as_their_options_say(monkeypatch):
    """fulmen-cudagraphs passes cuda_graphs=True (on the CPU the program runs without graphs); the torch.compile
    variant asks for mode="reduce-overhead"."""
    from fulmen.bench import runner

    row = run_benchmark(BenchConfig(model="mlp-tiny", mode="train", backend="fulmen-cudagraphs", steps=2, warmup=1))
    assert row.error is None and row.max_diff <= 1e-5
    seen = {}

    def fake_compile(model, mode=None):
        seen["mode"] = mode
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    runner.BACKENDS["torch.compile-cudagraphs"].wrap(torch.nn.Linear(2, 2))
    assert seen == {"mode": "reduce-overhead"}
    assert runner.BACKENDS["fulmen-cudagraphs"].wrap(torch.nn.Linear(2, 2))._fulmen_jitted.cuda_graphs is True


def test_runner_records_backend_failures(monkeypatch):
    from fulmen.bench import runner

    class Broken(runner.Backend):
        name = "broken"

        def wrap(self, model):
            def fail(*args):
                raise RuntimeError("no kernel for this\nsecond line")
            return fail

    monkeypatch.setitem(runner.BACKENDS, "broken", Broken())
    row = run_benchmark(BenchConfig(model="mlp-tiny", mode="train", backend="broken", steps=1))
    assert row.error == "RuntimeError: no kernel for this"
    assert row.median_ms is None


def test_runner_waits_for_background_compilation(monkeypatch):
    from fulmen.bench import runner

    class Background(runner.Backend):
        name = "background"

        def __init__(self):
            self.polls = 0

        def pending(self, wrapped):
            self.polls += 1
            return 1 if self.polls < 4 else 0

    backend = Background()
    monkeypatch.setitem(runner.BACKENDS, "background", backend)
    row = run_benchmark(BenchConfig(model="mlp-tiny", backend="background", steps=2, warmup=0))
    assert row.error is None
    assert row.compiled_s > row.first_result_s  # it took three more steps to report nothing pending


def test_first_result_and_compile_times_count_from_wrapping_the_model(monkeypatch):
    """What a backend does when the model is wrapped (torch.compile imports Dynamo then) is part of the wait."""
    import time

    from fulmen.bench import runner

    class SlowToWrap(runner.Backend):
        name = "slow-to-wrap"

        def wrap(self, model):
            skipped[0] += 1000.0  # wrapping "takes" 1000 s on the runner's clock; nothing really waits
            return model

    # A clock that jumps while the model is wrapped: the figures show where the jump is counted, whatever the
    # machine's load does to the real durations.
    skipped = [0.0]
    real_clock = time.perf_counter
    monkeypatch.setattr(runner.time, "perf_counter", lambda: real_clock() + skipped[0])
    monkeypatch.setitem(runner.BACKENDS, "slow-to-wrap", SlowToWrap())
    row = run_benchmark(BenchConfig(model="mlp-tiny", backend="slow-to-wrap", steps=1, warmup=0))
    assert row.error is None
    assert row.first_result_s >= 1000 and row.compiled_s >= 1000
    assert row.median_ms < 1000 * 1000  # the steps themselves do not include the wrap


def test_fulmen_backend_counts_compilations_in_flight(monkeypatch):
    from fulmen.bench.runner import BACKENDS
    from fulmen.executors import inductor_compile

    def kernel(done):
        k = inductor_compile.Kernel("k", Ambient.capture())
        k.done = done
        return k

    kernels = {1: kernel(False), 2: kernel(True), 3: kernel(False)}
    monkeypatch.setattr(inductor_compile, "_kernels", kernels)
    jitted = fulmen.jit(lambda x: x + 1)
    jitted(torch.ones(2))
    assert BACKENDS["fulmen"].pending(jitted) == 2
    kernels[1].done = kernels[3].done = True
    assert BACKENDS["fulmen"].pending(jitted) == 0
    # a training program whose first call ran on PyTorch autograd compiles at its second call: pending till then
    w = torch.ones(2, requires_grad=True)
    training = fulmen.jit(lambda x: (x * w).sum(), executors=["torch"], compile="async")
    training(torch.ones(2))
    assert BACKENDS["fulmen"].pending(training) == 1
    training(torch.ones(2))
    assert BACKENDS["fulmen"].pending(training) == 0
    assert BACKENDS["fulmen"].pending(lambda x: x) == 0  # not a jitted function: nothing compiles


def test_speedups_are_per_model_and_mode():
    def row(model, mode, backend, ms):
        return BenchRow(model=model, mode=mode, backend=backend, device="cpu", dtype="float32", batch_size=1,
                        steps=1, median_ms=ms)

    rows = [row("a", "train", "eager", 10.0), row("a", "train", "fulmen", 5.0), row("a", "inference", "fulmen", 1.0),
            row("b", "train", "fulmen", None)]
    add_speedups(rows)
    assert [r.speedup for r in rows] == [1.0, 2.0, None, None]


def test_repeated_rows_combine_into_medians():
    def row(ms, first, diff, error=None):
        return BenchRow(model="m", mode="train", backend="fulmen", device="cpu", dtype="float32", batch_size=1,
                        steps=1, median_ms=ms, min_ms=ms - 1, eager_median_ms=2 * ms, first_result_s=first,
                        compiled_s=3 * first, peak_mb=ms, max_diff=diff, isolated=True, error=error)

    combined = combine_repeats([row(10.0, 0.5, 0.0), row(30.0, 0.1, 1e-6), row(20.0, 9.0, 0.0)])
    assert (combined.median_ms, combined.min_ms, combined.eager_median_ms) == (20.0, 9.0, 40.0)
    assert (combined.first_result_s, combined.compiled_s, combined.peak_mb) == (0.5, 1.5, 20.0)
    assert combined.max_diff == 1e-6 and combined.repeats == 3 and combined.first_result_runs == [0.5, 0.1, 9.0]
    failed = combine_repeats([row(10.0, 0.5, 0.0), row(10.0, 0.5, 0.0, error="RuntimeError: boom")])
    assert failed.error == "RuntimeError: boom (in 1 of 2 runs)" and failed.repeats == 2


# ---- the command line ----

def test_cli_bench_repeat_takes_backends_in_turns(capsys):
    code = cli.main(["bench", "--model", "mlp-tiny", "--mode", "inference", "--backends", "eager,fulmen-torch",
                     "--steps", "1", "--warmup", "0", "--isolate", "--warm-cache", "--repeat", "2", "--json", "-"])
    captured = capsys.readouterr()
    assert code == 0
    rows = json.loads(captured.out)["rows"]
    assert [(r["backend"], r["repeats"], len(r["first_result_runs"])) for r in rows] == [("eager", 2, 2),
                                                                                         ("fulmen-torch", 2, 2)]
    assert all(r["error"] is None and r["isolated"] for r in rows)
    labels = [f"[mlp-tiny inference {b} ({t}/2)]" for t in (1, 2) for b in ("eager", "fulmen-torch")]
    positions = [captured.err.find(label) for label in labels]
    assert -1 not in positions and positions == sorted(positions), "one turn of every backend, then the next"
    assert "median of 2 fresh processes" in captured.err


def test_cli_bench_json(capsys):
    code = cli.main(["bench", "--model", "mlp", "--mode", "inference", "--backends", "eager,fulmen", "--steps", "2",
                     "--json", "-"])
    captured = capsys.readouterr()
    assert code == 0
    payload = json.loads(captured.out)
    rows = payload["rows"]
    assert [(r["model"], r["mode"], r["backend"]) for r in rows] == [("mlp", "inference", "eager"),
                                                                      ("mlp", "inference", "fulmen")]
    for r in rows:
        assert r["error"] is None, r["error"]
        assert r["median_ms"] > 0 and r["peak_mb"] > 0 and r["steps"] == 2
    assert payload["environment"]["torch"] == torch.__version__
    # The table and the progress lines go to stderr when the JSON takes stdout.
    assert "median ms" in captured.err and "[mlp inference fulmen]" in captured.err


def test_cli_bench_table_and_json_file(tmp_path, capsys):
    path = tmp_path / "rows.json"
    code = cli.main(["bench", "--model", "mlp-tiny", "--mode", "train", "--backends", "eager", "--steps", "1",
                     "--warmup", "0", "--quiet", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0
    header = out.splitlines()[0].split()
    assert header[:4] == ["model", "mode", "backend", "median"]
    assert "mlp-tiny" in out and "train" in out
    assert "the same adamw-fused optimizer step" in out
    payload = json.loads(path.read_text())
    assert payload["rows"][0]["backend"] == "eager" and payload["rows"][0]["optimizer"] == "adamw-fused"
    assert payload["environment"]["optimizer"] == "adamw-fused"


@pytest.mark.parametrize("name", ["adamw", "adamw-foreach", "sgd"])
def test_runner_train_step_takes_the_chosen_optimizer(name):
    """Every optimizer choice builds, steps, and leaves fulmen's second loss (after one optimizer step) equal to
    eager's; the row says which optimizer ran."""
    row = run_benchmark(BenchConfig(model="mlp-tiny", mode="train", backend="fulmen", steps=2, warmup=1,
                                    optimizer=name))
    assert row.error is None, row.error
    assert row.optimizer == name and row.max_diff <= 1e-5
    with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
        BenchConfig(model="mlp-tiny", optimizer="adam").validate()


def test_format_table_aligns_columns():
    rows = [BenchRow(model="gpt-small", mode="train", backend="eager", device="cpu", dtype="float32", batch_size=2,
                     steps=3, median_ms=123.456, speedup=1.0, first_result_s=0.5, compiled_s=0.5, peak_mb=10.0),
            BenchRow(model="mlp", mode="train", backend="fulmen", device="cpu", dtype="float32", batch_size=2,
                     steps=3, error="RuntimeError: boom")]
    lines = cli.format_table(rows).splitlines()
    assert len(lines) == 4
    col = lines[0].index("median ms") + len("median ms")
    assert lines[2][:col].endswith("123.46") and lines[3][:col].endswith("-")
    assert lines[3].endswith("RuntimeError: boom")


@pytest.mark.parametrize("argv, message", [
    (["bench", "--model", "gpt-huge"], "unknown model 'gpt-huge'"),
    (["bench", "--backends", "eager,tvm"], "unknown backend 'tvm'"),
    (["bench", "--steps", "0"], "expected a positive integer"),
    (["bench", "--optimizer", "adam"], "invalid choice"),
    (["bench", "--mode", "sideways"], "invalid choice"),
    (["bench", "--device", "tpu"], "--device"),
    (["bench", "--warm-cache"], "--warm-cache only applies with --isolate"),
    (["bench", "--repeat", "3"], "--repeat only applies with --isolate"),
    (["bench", "--mode", "generate", "--model", "gpt-small"], "'gpt-small' cannot run with --mode generate"),
    (["bench", "--mode", "inference", "--backends", "torch.compile-fulmen"], "cannot run with --mode inference"),
    (["bench", "--mode", "generate", "--isolate"], "--isolate does not apply to --mode generate"),
    (["bench", "--mode", "generate", "--new-tokens", "1"], "expected a 2-or-larger integer"),
    (["examine"], "exactly one"),
    (["examine", "no_colon_here"], "MODULE:FUNCTION"),
    (["frobnicate"], "invalid choice"),
])
def test_cli_bad_arguments_exit_2(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cli_cuda_unavailable(capsys):
    assert cli.main(["bench", "--device", "cuda"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_cli_examine_model(capsys):
    assert cli.main(["examine", "--model", "gpt-tiny"]) == 0
    out = capsys.readouterr().out
    assert "ops in the computation trace" in out
    assert re.search(r"executors: .*inductor \d", out)  # fusion is on by default
    assert "ops by kind" in out and "fallback (opaque) ops" in out


def test_cli_examine_target(tmp_path, capsys):
    src = tmp_path / "examine_target.py"
    src.write_text("import torch\n"
                   "def make():\n"
                   "    return (lambda a, b: torch.nn.functional.relu(a * b + a), (torch.randn(3), torch.randn(3)))\n")
    assert cli.main(["examine", f"{src}:make", "--trace"]) == 0
    out = capsys.readouterr().out
    assert "ops in the computation trace" in out and "def " in out


def test_cli_help_exits_0(capsys):
    assert cli.main(["bench", "--help"]) == 0
    assert "--isolate" in capsys.readouterr().out


def test_cli_bench_generate_smoke(capsys):
    """``--mode generate``: a tiny Llama generating under eager and ``backend="fulmen"``; both rows have figures, the
    tokens are eager's, and every Dynamo graph (prompt, first decode step, decode with a dynamic cache length)
    compiled once in fulmen."""
    pytest.importorskip("transformers")
    code = cli.main(["bench", "--mode", "generate", "--backends", "eager,torch.compile-fulmen-torch", "--prompt-len",
                     "4", "--new-tokens", "3", "--batch-size", "1", "--steps", "1", "--warmup", "0", "--json", "-"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    rows = json.loads(captured.out)["rows"]
    assert [(r["model"], r["backend"]) for r in rows] == [("hf:llama", "eager"),
                                                          ("hf:llama", "torch.compile-fulmen-torch")]
    for r in rows:
        assert r["error"] is None and r["note"] is None, r
        assert r["tokens_match"] is True and r["ttft_ms"] > 0 and r["first_generate_s"] > 0
        assert r["prompt_len"] == 4 and r["new_tokens"] == 3
    assert rows[1]["compilations"] == 3
    # eager's figures come from generations interleaved with each row's own (the eager row's are its own)
    assert rows[0]["eager_ttft_ms"] == rows[0]["ttft_ms"] and rows[1]["eager_ttft_ms"] > 0
    assert "first token ms" in captured.err and "decode tok/s" in captured.err


def test_generate_rows_report_tokens_that_differ_from_eagers(monkeypatch):
    """A backend whose tokens are not eager's is reported (and the command fails), not timed as if it were right."""
    pytest.importorskip("transformers")
    from fulmen.bench import generate

    real = generate._generate

    def off_by_one(holder, ids, new_tokens):
        out = real(holder, ids, new_tokens)
        return out + 1 if holder is not None and getattr(holder, "_fulmen_wrong", False) else out

    class Wrong(generate._Backend):
        def wrap(self, model):
            model._fulmen_wrong = True
            return model

    monkeypatch.setattr(generate, "_generate", off_by_one)
    monkeypatch.setitem(generate.GENERATE_BACKENDS, "eager", Wrong("eager", "eager"))
    row = generate.run_generate(generate.GenerateConfig(prompt_len=4, new_tokens=3, steps=1, warmup=0))
    assert row.error is None and row.tokens_match is False
    assert "first differing token: sequence 0, position 0" in row.note


def test_generate_models_are_the_decoders():
    from fulmen.bench.generate import generate_model_names

    names = generate_model_names()
    assert {"hf:llama", "hf:gpt2", "hf:qwen2"} <= set(names)
    assert not {"hf:t5", "hf:bert", "hf:mixtral"} & set(names)
