"""Elementwise primitives: unary, binary and ``where``. Inputs have one shape, device and dtype."""

from __future__ import annotations

from numbers import Number

import torch

from fulmen.core import dtypes
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags
from fulmen.core.symbolic import NUMBER_TYPES
from fulmen.core.utils import check
from fulmen.prims.base import PrimIDs, make_prim, same_dtype, same_shape_device

_ELEMENTWISE = (OpTags.ELEMENTWISE,)


def _unary_meta_factory(name: str, *, output: str = "same", supports: str | None = None):
    def meta(a):
        if isinstance(a, NUMBER_TYPES):
            raise TypeError(f"prims.{name} expects a tensor; clang folds Python numbers before calling prims")
        check(isinstance(a, TensorProxy), lambda: f"prims.{name} expects a tensor, but got {type(a).__name__}",
              TypeError)
        if supports == "float" and not dtypes.is_inexact_dtype(a.dtype):
            raise TypeError(f"prims.{name} expects a floating point or complex tensor, but got {a.dtype}")
        if supports == "exact" and not dtypes.is_exact_dtype(a.dtype):  # torch: "not implemented for 'Float'"
            raise NotImplementedError(f"prims.{name} is not implemented for {a.dtype}: it expects an integer or "
                                      "boolean tensor")
        if output == "bool":
            return TensorProxy(like=a, dtype=torch.bool, requires_grad=False)
        if output == "real":
            return TensorProxy(like=a, dtype=dtypes.corresponding_real_dtype(a.dtype))
        return TensorProxy(like=a)

    return meta


def _unary(pid, name, torch_fn, doc, *, output="same", supports=None, extra_tags=()):
    return make_prim(pid, name, meta=_unary_meta_factory(name, output=output, supports=supports),
                     torch_impl=torch_fn, tags=_ELEMENTWISE + tuple(extra_tags), doc=doc)


abs = _unary(PrimIDs.ABS, "abs", torch.abs, "Absolute value; complex inputs give their real magnitude.", output="real")
neg = _unary(PrimIDs.NEG, "neg", torch.neg, "Negation.")
exp = _unary(PrimIDs.EXP, "exp", torch.exp, "e to the power of the input.", supports="float")
exp2 = _unary(PrimIDs.EXP2, "exp2", torch.exp2, "2 to the power of the input.", supports="float")
expm1 = _unary(PrimIDs.EXPM1, "expm1", torch.expm1, "exp(x) - 1, accurate near zero.", supports="float")
log = _unary(PrimIDs.LOG, "log", torch.log, "Natural logarithm.", supports="float")
log1p = _unary(PrimIDs.LOG1P, "log1p", torch.log1p, "log(1 + x), accurate near zero.", supports="float")
log2 = _unary(PrimIDs.LOG2, "log2", torch.log2, "Base-2 logarithm.", supports="float")
log10 = _unary(PrimIDs.LOG10, "log10", torch.log10, "Base-10 logarithm.", supports="float")
sin = _unary(PrimIDs.SIN, "sin", torch.sin, "Sine.", supports="float")
cos = _unary(PrimIDs.COS, "cos", torch.cos, "Cosine.", supports="float")
tan = _unary(PrimIDs.TAN, "tan", torch.tan, "Tangent.", supports="float")
asin = _unary(PrimIDs.ASIN, "asin", torch.asin, "Inverse sine.", supports="float")
acos = _unary(PrimIDs.ACOS, "acos", torch.acos, "Inverse cosine.", supports="float")
atan = _unary(PrimIDs.ATAN, "atan", torch.atan, "Inverse tangent.", supports="float")
sinh = _unary(PrimIDs.SINH, "sinh", torch.sinh, "Hyperbolic sine.", supports="float")
cosh = _unary(PrimIDs.COSH, "cosh", torch.cosh, "Hyperbolic cosine.", supports="float")
tanh = _unary(PrimIDs.TANH, "tanh", torch.tanh, "Hyperbolic tangent.", supports="float")
asinh = _unary(PrimIDs.ASINH, "asinh", torch.asinh, "Inverse hyperbolic sine.", supports="float")
acosh = _unary(PrimIDs.ACOSH, "acosh", torch.acosh, "Inverse hyperbolic cosine.", supports="float")
atanh = _unary(PrimIDs.ATANH, "atanh", torch.atanh, "Inverse hyperbolic tangent.", supports="float")
sqrt = _unary(PrimIDs.SQRT, "sqrt", torch.sqrt, "Square root.", supports="float")
rsqrt = _unary(PrimIDs.RSQRT, "rsqrt", torch.rsqrt, "1 / sqrt(x).", supports="float")
reciprocal = _unary(PrimIDs.RECIPROCAL, "reciprocal", torch.reciprocal, "1 / x.", supports="float")
sign = _unary(PrimIDs.SIGN, "sign", torch.sign, "-1, 0 or 1 by the sign of x.")
signbit = _unary(PrimIDs.SIGNBIT, "signbit", torch.signbit, "True where the sign bit is set.", output="bool")
floor = _unary(PrimIDs.FLOOR, "floor", torch.floor, "Round down.")
ceil = _unary(PrimIDs.CEIL, "ceil", torch.ceil, "Round up.")
round = _unary(PrimIDs.ROUND, "round", torch.round, "Round half to even.")
trunc = _unary(PrimIDs.TRUNC, "trunc", torch.trunc, "Round toward zero.")
erf = _unary(PrimIDs.ERF, "erf", torch.erf, "Gauss error function.", supports="float")
erfc = _unary(PrimIDs.ERFC, "erfc", torch.erfc, "1 - erf(x), accurate for large x.", supports="float")
erfinv = _unary(PrimIDs.ERFINV, "erfinv", torch.erfinv, "Inverse error function.", supports="float")
lgamma = _unary(PrimIDs.LGAMMA, "lgamma", torch.lgamma, "log(|gamma(x)|).", supports="float")
digamma = _unary(PrimIDs.DIGAMMA, "digamma", torch.digamma, "Derivative of lgamma.", supports="float")
sigmoid = _unary(PrimIDs.SIGMOID, "sigmoid", torch.sigmoid, "1 / (1 + exp(-x)), kept whole for accuracy.",
                 supports="float")
logical_not = _unary(PrimIDs.LOGICAL_NOT, "logical_not", torch.logical_not, "Boolean not.", output="bool")
bitwise_not = _unary(PrimIDs.BITWISE_NOT, "bitwise_not", torch.bitwise_not, "Bitwise not of integers and bools.",
                     supports="exact")
isfinite = _unary(PrimIDs.ISFINITE, "isfinite", torch.isfinite, "True where finite.", output="bool")
isnan = _unary(PrimIDs.ISNAN, "isnan", torch.isnan, "True where NaN.", output="bool")
isinf = _unary(PrimIDs.ISINF, "isinf", torch.isinf, "True where infinite.", output="bool")
real = _unary(PrimIDs.REAL, "real", torch.real, "Real part.", output="real")
imag = _unary(PrimIDs.IMAG, "imag", torch.imag, "Imaginary part.", output="real")
conj = _unary(PrimIDs.CONJ, "conj", torch.conj_physical, "Complex conjugate (a copy for real tensors).")


def _binary_meta_factory(name: str, *, output: str = "same", supports: str | None = None):
    def meta(a, b):
        check(isinstance(a, TensorProxy) or isinstance(b, TensorProxy),
              lambda: f"prims.{name} expects at least one tensor, but got {type(a).__name__} and {type(b).__name__}",
              TypeError)
        shape, device = same_shape_device(name, a, b)
        dtype = same_dtype(name, a, b)
        if supports == "exact" and not dtypes.is_exact_dtype(dtype):  # torch: "not implemented for 'Float'"
            raise NotImplementedError(f"prims.{name} is not implemented for {dtype}: it expects integer or boolean "
                                      "tensors")
        if supports == "not_complex" and dtypes.is_complex_dtype(dtype):
            raise TypeError(f"prims.{name} does not support complex tensors")
        out_dtype = torch.bool if output == "bool" else dtype
        requires_grad = output != "bool" and any(isinstance(x, TensorProxy) and x.requires_grad for x in (a, b))
        return TensorProxy(shape=shape, device=device, dtype=out_dtype, requires_grad=requires_grad)

    return meta


def _scalars_as_tensors(torch_fn, both: bool):
    """torch functions take a Python number only as their second argument, and some not even there."""

    def impl(a, b):
        if isinstance(a, Number):
            a = torch.tensor(a, dtype=b.dtype, device=b.device)
        elif both and isinstance(b, Number):
            b = torch.tensor(b, dtype=a.dtype, device=a.device)
        return torch_fn(a, b)

    impl.__name__ = getattr(torch_fn, "__name__", "impl")
    return impl


_TENSOR_ONLY = {"maximum", "minimum", "atan2", "nextafter", "copysign", "remainder"}


def _binary(pid, name, torch_fn, doc, *, output="same", supports=None):
    impl = _scalars_as_tensors(torch_fn, both=name in _TENSOR_ONLY)
    return make_prim(pid, name, meta=_binary_meta_factory(name, output=output, supports=supports),
                     torch_impl=impl, tags=_ELEMENTWISE, doc=doc)


def _torch_div(a, b):
    return torch.true_divide(a, b) if not _is_exact(a, b) else torch.div(a, b, rounding_mode="trunc")


def _is_exact(a, b) -> bool:
    t = a if isinstance(a, torch.Tensor) else b
    return t.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)


add = _binary(PrimIDs.ADD, "add", torch.add, "Addition.")
sub = _binary(PrimIDs.SUB, "sub", torch.sub, "Subtraction.")
mul = _binary(PrimIDs.MUL, "mul", torch.mul, "Multiplication.")
div = _binary(PrimIDs.DIV, "div", _torch_div, "Division: true division for inexact dtypes, truncation for exact ones.")
floor_divide = _binary(PrimIDs.FLOOR_DIVIDE, "floor_divide", torch.floor_divide, "Division rounded down.",
                       supports="not_complex")
remainder = _binary(PrimIDs.REMAINDER, "remainder", torch.remainder, "Python-style modulus (sign of the divisor).",
                    supports="not_complex")
fmod = _binary(PrimIDs.FMOD, "fmod", torch.fmod, "C-style modulus (sign of the dividend).", supports="not_complex")
pow = _binary(PrimIDs.POW, "pow", torch.pow, "a to the power b.")
atan2 = _binary(PrimIDs.ATAN2, "atan2", torch.atan2, "Angle of (b, a).", supports="not_complex")
maximum = _binary(PrimIDs.MAXIMUM, "maximum", torch.maximum, "Elementwise maximum, propagating NaN.",
                  supports="not_complex")
minimum = _binary(PrimIDs.MINIMUM, "minimum", torch.minimum, "Elementwise minimum, propagating NaN.",
                  supports="not_complex")
eq = _binary(PrimIDs.EQ, "eq", torch.eq, "a == b.", output="bool")
ne = _binary(PrimIDs.NE, "ne", torch.ne, "a != b.", output="bool")
lt = _binary(PrimIDs.LT, "lt", torch.lt, "a < b.", output="bool", supports="not_complex")
le = _binary(PrimIDs.LE, "le", torch.le, "a <= b.", output="bool", supports="not_complex")
gt = _binary(PrimIDs.GT, "gt", torch.gt, "a > b.", output="bool", supports="not_complex")
ge = _binary(PrimIDs.GE, "ge", torch.ge, "a >= b.", output="bool", supports="not_complex")
bitwise_and = _binary(PrimIDs.BITWISE_AND, "bitwise_and", torch.bitwise_and, "Bitwise and.", supports="exact")
bitwise_or = _binary(PrimIDs.BITWISE_OR, "bitwise_or", torch.bitwise_or, "Bitwise or.", supports="exact")
bitwise_xor = _binary(PrimIDs.BITWISE_XOR, "bitwise_xor", torch.bitwise_xor, "Bitwise xor.", supports="exact")
shift_left = _binary(PrimIDs.SHIFT_LEFT, "shift_left", torch.bitwise_left_shift, "Left shift.", supports="exact")
shift_right = _binary(PrimIDs.SHIFT_RIGHT, "shift_right", torch.bitwise_right_shift, "Arithmetic right shift.",
                      supports="exact")
copysign = _binary(PrimIDs.COPYSIGN, "copysign", torch.copysign, "Magnitude of a with the sign of b.",
                   supports="not_complex")
nextafter = _binary(PrimIDs.NEXTAFTER, "nextafter", torch.nextafter, "Next float after a toward b.",
                    supports="not_complex")


def _where_meta(pred, a, b):
    check(isinstance(pred, TensorProxy) and pred.dtype is torch.bool,
          lambda: f"prims.where expects a boolean tensor condition, but got {getattr(pred, 'dtype', type(pred))}",
          TypeError)
    shape, device = same_shape_device("where", pred, a, b)
    values = [x for x in (a, b) if isinstance(x, TensorProxy)]
    dtype = values[0].dtype if values else (torch.get_default_dtype() if isinstance(a, float) else torch.int64)
    for v in values[1:]:
        check(v.dtype == dtype, lambda: f"prims.where expects values of one dtype, but got {dtype} and {v.dtype}",
              TypeError)
    return TensorProxy(shape=shape, device=device, dtype=dtype,
                       requires_grad=any(v.requires_grad for v in values))


def _torch_where(pred, a, b):
    return torch.where(pred, a, b)


where = make_prim(PrimIDs.WHERE, "where", meta=_where_meta, torch_impl=_torch_where,
                  tags=(OpTags.ELEMENTWISE,), doc="a where pred is true, else b.")

