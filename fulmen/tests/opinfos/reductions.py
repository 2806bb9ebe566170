"""OpInfos: reductions, scans, sorting, softmax, norms and the linear-algebra products.

Samples cover 0-d and empty tensors (where torch allows them), non-contiguous inputs, negative and
multiple dims, ``keepdim`` and ``dtype=``. Error generators yield ``(SampleInput, exception type, regex)``
with torch's exception type and message. None of these ops draws random numbers.
"""

from __future__ import annotations

import math
from functools import partial

import torch

import fulmen.torch as ltorch
from fulmen.tests.opinfos.base import OpInfo, SampleInput, make_tensor

__all__ = []  # filled at the end with every ``<op>_opinfo``

_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_FLOATS_INT = _FLOATS + (torch.int64,)
# One bfloat16/float16 rounding of a float32-accumulated result, plus cancellation near zero.
_LOW_TOL = {torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1e-3, 1e-3)}


def _maker(device, dtype, requires_grad, **kwargs):
    grad = requires_grad and (dtype.is_floating_point or dtype.is_complex)
    return partial(make_tensor, device=device, dtype=dtype, requires_grad=grad, **kwargs)


# ---- shared sample generators ----

# (shape, dim) pairs every dim-reduction accepts; tuple dims are added when the op takes them.
_DIM_CASES = (((), 0), ((), -1), ((5,), 0), ((3, 4), 1), ((3, 4), -1), ((2, 3, 4), -2), ((0, 3), 1))
_TUPLE_DIM_CASES = (((3, 4), (0, 1)), ((2, 3, 4), (0, 2)), ((2, 3, 4), (-1, 0)), ((0, 3), (0,)), ((2, 3), ()))


def _reduction_samples(op, device, dtype, requires_grad, *, tuple_dims=True, empty_all=True, **kwargs):
    """Full reductions, dims (int, negative, tuple), keepdim positionally and by keyword, empty inputs.

    ``empty_all=False`` (ops without an identity, like amax) skips reducing over a length-0 dim.
    """
    make = _maker(device, dtype, requires_grad)
    yield SampleInput(make(()))
    yield SampleInput(make((3, 4)))
    yield SampleInput(make((4, 5), noncontiguous=True))
    if empty_all:
        yield SampleInput(make((0, 3)))
    for shape, dim in _DIM_CASES + (_TUPLE_DIM_CASES if tuple_dims else ()):
        if empty_all or shape != (0, 3) or dim == 1:
            yield SampleInput(make(shape), dim)
    yield SampleInput(make((3, 4)), 0, True)
    yield SampleInput(make((2, 3, 4)), dim=-1, keepdim=True)
    yield SampleInput(make((5, 4), noncontiguous=True), 1, keepdim=True)
    yield SampleInput(make(()), 0, True)
    if tuple_dims:
        yield SampleInput(make((2, 3, 4)), (2, 0), True)


def _dim_errors(op, device, *, what="dim"):
    """Out-of-range and repeated dims: IndexError / RuntimeError as in torch."""
    t = make_tensor((3, 4), device=device, dtype=torch.float32)
    yield SampleInput(t, 2), IndexError, r"Dimension out of range \(expected to be in range of \[-2, 1\], but got 2\)"
    yield SampleInput(make_tensor((), device=device, dtype=torch.float32), 1), IndexError, "Dimension out of range"
    if what == "dims":
        yield SampleInput(t, (0, -2)), RuntimeError, "dim 0 appears multiple times in the list of dims"
        yield SampleInput(t, (0, 5)), IndexError, "Dimension out of range"


def _dtype_kwarg_samples(device, dtype, requires_grad, targets):
    make = _maker(device, dtype, requires_grad)
    for target in targets:
        yield SampleInput(make((3, 4)), 1, dtype=target)
        yield SampleInput(make((2, 3)), dtype=target)


# ---- sum, mean, prod ----

def sum_samples(op, device, dtype, requires_grad, **kwargs):
    yield from _reduction_samples(op, device, dtype, requires_grad)
    yield SampleInput(_maker(device, dtype, requires_grad)((2, 3, 4)), None, True)
    if dtype.is_floating_point:
        yield from _dtype_kwarg_samples(device, dtype, requires_grad, (torch.float64, torch.float32))
    else:
        yield from _dtype_kwarg_samples(device, dtype, False, (torch.int32, torch.float32))
        # bool and narrow integers sum to int64, and int8 with dtype=int8 wraps around
        yield SampleInput(make_tensor((4, 5), device=device, dtype=torch.bool), 1)
        yield SampleInput(make_tensor((4, 5), device=device, dtype=torch.int8))
        yield SampleInput(make_tensor((40,), device=device, dtype=torch.int8, low=60, high=100), dtype=torch.int8)
        yield SampleInput(make_tensor((4,), device=device, dtype=torch.uint8), 0, True)


sum_opinfo = OpInfo(
    ltorch.sum, sample_input_generator=sum_samples, error_input_generator=partial(_dim_errors, what="dims"),
    torch_reference=torch.sum, dtypes=_FLOATS_INT, tolerance=_LOW_TOL,
)


def mean_samples(op, device, dtype, requires_grad, **kwargs):
    yield from _reduction_samples(op, device, dtype, requires_grad)
    yield from _dtype_kwarg_samples(device, dtype, requires_grad, (torch.float64, torch.float32))
    yield SampleInput(make_tensor((3, 4), device=device, dtype=torch.int64), 0, dtype=dtype)


def mean_errors(op, device, **kwargs):
    yield from _dim_errors(op, device, what="dims")
    ints = make_tensor((3, 4), device=device, dtype=torch.int64)
    yield (SampleInput(ints), RuntimeError,
           r"mean\(\): could not infer output dtype. Input dtype must be either a floating point or complex dtype. "
           "Got: Long")
    yield (SampleInput(ints.bool(), 0), RuntimeError, "could not infer output dtype.*Got: Bool")
    yield (SampleInput(ints.float(), dtype=torch.int32), RuntimeError,
           "Optional dtype must be either a floating point or complex dtype. Got: Int")


mean_opinfo = OpInfo(
    ltorch.mean, sample_input_generator=mean_samples, error_input_generator=mean_errors, torch_reference=torch.mean,
    dtypes=_FLOATS, tolerance=_LOW_TOL,
)


def prod_samples(op, device, dtype, requires_grad, **kwargs):
    # values near 1 keep products of a dozen factors finite in every dtype
    make = _maker(device, dtype, requires_grad, low=0.5 if dtype.is_floating_point else -3,
                  high=1.7 if dtype.is_floating_point else 3)
    yield SampleInput(make(()))
    yield SampleInput(make((3, 4)))
    yield SampleInput(make((0, 3)))
    for shape, dim in _DIM_CASES:
        yield SampleInput(make(shape), dim)
    yield SampleInput(make((3, 4), noncontiguous=True), 0, True)
    yield SampleInput(make((2, 3, 4)), dim=-1, keepdim=True)
    if dtype.is_floating_point:
        yield SampleInput(make((3, 4)), 1, dtype=torch.float64)
    else:
        yield SampleInput(make((3, 4)), dtype=torch.int32)
        yield SampleInput(make_tensor((3, 4), device=device, dtype=torch.bool), 1)


def prod_errors(op, device, **kwargs):
    yield from _dim_errors(op, device)
    yield SampleInput(make_tensor((3, 4), device=device, dtype=torch.float32), (0, 1)), TypeError, "dim"


prod_opinfo = OpInfo(
    ltorch.prod, sample_input_generator=prod_samples, error_input_generator=prod_errors, torch_reference=torch.prod,
    dtypes=_FLOATS_INT, tolerance={torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 1e-3)},
)


# ---- amax, amin, aminmax, max, min, argmax, argmin ----

def amax_samples(op, device, dtype, requires_grad, **kwargs):
    yield from _reduction_samples(op, device, dtype, requires_grad, empty_all=False)
    if dtype.is_floating_point:
        yield SampleInput(torch.tensor([[1.0, float("nan"), 3.0], [2.0, 1.0, 0.0]], device=device, dtype=dtype), 1)
    else:
        yield SampleInput(make_tensor((3, 4), device=device, dtype=torch.bool), 0)


def _no_identity_errors(name, op, device, *, index_sep="()", full_form=True):
    empty = make_tensor((0, 3), device=device, dtype=torch.float32)
    yield from _dim_errors(op, device)
    if full_form:
        yield (SampleInput(empty), RuntimeError,
               rf"{name}\(\): Expected reduction dim to be specified for input.numel\(\) == 0")
    sep = r"\(\)" if index_sep == "()" else index_sep
    yield SampleInput(empty, 0), IndexError, rf"{name}{sep}: Expected reduction dim 0 to have non-zero size"


amax_opinfo = OpInfo(
    ltorch.amax, sample_input_generator=amax_samples, error_input_generator=partial(_no_identity_errors, "amax"),
    torch_reference=torch.amax, dtypes=_FLOATS_INT,
)
amin_opinfo = OpInfo(
    ltorch.amin, sample_input_generator=amax_samples, error_input_generator=partial(_no_identity_errors, "amin"),
    torch_reference=torch.amin, dtypes=_FLOATS_INT,
)


def aminmax_samples(op, device, dtype, requires_grad, **kwargs):
    make = _maker(device, dtype, requires_grad)
    yield SampleInput(make(()))
    yield SampleInput(make((3, 4), noncontiguous=True))
    yield SampleInput(make((3, 4)), dim=1)
    yield SampleInput(make((2, 3, 4)), dim=-2, keepdim=True)
    yield SampleInput(make((0, 3)), dim=1)
    yield SampleInput(make(()), dim=0, keepdim=True)


def aminmax_errors(op, device, **kwargs):
    empty = make_tensor((0, 3), device=device, dtype=torch.float32)
    yield SampleInput(empty), RuntimeError, r"aminmax\(\): cannot compute aminmax over an empty dimension"
    yield SampleInput(empty, dim=0), IndexError, "aminmax: Expected reduction dim 0 to have non-zero size"
    yield SampleInput(empty, dim=2), IndexError, "Dimension out of range"


aminmax_opinfo = OpInfo(
    ltorch.aminmax, sample_input_generator=aminmax_samples, error_input_generator=aminmax_errors,
    torch_reference=torch.aminmax, dtypes=_FLOATS_INT, supports_grad=False,
)


def max_samples(op, device, dtype, requires_grad, **kwargs):
    make = _maker(device, dtype, requires_grad)
    # the full reduction
    yield SampleInput(make(()))
    yield SampleInput(make((3, 4), noncontiguous=True))
    # along a dim: (values, indices); small integers make ties, where the first index wins
    for shape, dim in (((), 0), ((5,), 0), ((3, 4), 1), ((3, 4), -2), ((2, 3, 4), -1), ((0, 3), 1)):
        yield SampleInput(make(shape), dim)
    yield SampleInput(make((3, 4)), 1, True)
    yield SampleInput(make((4, 5), noncontiguous=True), dim=0, keepdim=True)
    if dtype.is_floating_point:
        yield SampleInput(torch.tensor([[1.0, float("nan"), 3.0], [2.0, 1.0, 0.0]], device=device, dtype=dtype), 1)
    else:
        yield SampleInput(make_tensor((6, 5), device=device, dtype=dtype, low=0, high=3), 1)
        yield SampleInput(make_tensor((3, 4), device=device, dtype=torch.bool), 0)
    # elementwise against another tensor, with broadcasting
    yield SampleInput(make((3, 4)), make((3, 4)))
    yield SampleInput(make((3, 4)), make((4,)))
    yield SampleInput(make((3, 1)), other=make((1, 4)))


def _max_errors(name, op, device, **kwargs):
    yield from _no_identity_errors(name, op, device)
    t = make_tensor((3, 4), device=device, dtype=torch.float32)
    yield (SampleInput(t, make_tensor((3,), device=device, dtype=torch.float32)), RuntimeError,
           r"The size of tensor a \(4\) must match the size of tensor b \(3\) at non-singleton dimension 1")


max_opinfo = OpInfo(
    ltorch.max, sample_input_generator=max_samples, error_input_generator=partial(_max_errors, "max"),
    torch_reference=torch.max, dtypes=_FLOATS_INT,
)
min_opinfo = OpInfo(
    ltorch.min, sample_input_generator=max_samples, error_input_generator=partial(_max_errors, "min"),
    torch_reference=torch.min, dtypes=_FLOATS_INT,
)


def argmax_samples(op, device, dtype, requires_grad, **kwargs):
    make = _maker(device, dtype, False)
    yield SampleInput(make(()))
    yield SampleInput(make((3, 4), noncontiguous=True))
    yield SampleInput(make((2, 3, 4)), keepdim=True)
    for shape, dim in (((), 0), ((5,), 0), ((3, 4), 1), ((3, 4), -2), ((0, 3), 1)):
        yield SampleInput(make(shape), dim)
    yield SampleInput(make((2, 3, 4)), -1, True)
    yield SampleInput(make(()), 0, keepdim=True)
    if dtype.is_floating_point:
        yield SampleInput(torch.tensor([[1.0, float("nan"), 3.0], [2.0, 1.0, 0.0]], device=device, dtype=dtype), 1)
    else:
        yield SampleInput(make_tensor((6, 5), device=device, dtype=dtype, low=0, high=3), 0)


def _argmax_errors(name, op, device, **kwargs):
    empty = make_tensor((0, 3), device=device, dtype=torch.float32)
    yield SampleInput(empty), IndexError, rf"{name}\(\): Expected reduction dim to be specified for input.numel"
    yield SampleInput(empty, 0), IndexError, rf"{name}\(\): Expected reduction dim 0 to have non-zero size"
    yield SampleInput(empty, 2), IndexError, "Dimension out of range"
    yield (SampleInput(make_tensor((3,), device=device, dtype=torch.bool)), RuntimeError,
           rf"{name}\(\): does not support bool input")


argmax_opinfo = OpInfo(
    ltorch.argmax, sample_input_generator=argmax_samples, error_input_generator=partial(_argmax_errors, "argmax"),
    torch_reference=torch.argmax, dtypes=_FLOATS_INT, supports_grad=False,
)
argmin_opinfo = OpInfo(
    ltorch.argmin, sample_input_generator=argmax_samples, error_input_generator=partial(_argmax_errors, "argmin"),
    torch_reference=torch.argmin, dtypes=_FLOATS_INT, supports_grad=False,
)


# ---- var, std, var_mean, std_mean ----

def var_samples(op, device, dtype, requires_grad, **kwargs):
    make = _maker(device, dtype, requires_grad)
    yield SampleInput(make((3, 4)))
    yield SampleInput(make(()))  # N - correction = 0: NaN, as torch
    yield SampleInput(make((0, 3)), 1)
    yield SampleInput(make((4, 5), noncontiguous=True), 0)
    yield SampleInput(make((3, 4)), -1, True)  # (dim, unbiased)
    yield SampleInput(make((3, 4)), 1, False, True)  # (dim, unbiased, keepdim)
    yield SampleInput(make((3, 4)), False)  # legacy (unbiased)
    yield SampleInput(make((2, 3, 4)), (0, 2))
    yield SampleInput(make((2, 3, 4)), dim=(-1, 0), correction=0, keepdim=True)
    yield SampleInput(make((5, 6)), 1, correction=2)
    yield SampleInput(make((5, 6)), dim=None, correction=1.5)
    yield SampleInput(make((3, 4)), 1, correction=4)  # correction >= N: inf
    yield SampleInput(make((3, 4)), dim=None, unbiased=False)


def var_errors(op, device, **kwargs):
    yield from _dim_errors(op, device, what="dims")
    yield (SampleInput(make_tensor((3, 4), device=device, dtype=torch.int64)), RuntimeError,
           "std and var only support floating point and complex dtypes")
    yield (SampleInput(make_tensor((3, 4), device=device, dtype=torch.float32), 0, unbiased=True, correction=1),
           TypeError, "invalid combination of arguments")


_VAR_TOL = {torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1e-3, 1e-3)}
var_opinfo = OpInfo(ltorch.var, sample_input_generator=var_samples, error_input_generator=var_errors,
                    torch_reference=torch.var, dtypes=_FLOATS, tolerance=_VAR_TOL)
std_opinfo = OpInfo(ltorch.std, sample_input_generator=var_samples, error_input_generator=var_errors,
                    torch_reference=torch.std, dtypes=_FLOATS, tolerance=_VAR_TOL)
var_mean_opinfo = OpInfo(ltorch.var_mean, sample_input_generator=var_samples, error_input_generator=var_errors,
                         torch_reference=torch.var_mean, dtypes=_FLOATS, tolerance=_VAR_TOL)
std_mean_opinfo = OpInfo(ltorch.std_mean, sample_input_generator=var_samples, error_input_generator=var_errors,
                         torch_reference=torch.std_mean, dtypes=_FLOATS, tolerance=_VAR_TOL)


# ---- logsumexp, softmax, log_softmax ----

def _with_infinities(device, dtype):
    inf = float("inf")
    return torch.tensor([[-inf, -inf, -inf], [1.0, -inf, 2.0], [inf, 0.0, 1.0], [3.0, 2.0, -1.0]],
                        device=device, dtype=dtype)


def logsumexp_samples(op, device, dtype, requires_grad, **kwargs):
    make = _maker(device, dtype, requires_grad)
    for shape, dim in _DIM_CASES + _TUPLE_DIM_CASES[:-1] + (((0, 3), 0),):
        yield SampleInput(make(shape), dim)
    yield SampleInput(make((4, 5), noncontiguous=True), 0)
    yield SampleInput(make((2, 3, 4)), -1, True)
    yield SampleInput(make((3, 4)), dim=(0, 1), keepdim=True)
    if dtype.is_floating_point:
        yield SampleInput(_with_infinities(device, dtype), 1)
        yield SampleInput(make((3, 4), low=60, high=80), 1)  # exp would overflow without the max shift


logsumexp_opinfo = OpInfo(
    ltorch.logsumexp, sample_input_generator=logsumexp_samples, error_input_generator=partial(_dim_errors, what="dims"),
    torch_reference=torch.logsumexp, dtypes=_FLOATS_INT, tolerance=_LOW_TOL,
)


def softmax_samples(op, device, dtype, requires_grad, **kwargs):
    if not dtype.is_floating_point:  # integers need dtype=
        make = _maker(device, dtype, False)
        yield SampleInput(make((3, 4)), 1, dtype=torch.float32)
        yield SampleInput(make((2, 3)), 0, torch.float64)
        return
    make = _maker(device, dtype, requires_grad)
    for shape, dim in _DIM_CASES + (((0, 3), 0),):
        yield SampleInput(make(shape), dim)
    yield SampleInput(make((4, 5), noncontiguous=True), 0)
    yield SampleInput(make((3, 4), low=60, high=80), -1)
    yield SampleInput(_with_infinities(device, dtype), 1)  # a row of -inf gives NaN, as torch
    yield SampleInput(make((3, 4)), 1, dtype=torch.float64)
    yield SampleInput(make((3, 4)), dim=0, dtype=torch.float32)


def softmax_errors(op, device, **kwargs):
    yield from _dim_errors(op, device)
    yield SampleInput(make_tensor((3, 4), device=device, dtype=torch.int64), 1), NotImplementedError, "'Long'"


softmax_opinfo = OpInfo(
    ltorch.softmax, sample_input_generator=softmax_samples, error_input_generator=softmax_errors,
    torch_reference=torch.softmax, dtypes=_FLOATS_INT, tolerance=_LOW_TOL,
)
log_softmax_opinfo = OpInfo(
    ltorch.log_softmax, sample_input_generator=softmax_samples, error_input_generator=softmax_errors,
    torch_reference=torch.log_softmax, dtypes=_FLOATS_INT, tolerance=_LOW_TOL,
)


# ---- scans ----

def cumsum_samples(op, device, dtype, requires_grad, **kwargs):
    low, high = (0.5, 1.5) if op is ltorch.cumprod and dtype.is_floating_point else (None, None)
    if op is ltorch.cumprod and not dtype.is_floating_point:
        low, high = -2, 3
    make = _maker(device, dtype, requires_grad, low=low, high=high)
    for shape, dim in _DIM_CASES + (((0, 3), 0),):
        yield SampleInput(make(shape), dim)
    yield SampleInput(make((4, 5), noncontiguous=True), 0)
    yield SampleInput(make((3, 4)), dim=-1)
    if dtype.is_floating_point:
        yield SampleInput(make((3, 4)), 1, dtype=torch.float64)
    else:
        yield SampleInput(make((3, 4)), 1, dtype=torch.float32)
        yield SampleInput(make((3, 4)), 0, dtype=torch.int32)
        yield SampleInput(make_tensor((3, 4), device=device, dtype=torch.bool), 1)
        yield SampleInput(make_tensor((3, 4), device=device, dtype=torch.int8, low=-3, high=3), 0)


def cumsum_errors(op, device, **kwargs):
    yield from _dim_errors(op, device)
    yield SampleInput(make_tensor((3, 4), device=device, dtype=torch.float32), None), TypeError, "dim"


_SCAN_TOL = {torch.bfloat16: (1.6e-2, 2e-2), torch.float16: (1e-3, 2e-3)}
cumsum_opinfo = OpInfo(ltorch.cumsum, sample_input_generator=cumsum_samples, error_input_generator=cumsum_errors,
                       torch_reference=torch.cumsum, dtypes=_FLOATS_INT, tolerance=_SCAN_TOL)
cumprod_opinfo = OpInfo(ltorch.cumprod, sample_input_generator=cumsum_samples, error_input_generator=cumsum_errors,
                        torch_reference=torch.cumprod, dtypes=_FLOATS_INT, tolerance=_SCAN_TOL)


# ---- topk, sort, argsort ----

def topk_samples(op, device, dtype, requires_grad, **kwargs):
    make = _maker(device, dtype, requires_grad)
    yield SampleInput(make(()), 1)
    yield SampleInput(make((6,)), 3)
    yield SampleInput(make((3, 5)), 2, 0)
    yield SampleInput(make((3, 5), noncontiguous=True), 5, -1, False)
    yield SampleInput(make((2, 3, 4)), 0, 1)
    yield SampleInput(make((2, 6)), k=4, dim=1, largest=False, sorted=True)
    yield SampleInput(make((0, 3)), 2, 1)
    yield SampleInput(make((4, 6)), 3, 1, True, False)


def topk_errors(op, device, **kwargs):
    t = make_tensor((3, 4), device=device, dtype=torch.float32)
    yield SampleInput(t, 5), RuntimeError, "selected index k out of range"
    yield SampleInput(t, -1), RuntimeError, "selected index k out of range"
    yield SampleInput(t, 1, 2), IndexError, "Dimension out of range"


topk_opinfo = OpInfo(ltorch.topk, sample_input_generator=topk_samples, error_input_generator=topk_errors,
                     torch_reference=torch.topk, dtypes=_FLOATS_INT)


def sort_samples(op, device, dtype, requires_grad, **kwargs):
    make = _maker(device, dtype, requires_grad)
    yield SampleInput(make(()))
    yield SampleInput(make((6,)))
    yield SampleInput(make((3, 5)), 0)
    yield SampleInput(make((3, 5), noncontiguous=True), -1, True)
    yield SampleInput(make((2, 3, 4)), dim=1, descending=True)
    yield SampleInput(make((0, 3)), 0)
    # ties: stable sorts keep the original order
    yield SampleInput(make_tensor((4, 8), device=device, dtype=dtype, low=0, high=3), stable=True)
    yield SampleInput(make_tensor((4, 8), device=device, dtype=dtype, low=0, high=3), dim=0, descending=True,
                      stable=True)


def sort_errors(op, device, **kwargs):
    yield from _dim_errors(op, device)


sort_opinfo = OpInfo(ltorch.sort, sample_input_generator=sort_samples, error_input_generator=sort_errors,
                     torch_reference=torch.sort, dtypes=_FLOATS_INT)
argsort_opinfo = OpInfo(ltorch.argsort, sample_input_generator=sort_samples, error_input_generator=sort_errors,
                        torch_reference=torch.argsort, dtypes=_FLOATS_INT, supports_grad=False)


# ---- all, any, count_nonzero ----

def all_samples(op, device, dtype, requires_grad, **kwargs):
    # mostly nonzero values with some zeros, so both answers occur
    def make(shape, **kw):
        t = make_tensor(shape, device=device, dtype=dtype, low=-2, high=3, **kw)
        return t
    yield SampleInput(make(()))
    yield SampleInput(make((3, 4)))
    yield SampleInput(make((4, 5), noncontiguous=True), 1)
    yield SampleInput(make((0, 3)))
    yield SampleInput(make((0, 3)), 0)
    yield SampleInput(make((0, 3)), 1, True)
    yield SampleInput(make((2, 3, 4)), -1, True)
    yield SampleInput(make((2, 3, 4)), (0, 2))
    yield SampleInput(make((2, 3)), ())  # dim=() reduces nothing for all/any
    yield SampleInput(make(()), 0)
    yield SampleInput(torch.ones(3, 4, device=device, dtype=dtype), 1)
    yield SampleInput(torch.zeros(3, 4, device=device, dtype=dtype), dim=0, keepdim=True)
    if dtype.is_floating_point:
        yield SampleInput(torch.tensor([float("nan"), 0.0], device=device, dtype=dtype))
    else:
        yield SampleInput(make_tensor((3, 4), device=device, dtype=torch.bool), 1)
        yield SampleInput(make_tensor((3, 4), device=device, dtype=torch.uint8, high=2), 0)  # uint8 -> uint8


all_opinfo = OpInfo(ltorch.all, sample_input_generator=all_samples, error_input_generator=partial(_dim_errors,
                    what="dims"), torch_reference=torch.all, dtypes=_FLOATS_INT, supports_grad=False)
any_opinfo = OpInfo(ltorch.any, sample_input_generator=all_samples, error_input_generator=partial(_dim_errors,
                    what="dims"), torch_reference=torch.any, dtypes=_FLOATS_INT, supports_grad=False)


def count_nonzero_samples(op, device, dtype, requires_grad, **kwargs):
    make = partial(make_tensor, device=device, dtype=dtype, low=-1, high=2)
    yield SampleInput(make(()))
    yield SampleInput(make((3, 4)))
    yield SampleInput(make((4, 5), noncontiguous=True), 1)
    yield SampleInput(make((2, 3, 4)), (0, -1))
    yield SampleInput(make((0, 3)), 0)
    yield SampleInput(make((2, 3)), ())
    if not dtype.is_floating_point:
        yield SampleInput(make_tensor((3, 4), device=device, dtype=torch.bool), 0)


count_nonzero_opinfo = OpInfo(
    ltorch.count_nonzero, sample_input_generator=count_nonzero_samples,
    error_input_generator=partial(_dim_errors, what="dims"), torch_reference=torch.count_nonzero,
    dtypes=_FLOATS_INT, supports_grad=False,
)


# ---- norms ----

def vector_norm_samples(op, device, dtype, requires_grad, **kwargs):
    make = _maker(device, dtype, requires_grad)
    for ord in (2, 1, math.inf, -math.inf, 0, 3, 0.5, -1):
        yield SampleInput(make((3, 4)), ord)
    yield SampleInput(make(()))
    yield SampleInput(make((0, 3)))
    yield SampleInput(make((0, 3)), math.inf, 1)
    yield SampleInput(make((4, 5), noncontiguous=True), 2, 0)
    yield SampleInput(make((2, 3, 4)), 1, (0, -1), True)
    yield SampleInput(make((2, 3, 4)), ord=math.inf, dim=-2, keepdim=True)
    yield SampleInput(make((3, 4)), 2, dtype=torch.float64)
    yield SampleInput(torch.zeros(3, 4, device=device, dtype=dtype), 2, 1)


def vector_norm_errors(op, device, **kwargs):
    yield (SampleInput(make_tensor((3, 4), device=device, dtype=torch.int64)), RuntimeError,
           "linalg.vector_norm: Expected a floating point or complex tensor as input. Got Long")
    empty = make_tensor((0, 3), device=device, dtype=torch.float32)
    yield SampleInput(empty, math.inf), RuntimeError, "cannot compute the inf norm on an empty tensor"
    yield SampleInput(empty, -1), RuntimeError, "cannot compute the -1 norm on an empty tensor"
    yield (SampleInput(make_tensor((3,), device=device, dtype=torch.float32), 2, dtype=torch.float16), RuntimeError,
           r"should be convertible without narrowing to the specified dtype \(Half\)")
    yield SampleInput(make_tensor((3,), device=device, dtype=torch.float32), 2, 1), IndexError, "Dimension out of range"


_NORM_TOL = {torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1e-3, 1e-3)}
vector_norm_opinfo = OpInfo(
    ltorch.vector_norm, sample_input_generator=vector_norm_samples, error_input_generator=vector_norm_errors,
    torch_reference=torch.linalg.vector_norm, dtypes=_FLOATS, tolerance=_NORM_TOL,
)


def norm_samples(op, device, dtype, requires_grad, **kwargs):
    make = _maker(device, dtype, requires_grad)
    yield SampleInput(make((3, 4)))
    yield SampleInput(make(()))
    yield SampleInput(make((3, 4), noncontiguous=True), "fro", (0, 1))
    yield SampleInput(make((3, 4)), p=1, dim=1)
    yield SampleInput(make((2, 3, 4)), p=math.inf, dim=-1, keepdim=True)
    yield SampleInput(make((3, 4)), 3, 0)
    yield SampleInput(make((3, 4)), p=None, dim=(1,))
    yield SampleInput(make((3, 4)), p=2, dtype=torch.float64)


def norm_errors(op, device, **kwargs):
    t = make_tensor((3, 4), device=device, dtype=torch.float32)
    yield SampleInput(t.long()), RuntimeError, "Expected a floating point or complex tensor as input. Got Long"
    yield SampleInput(t, 2, 2), IndexError, "Dimension out of range"


norm_opinfo = OpInfo(ltorch.norm, sample_input_generator=norm_samples, error_input_generator=norm_errors,
                     torch_reference=torch.norm, dtypes=_FLOATS, tolerance=_NORM_TOL)

__all__ += [name for name in list(globals()) if name.endswith("_opinfo")]
