"""Reverse-mode automatic differentiation: the VJP table and the backward walk (the functional APIs built on them,
``grad`` / ``value_and_grad`` / ``vjp``, are in ``fulmen.frontend.functional``).

Every prim has a vector-Jacobian product in ``vjp_rules`` (keyed by ``PrimIDs``; the prims' rows of the gradient
table, ``grad_table.py``) or is listed in ``NON_DIFFERENTIABLE``; a test checks that the two cover
``prims.all_prims()``. A rule takes the bound symbol and the cotangent of its output (a tuple for prims with
several outputs) and returns one gradient per parameter of the prim. Rules are written in the torch language where
it has the operation (elementwise math) and in clang/prims otherwise (sums, reshapes): a backward's ``ltorch.mul``
runs as one torch call and an executor can claim it (seed 001 replaces it by its own kernel). Broadcasting needs no
care: prims take same-shape inputs, so un-broadcasting is the VJP of ``prims.broadcast_in_dim`` (a sum).

How symbols above prims are differentiated (grad transforms, augmented forward/backward, decomposition,
PyTorch autograd for opaque ops) is in ``linearize.py``; turning the result into forward and backward traces
in ``split.py``. The registration functions are re-exported here.
"""

from __future__ import annotations

import cmath
import math
import threading
from collections.abc import Callable, Sequence
from numbers import Number

from torch.utils._pytree import tree_flatten

import fulmen.torch as ltorch
from fulmen import clang, prims
from fulmen.core import dtypes
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol
from fulmen.core.unbacked import known_equal
from fulmen.core.utils import canonicalize_dim, check, prod
from fulmen.prims import PrimIDs
from fulmen.transforms import grad_ops, grad_table
from fulmen.transforms.linearize import (  # noqa: F401  (public names)
    Joint,
    NotDifferentiableError,
    bind_arguments,
    compute_in_forward,
    get_grad,
    is_differentiable_dtype,
    needs_grad,
    put_grad,
    put_grads,
    register_augmented_forward,
    register_backward,
    register_grad,
    zeros_like,
)

__all__ = [
    "get_grad", "put_grad", "put_grads", "compute_in_forward", "register_grad",
    "register_augmented_forward", "register_backward", "vjp_rules", "NON_DIFFERENTIABLE", "backward_pass",
    "needs_grad", "NotDifferentiableError", "sum_to",
]

#: Prims whose outputs carry no gradient (comparisons, bitwise and integer ops, creation, random, copies).
NON_DIFFERENTIABLE = frozenset({
    PrimIDs.UNPACK_TRIVIAL, PrimIDs.RETURN, PrimIDs.FULL, PrimIDs.IOTA, PrimIDs.EMPTY, PrimIDs.UNIFORM,
    PrimIDs.NORMAL, PrimIDs.BERNOULLI, PrimIDs.RANDINT, PrimIDs.COPY_, PrimIDs.SIGNBIT, PrimIDs.LOGICAL_NOT,
    PrimIDs.BITWISE_NOT, PrimIDs.ISFINITE, PrimIDs.ISNAN, PrimIDs.ISINF, PrimIDs.EQ, PrimIDs.NE, PrimIDs.LT,
    PrimIDs.LE, PrimIDs.GT, PrimIDs.GE, PrimIDs.BITWISE_AND, PrimIDs.BITWISE_OR, PrimIDs.BITWISE_XOR,
    PrimIDs.SHIFT_LEFT, PrimIDs.SHIFT_RIGHT, PrimIDs.ARGMAX, PrimIDs.ARGMIN,
    PrimIDs.MANUAL_SEED, PrimIDs.GET_RNG_STATE, PrimIDs.SET_RNG_STATE,
})

grad_table.mark_non_differentiable(*NON_DIFFERENTIABLE)

#: prim id -> rule(bsym, cotangent) -> one gradient (or None) per parameter of the prim: the prims' entries of
#: the gradient table (``grad_table.py``), read and written through this mapping.
vjp_rules = grad_table.VJPRules()


# ---------------------------------------------------------------------------------------------------------
# the backward walk

def backward_pass(joint: Joint, cotangents: dict[str, TensorProxy]) -> dict[str, TensorProxy]:
    """Walk the units in reverse order, accumulating cotangents by value name; returns all cotangents reached.

    The units' backward functions emit their operations into the current trace scope.
    """
    cts = dict(cotangents)
    walks = _walk_active.stack
    walks.append(joint.active)
    try:
        for unit in reversed(joint.units):
            outs = [cts.get(o.name) for o in unit.outputs]
            if all(c is None for c in outs):
                continue
            for x, g in unit.backward(outs):
                if g is None or x.name not in joint.active:
                    continue
                g = fit_gradient(g, x)
                prev = cts.get(x.name)
                cts[x.name] = g if prev is None else ltorch.add(prev, g)
    finally:
        walks.pop()
    return cts


class _Walks(threading.local):
    def __init__(self):
        self.stack: list[set[str]] = []  # the active values of this thread's walks in progress (see wanted)


_walk_active = _Walks()


def wanted(x) -> bool:
    """In a VJP rule: whether the gradient of argument ``x`` is wanted (for kernels with an output mask)."""
    walks = _walk_active.stack
    return _t(x) and bool(walks) and x.name in walks[-1]


def fit_gradient(g, x: TensorProxy) -> TensorProxy:
    """A gradient with ``x``'s shape and dtype (user rules may return broadcastable or upcast gradients)."""
    if isinstance(g, Number):
        return clang.full(tuple(x.shape), g, device=x.device, dtype=x.dtype)
    check(isinstance(g, TensorProxy), lambda: f"the gradient for {x.name} is a {type(g).__name__}, not a tensor",
          TypeError)
    if tuple(g.shape) != tuple(x.shape):
        check(clang.broadcast_shapes(g.shape, x.shape) == tuple(g.shape),
              lambda: f"a gradient of shape {tuple(g.shape)} does not fit {x.name} of shape {tuple(x.shape)}")
        g = sum_to(g, x.shape)
    return clang.maybe_convert_to_dtype(_real_part_for(g, x), x.dtype)


def _real_part_for(g, x: TensorProxy):
    """The gradient of a real value that met complex math is the real part of its complex gradient (eager's
    ``handle_r_to_c``); casting would drop the imaginary part too, but with a warning."""
    return prims.real(g) if dtypes.is_complex_dtype(g.dtype) and not dtypes.is_complex_dtype(x.dtype) else g


def sum_to(g: TensorProxy, shape: Sequence[int]) -> TensorProxy:
    """Sum ``g`` down to ``shape``: the VJP of broadcasting ``shape`` to ``g.shape``."""
    shape = tuple(shape)
    lead = g.ndim - len(shape)
    # a data-dependent size is taken as not 1 (as broadcasting took it): summing a dim of size 1 would be right too
    dims = list(range(lead)) + [lead + i for i, s in enumerate(shape)
                                if known_equal(s, 1) and not known_equal(g.shape[lead + i], 1)]
    if dims:
        g = prims.sum(g, tuple(dims))
    return clang.reshape(g, shape)


# ---------------------------------------------------------------------------------------------------------
# the VJP table

mul, add, sub, div, neg, where = ltorch.mul, ltorch.add, ltorch.sub, ltorch.true_divide, ltorch.neg, ltorch.where


def _t(x) -> bool:
    return isinstance(x, TensorProxy)


def _args(b: BoundSymbol) -> list:
    return list(bind_arguments(b.sym.meta, b).values())


def _rule(*pids: PrimIDs) -> Callable:
    def decorator(fn: Callable) -> Callable:
        for pid in pids:
            vjp_rules[pid] = fn
        return fn
    return decorator


def _unary(pid: PrimIDs, fn: Callable) -> None:
    """A rule for a unary prim written as ``fn(g, a, out)``."""
    vjp_rules[pid] = lambda b, g: (fn(g, _args(b)[0], b.output),)


def _conj(x):
    """The complex conjugate of a complex tensor or number; anything else unchanged (real traces get no op).

    PyTorch's convention for complex gradients: for a holomorphic f, the gradient of the input is
    ``g * conj(f'(z))``. Rules conjugate the derivative factor they multiply (or divide) the cotangent by."""
    if isinstance(x, TensorProxy):
        return prims.conj(x) if dtypes.is_complex_dtype(x.dtype) else x
    return x.conjugate() if isinstance(x, complex) else x


_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_unary(PrimIDs.NEG, lambda g, a, out: neg(g))
_unary(PrimIDs.CONJ, lambda g, a, out: _conj(g))
_unary(PrimIDs.EXP, lambda g, a, out: mul(g, _conj(out)))
_unary(PrimIDs.EXP2, lambda g, a, out: mul(g, _conj(mul(out, math.log(2.0)))))
_unary(PrimIDs.EXPM1, lambda g, a, out: mul(g, _conj(add(out, 1))))
_unary(PrimIDs.LOG, lambda g, a, out: div(g, _conj(a)))
_unary(PrimIDs.LOG1P, lambda g, a, out: div(g, _conj(add(a, 1))))
_unary(PrimIDs.LOG2, lambda g, a, out: div(g, _conj(mul(a, math.log(2.0)))))
_unary(PrimIDs.LOG10, lambda g, a, out: div(g, _conj(mul(a, math.log(10.0)))))
_unary(PrimIDs.SIN, lambda g, a, out: mul(g, _conj(ltorch.cos(a))))
_unary(PrimIDs.COS, lambda g, a, out: mul(g, neg(_conj(ltorch.sin(a)))))
_unary(PrimIDs.TAN, lambda g, a, out: mul(g, _conj(add(mul(out, out), 1))))
_unary(PrimIDs.ASIN, lambda g, a, out: mul(g, _conj(ltorch.rsqrt(sub(1, mul(a, a))))))
_unary(PrimIDs.ACOS, lambda g, a, out: neg(mul(g, _conj(ltorch.rsqrt(sub(1, mul(a, a)))))))
_unary(PrimIDs.ATAN, lambda g, a, out: div(g, _conj(add(mul(a, a), 1))))
_unary(PrimIDs.SINH, lambda g, a, out: mul(g, _conj(ltorch.cosh(a))))
_unary(PrimIDs.COSH, lambda g, a, out: mul(g, _conj(ltorch.sinh(a))))
_unary(PrimIDs.TANH, lambda g, a, out: mul(g, _conj(sub(1, mul(out, out)))))
_unary(PrimIDs.ASINH, lambda g, a, out: mul(g, _conj(ltorch.rsqrt(add(mul(a, a), 1)))))
_unary(PrimIDs.ACOSH, lambda g, a, out: mul(g, _conj(_acosh_derivative(a))))
_unary(PrimIDs.ATANH, lambda g, a, out: div(g, _conj(sub(1, mul(a, a)))))
_unary(PrimIDs.SQRT, lambda g, a, out: div(g, _conj(mul(out, 2))))
_unary(PrimIDs.RSQRT, lambda g, a, out: mul(mul(g, -0.5), _conj(mul(out, mul(out, out)))))
_unary(PrimIDs.RECIPROCAL, lambda g, a, out: neg(mul(g, _conj(mul(out, out)))))
_unary(PrimIDs.ERF, lambda g, a, out: mul(g, mul(ltorch.exp(neg(mul(a, a))), _TWO_OVER_SQRT_PI)))
_unary(PrimIDs.ERFC, lambda g, a, out: mul(g, mul(ltorch.exp(neg(mul(a, a))), -_TWO_OVER_SQRT_PI)))
_unary(PrimIDs.ERFINV, lambda g, a, out: mul(g, mul(ltorch.exp(mul(out, out)), math.sqrt(math.pi) / 2)))
_unary(PrimIDs.LGAMMA, lambda g, a, out: mul(g, ltorch.digamma(a)))
_unary(PrimIDs.SIGMOID, lambda g, a, out: mul(g, _conj(mul(out, sub(1, out)))))
_unary(PrimIDs.REAL, lambda g, a, out: clang.maybe_convert_to_dtype(g, a.dtype))
# imag(x + iy) = y: a real cotangent g goes to the imaginary part, i * g
_unary(PrimIDs.IMAG, lambda g, a, out: mul(clang.maybe_convert_to_dtype(g, a.dtype), 1j))
# Piecewise-constant functions: zero gradient, as eager gives.
for _pid in (PrimIDs.SIGN, PrimIDs.FLOOR, PrimIDs.CEIL, PrimIDs.ROUND, PrimIDs.TRUNC):
    _unary(_pid, lambda g, a, out: zeros_like(a))
# Floor division of floats is piecewise constant too: eager's result requires grad, and ``div(rounding_mode="floor")``
# gives zero gradients (``floor_divide``'s backward raises in eager; zeros are its value where defined).
vjp_rules[PrimIDs.FLOOR_DIVIDE] = lambda b, g: tuple(zeros_like(x) if isinstance(x, TensorProxy) else None
                                                     for x in _args(b))


def _acosh_derivative(a: TensorProxy) -> TensorProxy:
    if not dtypes.is_complex_dtype(a.dtype):
        return ltorch.rsqrt(sub(mul(a, a), 1))
    # sqrt(z*z - 1) = sqrt(z + 1) * sqrt(z - 1) holds for positive reals only: eager takes the product off the real
    # line, which has acosh's branch cut
    return mul(ltorch.rsqrt(add(a, 1)), ltorch.rsqrt(sub(a, 1)))


def sgn(a: TensorProxy, magnitude: TensorProxy | None = None) -> TensorProxy:
    """torch.sgn, the derivative of ``abs`` (times the cotangent): sign(a) for real ``a``, a / |a| (0 at 0) for
    complex ``a``, which torch.sign refuses. ``magnitude`` is |a| where the caller has it."""
    if not dtypes.is_complex_dtype(a.dtype):
        return ltorch.sign(a)
    magnitude = ltorch.abs(a) if magnitude is None else magnitude
    return where(ltorch.eq(magnitude, 0), 0, div(a, magnitude))


_rule(PrimIDs.ABS)(lambda b, g: (mul(g, sgn(_args(b)[0], b.output)),))


@_rule(PrimIDs.DIGAMMA)
def _digamma_vjp(b, g):
    return (mul(g, grad_ops.polygamma(1, _args(b)[0])),)


@_rule(PrimIDs.CONVERT_ELEMENT_TYPE)
def _convert_vjp(b, g):
    a = _args(b)[0]
    if not is_differentiable_dtype(a.dtype):
        return None, None
    return clang.maybe_convert_to_dtype(_real_part_for(g, a), a.dtype), None


@_rule(PrimIDs.DEVICE_PUT)
def _device_put_vjp(b, g):
    a = _args(b)[0]
    return (prims.device_put(g, a.device) if g.device != a.device else g, None)


# ---- binary (either argument may be a Python number) ----

@_rule(PrimIDs.ADD)
def _add_vjp(b, g):
    return g, g


@_rule(PrimIDs.SUB)
def _sub_vjp(b, g):
    return g, neg(g)


@_rule(PrimIDs.MUL)
def _mul_vjp(b, g):
    x, y = _args(b)
    return (mul(g, _conj(y)) if _t(x) else None), (mul(g, _conj(x)) if _t(y) else None)


@_rule(PrimIDs.DIV)
def _div_vjp(b, g):
    x, y = _args(b)
    return (div(g, _conj(y)) if _t(x) else None), (mul(neg(g), _conj(div(div(x, y), y))) if _t(y) else None)


@_rule(PrimIDs.REMAINDER)
def _remainder_vjp(b, g):
    x, y = _args(b)
    return g, (mul(neg(g), ltorch.floor_divide(x, y)) if _t(y) else None)


@_rule(PrimIDs.FMOD)
def _fmod_vjp(b, g):
    x, y = _args(b)
    return g, (mul(neg(g), ltorch.div(x, y, rounding_mode="trunc")) if _t(y) else None)


@_rule(PrimIDs.POW)
def _pow_vjp(b, g):
    """eager's pow_backward_self and pow_backward_exponent: zero where the exponent is 0, or where the base is
    0 and the exponent real and non-negative (0 ** y has no finite derivative in y there)."""
    x, y = _args(b)
    out = b.output
    gx = gy = None
    if _t(x):
        if isinstance(y, Number):
            gx = zeros_like(x) if y == 0 else mul(g, _conj(mul(y, x if y == 2 else ltorch.pow(x, y - 1))))
        else:
            gx = where(ltorch.eq(y, 0), 0, mul(g, _conj(mul(y, ltorch.pow(x, sub(y, 1))))))
    if _t(y):
        if isinstance(x, Number):
            factor = _conj(mul(out, _log_number(x, complex_result=dtypes.is_complex_dtype(y.dtype))))
            gy = mul(g, factor) if x != 0 else mul(g, where(_real_nonnegative(y), 0, factor))
        else:
            zero_base = ltorch.logical_and(ltorch.eq(x, 0), _real_nonnegative(y))
            gy = mul(g, where(zero_base, 0, _conj(mul(out, ltorch.log(x)))))
    return gx, gy


def _log_number(x: Number, *, complex_result: bool) -> Number:
    if complex_result:  # a negative real base of a complex power has the principal complex logarithm
        return complex(-math.inf, 0.0) if x == 0 else cmath.log(x)
    return math.log(x) if x > 0 else (-math.inf if x == 0 else math.nan)


def _real_nonnegative(y: TensorProxy) -> TensorProxy:
    if not dtypes.is_complex_dtype(y.dtype):
        return ltorch.ge(y, 0)
    return ltorch.logical_and(ltorch.eq(prims.imag(y), 0), ltorch.ge(prims.real(y), 0))


@_rule(PrimIDs.ATAN2)
def _atan2_vjp(b, g):
    x, y = _args(b)
    # eager's: zero where x*x + y*y is 0 (both 0, or underflowing), not 0 * inf
    denom = add(mul(x, x), mul(y, y))
    recip = where(ltorch.eq(denom, 0), 0, ltorch.reciprocal(denom))
    return mul(g, mul(y, recip)), mul(g, mul(neg(x), recip))


def _minmax_vjp(b, g, loses_x):
    x, y = _args(b)
    half = where(ltorch.eq(x, y), div(g, 2), g)
    gx = where(loses_x(x, y), 0, half) if _t(x) else None
    gy = where(loses_x(y, x), 0, half) if _t(y) else None
    return gx, gy


vjp_rules[PrimIDs.MAXIMUM] = lambda b, g: _minmax_vjp(b, g, ltorch.lt)
vjp_rules[PrimIDs.MINIMUM] = lambda b, g: _minmax_vjp(b, g, ltorch.gt)


@_rule(PrimIDs.NEXTAFTER)
def _nextafter_vjp(b, g):
    x, y = _args(b)
    return g, (zeros_like(y) if _t(y) else None)  # eager: the identity for x, zero for y


@_rule(PrimIDs.COPYSIGN)
def _copysign_vjp(b, g):
    x, y = _args(b)
    ratio = where(ltorch.eq(x, 0), 0, div(b.output, x))
    return mul(g, ratio), (zeros_like(y) if _t(y) else None)


@_rule(PrimIDs.WHERE)
def _where_vjp(b, g):
    pred, x, y = _args(b)
    return None, (where(pred, g, 0) if _t(x) else None), (where(pred, 0, g) if _t(y) else None)


# ---- shape ----

@_rule(PrimIDs.BROADCAST_IN_DIM)
def _broadcast_in_dim_vjp(b, g):
    a, shape, bdims = _args(b)
    # new length-1 dims: a reshape; a data-dependent length is summed over (right for a length 1 too)
    dims = [d for d in range(len(shape)) if d not in bdims and not known_equal(shape[d], 1)]
    dims += [d for i, d in enumerate(bdims) if known_equal(a.shape[i], 1) and not known_equal(shape[d], 1)]
    if dims:
        g = prims.sum(g, tuple(sorted(dims)))
    return clang.reshape(g, a.shape), None, None


@_rule(PrimIDs.RESHAPE, PrimIDs.SQUEEZE)
def _reshape_vjp(b, g):
    return clang.reshape(g, _args(b)[0].shape), None


@_rule(PrimIDs.STRIDE_ORDER)
def _stride_order_vjp(b, g):
    return g, None


@_rule(PrimIDs.TRANSPOSE)
def _transpose_vjp(b, g):
    perm = _args(b)[1]
    inverse = sorted(range(len(perm)), key=lambda i: perm[i])
    return prims.transpose(g, tuple(inverse)), None


@_rule(PrimIDs.FLIP)
def _flip_vjp(b, g):
    return prims.flip(g, _args(b)[1]), None


@_rule(PrimIDs.SLICE)
def _slice_vjp(b, g):
    a, starts, _, strides = _args(b)
    strides = strides if strides is not None else [1] * a.ndim
    if known_equal(g.numel(), 0):  # a data-dependent length may be 0 too: padding covers it
        return zeros_like(a), None, None, None
    config = [(s, n_in - (s + (n_out - 1) * st) - 1, st - 1)
              for s, st, n_in, n_out in zip(starts, strides, a.shape, g.shape)]
    return prims.pad(g, 0.0, config), None, None, None


@_rule(PrimIDs.PAD)
def _pad_vjp(b, g):
    a, _, config = _args(b)
    crop = [(max(-lo, 0), max(-hi, 0), 0) for lo, hi, _ in config]
    if any(lo or hi for lo, hi, _ in crop):
        g = prims.pad(g, 0.0, crop)  # cropped elements of a got no gradient; put them back as zeros
    starts = [max(lo, 0) for lo, _, _ in config]
    ends = [length - max(hi, 0) for length, (_, hi, _) in zip(g.shape, config)]
    steps = [interior + 1 for _, _, interior in config]
    return prims.slice_prim(g, starts, ends, steps), None, None


@_rule(PrimIDs.CAT)
def _cat_vjp(b, g):
    tensors, dim = _args(b)
    dim = canonicalize_dim(g.ndim, dim)
    grads, start = [], 0
    for t in tensors:
        grads.append(clang.slice_in_dim(g, start, start + t.shape[dim], 1, dim))
        start += t.shape[dim]
    return grads, None


@_rule(PrimIDs.UNFOLD)
def _unfold_vjp(b, g):
    a, dim, size, step = _args(b)
    return grad_ops.unfold_backward(g, tuple(a.shape), dim, size, step), None, None, None


# ---- indexing ----

def _pad_to(g: TensorProxy, shape) -> TensorProxy:
    """Zero-pad ``g`` at the end of each dim up to ``shape`` (sources larger than their index)."""
    if tuple(g.shape) == tuple(shape):
        return g
    return prims.pad(g, 0.0, [(0, s - n, 0) for n, s in zip(g.shape, shape)])


@_rule(PrimIDs.TAKE)
def _take_vjp(b, g):
    a, index, dim = _args(b)
    return prims.index_add(zeros_like(a), dim, index, g), None, None


@_rule(PrimIDs.TAKE_ALONG_AXIS)
def _take_along_axis_vjp(b, g):
    a, index, dim = _args(b)
    return prims.scatter_add(zeros_like(a), dim, index, g), None, None


@_rule(PrimIDs.INDEX_ADD)
def _index_add_vjp(b, g):
    a, dim, index, source = _args(b)
    return g, None, None, (clang.reshape(prims.take(g, index, dim), source.shape) if _t(source) else None)


@_rule(PrimIDs.SCATTER)
def _scatter_vjp(b, g):
    a, dim, index, src = _args(b)
    gsrc = _pad_to(prims.take_along_axis(g, index, dim), src.shape) if _t(src) else None
    return prims.scatter(g, dim, index, 0.0), None, None, gsrc


@_rule(PrimIDs.SCATTER_ADD)
def _scatter_add_vjp(b, g):
    a, dim, index, src = _args(b)
    return g, None, None, (_pad_to(prims.take_along_axis(g, index, dim), src.shape) if _t(src) else None)


@_rule(PrimIDs.INDEX_PUT)
def _index_put_vjp(b, g):
    a, indices, values, accumulate = _args(b)
    ga = g if accumulate else prims.index_put(g, indices, zeros_like(values), False)
    if not _t(values):
        return ga, None, None, None
    # values' gradient: g gathered at the (broadcast) indices, through one flat index into g's leading dims
    idx = clang.maybe_broadcast(*indices)
    k, lead = len(idx), a.shape[:len(idx)]
    flat = None
    for j, i in enumerate(idx):
        i = where(ltorch.lt(i, 0), add(i, lead[j]), i)
        flat = i if flat is None else add(mul(flat, lead[j]), i)
    rest = tuple(a.shape[k:])
    picked = prims.take(clang.reshape(g, (prod(lead),) + rest), clang.reshape(flat, (flat.numel(),)), 0)
    picked = clang.reshape(picked, tuple(flat.shape) + rest)
    return ga, None, sum_to(picked, values.shape), None


# ---- reductions and scans ----

def _expand_back(x: TensorProxy, a: TensorProxy, dims) -> TensorProxy:
    """Broadcast a reduction's result (dims removed) back to the input's shape."""
    kept = tuple(i for i in range(a.ndim) if i not in dims)
    return prims.broadcast_in_dim(x, tuple(a.shape), kept)


@_rule(PrimIDs.SUM)
def _sum_vjp(b, g):
    a, dims = _args(b)[:2]
    return clang.maybe_convert_to_dtype(_expand_back(g, a, dims), a.dtype), None


def _amax_vjp(b, g):
    a, dims = _args(b)[:2]
    mask = clang.maybe_convert_to_dtype(ltorch.eq(a, _expand_back(b.output, a, dims)), g.dtype)
    count = _expand_back(prims.sum(mask, tuple(dims)), a, dims)
    return mul(div(_expand_back(g, a, dims), count), mask), None


vjp_rules[PrimIDs.AMAX] = vjp_rules[PrimIDs.AMIN] = _amax_vjp


def _var_part(a, dims, correction, gvar):
    n = prod(a.shape[d] for d in dims)
    mean = _expand_back(div(prims.sum(a, tuple(dims)), n), a, dims)
    scale = 2.0 / (n - correction) if n != correction else math.inf  # as eager's double arithmetic gives
    return mul(mul(_expand_back(gvar, a, dims), sub(a, mean)), scale)


@_rule(PrimIDs.VAR)
def _var_vjp(b, g):
    a, dims, correction = _args(b)
    return _var_part(a, dims, correction, g), None


@_rule(PrimIDs.VAR_MEAN)
def _var_mean_vjp(b, g):
    a, dims, correction = _args(b)
    gvar, gmean = g
    ga = _var_part(a, dims, correction, gvar) if gvar is not None else None
    if gmean is not None:
        gm = div(_expand_back(gmean, a, dims), prod(a.shape[d] for d in dims))
        ga = gm if ga is None else add(ga, gm)
    return ga, None


@_rule(PrimIDs.CUMSUM)
def _cumsum_vjp(b, g):
    a, dim = _args(b)
    if a.ndim == 0:
        return g, None
    dim = (canonicalize_dim(a.ndim, dim),)
    return prims.flip(prims.cumsum(prims.flip(g, dim), dim[0]), dim), None


def _torch_autograd_vjp(b, g):
    """Prims whose exact VJP is intricate (products with zeros): PyTorch's autograd on the prim's torch impl."""
    args = _args(b)
    tensors = [x for x in tree_flatten((b.args, b.kwargs))[0] if _t(x)]
    which = tuple(i for i, x in enumerate(tensors) if is_differentiable_dtype(x.dtype))
    cts = g if isinstance(g, tuple) else (g,)
    grads = dict(zip((tensors[i].name for i in which),
                     grad_ops.autograd_vjp(b.sym.torch_impl)(b.args, b.kwargs, cts, which, None)))
    return tuple(grads.get(x.name) if _t(x) else None for x in args)


vjp_rules[PrimIDs.PROD] = vjp_rules[PrimIDs.CUMPROD] = _torch_autograd_vjp


def _permutation_vjp(b, g):
    """topk and sort: values' cotangent scattered back to where the values came from."""
    args = _args(b)
    a, dim = args[0], args[2] if b.sym.id is PrimIDs.TOPK else args[1]
    gv = g[0]
    if gv is None:
        return (None,) * len(args)
    if a.ndim == 0:
        return (clang.reshape(gv, ()),) + (None,) * (len(args) - 1)
    dim = canonicalize_dim(a.ndim, dim)
    return (prims.scatter(zeros_like(a), dim, b.output[1], gv),) + (None,) * (len(args) - 1)


vjp_rules[PrimIDs.TOPK] = vjp_rules[PrimIDs.SORT] = _permutation_vjp


# ---- linear algebra ----

def _mT(x: TensorProxy) -> TensorProxy:
    return clang.matrix_transpose(x)


def matmul_vjp(a: TensorProxy, b: TensorProxy, g: TensorProxy) -> tuple[TensorProxy, TensorProxy]:
    """Gradients of ``torch.matmul(a, b)`` (broadcast batches and 1-D promotion included)."""
    a, b = _conj(a), _conj(b)  # complex: g @ b^H and a^H @ g
    if a.ndim == 1 and b.ndim == 1:
        return mul(g, b), mul(g, a)
    a2 = clang.unsqueeze(a, 0) if a.ndim == 1 else a
    b2 = clang.unsqueeze(b, -1) if b.ndim == 1 else b
    g2 = clang.unsqueeze(g, -2) if a.ndim == 1 else g
    g2 = clang.unsqueeze(g2, -1) if b.ndim == 1 else g2
    ga = clang.reshape(sum_to(prims.matmul(g2, _mT(b2)), a2.shape), a.shape)
    if b2.ndim == 2 and a2.ndim > 2:  # the batch folds into the inner dim: one matrix product, as eager does
        k, n = b2.shape
        rows = prod(a2.shape[:-1])  # not numel // k: with k or n zero that loses the rows
        gb = prims.matmul(_mT(clang.reshape(a2, (rows, k))), clang.reshape(g2, (rows, n)))
    else:
        gb = sum_to(prims.matmul(_mT(a2), g2), b2.shape)
    return ga, clang.reshape(gb, b.shape)


@_rule(PrimIDs.MATMUL)
def _matmul_vjp(b, g):
    x, y = _args(b)
    return matmul_vjp(x, y, g)


def linear_vjp(a: TensorProxy, w: TensorProxy, bias: TensorProxy | None, g: TensorProxy) -> tuple:
    """Gradients of ``F.linear(a, w, bias)``."""
    gb = sum_to(g, bias.shape) if _t(bias) else None
    a, w = _conj(a), _conj(w)
    if w.ndim == 1:
        ga = mul(clang.unsqueeze(g, -1), w)
        gw = prims.matmul(clang.reshape(g, (g.numel(),)), clang.reshape(a, (g.numel(), w.shape[0])))
        return ga, gw, gb
    out_features, in_features = w.shape
    ga = prims.matmul(g, w)
    rows = prod(g.shape[:-1])  # not numel // out_features: with a zero size that loses the rows
    gw = prims.matmul(_mT(clang.reshape(g, (rows, out_features))), clang.reshape(a, (rows, in_features)))
    return ga, gw, gb


@_rule(PrimIDs.LINEAR)
def _linear_vjp(b, g):
    return linear_vjp(*_args(b), g)


@_rule(PrimIDs.CONVOLUTION)
def _convolution_vjp(b, g):
    a, w, bias, stride, padding, dilation, transposed, output_padding, groups = _args(b)
    if dtypes.is_complex_dtype(a.dtype):  # aten's convolution_backward has no complex kernels
        return _torch_autograd_vjp(b, g)
    mask = [wanted(a), wanted(w), wanted(bias)]
    ga, gw, gb = grad_ops.convolution_backward(g, a, w, tuple(bias.shape) if _t(bias) else None, stride, padding,
                                               dilation, transposed, output_padding, groups, mask)
    return ga, gw, gb, None, None, None, None, None, None


def flat_tensor_args(args: tuple, kwargs: dict) -> list[TensorProxy]:
    return [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, TensorProxy)]


def seed_cotangent(p: TensorProxy, value: float = 1.0) -> TensorProxy:
    """The cotangent ``grad`` starts from: ``torch.full(p.shape, value)`` (the gradient of a sum)."""
    full = ltorch.symbols_by_id.get("torch.full")
    if full is not None:
        return full(tuple(p.shape), value, device=p.device, dtype=p.dtype)
    return clang.full(tuple(p.shape), value, device=p.device, dtype=p.dtype)


from fulmen.transforms import collective_grads as _collective_grads  # noqa: E402,F401  (collectives' rules)
from fulmen.transforms import grad_rules as _grad_rules  # noqa: E402,F401  (registers fulmen's own rules)
