"""The ``cross_entropy`` executor: a fused forward and backward that saves only the per-row log-sum-exp.

``F.cross_entropy(logits, target)`` with class-index targets runs as two operations (what NVIDIA Apex's
xentropy does)::

    (loss, lse) = cross_entropy_fwd(logits, target, 'mean', -100, 0.0)
    grad_logits = cross_entropy_bwd(g, logits, target, lse, 'mean', -100, 0.0)

The forward returns the loss and the (N,) log-sum-exp; the backward rebuilds the softmax from the logits and
the saved log-sum-exp. Both work over chunks of rows, so no (N, C) softmax or log-softmax is materialized
beyond a chunk. Every reduction, ``ignore_index`` and ``label_smoothing`` are supported; class-probability
targets, ``weight`` and the legacy ``size_average`` / ``reduce`` arguments are declined (fulmen's default path
then runs them). The kernels are written in torch operations and run on any device.
"""

from __future__ import annotations

import torch

from fulmen.core import dtypes
from fulmen.core.proxies import TensorProxy
from fulmen.executors.base import OperatorExecutor, register_executor
from fulmen.executors.triton_cross_entropy import (
    TRITON_AVAILABLE,
    triton_cross_entropy_backward,
    triton_cross_entropy_forward,
)

CROSS_ENTROPY_ID = "torch.nn.functional.cross_entropy"

#: elements of a (rows, C) chunk processed at once (float32: 8 MiB)
CHUNK_ELEMENTS = 1 << 21

cross_entropy_ex = OperatorExecutor("cross_entropy", version="0.1")
register_executor(cross_entropy_ex)


def chunk_rows(n_classes: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    return max(1, chunk_elements // max(n_classes, 1))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def row_losses(x: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float):
    """Per-row loss and log-sum-exp of a chunk of logits ``x`` (rows, C) in the compute dtype; ignored rows get
    loss 0. loss = lse - (1 - s) * x[target] - (s / C) * sum(x)."""
    lse = torch.logsumexp(x, dim=1)
    valid = target != ignore_index
    picked = x.gather(1, torch.where(valid, target, 0).unsqueeze(1)).squeeze(1)
    loss = lse - (1.0 - label_smoothing) * picked
    if label_smoothing:
        loss = loss - (label_smoothing / x.shape[1]) * x.sum(dim=1)
    return torch.where(valid, loss, 0.0), lse


def reduce_losses(losses: torch.Tensor, target: torch.Tensor, reduction: str, ignore_index: int, dtype):
    if reduction == "none":
        return losses.to(dtype)
    total = losses.sum()
    if reduction == "mean":
        total = total / (target != ignore_index).sum()  # all rows ignored: 0 / 0 = nan, as eager gives
    return total.to(dtype)


def row_scale(g: torch.Tensor, target: torch.Tensor, reduction: str, ignore_index: int, compute) -> torch.Tensor:
    """The loss cotangent each row's gradient is multiplied by (0 for ignored rows), shape (N,)."""
    valid = target != ignore_index
    if reduction == "none":
        scale = g.to(compute)
    elif reduction == "sum":
        scale = g.to(compute).expand(target.shape)
    else:
        scale = (g.to(compute) / valid.sum()).expand(target.shape)
    return torch.where(valid, scale, 0.0)


def logits_grad(
    x: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, label_smoothing: float
) -> torch.Tensor:
    """(softmax(x) - (1 - s) * onehot(target) - s / C) * scale for a chunk, in the compute dtype."""
    p = torch.exp(x - lse.unsqueeze(1))
    if label_smoothing:
        p = p - label_smoothing / x.shape[1]
    safe = torch.where(scale != 0, target, 0).clamp(0, x.shape[1] - 1).unsqueeze(1)
    p.scatter_add_(1, safe, torch.full_like(safe, -(1.0 - label_smoothing), dtype=p.dtype))
    return p * scale.unsqueeze(1)


# ---- the kernels ----

#: Device types whose logits the Triton kernels run. Tests add ``"cpu"`` to run them in Triton's interpreter
#: (``TRITON_INTERPRET=1``), so that this executor's path through them is tested without a GPU.
TRITON_DEVICE_TYPES: frozenset[str] = frozenset({"cuda"})


def _use_triton(logits: torch.Tensor) -> bool:
    """The Triton kernels run float16 / bfloat16 / float32 logits on ``TRITON_DEVICE_TYPES``; everything else takes
    the torch path."""
    return (
        TRITON_AVAILABLE
        and logits.device.type in TRITON_DEVICE_TYPES
        and logits.dtype in (torch.float16, torch.bfloat16, torch.float32)
    )


def cross_entropy_forward(
    logits: torch.Tensor, target: torch.Tensor, reduction: str, ignore_index: int, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x2, t1 = (logits.unsqueeze(0), target.reshape(1)) if logits.ndim == 1 else (logits, target)
    compute = _compute_dtype(logits.dtype)
    n, c = x2.shape
    losses = torch.empty(n, dtype=compute, device=logits.device)
    lse = torch.empty(n, dtype=compute, device=logits.device)
    if _use_triton(logits):
        losses, lse = triton_cross_entropy_forward(x2, t1, ignore_index, label_smoothing)
    else:
        step = chunk_rows(c)
        for i in range(0, n, step):
            losses[i : i + step], lse[i : i + step] = row_losses(
                x2[i : i + step].to(compute), t1[i : i + step], ignore_index, label_smoothing
            )
    loss = reduce_losses(losses, t1, reduction, ignore_index, logits.dtype)
    if logits.ndim == 1:
        loss, lse = (loss.reshape(()) if reduction == "none" else loss), lse.reshape(())
    return loss, lse


def cross_entropy_backward(
    g: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
) -> torch.Tensor:
    x2, t1 = (logits.unsqueeze(0), target.reshape(1)) if logits.ndim == 1 else (logits, target)
    compute = _compute_dtype(logits.dtype)
    n, c = x2.shape
    scale = row_scale(g.reshape(-1) if reduction == "none" else g, t1, reduction, ignore_index, compute)
    lse = lse.reshape(n)
    if _use_triton(logits):
        return triton_cross_entropy_backward(scale, x2, t1, lse, ignore_index, label_smoothing).reshape(logits.shape)
    grad = torch.empty_like(x2)
    step = chunk_rows(c)
    for i in range(0, n, step):
        grad[i : i + step] = logits_grad(
            x2[i : i + step].to(compute), lse[i : i + step], t1[i : i + step], scale[i : i + step], label_smoothing
        )
    return grad.reshape(logits.shape)


def _fwd_meta(logits, target, reduction, ignore_index, label_smoothing):
    rows = () if logits.ndim == 1 else (logits.shape[0],)
    loss_shape = rows if reduction == "none" else ()
    return (
        TensorProxy(like=logits, shape=loss_shape, requires_grad=False),
        TensorProxy(like=logits, shape=rows, dtype=_compute_dtype(logits.dtype), requires_grad=False),
    )


def _bwd_meta(g, logits, target, lse, reduction, ignore_index, label_smoothing):
    return TensorProxy(like=logits, requires_grad=False)


cross_entropy_fwd = cross_entropy_ex.register_operator("cross_entropy_fwd", meta=_fwd_meta, fn=cross_entropy_forward)
cross_entropy_bwd = cross_entropy_ex.register_operator("cross_entropy_bwd", meta=_bwd_meta, fn=cross_entropy_backward)


# ---- claiming F.cross_entropy ----


def supported(
    input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean", label_smoothing=0.0
) -> bool:
    """Class-index targets, no weight, 1-D or 2-D logits of a floating dtype."""
    if not (isinstance(input, TensorProxy) and isinstance(target, TensorProxy)):
        return False
    if weight is not None or size_average is not None or reduce is not None:
        return False
    if reduction not in ("none", "mean", "sum") or not isinstance(ignore_index, int):
        return False
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        return False
    if (
        not dtypes.is_float_dtype(input.dtype)
        or not dtypes.is_integer_dtype(target.dtype)
        or target.dtype is torch.bool
    ):
        return False
    if input.ndim == 2:
        return target.ndim == 1 and target.shape[0] == input.shape[0] and input.shape[1] > 0
    return input.ndim == 1 and target.ndim == 0 and input.shape[0] > 0


def _execution_transform(
    input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean", label_smoothing=0.0
):
    loss, _ = cross_entropy_fwd(input, target, reduction, ignore_index, float(label_smoothing))
    return loss


def _grad_transform(
    input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean", label_smoothing=0.0
):
    from fulmen.transforms.linearize import get_grad, put_grad

    loss, lse = cross_entropy_fwd(input, target, reduction, ignore_index, float(label_smoothing))
    put_grad(
        input, cross_entropy_bwd(get_grad(loss), input, target, lse, reduction, ignore_index, float(label_smoothing))
    )
    return loss


cross_entropy_ex.register_implementation(
    CROSS_ENTROPY_ID, checker=supported, execution_transform=_execution_transform, grad_transform=_grad_transform
)
