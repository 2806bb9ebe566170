"""OpInfos for the elementwise torch language (``fulmen/torch/elementwise.py``).

Unary math, binary arithmetic (with ``alpha`` and ``rounding_mode``), comparisons, logical and bitwise
ops, ``where``/``clamp``/``lerp``/``addcmul``/``addcdiv`` and friends, and the in-place variants of the
common ones. Generators cover 0-d and empty tensors, non-contiguous and expanded (stride 0) inputs,
broadcasting, Python scalars on either side, 0-d tensors of another dtype mixed with dimensioned ones
(type promotion) and NaN/inf where the op has no restricted domain.

The dtypes an OpInfo lists are the ones torch supports on CPU; an unsupported dtype is left out rather
than marked, and when torch raises for it that case is an error input instead.
"""

from __future__ import annotations

import math
import operator
from functools import partial

import torch

import fulmen.torch as ltorch
from fulmen.tests.opinfos.base import DecorateInfo, OpInfo, SampleInput, make_tensor

try:  # directives are pytest marks; the database itself imports without pytest (seed 002 runs in a notebook)
    import pytest

    _skip = pytest.mark.skip
except ImportError:  # pragma: no cover
    _skip = None

F32, F64, BF16, I64, B8 = torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool
FLOATS = (F32, F64, BF16)
NUMBERS = (F32, F64, BF16, I64)
ALL = (F32, F64, BF16, I64, B8)
INTS = (I64, B8)

# ---------------------------------------------------------------------------------------------------------
# helpers


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _bounds(domain, dtype):
    """make_tensor bounds inside ``domain``; integer ``high`` is exclusive in make_tensor, hence the +1."""
    if dtype is torch.bool:
        return None, None
    lo, hi = domain
    if _is_float(dtype):
        return lo, hi
    return (None if lo is None else math.ceil(lo)), (None if hi is None else math.floor(hi) + 1)


def _maker(device, dtype, requires_grad, domain=(None, None), **kwargs):
    low, high = _bounds(domain, dtype)
    rg = requires_grad and _is_float(dtype)
    return partial(make_tensor, device=device, dtype=dtype, requires_grad=rg, low=low, high=high, **kwargs)


def _leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A leaf with ``t``'s strides (a transposed or expanded view stays one)."""
    return t.detach().requires_grad_(requires_grad and _is_float(t.dtype))


def _layouts(make, requires_grad):
    """Non-contiguous (gapped), transposed and expanded (stride 0) 4x3-ish tensors."""
    yield make((4, 4), noncontiguous=True)
    yield _leaf(make((3, 4)).transpose(0, 1), requires_grad)
    yield _leaf(make((1, 3)).expand(4, 3), requires_grad)


def _specials(device, dtype, requires_grad, n=8):
    """NaN, infinities, signed zeros, a half-integer and ordinary values."""
    values = [math.nan, math.inf, -math.inf, 0.0, -0.0, 2.5, -1.5, 0.25][:n]
    return torch.tensor(values, device=device, dtype=dtype).requires_grad_(requires_grad)


def _python_scalars(dtype):
    """Python numbers of the tensor's own kind and of the next kind up (which changes the result dtype)."""
    if dtype is torch.bool:
        return (True, 3, -2.5)
    if _is_float(dtype):
        return (-2.5, 3)
    return (3, -2.5)


# ---------------------------------------------------------------------------------------------------------
# generic generators


def elementwise_unary_generator(op, device, dtype, requires_grad, *, specials=None, **kwargs):
    """0-d, empty, 1-3 d, non-contiguous, transposed and expanded inputs inside ``op.domain``."""
    make = _maker(device, dtype, requires_grad, op.domain)
    for shape in ((4, 4), (), (0,), (5,), (2, 3, 4)):
        yield SampleInput(make(shape), **kwargs)
    for t in _layouts(make, requires_grad):
        yield SampleInput(t, **kwargs)
    if specials is None:
        specials = op.domain == (None, None)
    if specials and _is_float(dtype):
        yield SampleInput(_specials(device, dtype, requires_grad), **kwargs)


_BINARY_SHAPES = (
    ((4, 4), (4, 4)),  # first: seed 002 expects two 4x4 tensors
    ((), ()),
    ((0,), (0,)),
    ((0, 3), (3,)),
    ((5,), ()),
    ((), (5,)),
    ((4, 1), (1, 3)),
    ((2, 3, 4), (4,)),
    ((3,), (2, 1, 3)),
)


def elementwise_binary_generator(op, device, dtype, requires_grad, *, rhs_domain=None, rhs_exclude_zero=False,
                                 scalar_rhs=True, scalar_lhs=False, float_scalars=True, mixed_zero_dim=True,
                                 specials=True, **kwargs):
    """Pairs with broadcasting, 0-d and empty tensors, odd layouts, Python scalars and 0-d tensors of other dtypes.

    ``rhs_domain`` / ``rhs_exclude_zero`` constrain the second operand (exponents, divisors, shift amounts);
    ``scalar_rhs`` / ``scalar_lhs`` say on which side torch accepts a Python number; ``float_scalars``
    whether a float number may meet an integer tensor; ``mixed_zero_dim`` whether a 0-d tensor of another
    dtype may meet this one.
    """
    make_a = _maker(device, dtype, requires_grad, op.domain)
    exclude_zero = rhs_exclude_zero and not _is_float(dtype) and dtype is not torch.bool
    make_b = _maker(device, dtype, requires_grad, rhs_domain or op.domain, exclude_zero=exclude_zero)
    for sa, sb in _BINARY_SHAPES:
        yield SampleInput(make_a(sa), make_b(sb), **kwargs)
    for a, b in zip(_layouts(make_a, requires_grad), _layouts(make_b, requires_grad)):
        yield SampleInput(a, b, **kwargs)
    yield SampleInput(make_a((4, 3), noncontiguous=True), make_b((3,)), **kwargs)
    scalars = [s for s in _python_scalars(dtype) if float_scalars or not isinstance(s, float) or _is_float(dtype)]
    if rhs_domain is not None and rhs_domain[0] is not None:
        scalars = [s for s in scalars if isinstance(s, bool) or s >= rhs_domain[0]]
    if scalar_rhs:
        for s in scalars:
            yield SampleInput(make_a((3, 2)), s, **kwargs)
    if scalar_lhs:
        for s in scalars:
            yield SampleInput(s, make_b((3, 2)), **kwargs)
    if mixed_zero_dim:
        # a 0-d tensor of another dtype does not change the result dtype unless it is of a higher kind
        others = (F64, I64) if dtype is not torch.bool else (I64,)
        for other in others:
            z = _maker(device, other, False, rhs_domain or op.domain, exclude_zero=rhs_exclude_zero)(())
            if other is I64 and not float_scalars and _is_float(dtype):
                continue
            if other is F64 and not float_scalars and not _is_float(dtype):
                continue
            yield SampleInput(make_a((2, 3)), z, **kwargs)
    if specials and _is_float(dtype):
        s = _specials(device, dtype, requires_grad)
        yield SampleInput(s, make_b((8,)), **kwargs)
        yield SampleInput(make_a((8,)), _specials(device, dtype, requires_grad), **kwargs)


def _binary_error_generator(op, device, *, dtype=torch.float32, **kwargs):
    make = partial(make_tensor, device=device, dtype=dtype)
    yield (SampleInput(make((4, 4)), make((3, 4))), RuntimeError,
           r"The size of tensor a \([34]\) must match the size of tensor b \([34]\) at non-singleton dimension 0")
    yield (SampleInput(make((2, 3)), make((2, 5))), RuntimeError, "must match the size")


def _dtype_error_generator(*dtypes_, name, message=None):
    """Inputs of dtypes torch has no kernel for: the same exception type must come back."""

    def gen(op, device, **kwargs):
        nargs = kwargs.get("nargs", 1)
        for dtype in dtypes_:
            args = [make_tensor((3,), device=device, dtype=dtype) for _ in range(nargs)]
            yield SampleInput(*args), RuntimeError, message or name

    return gen


def _chain(*gens):
    def gen(op, device, **kwargs):
        for g in gens:
            yield from g(op, device, **kwargs)

    return gen


# ---------------------------------------------------------------------------------------------------------
# unary


def _unary(sym, reference=None, *, dtypes=ALL, domain=(None, None), errors=None, directives=(), **gen_kwargs):
    generator = partial(elementwise_unary_generator, **gen_kwargs) if gen_kwargs else elementwise_unary_generator
    return OpInfo(sym, name=sym.name, sample_input_generator=generator,
                  torch_reference=reference or getattr(torch, sym.name), dtypes=dtypes, domain=domain,
                  error_input_generator=errors, test_directives=directives, check_strides=True)


def _no_kernel(name, *dtypes_):
    return _dtype_error_generator(*dtypes_, name=f"{name}|not implemented|not supported")


abs_opinfo = _unary(ltorch.abs, dtypes=NUMBERS, errors=_no_kernel("abs", B8))
neg_opinfo = _unary(ltorch.neg, dtypes=NUMBERS, errors=_dtype_error_generator(
    B8, name="neg", message=r"Negation, the `-` operator, on a bool tensor is not supported"))
exp_opinfo = _unary(ltorch.exp)
exp2_opinfo = _unary(ltorch.exp2)
expm1_opinfo = _unary(ltorch.expm1)
log_opinfo = _unary(ltorch.log, domain=(0, None))
log1p_opinfo = _unary(ltorch.log1p, domain=(-1, None))
log2_opinfo = _unary(ltorch.log2, domain=(0, None))
log10_opinfo = _unary(ltorch.log10, domain=(0, None))
sin_opinfo = _unary(ltorch.sin)
cos_opinfo = _unary(ltorch.cos)
tan_opinfo = _unary(ltorch.tan)
asin_opinfo = _unary(ltorch.asin, domain=(-1, 1))
acos_opinfo = _unary(ltorch.acos, domain=(-1, 1))
atan_opinfo = _unary(ltorch.atan)
sinh_opinfo = _unary(ltorch.sinh)
cosh_opinfo = _unary(ltorch.cosh)
tanh_opinfo = _unary(ltorch.tanh)
asinh_opinfo = _unary(ltorch.asinh)
acosh_opinfo = _unary(ltorch.acosh, domain=(1, None))
atanh_opinfo = _unary(ltorch.atanh, domain=(-1, 1))
sqrt_opinfo = _unary(ltorch.sqrt, domain=(0, None))
rsqrt_opinfo = _unary(ltorch.rsqrt, domain=(0, None))
reciprocal_opinfo = _unary(ltorch.reciprocal)
sign_opinfo = _unary(ltorch.sign)
signbit_opinfo = _unary(ltorch.signbit)
floor_opinfo = _unary(ltorch.floor, dtypes=NUMBERS, errors=_no_kernel("floor", B8))
ceil_opinfo = _unary(ltorch.ceil, dtypes=NUMBERS, errors=_no_kernel("ceil", B8))
trunc_opinfo = _unary(ltorch.trunc, dtypes=NUMBERS, errors=_no_kernel("trunc", B8))
frac_opinfo = _unary(ltorch.frac, dtypes=FLOATS, errors=_no_kernel("frac", I64, B8))
erf_opinfo = _unary(ltorch.erf)
erfc_opinfo = _unary(ltorch.erfc)
erfinv_opinfo = _unary(ltorch.erfinv, domain=(-1, 1))
lgamma_opinfo = _unary(ltorch.lgamma)
# digamma has poles at 0, -1, -2, ...; torch and its prim agree there, but keep samples away from them
digamma_opinfo = _unary(ltorch.digamma, domain=(0.1, None))
sigmoid_opinfo = _unary(ltorch.sigmoid)
bitwise_not_opinfo = _unary(ltorch.bitwise_not, dtypes=INTS, errors=_no_kernel("bitwise_not", F32))
logical_not_opinfo = _unary(ltorch.logical_not)
isfinite_opinfo = _unary(ltorch.isfinite, specials=True)
isnan_opinfo = _unary(ltorch.isnan, specials=True)
isinf_opinfo = _unary(ltorch.isinf, specials=True)
positive_opinfo = _unary(ltorch.positive, dtypes=NUMBERS, errors=_dtype_error_generator(
    B8, name="positive", message=r"The `\+` operator, on a bool tensor is not supported"))
square_opinfo = _unary(ltorch.square)


def _round_generator(op, device, dtype, requires_grad, **kwargs):
    yield from elementwise_unary_generator(op, device, dtype, requires_grad)
    if _is_float(dtype):
        make = _maker(device, dtype, requires_grad, (-100, 100))
        for decimals in (1, 2, -1):
            yield SampleInput(make((4, 5)), decimals=decimals)


round_opinfo = OpInfo(ltorch.round, name="round", sample_input_generator=_round_generator,
                      torch_reference=torch.round, dtypes=NUMBERS, error_input_generator=_no_kernel("round", B8))


def _nan_to_num_generator(op, device, dtype, requires_grad, **kwargs):
    yield from elementwise_unary_generator(op, device, dtype, requires_grad, specials=True)
    if _is_float(dtype):
        for kw in ({"nan": 1.5}, {"posinf": 7.0}, {"neginf": -7.0}, {"nan": -1.0, "posinf": 2.0, "neginf": -3.0},
                   {"nan": None}):
            yield SampleInput(_specials(device, dtype, requires_grad), **kw)


nan_to_num_opinfo = OpInfo(ltorch.nan_to_num, name="nan_to_num", sample_input_generator=_nan_to_num_generator,
                           torch_reference=torch.nan_to_num, dtypes=ALL)

# ---------------------------------------------------------------------------------------------------------
# binary


def _binary(sym, reference=None, *, dtypes=ALL, domain=(None, None), errors=_binary_error_generator,
            directives=(), name=None, **gen_kwargs):
    generator = partial(elementwise_binary_generator, **gen_kwargs) if gen_kwargs else elementwise_binary_generator
    return OpInfo(sym, name=name or sym.name, sample_input_generator=generator,
                  torch_reference=reference or getattr(torch, sym.name), dtypes=dtypes, domain=domain,
                  error_input_generator=errors, test_directives=directives, check_strides=True)


def _alpha_generator(op, device, dtype, requires_grad, **kwargs):
    yield from elementwise_binary_generator(op, device, dtype, requires_grad, scalar_lhs=True)
    if dtype is torch.bool:
        return
    make = _maker(device, dtype, requires_grad)
    alphas = (2, -0.5) if _is_float(dtype) else (2, -3)
    for alpha in alphas:
        yield SampleInput(make((3, 4)), make((4,)), alpha=alpha)
        yield SampleInput(make((3, 4)), 2, alpha=alpha)


def _add_errors(op, device, **kwargs):
    yield from _binary_error_generator(op, device)
    ints = partial(make_tensor, (3,), device=device, dtype=torch.int64)
    yield (SampleInput(ints(), ints(), alpha=0.5), RuntimeError,
           "For integral input tensors, argument alpha must not be a floating point number")


def _sub_errors(op, device, **kwargs):
    yield from _add_errors(op, device)
    bools = partial(make_tensor, (3,), device=device, dtype=torch.bool)
    yield (SampleInput(bools(), bools()), RuntimeError,
           r"Subtraction, the `-` operator, with two bool tensors is not supported")
    yield (SampleInput(bools(), 1), RuntimeError,
           r"Subtraction, the `-` operator, with (two bool tensors|a bool tensor) is not supported")


add_opinfo = OpInfo(ltorch.add, name="add", sample_input_generator=_alpha_generator, torch_reference=torch.add,
                    dtypes=ALL, error_input_generator=_add_errors, check_strides=True)
sub_opinfo = OpInfo(ltorch.sub, name="sub", sample_input_generator=_alpha_generator, torch_reference=torch.sub,
                    dtypes=NUMBERS, error_input_generator=_sub_errors, check_strides=True)
rsub_opinfo = _binary(ltorch.rsub, dtypes=NUMBERS)
mul_opinfo = _binary(ltorch.mul, scalar_lhs=True)
true_divide_opinfo = _binary(ltorch.true_divide, scalar_lhs=True)


def _div_generator(op, device, dtype, requires_grad, **kwargs):
    # integer division by zero raises in torch, so integer divisors exclude it for the rounding modes
    yield from elementwise_binary_generator(op, device, dtype, requires_grad, scalar_lhs=True)
    if dtype is torch.bool:
        return
    make_a = _maker(device, dtype, requires_grad)
    make_b = _maker(device, dtype, requires_grad, exclude_zero=True)
    for mode in ("trunc", "floor"):
        yield SampleInput(make_a((4, 4)), make_b((4, 4)), rounding_mode=mode)
        yield SampleInput(make_a((3, 4)), make_b((4,)), rounding_mode=mode)
        yield SampleInput(make_a((3,)), -3, rounding_mode=mode)
        yield SampleInput(make_a((3,)), 2.5, rounding_mode=mode)
        yield SampleInput(make_a(()), make_b((2, 2)), rounding_mode=mode)
        if _is_float(dtype):
            yield SampleInput(_specials(device, dtype, requires_grad), make_b((8,)), rounding_mode=mode)
    yield SampleInput(make_a((4,)), make_b((4,)), rounding_mode=None)


def _div_errors(op, device, **kwargs):
    yield from _binary_error_generator(op, device)
    make = partial(make_tensor, (3,), device=device, dtype=torch.float32)
    yield (SampleInput(make(), make(), rounding_mode="round"), RuntimeError,
           "div expected rounding_mode to be one of None, 'trunc', or 'floor' but found 'round'")


div_opinfo = OpInfo(ltorch.div, name="div", sample_input_generator=_div_generator, torch_reference=torch.div,
                    dtypes=ALL, error_input_generator=_div_errors, check_strides=True)


def _int_division_errors(name):
    def gen(op, device, **kwargs):
        yield from _binary_error_generator(op, device)
        ints = partial(make_tensor, (3,), device=device, dtype=torch.int64)
        yield SampleInput(ints(), torch.zeros(3, dtype=torch.int64, device=device)), RuntimeError, "ZeroDivisionError"
        yield from _no_kernel(name, B8)(op, device, nargs=2)

    return gen


floor_divide_opinfo = _binary(ltorch.floor_divide, dtypes=NUMBERS, rhs_exclude_zero=True, scalar_lhs=True,
                              errors=_int_division_errors("floor_divide"))
remainder_opinfo = _binary(ltorch.remainder, dtypes=NUMBERS, rhs_exclude_zero=True, scalar_lhs=True,
                           errors=_int_division_errors("remainder"))
fmod_opinfo = _binary(ltorch.fmod, dtypes=NUMBERS, rhs_exclude_zero=True, errors=_int_division_errors("fmod"))


def _pow_errors(op, device, **kwargs):
    yield from _binary_error_generator(op, device)
    ints = make_tensor((3,), device=device, dtype=torch.int64)
    yield SampleInput(ints, -2), RuntimeError, "Integers to negative integer powers are not allowed"
    yield from _no_kernel("pow", B8)(op, device, nargs=2)


# integer powers: non-negative, small exponents (no overflow) and small bases
pow_opinfo = _binary(ltorch.pow, dtypes=NUMBERS, domain=(-4, 4), rhs_domain=(0, 4), scalar_lhs=True,
                     errors=_pow_errors)
float_power_opinfo = _binary(ltorch.float_power, domain=(-4, 4), rhs_domain=(0, 4), scalar_lhs=True)
atan2_opinfo = _binary(ltorch.atan2, scalar_rhs=False)
maximum_opinfo = _binary(ltorch.maximum, scalar_rhs=False)
minimum_opinfo = _binary(ltorch.minimum, scalar_rhs=False)
copysign_opinfo = _binary(ltorch.copysign)
nextafter_opinfo = _binary(ltorch.nextafter, dtypes=(F32, F64), scalar_rhs=False,
                           errors=_chain(_binary_error_generator, partial(_no_kernel("nextafter", I64), nargs=2)))
xlogy_opinfo = _binary(ltorch.xlogy, scalar_lhs=True)
logaddexp_opinfo = _binary(ltorch.logaddexp, dtypes=FLOATS, scalar_rhs=False,
                           errors=_chain(_binary_error_generator, partial(_no_kernel("logaddexp", I64), nargs=2)))
hypot_opinfo = _binary(ltorch.hypot, dtypes=FLOATS, scalar_rhs=False,
                       errors=_chain(_binary_error_generator, partial(_no_kernel("hypot", I64), nargs=2)))

eq_opinfo = _binary(ltorch.eq)
ne_opinfo = _binary(ltorch.ne)
lt_opinfo = _binary(ltorch.lt)
le_opinfo = _binary(ltorch.le)
gt_opinfo = _binary(ltorch.gt)
ge_opinfo = _binary(ltorch.ge)

logical_and_opinfo = _binary(ltorch.logical_and, scalar_rhs=False)
logical_or_opinfo = _binary(ltorch.logical_or, scalar_rhs=False)
logical_xor_opinfo = _binary(ltorch.logical_xor, scalar_rhs=False)


def _bitwise_errors(name):
    def gen(op, device, **kwargs):
        yield from _binary_error_generator(op, device, dtype=torch.int64)
        floats = partial(make_tensor, (3,), device=device, dtype=torch.float32)
        # torch raises NotImplementedError (a RuntimeError) from its kernel dispatch
        yield SampleInput(floats(), floats()), RuntimeError, name

    return gen


def _bitwise(sym, **kwargs):
    return _binary(sym, dtypes=INTS, float_scalars=False, scalar_lhs=True, errors=_bitwise_errors(sym.name),
                   **kwargs)


bitwise_and_opinfo = _bitwise(ltorch.bitwise_and)
bitwise_or_opinfo = _bitwise(ltorch.bitwise_or)
bitwise_xor_opinfo = _bitwise(ltorch.bitwise_xor)
# shifts by 0..7 of small values: shifting by >= the bit width is implementation-defined in C++
bitwise_left_shift_opinfo = _binary(ltorch.bitwise_left_shift, dtypes=(I64,), domain=(-100, 100),
                                    rhs_domain=(0, 7), float_scalars=False, scalar_lhs=True,
                                    errors=_bitwise_errors("bitwise_left_shift|shift_left|lshift"))
bitwise_right_shift_opinfo = _binary(ltorch.bitwise_right_shift, dtypes=(I64,), domain=(-100, 100),
                                     rhs_domain=(0, 7), float_scalars=False, scalar_lhs=True,
                                     errors=_bitwise_errors("bitwise_right_shift|shift_right|rshift"))

# ---------------------------------------------------------------------------------------------------------
# ternary and friends


def _where_generator(op, device, dtype, requires_grad, **kwargs):
    make = _maker(device, dtype, requires_grad)
    cond = partial(make_tensor, device=device, dtype=torch.bool)
    yield SampleInput(cond((4, 4)), make((4, 4)), make((4, 4)))
    yield SampleInput(cond(()), make(()), make(()))
    yield SampleInput(cond((0, 3)), make((0, 3)), make((3,)))
    yield SampleInput(cond((4, 1)), make((1, 3)), make((4, 3)))
    yield SampleInput(cond((2, 3, 4)), make((4,)), make(()))
    yield SampleInput(cond((3, 4), noncontiguous=True), make((4, 3)).mT, _leaf(make((1, 4)).expand(3, 4), False))
    for scalar in _python_scalars(dtype):
        yield SampleInput(cond((3, 2)), make((3, 2)), scalar)
        yield SampleInput(cond((3, 2)), scalar, make((2,)))
    yield SampleInput(cond((3,)), 1.5, -2)  # two numbers: default float dtype
    other = F64 if dtype is not F64 else F32
    yield SampleInput(cond((2, 2)), make((2, 2)), make_tensor((), device=device, dtype=other))


def _where_errors(op, device, **kwargs):
    make = partial(make_tensor, device=device, dtype=torch.float32)
    yield (SampleInput(make((3,)), make((3,)), make((3,))), RuntimeError,
           "where expected condition to be a boolean tensor")
    yield (SampleInput(torch.ones(4, 4, dtype=torch.bool, device=device), make((3, 4)), make((4, 4))), RuntimeError,
           "must match the size")


where_opinfo = OpInfo(ltorch.where, name="where", sample_input_generator=_where_generator,
                      torch_reference=torch.where, dtypes=ALL, error_input_generator=_where_errors,
                      check_strides=True)


def _clamp_generator(op, device, dtype, requires_grad, **kwargs):
    make = _maker(device, dtype, requires_grad)
    lo, hi = (-2.5, 3.5) if _is_float(dtype) else (-2, 3)
    for shape in ((4, 4), (), (0,), (2, 3, 4)):
        yield SampleInput(make(shape), lo, hi)
    yield SampleInput(make((4, 4)), lo)
    yield SampleInput(make((4, 4)), None, hi)
    yield SampleInput(make((4, 4)), hi, lo)  # min > max: everything becomes max, as in torch
    yield SampleInput(make((4, 4), noncontiguous=True), lo, hi)
    yield SampleInput(make((4, 4)), make((4, 4)), make((4,)))
    yield SampleInput(make((4, 4)), make(()), None)
    yield SampleInput(make((4, 4)), None, make((4, 1)))
    if not _is_float(dtype):
        yield SampleInput(make((3, 3)), -0.5, 2.5)  # float bounds promote an integer tensor
    else:
        yield SampleInput(_specials(device, dtype, requires_grad), -1.0, 1.0)
        yield SampleInput(make((8,)), _specials(device, dtype, False), None)


def _clamp_errors(op, device, **kwargs):
    yield (SampleInput(make_tensor((3,), device=device, dtype=torch.float32)), RuntimeError,
           "torch.clamp: At least one of 'min' or 'max' must not be None")
    yield (SampleInput(make_tensor((3,), device=device, dtype=torch.bool), False, True), RuntimeError,
           "clamp|not implemented")


clamp_opinfo = OpInfo(ltorch.clamp, name="clamp", sample_input_generator=_clamp_generator,
                      torch_reference=torch.clamp, dtypes=NUMBERS, error_input_generator=_clamp_errors,
                      check_strides=True)


def _clamp_side_generator(op, device, dtype, requires_grad, **kwargs):
    make = _maker(device, dtype, requires_grad)
    bound = 1.5 if _is_float(dtype) else 1
    for shape in ((4, 4), (), (0,)):
        yield SampleInput(make(shape), bound)
    yield SampleInput(make((4, 4), noncontiguous=True), -bound)
    yield SampleInput(make((3, 4)), make((4,)))
    if _is_float(dtype):
        yield SampleInput(_specials(device, dtype, requires_grad), 0.0)


clamp_min_opinfo = OpInfo(ltorch.clamp_min, name="clamp_min", sample_input_generator=_clamp_side_generator,
                          torch_reference=torch.clamp_min, dtypes=NUMBERS, check_strides=True)
clamp_max_opinfo = OpInfo(ltorch.clamp_max, name="clamp_max", sample_input_generator=_clamp_side_generator,
                          torch_reference=torch.clamp_max, dtypes=NUMBERS, check_strides=True)


def _lerp_generator(op, device, dtype, requires_grad, **kwargs):
    make = _maker(device, dtype, requires_grad)
    make_w = _maker(device, dtype, requires_grad, (0, 1))
    yield SampleInput(make((4, 4)), make((4, 4)), 0.25)
    yield SampleInput(make(()), make(()), 0.75)
    yield SampleInput(make((0, 3)), make((3,)), 0.5)
    yield SampleInput(make((4, 4)), make((4, 4)), make_w((4, 4)))
    yield SampleInput(make((3, 1)), make((1, 4)), make_w((4,)))
    yield SampleInput(make((4, 4), noncontiguous=True), make((4, 4)).mT, 0.9)  # weight >= 0.5: the other formula
    yield SampleInput(make((2, 3)), make((2, 3)), make_w(()))
    yield SampleInput(make((5,)), make((5,)), -1.5)


def _lerp_errors(op, device, **kwargs):
    ints = partial(make_tensor, (3,), device=device, dtype=torch.int64)
    yield SampleInput(ints(), ints(), 0.5), RuntimeError, "lerp|not implemented"
    f = partial(make_tensor, device=device, dtype=torch.float32)
    yield SampleInput(f((4, 4)), f((3, 4)), 0.5), RuntimeError, "must match the size"


lerp_opinfo = OpInfo(ltorch.lerp, name="lerp", sample_input_generator=_lerp_generator, torch_reference=torch.lerp,
                     dtypes=FLOATS, error_input_generator=_lerp_errors, check_strides=True)


def _addc_generator(op, device, dtype, requires_grad, *, divisor=False, **kwargs):
    make = _maker(device, dtype, requires_grad)
    make_d = _maker(device, dtype, requires_grad, (0.5, 4) if divisor else (None, None))
    values = (0.5, -2) if _is_float(dtype) else (2, -3)
    yield SampleInput(make((4, 4)), make((4, 4)), make_d((4, 4)))
    yield SampleInput(make(()), make(()), make_d(()))
    yield SampleInput(make((0, 3)), make((3,)), make_d((0, 1)))
    yield SampleInput(make((4, 1)), make((1, 4)), make_d((4,)))
    yield SampleInput(make((4, 4), noncontiguous=True), make((4, 4)).mT, make_d((4, 4)))
    for value in values:
        yield SampleInput(make((3, 4)), make((3, 4)), make_d((4,)), value=value)


def _addcdiv_errors(op, device, **kwargs):
    ints = partial(make_tensor, (3,), device=device, dtype=torch.int64)
    yield (SampleInput(ints(), ints(), ints()), RuntimeError,
           "Integer division with addcdiv is no longer supported")


addcmul_opinfo = OpInfo(ltorch.addcmul, name="addcmul", sample_input_generator=_addc_generator,
                        torch_reference=torch.addcmul, dtypes=NUMBERS, check_strides=True)
addcdiv_opinfo = OpInfo(ltorch.addcdiv, name="addcdiv", sample_input_generator=partial(_addc_generator, divisor=True),
                        torch_reference=torch.addcdiv, dtypes=FLOATS, error_input_generator=_addcdiv_errors,
                        check_strides=True)


def _masked_fill_generator(op, device, dtype, requires_grad, **kwargs):
    make = _maker(device, dtype, requires_grad)
    mask = partial(make_tensor, device=device, dtype=torch.bool)
    value = 2.5 if _is_float(dtype) else (True if dtype is torch.bool else 7)
    yield SampleInput(make((4, 4)), mask((4, 4)), value)
    yield SampleInput(make(()), mask(()), value)
    yield SampleInput(make((0, 3)), mask((3,)), value)
    yield SampleInput(make((3, 4)), mask((4,)), value)
    yield SampleInput(make((3, 1)), mask((3, 4)), value)  # the mask broadcasts the input
    yield SampleInput(make((4, 4), noncontiguous=True), mask((4, 4)).mT, value)
    yield SampleInput(make((3, 4)), mask((3, 4)), make_tensor((), device=device, dtype=dtype))
    yield SampleInput(make((3, 4)), mask((3, 4)), make_tensor((), device=device, dtype=F64))  # cast to the input
    if dtype is not torch.bool:
        yield SampleInput(make((3, 4)), mask((3, 4)), -1)


def _masked_fill_errors(op, device, **kwargs):
    make = partial(make_tensor, device=device, dtype=torch.float32)
    yield (SampleInput(make((3,)), make((3,)), 1.0), RuntimeError, "masked_fill_ only supports boolean masks")
    yield (SampleInput(make((3,)), torch.ones(3, dtype=torch.bool, device=device), make((2,))), RuntimeError,
           "only supports a 0-dimensional value tensor")


masked_fill_opinfo = OpInfo(ltorch.masked_fill, name="masked_fill", sample_input_generator=_masked_fill_generator,
                            torch_reference=torch.masked_fill, dtypes=ALL, error_input_generator=_masked_fill_errors)


def _isclose_generator(op, device, dtype, requires_grad, **kwargs):
    make = _maker(device, dtype, requires_grad)
    a = make((4, 4))
    near = a + (1e-6 if _is_float(dtype) else 0) if dtype is not torch.bool else a.clone()
    yield SampleInput(a, near.detach())
    yield SampleInput(make((4, 4)), make((4, 4)))
    yield SampleInput(make(()), make((3,)))
    yield SampleInput(make((3, 1)), make((1, 4)), rtol=0.5, atol=1.0)
    yield SampleInput(make((0,)), make((0,)))
    if _is_float(dtype):
        s = _specials(device, dtype, requires_grad)
        yield SampleInput(s, s.detach().clone())
        yield SampleInput(s, s.detach().clone(), equal_nan=True)
        yield SampleInput(s, make((8,)), rtol=0.0, atol=0.0)


def _isclose_errors(op, device, **kwargs):
    f = make_tensor((3,), device=device, dtype=torch.float32)
    yield SampleInput(f, make_tensor((3,), device=device, dtype=torch.int64)), RuntimeError, "did not match"
    yield SampleInput(f, f, rtol=-1.0), RuntimeError, "rtol must be greater than or equal to zero"
    yield SampleInput(f, f, atol=-1.0), RuntimeError, "atol must be greater than or equal to zero"


isclose_opinfo = OpInfo(ltorch.isclose, name="isclose", sample_input_generator=_isclose_generator,
                        torch_reference=torch.isclose, dtypes=ALL, error_input_generator=_isclose_errors)

# ---------------------------------------------------------------------------------------------------------
# in-place variants: the test compares the returned value *and* the mutated first argument with eager


def _inplace_generator(base_generator):
    """Samples of ``base_generator`` that an in-place op can take: the first argument receives the result."""

    def gen(op, device, dtype, requires_grad, **kwargs):
        for sample in base_generator(op, device, dtype, False, **kwargs):
            a = sample.args[0]
            if not isinstance(a, torch.Tensor) or 0 in a.stride() and a.numel() > 1:
                continue
            others = [x for x in sample.args[1:] if isinstance(x, torch.Tensor)]
            try:
                shape = torch.broadcast_shapes(a.shape, *(x.shape for x in others))
                promoted = torch.result_type(a, sample.args[1]) if len(sample.args) > 1 and sample.args[1] is not \
                    None else a.dtype
            except (RuntimeError, TypeError):
                continue
            if tuple(shape) != tuple(a.shape) or not torch.can_cast(promoted, a.dtype):
                continue
            yield sample

    return gen


def _inplace(name, base, reference_name=None, *, dtypes=None):
    method = reference_name or name + "_"

    def op(a, *args, **kwargs):
        return getattr(a, method)(*args, **kwargs)

    op.__name__ = method
    return OpInfo(op, name=method, sample_input_generator=_inplace_generator(base.sample_input_generator),
                  torch_reference=op, dtypes=dtypes or base.dtypes, tolerance=dict(base.tolerance))


add__opinfo = _inplace("add", add_opinfo)
sub__opinfo = _inplace("sub", sub_opinfo)
mul__opinfo = _inplace("mul", mul_opinfo)
div__opinfo = _inplace("div", div_opinfo, dtypes=FLOATS)
pow__opinfo = _inplace("pow", pow_opinfo)
clamp__opinfo = _inplace("clamp", clamp_opinfo)
masked_fill__opinfo = _inplace("masked_fill", masked_fill_opinfo)
lerp__opinfo = _inplace("lerp", lerp_opinfo)
addcmul__opinfo = _inplace("addcmul", addcmul_opinfo)
exp__opinfo = _inplace("exp", exp_opinfo, dtypes=FLOATS)
neg__opinfo = _inplace("neg", neg_opinfo)
sigmoid__opinfo = _inplace("sigmoid", sigmoid_opinfo, dtypes=FLOATS)
eq__opinfo = _inplace("eq", eq_opinfo)
bitwise_and__opinfo = _inplace("bitwise_and", bitwise_and_opinfo)
logical_not__opinfo = _inplace("logical_not", logical_not_opinfo)

# ---------------------------------------------------------------------------------------------------------
# Python operators and torch aliases: they must reach the same symbols (reflected forms included: ``2 - t``)


def _same_symbol_as(base):
    """An alias records the same symbol as ``base``: its decomposition and metas are tested there already."""
    if _skip is None:
        return ()
    reason = f"records the same symbol as {base.name}, whose OpInfo tests its decomposition and metas"
    return tuple(DecorateInfo(_skip, test, reason=reason) for test in ("test_decomposed_vs_torch", "test_meta"))


def _routed(fn, name, base, **gen_kwargs):
    generator = partial(elementwise_binary_generator, **gen_kwargs) if gen_kwargs else base.sample_input_generator
    return OpInfo(fn, name=name, sample_input_generator=generator, torch_reference=fn, dtypes=base.dtypes,
                  domain=base.domain, tolerance=dict(base.tolerance), test_directives=_same_symbol_as(base))


operator_add_opinfo = _routed(operator.add, "operator.add", add_opinfo, scalar_lhs=True)
operator_sub_opinfo = _routed(operator.sub, "operator.sub", sub_opinfo, scalar_lhs=True)
operator_mul_opinfo = _routed(operator.mul, "operator.mul", mul_opinfo, scalar_lhs=True)
operator_truediv_opinfo = _routed(operator.truediv, "operator.truediv", true_divide_opinfo, scalar_lhs=True)
operator_floordiv_opinfo = _routed(operator.floordiv, "operator.floordiv", floor_divide_opinfo, scalar_lhs=True,
                                   rhs_exclude_zero=True)
operator_mod_opinfo = _routed(operator.mod, "operator.mod", remainder_opinfo, scalar_lhs=True, rhs_exclude_zero=True)
operator_pow_opinfo = _routed(operator.pow, "operator.pow", pow_opinfo, scalar_lhs=True, rhs_domain=(0, 4))
operator_and_opinfo = _routed(operator.and_, "operator.and", bitwise_and_opinfo, scalar_lhs=True, float_scalars=False)
operator_or_opinfo = _routed(operator.or_, "operator.or", bitwise_or_opinfo, scalar_lhs=True, float_scalars=False)
operator_xor_opinfo = _routed(operator.xor, "operator.xor", bitwise_xor_opinfo, scalar_lhs=True, float_scalars=False)
operator_lshift_opinfo = _routed(operator.lshift, "operator.lshift", bitwise_left_shift_opinfo, scalar_lhs=True,
                                 rhs_domain=(0, 7), float_scalars=False)
operator_rshift_opinfo = _routed(operator.rshift, "operator.rshift", bitwise_right_shift_opinfo, scalar_lhs=True,
                                 rhs_domain=(0, 7), float_scalars=False)
operator_lt_opinfo = _routed(operator.lt, "operator.lt", lt_opinfo, scalar_lhs=True)
operator_eq_opinfo = _routed(operator.eq, "operator.eq", eq_opinfo, scalar_lhs=True)
operator_ne_opinfo = _routed(operator.ne, "operator.ne", ne_opinfo, scalar_lhs=True)
operator_neg_opinfo = OpInfo(operator.neg, name="operator.neg", sample_input_generator=elementwise_unary_generator,
                             torch_reference=operator.neg, dtypes=NUMBERS, test_directives=_same_symbol_as(neg_opinfo))
operator_abs_opinfo = OpInfo(operator.abs, name="operator.abs", sample_input_generator=elementwise_unary_generator,
                             torch_reference=operator.abs, dtypes=NUMBERS, test_directives=_same_symbol_as(abs_opinfo))
operator_invert_opinfo = OpInfo(operator.invert, name="operator.invert",
                                sample_input_generator=elementwise_unary_generator, torch_reference=operator.invert,
                                dtypes=INTS, test_directives=_same_symbol_as(bitwise_not_opinfo))

subtract_opinfo = _routed(torch.subtract, "subtract", sub_opinfo)
multiply_opinfo = _routed(torch.multiply, "multiply", mul_opinfo)
divide_opinfo = _routed(torch.divide, "divide", div_opinfo)
arctan2_opinfo = _routed(torch.arctan2, "arctan2", atan2_opinfo)
clip_opinfo = _routed(torch.clip, "clip", clamp_opinfo)
greater_equal_opinfo = _routed(torch.greater_equal, "greater_equal", ge_opinfo)
not_equal_opinfo = _routed(torch.not_equal, "not_equal", ne_opinfo)
special_xlogy_opinfo = _routed(torch.special.xlogy, "special.xlogy", xlogy_opinfo)
F_tanh_opinfo = OpInfo(torch.nn.functional.tanh, name="nn.functional.tanh",
                       sample_input_generator=elementwise_unary_generator, torch_reference=torch.nn.functional.tanh,
                       test_directives=_same_symbol_as(tanh_opinfo))


def _tensor_first(generator):
    def gen(op, device, dtype, requires_grad, **kwargs):
        return (s for s in generator(op, device, dtype, requires_grad, **kwargs) if isinstance(s.args[0], torch.Tensor))

    return gen


Tensor_subtract_opinfo = OpInfo(lambda a, b, **kw: a.subtract(b, **kw), name="Tensor.subtract",
                                sample_input_generator=_tensor_first(sub_opinfo.sample_input_generator),
                                torch_reference=lambda a, b, **kw: a.subtract(b, **kw), dtypes=sub_opinfo.dtypes)


def _routed_inplace(fn, name, base, dtypes=None):
    return OpInfo(fn, name=name, sample_input_generator=_inplace_generator(base.sample_input_generator),
                  torch_reference=fn, dtypes=dtypes or base.dtypes, tolerance=dict(base.tolerance))


# augmented assignment (``a += b``): the caller's tensor must change, as in eager
operator_iadd_opinfo = _routed_inplace(operator.iadd, "operator.iadd", operator_add_opinfo)
operator_isub_opinfo = _routed_inplace(operator.isub, "operator.isub", operator_sub_opinfo)
operator_imul_opinfo = _routed_inplace(operator.imul, "operator.imul", operator_mul_opinfo)
operator_itruediv_opinfo = _routed_inplace(operator.itruediv, "operator.itruediv", operator_truediv_opinfo, FLOATS)
operator_ifloordiv_opinfo = _routed_inplace(operator.ifloordiv, "operator.ifloordiv", operator_floordiv_opinfo)
operator_imod_opinfo = _routed_inplace(operator.imod, "operator.imod", operator_mod_opinfo)
operator_ipow_opinfo = _routed_inplace(operator.ipow, "operator.ipow", operator_pow_opinfo)
operator_iand_opinfo = _routed_inplace(operator.iand, "operator.iand", operator_and_opinfo)
operator_ior_opinfo = _routed_inplace(operator.ior, "operator.ior", operator_or_opinfo)
operator_ixor_opinfo = _routed_inplace(operator.ixor, "operator.ixor", operator_xor_opinfo)
operator_ilshift_opinfo = _routed_inplace(operator.ilshift, "operator.ilshift", operator_lshift_opinfo)
operator_irshift_opinfo = _routed_inplace(operator.irshift, "operator.irshift", operator_rshift_opinfo)

elementwise_opinfos = [v for k, v in sorted(globals().items()) if k.endswith("_opinfo")]

__all__ = ["elementwise_opinfos", "elementwise_unary_generator", "elementwise_binary_generator"] + [
    k for k in list(globals()) if k.endswith("_opinfo")]
