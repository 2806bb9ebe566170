"""A training program's first call on PyTorch autograd, fulmen's forward and backward from the second call.

In the "async" compile mode (the default outside the test suite) the first call of a training program runs its
trace with the torch executor under PyTorch autograd, and the second call compiles and runs fulmen's own
forward and backward (``fulmen.frontend.warm_start``). Checked here: every call matches eager (the first one
bit for bit), the switch happens at the second call or when traces are asked for, and the first call stays on
fulmen's own program whenever PyTorch autograd could differ from it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fulmen
from fulmen.executors.base import OperatorExecutor, deregister_executor, register_executor
from fulmen.executors.inductor_compile import wait_for_compilations
from fulmen.transforms.autodiff import get_grad, put_grads, register_grad

GRAD_TOL = dict(rtol=1e-4, atol=1e-5)


def _fulmen_backward(out: torch.Tensor) -> bool:
    return type(out.grad_fn).__name__ == "FulmenFunctionBackward"


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def _loss_fn(model):
    def loss(x, y):
        return nn.functional.cross_entropy(model(x), y)

    return loss


def test_first_call_on_pytorch_autograd_then_fulmen_program_matches_eager():
    model = _mlp()
    reference = copy.deepcopy(model)
    jitted = fulmen.jit(_loss_fn(model), executors=["torch"], compile="async")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    stats = fulmen.compile_stats(jitted)
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        loss = jitted(x, y)
        ref_loss = nn.functional.cross_entropy(reference(x), y)
        assert _fulmen_backward(loss) == (step > 0), f"step {step}: grad_fn {loss.grad_fn}"
        assert stats.pending_compilations == (1 if step == 0 else 0)
        loss.backward()
        ref_loss.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if step == 0:  # the same torch operations in the same order as eager
                assert torch.equal(p.grad, q.grad), name
            else:
                torch.testing.assert_close(p.grad, q.grad, **GRAD_TOL, msg=lambda m: f"step {step}, {name}: {m}")
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        opt.step()
        ref_opt.step()
    assert fulmen.cache_misses(jitted) == 1


def test_asking_for_traces_compiles_the_program_the_next_call_runs():
    model = _mlp()
    jitted = fulmen.jit(_loss_fn(model), executors=["torch"], compile="async")
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    jitted(x, y).backward()
    stats = fulmen.compile_stats(jitted)
    assert stats.pending_compilations == 1
    traces = fulmen.last_traces(jitted)  # compiles fulmen's forward and backward now
    assert stats.pending_compilations == 0
    assert "autodiff" in stats.phase_times_ms and "warm_start" in stats.phase_times_ms
    assert stats.last_compile_time_ms > stats.last_trace_time_ms
    backward = fulmen.last_backward_traces(jitted)
    assert backward and "linear" in str(traces[-1]) and backward[-1].bound_symbols
    loss = jitted(x, y)
    assert _fulmen_backward(loss)
    assert fulmen.cache_misses(jitted) == 1 and fulmen.cache_hits(jitted) == 1


def test_second_call_starts_the_background_compilation_of_fused_regions():
    def f(x, w):
        return torch.tanh(x @ w).mul(3.0).sum()

    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    jitted = fulmen.jit(f, compile="async")  # the default executors: Inductor fuses tanh, mul and sum
    stats = fulmen.compile_stats(jitted)
    expected = torch.autograd.grad(f(x, w), w)[0]
    assert torch.equal(torch.autograd.grad(jitted(x, w), w)[0], expected)
    assert stats.pending_compilations == 1  # nothing is compiling: the program compiles at the next call
    out = jitted(x, w)
    assert _fulmen_backward(out)
    torch.testing.assert_close(torch.autograd.grad(out, w)[0], expected, **GRAD_TOL)
    wait_for_compilations(timeout=300)
    assert stats.pending_compilations == 0
    assert any(b.sym.name.startswith("inductor") or "fusion" in b.sym.name
               for b in fulmen.last_traces(jitted)[-1].bound_symbols), str(fulmen.last_traces(jitted)[-1])
    torch.testing.assert_close(torch.autograd.grad(jitted(x, w), w)[0], expected, **GRAD_TOL)


def _no_grad_inside(x, w):
    with torch.no_grad():
        scale = (x * w).sum()
    return (x * w * scale).sum()


def _mutates_input(x, w, counter):
    counter.add_(1)
    return (x * w).sum()


@pytest.mark.parametrize("case", ["sync", "off", "disabled", "no_grad region", "user grad rule", "own executor",
                                  "in-place input update"])
def test_first_call_stays_on_fulmen_where_autograd_could_differ(case, monkeypatch):
    fn, executors, mode = (lambda x, w: (x * w).sum()), ["torch"], "async"
    x, w = torch.randn(3, 4), torch.randn(3, 4, requires_grad=True)
    args = (x, w)
    cleanup = []
    if case in ("sync", "off"):
        mode = case
    elif case == "disabled":
        monkeypatch.setenv("FULMEN_WARM_START", "0")
    elif case == "no_grad region":
        fn = _no_grad_inside
    elif case == "user grad rule":
        def doubled_mul_grad(a, b):  # a deliberately different gradient: the first call must use it too
            out = a * b
            g = get_grad(out)
            put_grads((a, b), (2 * g * b, 2 * g * a))
            return out

        register_grad("torch.mul", doubled_mul_grad)
        cleanup.append(lambda: register_grad("torch.mul", None))
    elif case == "own executor":
        myex = register_executor(OperatorExecutor("warm_start_test_ex", version="0"))
        cleanup.append(lambda: deregister_executor(myex))
        executors = [myex]
    elif case == "in-place input update":
        fn, args = _mutates_input, (x, w, torch.zeros(()))
    try:
        jitted = fulmen.jit(fn, executors=executors, compile=mode)
        out = jitted(*args)
        assert _fulmen_backward(out), f"{case}: the first call ran {out.grad_fn}"
        (grad,) = torch.autograd.grad(out, w)
        if case == "user grad rule":
            torch.testing.assert_close(grad, 2 * x)
        else:
            eager_args = tuple(a.clone() if a is not w else a for a in args)
            torch.testing.assert_close(grad, torch.autograd.grad(fn(*eager_args), w)[0], **GRAD_TOL)
        assert fulmen.compile_stats(jitted).pending_compilations == 0
    finally:
        for undo in cleanup:
            undo()


def test_jitted_module_first_step_on_autograd_then_compiled():
    from fulmen.bench.models import build

    model, make_inputs = build("gpt-tiny")
    reference = copy.deepcopy(model)
    jitted = fulmen.jit(model, executors=["torch"], compile="async")
    inputs = make_inputs(2, targets=True)
    for step in range(3):
        _, loss = jitted(*inputs)
        _, ref_loss = reference(*inputs)
        assert _fulmen_backward(loss) == (step > 0)
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **GRAD_TOL, msg=lambda m: f"step {step}, {name}: {m}")
    assert fulmen.cache_misses(jitted) == 1
