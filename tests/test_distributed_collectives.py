"""Collectives inside jitted functions, on 2 gloo ranks, against eager distributed.

One spawned run (``_checks``, module scope) computes every program eagerly and with fulmen -- with fusion
(``compile="sync"``) and without (``executors=["torch"]``) -- and returns the pairs; the tests compare them.
"""

import warnings

import pytest
import torch
import torch.distributed as dist

from fulmen.core.bookkeeping import is_bookkeeping
from fulmen.launch import run_on_ranks


def _c10d_program(a, b, x):
    t = a * 2 + 1
    before = t.sin()  # reads t before the all-reduce overwrites it
    dist.all_reduce(t)
    after = t.cos() * 3
    gathered = torch.empty(a.shape[0] * 2, a.shape[1], dtype=a.dtype)
    dist.all_gather_into_tensor(gathered, b * 2)
    part = torch.empty(a.shape[0] // 2, a.shape[1], dtype=a.dtype)
    dist.reduce_scatter_tensor(part, a + b)
    c = b.clone()
    dist.broadcast(c, src=1)
    pieces = [torch.empty_like(b) for _ in range(2)]
    dist.all_gather(pieces, b + 1)
    u = a - 1
    work = dist.all_reduce(u, op=dist.ReduceOp.MAX, async_op=True)
    v = b.exp()  # runs while the all-reduce is in flight
    work.wait()
    dist.all_reduce(x)  # an argument: written back into the caller's tensor
    return before + after, gathered.exp(), part * 2, c + 1, pieces[0] - pieces[1], u + v


def _other_c10d_program(a):
    t = a * 2
    before = t.sin()
    out = torch.empty_like(t)
    dist.all_to_all_single(out, t)  # no symbol of its own: run on copies, its written tensors replaced
    if dist.get_rank() == 0:
        dist.send(t + 1, dst=1)
    else:
        dist.recv(t, src=0)
    return before, out.cos(), t * 3


def _functional_program(a):
    import torch.distributed._functional_collectives as fc

    group = dist.group.WORLD
    r = fc.all_reduce(a * 2, "sum", group)
    g = fc.all_gather_tensor(a.sin(), 0, group)
    s = fc.reduce_scatter_tensor(a + 1, "sum", 0, group)
    w = fc.wait_tensor(torch.ops._c10d_functional.all_reduce(a, "avg", group.group_name))
    return r + 1, g * 2, s.exp(), w


def _functional_loss(a, coef):
    import torch.distributed._functional_collectives as fc

    group = dist.group.WORLD
    r = fc.all_reduce(a * a, "sum", group)
    g = fc.all_gather_tensor(a.tanh(), 0, group)
    s = fc.reduce_scatter_tensor(a.exp(), "sum", 0, group)
    # the differentiable twins (torch.ops._c10d_functional_autograd), which DTensor calls
    g2 = fc.all_gather_tensor_autograd(a.sin(), 0, group)
    s2 = fc.reduce_scatter_tensor_autograd(a.cos(), "sum", 0, group)
    ramp = torch.arange(g.numel(), dtype=a.dtype).reshape(g.shape)
    return (r * coef).sum() + (g * ramp).sum() + (s * coef[0]).sum() + (g2 * ramp).cos().sum() + (s2 * s2).sum()


def _nn_loss(a, coef):
    import torch.distributed.nn.functional as dnn

    r = dnn.all_reduce(a * a)
    g0, g1 = dnn.all_gather(a.tanh())
    s = dnn.reduce_scatter(torch.empty(a.shape[0] // 2, a.shape[1], dtype=a.dtype), list((a.exp()).chunk(2)))
    return (r * coef).sum() + (g0 * 2 + g1 * 5).sum() + (s * coef[0, 0]).sum()


def _c10d_loss(a, coef):
    t = a * 3
    dist.all_reduce(t)  # eager's autograd does not see it: the gradient passes through unchanged
    return (t * t * coef).sum()


def _overlap_program(x, w1, w2):
    import torch.distributed._functional_collectives as fc

    h = x @ w1
    r = fc.all_reduce(h, "sum", dist.group.WORLD)
    k = (x @ w2).relu()  # does not need r: runs while r travels
    return r + k


def _in_group(a, group):
    t = a + 1
    dist.all_reduce(t, group=group)
    return t


def _grads(loss_fn, a, coef):
    a = a.clone().requires_grad_()
    loss = loss_fn(a, coef)
    loss.backward()
    return loss.detach(), a.grad


def _checks(rank, world_size):
    import fulmen
    from fulmen.executors import inductor

    warnings.filterwarnings("ignore")  # torch's deprecation notes on the collectives' older names
    gen = torch.Generator().manual_seed(rank)
    a, b = torch.randn(4, 3, generator=gen, dtype=torch.float64), torch.randn(4, 3, generator=gen, dtype=torch.float64)
    coef = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    x = torch.randn(5, generator=gen, dtype=torch.float64)
    out = {}
    x_eager = x.clone()
    expected = _c10d_program(a, b, x_eager)
    for mode, kwargs in (("fused", {"compile": "sync"}), ("torch", {"executors": ["torch"]})):
        x_jit = x.clone()
        jf = fulmen.jit(_c10d_program, **kwargs)
        got = jf(a, b, x_jit)
        inductor.wait_for_compilations()
        got_again = jf(a, b, x_jit.copy_(x))  # the cached program
        out[f"c10d_{mode}"] = (expected, got, got_again, x_eager, x_jit)
        out[f"c10d_{mode}_trace"] = str(fulmen.last_traces(jf)[-1])

    expected = _other_c10d_program(a)
    for mode, kwargs in (("fused", {"compile": "sync"}), ("torch", {"executors": ["torch"]})):
        jf = fulmen.jit(_other_c10d_program, **kwargs)
        out[f"other_c10d_{mode}"] = (expected, jf(a), jf(a))

    expected = _functional_program(a)
    for mode, kwargs in (("fused", {"compile": "sync"}), ("torch", {"executors": ["torch"]})):
        jf = fulmen.jit(_functional_program, **kwargs)
        out[f"functional_{mode}"] = (expected, jf(a), jf(a))
        out[f"functional_{mode}_trace"] = str(fulmen.last_traces(jf)[0])

    for name, fn in (("functional", _functional_loss), ("nn", _nn_loss), ("c10d", _c10d_loss)):
        jf = fulmen.jit(fn)  # default executors: the first call runs under PyTorch's autograd, the second compiled
        jitted = [_grads(fulmen.jit(fn, executors=["torch"]), a, coef), _grads(jf, a, coef), _grads(jf, a, coef)]
        out[f"grad_{name}"] = (_grads(fn, a, coef), jitted)
    jf = fulmen.jit(_nn_loss, executors=["torch"])
    _grads(jf, a, coef)
    out["nn_backward_trace"] = str(fulmen.last_backward_traces(jf)[-1])
    out["nn_backward_order"] = [
        b.sym.name for b in fulmen.last_backward_traces(jf)[-1].bound_symbols if not is_bookkeeping(b)
    ]

    other = dist.new_group([0, 1])  # the same ranks, another group: another program
    jf = fulmen.jit(_in_group, executors=["torch"])
    results = [jf(a, dist.group.WORLD), jf(a, other)]
    trace = str(fulmen.last_traces(jf)[-1])
    results.append(jf(a, dist.group.WORLD))
    out["groups"] = (_in_group(a, other), results, fulmen.cache_misses(jf), trace, other.group_name)

    w1, w2 = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    xf = a.float()
    off = {"overlap_communication": False}
    for mode, kwargs in (
        ("fused", {"compile": "sync"}),
        ("torch", {"executors": ["torch"]}),
        ("fused_off", {"compile": "sync", **off}),
        ("torch_off", {"executors": ["torch"], **off}),
    ):
        jf = fulmen.jit(_overlap_program, **kwargs)
        got = jf(xf, w1, w2)
        out[f"overlap_{mode}"] = (_overlap_program(xf, w1, w2), got)
        out[f"overlap_{mode}_order"] = [
            b.sym.name for b in fulmen.last_traces(jf)[-1].bound_symbols if not is_bookkeeping(b)
        ]
        out[f"overlap_{mode}_steps"] = fulmen.compile_stats(jf).last_trace_steps
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_checks, world_size=2, timeout=300)


def _close(got, expected):
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["fused", "torch"])
def test_c10d_collectives_on_intermediates_and_arguments_match_eager(ranks, mode):
    for out in ranks:
        expected, got, got_again, x_eager, x_jit = out[f"c10d_{mode}"]
        _close(got, expected)
        _close(got_again, expected)
        _close(x_jit, x_eager)  # the argument all-reduced in place is written back
    # the ranks' inputs differ; the all-reduced argument agrees
    _close(ranks[0][f"c10d_{mode}"][4], ranks[1][f"c10d_{mode}"][4])


def test_the_read_before_an_in_place_all_reduce_reads_the_old_value(ranks):
    trace = ranks[0]["c10d_torch_trace"]
    lines = trace.splitlines()
    sin = next(i for i, line in enumerate(lines) if "torch.sin(" in line)
    wait = next(i for i, line in enumerate(lines) if "torch.ops._c10d_functional.wait_tensor(" in line)
    start = next(i for i, line in enumerate(lines) if "torch.ops._c10d_functional.all_reduce(" in line)
    reader = lines[sin].split("torch.sin(")[1].split(")")[0]
    started = lines[start].split("all_reduce(")[1].split(",")[0]
    assert reader == started  # sin reads the value the all-reduce starts from, not its result
    assert start < wait


@pytest.mark.parametrize("mode", ["fused", "torch"])
def test_c10d_calls_without_a_symbol_of_their_own_match_eager(ranks, mode):
    for out in ranks:
        expected, got, got_again = out[f"other_c10d_{mode}"]
        _close(got, expected)
        _close(got_again, expected)


@pytest.mark.parametrize("mode", ["fused", "torch"])
def test_functional_collectives_match_eager(ranks, mode):
    for out in ranks:
        expected, got, got_again = out[f"functional_{mode}"]
        _close(got, expected)
        _close(got_again, expected)


def test_the_trace_shows_each_collective_and_its_wait(ranks):
    trace = ranks[0]["functional_torch_trace"]
    for op in ("all_reduce(", "all_gather_into_tensor(", "reduce_scatter_tensor(", "wait_tensor("):
        assert f"torch.ops._c10d_functional.{op}" in trace, op
    assert "fallback" not in trace


def test_a_different_process_group_is_a_different_program(ranks):
    for out in ranks:
        expected, results, misses, trace, name = out["groups"]
        for got in results:
            _close(got, expected)
        assert misses == 2
    assert f"'{name}')" in trace.split("all_reduce(")[1].splitlines()[0]


@pytest.mark.parametrize("kind", ["functional", "nn", "c10d"])
def test_gradients_through_collectives_match_eager(ranks, kind):
    for out in ranks:
        (loss_e, grad_e), jitted = out[f"grad_{kind}"]
        for loss_j, grad_j in jitted:
            _close(loss_j, loss_e)
            _close(grad_j, grad_e)


def test_the_backward_of_all_gather_reduce_scatters_and_of_reduce_scatter_all_gathers(ranks):
    trace = ranks[0]["nn_backward_trace"]
    assert "torch.ops._c10d_functional.reduce_scatter_tensor(" in trace
    assert "torch.ops._c10d_functional.all_gather_into_tensor(" in trace
    assert "torch.ops._c10d_functional.all_reduce(" in trace


@pytest.mark.parametrize("mode", ["fused", "torch"])
def test_overlap_starts_the_collective_before_and_waits_after_independent_compute(ranks, mode):
    for out in ranks:
        expected, got = out[f"overlap_{mode}"]
        torch.testing.assert_close(got, expected)
    order = ranks[0][f"overlap_{mode}_order"]
    start, wait = order.index("all_reduce"), order.index("wait_tensor")
    # the independent matmul (alone, or inside a fused region) runs while the all-reduce is in flight
    between = order[start + 1 : wait]
    assert any(name in ("matmul", "relu") or name.startswith("inductor_fusion") for name in between), order
    assert order[wait + 1 :], order  # the reader of the result runs after the wait


@pytest.mark.parametrize("mode", ["fused", "torch"])
def test_overlap_is_an_option_of_each_jitted_function(ranks, mode):
    for out in ranks:
        expected, got = out[f"overlap_{mode}_off"]
        torch.testing.assert_close(got, expected)
    assert "overlap" in ranks[0][f"overlap_{mode}_steps"]
    assert "overlap" not in ranks[0][f"overlap_{mode}_off_steps"]  # overlap_communication=False: the step is off


def test_the_backward_starts_every_independent_collective_before_waiting_for_any(ranks):
    order = ranks[0]["nn_backward_order"]
    starts = [
        i for i, name in enumerate(order) if name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
    ]
    waits = [i for i, name in enumerate(order) if name == "wait_tensor"]
    assert len(starts) == len(waits) == 3, order
    assert max(starts) < min(waits), order
