"""Elementwise torch operations: math, comparison, logical and bitwise, and their in-place variants."""

from __future__ import annotations

import math
from numbers import Number

import torch

from fulmen import clang, prims
from fulmen.clang import TypePromotion, elementwise_binary, elementwise_unary, maybe_convert_to_dtype
from fulmen.core import dtypes
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags
from fulmen.core.symbolic import NUMBER_TYPES
from fulmen.core.utils import check
from fulmen.torch.inplace import mutate
from fulmen.torch.overlap import check_no_partial_overlap
from fulmen.torch.registry import register_function, tensor_methods, torchsymbol

_EW = (OpTags.ELEMENTWISE,)


def inplace_variant(fn, name: str):
    """``name_`` for a functional ``fn``: same math, result cast back into ``a`` as torch does."""

    def inplace(a, *args, **kwargs):
        check_no_partial_overlap(name + "_", a, *args, *kwargs.values())
        result = fn(a, *args, **kwargs)
        if isinstance(result, TensorProxy):
            check(torch.can_cast(result.dtype, a.dtype),
                  lambda: f"result type {str(result.dtype).replace('torch.', '').capitalize()} can't be cast to the "
                  f"desired output type {str(a.dtype).replace('torch.', '').capitalize()}")
        return mutate(a, result)

    inplace.__name__ = name + "_"
    register_function(tensor_methods(name + "_") + ((getattr(torch, name + "_"),) if hasattr(torch, name + "_")
                                                     else ()), inplace, method_names=[name + "_"])
    return inplace


def _unary_symbol(name: str, prim, kind=TypePromotion.DEFAULT, *, extra_fns=()):
    torch_fns = tuple(f for f in (getattr(torch, name, None), getattr(torch.Tensor, name, None)) if f is not None)

    def fn(a):
        return elementwise_unary(a, prim, kind)

    fn.__name__ = name
    fn.__doc__ = f"torch.{name} through prims.{prim.name}."
    sym = torchsymbol(*torch_fns, *extra_fns, method_name=name, tags=_EW)(fn)
    inplace_variant(sym, name)
    return sym


_FLOAT = TypePromotion.INT_TO_FLOAT
abs = _unary_symbol("abs", prims.abs, TypePromotion.COMPLEX_TO_FLOAT)
neg = _unary_symbol("neg", prims.neg)
exp = _unary_symbol("exp", prims.exp, _FLOAT)
exp2 = _unary_symbol("exp2", prims.exp2, _FLOAT)
expm1 = _unary_symbol("expm1", prims.expm1, _FLOAT)
log = _unary_symbol("log", prims.log, _FLOAT)
log1p = _unary_symbol("log1p", prims.log1p, _FLOAT)
log2 = _unary_symbol("log2", prims.log2, _FLOAT)
log10 = _unary_symbol("log10", prims.log10, _FLOAT)
sin = _unary_symbol("sin", prims.sin, _FLOAT)
cos = _unary_symbol("cos", prims.cos, _FLOAT)
tan = _unary_symbol("tan", prims.tan, _FLOAT)
asin = _unary_symbol("asin", prims.asin, _FLOAT)
acos = _unary_symbol("acos", prims.acos, _FLOAT)
atan = _unary_symbol("atan", prims.atan, _FLOAT)
sinh = _unary_symbol("sinh", prims.sinh, _FLOAT)
cosh = _unary_symbol("cosh", prims.cosh, _FLOAT)
tanh = _unary_symbol("tanh", prims.tanh, _FLOAT, extra_fns=(torch.nn.functional.tanh,))
asinh = _unary_symbol("asinh", prims.asinh, _FLOAT)
acosh = _unary_symbol("acosh", prims.acosh, _FLOAT)
atanh = _unary_symbol("atanh", prims.atanh, _FLOAT)
sqrt = _unary_symbol("sqrt", prims.sqrt, _FLOAT)
rsqrt = _unary_symbol("rsqrt", prims.rsqrt, _FLOAT)
reciprocal = _unary_symbol("reciprocal", prims.reciprocal, _FLOAT)
sign = _unary_symbol("sign", prims.sign)
floor = _unary_symbol("floor", prims.floor)
ceil = _unary_symbol("ceil", prims.ceil)
trunc = _unary_symbol("trunc", prims.trunc)
erf = _unary_symbol("erf", prims.erf, _FLOAT)
erfc = _unary_symbol("erfc", prims.erfc, _FLOAT)
erfinv = _unary_symbol("erfinv", prims.erfinv, _FLOAT)
lgamma = _unary_symbol("lgamma", prims.lgamma, _FLOAT)
digamma = _unary_symbol("digamma", prims.digamma, _FLOAT)
sigmoid = _unary_symbol("sigmoid", prims.sigmoid, _FLOAT, extra_fns=(torch.nn.functional.sigmoid,))
bitwise_not = _unary_symbol("bitwise_not", prims.bitwise_not)


@torchsymbol(torch.round, torch.Tensor.round, method_name="round", tags=_EW)
def round(a, *, decimals: int = 0):
    if decimals == 0:
        return elementwise_unary(a, prims.round)
    scale = 10.0 ** decimals
    return true_divide(elementwise_unary(mul(a, scale), prims.round), scale)


@torchsymbol(torch.signbit, torch.Tensor.signbit, method_name="signbit", tags=_EW)
def signbit(a):
    return prims.signbit(a)


@torchsymbol(torch.isfinite, torch.Tensor.isfinite, method_name="isfinite", tags=_EW)
def isfinite(a):
    if dtypes.is_exact_dtype(a.dtype):
        return clang.full_like(a, True, dtype=torch.bool)
    return prims.isfinite(a)


@torchsymbol(torch.isnan, torch.Tensor.isnan, method_name="isnan", tags=_EW)
def isnan(a):
    if dtypes.is_exact_dtype(a.dtype):
        return clang.full_like(a, False, dtype=torch.bool)
    return prims.isnan(a)


@torchsymbol(torch.isinf, torch.Tensor.isinf, method_name="isinf", tags=_EW)
def isinf(a):
    if dtypes.is_exact_dtype(a.dtype):
        return clang.full_like(a, False, dtype=torch.bool)
    return prims.isinf(a)


@torchsymbol(torch.logical_not, torch.Tensor.logical_not, method_name="logical_not", tags=_EW)
def logical_not(a):
    return prims.logical_not(a)


inplace_variant(logical_not, "logical_not")


@torchsymbol(torch.positive, torch.Tensor.positive, method_name="positive", tags=_EW)
def positive(a):
    check(a.dtype is not torch.bool, lambda: "The `+` operator, on a bool tensor is not supported.", RuntimeError)
    return a


@torchsymbol(torch.square, torch.Tensor.square, method_name="square", tags=_EW)
def square(a):
    return mul(a, a) if a.dtype is not torch.bool else mul(maybe_convert_to_dtype(a, torch.int64),
                                                          maybe_convert_to_dtype(a, torch.int64))


inplace_variant(square, "square")


@torchsymbol(torch.frac, torch.Tensor.frac, method_name="frac", tags=_EW)
def frac(a):
    return sub(a, trunc(a))


@torchsymbol(torch.nan_to_num, torch.Tensor.nan_to_num, method_name="nan_to_num", tags=_EW)
def nan_to_num(a, nan: float | None = 0.0, posinf: float | None = None, neginf: float | None = None):
    if dtypes.is_exact_dtype(a.dtype):
        return prims.flip(a, ())  # a copy, as eager returns for integer inputs (nothing to replace)
    info = torch.finfo(a.dtype)
    posinf = info.max if posinf is None else posinf
    neginf = info.min if neginf is None else neginf
    nan = 0.0 if nan is None else nan
    out = clang.where(prims.isnan(a), nan, a)
    out = clang.where(prims.eq(out, math.inf), posinf, out)
    return clang.where(prims.eq(out, -math.inf), neginf, out)


# ---- binary ----

def _binary_torch_fns(name):
    return tuple(f for f in (getattr(torch, name, None), getattr(torch.Tensor, name, None)) if f is not None)


@torchsymbol(*_binary_torch_fns("add"), method_name="add", tags=_EW)
def add(a, b, *, alpha: Number | None = None):
    """torch.add: a + alpha * b with torch's type promotion."""
    if alpha is not None and alpha != 1:
        dtype = clang.result_dtype(a, b)
        check(not (isinstance(alpha, float) and dtypes.is_exact_dtype(dtype)),
              lambda: "For integral input tensors, argument alpha must not be a floating point number.", RuntimeError)
        if dtype is torch.bool:  # eager's kernel takes alpha in the result dtype: any nonzero alpha is True
            alpha = bool(alpha)
            b = bool(b) and alpha if isinstance(b, NUMBER_TYPES) else mul(b, alpha)
        else:
            b = b * alpha if isinstance(b, NUMBER_TYPES) else mul(b, alpha)
    return elementwise_binary(a, b, prims.add)


@torchsymbol(*_binary_torch_fns("sub"), torch.subtract, method_name=("sub", "subtract"), tags=_EW)
def sub(a, b, *, alpha: Number | None = None):
    """torch.sub: a - alpha * b."""
    check(not (isinstance(a, TensorProxy) and a.dtype is torch.bool) and not (isinstance(b, TensorProxy) and b.dtype is
          torch.bool), lambda: "Subtraction, the `-` operator, with two bool tensors is not supported. Use the `^` or "
          "`logical_xor()` operator instead.", RuntimeError)
    if alpha is not None and alpha != 1:
        b = b * alpha if isinstance(b, NUMBER_TYPES) else mul(b, alpha)
    return elementwise_binary(a, b, prims.sub)


@torchsymbol(torch.rsub, method_name="rsub", tags=_EW)
def rsub(a, b, *, alpha: Number | None = None):
    return sub(b, a) if alpha is None else sub(b, a, alpha=alpha)


@torchsymbol(*_binary_torch_fns("mul"), torch.multiply, method_name=("mul", "multiply"), tags=_EW)
def mul(a, b):
    return elementwise_binary(a, b, prims.mul)


@torchsymbol(torch.true_divide, torch.Tensor.true_divide, method_name="true_divide", tags=_EW)
def true_divide(a, b):
    return elementwise_binary(a, b, prims.div, TypePromotion.INT_TO_FLOAT)


@torchsymbol(*_binary_torch_fns("div"), torch.divide, method_name=("div", "divide"), tags=_EW)
def div(a, b, *, rounding_mode: str | None = None):
    """torch.div with rounding_mode None (true division), "trunc" or "floor"."""
    if rounding_mode is None:
        return true_divide(a, b)
    if rounding_mode == "trunc":
        if dtypes.is_exact_dtype(clang.result_dtype(a, b)):
            return elementwise_binary(a, b, prims.div)
        return trunc(true_divide(a, b))
    if rounding_mode == "floor":
        return floor_divide(a, b)
    raise RuntimeError(f"div expected rounding_mode to be one of None, 'trunc', or 'floor' but found '{rounding_mode}'")


@torchsymbol(*_binary_torch_fns("floor_divide"), method_name="floor_divide", tags=_EW)
def floor_divide(a, b):
    return elementwise_binary(a, b, prims.floor_divide, TypePromotion.NO_OPMATH)


@torchsymbol(*_binary_torch_fns("remainder"), method_name="remainder", tags=_EW)
def remainder(a, b):
    return elementwise_binary(a, b, prims.remainder, TypePromotion.NO_OPMATH)


@torchsymbol(*_binary_torch_fns("fmod"), method_name="fmod", tags=_EW)
def fmod(a, b):
    return elementwise_binary(a, b, prims.fmod, TypePromotion.NO_OPMATH)


def _dense_number_base(args, kwargs):
    """A number base becomes a dense tensor of the exponent's shape: eager's pow(Scalar, Tensor) kernel allocates a
    contiguous result whatever the exponent's layout, where PyTorch's meta function for it (which fake tensors, and
    so a fused region's graph, run) lays the result out as the exponent. pow(dense base, exponent) is laid out as
    the base, everywhere, with the same values."""
    if len(args) != 2 or kwargs or not isinstance(args[0], NUMBER_TYPES) or not isinstance(args[1], TensorProxy):
        return args, kwargs
    a, b = args
    return (clang.full(tuple(b.shape), a, device=b.device, dtype=clang.result_dtype(a, b)), b), kwargs


@torchsymbol(*_binary_torch_fns("pow"), method_name="pow", tags=_EW, normalize=_dense_number_base)
def pow(a, b):
    """torch.pow; ``x ** 2`` stays a pow (torch computes it exactly as x * x for integer exponents)."""
    (a, b), _ = _dense_number_base((a, b), {})
    return elementwise_binary(a, b, prims.pow)


def _float_power_base(args, kwargs):
    if len(args) != 2 or kwargs or not isinstance(args[0], NUMBER_TYPES) or not isinstance(args[1], TensorProxy):
        return args, kwargs
    dtype = torch.complex128 if isinstance(args[0], complex) or args[1].dtype.is_complex else torch.float64
    return (clang.full(tuple(args[1].shape), args[0], device=args[1].device, dtype=dtype), args[1]), kwargs


@torchsymbol(torch.float_power, torch.Tensor.float_power, method_name="float_power", tags=_EW,
             normalize=_float_power_base)
def float_power(a, b):
    """torch.float_power: pow in float64 (complex128); a number base is dense, as pow's (``_dense_number_base``)."""
    dtype = torch.complex128 if any(isinstance(x, TensorProxy) and dtypes.is_complex_dtype(x.dtype) for x in (a, b)) \
        else torch.float64
    return pow(maybe_convert_to_dtype(a, dtype), maybe_convert_to_dtype(b, dtype))


@torchsymbol(*_binary_torch_fns("atan2"), torch.arctan2, method_name=("atan2", "arctan2"), tags=_EW)
def atan2(a, b):
    return elementwise_binary(a, b, prims.atan2, TypePromotion.INT_TO_FLOAT)


def _numbers_as_tensors(args, kwargs, first_only: bool = False):
    """Numbers become 0-d tensors of the result dtype where the torch function takes tensors only (decompositions
    call ``maximum(x, 0.5)`` or ``le(0.5, x)``); the result is unchanged and the recorded call stays valid."""
    if len(args) != 2 or kwargs or not any(isinstance(x, TensorProxy) for x in args):
        return args, kwargs
    a, b = args
    ref = a if isinstance(a, TensorProxy) else b
    dtype = clang.result_dtype(a, b)
    if isinstance(a, NUMBER_TYPES):
        a = clang.full((), a, device=ref.device, dtype=dtype)
    if isinstance(b, NUMBER_TYPES) and not first_only:
        b = clang.full((), b, device=ref.device, dtype=dtype)
    return (a, b), kwargs


def _first_number_as_tensor(args, kwargs):
    return _numbers_as_tensors(args, kwargs, first_only=True)


@torchsymbol(*_binary_torch_fns("maximum"), method_name="maximum", tags=_EW, normalize=_numbers_as_tensors)
def maximum(a, b):
    return elementwise_binary(a, b, prims.maximum, TypePromotion.NO_OPMATH)


@torchsymbol(*_binary_torch_fns("minimum"), method_name="minimum", tags=_EW, normalize=_numbers_as_tensors)
def minimum(a, b):
    return elementwise_binary(a, b, prims.minimum, TypePromotion.NO_OPMATH)


@torchsymbol(*_binary_torch_fns("copysign"), method_name="copysign", tags=_EW)
def copysign(a, b):
    return elementwise_binary(a, b, prims.copysign, TypePromotion.INT_TO_FLOAT)


@torchsymbol(*_binary_torch_fns("nextafter"), method_name="nextafter", tags=_EW)
def nextafter(a, b):
    return elementwise_binary(a, b, prims.nextafter, TypePromotion.NO_OPMATH)


def _comparison(name, prim, aliases=()):
    fns = _binary_torch_fns(name) + tuple(getattr(torch, n) for n in aliases if hasattr(torch, n))

    def fn(a, b):
        return elementwise_binary(a, b, prim, TypePromotion.ALWAYS_BOOL)

    fn.__name__ = name
    sym = torchsymbol(*fns, method_name=(name, *aliases), tags=_EW, normalize=_first_number_as_tensor)(fn)
    inplace_variant(sym, name)
    return sym


eq = _comparison("eq", prims.eq)
ne = _comparison("ne", prims.ne, ("not_equal",))
lt = _comparison("lt", prims.lt, ("less",))
le = _comparison("le", prims.le, ("less_equal",))
gt = _comparison("gt", prims.gt, ("greater",))
ge = _comparison("ge", prims.ge, ("greater_equal",))


def _bitwise(name, prim):
    def fn(a, b):
        return elementwise_binary(a, b, prim, TypePromotion.NO_OPMATH)

    fn.__name__ = name
    sym = torchsymbol(*_binary_torch_fns(name), method_name=name, tags=_EW)(fn)
    inplace_variant(sym, name)
    return sym


bitwise_and = _bitwise("bitwise_and", prims.bitwise_and)
bitwise_or = _bitwise("bitwise_or", prims.bitwise_or)
bitwise_xor = _bitwise("bitwise_xor", prims.bitwise_xor)
bitwise_left_shift = _bitwise("bitwise_left_shift", prims.shift_left)
bitwise_right_shift = _bitwise("bitwise_right_shift", prims.shift_right)


def _to_bool(x):
    if isinstance(x, TensorProxy):
        return x if x.dtype is torch.bool else prims.ne(x, maybe_convert_to_dtype(0, x.dtype))
    return bool(x)


def _logical(name, prim):
    def fn(a, b):
        return elementwise_binary(_to_bool(a), _to_bool(b), prim, TypePromotion.ALWAYS_BOOL)

    fn.__name__ = name
    sym = torchsymbol(*_binary_torch_fns(name), method_name=name, tags=_EW)(fn)
    inplace_variant(sym, name)
    return sym


logical_and = _logical("logical_and", prims.bitwise_and)
logical_or = _logical("logical_or", prims.bitwise_or)
logical_xor = _logical("logical_xor", prims.bitwise_xor)

for _name, _sym in (("add", add), ("sub", sub), ("mul", mul), ("div", div), ("true_divide", true_divide),
                    ("floor_divide", floor_divide), ("remainder", remainder), ("fmod", fmod), ("pow", pow),
                    ("atan2", atan2), ("copysign", copysign), ("float_power", float_power)):
    inplace_variant(_sym, _name)


# ---- ternary and friends ----

@torchsymbol(torch.where, torch.Tensor.where, method_name="where", tags=_EW)
def where(condition, input=None, other=None):
    """torch.where(condition, input, other); the one-argument form is torch.nonzero(condition, as_tuple=True)."""
    check(input is not None or other is not None,
          lambda: "torch.where(condition) (one argument) is not traced by fulmen.jit: write "
          "torch.nonzero(condition, as_tuple=True), which returns the same indices and is traced, or use the "
          "three-argument form", NotImplementedError)
    return clang.where(condition, input, other)


@torchsymbol(torch.clamp, torch.Tensor.clamp, torch.clip, torch.Tensor.clip, method_name=("clamp", "clip"), tags=_EW)
def clamp(a, min=None, max=None):
    check(min is not None or max is not None, lambda: "torch.clamp: At least one of 'min' or 'max' must not be None",
          RuntimeError)
    # maximum/minimum propagate NaN from the input, as torch.clamp does; called at the clang level because
    # torch.maximum rejects the Python numbers clamp accepts
    out = a
    if min is not None:
        out = elementwise_binary(out, min, prims.maximum, TypePromotion.NO_OPMATH)
    if max is not None:
        out = elementwise_binary(out, max, prims.minimum, TypePromotion.NO_OPMATH)
    return out


@torchsymbol(torch.clamp_min, torch.Tensor.clamp_min, method_name="clamp_min", tags=_EW)
def clamp_min(a, min):
    return clamp(a, min, None)


@torchsymbol(torch.clamp_max, torch.Tensor.clamp_max, method_name="clamp_max", tags=_EW)
def clamp_max(a, max):
    return clamp(a, None, max)


for _name, _sym in (("clamp", clamp), ("clip", clamp), ("clamp_min", clamp_min), ("clamp_max", clamp_max)):
    inplace_variant(_sym, _name)


@torchsymbol(torch.lerp, torch.Tensor.lerp, method_name="lerp", tags=_EW)
def lerp(start, end, weight):
    computation, result = clang.elementwise_type_promotion(start, end, weight)
    start, end = maybe_convert_to_dtype(start, computation), maybe_convert_to_dtype(end, computation)
    weight = maybe_convert_to_dtype(weight, computation)
    out = add(start, mul(weight, sub(end, start)))  # one rounding at the end, as torch's kernel
    return maybe_convert_to_dtype(out, result)


@torchsymbol(torch.addcmul, torch.Tensor.addcmul, method_name="addcmul", tags=_EW)
def addcmul(a, t1, t2, *, value: Number = 1):
    prod_ = mul(t1, t2)
    return add(a, prod_ if value == 1 else mul(prod_, value))


@torchsymbol(torch.addcdiv, torch.Tensor.addcdiv, method_name="addcdiv", tags=_EW)
def addcdiv(a, t1, t2, *, value: Number = 1):
    check(not (dtypes.is_exact_dtype(t1.dtype) and dtypes.is_exact_dtype(t2.dtype)),
          lambda: "Integer division with addcdiv is no longer supported, and in a future release addcdiv will perform "
          "a true division of tensor1 and tensor2.", RuntimeError)
    q = true_divide(t1, t2)
    return add(a, q if value == 1 else mul(q, value))


for _name, _sym in (("lerp", lerp), ("addcmul", addcmul), ("addcdiv", addcdiv)):
    inplace_variant(_sym, _name)


@torchsymbol(torch.xlogy, torch.Tensor.xlogy, torch.special.xlogy, method_name="xlogy", tags=_EW)
def xlogy(a, b):
    if isinstance(a, NUMBER_TYPES):
        a = clang.full((), a, device=b.device, dtype=clang.result_dtype(a, b))
    if isinstance(b, NUMBER_TYPES):
        b = clang.full((), b, device=a.device, dtype=clang.result_dtype(a, b))
    return clang.where(eq(a, 0), 0.0, mul(a, log(b)))


@torchsymbol(torch.logaddexp, torch.Tensor.logaddexp, method_name="logaddexp", tags=_EW)
def logaddexp(a, b):
    m = maximum(a, b)
    # exp(-|a-b|) keeps the sum finite; inf - inf is avoided by the where
    d = abs(sub(a, b))
    out = add(m, log1p(exp(neg(d))))
    return clang.where(eq(a, b), add(a, math.log(2.0)), out)


@torchsymbol(torch.hypot, torch.Tensor.hypot, method_name="hypot", tags=_EW)
def hypot(a, b):
    return sqrt(add(mul(a, a), mul(b, b)))


@torchsymbol(torch.masked_fill, torch.Tensor.masked_fill, method_name="masked_fill", tags=_EW)
def masked_fill(a, mask, value):
    """Where ``mask`` is true, ``value`` (a number or a 0-d tensor), else ``a``; the result keeps a's dtype."""
    check(isinstance(mask, TensorProxy) and mask.dtype is torch.bool,
          lambda: f"masked_fill_ only supports boolean masks, but got mask with dtype {getattr(mask, 'dtype', mask)}",
          RuntimeError)
    if isinstance(value, TensorProxy):
        check(value.ndim == 0, lambda: f"masked_fill_ only supports a 0-dimensional value tensor, but got tensor "
              f"with {value.ndim} dimension(s).", RuntimeError)
        value = clang.maybe_convert_to_dtype(value, a.dtype)
    else:
        value = maybe_convert_to_dtype(value, a.dtype)
    out_shape = clang.broadcast_shapes(a.shape, mask.shape)
    return clang.where(mask, value, clang.expand_to(a, out_shape))


inplace_variant(masked_fill, "masked_fill")


@torchsymbol(torch.isclose, torch.Tensor.isclose, method_name="isclose", tags=_EW)
def isclose(a, b, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False):
    if rtol == 0 and atol == 0:
        return eq(a, b)
    # torch compares bools as numbers of the default dtype (so a tolerance of 1 accepts True vs False)
    if a.dtype is torch.bool:
        a = maybe_convert_to_dtype(a, torch.get_default_dtype())
    if isinstance(b, TensorProxy) and b.dtype is torch.bool:
        b = maybe_convert_to_dtype(b, torch.get_default_dtype())
    close = le(abs(sub(a, b)), add(atol, mul(rtol, abs(b))))
    close = logical_or(eq(a, b), close)
    if equal_nan and dtypes.is_inexact_dtype(a.dtype):
        close = logical_or(close, logical_and(isnan(a), isnan(b)))
    return close
