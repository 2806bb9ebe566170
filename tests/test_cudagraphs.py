"""CUDA graphs (``fulmen.jit(..., cuda_graphs=True)``): replays give exactly what the same program gives without
graphs, nothing the caller holds is overwritten by a later replay, and whatever cannot be graphed runs without
graphs and says why. The GPU tests compare the graphed program with the same program without graphs (the same
kernels on the same data: equal to float rounding of the copies, which is none) and with eager PyTorch."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import fulmen
from fulmen.bench.models import build
from fulmen.executors import inductor
from fulmen.frontend import cudagraphs

_GPU = pytest.mark.gpu


@pytest.fixture
def sync_compile():
    token = inductor.compile_mode.set("sync")
    yield
    inductor.compile_mode.reset(token)


# ---- without a GPU: the option, and the programs that do not qualify ----

def test_cuda_graphs_option_must_be_a_bool():
    with pytest.raises(TypeError, match="cuda_graphs= must be True or False"):
        fulmen.jit(nn.Linear(2, 2), cuda_graphs="yes")


def test_cpu_program_runs_without_graphs_and_says_why(caplog):
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    jm = fulmen.jit(model, cuda_graphs=True)
    x = torch.randn(3, 4)
    before = cudagraphs.graph_stats()
    with caplog.at_level(logging.WARNING, logger="fulmen"):
        for _ in range(2):  # the second call compiles the training program (the first runs on PyTorch autograd)
            out = jm(x)
            out.sum().backward()
        with torch.no_grad():
            torch.testing.assert_close(jm(x), model(x))
    assert "Sequential runs without CUDA graphs: its tensors are not all on one CUDA device (cpu)" in caplog.text
    assert cudagraphs.graph_stats() == before


@pytest.mark.parametrize("case", ["random", "mutation"])
def test_programs_that_cannot_replay_are_named(case):
    def random(x):
        return torch.nn.functional.dropout(x, 0.5) * 2

    def mutation(x):
        x.add_(1)
        return x * 2

    fn = {"random": random, "mutation": mutation}[case]
    jf = fulmen.jit(fn)
    jf(torch.randn(4))
    trace = fulmen.last_traces(jf)[0]
    reason = cudagraphs.why_not_graphed([trace])
    assert reason == {"random": "it draws random numbers (bernoulli)", "mutation": "it updates an input in place"}[case]


# ---- on a GPU ----

def _train(name, *, cuda_graphs, steps, executors=None, compile="sync"):
    """Losses and final parameters of ``steps`` AdamW steps of a built-in model on CUDA; the backend used."""
    torch.manual_seed(0)
    model, make_inputs = build(name, device="cuda")
    batches = [make_inputs(2, targets=True) for _ in range(steps)]
    step_fn = model if cuda_graphs is None else fulmen.jit(model, executors=executors, compile=compile,
                                                           cuda_graphs=cuda_graphs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for x, y in batches:
        _, loss = step_fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # kept: a later replay must not overwrite it
        if compile == "async":
            inductor.wait_for_compilations()
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


@_GPU
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_training_replays_match_the_program_without_graphs_and_eager(sync_compile, name):
    before = cudagraphs.graph_stats()
    graphed_losses, graphed_params = _train(name, cuda_graphs=True, steps=8)
    after = cudagraphs.graph_stats()
    assert after["captures"] - before["captures"] == 2, "one forward and one backward graph"
    assert after["replays"] - before["replays"] >= 2 * 4, "the later steps replay both graphs"
    assert after["failed_captures"] == before["failed_captures"]
    plain_losses, plain_params = _train(name, cuda_graphs=False, steps=8)
    eager_losses, eager_params = _train(name, cuda_graphs=None, steps=8)
    torch.testing.assert_close(graphed_losses, plain_losses, rtol=0, atol=0)
    for g, p in zip(graphed_params, plain_params, strict=True):
        torch.testing.assert_close(g, p, rtol=0, atol=0)
    torch.testing.assert_close(graphed_losses, eager_losses, rtol=1e-4, atol=1e-5)
    for g, e in zip(graphed_params, eager_params, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


@_GPU
def test_async_compilation_captures_after_the_regions_swap_in():
    token = inductor.compile_mode.set("async")
    try:
        before = cudagraphs.graph_stats()
        graphed_losses, graphed_params = _train("gpt-tiny", cuda_graphs=True, steps=8, compile="async")
        assert cudagraphs.graph_stats()["replays"] > before["replays"]
        eager_losses, eager_params = _train("gpt-tiny", cuda_graphs=None, steps=8)
    finally:
        inductor.compile_mode.reset(token)
    torch.testing.assert_close(graphed_losses, eager_losses, rtol=1e-4, atol=1e-5)
    for g, e in zip(graphed_params, eager_params, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


def _mlp_pair():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).cuda()
    twin = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).cuda()
    twin.load_state_dict(model.state_dict())
    return model, twin


@_GPU
def test_gradient_accumulation_and_two_forwards_before_backward(sync_compile):
    """Two forwards, then their two backwards: the second forward must not overwrite what the first saved, so it
    runs without the graph; gradients accumulate over steps without zero_grad as in eager."""
    model, twin = _mlp_pair()
    jm = fulmen.jit(model, cuda_graphs=True)
    xs = [torch.randn(8, 16, device="cuda") for _ in range(12)]
    for i in range(0, 12, 2):
        la, lb = jm(xs[i]).square().mean(), jm(xs[i + 1]).square().mean()
        ea, eb = twin(xs[i]).square().mean(), twin(xs[i + 1]).square().mean()
        lb.backward()
        la.backward()
        (eb + ea).backward()
        torch.testing.assert_close(torch.stack([la, lb]), torch.stack([ea, eb]), rtol=1e-5, atol=1e-6)
    for p, e in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, e.grad, rtol=1e-5, atol=1e-6)
    assert cudagraphs.graph_stats()["replays"] > 0


@_GPU
def test_inputs_refilled_in_place_or_moved_and_parameters_swapped(sync_compile):
    """A batch refilled in place is read where it lives; fresh batches are copied; a parameter whose storage
    moves (``p.data = ...``) makes the graph be captured again."""
    model, twin = _mlp_pair()
    jm = fulmen.jit(model, cuda_graphs=True)
    batch = torch.empty(8, 16, device="cuda")
    for i in range(10):
        if i < 5:
            batch.normal_()
            x = batch
        else:
            x = torch.randn(8, 16, device="cuda")
        if i == 7:
            new = torch.randn_like(model[0].weight)
            model[0].weight.data = new
            twin[0].weight.data = new.clone()
        out, ref = jm(x), twin(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        out.sum().backward()
        ref.sum().backward()
    for p, e in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, e.grad, rtol=1e-5, atol=1e-5)


@_GPU
def test_inference_outputs_are_not_overwritten_by_later_replays(sync_compile):
    model, twin = _mlp_pair()
    jm = fulmen.jit(model, cuda_graphs=True)
    before = cudagraphs.graph_stats()["replays"]
    outs, refs = [], []
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(8, 16, device="cuda")
            outs.append(jm(x))
            refs.append(twin(x))
    assert cudagraphs.graph_stats()["replays"] > before
    for o, r in zip(outs, refs, strict=True):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)


@_GPU
def test_a_capture_that_fails_is_logged_and_the_program_runs_without_graphs(sync_compile, caplog):
    @torch.library.custom_op("fulmen_test::host_scale", mutates_args=())
    def host_scale(x: torch.Tensor) -> torch.Tensor:
        return x * float(x.abs().max().item())  # a host synchronization: cannot be captured

    @host_scale.register_fake
    def _(x):
        return torch.empty_like(x)

    def f(x):
        return host_scale(torch.sin(x)) + 1

    jf = fulmen.jit(f, cuda_graphs=True)
    before = cudagraphs.graph_stats()["failed_captures"]
    with caplog.at_level(logging.WARNING, logger="fulmen"):
        for _ in range(5):
            x = torch.randn(32, device="cuda")
            torch.testing.assert_close(jf(x), f(x))
    assert cudagraphs.graph_stats()["failed_captures"] == before + 1
    assert "runs without CUDA graphs" in caplog.text
