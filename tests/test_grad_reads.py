"""``p.grad`` of tensors that are not inputs, read inside a jitted function (an optimizer step, ``clip_grad_norm_``):
the program reads the gradient on every call (fulmen.frontend.training_state.GradOf), so the usual training loop
(``zero_grad()`` sets the gradients to None, backward makes new ones) compiles once and matches eager."""

import pytest
import torch
from torch import nn

import fulmen

_OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False),
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=True),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
    # Adam's first step creates its state (refused inside a program): that one runs eagerly
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
}


def _train(jit: bool, make, set_to_none: bool, steps: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    opt = make(model.parameters())

    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()

    step = fulmen.jit(update, executors=["torch"]) if jit else update
    for i in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        torch.manual_seed(i)
        model(torch.randn(5, 3, dtype=torch.float64)).pow(2).sum().backward()
        (update if i == 0 and "Adam" in type(opt).__name__ else step)()
    return [p.detach().clone() for p in model.parameters()], step


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
@pytest.mark.parametrize("optimizer", list(_OPTIMIZERS))
def test_a_training_loop_step_compiles_once_and_matches_eager(optimizer, set_to_none):
    # zero_grad() put new gradient objects in p.grad before every step, and the guard checked them by identity: the
    # step compiled again on every call
    (params, step), (expected, _) = (
        _train(True, _OPTIMIZERS[optimizer], set_to_none),
        _train(False, _OPTIMIZERS[optimizer], set_to_none),
    )
    for got, want in zip(params, expected):
        torch.testing.assert_close(got, want)
    assert fulmen.cache_misses(step) == 1, fulmen.compile_stats(step).recompile_reasons


def test_a_parameter_whose_gradient_is_none_on_some_steps_compiles_once_per_case():
    # the second head is used on even steps only: its .grad is None on odd ones, and the optimizer skips it
    def train(jit: bool):
        torch.manual_seed(0)
        body, heads = nn.Linear(3, 4), nn.ModuleList([nn.Linear(4, 1), nn.Linear(4, 1)])
        params = [*body.parameters(), *heads.parameters()]
        opt = torch.optim.SGD(params, lr=0.1)

        def update():
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()

        step = fulmen.jit(update, executors=["torch"]) if jit else update
        for i in range(6):
            opt.zero_grad()
            h = body(torch.full((2, 3), i + 1.0))
            loss = heads[0](h).sum() + (heads[1](h).sum() if i % 2 == 0 else 0)
            loss.backward()
            step()
        return [p.detach().clone() for p in params], step

    (params, step), (expected, _) = train(True), train(False)
    for got, want in zip(params, expected):
        torch.testing.assert_close(got, want)
    assert fulmen.cache_misses(step) == 2
    assert "to None" in fulmen.compile_stats(step).recompile_reasons[0]


def test_an_in_place_write_to_a_gradient_reaches_that_calls_gradient_object():
    weight = nn.Parameter(torch.ones(3))

    def scale(x):
        weight.grad.mul_(x)  # GradScaler's unscale and clip_grad_norm_ write the gradients in place
        return weight.grad.sum()

    jitted = fulmen.jit(scale, executors=["torch"])
    for i in range(3):
        old, weight.grad = weight.grad, torch.full((3,), i + 1.0)
        grad = weight.grad
        torch.testing.assert_close(jitted(torch.tensor(2.0)), torch.tensor(6.0 * (i + 1)))
        assert weight.grad is grad and torch.equal(grad, torch.full((3,), 2.0 * (i + 1)))
        if old is not None:  # the previous call's gradient is left as that call made it
            assert torch.equal(old, torch.full((3,), 2.0 * i))
    assert fulmen.cache_misses(jitted) == 1


@pytest.mark.parametrize("read", ["p.grad.data", "two tensors holding one gradient", "the gradient as argument"])
def test_a_gradient_also_reached_another_way_is_checked_by_identity(read):
    # the traced program's view of these gradients depends on the object: .data is another tensor sharing the
    # traced gradient's memory, and one gradient read through two tensors (or also passed in) is one input
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    fns = {
        "p.grad.data": lambda x: x * a.grad.data,
        "two tensors holding one gradient": lambda x: x * a.grad + b.grad,
        "the gradient as argument": lambda x: x * a.grad + (x is a.grad),
    }
    fn = fns[read]
    jitted = fulmen.jit(fn, executors=["torch"])
    for i in range(4):
        a.grad = torch.full((3,), i + 1.0)
        b.grad = a.grad if read != "two tensors holding one gradient" or i < 2 else torch.full((3,), 7.0)
        x = a.grad if read == "the gradient as argument" and i >= 2 else torch.ones(3)
        torch.testing.assert_close(jitted(x), fn(x))


@pytest.mark.slow
def test_a_transformers_gpt2_training_loop_hits_the_cache_with_new_gradients_and_matches_eager():
    # the fast path (a new gradient object with the same layout, read at call time, a cache hit) on a program we did
    # not write: transformers' GPT-2 and torch's clip + SGD, float64, against eager step by step
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )

    def train(jit: bool):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0, foreach=True)

        def update():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()

        step = fulmen.jit(update, executors=["torch"]) if jit else update
        for i in range(4):
            opt.zero_grad()  # set_to_none: backward makes new gradient objects
            ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(i))
            model(ids, labels=ids).loss.backward()
            step()
        return [p.detach().clone() for p in model.parameters()], step

    (got, step), (want, _) = train(True), train(False)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert fulmen.cache_misses(step) == 1, fulmen.compile_stats(step).recompile_reasons
