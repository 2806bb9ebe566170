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
            y = torch.relu_(x)  # torch.relu_ returns its argument (a control: it has a rule, and was already eager's)
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


class _WithExtraState(nn.Linear):
    _version = 3  # a module class's own version, which its _load_from_state_dict may read

    def get_extra_state(self):
        return {"calls": 7}

    def set_extra_state(self, state):
        self.loaded = state


_SCALE = torch.ones(1)


def _with_state_dict_hooks() -> nn.Module:
    m = nn.Linear(2, 2)
    m.register_state_dict_post_hook(lambda mod, sd, prefix, meta: sd.__setitem__(prefix + "scale", _SCALE))
    m._register_load_state_dict_pre_hook(lambda sd, prefix, *args: sd.pop(prefix + "scale", None))
    return m


def _checkpoint_wrapped() -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(nn.Linear(2, 2))  # its state_dict hook strips the wrapper's prefix


@pytest.mark.parametrize(
    "make",
    [
        _with_state_dict_hooks,
        lambda: _WithExtraState(2, 2),
        lambda: torch.nn.utils.spectral_norm(nn.Linear(2, 2)),
        _checkpoint_wrapped,
        lambda: nn.BatchNorm1d(2),
    ],
    ids=["hooks", "extra_state", "spectral_norm", "checkpoint_wrapper", "batch_norm_version"],
)
@pytest.mark.parametrize("nested", [False, True])
def test_state_dict_of_a_jitted_module_is_the_originals(make, nested):
    # the wrapper shared the original's tensors but not its state_dict hooks, extra state or version, so keys went
    # missing (or kept a prefix) and loading the eager model's state_dict into it failed
    torch.manual_seed(0)
    model = make()
    jitted = fulmen.jit(model, executors=["torch"])
    jitted(torch.randn(3, 2))
    eager_holder, holder = (nn.Sequential(model), nn.Sequential(jitted)) if nested else (model, jitted)
    expected, got = eager_holder.state_dict(), holder.state_dict()
    assert list(got) == list(expected)
    assert got._metadata == expected._metadata
    for k in expected:
        if isinstance(expected[k], torch.Tensor):
            assert got[k].data_ptr() == expected[k].data_ptr()  # the very tensors, not copies
        else:
            assert got[k] == expected[k]
    holder.load_state_dict(expected)  # strict: the same keys are expected
    eager_holder.load_state_dict(got)
    if isinstance(model, _WithExtraState):
        assert model.loaded == {"calls": 7}


def test_a_gradient_replaced_between_calls_is_the_one_read():
    # the program captured the .grad tensor object it read; zero_grad() (set_to_none) and backward put a new one there.
    # It is read on every call (tests/test_grad_reads.py): a like one runs the same program, another layout compiles
    model = nn.Linear(3, 1)
    model.weight.grad = torch.ones(1, 3)
    scaled = fulmen.jit(lambda x: x * model.weight.grad, executors=["torch"])
    torch.testing.assert_close(scaled(torch.ones(3)), torch.ones(1, 3))
    model.weight.grad = torch.full((1, 3), 2.0)
    torch.testing.assert_close(scaled(torch.ones(3)), torch.full((1, 3), 2.0))
    model.weight.grad = torch.full((3, 1), 3.0).t()  # the same shape, transposed strides
    torch.testing.assert_close(scaled(torch.ones(3)), torch.full((1, 3), 3.0))
    assert fulmen.cache_misses(scaled) == 2
    assert "the .grad of a tensor" in fulmen.compile_stats(scaled).recompile_reasons[-1]


def _sgd_steps(jit: bool, set_to_none: bool, clip: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)

    def update():
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()

    # the optimizer's own method (torch's code, not the user's) traced directly
    step = update if clip else opt.step
    step = fulmen.jit(step, executors=["torch"]) if jit else step
    for i in range(3):
        opt.zero_grad(set_to_none=set_to_none)
        torch.manual_seed(i)
        model(torch.randn(5, 3)).pow(2).sum().backward()
        step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("clip", [False, True], ids=["opt.step", "clip_grad_norm_+step"])
def test_a_jitted_optimizer_step_matches_eager_over_steps(set_to_none, clip):
    # jit(opt.step): torch's optimizer code between the jitted function and param.add_ counted as fulmen's own, so
    # the update ran once, while tracing; and the gradients it read were the first step's tensors on every call
    for got, expected in zip(_sgd_steps(True, set_to_none, clip), _sgd_steps(False, set_to_none, clip)):
        torch.testing.assert_close(got, expected)


def test_an_aten_function_without_a_rule_reads_global_tensors_on_every_call():
    # torch.cummax and torch._foreach_norm have no torch-language rule: on tensors that are not proxies they ran
    # while tracing, and their results were constants of the program
    weights = [torch.ones(3), torch.ones(2)]

    def stats(x):
        norms = torch._foreach_norm(weights)
        return x * torch.cummax(weights[0], 0).values + norms[0] + norms[1]

    jitted = fulmen.jit(stats, executors=["torch"])
    for i in range(3):
        with torch.no_grad():
            weights[0].mul_(torch.tensor([1.0, 3.0, 2.0]))
            weights[1].add_(i)
        torch.testing.assert_close(jitted(torch.ones(3)), stats(torch.ones(3)))
    assert fulmen.cache_misses(jitted) == 1


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), NotImplementedError),
        (torch.optim.Adam, fulmen.DataDependentError),
    ],
    ids=["sgd_momentum", "adam"],
)
def test_an_optimizer_whose_first_step_makes_state_leaves_no_placeholders_in_it(make, error):
    # the first step stores momentum buffers (Adam: moments, a step count) in opt.state: while tracing those were
    # proxies, left there for the next call (an invalid program) and for eager steps after it
    from fulmen.core.proxies import TensorProxy

    model = nn.Linear(3, 2)
    opt = make(model.parameters())

    def update():
        opt.step()

    model(torch.ones(1, 3)).sum().backward()
    # Adam's for-loop step branches on a tensor (its capturable check) before it stores state
    with pytest.raises(error, match="state of the optimizer" if error is NotImplementedError else r"bool\(tensor\)"):
        fulmen.jit(update, executors=["torch"])()
    assert not any(isinstance(v, TensorProxy) for state in opt.state.values() for v in state.values())
    opt.step()  # eagerly, as if never traced
    assert all(
        isinstance(state["exp_avg" if "exp_avg" in state else "momentum_buffer"], torch.Tensor)
        and not isinstance(next(iter(state.values())), TensorProxy)
        for state in opt.state.values()
    )


@pytest.mark.parametrize("through", ["opt.step", "a function calling opt.step"])
def test_an_lr_scheduler_changing_the_learning_rate_between_steps_is_seen(through):
    # group["lr"] is a Python float the step reads: the program held the first step's value; an LR scheduler
    # (which also wraps opt.step in a function of its own) changes it between calls
    def steps(jit: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (epoch + 1))

        def update():
            opt.step()

        step = opt.step if through == "opt.step" else update
        step = fulmen.jit(step, executors=["torch"]) if jit else step
        for i in range(3):
            opt.zero_grad(set_to_none=False)  # the same gradient tensors on every call
            model(torch.full((1, 3), i + 1.0)).sum().backward()
            step()
            scheduler.step()
        return [p.detach().clone() for p in model.parameters()]

    for got, expected in zip(steps(True), steps(False)):
        torch.testing.assert_close(got, expected)


def test_a_jitted_averaged_model_update_is_refused_rather_than_run_once():
    # AveragedModel.update_parameters (torch's code) ran while tracing and never again; it reassigns its n_averaged
    # buffer, which a program of another module cannot do
    from torch.optim.swa_utils import AveragedModel

    model = nn.Linear(3, 2)
    averaged = AveragedModel(model)
    with pytest.raises(NotImplementedError, match="n_averaged"):
        fulmen.jit(averaged.update_parameters, executors=["torch"])(model)


def test_a_grad_scaler_step_inside_jit_skips_the_inf_step_and_updates_its_scale_as_eager():
    # torch._amp_foreach_non_finite_check_and_unscale_ and torch._amp_update_scale_ write their arguments (found_inf,
    # the scale, the growth tracker): they ran once, while tracing, so the scale never changed again
    def steps(jit: bool):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)

        def update():
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()

        update = fulmen.jit(update, executors=["torch"]) if jit else update
        scales = []
        for i in range(3):
            opt.zero_grad(set_to_none=False)
            x = torch.randn(3, 4) * (float("inf") if i == 1 else 1.0)  # step 1 is skipped, its scale halved
            scaler.scale(model(x).sum()).backward()
            update()
            scales.append(scaler.get_scale())
        return scales, [p.detach().clone() for p in model.parameters()]

    (scales, params), (eager_scales, eager_params) = steps(True), steps(False)
    assert scales == eager_scales
    for got, expected in zip(params, eager_params):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("executors", [["torch"], None], ids=["torch", "default"])
def test_a_tensor_hook_reading_tensors_the_function_computed_sees_each_calls_values(executors):
    # the hook's closure held the proxies of the trace: calling it at backward time raised deep in generated code
    calls = []

    def f(x):
        mask = (x > 0).to(x.dtype)
        scale = x.sigmoid()  # requires grad: eager's hook reads it without differentiating through it
        y = x * 2
        y.register_hook(lambda g: calls.append(1) or g * mask * scale)
        return (y * y).sum()

    jitted = fulmen.jit(f, executors=executors)
    for i in range(3):
        torch.manual_seed(i)
        x = torch.randn(5, dtype=torch.float64, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        jitted(x).backward()
        f(x_ref).backward()
        torch.testing.assert_close(x.grad, x_ref.grad)
    assert len(calls) == 6  # once per backward, in both


def test_a_tensor_hook_reading_traced_tensors_through_a_list_is_refused():
    def f(x):
        saved = [x.exp()]
        y = x * 2
        y.register_hook(lambda g: g * saved[0])
        return y.sum()

    with pytest.raises(NotImplementedError, match="through the list 'saved'"):
        fulmen.jit(f, executors=["torch"])(torch.randn(3, requires_grad=True))


def test_zero_grad_setting_gradients_to_none_inside_jit_is_refused_and_leaves_them():
    # zero_grad() assigned p.grad = None while tracing only: later calls kept accumulating into the gradients
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def update():
        opt.step()
        opt.zero_grad()

    model(torch.ones(1, 3)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NotImplementedError, match=r"assigns the \.grad"):
        fulmen.jit(update, executors=["torch"])()
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), b)


_PARAMETER_EDITS = {
    "add_param_group": lambda opt, extra: opt.add_param_group({"params": [extra], "lr": 0.05}),
    "params.append": lambda opt, extra: opt.param_groups[0]["params"].append(extra),
    "params.pop": lambda opt, extra: opt.param_groups[0]["params"].pop(),
    "params[1] = other": lambda opt, extra: opt.param_groups[0]["params"].__setitem__(1, extra),
    "del param_groups[1]": lambda opt, extra: opt.param_groups.__delitem__(1),
    "param_groups rebound": lambda opt, _: setattr(opt, "param_groups", [{**g, "lr": 0.5} for g in opt.param_groups]),
}


def _steps_with_edited_parameters(jit: bool, make, edit: str, eager_steps: tuple, through_function=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1))
    first, _, second = model
    opt = make([{"params": [first.weight, first.bias]}, {"params": [second.weight], "lr": 0.2}])

    def update():
        opt.step()

    step = update if through_function else opt.step
    step = fulmen.jit(step, executors=["torch"]) if jit else step
    for i in range(4):
        if i == 2:
            _PARAMETER_EDITS[edit](opt, second.bias)
        model.zero_grad()
        torch.manual_seed(i)
        model(torch.randn(4, 3)).pow(2).sum().backward()
        (opt.step if i in eager_steps else step)()
    return [p.detach().clone() for p in model.parameters()], fulmen.compile_stats(step).recompile_reasons if jit else []


@pytest.mark.parametrize("edit", list(_PARAMETER_EDITS))
def test_a_jitted_optimizer_step_sees_its_parameter_lists_change(edit):
    # the program updates the parameters it was traced with: a group added or removed, a parameter appended, removed or
    # replaced in a group's list, or param_groups rebound (with new hyperparameters) ran the old program, which skipped
    # or kept updating parameters and read the old groups' learning rates
    sgd = lambda groups: torch.optim.SGD(groups, lr=0.1)  # noqa: E731
    got, reasons = _steps_with_edited_parameters(True, sgd, edit, ())
    expected, _ = _steps_with_edited_parameters(False, sgd, edit, ())
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    assert len(reasons) == 1 and "the optimizer SGD" in reasons[0]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("through", ["opt.step", "a function calling opt.step"])
def test_a_jitted_momentum_step_updates_a_parameter_group_added_after_it_was_traced(foreach, through):
    # the momentum buffers of the new group are made by an eager step (a first step is not traced): the jitted step
    # after it must update the added group too
    sgd = lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, foreach=foreach)  # noqa: E731
    function = through != "opt.step"
    got, reasons = _steps_with_edited_parameters(True, sgd, "add_param_group", (0, 2), function)
    expected, _ = _steps_with_edited_parameters(False, sgd, "add_param_group", (0, 2), function)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    assert len(reasons) == 1 and "the optimizer SGD" in reasons[0] and "add_param_group" in reasons[0]


def test_a_jitted_adam_step_updates_a_parameter_group_added_after_it_was_traced():
    # only whether the added parameter moves: a jitted foreach Adam step's bias corrections are not yet eager's
    # (reported separately), so its values are not compared here
    model = nn.Linear(3, 1)
    opt = torch.optim.Adam([model.weight], lr=0.1, foreach=True)
    step = fulmen.jit(opt.step, executors=["torch"])
    for i in range(4):
        if i == 2:
            opt.add_param_group({"params": [model.bias]})
        model.zero_grad()
        model(torch.full((2, 3), i + 1.0)).sum().backward()
        before = model.bias.detach().clone()
        (opt.step if i in (0, 2) else step)()  # eager steps make the state of new parameters
    assert not torch.equal(model.bias, before)
    reason = fulmen.compile_stats(step).recompile_reasons[-1]
    assert "the optimizer Adam" in reason and "add_param_group" in reason
