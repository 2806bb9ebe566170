"""Metadata a compiled call gives as eager gives it: strides of elementwise results, identity of returned inputs,
dtypes under autocast, ``is_inference`` and errors eager raises in backward."""

from __future__ import annotations

import pytest
import torch

import fulmen


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- an input returned unchanged is the caller's tensor, with or without a gradient ----


@pytest.mark.parametrize("op", ["conj", "resolve_conj", "resolve_neg", "identity", "pair"])
def test_an_input_returned_unchanged_that_requires_grad_is_the_callers_tensor(op):
    # eager: x.conj() of a real x is x itself (a leaf, no grad_fn); fulmen returned autograd.Function's view of x
    fns = {
        "conj": lambda x: x.conj(),
        "resolve_conj": lambda x: x.resolve_conj(),
        "resolve_neg": lambda x: x.resolve_neg(),
        "identity": lambda x: x,
        "pair": lambda x: (x.conj(), x * 3),
    }
    fn = fns[op]
    x = torch.randn(3, 2, dtype=torch.float64, generator=_gen(0), requires_grad=True)
    got, want = fulmen.jit(fn, executors=["torch"])(x), fn(x)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    assert [g is x for g in got] == [w is x for w in want] == [True] + [False] * (len(want) - 1)
    assert got[0].grad_fn is None and got[0].is_leaf
    cts = [torch.randn(w.shape, dtype=w.dtype, generator=_gen(k + 1)) for k, w in enumerate(want)]
    (grad_got,) = torch.autograd.grad(got, x, cts)
    (grad_want,) = torch.autograd.grad(want, x, cts)
    torch.testing.assert_close(grad_got, grad_want, rtol=0, atol=0)


# ---- layouts of elementwise results (wide fuzz seeds 619, 692, 819) ----


class _Compare(torch.nn.Module):
    """A parameter laid out row-major compared with a transposed value: Python runs the parameter's reflected
    comparison first (nn.Parameter is a proper subclass of Tensor), so eager's result is laid out as the parameter."""

    def __init__(self, left_param: bool):
        super().__init__()
        self.p = torch.nn.Parameter(torch.randn(3, 2, dtype=torch.float64, generator=_gen(1)))
        self.q = torch.nn.Parameter(torch.randn(2, 3, dtype=torch.float64, generator=_gen(2)).t())
        self.left_param = left_param

    def forward(self, x):
        t = x.t() * 1  # a computed (non-parameter) value, transposed
        if self.left_param:
            return self.p == t, self.p < t, self.q >= self.p, self.q != self.p
        return t == self.p, t < self.p, t <= self.p, t > self.p, t >= self.p, t != self.p


@pytest.mark.parametrize("left_param", [False, True])
def test_comparisons_with_a_parameter_are_laid_out_as_eagers(left_param):
    module = _Compare(left_param)
    x = torch.randn(2, 3, dtype=torch.float64, generator=_gen(3))
    want, got = module(x), fulmen.jit(module, executors=["torch"])(x)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(g, w) and g.stride() == w.stride()


def _number_base_pow(x):
    y = 2 ** x.t()
    return y, y.stride(), y.view(-1), torch.float_power(3, x.t()).stride()


@pytest.mark.parametrize("compile", ["off", pytest.param("sync", marks=pytest.mark.slow)])
def test_pow_of_a_number_base_is_contiguous_as_eagers(compile):
    # eager's pow(Scalar, Tensor) kernel allocates a contiguous result; PyTorch's meta function (which fulmen asked,
    # and which a fused region's fake tensors run) lays it out as the exponent, so .view(-1) raised while tracing
    x = torch.randn(3, 4, dtype=torch.float64, generator=_gen(4))
    executors = {"executors": ["torch"]} if compile == "off" else {"compile": "sync"}
    want, got = _number_base_pow(x), fulmen.jit(_number_base_pow, **executors)(x)
    assert got[1] == want[1] == (3, 1) and got[3] == want[3]
    for w, g in ((want[0], got[0]), (want[2], got[2])):
        torch.testing.assert_close(g, w, rtol=1e-15, atol=0)
        assert g.stride() == w.stride()


# ---- a write through an expanded view that autograd sees: eager's backward raises ----


_OVERLAP = "more than one element of the written-to tensor refers to a single memory location"


@pytest.mark.parametrize("write", ["fill_", "zero_"])
def test_a_write_through_an_expanded_view_with_grad_raises_in_backward_as_eager(write):
    # eager runs the write and its backward raises; fulmen gave the input a silent zero gradient
    def program(x):
        b = x * 1
        e = b[None].expand(2, 3, 4)
        getattr(e, write)(*((3.0,) if write == "fill_" else ()))
        return b, e * 2, x * 3

    outs = {}
    for name, fn in (("eager", program), ("fulmen", fulmen.jit(program, executors=["torch"]))):
        x = torch.randn(3, 4, dtype=torch.float64, generator=_gen(5), requires_grad=True)
        outs[name] = fn(x)  # the forward runs, in both
        (grad,) = torch.autograd.grad(outs[name][2], x, torch.ones(3, 4, dtype=torch.float64), retain_graph=True)
        assert torch.equal(grad, torch.full((3, 4), 3.0, dtype=torch.float64))  # a backward not through the write
        for k in (0, 1):
            with pytest.raises(RuntimeError, match=_OVERLAP) as info:
                torch.autograd.grad(outs[name][k], x, torch.ones_like(outs[name][k]), retain_graph=True)
            if name == "fulmen":
                assert "test_strides_eager.py" in str(info.value)  # names the line of the write
    for g, w in zip(outs["fulmen"], outs["eager"]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# ---- is_inference() of inputs, and inference tensors as a cache-key difference ----


def _branch_on_inference(x):
    return (x * 2 if x.is_inference() else x * 3), x.t().is_inference()


def test_is_inference_of_an_input_reads_eagers_and_is_part_of_the_cache_key():
    f = fulmen.jit(_branch_on_inference, executors=["torch"])
    with torch.inference_mode():
        inference = torch.randn(2, 3, generator=_gen(6))
    normal = inference.clone()
    for x in (inference, normal, inference):
        got, want = f(x), _branch_on_inference(x)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        assert got[1] is want[1] is x.is_inference()
    assert fulmen.cache_misses(f) == 2  # one program each: the third call reuses the first
    with torch.inference_mode():  # under inference mode, computed values are inference tensors too
        got, want = f(normal), _branch_on_inference(normal)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert got[0].is_inference() and got[1] is want[1] is False


def _write_through_views(x):
    y = x * 1
    y[0].add_(5)
    y.t().mul_(2)
    return y


def test_writes_through_views_under_inference_mode_reach_their_base():
    # torch records no view's base under inference mode: fulmen's layout probe on meta tensors took every view for
    # a copy, and the writes through y[0] and y.t() were lost
    x = torch.randn(2, 3, generator=_gen(7))
    with torch.inference_mode():
        got, want = fulmen.jit(_write_through_views, executors=["torch"])(x), _write_through_views(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---- dtypes under CPU autocast ----

_M, _V = torch.randn(3, 4, generator=_gen(8)), torch.randn(4, generator=_gen(9))
_AUTOCAST = {
    "einsum_one_operand": lambda: torch.einsum("ij->ji", _M),  # eager: no bmm, float32
    "einsum_outer": lambda: torch.einsum("i,j->ij", _V, _V),  # eager: mul, float32
    "einsum_contraction": lambda: torch.einsum("ij,j->i", _M, _V),  # eager: bmm, bfloat16
    "einsum_three": lambda: torch.einsum("ij,jk,k->ik", _M, _M.t(), torch.ones(3)),  # bmm, then mul with float32
    "mv": lambda: torch.mv(_M, _V),  # not on CPU's list
    "addmv": lambda: torch.addmv(torch.ones(3), _M, _V),
    "conv1d": lambda: torch.nn.functional.conv1d(_M[None], torch.ones(2, 3, 2)),  # recorded as torch.conv1d
    "prelu": lambda: torch.nn.functional.prelu(_M, torch.tensor([0.25])),
}


@pytest.mark.parametrize("case", list(_AUTOCAST))
def test_cpu_autocast_dtypes_are_eagers(case):
    fn = _AUTOCAST[case]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = fn(), fulmen.jit(fn, executors=["torch"])()
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)  # bfloat16's rounding


def test_autocast_lists_name_the_ids_fulmen_records():
    # the lists named F.conv1d and F.prelu by their Python names; fulmen records them as torch.conv1d and
    # torch.prelu, so convolutions ran in float32 under autocast
    import fulmen.torch  # noqa: F401  (registers the torch language)
    from fulmen.core import langctx
    from fulmen.torch.fallback import opaque_symbol
    from fulmen.torch.registry import symbols_by_id
    from fulmen.transforms import autocast

    names = (autocast.LOWER_PRECISION_CUDA | autocast.FLOAT32_CUDA | autocast.FLOAT32_CPU | autocast.PROMOTE
             | autocast.CPU_COMPOSITES)
    wrong = []
    for name in sorted(names):
        fn = torch
        for part in name.split(".")[1:]:
            fn = getattr(fn, part)
        entry = langctx.torch_functions.get(fn) or opaque_symbol(fn)
        sym_id = getattr(entry, "id", None)
        if sym_id is None:  # a Python entry point that calls the symbol (F.l1_loss reads its weight= first)
            sym_id = name if name in symbols_by_id else f"{entry.__name__}, which records no {name}"
        if sym_id.removeprefix("fallback:") != name:
            wrong.append(f"{name} is recorded as {sym_id}")
    assert not wrong, wrong


# ---- strides of views with symbolic sizes ----


def _strided_view_facts(x):
    v = x[:, ::2]
    return v * 1, v.stride(), v.is_contiguous(), x.t().stride()


def test_a_view_torch_cannot_lay_out_for_symbolic_sizes_is_not_taken_as_contiguous():
    # PyTorch's meta tensors fail on x[:, ::2] with symbolic sizes; fulmen took the view to be contiguous and
    # answered stride() == (2, 1) once the size turned dynamic. Now the dynamic compilation gives up (logged) and the
    # program compiles for the exact sizes
    f = fulmen.jit(_strided_view_facts, executors=["torch"])
    for n in (3, 4, 5):
        x = torch.randn(n, 4, generator=_gen(10 + n))
        got, want = f(x), _strided_view_facts(x)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        assert got[1:] == want[1:] == ((4, 2), False, (1, 4))


def _non_elementwise_layouts(c):
    y = torch.nn.functional.layer_norm(c, (4,))  # contiguous whatever c's layout
    s = torch.sort(c, 0)[0]  # laid out as c
    return y.view(-1), y.stride(), s.stride(), c.flip(0).stride(), c.double().stride()


def test_layouts_of_other_ops_on_a_transposed_input_are_eagers():
    # wide fuzz seed 2451: fulmen took layer_norm's result to be laid out as its transposed input (the layout its
    # decomposition's elementwise ops gave), so .view(-1) raised where eager's works; sort, flip and .double() of a
    # transposed tensor were taken to be contiguous
    c = torch.randn(4, 5, dtype=torch.float64, generator=_gen(20)).t()
    got, want = fulmen.jit(_non_elementwise_layouts, executors=["torch"])(c), _non_elementwise_layouts(c)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    assert got[1:] == want[1:]


def _write_through_ravel(x):
    y = torch.ravel(x)  # an opaque op: eager copies a transposed x, and returns a view of a contiguous one
    y.add_(1)
    return x * 1, y * 1, torch.angle(x).stride()


@pytest.mark.parametrize("transposed", [True, False])
def test_opaque_ops_see_their_inputs_layouts(transposed):
    # opaque ops ran on contiguous fake tensors: ravel of a transposed input was taken for a view, so the write
    # through it reached x (eager's copy leaves x alone), and results were taken to be contiguous
    make = lambda: torch.arange(12.0).reshape(4, 3).t() if transposed else torch.arange(12.0).reshape(3, 4)  # noqa: E731
    x_eager, x_fulmen = make(), make()
    want, got = _write_through_ravel(x_eager), fulmen.jit(_write_through_ravel, executors=["torch"])(x_fulmen)
    torch.testing.assert_close(x_fulmen, x_eager, rtol=0, atol=0)
    for g, w in zip(got[:2], want[:2]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert got[2] == want[2]
