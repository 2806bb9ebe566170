"""Gradients of reductions that pick one element (max pooling, max/min over a dim) go where eager sends them.

Eager's max-pool backward scatters each output's gradient to the one index ``max_pool*_with_indices`` picks (the
last NaN of the window, else its first maximum in input order); ``max(dim)``/``min(dim)`` send it to the returned
index; ``max()``/``min()`` over everything split it evenly among the ties (among the NaNs when there are any).
Inputs here are small integers with NaNs sprinkled in, so windows tie often; the cotangent is distinct per output
so a gradient sent to the wrong element shows. Gradients compare bit for bit: each input element sums the same
cotangents in the same order as eager, or the tolerance says why not.
"""

import pytest
import torch
import torch.nn.functional as F

import fulmen

EXECUTORS = [pytest.param(["torch"], id="torch"), pytest.param(None, id="default")]
DTYPES = [torch.float32, torch.float64]


def _tied(shape, dtype, seed, nans=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 3, shape, generator=g).to(dtype)
    if nans:
        x.view(-1)[torch.randperm(x.numel(), generator=g)[: max(1, x.numel() // 9)]] = float("nan")
    return x


def _grads(fn, x, executors):
    """Gradient of sum(fn(x) * distinct weights) under eager and under fulmen."""
    out = fn(x)
    w = torch.arange(1, out.numel() + 1, dtype=x.dtype).reshape(out.shape)
    def loss(t):
        return (fn(t * 1.0) * w).sum()
    xe = x.clone().requires_grad_()
    loss(xe).backward()
    xf = x.clone().requires_grad_()
    kw = {} if executors is None else {"executors": executors}
    fulmen.jit(loss, compile="sync", **kw)(xf).backward()
    return xe.grad, xf.grad


def _assert_same(expected, actual):
    assert torch.equal(expected.isnan(), actual.isnan())
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


MAX_POOLS = [
    ("1d", (2, 3, 11), lambda t: F.max_pool1d(t, 3, 2, 1, ceil_mode=True)),
    ("1d_dilated", (2, 3, 11), lambda t: F.max_pool1d(t, 2, 1, dilation=3)),
    ("2d", (2, 2, 4, 6), lambda t: F.max_pool2d(t, 2)),
    ("2d_overlap_pad", (2, 3, 7, 5), lambda t: F.max_pool2d(t, 3, 1, 1)),
    ("2d_ceil_dilated", (1, 2, 9, 8), lambda t: F.max_pool2d(t, (2, 3), (2, 1), (1, 0), dilation=(2, 1),
                                                              ceil_mode=True)),
    ("2d_unbatched", (3, 6, 6), lambda t: F.max_pool2d(t, 3, 2)),
    ("3d", (1, 2, 5, 6, 4), lambda t: F.max_pool3d(t, 2, 1, (1, 0, 1))),
    ("3d_ceil", (2, 1, 5, 5, 5), lambda t: F.max_pool3d(t, 2, 2, ceil_mode=True)),
    ("2d_return_indices", (2, 2, 7, 7), lambda t: F.max_pool2d(t, 3, 2, 1, return_indices=True)[0]),
    ("1d_kernel_1", (2, 3, 5), lambda t: F.max_pool1d(t, 1)),
]


@pytest.mark.parametrize("executors", EXECUTORS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,shape,fn", MAX_POOLS, ids=[m[0] for m in MAX_POOLS])
def test_max_pool_gradient_goes_to_eagers_index(name, shape, fn, dtype, executors):
    for seed, nans in ((0, False), (1, True)):
        _assert_same(*_grads(fn, _tied(shape, dtype, seed, nans), executors))


def test_max_pool_reproducer_ties_go_to_the_first_maximum():
    x = torch.tensor([[[[1., 1., 0., 2.], [1., 1., 2., 2.]]]])
    expected, actual = _grads(lambda t: F.max_pool2d(t, 2) * 3, x, None)
    _assert_same(torch.tensor([[[[3., 0., 0., 6.], [0., 0., 0., 0.]]]]), expected)  # output weights 1 and 2
    _assert_same(expected, actual)


def test_max_pool_all_minus_inf_window_with_padding_goes_to_the_first_real_element():
    x = torch.full((1, 2, 5), -float("inf"))
    _assert_same(*_grads(lambda t: F.max_pool1d(t, 3, 1, 1), x, ["torch"]))


ADAPTIVE = [
    ("1d", (2, 3, 9), lambda t: F.adaptive_max_pool1d(t, 4)),
    ("2d", (2, 3, 7, 5), lambda t: F.adaptive_max_pool2d(t, (3, 2))),
    ("2d_even", (1, 2, 6, 8), lambda t: F.adaptive_max_pool2d(t, (3, 4))),
    ("2d_one_dim_same", (2, 2, 5, 7), lambda t: F.adaptive_max_pool2d(t, (None, 3))),
    ("2d_upsampling", (2, 2, 5, 4), lambda t: F.adaptive_max_pool2d(t, (7, 9))),
    ("2d_return_indices", (2, 2, 7, 5), lambda t: F.adaptive_max_pool2d(t, (3, 2), return_indices=True)[0]),
]


@pytest.mark.parametrize("executors", EXECUTORS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,shape,fn", ADAPTIVE, ids=[m[0] for m in ADAPTIVE])
def test_adaptive_max_pool_gradient_goes_to_eagers_index(name, shape, fn, dtype, executors):
    for seed, nans in ((0, False), (1, True)):
        _assert_same(*_grads(fn, _tied(shape, dtype, seed, nans), executors))


SELECTING = [
    ("max_dim", lambda t: t.max(-1)[0]),
    ("min_dim_keepdim", lambda t: torch.min(t, 0, keepdim=True).values),
    ("max_dim_0d", lambda t: t[1, 2].max(0)[0]),
]


@pytest.mark.parametrize("executors", EXECUTORS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,fn", SELECTING, ids=[m[0] for m in SELECTING])
def test_max_min_over_a_dim_gradient_goes_to_the_returned_index(name, fn, dtype, executors):
    for seed, nans in ((0, False), (1, True)):
        x = _tied((5, 7), dtype, seed, nans)
        if nans:
            x[1, 2] = float("nan")
        _assert_same(*_grads(fn, x, executors))


EVEN = [("max", torch.max), ("min", torch.min), ("amax", lambda t: t.amax((0, 1))), ("amin", lambda t: t.amin(1))]


@pytest.mark.parametrize("executors", EXECUTORS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,fn", EVEN, ids=[m[0] for m in EVEN])
def test_max_min_over_everything_splits_evenly_as_eager(name, fn, dtype, executors):
    # max()/min() split among the ties (the NaNs when there are any); amax/amin among the ties (NaN when NaN)
    for seed, nans in ((0, False), (1, True)):
        _assert_same(*_grads(fn, _tied((4, 6), dtype, seed, nans), executors))
    _assert_same(*_grads(fn, torch.full((3, 3), 2.0, dtype=dtype), executors))


PICKING = [
    ("topk", lambda t: t.topk(3, -1)[0]),
    ("topk_smallest", lambda t: t.topk(2, 0, largest=False)[0]),
    ("sort", lambda t: t.sort(-1)[0]),
    ("sort_descending", lambda t: torch.sort(t, 0, descending=True)[0]),
    ("kthvalue", lambda t: t.kthvalue(2, -1)[0]),
    ("median_dim", lambda t: t.median(-1)[0]),
    ("median", lambda t: t.median()),
    ("nanmedian_dim", lambda t: t.nanmedian(0)[0]),
    ("mode", lambda t: t.mode(-1)[0]),
    ("cummax", lambda t: t.cummax(-1)[0]),
]


@pytest.mark.parametrize("executors", EXECUTORS)
@pytest.mark.parametrize("name,fn", PICKING, ids=[m[0] for m in PICKING])
def test_selecting_reductions_gradient_goes_where_eager_sends_it(name, fn, executors):
    for seed, nans in ((0, False), (1, True)):
        _assert_same(*_grads(fn, _tied((4, 6), torch.float64, seed, nans), executors))


def _bound_grads(fn, inputs, executors):
    """Gradients of sum(fn(*inputs) * distinct weights) for every input under eager and under fulmen."""
    out = fn(*inputs)
    w = torch.arange(1, out.numel() + 1, dtype=out.dtype).reshape(out.shape)
    def loss(*ts):
        return (fn(*(t * 1.0 for t in ts)) * w).sum()
    eager = [t.clone().requires_grad_() for t in inputs]
    loss(*eager).backward()
    ours = [t.clone().requires_grad_() for t in inputs]
    kw = {} if executors is None else {"executors": executors}
    fulmen.jit(loss, compile="sync", **kw)(*ours).backward()
    return [(e.grad, o.grad) for e, o in zip(eager, ours)]


CLAMPS = [
    ("scalars", 1, lambda x: torch.clamp(x, -1, 1)),
    ("min_tensor", 2, lambda x, lo: torch.clamp(x, min=lo)),
    ("max_tensor", 3, lambda x, lo, hi: x.clamp(max=hi)),
    ("both_tensors", 3, lambda x, lo, hi: torch.clamp(x, lo, hi)),
    ("clamp_min", 2, lambda x, lo: torch.clamp_min(x, lo)),
    ("clip_inplace", 1, lambda x: x.clip_(0, 1)),
]


@pytest.mark.parametrize("executors", EXECUTORS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,arity,fn", CLAMPS, ids=[m[0] for m in CLAMPS])
def test_clamp_at_its_bounds_keeps_the_inputs_gradient_as_eager(name, arity, fn, dtype, executors):
    # inputs equal to a bound, bounds crossing (min > max), NaN inputs and NaN bounds: eager's clamp_backward
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2, 3, (4, 5), generator=g).to(dtype)
    x[0, 0] = x[1, 1] = float("nan")
    lo = torch.randint(-2, 2, (5,), generator=g).to(dtype)
    lo[2] = float("nan")
    hi = torch.randint(-1, 3, (4, 1), generator=g).to(dtype)
    for expected, actual in _bound_grads(fn, [x, lo, hi][:arity], executors):
        if expected is None:  # max_tensor takes lo only to keep the argument order
            assert actual is None or not actual.any()
        else:
            _assert_same(expected, actual)


HARDTANHS = [
    ("hardtanh", lambda x: F.hardtanh(x, -1.0, 1.0)),
    ("hardtanh_inplace", lambda x: F.hardtanh(x, 0.0, 1.0, inplace=True)),
    ("relu6", lambda x: F.relu6(x * 3)),
]


@pytest.mark.parametrize("executors", EXECUTORS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,fn", HARDTANHS, ids=[m[0] for m in HARDTANHS])
def test_hardtanh_at_its_bounds_gets_no_gradient_as_eager(name, fn, dtype, executors):
    # no NaNs: eager's hardtanh_backward treats them differently in its vectorized loop and its scalar tail
    x = torch.randint(-2, 3, (3, 7), generator=torch.Generator().manual_seed(0)).to(dtype)
    for expected, actual in _bound_grads(fn, [x], executors):
        _assert_same(expected, actual)


@pytest.mark.parametrize("executors", EXECUTORS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_max_pool_reduced_precision_gradient_goes_to_eagers_index(dtype, executors):
    x = _tied((2, 3, 8, 8), dtype, 2, nans=True)
    _assert_same(*_grads(lambda t: F.max_pool2d(t, 2), x, executors))  # one cotangent per element: exact
    # overlapping windows: an element sums up to 9 cotangents in reduced precision, in another order than
    # eager's kernel; 8 additions round at most eps/2 each (the same elements get gradients as in eager)
    expected, actual = _grads(lambda t: F.max_pool2d(t, 3, 1, 1), x, executors)
    assert torch.equal(expected == 0, actual == 0)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(actual, expected, rtol=4 * eps, atol=0, equal_nan=True)
