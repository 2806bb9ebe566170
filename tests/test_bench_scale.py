"""LLM-scale benchmarking at toy size: the llama-1b and gpt2-124m models, their size overrides, bf16 autocast and
checkpointed steps, model FLOPs and MFU, per-measurement time limits, and the ``fulmen.bench.scale`` entry that
benchmarks/gpu_check.sh's ``scale`` step runs."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import pytest
import torch

import fulmen
from fulmen.bench import cli, flops, scale
from fulmen.bench.models import CONFIGS, build, checkpoint_blocks, meta_model, size_overrides
from fulmen.bench.runner import (
    _ROW_MARKER,
    _TIMED_MARKER,
    BenchConfig,
    BenchRow,
    combine_repeats,
    row_from_output,
    run_benchmark,
    run_child,
)

TOY = {"n_layer": 1, "width": 64, "seq_len": 16}


# ---- the models ----


def test_llm_models_have_their_published_shapes_and_sizes():
    llama = meta_model("llama-1b")
    attention = llama.layers[0].attention
    assert len(llama.layers) == 16 and llama.config.n_embd == 2048 and llama.config.block_size == 2048
    assert (attention.n_head, attention.n_kv_head, attention.head_dim) == (32, 8, 64)  # grouped-query attention
    assert llama.layers[0].feed_forward.w1.out_features == 8192
    assert llama.output.weight is not llama.tok_embeddings.weight and llama.output.out_features == 32000
    assert sum(p.numel() for p in llama.parameters()) == 1_104_218_112
    # the untied input embedding is a lookup: 32,000 x 2,048 parameters do no arithmetic
    assert flops.matmul_parameters(llama) == 1_104_218_112 - 32000 * 2048

    gpt = meta_model("gpt2-124m")
    assert gpt.transformer.wte.weight is gpt.lm_head.weight  # tied
    assert (gpt.config.n_layer, gpt.config.n_head, gpt.config.n_embd, gpt.config.vocab_size, gpt.config.block_size) == (
        12,
        12,
        768,
        50257,
        1024,
    )
    assert sum(p.numel() for p in gpt.parameters()) == 124_439_808
    assert flops.matmul_parameters(gpt) == 123_653_376  # nanoGPT's count: all but the position embedding


def test_size_overrides_keep_the_head_size_and_grouping():
    toy = size_overrides("llama-1b", n_layer=2, width=256, seq_len=64)
    assert toy == {
        "n_layer": 2,
        "block_size": 64,
        "n_embd": 256,
        "n_head": 4,
        "n_kv_head": 1,
        "intermediate_size": 1024,
    }
    assert size_overrides("gpt2-124m", width=128) == {"n_embd": 128, "n_head": 2}
    assert size_overrides("llama-1b") == {}
    with pytest.raises(ValueError, match="--width 100 must be a multiple of the head size 64"):
        size_overrides("llama-1b", width=100)
    with pytest.raises(ValueError, match="mlp is an MLP"):
        size_overrides("mlp", n_layer=2)


def _llama(checkpointed: bool):
    model, make_inputs = build(
        "llama-1b", vocab_size=256, **size_overrides("llama-1b", n_layer=2, width=128, seq_len=32)
    )
    return (checkpoint_blocks(model) if checkpointed else model), make_inputs(2, targets=True)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_toy_llama_1b_step_under_fulmen_matches_eager(checkpointed):
    """The llama-1b code at toy size, its blocks checkpointed or not: fulmen's loss and gradients are eager's, in
    float32 and under bfloat16 autocast (where both round the same matrix products to bfloat16)."""
    for autocast, tol in ((False, 1e-5), (True, 2e-2)):
        model, inputs = _llama(checkpointed)
        eager, _ = _llama(checkpointed)
        jitted = fulmen.jit(model, executors=["torch"])
        losses = []
        for run, params in ((jitted, model.parameters()), (eager, eager.parameters())):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits, loss = run(*inputs)
            assert logits.dtype == (torch.bfloat16 if autocast else torch.float32)
            loss.backward()
            losses.append((loss, [p.grad for p in params]))
        (loss, grads), (expected_loss, expected_grads) = losses
        torch.testing.assert_close(loss, expected_loss, rtol=tol, atol=tol)
        for g, e in zip(grads, expected_grads):
            torch.testing.assert_close(g, e, rtol=tol, atol=tol * e.abs().max().item())


def test_checkpoint_blocks_refuses_a_model_without_blocks():
    with pytest.raises(TypeError, match="MLP has no transformer blocks"):
        checkpoint_blocks(build("mlp-tiny")[0])


# ---- model FLOPs and MFU ----


def test_model_flops_follow_the_palm_formula():
    gpt = meta_model("gpt2-124m")
    # nanoGPT's estimate_mfu: 6 N + 12 L H Q T per token, N without the position embedding
    assert flops.flops_per_token(gpt, 1024) == 6 * 123_653_376 + 12 * 12 * 12 * 64 * 1024
    assert flops.flops_per_token(gpt, 1024, train=False) == pytest.approx(flops.flops_per_token(gpt, 1024) / 3)
    assert flops.peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert flops.peak_flops("NVIDIA H200") == 989.4e12
    assert flops.peak_flops("NVIDIA H100 PCIe") == 756.0e12
    assert flops.peak_flops("cpu") is None and flops.peak_flops(None) is None
    assert flops.mfu(989.4e12, 2.0, 989.4e12) == 0.5
    assert flops.mfu(1e12, 1.0, None) is None


def test_runner_reports_throughput_and_precision():
    config = BenchConfig(
        model="llama-1b",
        mode="train",
        backend="fulmen-torch",
        steps=2,
        warmup=1,
        autocast=True,
        checkpoint=True,
        interleave=False,
        **TOY,
    )
    row = run_benchmark(config)
    assert row.error is None, row.error
    assert (row.precision, row.checkpoint, row.seq_len, row.device_name) == ("bf16-autocast", True, 16, "cpu")
    assert row.tokens_per_s == pytest.approx(2 * 16 / (row.median_ms / 1e3))
    model = meta_model("llama-1b", **size_overrides("llama-1b", **TOY))
    assert row.parameters == sum(p.numel() for p in model.parameters())
    assert row.model_flops == flops.flops_per_token(model, 16) * 2 * 16
    assert row.peak_flops is None and row.mfu is None  # no peak on a CPU
    assert row.eager_median_ms is None  # not interleaved: eager only checked the results
    assert row.max_diff is not None and row.max_diff < 0.05  # bf16 rounding of a loss near log(32000)
    with pytest.raises(ValueError, match="float32 master weights"):
        BenchConfig(model="llama-1b", dtype="bfloat16", autocast=True).validate()


def test_rows_say_what_a_step_is_made_of():
    """Compiled calls per step, host time against the step's time, and (on CUDA only) the kernels' time: what the
    GPU run of issue 46 needs to tell a host-bound step from a device-bound one."""

    config = BenchConfig(model="llama-1b", mode="train", backend="fulmen", steps=2, warmup=1, interleave=False, **TOY)
    row = run_benchmark(config)
    assert row.error is None, row.error
    calls = row.calls_per_step
    assert set(calls) == {"forward_regions", "forward_other_calls", "backward_regions", "backward_other_calls"}
    assert calls["forward_regions"] >= 1 and calls["backward_regions"] >= 1, calls
    assert 0 < row.host_ms <= row.median_ms * 1.5 and row.host_cpu_ms > 0
    assert row.device_busy_ms is None  # no device time on a CPU
    table = scale.markdown([row], scale.environment(scale.parse_args(["--out", "x", "--toy"])))
    f, b = calls["forward_regions"], calls["backward_regions"]
    assert f"| {f}+{calls['forward_other_calls']} / {b}+{calls['backward_other_calls']} |" in table

    eager = run_benchmark(dataclasses.replace(config, backend="eager"))
    assert eager.calls_per_step is None and eager.host_ms > 0


def test_repeated_rows_take_throughput_and_mfu_from_the_median_step():
    def row(ms):
        return BenchRow(
            model="llama-1b",
            mode="train",
            backend="fulmen",
            device="cuda",
            dtype="float32",
            batch_size=1,
            steps=1,
            median_ms=ms,
            tokens_per_s=1000.0 / ms,
            mfu=0.1 / ms,
        )

    combined = combine_repeats([row(10.0), row(30.0), row(20.0)])
    assert combined.median_ms == 20.0
    assert combined.tokens_per_s == pytest.approx(50.0) and combined.mfu == pytest.approx(0.005)


def test_cli_bench_scale_options(capsys):
    code = cli.main(
        [
            "bench",
            "--model",
            "gpt2-124m",
            "--mode",
            "train",
            "--backends",
            "eager",
            "--n-layer",
            "1",
            "--width",
            "64",
            "--seq-len",
            "16",
            "--precision",
            "bf16",
            "--checkpoint",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--quiet",
            "--json",
            "-",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0
    (row,) = json.loads(captured.out)["rows"]
    assert row["error"] is None, row["error"]
    assert (row["dtype"], row["precision"], row["checkpoint"], row["seq_len"]) == ("bfloat16", "bf16", True, 16)
    assert row["tokens_per_s"] > 0 and "tokens/s" in captured.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--width", "100"], "multiple of the head size 64"),
        (["--precision", "bf16", "--dtype", "float16"], "give --precision or --dtype, not both"),
        (["--timeout", "5"], "--timeout only applies with --isolate"),
        (["--mode", "distributed", "--precision", "bf16"], "do not apply to --mode distributed"),
    ],
)
def test_cli_bench_rejects_bad_scale_options(argv, message, capsys):
    assert cli.main(["bench", "--model", "llama-1b", *argv]) == 2
    assert message in capsys.readouterr().err


# ---- time limits and the scale entry ----


def test_a_child_past_its_time_limit_is_stopped_with_what_it_started(tmp_path):
    """The child and the grandchild it started (as Inductor's compile workers are) both hold stderr; stopping the
    process group ends the wait long before either would exit by itself."""
    code = (
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('@compiling\\t\\t', file=sys.stderr, flush=True); time.sleep(60)"
    )
    phases = []
    start = time.perf_counter()
    _, tail, timed_out = run_child(
        [sys.executable, "-c", code],
        {},
        str(tmp_path / "out.txt"),
        lambda phase, done, total: phases.append(phase),
        timeout_s=2.0,
    )
    assert timed_out and tail[-1] == "while compiling" and phases == ["compiling"]
    assert time.perf_counter() - start < 50
    _, _, timed_out = run_child([sys.executable, "-c", "pass"], {}, str(tmp_path / "out.txt"), lambda *a: None, 30.0)
    assert not timed_out


def test_a_measurement_stopped_after_its_timed_steps_keeps_them():
    config = BenchConfig(
        model="llama-1b", mode="train", backend="eager", steps=1, warmup=0, isolate=True, timeout_s=60.0, **TOY
    )
    timed = []
    row = run_benchmark(dataclasses.replace(config, isolate=False), timed=lambda r: timed.append(r.to_dict()))
    assert timed and timed[0]["median_ms"] == row.median_ms and timed[0]["peak_mb"] is None  # before memory
    lines = ["noise\n", _TIMED_MARKER + json.dumps(timed[0]) + "\n"]
    kept = row_from_output(config, lines, -9, ["while measuring memory"], timed_out=True)
    assert kept.median_ms == row.median_ms and kept.tokens_per_s == row.tokens_per_s and kept.isolated
    assert kept.error == (
        "timed out after 60 s (while measuring memory); step times kept, results not checked against eager's"
    )
    lost = row_from_output(config, lines[:1], -9, ["while compiling"], timed_out=True)
    assert lost.median_ms is None and lost.error == "timed out after 60 s (while compiling)"
    done = row_from_output(config, [_ROW_MARKER + json.dumps(row.to_dict()) + "\n"], 0, [], timed_out=True)
    assert done.error is None and done.peak_mb == row.peak_mb  # finished as the timer fired: the whole row


def test_scale_toy_runs_one_cpu_thread():
    """On a shared CPU, PyTorch's threads waiting for one another made a toy step take seconds under every backend."""
    args = scale.parse_args(["--out", "x", "--toy"])
    config = scale._config(args, scale.Job("llama-1b", "fulmen"), 60.0)
    assert config.threads == 1 and scale.environment(args)["threads"] == 1
    assert scale._config(scale.parse_args(["--out", "x"]), scale.Job("llama-1b", "eager"), 60.0).threads is None


def test_scale_plan_runs_max_autotune_last_and_keeps_to_the_budget(tmp_path, capsys):
    jobs = scale.plan(["llama-1b", "gpt2-124m"], scale.SCALE_BACKENDS)
    assert [(j.model, j.backend) for j in jobs][-2:] == [
        ("llama-1b", "torch.compile-max-autotune"),
        ("gpt2-124m", "torch.compile-max-autotune"),
    ]
    assert len(jobs) == 8
    # no budget: every measurement is recorded as not run, and nothing is started
    assert scale.main(["--out", str(tmp_path), "--toy", "--budget", "0"]) == 0
    payload = json.loads((tmp_path / "scale.json").read_text())
    assert len(payload["rows"]) == 8 and all(r["error"].startswith("not run") for r in payload["rows"])
    assert payload["environment"]["models"]["llama-1b"]["parameters"] == 8_684_160  # the toy size
    assert (tmp_path / "scale.md").read_text().count("| llama-1b |") == 4


@pytest.mark.slow  # three fresh processes, each importing torch and fulmen
def test_scale_toy_dry_run(tmp_path):
    """What ``SCALE_TOY=1 bash benchmarks/gpu_check.sh OUT scale`` runs, for one model and two backends: fresh
    processes (fulmen without Inductor here, as the test suite sets FULMEN_COMPILE=off), JSON and markdown."""
    out = tmp_path / "scale"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fulmen.bench.scale",
            "--out",
            str(out),
            "--toy",
            "--models",
            "llama-1b",
            "--backends",
            "eager,fulmen",
            "--n-layer",
            "1",
            "--width",
            "64",
            "--seq-len",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    payload = json.loads((out / "scale.json").read_text())
    rows = {r["backend"]: r for r in payload["rows"]}
    for backend in ("eager", "fulmen"):
        row = rows[backend]
        assert row["error"] is None and row["isolated"] and row["precision"] == "bf16-autocast"
        assert row["tokens_per_s"] > 0 and row["compiled_s"] >= row["first_result_s"] > 0 and row["peak_mb"] > 0
    assert rows["fulmen"]["max_diff"] < 0.05 and rows["fulmen"]["speedup"] > 0
    table = (out / "scale.md").read_text()
    assert "| llama-1b | fulmen |" in table and "6N + 12LHQT" in table
    assert CONFIGS["llama-1b"].n_layer == 16  # the toy run changed no built-in config


# ---- on a GPU (skipped without CUDA) ----


@pytest.mark.gpu
def test_gpu_builds_draw_the_same_weights_on_the_device():
    a, _ = build("llama-tiny", device="cuda", seed=3)
    b, _ = build("llama-tiny", device="cuda", seed=3)
    state = torch.cuda.get_rng_state()
    c, _ = build("llama-tiny", device="cuda", seed=4)
    assert torch.equal(torch.cuda.get_rng_state(), state)  # the caller's generator is left as it was
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert p.is_cuda and torch.equal(p, q), name
    assert not torch.equal(a.output.weight, c.output.weight)


@pytest.mark.gpu
def test_gpu_row_has_mfu_against_the_cards_peak():
    row = run_benchmark(
        BenchConfig(
            model="llama-1b",
            mode="train",
            backend="eager",
            device="cuda",
            steps=2,
            warmup=1,
            autocast=True,
            interleave=False,
            **TOY,
        )
    )
    assert row.error is None, row.error
    assert row.device_name == torch.cuda.get_device_name()
    if row.peak_flops is not None:
        assert row.mfu == pytest.approx(row.model_flops / (row.median_ms / 1e3 * row.peak_flops))
    assert row.device_busy_ms is not None and 0 < row.device_busy_ms <= row.median_ms * 1.5
    assert 0 < row.host_ms <= row.median_ms * 1.5
