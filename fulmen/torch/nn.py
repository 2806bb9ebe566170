"""Torch language: torch.nn.functional activations, normalization, embedding, one_hot and dropout.

Convolution, pooling and interpolation live in ``nn_conv.py`` (re-exported from here), losses in
``losses.py``, attention in ``attention.py``. The private helpers below (``_sum``, ``_log_softmax``,
``_opmath``...) are built on prims and clang only, so these files do not depend on the reductions module.

Numerics follow PyTorch's kernels: float16/bfloat16 inputs are computed in float32 and rounded once at
the end (``_opmath``), normalization statistics are biased (``correction=0``), and the running statistics of
``batch_norm`` use the unbiased variance. Ops with an ``inplace=`` flag are one functional symbol plus a
plain entry function that calls ``fulmen.torch.inplace.mutate`` when ``inplace=True``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from fulmen import clang, prims
from fulmen.core import dtypes
from fulmen.core.proxies import DataDependentError, TensorProxy, _user_location
from fulmen.core.symbol import OpTags
from fulmen.core.utils import canonicalize_dim, check, prod
from fulmen.torch.elementwise import (
    abs,
    add,
    eq,
    erf,
    exp,
    expm1,
    ge,
    gt,
    le,
    log,
    log1p,
    logical_and,
    mul,
    neg,
    rsqrt,
    sigmoid,
    sub,
    tanh,
    true_divide,
    where,
)
from fulmen.torch.inplace import mutate
from fulmen.torch.reductions import vector_norm
from fulmen.torch.registry import register_function, torchsymbol
from fulmen.torch.shape import detach
from fulmen.torch.views import bernoulli_like, dense, laid_out_as_kernel

__all__ = [
    # activations
    "relu", "relu6", "gelu", "silu", "softplus", "leaky_relu", "elu", "selu", "celu", "hardswish", "hardsigmoid",
    "hardtanh", "mish", "logsigmoid", "softsign", "tanhshrink", "softshrink", "hardshrink", "threshold", "glu",
    "prelu",
    # normalization
    "layer_norm", "rms_norm", "group_norm", "batch_norm", "batch_norm_with_update", "instance_norm", "normalize",
    # one_hot, dropout (embedding: fulmen/torch/embedding.py)
    "one_hot", "dropout", "feature_dropout",
]

_EW = (OpTags.ELEMENTWISE,)

# ---------------------------------------------------------------------------------------------------------
# private helpers shared with losses.py and attention.py (they must not depend on reductions.py or linalg.py)


def _opmath(a: TensorProxy) -> TensorProxy:
    """float32 for float16/bfloat16 tensors (torch's opmath type), the tensor itself otherwise."""
    return clang.maybe_convert_to_dtype(a, torch.float32) if dtypes.is_low_precision_dtype(a.dtype) else a


def _to(a, dtype: torch.dtype):
    return clang.maybe_convert_to_dtype(a, dtype)


def _dims(ndim: int, dims) -> tuple[int, ...]:
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted({canonicalize_dim(ndim, d) for d in dims}))


def _keepdim(out: TensorProxy, shape: Sequence[int], dims: Sequence[int]) -> TensorProxy:
    """Give a reduction result its reduced dims back as length 1 (``keepdim=True``)."""
    kept = tuple(i for i in range(len(shape)) if i not in dims)
    return prims.broadcast_in_dim(out, tuple(1 if i in dims else s for i, s in enumerate(shape)), kept)


def _sum(a: TensorProxy, dims, keepdim: bool = False) -> TensorProxy:
    """Sum in a's dtype (callers upcast first); ``dims=None`` reduces every dim."""
    dims = tuple(range(a.ndim)) if dims is None else _dims(a.ndim, dims)
    out = prims.sum(a, dims)
    return _keepdim(out, a.shape, dims) if keepdim else out


def _mean(a: TensorProxy, dims, keepdim: bool = False) -> TensorProxy:
    dims_ = tuple(range(a.ndim)) if dims is None else _dims(a.ndim, dims)
    n = prod(a.shape[d] for d in dims_)
    return true_divide(_sum(a, dims_, keepdim), n)


def _amax(a: TensorProxy, dims, keepdim: bool = False) -> TensorProxy:
    dims = tuple(range(a.ndim)) if dims is None else _dims(a.ndim, dims)
    out = prims.amax(a, dims)
    return _keepdim(out, a.shape, dims) if keepdim else out


def _var_mean(a: TensorProxy, dims, correction: int = 0, keepdim: bool = True) -> tuple[TensorProxy, TensorProxy]:
    dims = _dims(a.ndim, dims)
    var, mean = prims.var_mean(a, dims, correction=correction)
    if keepdim:
        var, mean = _keepdim(var, a.shape, dims), _keepdim(mean, a.shape, dims)
    return var, mean


def _softmax(a: TensorProxy, dim: int) -> TensorProxy:
    """exp(a - max) / sum, in a's dtype (callers upcast low precision first)."""
    e = exp(sub(a, _amax(a, dim, keepdim=True)))
    return true_divide(e, _sum(e, dim, keepdim=True))


def _log_softmax(a: TensorProxy, dim: int) -> TensorProxy:
    """(a - max) - log(sum(exp(a - max))), as torch's CPU and CUDA kernels compute it."""
    shifted = sub(a, _amax(a, dim, keepdim=True))
    return sub(shifted, log(_sum(exp(shifted), dim, keepdim=True)))


def _clamp(a, lo=None, hi=None):
    """min(max(a, lo), hi) against Python numbers, NaN-propagating, straight to prims: ``torch.maximum`` refuses
    numbers, so an ltorch.maximum(a, 0.5) subsymbol could not run as one torch call once this op is decomposed."""
    if lo is not None:
        a = clang.elementwise_binary(a, lo, prims.maximum, clang.TypePromotion.NO_OPMATH)
    if hi is not None:
        a = clang.elementwise_binary(a, hi, prims.minimum, clang.TypePromotion.NO_OPMATH)
    return a


def _channel_view(t: TensorProxy, ndim: int, channel_dim: int = 1) -> TensorProxy:
    """A 1-D per-channel tensor broadcast-ready against an ``ndim``-dim input (shape 1 everywhere else)."""
    shape = [1] * ndim
    shape[channel_dim] = t.shape[0] if t.ndim else 1
    return prims.broadcast_in_dim(t, tuple(shape), (channel_dim,) if t.ndim else ())


def _check_floating(a: TensorProxy, kernel: str) -> None:
    check(dtypes.is_inexact_dtype(a.dtype), lambda: f'"{kernel}" not implemented for '
          f"'{str(a.dtype).replace('torch.', '').capitalize().replace('Int64', 'Long')}'", NotImplementedError)


def _in_opmath(fn: Callable) -> Callable:
    """Compute ``fn`` in float32 for float16/bfloat16 inputs and round once, as torch's activation kernels do."""

    @functools.wraps(fn)
    def wrapper(input, *args, **kwargs):
        check(isinstance(input, TensorProxy), lambda: f"{fn.__name__}(): argument 'input' must be Tensor, not "
              f"{type(input).__name__}", TypeError)
        return _to(fn(_opmath(input), *args, **kwargs), input.dtype)

    return wrapper


def _inplace_forms(sym, functional_fns: Sequence[Callable] = (), inplace_fns: Sequence[Callable] = (),
                   method_name: str | None = None) -> None:
    """Route ``F.op(x, ..., inplace=...)`` and ``op_(x, ...)`` to ``sym`` plus ``mutate`` (x becomes the result)."""

    def functional(input, *args, inplace: bool = False, **kwargs):
        out = sym(input, *args, **kwargs)
        return mutate(input, out) if inplace else out

    def inplace(input, *args, **kwargs):
        return mutate(input, sym(input, *args, **kwargs))

    functional.__name__, inplace.__name__ = sym.name, sym.name + "_"
    if functional_fns:
        register_function(functional_fns, functional)
    if inplace_fns or method_name:
        register_function(inplace_fns, inplace, method_names=[method_name] if method_name else [])


def _torch_fns(*names: str, module=torch) -> tuple:
    return tuple(getattr(module, n) for n in names if hasattr(module, n))


# ---------------------------------------------------------------------------------------------------------
# activations


@torchsymbol(F.relu, torch.relu, torch.Tensor.relu, method_name="relu", tags=_EW)
def relu(input):
    """max(x, 0); NaN stays NaN."""
    return where(le(input, 0), 0, input)


_inplace_forms(relu, (F.relu,), _torch_fns("relu_") + (torch.Tensor.relu_,), "relu_")


@torchsymbol(F.hardtanh, tags=_EW)
def hardtanh(input, min_val: float = -1.0, max_val: float = 1.0):
    check(min_val <= max_val, lambda: "min_val cannot be greater than max_val", ValueError)
    return _clamp(input, min_val, max_val)


_inplace_forms(hardtanh, (F.hardtanh,), (F.hardtanh_,))


@torchsymbol(F.relu6, tags=_EW)
def relu6(input):
    return hardtanh(input, 0.0, 6.0)


_inplace_forms(relu6, (F.relu6,))


@torchsymbol(F.gelu, tags=_EW)
def gelu(input, approximate: str = "none"):
    """Exact ``x * Phi(x)`` with erf, or the tanh approximation."""
    check(approximate in ("none", "tanh"), lambda: "approximate argument must be either none or tanh.", RuntimeError)
    _check_floating(input, "GeluKernelImpl")
    return _gelu(input, approximate)


@_in_opmath
def _gelu(x, approximate):
    if approximate == "tanh":
        inner = mul(0.7978845608028654, add(x, mul(0.044715, mul(x, mul(x, x)))))
        return mul(mul(0.5, x), add(1, tanh(inner)))
    return mul(mul(x, 0.5), add(1, erf(mul(x, 0.7071067811865476))))


@torchsymbol(F.silu, tags=_EW)
@_in_opmath
def silu(input):
    """x / (1 + exp(-x)), the form torch's kernel uses."""
    return true_divide(input, add(1, exp(neg(input))))


_inplace_forms(silu, (F.silu,))


@torchsymbol(F.softplus, tags=_EW)
@_in_opmath
def softplus(input, beta: float = 1.0, threshold: float = 20.0):
    """log(1 + exp(beta x)) / beta, and x itself where beta x > threshold (where the log would lose it)."""
    scaled = mul(input, beta)
    linear = gt(scaled, threshold)
    # the log branch sees 0 where it is not taken: exp(inf) there would give its gradient inf / inf = NaN, which
    # where's gradient (0 times it) keeps; eager's softplus_backward is the input's gradient there
    safe = where(linear, 0.0, scaled)
    return where(linear, input, true_divide(log1p(exp(safe)), beta))


@torchsymbol(F.leaky_relu, tags=_EW)
def leaky_relu(input, negative_slope: float = 0.01):
    return where(gt(input, 0), input, mul(input, negative_slope))


_inplace_forms(leaky_relu, (F.leaky_relu,), (F.leaky_relu_,))


@_in_opmath
def _elu(x, alpha, scale=1.0, input_scale=1.0):
    negative = mul(expm1(mul(x, input_scale) if input_scale != 1.0 else x), alpha * scale)
    return where(le(x, 0), negative, mul(x, scale) if scale != 1.0 else x)


@torchsymbol(F.elu, tags=_EW)
def elu(input, alpha: float = 1.0):
    return _elu(input, alpha)


_inplace_forms(elu, (F.elu,), (F.elu_,))

_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


@torchsymbol(F.selu, torch.selu, tags=_EW)
def selu(input):
    return _elu(input, _SELU_ALPHA, _SELU_SCALE)


_inplace_forms(selu, (F.selu,), _torch_fns("selu_"))


@torchsymbol(F.celu, torch.celu, tags=_EW)
def celu(input, alpha: float = 1.0):
    check(alpha != 0, lambda: "ZeroDivisionError: alpha cannot be 0 for CELU", RuntimeError)
    return _elu(input, alpha, 1.0, 1.0 / alpha)


_inplace_forms(celu, (F.celu,), _torch_fns("celu_"))


@torchsymbol(F.hardsigmoid, tags=_EW)
@_in_opmath
def hardsigmoid(input):
    return true_divide(_clamp(add(input, 3), 0, 6), 6)


_inplace_forms(hardsigmoid, (F.hardsigmoid,))


@torchsymbol(F.hardswish, tags=_EW)
@_in_opmath
def hardswish(input):
    return true_divide(mul(input, _clamp(add(input, 3), 0, 6)), 6)


_inplace_forms(hardswish, (F.hardswish,))


@torchsymbol(F.mish, tags=_EW)
@_in_opmath
def mish(input):
    """x * tanh(log1p(exp(x))); unlike softplus, torch's mish has no threshold."""
    return mul(input, tanh(log1p(exp(input))))


_inplace_forms(mish, (F.mish,))


@torchsymbol(F.logsigmoid, tags=_EW)
@_in_opmath
def logsigmoid(input):
    """min(x, 0) - log1p(exp(-|x|)): finite for large |x|."""
    return sub(_clamp(input, hi=0), log1p(exp(neg(abs(input)))))


@torchsymbol(F.softsign, tags=_EW)
def softsign(input):
    """x / (|x| + 1), op by op in the input dtype as torch's Python definition does."""
    return true_divide(input, add(abs(input), 1))


@torchsymbol(F.tanhshrink, tags=_EW)
def tanhshrink(input):
    return sub(input, tanh(input))


@torchsymbol(F.softshrink, tags=_EW)
def softshrink(input, lambd: float = 0.5):
    check(lambd >= 0, lambda: f"lambda must be in range [0, {torch.finfo(input.dtype).max:g}] for input dtype "
          f"{str(input.dtype).replace('torch.', '').capitalize()}, but found {lambd}", RuntimeError)
    # NaN fails the first test and falls through to x + lambd, staying NaN as in torch
    return where(le(abs(input), lambd), 0, where(gt(input, 0), sub(input, lambd), add(input, lambd)))


@torchsymbol(F.hardshrink, torch.Tensor.hardshrink, method_name="hardshrink", tags=_EW)
def hardshrink(input, lambd: float = 0.5):
    return where(logical_and(le(input, lambd), ge(input, -lambd)), 0, input)


@torchsymbol(F.threshold, torch.threshold, id="torch.nn.functional.threshold", tags=_EW)
def threshold(input, threshold: float, value: float):
    """``value`` where x <= threshold, else x."""
    return where(le(input, threshold), value, input)


_inplace_forms(threshold, (F.threshold,), _torch_fns("threshold_"))


@torchsymbol(F.glu, tags=_EW)
def glu(input, dim: int = -1):
    """First half times sigmoid of the second half along ``dim``."""
    check(input.ndim > 0, lambda: "glu does not support scalars because halving size must be even", RuntimeError)
    d = canonicalize_dim(input.ndim, dim)
    n = input.shape[d]
    check(n % 2 == 0, lambda: f"Halving dimension must be even, but dimension {d} is size {n}", RuntimeError)
    x = _opmath(input)
    a, b = clang.slice_in_dim(x, 0, n // 2, 1, d), clang.slice_in_dim(x, n // 2, n, 1, d)
    return _to(mul(a, sigmoid(b)), input.dtype)


@torchsymbol(torch.prelu, torch.Tensor.prelu, F.prelu, method_name="prelu", tags=_EW)
def prelu(input, weight):
    """x where x > 0, else weight * x with one weight per channel (dim 1) or one for all."""
    check(weight.ndim <= 1, lambda: f"prelu: Expected `weight` to be a scalar or 1D tensor, but got: ndim = "
          f"{weight.ndim}", RuntimeError)
    if weight.numel() != 1:
        channels = input.shape[1] if input.ndim > 1 else 1
        check(channels == weight.numel(), lambda: f"Mismatch of parameter numbers and input channel size. Found "
              f"parameter numbers = {weight.numel()} and channel size = {channels}.", RuntimeError)
        w = _channel_view(weight, input.ndim)
    else:
        w = clang.reshape(weight, ())
    return where(gt(input, 0), input, mul(w, input))


# ---------------------------------------------------------------------------------------------------------
# normalization


def _normalized_dims(input, normalized_shape, what: str = "") -> tuple[int, ...]:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    k = len(shape)
    ok = 0 < k <= input.ndim and tuple(input.shape[input.ndim - k:]) == shape
    star = "*" if what == "rms" else "*, "
    check(ok, lambda: f"Given normalized_shape={list(shape)}, expected input with shape [{star}"
          f"{', '.join(str(s) for s in shape)}], but got input of size{list(input.shape)}", RuntimeError)
    return tuple(range(input.ndim - k, input.ndim))


def _check_affine(t, shape, what):
    if t is not None:
        check(tuple(t.shape) == tuple(shape), lambda: f"Expected {what} to be of same shape as normalized_shape, "
              f"but got {what} of shape {list(t.shape)} and normalized_shape = {list(shape)}", RuntimeError)


@torchsymbol(F.layer_norm, tags=())
def layer_norm(input, normalized_shape, weight=None, bias=None, eps: float = 1e-5):
    """(x - mean) / sqrt(var + eps) over the trailing ``normalized_shape`` dims, then weight and bias."""
    dims = _normalized_dims(input, normalized_shape)
    shape = tuple(input.shape[dims[0]:])
    _check_affine(weight, shape, "weight")
    _check_affine(bias, shape, "bias")
    x = _opmath(input)
    var, mean = _var_mean(x, dims)
    out = mul(sub(x, mean), rsqrt(add(var, eps)))
    if weight is not None:
        out = mul(out, _opmath(weight))
    if bias is not None:
        out = add(out, _opmath(bias))
    return _to(out, input.dtype)


@torchsymbol(F.rms_norm, torch.rms_norm, tags=())
def rms_norm(input, normalized_shape, weight=None, eps: float | None = None):
    """x / sqrt(mean(x^2) + eps) * weight; ``eps=None`` is the epsilon of the computation dtype (float32 for
    float16/bfloat16 inputs), as torch uses."""
    dims = _normalized_dims(input, normalized_shape, "rms")
    x = _opmath(input)
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    out = mul(x, rsqrt(add(_mean(mul(x, x), dims, keepdim=True), eps)))
    if weight is not None:
        out = mul(out, _opmath(weight))
    return _to(out, input.dtype)


register_function((torch.layer_norm,), lambda input, normalized_shape, weight=None, bias=None, eps=1e-5,
                  cudnn_enable=True: layer_norm(input, normalized_shape, weight, bias, eps))


def _verify_batch_size(size) -> None:
    n = size[0] * prod(size[2:])
    check(n != 1, lambda: f"Expected more than 1 value per channel when training, got input size {size}", ValueError)


@torchsymbol(F.group_norm, tags=())
def group_norm(input, num_groups: int, weight=None, bias=None, eps: float = 1e-5):
    """Normalize each of ``num_groups`` groups of channels over the group's channels and all spatial dims."""
    check(input.ndim >= 2, lambda: f"Expected at least 2 dimensions for input tensor but received {input.ndim}",
          RuntimeError)
    n, c = input.shape[0], input.shape[1]
    check(num_groups > 0 and c % num_groups == 0, lambda: f"Expected number of channels in input to be divisible by "
          f"num_groups, but got input of shape {list(input.shape)} and num_groups={num_groups}", RuntimeError)
    _verify_batch_size(torch.Size([n * c // num_groups, num_groups, *input.shape[2:]]))
    for t, what in ((weight, "weight"), (bias, "bias")):
        check(t is None or (t.ndim == 1 and t.shape[0] == c), lambda: f"Expected {what} to be a vector of size equal "
              f"to the number of channels in input, but got {what} of shape {list(t.shape)} and input of shape "
              f"{list(input.shape)}", RuntimeError)
    x = _opmath(input)
    grouped = clang.reshape(x, (n, num_groups, prod(input.shape[1:]) // num_groups))
    var, mean = _var_mean(grouped, 2)
    out = clang.reshape(mul(sub(grouped, mean), rsqrt(add(var, eps))), input.shape)
    if weight is not None:
        out = mul(out, _channel_view(_opmath(weight), input.ndim))
    if bias is not None:
        out = add(out, _channel_view(_opmath(bias), input.ndim))
    return _to(out, input.dtype)


register_function((torch.group_norm,), lambda input, num_groups, weight=None, bias=None, eps=1e-5,
                  cudnn_enabled=True: group_norm(input, num_groups, weight, bias, eps))


def _batch_norm_checks(input, running_mean, running_var, weight, bias, training):
    check(input.ndim >= 2, lambda: f"batch_norm: expected 2D or more input, got {input.ndim}D", ValueError)
    c = input.shape[1]
    if training:
        _verify_batch_size(input.shape)
    else:
        check(running_mean is not None, lambda: "running_mean must be defined in evaluation mode", RuntimeError)
        check(running_var is not None, lambda: "running_var must be defined in evaluation mode", RuntimeError)
    for t, what in ((weight, "weight"), (bias, "bias"), (running_mean, "running_mean"), (running_var, "running_var")):
        check(t is None or t.numel() == c, lambda: f"{what} should contain {c} elements not {t.numel()}", RuntimeError)


def _batch_norm_decomposition(input, running_mean, running_var, weight, bias, training, eps):
    """(output, batch mean, biased batch variance) in the computation dtype; statistics are None in eval mode."""
    x = _opmath(input)
    dims = (0, *range(2, input.ndim))
    if training:
        var, mean = prims.var_mean(x, dims, correction=0)
    else:
        var, mean = _opmath(running_var), _opmath(running_mean)
    scale = rsqrt(add(var, eps))
    out = mul(sub(x, _channel_view(mean, input.ndim)), _channel_view(scale, input.ndim))
    if weight is not None:
        out = mul(out, _channel_view(_opmath(weight), input.ndim))
    if bias is not None:
        out = add(out, _channel_view(_opmath(bias), input.ndim))
    return laid_out_as_kernel(_to(out, input.dtype), input, (F.batch_norm,)), *((mean, var) if training else [None] * 2)


@torchsymbol(F.batch_norm, tags=())
def _batch_norm(input, running_mean, running_var, weight=None, bias=None, training: bool = False,
                momentum: float = 0.1, eps: float = 1e-5):
    """Functional batch norm: batch statistics when training, running statistics otherwise; never updates."""
    _batch_norm_checks(input, running_mean, running_var, weight, bias, training)
    check(not (training and (running_mean is not None or running_var is not None)),
          lambda: "ltorch batch_norm with training=True does not update running statistics; call "
          "torch.nn.functional.batch_norm (or ltorch.batch_norm), which records batch_norm_with_update", RuntimeError)
    return _batch_norm_decomposition(input, running_mean, running_var, weight, bias, training, eps)[0]


_batch_norm.name = "batch_norm"  # printed so: for the arguments it accepts, the public entry below computes the same


def _eager_batch_norm_with_update(input, running_mean, running_var, weight, bias, momentum, eps):
    out, _, _, new_mean, new_var = torch.ops.aten._native_batch_norm_legit_functional(
        input, weight, bias, running_mean, running_var, True, momentum, eps)
    return out, new_mean, new_var


@torchsymbol(_eager_batch_norm_with_update, id="ltorch.batch_norm_with_update", tags=())
def batch_norm_with_update(input, running_mean, running_var, weight, bias, momentum: float, eps: float):
    """Training-mode batch norm that also returns the new running mean and variance (unbiased), functionally.

    ``F.batch_norm(..., training=True)`` records this and writes the new statistics into the running-stat
    tensors with ``mutate``, so the caller's buffers change exactly as in eager.
    """
    _batch_norm_checks(input, running_mean, running_var, weight, bias, True)
    out, mean, var = _batch_norm_decomposition(input, running_mean, running_var, weight, bias, True, eps)
    n = input.numel() // input.shape[1]
    # torch updates as momentum * batch_stat + (1 - momentum) * running_stat in the statistics' dtype, without autograd
    unbiased, mean = mul(detach(var), n / (n - 1)), detach(mean)
    new_mean = add(mul(_to(mean, running_mean.dtype), momentum), mul(running_mean, 1 - momentum))
    new_var = add(mul(_to(unbiased, running_var.dtype), momentum), mul(running_var, 1 - momentum))
    return out, new_mean, new_var


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5):
    """``torch.nn.functional.batch_norm``: in training mode the running statistics are updated in place.

    The update is recorded functionally (``batch_norm_with_update``) and the new values replace the
    running-stat tensors through ``mutate``, so ``nn.BatchNorm*`` buffers change as in eager.
    """
    if isinstance(input, TensorProxy) and input.ndim == 1:
        return _batch_norm_1d(input, running_mean, running_var, weight, bias)
    if training and (running_mean is not None or running_var is not None):
        check(running_mean is not None and running_var is not None,
              lambda: "batch_norm: running_mean and running_var must both be given or both be None", RuntimeError)
        out, new_mean, new_var = batch_norm_with_update(input, running_mean, running_var, weight, bias, momentum,
                                                        eps)
        mutate(running_mean, new_mean)
        mutate(running_var, new_var)
        return out
    return _batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)


def _batch_norm_1d(input, running_mean, running_var, weight, bias):
    """Eager reads a 1-D input's channel count as 0: it accepts only an empty input, with empty (or no) running
    statistics and no weight or bias, and returns a copy of it; it raises what eager raises otherwise."""
    check(input.shape[0] == 0, lambda: "Dimension out of range (expected to be in range of [-1, 0], but got 1)",
          IndexError)
    for t, what in ((running_mean, "running_mean"), (running_var, "running_var")):
        check(t is None or t.numel() == 0, lambda: f"{what} should contain 0 elements not {t.numel()}", RuntimeError)
    check(weight is None and bias is None, lambda: "select(): index 0 out of range for tensor of size [0] at "
          "dimension 0", IndexError)
    return mul(input, 1)


def _torch_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled=True):
    return batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)


register_function((F.batch_norm,), batch_norm)
register_function((torch.batch_norm,), _torch_batch_norm)


def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats: bool = True,
                  momentum: float = 0.1, eps: float = 1e-5):
    """``torch.nn.functional.instance_norm``: batch norm of each (sample, channel) over its spatial dims.

    With running statistics and ``use_input_stats``, they are updated in place with the batch average of
    the per-instance updates, as torch does.
    """
    check(input.ndim >= 3, lambda: f"instance_norm: expected 3D or more input, got {input.ndim}D", ValueError)
    if use_input_stats:
        check(prod(input.shape[2:]) != 1, lambda: f"Expected more than 1 spatial element when training, got input "
              f"size {input.shape}", ValueError)
    n, c = input.shape[0], input.shape[1]
    folded = clang.reshape(dense(input), (1, n * c, *input.shape[2:]))  # ATen views a contiguous copy

    def repeat(t):
        return None if t is None else clang.reshape(clang.expand_to(t, (n, c)), (n * c,))

    w, b = repeat(weight), repeat(bias)
    if use_input_stats and running_mean is not None and running_var is not None:
        out, new_mean, new_var = batch_norm_with_update(folded, repeat(running_mean), repeat(running_var), w, b,
                                                        momentum, eps)
        mutate(running_mean, _mean(clang.reshape(new_mean, (n, c)), 0))
        mutate(running_var, _mean(clang.reshape(new_var, (n, c)), 0))
    else:
        out = _batch_norm(folded, None if use_input_stats else repeat(running_mean),
                          None if use_input_stats else repeat(running_var), w, b, use_input_stats, momentum, eps)
    return clang.reshape(out, input.shape)


register_function((F.instance_norm,), instance_norm)


@torchsymbol(F.normalize, tags=())
def normalize(input, p: float = 2.0, dim: int = 1, eps: float = 1e-12, out=None):
    """x / max(||x||_p, eps) along ``dim``."""
    check(out is None, lambda: "F.normalize(out=...) writes into a preallocated tensor, which fulmen does not trace; "
          "assign the result instead", NotImplementedError)
    _check_floating(input, "linalg.vector_norm")
    dim = canonicalize_dim(input.ndim, dim)
    norm = vector_norm(input, p, (dim,), keepdim=True)  # its gradient is eager's, 0 where the norm is 0
    return true_divide(input, clang.expand_to(_clamp(norm, eps), input.shape))


# ---------------------------------------------------------------------------------------------------------
# one_hot

@torchsymbol(F.one_hot, tags=())
def one_hot(tensor, num_classes: int = -1):
    """int64 tensor with a trailing dim of ``num_classes``: 1 at each value's position, 0 elsewhere."""
    check(tensor.dtype is torch.int64, lambda: "one_hot is only applicable to index tensor of type LongTensor.",
          RuntimeError)
    if num_classes == -1:
        raise DataDependentError(
            "F.one_hot(t) without num_classes needs the largest value of the tensor, which is not known while "
            f"fulmen traces the program.\n  at {_user_location()}\nPass num_classes explicitly.")
    check(num_classes >= 0, lambda: "Class values must be smaller than num_classes.", RuntimeError)
    classes = prims.iota(num_classes, start=0, step=1, device=tensor.device, dtype=torch.int64)
    hit = eq(clang.unsqueeze(tensor, -1), classes)
    return _to(hit, torch.int64)


# ---------------------------------------------------------------------------------------------------------
# dropout


def _check_p(p):
    check(0.0 <= p <= 1.0, lambda: f"dropout probability has to be between 0 and 1, but got {p}", ValueError)


def _dropout_with_noise(input, p, noise_shape):
    """input * bernoulli(1 - p) / (1 - p), drawing the mask like ATen's ``_dropout_impl`` (so seeds match eager)."""
    if p == 1:
        return mul(input, clang.full((), 0, device=input.device, dtype=input.dtype))
    return mul(input, true_divide(bernoulli_like(input, 1 - p, noise_shape), 1 - p))


@torchsymbol(F.dropout, tags=(OpTags.RANDOM_OP,))
def dropout(input, p: float = 0.5, training: bool = True):
    """Zero each element with probability p and scale the rest by 1 / (1 - p); identity when not training.

    The mask is ``prims.bernoulli`` of the input's shape, drawn in the input's memory order (``bernoulli_like``): the
    same generator calls as eager, so seeded runs match bit for bit.
    """
    _check_p(p)
    if not training or p == 0 or input.numel() == 0:
        return input
    return _dropout_with_noise(input, p, input.shape)


def _dropout_entry(input, p: float = 0.5, training: bool = True, inplace: bool = False):
    _check_p(p)
    if not training or p == 0 or input.numel() == 0:
        return input
    if inplace:
        # Eager's in-place dropout draws its mask with bernoulli_ on every device, while its out-of-place dropout
        # on CUDA runs the fused native_dropout kernel, which consumes the generator differently.
        return mutate(input, _dropout_with_noise(input, p, input.shape))
    return dropout(input, p, training)


register_function((F.dropout,), _dropout_entry)
register_function(_torch_fns("dropout"), lambda input, p, train: _dropout_entry(input, p, train))
register_function(_torch_fns("dropout_"), lambda input, p, train: _dropout_entry(input, p, train, True))


@torchsymbol(torch.feature_dropout, tags=(OpTags.RANDOM_OP,))
def feature_dropout(input, p: float, train: bool):
    """Channel-wise dropout: one mask entry per (sample, channel), broadcast over the remaining dims."""
    _check_p(p)
    check(input.ndim >= 2, lambda: f"Feature dropout requires at least 2 dimensions in the input, got {input.ndim}",
          RuntimeError)
    if not train or p == 0 or input.numel() == 0:
        return input
    return _dropout_with_noise(input, p, (input.shape[0], input.shape[1]) + (1,) * (input.ndim - 2))


def _feature_dropout_entry(name: str, dims: tuple[int, int]):
    """F.dropout1d/2d/3d: torch's checks and batching rules around ``feature_dropout``."""

    def entry(input, p: float = 0.5, training: bool = True, inplace: bool = False):
        import warnings

        _check_p(p)
        if name == "dropout1d":
            check(input.ndim in dims, lambda: f"dropout1d: Expected 2D or 3D input, but received a {input.ndim}D "
                  "input.", RuntimeError)
        elif input.ndim not in dims:
            warnings.warn(f"{name}: Received a {input.ndim}-D input to {name}, which is deprecated and will result in "
                          "an error in a future release.", stacklevel=3)
        # dropout2d treats a 3-D input as batched (N, C, L); dropout1d and dropout3d add a batch dim when missing
        unbatched = name != "dropout2d" and input.ndim != dims[1]
        if not training or p == 0 or input.numel() == 0:  # the input itself, as eager returns it
            return input
        out = feature_dropout(input.unsqueeze(0) if unbatched else input, p, training)  # views keep the layout
        out = out.squeeze(0) if unbatched else out
        return mutate(input, out) if inplace else out

    entry.__name__ = name
    return entry


register_function((F.dropout1d,), _feature_dropout_entry("dropout1d", (2, 3)))
register_function((F.dropout2d,), _feature_dropout_entry("dropout2d", (3, 4)))
register_function((F.dropout3d,), _feature_dropout_entry("dropout3d", (4, 5)))

from fulmen.torch.nn_conv import *  # noqa: E402,F401,F403  (convolution, pooling, interpolation)
from fulmen.torch.nn_conv import __all__ as _conv_all  # noqa: E402

__all__ += _conv_all
