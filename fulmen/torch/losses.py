"""Torch language: the losses of torch.nn.functional.

Each loss follows ATen's definition, including its corner cases: ``mean`` with class weights divides by the
summed weights of the non-ignored targets (NaN when every target is ignored), ignored targets contribute 0
even where the log-probability is infinite, binary cross entropy clamps its logs at -100, and
``cross_entropy`` with ``label_smoothing`` mixes the NLL with the (weighted) mean of the negative
log-probabilities exactly as ``cross_entropy_loss_label_smoothing`` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn import _reduction as _torch_reduction

from fulmen import clang, prims
from fulmen.core import dtypes
from fulmen.core.utils import canonicalize_dim, check
from fulmen.torch.elementwise import (
    abs,
    add,
    exp,
    log,
    log1p,
    lt,
    mul,
    ne,
    neg,
    sub,
    true_divide,
    where,
    xlogy,
)
from fulmen.torch.nn import _channel_view, _clamp, _log_softmax, _opmath, _sum, _to
from fulmen.torch.nn import logsigmoid as _logsigmoid
from fulmen.torch.reductions import vector_norm
from fulmen.torch.registry import register_function, torchsymbol

__all__ = [
    "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "kl_div", "cosine_similarity",
]


def _reduction(size_average, reduce, reduction: str) -> str:
    """The reduction string, honouring the deprecated ``size_average`` / ``reduce`` flags as torch does."""
    if size_average is not None or reduce is not None:
        reduction = _torch_reduction.legacy_get_string(size_average, reduce)
    check(reduction in ("none", "mean", "sum"), lambda: f"{reduction} is not a valid value for reduction", ValueError)
    return reduction


def _reduce(loss, reduction: str):
    """Sum or mean over every element, accumulated in float32 for float16/bfloat16 like torch's reductions."""
    if reduction == "none":
        return loss
    total = _sum(_opmath(loss), None)
    if reduction == "mean":
        total = true_divide(total, loss.numel())
    return _to(total, loss.dtype)


def _broadcast_pair(input, target):
    return clang.maybe_broadcast(input, target)


# ---------------------------------------------------------------------------------------------------------
# class-index losses


def _nll_checks(input, target, weight, n_classes, prefix=""):
    check(input.ndim >= 1, lambda: f"Expected 1 or more dimensions (got {input.ndim})", ValueError)
    check(input.ndim == 1 or input.shape[0] == target.shape[0], lambda: f"Expected input batch_size "
          f"({input.shape[0]}) to match target batch_size ({target.shape[0] if target.ndim else 0}).", ValueError)
    check(target.dtype in (torch.int64, torch.uint8), lambda: f"expected target dtype to be Long or Byte, but got "
          f"{_type_name(target.dtype)}", RuntimeError)
    if input.ndim <= 2:
        check(target.ndim <= 1, lambda: "0D or 1D target tensor expected, multi-target not supported", RuntimeError)
        check(input.ndim == 1 and target.ndim == 0 or input.ndim == 2 and target.ndim == 1,
              lambda: f"size mismatch (got input: {list(input.shape)}, target: {list(target.shape)})", RuntimeError)
    elif input.ndim == 4:
        check(target.ndim == 3, lambda: "only batches of spatial targets supported (3D tensors) but got targets of "
              f"dimension: {target.ndim}", RuntimeError)
        check(tuple(target.shape[1:]) == tuple(input.shape[2:]), lambda: f"size mismatch (got input: "
              f"{list(input.shape)} , target: {list(target.shape)}", RuntimeError)
    else:
        check(tuple(target.shape[1:]) == tuple(input.shape[2:]), lambda: f"Expected target size "
              f"{[input.shape[0], *input.shape[2:]]}, got {list(target.shape)}", RuntimeError)
    check(weight is None or (weight.ndim == 1 and weight.numel() == n_classes), lambda: f"{prefix}weight tensor should "
          f"be defined either for all {n_classes} classes or no classes but got weight tensor of shape: "
          f"{list(weight.shape)}", RuntimeError)


def _type_name(dtype) -> str:
    return {torch.int32: "Int", torch.float32: "Float", torch.float64: "Double", torch.int16: "Short",
            torch.int8: "Char", torch.bool: "Bool", torch.float16: "Half", torch.bfloat16: "BFloat16"}.get(
                dtype, str(dtype).replace("torch.", ""))


def _nll(logp, target, weight, ignore_index: int, reduction: str):
    """-weight[t] * logp[t] per target; ``mean`` divides by the summed weights of the targets not ignored."""
    class_dim = 0 if logp.ndim == 1 else 1
    target = _to(target, torch.int64)
    valid = ne(target, ignore_index)
    safe = where(valid, target, 0)  # an ignored target may be any value; never gather with it
    picked = prims.take_along_axis(logp, clang.unsqueeze(safe, class_dim), class_dim)
    picked = clang.squeeze(picked, (class_dim,))
    if weight is not None:
        w = clang.reshape(prims.take(_to(weight, logp.dtype), clang.reshape(safe, (safe.numel(),)), 0), safe.shape)
        w = where(valid, w, 0)
        loss = where(valid, neg(mul(picked, w)), 0)
    else:
        w = _to(valid, logp.dtype)
        loss = where(valid, neg(picked), 0)
    if reduction == "none":
        return loss
    total = _sum(_opmath(loss), None)
    if reduction == "mean":
        total = true_divide(total, _sum(_opmath(w), None))
    return _to(total, logp.dtype)


@torchsymbol(F.nll_loss, tags=())
def nll_loss(input, target, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
             reduction: str = "mean"):
    """Negative log likelihood of class-index targets; input (C,), (N, C) or (N, C, d1, ...)."""
    reduction = _reduction(size_average, reduce, reduction)
    n_classes = input.shape[0 if input.ndim == 1 else 1] if input.ndim else 0
    _nll_checks(input, target, weight, n_classes)
    return _nll(input, target, weight, ignore_index, reduction)


def _smoothing_term(logp, target, weight, ignore_index: int, reduction: str):
    """The label-smoothing part of cross entropy: -(weighted) sum of log-probabilities, reduced like torch."""
    class_dim = 0 if logp.ndim == 1 else 1
    x = _opmath(logp)
    if weight is not None:
        x = mul(x, _channel_view(_opmath(weight), logp.ndim, class_dim))
    smooth = neg(_sum(x, class_dim))
    target = _to(target, torch.int64)
    valid = ne(target, ignore_index)
    smooth = where(valid, smooth, 0)
    if reduction == "none":
        return smooth
    total = _sum(smooth, None)
    if reduction == "sum":
        return total
    if weight is not None:
        safe = where(valid, target, 0)
        w = clang.reshape(prims.take(_opmath(weight), clang.reshape(safe, (safe.numel(),)), 0), safe.shape)
        return true_divide(total, _sum(where(valid, w, 0), None))
    return true_divide(total, _sum(_to(valid, x.dtype), None))


def _cross_entropy_probabilities(logp, target, weight, reduction: str, label_smoothing: float, n_classes: int):
    class_dim = 0 if logp.ndim == 1 else 1
    if label_smoothing > 0:
        target = add(mul(target, 1 - label_smoothing), label_smoothing / n_classes)
    prod_ = mul(logp, target)
    if weight is not None:
        prod_ = mul(prod_, _channel_view(weight, logp.ndim, class_dim))
    if reduction == "none":
        return neg(_to(_sum(_opmath(prod_), class_dim), prod_.dtype))
    total = neg(_to(_sum(_opmath(prod_), None), prod_.dtype))
    if reduction == "sum":
        return total
    # torch divides by the batch size (numel / classes); an empty input gives NaN
    return true_divide(total, logp.numel() // n_classes) if logp.numel() else mul(total, float("nan"))


@torchsymbol(F.cross_entropy, id="torch.nn.functional.cross_entropy", tags=())
def cross_entropy(input, target, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
                  reduction: str = "mean", label_smoothing: float = 0.0):
    """log_softmax over the class dim, then NLL of class indices or cross entropy with class probabilities.

    Input (C,), (N, C) or (N, C, d1, ...); a target of the input's shape holds class probabilities.
    """
    reduction = _reduction(size_average, reduce, reduction)
    check(dtypes.is_inexact_dtype(input.dtype), lambda: '"log_softmax_lastdim_kernel_impl" not implemented for '
          f"'{_type_name(input.dtype) if input.dtype is not torch.int64 else 'Long'}'", NotImplementedError)
    class_dim = 0 if input.ndim == 1 else 1
    n_classes = input.shape[class_dim] if input.ndim else 1
    if tuple(input.shape) == tuple(target.shape):
        check(dtypes.is_float_dtype(target.dtype), lambda: f"Expected floating point type for target with class "
              f"probabilities, got {'Long' if target.dtype is torch.int64 else _type_name(target.dtype)}", RuntimeError)
        check(ignore_index < 0, lambda: "ignore_index is not supported for floating point target", RuntimeError)
        check(weight is None or (weight.ndim == 1 and weight.numel() == n_classes), lambda: f"cross_entropy: weight "
              f"tensor should be defined either for all {n_classes} classes or no classes but got weight tensor of "
              f"shape: {list(weight.shape)}", RuntimeError)
        check(0.0 <= label_smoothing <= 1.0, lambda: f"label_smoothing must be between 0.0 and 1.0. Got: "
              f"{label_smoothing}", RuntimeError)
        logp = _to(_log_softmax(_opmath(input), class_dim), input.dtype)
        return _cross_entropy_probabilities(logp, target, weight, reduction, label_smoothing, n_classes)
    check(label_smoothing <= 1.0, lambda: f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}",
          RuntimeError)
    _nll_checks(input, target, weight, n_classes)
    logp = _to(_log_softmax(_opmath(input), class_dim), input.dtype)
    nll = _nll(logp, target, weight, ignore_index, reduction)
    if label_smoothing <= 0:
        return nll
    smooth = _smoothing_term(logp, target, weight, ignore_index, reduction)
    out = add(mul(_opmath(nll), 1 - label_smoothing), mul(smooth, label_smoothing / n_classes))
    return _to(out, nll.dtype)


# ---------------------------------------------------------------------------------------------------------
# regression losses


def _check_weight_size(weight, input):
    check(tuple(weight.shape) == tuple(input.shape), lambda: "Weights and input must have the same size.", ValueError)


def _elementwise_loss(input, target, fn):
    """fn(input, target) in float32 for half/bfloat16, rounded to the promoted dtype, as ATen's loss kernels do."""
    input, target = _broadcast_pair(input, target)
    dtype = clang.result_dtype(input, target)
    return _to(fn(_opmath(_to(input, dtype)), _opmath(_to(target, dtype))), dtype)


def _weighted(loss, weight, reduction: str, mean_by_weight: bool):
    loss = mul(loss, weight)
    if reduction == "mean" and mean_by_weight:
        return true_divide(_reduce(loss, "sum"), _reduce(weight, "sum"))
    return _reduce(loss, reduction)


@torchsymbol(F.mse_loss, tags=())
def mse_loss(input, target, size_average=None, reduce=None, reduction: str = "mean", weight=None):
    """(input - target)^2, reduced; with ``weight``, ``mean`` is sum(w * err) / sum(w)."""
    reduction = _reduction(size_average, reduce, reduction)
    if weight is not None:
        _check_weight_size(weight, input)
    loss = _elementwise_loss(input, target, lambda a, b: mul(sub(a, b), sub(a, b)))
    return _reduce(loss, reduction) if weight is None else _weighted(loss, weight, reduction, True)


@torchsymbol(F.l1_loss, tags=())
def l1_loss(input, target, size_average=None, reduce=None, reduction: str = "mean", weight=None):
    """|input - target|, reduced; with ``weight``, ``mean`` is sum(w * err) / sum(w)."""
    reduction = _reduction(size_average, reduce, reduction)
    if weight is not None:
        _check_weight_size(weight, input)
    loss = _elementwise_loss(input, target, lambda a, b: abs(sub(a, b)))
    return _reduce(loss, reduction) if weight is None else _weighted(loss, weight, reduction, True)


def _l1_loss_entry(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    # torch's F.l1_loss forwards every argument to __torch_function__ except ``weight``; read it from the
    # caller's F.l1_loss frame so a weighted call is not silently traced unweighted. (A torch function mode may
    # have re-called F.l1_loss without it in between, so look past frames whose weight is None.)
    if weight is None:
        import sys

        frame = sys._getframe(1)
        while frame is not None and weight is None:
            if frame.f_code is F.l1_loss.__code__ and frame.f_locals.get("input") is input:
                weight = frame.f_locals.get("weight")
            frame = frame.f_back
    return l1_loss(input, target, size_average, reduce, reduction, weight)


register_function((F.l1_loss,), _l1_loss_entry)


@torchsymbol(F.smooth_l1_loss, tags=())
def smooth_l1_loss(input, target, size_average=None, reduce=None, reduction: str = "mean", beta: float = 1.0):
    """0.5 z^2 / beta where z = |input - target| < beta, else z - 0.5 beta; beta = 0 is the L1 loss."""
    reduction = _reduction(size_average, reduce, reduction)
    check(beta >= 0, lambda: "smooth_l1_loss does not support negative values for beta.", RuntimeError)
    if beta == 0:
        return l1_loss(input, target, reduction=reduction)

    def fn(a, b):
        z = abs(sub(a, b))
        return where(lt(z, beta), true_divide(mul(mul(z, 0.5), z), beta), sub(z, 0.5 * beta))

    return _reduce(_elementwise_loss(input, target, fn), reduction)


@torchsymbol(F.huber_loss, tags=())
def huber_loss(input, target, reduction: str = "mean", delta: float = 1.0, weight=None):
    """0.5 z^2 where z = |input - target| < delta, else delta (z - 0.5 delta); ``weight`` scales before the mean."""
    reduction = _reduction(None, None, reduction)
    check(delta > 0, lambda: "huber_loss does not support non-positive values for delta.", RuntimeError)
    if weight is not None:
        _check_weight_size(weight, input)

    def fn(a, b):
        z = abs(sub(a, b))
        return where(lt(z, delta), mul(mul(z, 0.5), z), mul(sub(z, 0.5 * delta), delta))

    loss = _elementwise_loss(input, target, fn)
    return _reduce(loss, reduction) if weight is None else _weighted(loss, weight, reduction, False)


# ---------------------------------------------------------------------------------------------------------
# binary and distribution losses


@torchsymbol(F.binary_cross_entropy, tags=())
def binary_cross_entropy(input, target, weight=None, size_average=None, reduce=None, reduction: str = "mean"):
    """-(t log x + (1 - t) log(1 - x)) with both logs clamped at -100, as torch does."""
    reduction = _reduction(size_average, reduce, reduction)
    check(tuple(target.shape) == tuple(input.shape), lambda: f"Using a target size ({target.shape}) that is different "
          f"to the input size ({input.shape}) is deprecated. Please ensure they have the same size.", ValueError)

    def fn(x, t):
        return sub(mul(sub(t, 1), _clamp(log1p(neg(x)), -100.0)), mul(t, _clamp(log(x), -100.0)))

    loss = _elementwise_loss(input, target, fn)
    if weight is not None:
        loss = mul(loss, clang.expand_to(weight, clang.broadcast_shapes(target.shape, weight.shape)))
    return _reduce(loss, reduction)


@torchsymbol(F.binary_cross_entropy_with_logits, tags=())
def binary_cross_entropy_with_logits(input, target, weight=None, size_average=None, reduce=None,
                                     reduction: str = "mean", pos_weight=None):
    """(1 - t) x - log_weight * logsigmoid(x), with log_weight = 1 + (pos_weight - 1) t: stable for any x."""
    reduction = _reduction(size_average, reduce, reduction)
    check(tuple(target.shape) == tuple(input.shape), lambda: f"Target size ({target.shape}) must be the same as input "
          f"size ({input.shape})", ValueError)
    log_sig = _logsigmoid(input)
    if pos_weight is not None:
        log_sig = mul(log_sig, add(mul(sub(pos_weight, 1), target), 1))
    loss = sub(mul(sub(1, target), input), log_sig)
    if weight is not None:
        loss = mul(loss, weight)
    return _reduce(loss, reduction)


@torchsymbol(F.kl_div, tags=())
def kl_div(input, target, size_average=None, reduce=None, reduction: str = "mean", log_target: bool = False):
    """target * (log(target) - input) (or with log-space targets); ``batchmean`` divides the sum by the batch."""
    batchmean = reduction == "batchmean" and size_average is None and reduce is None
    reduction = _reduction(size_average, reduce, "sum" if batchmean else reduction)
    if log_target:
        loss = mul(exp(target), sub(target, input))
    else:
        loss = sub(xlogy(target, target), mul(target, input))
    out = _reduce(loss, reduction)
    return true_divide(out, input.shape[0]) if batchmean and input.ndim else out


@torchsymbol(torch.cosine_similarity, F.cosine_similarity, tags=())
def cosine_similarity(x1, x2, dim: int = 1, eps: float = 1e-8):
    """sum((x1 / max(||x1||, eps)) * (x2 / max(||x2||, eps))) along dim; normalizing first keeps it in [-1, 1]."""
    dtype = clang.result_dtype(x1, x2)
    if dtypes.is_exact_dtype(dtype):
        dtype = torch.get_default_dtype()
    x1, x2 = clang.maybe_broadcast(_to(x1, dtype), _to(x2, dtype))
    d = canonicalize_dim(x1.ndim, dim)

    def normed(x):
        norm = vector_norm(x, 2, (d,), keepdim=True)  # its gradient is eager's, 0 where the norm is 0
        return true_divide(x, clang.expand_to(_clamp(norm, eps), x.shape))

    return _to(_sum(_opmath(mul(normed(x1), normed(x2))), d), dtype)

