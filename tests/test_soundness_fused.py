"""Fused regions, recomputed values and swapped-in kernels compute exactly what the program computes.

Every test compares forward values and gradients with eager PyTorch."""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.core.trace import check_trace


def _grads(fn, inputs, *args):
    out = fn(*inputs, *args)
    return out, torch.autograd.grad(out.sum(), inputs)


def _compare(jf, fn, inputs, *args, calls=2, **tol):
    """``jf`` against eager ``fn``: forward and gradients of ``inputs``, for ``calls`` calls (a cache hit too)."""
    expected, expected_grads = _grads(fn, inputs, *args)
    for _ in range(calls):
        out, grads = _grads(jf, inputs, *args)
        torch.testing.assert_close(out, expected, **tol)
        for g, e in zip(grads, expected_grads):
            torch.testing.assert_close(g, e, **tol)


# ---------------------------------------------------------------------------------------------------------
# a symbol that passes an input through as one of its outputs


def _gather_of_broadcast(x, c):
    y = x * 2
    v, l = torch.broadcast_tensors(c.unsqueeze(-1), y)  # l is y itself: it has the common shape already
    return l.gather(-1, v[..., :1]).sum() + (y * y).sum()


def test_backward_recomputes_no_value_a_symbol_passes_through():
    """``broadcast_tensors`` returns ``y`` under its own name: recomputing the index in the backward must not
    recompute ``y`` with it (it would read ``y`` before defining it)."""
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    c = torch.tensor([0, 3, 1])
    jf = fulmen.jit(_gather_of_broadcast, executors=["torch"])
    _compare(jf, _gather_of_broadcast, (x,), c, calls=3)
    for trace in fulmen.last_backward_traces(jf):
        check_trace(trace)


@pytest.mark.parametrize("executors", [["torch"], None])
def test_categorical_log_prob(executors):
    """A policy-gradient loss with a penalty on the normalized logits: ``log_prob`` broadcasts the actions against
    the normalized logits, which the penalty reads too. (With the default executors, fused regions run unfused:
    the test suite's compile mode.)"""
    def f(logits, actions):
        dist = torch.distributions.Categorical(logits=logits * 2, validate_args=False)
        return dist.log_prob(actions).sum() + 0.01 * (dist.logits * dist.logits).sum()

    logits = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    actions = torch.tensor([0, 5, 2, 2, 1])
    jf = fulmen.jit(f, executors=executors)
    _compare(jf, f, (logits,), actions, calls=3)
    torch.autograd.gradcheck(lambda lg: jf(lg, actions), (logits,))


# ---------------------------------------------------------------------------------------------------------
# values whose bits the backward compares are saved, not recomputed


def _pool_of_gelu(x):
    return F.max_pool2d(F.gelu(x), 2)


def _recomputed_ops(jf):
    return {b.sym.name for t in fulmen.last_backward_traces(jf)[-1:] for b in t.bound_symbols
            for s in (b, *b.subsymbols)}


def test_backward_saves_what_it_compares_with_a_saved_maximum():
    """max_pool2d's gradient compares its input with the saved maximum for equality: the GELU before it is
    saved, because a recomputation (by another kernel) need not reproduce its bits."""
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    jf = fulmen.jit(_pool_of_gelu, executors=["torch"])
    _compare(jf, _pool_of_gelu, (x,))
    assert not {"gelu", "erf"} & _recomputed_ops(jf), fulmen.last_backward_traces(jf)[-1]


def test_backward_still_recomputes_data_movement_and_ordinary_values():
    """Only the bits that decide matter: max-pooling saves the positions it picked (not its windows), and an
    activation whose gradient compares nothing is still recomputed."""
    def f(x):
        return F.max_pool2d(F.gelu(x), 2) * 2 + torch.sin(x * 3).sum()

    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    jf = fulmen.jit(f, executors=["torch"])
    _compare(jf, f, (x,))
    saved = fulmen.last_traces(jf)[-1].output[1:]
    # x and the positions max-pooling picked (eager's indices): sin's input (x * 3) is recomputed from x
    assert [(tuple(p.shape), p.dtype) for p in saved] == [((2, 3, 8, 8), torch.float32), ((2, 3, 16), torch.int64)], \
        saved


def test_fused_max_pool_of_gelu_gradients_match_eager():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    jf = fulmen.jit(_pool_of_gelu, compile="sync")
    _compare(jf, _pool_of_gelu, (x,), rtol=1e-5, atol=1e-6)
    assert any(b.sym.is_fusion for b in fulmen.last_backward_traces(jf)[-1].bound_symbols)


# ---------------------------------------------------------------------------------------------------------
# casts to a lower precision round inside fused regions, as they do in eager


def _low_precision_intermediates(x):
    return (x.to(torch.bfloat16).amax(-1).float(),  # the gradient compares with a bfloat16 maximum
            (x > x.to(torch.bfloat16)).float() * x,  # true exactly where rounding went down
            (x.to(torch.float16) * 3).float() + x)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fused_casts_to_lower_precision_round_as_in_eager(mode):
    import torch._inductor.config as inductor_config

    from fulmen.executors.inductor_compile import wait_for_compilations

    emulating = inductor_config.emulate_precision_casts
    torch.manual_seed(0)
    x = torch.randn(4, 33, requires_grad=True)
    jf = fulmen.jit(_low_precision_intermediates, compile=mode)
    expected = _low_precision_intermediates(x)
    expected_grad, = torch.autograd.grad(sum(e.sum() for e in expected), x)
    for call in range(4):
        if call == 2:
            wait_for_compilations()  # the last calls run the swapped-in kernels
        out = jf(x)
        grad, = torch.autograd.grad(sum(o.sum() for o in out), x)
        for o, e in zip(out, expected):
            torch.testing.assert_close(o, e, rtol=0, atol=0)
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
    assert any(b.sym.is_fusion for b in fulmen.last_traces(jf)[-1].bound_symbols)
    assert inductor_config.emulate_precision_casts == emulating, "fulmen's compiles leave Inductor's config as it was"


# ---------------------------------------------------------------------------------------------------------
# a kernel that swaps in returns what the unfused region returned, in the same layouts


class _ConvNeXtBlock(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dwconv = torch.nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.pwconv1 = torch.nn.Linear(dim, 4 * dim)
        self.pwconv2 = torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        return x + self.pwconv2(F.gelu(self.pwconv1(y))).permute(0, 3, 1, 2)


class _ConvNeXt(torch.nn.Module):
    """A stem convolution, a LayerNorm over channels through ``permute``, a depthwise-convolution block."""

    def __init__(self, dim=8):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, dim, 4, stride=4)
        self.norm = torch.nn.LayerNorm(dim)
        self.block = _ConvNeXtBlock(dim)

    def forward(self, x, w):
        x = self.norm(self.stem(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return (self.block(x) * w).sum()


@pytest.fixture
def kernels_checked_against_regions(monkeypatch):
    """Every call of a compiled kernel also runs the region unfused on the same inputs: same values, same strides."""
    from fulmen.executors import inductor, inductor_layout

    monkeypatch.setattr(inductor_layout, "CHECK_LAYOUTS", True)
    checked = []
    call = inductor.FusedRegion.__call__

    def checking_call(self, *args):
        key = tuple((a.shape, a.stride()) for a in args)
        if key not in self.variants:
            return call(self, *args)
        got = call(self, *args)
        expected = self.eager(*args)
        for g, e in zip(got, expected if isinstance(expected, (tuple, list)) else (expected,)):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
            assert g.numel() <= 1 or g.stride() == e.stride(), (self.name, g.shape, g.stride(), e.stride())
        checked.append(self.name)
        return got

    monkeypatch.setattr(inductor.FusedRegion, "__call__", checking_call)
    return checked


def test_async_swap_in_keeps_convnext_gradients(kernels_checked_against_regions, caplog):
    """The regions' kernels compile in the background and swap in between steps; every step's loss and gradients
    match eager's. The backward region runs unfused for the layouts the forward's kernel returns while its own
    kernel compiles: those layouts must be the unfused forward's (its aten calls read mean and rstd as
    contiguous)."""
    from fulmen.executors.inductor_compile import wait_for_compilations

    torch.manual_seed(0)
    model, x, w = _ConvNeXt(), torch.randn(2, 3, 16, 16), torch.randn(2, 8, 4, 4)
    jitted = _ConvNeXt()
    jitted.load_state_dict(model.state_dict())
    jm = fulmen.jit(jitted, compile="async")
    programs = []
    for step in range(5):
        if step == 2:
            wait_for_compilations()
        loss, jloss = model(x, w), jm(x, w)
        if step in (1, 4):  # the program the unfused regions ran, and the one the kernels run: the same traces
            programs.append([str(t) for t in (fulmen.last_traces(jm)[-1], fulmen.last_backward_traces(jm)[-1])])
        grads = torch.autograd.grad(loss, list(model.parameters()))
        jgrads = torch.autograd.grad(jloss, list(jitted.parameters()))
        torch.testing.assert_close(jloss, loss, rtol=1e-5, atol=1e-5)
        for (name, _), g, e in zip(model.named_parameters(), jgrads, grads):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step}, {name}: {m}")
    assert kernels_checked_against_regions, "the kernels swapped in"
    assert programs[0] == programs[1]
    assert not [r for r in caplog.records if r.levelname == "WARNING" and r.name.startswith("fulmen")]


@pytest.mark.slow
def test_async_swap_in_keeps_hf_convnext_gradients(kernels_checked_against_regions):
    transformers = pytest.importorskip("transformers")
    from fulmen.executors.inductor_compile import wait_for_compilations

    torch.manual_seed(0)
    config = transformers.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
                                         image_size=32, patch_size=4, layer_scale_init_value=0.5)
    model = transformers.ConvNextModel(config)
    jitted = transformers.ConvNextModel(config)
    jitted.load_state_dict(model.state_dict())
    jm = fulmen.jit(jitted, compile="async")
    x, w = torch.randn(2, 3, 32, 32), torch.randn(2, 16, 4, 4)
    params = [n for n, _ in model.named_parameters() if n.startswith(("embeddings.", "encoder."))]
    for step in range(4):
        if step == 2:
            wait_for_compilations()
        loss = (model(x).last_hidden_state * w).sum()
        jloss = (jm(x).last_hidden_state * w).sum()
        grads = torch.autograd.grad(loss, [model.get_parameter(n) for n in params])
        jgrads = torch.autograd.grad(jloss, [jitted.get_parameter(n) for n in params])
        torch.testing.assert_close(jloss, loss, rtol=1e-5, atol=1e-4)
        for name, g, e in zip(params, jgrads, grads):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step}, {name}: {m}")
    assert kernels_checked_against_regions, "the kernels swapped in"


def test_kernel_outputs_in_other_strides_are_copied_into_the_traced_ones():
    """A compiled graph whose outputs come in other strides than the traced graph's (one from Inductor's on-disk
    cache, compiled before its outputs were marked visible) is wrapped: the outputs come back in the traced
    layouts, with the same values."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fulmen.executors.inductor_layout import with_eager_strides

    def region(x):
        return x.permute(0, 2, 1) * 2, x.sum(1, keepdim=True)

    x = torch.randn(2, 3, 4)
    gm = make_fx(region, tracing_mode="fake")(x)

    class Compiled:  # what Inductor hands back: contiguous outputs, and the strides it recorded for them
        output_strides = [("12", "4", "1"), ("4", "4", "1")]

    def call(args):
        a, b = region(*args)
        return [a.contiguous(), b.contiguous()]

    fixed = with_eager_strides(call, Compiled(), gm, region, [x])
    assert fixed is not call
    for got, expected in zip(fixed([x]), region(x)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert got.stride() == expected.stride()
    Compiled.output_strides = [tuple(str(s) for s in o.stride()) for o in region(x)]
    assert with_eager_strides(call, Compiled(), gm, region, [x]) is call


def test_remat_recomputes_a_compared_value_only_by_operations_that_reproduce_its_bits():
    """``choose_saved`` and ``coarsen`` on a value the backward compares (``v``, a broadcast of ``exp(x)``): the
    broadcast may run again on the saved ``exp(x)``, ``exp`` may not -- also not as part of a whole symbol."""
    from fulmen import prims
    from fulmen.core.proxies import TensorProxy
    from fulmen.core.symbol import Symbol
    from fulmen.core.trace import Trace, tracectx
    from fulmen.transforms.linearize import Node
    from fulmen.transforms.remat import bit_exact_reads, choose_saved, coarsen

    trc = Trace()
    with tracectx(trc):
        x = TensorProxy(shape=(8,), dtype=torch.float32, device="cpu")
        e = prims.exp(x)
        v = prims.broadcast_in_dim(e, (8, 8), (0,))
        exp_b, bcast_b = trc.bound_symbols
        m = prims.amax(v, (1,))
        prims.eq(v, prims.broadcast_in_dim(m, (8, 8), (0,)))  # the backward of amax
    assert v.name in bit_exact_reads(trc.bound_symbols[-2:])
    whole = Symbol(name="exp_then_broadcast", id="test.exp_then_broadcast", is_prim=False, tags=())
    node = Node(whole.bind(x, output=v, subsymbols=(exp_b, bcast_b)), [Node(exp_b), Node(bcast_b)])
    leaves = [exp_b, bcast_b]

    saved, producers = choose_saved(leaves, [x], [v.name, x.name])
    assert producers[v.name] is bcast_b and producers[e.name] is exp_b  # exp recomputed from x
    assert coarsen([node], [p.name for p in saved], producers)[v.name] is node.bsym

    saved, producers = choose_saved(leaves, [x], [v.name, x.name], exact={v.name})
    assert {p.name for p in saved} == {x.name, e.name} and set(producers) == {v.name}
    assert coarsen([node], [p.name for p in saved], producers, {v.name})[v.name] is bcast_b
