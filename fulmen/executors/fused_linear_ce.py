"""The ``fused_linear_ce`` executor: an LM head (``linear``) followed by ``cross_entropy``, chunk by chunk.

A trace transform run *before* autodiff (``fuse_linear_cross_entropy``) finds ``F.linear(h, W, b)`` whose output
is used only by ``F.cross_entropy`` (directly, or through one reshape that flattens the leading dims) and
replaces the pair by one symbol, ``fused_linear_cross_entropy(h, W, b, target, reduction, ignore_index,
label_smoothing)``, whose decomposition is the original pair. This executor gives that symbol a chunked
implementation and a chunked grad rule, so neither the (N, V) logits nor their gradient ever exist whole:

- ``mean`` / ``sum`` (the loss is a scalar, so every gradient is the loss cotangent times a fixed tensor): the
  forward computes, chunk by chunk of rows, the loss and the gradients for a cotangent of 1 -- grad_hidden
  rows, grad_weight and grad_bias accumulated -- and saves those; the backward multiplies them by the
  cotangent. Three matrix products in all, like eager, and no recomputation.
- ``none``: the forward saves only the per-row log-sum-exp; the backward recomputes each chunk's logits to
  produce grad_hidden and accumulate grad_weight / grad_bias.

Switching it on: list the executor, ``fulmen.jit(model, executors=["fused_linear_ce"])``; ``fulmen.jit`` applies
each listed executor's pipeline ``steps`` (here the step ``fused_linear_ce``, stage "computation") to the
computation trace before autodiff.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fulmen.core.proxies import TensorProxy
from fulmen.core.steps import Step
from fulmen.core.symbol import BoundSymbol, Symbol
from fulmen.core.trace import Trace
from fulmen.executors.base import OperatorExecutor, register_executor
from fulmen.executors.cross_entropy import (
    _compute_dtype,
    logits_grad,
    reduce_losses,
    row_losses,
    row_scale,
    supported,
)

FUSED_ID = "fused_linear_ce.fused_linear_cross_entropy"
LINEAR_ID = "torch.nn.functional.linear"
CROSS_ENTROPY_ID = "torch.nn.functional.cross_entropy"
_FLATTENING_IDS = {"torch.reshape", "torch.Tensor.reshape", "torch.Tensor.view", "torch.flatten",
                   "torch.Tensor.flatten"}

#: logits elements of one chunk of rows (float32: 64 MiB); big enough that the products stay efficient
CHUNK_ELEMENTS = 1 << 24


class FusedLinearCrossEntropyExecutor(OperatorExecutor):
    """Runs ``fused_linear_cross_entropy``; its pipeline step makes those symbols out of linear + cross_entropy."""

    steps = (Step("fused_linear_ce", lambda trace, executors: fuse_linear_cross_entropy(trace), "computation"),)


fused_linear_ce_ex = FusedLinearCrossEntropyExecutor("fused_linear_ce", version="0.1")
register_executor(fused_linear_ce_ex)


def _rows(n_classes: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(n_classes, 1))


# ---------------------------------------------------------------------------------------------------------
# the kernels (real tensors)

def _flat(hidden: torch.Tensor) -> torch.Tensor:
    return hidden.reshape(-1, hidden.shape[-1])


def _grad_buffers(h, weight, bias, mask):
    """(grad_hidden, grad_weight, grad_bias) to fill chunk by chunk; None where ``mask`` does not want one."""
    gh = torch.empty_like(h) if mask[0] else None
    gw = torch.zeros_like(weight) if mask[1] else None
    gb = torch.zeros_like(bias) if mask[2] and bias is not None else None
    return gh, gw, gb


def _accumulate(gl, hc, weight, gh_rows, gw, gb) -> None:
    """Add one chunk's share: its rows of grad_hidden, and its contributions to grad_weight and grad_bias."""
    if gh_rows is not None:
        torch.mm(gl, weight, out=gh_rows)
    if gw is not None:
        gw.addmm_(gl.t(), hc)
    if gb is not None:
        gb += gl.sum(0)


def forward_with_grads(hidden, weight, bias, target, reduction, ignore_index, label_smoothing, mask):
    """Loss and, for a loss cotangent of 1, (grad_hidden, grad_weight, grad_bias) -- each ``None`` where ``mask``
    says it is not wanted. ``reduction`` is ``mean`` or ``sum``."""
    h = _flat(hidden)
    n, v = h.shape[0], weight.shape[0]
    compute = _compute_dtype(hidden.dtype)
    losses = torch.empty(n, dtype=compute, device=h.device)
    scale = row_scale(torch.ones((), dtype=compute, device=h.device), target, reduction, ignore_index, compute)
    gh, gw, gb = _grad_buffers(h, weight, bias, mask)
    step = _rows(v)
    for i in range(0, n, step):
        hc, tc = h[i:i + step], target[i:i + step]
        logits = F.linear(hc, weight, bias).to(compute)
        losses[i:i + step], lse = row_losses(logits, tc, ignore_index, label_smoothing)
        gl = logits_grad(logits, lse, tc, scale[i:i + step], label_smoothing).to(weight.dtype)
        del logits
        _accumulate(gl, hc, weight, gh[i:i + step] if gh is not None else None, gw, gb)
    loss = reduce_losses(losses, target, reduction, ignore_index, hidden.dtype)
    return loss, (gh.reshape(hidden.shape) if gh is not None else None), gw, gb


def forward_lse(hidden, weight, bias, target, reduction, ignore_index, label_smoothing):
    """Loss and the per-row log-sum-exp (what the recomputing backward needs)."""
    h = _flat(hidden)
    n, v = h.shape[0], weight.shape[0]
    compute = _compute_dtype(hidden.dtype)
    losses = torch.empty(n, dtype=compute, device=h.device)
    lse = torch.empty(n, dtype=compute, device=h.device)
    step = _rows(v)
    for i in range(0, n, step):
        logits = F.linear(h[i:i + step], weight, bias).to(compute)
        losses[i:i + step], lse[i:i + step] = row_losses(logits, target[i:i + step], ignore_index, label_smoothing)
    return reduce_losses(losses, target, reduction, ignore_index, hidden.dtype), lse


def backward_recompute(g, hidden, weight, bias, target, lse, reduction, ignore_index, label_smoothing, mask):
    h = _flat(hidden)
    n, v = h.shape[0], weight.shape[0]
    compute = _compute_dtype(hidden.dtype)
    scale = row_scale(g.reshape(-1) if reduction == "none" else g, target, reduction, ignore_index, compute)
    gh, gw, gb = _grad_buffers(h, weight, bias, mask)
    step = _rows(v)
    for i in range(0, n, step):
        hc, tc = h[i:i + step], target[i:i + step]
        logits = F.linear(hc, weight, bias).to(compute)
        gl = logits_grad(logits, lse[i:i + step], tc, scale[i:i + step], label_smoothing).to(weight.dtype)
        del logits
        _accumulate(gl, hc, weight, gh[i:i + step] if gh is not None else None, gw, gb)
    return (gh.reshape(hidden.shape) if gh is not None else None), gw, gb


# ---------------------------------------------------------------------------------------------------------
# operations

def _p(x: TensorProxy, **changes) -> TensorProxy:
    return TensorProxy(like=x, requires_grad=False, **changes)


def _loss_meta(hidden, weight, target, reduction):
    n = target.shape[0]
    return _p(hidden, shape=(n,) if reduction == "none" else ())


def _grads_meta(hidden, weight, bias, mask):
    return (_p(hidden) if mask[0] else None, _p(weight) if mask[1] else None,
            _p(bias) if mask[2] and bias is not None else None)


def _fwd_grads_meta(hidden, weight, bias, target, reduction, ignore_index, label_smoothing, mask):
    return (_loss_meta(hidden, weight, target, reduction), *_grads_meta(hidden, weight, bias, mask))


def _fwd_lse_meta(hidden, weight, bias, target, reduction, ignore_index, label_smoothing):
    return (_loss_meta(hidden, weight, target, reduction),
            _p(hidden, shape=(target.shape[0],), dtype=_compute_dtype(hidden.dtype)))


def _bwd_meta(g, hidden, weight, bias, target, lse, reduction, ignore_index, label_smoothing, mask):
    return _grads_meta(hidden, weight, bias, mask)


linear_ce_fwd_grads = fused_linear_ce_ex.register_operator("linear_cross_entropy_fwd_with_grads",
                                                           meta=_fwd_grads_meta, fn=forward_with_grads)
linear_ce_fwd = fused_linear_ce_ex.register_operator("linear_cross_entropy_fwd", meta=_fwd_lse_meta, fn=forward_lse)
linear_ce_bwd = fused_linear_ce_ex.register_operator("linear_cross_entropy_bwd", meta=_bwd_meta,
                                                     fn=backward_recompute)


def _decomposition(hidden, weight, bias, target, reduction="mean", ignore_index=-100, label_smoothing=0.0):
    logits = F.linear(hidden, weight, bias)
    logits = logits.reshape(-1, weight.shape[0])
    return F.cross_entropy(logits, target, reduction=reduction, ignore_index=ignore_index,
                           label_smoothing=label_smoothing)


#: the symbol the trace transform records; its decomposition is the original linear (+ reshape) + cross_entropy
fused_linear_cross_entropy = Symbol(name="fused_linear_cross_entropy", meta=_decomposition, id=FUSED_ID,
                                    module=None)


def _checker(hidden, weight, bias, target, reduction="mean", ignore_index=-100, label_smoothing=0.0) -> bool:
    return (isinstance(weight, TensorProxy) and weight.ndim == 2 and hidden.dtype == weight.dtype
            and (bias is None or (isinstance(bias, TensorProxy) and bias.dtype == weight.dtype))
            and hidden.device == weight.device)


def _execution_transform(hidden, weight, bias, target, reduction="mean", ignore_index=-100, label_smoothing=0.0):
    loss, _ = linear_ce_fwd(hidden, weight, bias, target, reduction, ignore_index, label_smoothing)
    return loss


def _grad_transform(hidden, weight, bias, target, reduction="mean", ignore_index=-100, label_smoothing=0.0):
    import fulmen.torch as ltorch
    from fulmen.transforms.linearize import get_grad, needs_grad, put_grads

    mask = (needs_grad(hidden), needs_grad(weight), bias is not None and needs_grad(bias))
    if reduction == "none":
        loss, lse = linear_ce_fwd(hidden, weight, bias, target, reduction, ignore_index, label_smoothing)
        grads = linear_ce_bwd(get_grad(loss), hidden, weight, bias, target, lse, reduction, ignore_index,
                              label_smoothing, mask)
    else:
        loss, *unit = linear_ce_fwd_grads(hidden, weight, bias, target, reduction, ignore_index, label_smoothing,
                                          mask)
        g = get_grad(loss)
        grads = [ltorch.mul(u, g) if u is not None else None for u in unit]
    put_grads((hidden, weight, bias), grads)
    return loss


fused_linear_ce_ex.register_implementation(FUSED_ID, checker=_checker, execution_transform=_execution_transform,
                                           grad_transform=_grad_transform)


# ---------------------------------------------------------------------------------------------------------
# the trace transform

def _match(bsym: BoundSymbol, producers: dict[str, BoundSymbol], uses: dict[str, int]) -> list[BoundSymbol] | None:
    """``[linear, (reshape,)] `` feeding this cross_entropy with no other use of what they compute."""
    from fulmen.transforms.linearize import bind_arguments

    if bsym.sym.id != CROSS_ENTROPY_ID or not bsym.args or not isinstance(bsym.args[0], TensorProxy):
        return None
    if not supported(*bsym.args, **bsym.kwargs) or bsym.args[0].ndim != 2:
        return None
    logits = bsym.args[0]
    chain: list[BoundSymbol] = []
    current = logits
    for _ in range(2):
        if uses.get(current.name, 0) != 1:
            return None
        prod = producers.get(current.name)
        if prod is None:
            return None
        chain.insert(0, prod)
        if prod.sym.id == LINEAR_ID:
            break
        if prod.sym.id not in _FLATTENING_IDS or not isinstance(prod.args[0], TensorProxy):
            return None
        current = prod.args[0]
        if current.ndim < 2 or current.shape[-1] != logits.shape[-1]:
            return None
    else:
        return None
    linear = chain[0]
    if linear.sym.id != LINEAR_ID:
        return None
    named = bind_arguments(linear.sym.meta, linear)
    weight = named.get("weight", linear.args[1] if len(linear.args) > 1 else None)
    if not isinstance(weight, TensorProxy) or weight.ndim != 2:
        return None
    return chain


def fuse_linear_cross_entropy(trace: Trace) -> Trace:
    """Replace each ``linear`` (+ flattening reshape) + ``cross_entropy`` whose logits are used nowhere else by one
    ``fused_linear_cross_entropy`` symbol (the pair stays as its decomposition)."""
    from fulmen.transforms.linearize import bind_arguments
    from fulmen.transforms.passes import use_counts

    uses = use_counts(trace)
    producers = {p.name: b for b in trace.bound_symbols for p in b.flat_proxy_outs}
    replaced: dict[int, BoundSymbol | None] = {}
    for b in trace.bound_symbols:
        chain = _match(b, producers, uses)
        if chain is None:
            continue
        lin = bind_arguments(chain[0].sym.meta, chain[0])
        values = list(lin.values())
        hidden, weight = values[0], values[1]
        bias = values[2] if len(values) > 2 else None
        ce = bind_arguments(b.sym.meta, b)
        fused = fused_linear_cross_entropy.bind(
            hidden, weight, bias, b.args[1], ce.get("reduction", "mean"), ce.get("ignore_index", -100),
            float(ce.get("label_smoothing", 0.0)), output=b.output, subsymbols=(*chain, b))
        for c in chain:
            replaced[id(c)] = None
        replaced[id(b)] = fused
    if not replaced:
        return trace
    out = []
    for b in trace.bound_symbols:
        if id(b) in replaced:
            if replaced[id(b)] is not None:
                out.append(replaced[id(b)])
        else:
            out.append(b)
    new = trace.derive("Fuse linear + cross_entropy", out)
    return new
