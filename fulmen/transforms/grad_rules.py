"""fulmen's own gradient rules for heavy torch operations.

Differentiating ``softmax`` or ``layer_norm`` through their decompositions works, but the forward then runs
several operations where eager runs one, and saves intermediates eager does not. The rules here make the
forward one torch call (whole, or the aten op that also returns what the backward needs, such as
``native_layer_norm``'s mean and rstd) and the backward the aten backward kernel eager itself uses. They are
written as grad transforms (``get_grad`` / ``put_grad``), keyed by torch symbol id, and may decline a call
(``NotImplemented``) they do not cover; the decomposition is then differentiated instead.

The aten operations the rules call are declared, as prims are, in ``grad_ops.py``. Each rule is an entry of
the gradient table (``grad_table.py``, source ``BUILTIN``), written there by ``builtin_rule``.
"""

from __future__ import annotations

import torch

import fulmen.torch as ltorch
from fulmen import clang, prims
from fulmen.core import dtypes
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import Symbol
from fulmen.core.utils import canonicalize_dim
from fulmen.torch.views import bernoulli_like
from fulmen.transforms.grad_ops import (
    _REDUCTIONS,
    _stats_shape,
    efficient_attention_cuda,
    efficient_attention_cuda_backward,
    efficient_attention_supported,
    elu,
    elu_backward,
    embedding,
    embedding_dense_backward,
    embedding_sparse_backward,
    flash_attention_cpu,
    flash_attention_cpu_backward,
    fused_rms_norm,
    gelu,
    gelu_backward,
    log_softmax,
    log_softmax_backward,
    native_layer_norm,
    native_layer_norm_backward,
    nll_loss_backward,
    nll_loss_forward,
    overlapping_write_error,
    relu,
    silu,
    silu_backward,
    softmax,
    softmax_backward,
    threshold_backward,
)
from fulmen.transforms.linearize import (
    RuleArgs,
    builtin_rule,
    get_grad,
    needs_grad,
    put_grad,
    put_grads,
)


def _convert(x, dtype):
    return clang.maybe_convert_to_dtype(x, dtype) if dtype is not None else x


@builtin_rule("torch.nn.functional.linear")
def _linear_rule(p: RuleArgs):
    from fulmen.transforms.autodiff import linear_vjp

    a, w, bias = p[0], p[1], p[2]
    if not all(isinstance(t, TensorProxy) and t.dtype == a.dtype for t in (a, w)) or (
            bias is not None and (not isinstance(bias, TensorProxy) or bias.dtype != a.dtype)):
        return NotImplemented
    out = prims.linear(a, w, bias)
    put_grads((a, w, bias), linear_vjp(a, w, bias, get_grad(out)))
    return out


@builtin_rule("torch.matmul")
def _matmul_rule(p: RuleArgs):
    from fulmen.transforms.autodiff import matmul_vjp

    a, b = p[0], p[1]
    if not (isinstance(a, TensorProxy) and isinstance(b, TensorProxy) and a.dtype == b.dtype):
        return NotImplemented
    out = prims.matmul(a, b)
    put_grads((a, b), matmul_vjp(a, b, get_grad(out)))
    return out


@builtin_rule("ltorch.overwritten")
def _overwritten_rule(p: RuleArgs):
    """An in-place update autograd keeps the history of (``ltorch.overwritten``): the old value gets the result's
    gradient unchanged (a write under ``no_grad``) or zeros (values that replace it), the new value its own."""
    new, old, keeps_gradient = p[0], p[1], p[2]
    out = prims.reshape(new, tuple(new.shape))
    g = get_grad(out)
    if needs_grad(old):
        put_grad(old, g if keeps_gradient else clang.full(tuple(g.shape), 0, device=g.device, dtype=g.dtype))
    if needs_grad(new) and not keeps_gradient:
        put_grad(new, g)
    return out


@builtin_rule("ltorch.overlapping_write")
def _overlapping_write_rule(p: RuleArgs):
    """A base written through a view whose elements share memory (``ltorch.overlapping_write``): eager's backward
    raises there, so the gradient that reaches it is one that raises when the backward runs."""
    new, where = p[0], p[1]
    out = prims.reshape(new, tuple(new.shape))
    if needs_grad(new):
        put_grad(new, overlapping_write_error(get_grad(out), where))
    return out


@builtin_rule("ltorch.cond_gate")
def _cond_gate_rule(p: RuleArgs):
    """A tensor as one branch of ``torch.cond`` reads it (``ltorch.cond_gate``): the cotangent where the predicate
    takes that branch, zeros where not, by selection, so non-finite values of the other branch's backward are
    dropped as eager never computes them."""
    a, taken = p[0], p[1]
    out = prims.reshape(a, tuple(a.shape))
    if needs_grad(a):
        g = get_grad(out)
        put_grad(a, clang.where(clang.expand_to(taken, tuple(g.shape)), g,
                                clang.full(tuple(g.shape), 0, device=g.device, dtype=g.dtype)))
    return out


def _pieces_rule(p: RuleArgs, *, stacked: bool = False):
    """split, chunk, tensor_split and unbind: the pieces cover the input along ``dim``, so its gradient is the
    pieces' cotangents concatenated (stacked for unbind), zeros for pieces that got none -- one ``cat``, as
    eager does, instead of a padded sum per piece."""
    a, dim = p[0], p.get("dim", 0)
    if not isinstance(a, TensorProxy) or not isinstance(dim, int) or a.ndim == 0:
        return NotImplemented
    pieces = p.bsym.sym(*p.bsym.args, **p.bsym.kwargs)
    grads = [get_grad(x) for x in pieces]
    put_grad(a, clang.stack(grads, dim) if stacked else clang.cat(grads, dim))
    return pieces


builtin_rule("torch.split", "torch.chunk", "torch.split_with_sizes", "torch.tensor_split")(_pieces_rule)
builtin_rule("torch.unbind")(lambda p: _pieces_rule(p, stacked=True))


def _normalized(shape) -> tuple[int, ...]:
    return (shape,) if isinstance(shape, int) else tuple(shape)


@builtin_rule("torch.max", "torch.min")
def _max_min_all_rule(p: RuleArgs):
    """``max(a)``/``min(a)`` over all elements split the gradient evenly among the elements equal to the result
    (among the NaNs when it is NaN), as eager's ``evenly_distribute_backward``; ``amax``'s rule would give NaN
    everywhere for a NaN result. The dim and two-tensor forms differentiate their decompositions."""
    a = p[0]
    if p[1] is not None or p.get("other") is not None or not isinstance(a, TensorProxy) \
            or not dtypes.is_float_dtype(a.dtype) or a.numel() == 0:
        return NotImplemented
    out = (prims.amax if p.bsym.sym.id == "torch.max" else prims.amin)(a, tuple(range(a.ndim)))
    if needs_grad(a):
        full = prims.broadcast_in_dim(out, tuple(a.shape), ())
        mask = ltorch.where(ltorch.isnan(full), ltorch.isnan(a), ltorch.eq(a, full))
        count = prims.sum(clang.maybe_convert_to_dtype(mask, torch.int64), tuple(range(a.ndim)))
        share = ltorch.true_divide(get_grad(out), count)
        put_grad(a, ltorch.where(mask, prims.broadcast_in_dim(share, tuple(a.shape), ()), 0.0))
    return out


def _bound_grad(cond, g, shape):
    from fulmen.transforms.autodiff import sum_to

    return sum_to(ltorch.where(cond, g, 0.0), shape)


@builtin_rule("torch.clamp", "torch.clamp_min", "torch.clamp_max")
def _clamp_rule(p: RuleArgs):
    """At a bound the input keeps its gradient (``self >= min``, ``self <= max``) and a NaN input gets none, as
    eager's ``clamp_backward``/``clamp_backward_min_max``; maximum/minimum's rule would split it at the bound."""
    sid = p.bsym.sym.id
    a = p[0]
    lo = p.get("min") if sid != "torch.clamp_max" else None
    hi = p.get("max") if sid != "torch.clamp_min" else None
    # bounds of another dtype are compared as eager compares them (after promotion); one that needs a gradient must
    # have the input's dtype (the result's, then: the gradients below are taken in it)
    if not isinstance(a, TensorProxy) or not dtypes.is_float_dtype(a.dtype) or any(
            isinstance(b, TensorProxy) and b.dtype != a.dtype and needs_grad(b) for b in (lo, hi)):
        return NotImplemented
    out = p.bsym.sym(*p.bsym.args, **p.bsym.kwargs)
    if not isinstance(out, TensorProxy) or not dtypes.is_float_dtype(out.dtype):
        return NotImplemented
    g = get_grad(out)
    if out.dtype != a.dtype:  # a bound of a wider float dtype widened the result: the input's share comes back
        g = clang.maybe_convert_to_dtype(g, a.dtype)
    ge_lo = ltorch.ge(a, lo) if lo is not None else None
    le_hi = ltorch.le(a, hi) if hi is not None else None
    inside = ge_lo if le_hi is None else le_hi if ge_lo is None else ltorch.logical_and(ge_lo, le_hi)
    if needs_grad(a):
        put_grad(a, _bound_grad(inside, g, a.shape))
    if isinstance(lo, TensorProxy) and needs_grad(lo):
        below = ltorch.lt(a, lo)
        put_grad(lo, _bound_grad(below if hi is None else ltorch.logical_and(below, ltorch.lt(lo, hi)), g, lo.shape))
    if isinstance(hi, TensorProxy) and needs_grad(hi):
        above = ltorch.gt(a, hi)
        put_grad(hi, _bound_grad(above if lo is None else ltorch.logical_or(above, ltorch.lt(hi, lo)), g, hi.shape))
    return out


@builtin_rule("torch.nn.functional.hardtanh")
def _hardtanh_rule(p: RuleArgs):
    """No gradient at the bounds themselves, as eager's ``hardtanh_backward``. A NaN input gets none either: eager's
    vectorized loop gives it none and its scalar tail all of it, so the bulk of a large tensor is what this follows."""
    a, lo, hi = p[0], p.get("min_val", -1.0), p.get("max_val", 1.0)
    if not isinstance(a, TensorProxy) or not dtypes.is_float_dtype(a.dtype):
        return NotImplemented
    out = p.bsym.sym(*p.bsym.args, **p.bsym.kwargs)
    if needs_grad(a):
        inside = ltorch.logical_and(ltorch.gt(a, lo), ltorch.lt(a, hi))
        put_grad(a, ltorch.where(inside, get_grad(out), 0.0))
    return out


@builtin_rule("torch.nn.functional.layer_norm")
def _layer_norm_rule(p: RuleArgs):
    a, shape, w, b, eps = p[0], _normalized(p[1]), p[2], p[3], p.get("eps", 1e-5)
    if any(t is not None and t.dtype != a.dtype for t in (w, b)):
        return NotImplemented
    out, mean, rstd = native_layer_norm(a, shape, w, b, eps)
    mask = [needs_grad(a), w is not None and needs_grad(w), b is not None and needs_grad(b)]
    put_grads((a, w, b), native_layer_norm_backward(get_grad(out), a, shape, mean, rstd, w, b, mask))
    return out


@builtin_rule("torch.nn.functional.rms_norm")
def _rms_norm_rule(p: RuleArgs):
    """The fused aten forward (it returns rstd); the backward is its formula (aten has no CPU backward kernel):
    with x^ = x * rstd, grad_x = rstd * (g*w - x^ * mean(g*w * x^)) and grad_w = sum(g * x^)."""
    from fulmen.transforms.autodiff import sum_to

    a, shape, w, eps = p[0], _normalized(p[1]), p[2], p.get("eps")
    if (w is not None and w.dtype != a.dtype) or not dtypes.is_float_dtype(a.dtype) or not shape:
        return NotImplemented
    out, rstd = fused_rms_norm(a, shape, w, eps)
    g = get_grad(out)
    dims = tuple(range(a.ndim - len(shape), a.ndim))
    compute = rstd.dtype
    x, g = _convert(a, compute), _convert(g, compute)
    x_hat = ltorch.mul(x, rstd)
    gw = _convert(sum_to(ltorch.mul(g, x_hat), w.shape), w.dtype) if w is not None and needs_grad(w) else None
    g_hat = ltorch.mul(g, _convert(w, compute)) if w is not None else g
    mean = ltorch.true_divide(prims.sum(ltorch.mul(g_hat, x_hat), dims), _numel(shape))
    mean = clang.reshape(mean, _stats_shape(a, shape))
    ga = ltorch.mul(rstd, ltorch.sub(g_hat, ltorch.mul(x_hat, mean)))
    put_grads((a, w), (_convert(ga, a.dtype), gw))
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _softmax_like(p: RuleArgs, forward: Symbol, backward: Symbol):
    a, dim, dtype = p[0], p.get("dim"), p.get("dtype")
    if dim is None or not isinstance(a, TensorProxy) or not dtypes.is_float_dtype(dtype or a.dtype):
        return NotImplemented
    x = _convert(a, dtype)
    out = forward(x, dim, False)
    gx = backward(get_grad(out), out, dim, x.dtype)
    put_grad(a, _convert(gx, a.dtype) if x is not a else gx)
    return out


builtin_rule("torch.softmax", "torch.nn.functional.softmax", "torch.Tensor.softmax")(
    lambda p: _softmax_like(p, softmax, softmax_backward))
builtin_rule("torch.log_softmax", "torch.nn.functional.log_softmax", "torch.Tensor.log_softmax")(
    lambda p: _softmax_like(p, log_softmax, log_softmax_backward))


@builtin_rule("torch.nn.functional.cross_entropy")
def _cross_entropy_rule(p: RuleArgs):
    """log_softmax + nll_loss, saving the log-probabilities once (as eager does), with their aten backwards; on
    CPU, unweighted (N, C) float32/float64 logits take a one-pass backward (``_cross_entropy_unit_gradient``)."""
    a, target, weight = p[0], p[1], p.get("weight")
    reduction = p.get("reduction", "mean")
    if (p.get("size_average") is not None or p.get("reduce") is not None or p.get("label_smoothing", 0.0)
            or reduction not in _REDUCTIONS or a.ndim not in (1, 2) or not isinstance(target, TensorProxy)
            or not dtypes.is_integer_dtype(target.dtype) or target.dtype is torch.bool or needs_grad(weight)
            or not dtypes.is_float_dtype(a.dtype)):
        return NotImplemented
    dim, red, ignore = (0 if a.ndim == 1 else 1), _REDUCTIONS[reduction], p.get("ignore_index", -100)
    if weight is None and a.ndim == 2 and a.dtype in (torch.float32, torch.float64) and a.device.type == "cpu":
        return _cross_entropy_unit_gradient(a, target, reduction, ignore)
    logp = log_softmax(a, dim, False)
    loss, total = nll_loss_forward(logp, target, weight, red, ignore)
    g_logp = nll_loss_backward(get_grad(loss), logp, target, weight, red, ignore, total)
    put_grad(a, log_softmax_backward(g_logp, logp, dim, a.dtype))
    return loss


def _cross_entropy_unit_gradient(a: TensorProxy, target: TensorProxy, reduction: str, ignore: int):
    """Cross-entropy of (N, C) float32/float64 logits whose backward is ``softmax - onehot`` on the rows not
    ignored (zeros on the others) times the cotangent (over the kept-row count for ``mean``): one fusible pass,
    instead of a pass that rebuilds the softmax from saved log-probabilities.

    The forward keeps no (N, C) tensor of its own: the backward recomputes the log-probabilities from the logits
    and the per-row maximum and log-sum (N values each), all fusible operations, so rematerialization saves the
    logits -- which the caller usually holds anyway (a model returns them; a returned value costs nothing to
    save) -- and the row statistics, as torch.compile does, rather than a second (N, C) tensor. The arithmetic
    is eager's: the log-probabilities are ``(x - max) - log(sum(exp(x - max)))`` as ATen's kernel computes them,
    the loss is the negated picked log-probability summed, or averaged over the kept rows, and the gradient is
    ATen's ``(exp(logp) - onehot) * (g / count)`` up to rounding.

    CPU only, where it is the faster of the two; on CUDA the log-softmax path with fulmen's one-pass backward
    decomposition (``inductor_decomps``) is faster and stays (figures: docs/performance.md, "What individual
    changes bought")."""
    n, c = a.shape
    shifted = ltorch.sub(a, ltorch.amax(a, 1, keepdim=True))
    logp = ltorch.sub(shifted, ltorch.log(ltorch.sum(ltorch.exp(shifted), 1, keepdim=True)))
    kept = ltorch.ne(target, ignore)
    safe = ltorch.where(kept, target, 0)
    picked = clang.reshape(ltorch.gather(logp, 1, clang.reshape(safe, (n, 1))), (n,))
    rows = ltorch.where(kept, ltorch.neg(picked), 0.0)
    classes = clang.reshape(ltorch.arange(c, device=a.device, dtype=target.dtype), (1, c))
    # an ignored row's gradient is eager's log-softmax backward of a zero cotangent, exp(logp) * 0, whatever the
    # loss's cotangent (an infinite one too): zero, or NaN where its logits make the log-probabilities NaN (a NaN or
    # +inf logit)
    kept_column = clang.reshape(kept, (n, 1))
    probs = ltorch.exp(logp)
    onehot = _convert(ltorch.eq(classes, clang.reshape(safe, (n, 1))), a.dtype)
    unit, ignored = ltorch.sub(probs, onehot), ltorch.mul(probs, 0.0)
    if reduction == "none":
        put_grad(a, ltorch.where(kept_column, ltorch.mul(unit, clang.reshape(get_grad(rows), (n, 1))), ignored))
        return rows
    loss = ltorch.sum(rows)
    if reduction == "mean":
        count = ltorch.sum(kept, dtype=a.dtype)
        loss = ltorch.true_divide(loss, count)
    g = get_grad(loss)
    if reduction == "mean":  # no kept rows: every row takes the ignored rows' gradient; g stays finite anyway
        g = ltorch.true_divide(g, ltorch.where(ltorch.gt(count, 0), count, 1.0))
    # One multiply by the 0-d cotangent, which push_scale_past_matmuls moves past the LM head's matrix products
    # (a where around it would keep the (N, C) pass). The ignored rows hold exp(logp) * 0 before it, so they are
    # eager's exactly whenever the cotangent is finite; an infinite or NaN cotangent (whose kept rows are already
    # non-finite in eager too) also makes them NaN where eager's are 0.
    put_grad(a, ltorch.mul(ltorch.where(kept_column, unit, ignored), g))
    return loss


@builtin_rule("torch.nn.functional.embedding")
def _embedding_rule(p: RuleArgs):
    idx, w = p[0], p[1]
    padding_idx, scale = p.get("padding_idx"), bool(p.get("scale_grad_by_freq", False))
    if p.get("max_norm") is not None or not isinstance(idx, TensorProxy) or w.ndim != 2:
        return NotImplemented
    padding_idx = -1 if padding_idx is None else (padding_idx + w.shape[0] if padding_idx < 0 else padding_idx)
    out = embedding(w, idx, padding_idx, scale, False)
    if p.get("sparse"):  # eager's sparse COO gradient (grad_ops.embedding_sparse_backward)
        g = embedding_sparse_backward(get_grad(out), idx, w.shape[0], padding_idx, scale)
        put_grad(w, g)
        return out
    put_grad(w, embedding_dense_backward(get_grad(out), idx, w.shape[0], padding_idx, scale))
    return out


@builtin_rule("torch.nn.functional.gelu")
def _gelu_rule(p: RuleArgs):
    a, approximate = p[0], p.get("approximate", "none")
    out = gelu(a, approximate=approximate)
    put_grad(a, gelu_backward(get_grad(out), a, approximate=approximate))
    return out


@builtin_rule("torch.logsumexp")
def _logsumexp_rule(p: RuleArgs):
    """eager's logsumexp backward, ``g * exp(a - out)``. Differentiating the decomposition instead also sends a
    gradient through the row maximum (which cancels out) by an equality mask, which a fused region that does not
    round ``a`` where eager does can leave empty: NaN."""
    a, dim, keepdim = p[0], p.get("dim"), p.get("keepdim", False)
    if not isinstance(a, TensorProxy) or not dtypes.is_float_dtype(a.dtype):
        return NotImplemented
    out = ltorch.logsumexp(a, dim, keepdim)
    g, full = get_grad(out), out
    if not keepdim and a.ndim:
        dims = [dim] if isinstance(dim, int) else list(dim)
        for d in sorted(canonicalize_dim(a.ndim, d) for d in dims):
            g, full = ltorch.unsqueeze(g, d), ltorch.unsqueeze(full, d)
    put_grad(a, ltorch.mul(g, ltorch.exp(ltorch.sub(a, full))))
    return out


@builtin_rule("torch.nn.functional.relu", "torch.relu")
def _relu_rule(p: RuleArgs):
    """Saves the output (which the next layer usually saves anyway), as eager does, not a boolean mask whose
    computation would split the forward's one relu into two operations."""
    a = p[0]
    if not isinstance(a, TensorProxy) or not dtypes.is_float_dtype(a.dtype):
        return NotImplemented
    out = relu(a)
    put_grad(a, threshold_backward(get_grad(out), out, 0))
    return out


@builtin_rule("torch.nn.functional.silu")
def _silu_rule(p: RuleArgs):
    a = p[0]
    out = silu(a)
    put_grad(a, silu_backward(get_grad(out), a))
    return out


_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def _elu_family(p: RuleArgs, alpha: float, scale: float, input_scale: float):
    """elu, selu and celu are one aten kernel; its backward is exact where the decomposition's ``where`` is not
    (0 * inf at infinite inputs)."""
    a = p[0]
    if not isinstance(a, TensorProxy) or not dtypes.is_float_dtype(a.dtype):
        return NotImplemented
    out = elu(a, alpha, scale, input_scale)
    put_grad(a, elu_backward(get_grad(out), alpha, scale, input_scale, False, a))
    return out


builtin_rule("torch.nn.functional.elu")(lambda p: _elu_family(p, p.get("alpha", 1.0), 1.0, 1.0))
builtin_rule("torch.nn.functional.selu")(lambda p: _elu_family(p, _SELU_ALPHA, _SELU_SCALE, 1.0))
builtin_rule("torch.nn.functional.celu")(
    lambda p: _elu_family(p, p.get("alpha", 1.0), 1.0, 1.0 / p.get("alpha", 1.0)) if p.get("alpha", 1.0) != 0
    else NotImplemented)


@builtin_rule("torch.nn.functional.dropout")
def _dropout_rule(p: RuleArgs):
    """Eager's CPU dropout: a bernoulli(1 - p) mask in the input's dtype, scaled by 1 / (1 - p), multiplied in;
    the scaled mask is what the backward needs."""
    a, prob, training = p[0], p.get("p", 0.5), p.get("training", True)
    if not training or prob == 0 or prob >= 1 or a.numel() == 0 or not dtypes.is_float_dtype(a.dtype):
        return NotImplemented
    scaled = ltorch.true_divide(bernoulli_like(a, 1 - prob), 1 - prob)
    out = ltorch.mul(a, scaled)
    put_grad(a, ltorch.mul(get_grad(out), scaled))
    return out


def _sdpa_supported(p: RuleArgs) -> bool:
    q, k, v, mask = p[0], p[1], p[2], p.get("attn_mask")
    if not all(isinstance(t, TensorProxy) and t.ndim == 4 and t.dtype == q.dtype for t in (q, k, v)):
        return False
    if p.get("dropout_p", 0.0) != 0.0:
        return False
    if q.device.type == "cuda":
        return efficient_attention_supported(q, k, v, mask, p.get("scale"))
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return False
    if k.shape[1] != q.shape[1] and not p.get("enable_gqa", False):
        return False
    return mask is None or (isinstance(mask, TensorProxy) and mask.dtype == q.dtype and not needs_grad(mask))


@builtin_rule("torch.nn.functional.scaled_dot_product_attention", checker=_sdpa_supported)
def _sdpa_rule(p: RuleArgs):
    """Fused attention, as eager picks it (CPU: flash attention; CUDA: memory-efficient attention): the output
    and log-sum-exp are what the backward needs, never the (L, S) attention weights."""
    q, k, v = p[0], p[1], p[2]
    mask, causal, scale = p.get("attn_mask"), bool(p.get("is_causal", False)), p.get("scale")
    if q.device.type == "cuda":
        out, lse = efficient_attention_cuda(q, k, v, None, causal, scale)
        gq, gk, gv = efficient_attention_cuda_backward(get_grad(out), q, k, v, out, lse, None, causal, scale)
    else:
        out, lse = flash_attention_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        gq, gk, gv = flash_attention_cpu_backward(get_grad(out), q, k, v, out, lse, 0.0, causal, attn_mask=mask,
                                                  scale=scale)
    put_grads((q, k, v), (gq, gk, gv))
    return out


# ---- norms: eager's gradients where the norm is zero ----
# The decompositions end in sqrt or pow(s, 1 / p), whose derivative at 0 is infinite while the chain rule's other
# factor there is 0: the product is NaN, where eager's norm_backward and std_backward mask the gradient to 0. The
# forward stays the (fusible) decomposition; only the backward is eager's formula.

@builtin_rule("torch.linalg.vector_norm")
def _vector_norm_rule(p: RuleArgs):
    from fulmen.torch.reductions import _reduction_dims

    x, ord, keepdim = p[0], p.get("ord", 2), p.get("keepdim", False)
    dims = _reduction_dims(x, p.get("dim"), "linalg.vector_norm")
    norm = p.bsym.sym(*p.bsym.args, **p.bsym.kwargs)
    g, n = get_grad(norm), norm
    if not keepdim:  # broadcast against x: the reduced dims back as length 1
        g, n = _unsqueeze_reduced(g, x, dims), _unsqueeze_reduced(n, x, dims)
    put_grad(x, _norm_backward(g, x, float(ord), n, dims))
    return norm


def _unsqueeze_reduced(t: TensorProxy, x: TensorProxy, dims) -> TensorProxy:
    return clang.reshape(t, tuple(1 if i in dims else s for i, s in enumerate(x.shape)))


def _norm_backward(g, x, p: float, norm, dims):
    """ATen's norm_backward, ``g`` and ``norm`` with x's rank."""
    from fulmen.transforms.autodiff import sgn, zeros_like

    mul, div, where, eq = ltorch.mul, ltorch.true_divide, ltorch.where, ltorch.eq
    if p == 0:
        return zeros_like(x)
    if p == 1:
        return mul(sgn(x), g)
    if p == 2:
        return mul(g, where(eq(norm, 0), 0, div(x, norm)))
    mag = ltorch.abs(x)
    if p in (float("inf"), float("-inf")):  # g shared by the elements at the extreme (NaN counts as one)
        mask = ltorch.logical_or(eq(mag, norm), ltorch.isnan(mag))
        return mul(sgn(x, mag), mul(div(g, ltorch.sum(mask, dims, keepdim=True)), mask))
    if p < 1:
        scaled = mul(sgn(x, mag), where(eq(x, 0), 0, ltorch.pow(mag, p - 1)))
        return mul(mul(scaled, g), ltorch.pow(norm, 1 - p))
    scaled = mul(sgn(x, mag), ltorch.pow(mag, p - 1)) if p < 2 else mul(x, ltorch.pow(mag, p - 2))
    return mul(scaled, where(eq(norm, 0), 0, div(g, ltorch.pow(norm, p - 1))))


@builtin_rule("torch.std", "torch.std_mean")
def _std_rule(p: RuleArgs):
    """eager's std_backward (and std_mean's): the variance's cotangent is g / (2 std), 0 where std is 0."""
    from fulmen.torch.reductions import _var_args

    x, keepdim = p[0], p.get("keepdim", False)
    dims, correction = _var_args(p.bsym.sym.name, x, p.get("dim"), p.get("unbiased"), p.get("correction"))
    result = p.bsym.sym(*p.bsym.args, **p.bsym.kwargs)
    std, mean = result if isinstance(result, tuple) else (result, None)
    g, s = get_grad(std), std
    if not keepdim:
        g, s = _unsqueeze_reduced(g, x, dims), _unsqueeze_reduced(s, x, dims)
    n = _numel(x.shape[d] for d in dims)
    g_var = ltorch.where(ltorch.eq(s, 0), 0, ltorch.true_divide(g, ltorch.mul(s, 2)))
    scale = 2.0 / (n - correction) if n != correction else float("inf")  # as eager's double arithmetic gives
    gx = ltorch.mul(ltorch.mul(g_var, ltorch.sub(x, ltorch.mean(x, dims, keepdim=True))), scale)
    if mean is not None:
        g_mean = get_grad(mean)
        g_mean = g_mean if keepdim else _unsqueeze_reduced(g_mean, x, dims)
        gx = ltorch.add(gx, ltorch.true_divide(g_mean, n))
    put_grad(x, gx)
    return result


@builtin_rule("torch.normal", "torch.bernoulli")
def _sample_rule(p: RuleArgs):
    """A sample passes no gradient to its distribution's parameters (the mean and std of ``normal``, the
    probabilities of ``bernoulli``): eager's derivatives give them zeros, not the reparameterized gradient the
    decomposition (``mean + std * draw``) would."""
    out = p.bsym.sym(*p.bsym.args, **p.bsym.kwargs)
    for x in p.values:
        if needs_grad(x):
            put_grad(x, clang.full(tuple(x.shape), 0, device=x.device, dtype=x.dtype))
    return out


@builtin_rule("torch.fill")
def _fill_rule(p: RuleArgs):
    """``torch.fill(a, value)``: eager's result requires grad when ``a`` does, with a zero gradient for ``a``; the
    decomposition (a new tensor made of ``value``) would read nothing of ``a``. A ``value`` that needs a gradient
    goes by the decomposition, which gives it one."""
    a, value = p[0], p[1]
    if needs_grad(value):
        return NotImplemented
    if isinstance(value, TensorProxy):
        value = clang.maybe_convert_to_dtype(value, a.dtype)
        if value.device != a.device:
            value = prims.device_put(value, a.device)
        out = clang.expand_to(value, a.shape) if a.ndim else ltorch.clone(value)
    else:
        out = clang.full(tuple(a.shape), value, device=a.device, dtype=a.dtype)
    put_grad(a, clang.full(tuple(a.shape), 0, device=a.device, dtype=a.dtype))
    return out
