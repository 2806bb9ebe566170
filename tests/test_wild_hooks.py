"""Hooks, parametrizations, optimizers and observers as programs nobody here wrote use them, compared with eager
over several calls (a change between calls is where a cache goes wrong)."""

import warnings

import pytest
import torch
import torch.nn as nn

import fulmen


def _qat_model() -> nn.Module:
    import torch.ao.quantization as quantization

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model.qconfig = quantization.get_default_qat_qconfig("x86")  # fused observers: per-tensor and per-channel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantization.prepare_qat(model.train())


def test_a_fused_observer_updates_its_statistics_once_per_training_step():
    # torch.fused_moving_avg_obs_fake_quant writes the running min/max, scale and zero point it is given; the
    # backward, which runs the op again under PyTorch's autograd, moved the averages a second time
    from torch.ao.quantization import FusedMovingAvgObsFakeQuantize, MovingAverageMinMaxObserver

    states = []
    for jit in (False, True):
        fake_quant = FusedMovingAvgObsFakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255)
        run = fulmen.jit(fake_quant, executors=["torch"]) if jit else fake_quant
        steps = []
        for i in range(3):
            torch.manual_seed(10 + i)
            x = (torch.randn(5) * (i + 1)).requires_grad_()
            (run(x) * torch.arange(5.0)).sum().backward()
            steps.append(({k: v.clone() for k, v in fake_quant.state_dict().items()}, x.grad))
        states.append(steps)
    for (eager_state, eager_grad), (state, grad) in zip(*states):
        for k in eager_state:
            torch.testing.assert_close(state[k], eager_state[k], rtol=0, atol=0, msg=k)  # the same kernel
        torch.testing.assert_close(grad, eager_grad)


@pytest.mark.slow
def test_qat_observers_update_their_statistics_once_per_training_step():
    # per-tensor and per-channel fused observers; the per-channel ones resize their scale on the first call (that
    # call runs eagerly, logged), so later calls are compiled for the new shapes
    states = []
    for jit in (False, True):
        model = _qat_model()
        run = fulmen.jit(model) if jit else model
        steps = []
        for i in range(3):
            torch.manual_seed(10 + i)
            out = run(torch.randn(3, 4) * (i + 1))
            out.sum().backward()
            steps.append(
                (
                    {k: v.clone() for k, v in model.state_dict().items()},
                    out.detach(),
                    [p.grad.clone() for p in model.parameters()],
                )
            )
        states.append(steps)
    for (eager_state, eager_out, eager_grads), (state, out, grads) in zip(*states):
        assert eager_state.keys() == state.keys()
        for k in eager_state:
            torch.testing.assert_close(state[k], eager_state[k], rtol=0, atol=0, msg=k)  # the same kernels
        torch.testing.assert_close(out, eager_out)
        for g, eager_g in zip(grads, eager_grads):
            torch.testing.assert_close(g, eager_g)


def test_a_foreach_update_of_list_arguments_is_part_of_the_program():
    # torch._foreach_lerp_ has no torch-language rule: as an opaque op whose result nothing reads, it was dropped
    def update(ema, params):
        torch._foreach_lerp_(ema, params, 0.5)
        return ema[0] * 2

    jitted = fulmen.jit(update, executors=["torch"])
    ema, ema_ref = [torch.zeros(3), torch.zeros(2)], [torch.zeros(3), torch.zeros(2)]
    params = [torch.ones(3), torch.full((2,), 4.0)]
    for _ in range(2):
        torch.testing.assert_close(jitted(ema, params), update(ema_ref, params))
        torch.testing.assert_close(ema, ema_ref)
    assert fulmen.cache_misses(jitted) == 1


def test_a_foreach_update_of_global_tensors_runs_on_every_call():
    # an EMA of a model's weights kept in a closure: a torch call with no rule on tensors that are not proxies ran
    # once, while tracing, and never again
    ema = [torch.zeros(3), torch.zeros(2)]
    weights = [torch.ones(3), torch.ones(2)]

    def update(decay):
        torch._foreach_lerp_(ema, weights, 1 - decay)
        torch._foreach_clamp_max_(ema, 0.7)

    jitted = fulmen.jit(update, executors=["torch"])
    expected = [torch.zeros(3), torch.zeros(2)]
    for _ in range(3):
        jitted(0.5)
        torch._foreach_lerp_(expected, weights, 0.5)
        torch._foreach_clamp_max_(expected, 0.7)
        torch.testing.assert_close(ema, expected)
    assert fulmen.cache_misses(jitted) == 1


@pytest.mark.parametrize("returned", ["relu_", "foreach"])
def test_an_in_place_function_returns_what_eager_returns(returned):
    def f(x):
        if returned == "relu_":
            y = torch.relu_(x)  # torch.relu_ returns its argument
            return y is x, y
        xs = [x]
        ys = torch._foreach_add_(xs, 1.0)  # returns the list it was given
        return ys is xs, ys[0]

    x, x_ref = torch.randn(3), None
    x_ref = x.clone()
    is_same, y = fulmen.jit(f, executors=["torch"])(x)
    eager_same, eager_y = f(x_ref)
    assert is_same == eager_same
    torch.testing.assert_close(y, eager_y)
    torch.testing.assert_close(x, x_ref)
