"""Triton kernels for the ``cross_entropy`` executor's forward and backward on (N, C) logits.

One program handles one row and walks its columns in blocks of ``BLOCK`` elements, so any number of classes
works without materializing a softmax:

* forward: an online max / sum-exp gives the row's log-sum-exp ``lse``; the row loss is
  ``(1 - s) * (lse - x[t]) + s * (lse - mean(x))`` (``s`` the label smoothing), 0 for rows whose target is
  ``ignore_index``;
* backward: ``grad = (softmax(x) - (1 - s) * onehot(t) - s / C) * g_row``, with ``softmax`` rebuilt from the
  logits and the saved ``lse``; ignored rows get zeros.

A target outside ``[0, C)`` that is not ``ignore_index`` gives its row a NaN loss and NaN gradients. Eager's CUDA
kernels stop there with a device-side assertion; checking on the host would wait for the device every call, and
reading the logit at that index would read another row's memory (a finite, wrong loss).

Arithmetic is float32 whatever the logits' dtype (float16, bfloat16 or float32); losses and ``lse`` come back in
float32 and the gradient in the logits' dtype. Triton is optional: importing this module never fails, and
``TRITON_AVAILABLE`` says whether the wrappers can run. Setting ``TRITON_INTERPRET=1``
before Triton is first imported runs them in Triton's CPU interpreter (Triton decorates its own helpers, such as
``tl.zeros``, as ``triton.language`` is imported, and fulmen's kernels as they are first used).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401
except ImportError:  # pragma: no cover - exercised only where triton is missing
    TRITON_AVAILABLE = False
else:
    TRITON_AVAILABLE = True

#: the largest column block a program loads at once
MAX_BLOCK = 4096


@functools.cache
def _kernels():
    """Define (and decorate) the kernels on first use; ``triton.jit`` reads ``TRITON_INTERPRET`` at that point."""
    import triton
    import triton.language as tl

    @triton.jit
    def _fwd_kernel(x_ptr, t_ptr, loss_ptr, lse_ptr, stride_x, n_cols, ignore_index, smoothing, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = x_ptr + row * stride_x
        cols = tl.arange(0, BLOCK)
        m_i = tl.full([BLOCK], float("-inf"), tl.float32)
        s_i = tl.zeros([BLOCK], dtype=tl.float32)
        sum_x = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m_i, x)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf while a lane is all -inf
            s_i = s_i * tl.exp(m_i - m_safe) + tl.exp(x - m_safe)
            m_i = m_new
            sum_x += tl.where(mask, x, 0.0)
        m = tl.max(m_i, axis=0)
        s = tl.sum(s_i * tl.exp(m_i - m), axis=0)
        lse = m + tl.log(s)
        t = tl.load(t_ptr + row)
        valid = t != ignore_index
        in_range = (t >= 0) & (t < n_cols)
        x_t = tl.load(row_ptr + tl.where(valid & in_range, t, 0)).to(tl.float32)
        loss = lse - (1.0 - smoothing) * x_t
        if smoothing != 0.0:  # skipped without smoothing, so -inf logits give 0 * -inf nowhere
            loss -= (smoothing / n_cols) * tl.sum(sum_x, axis=0)
        loss = tl.where(in_range, loss, float("nan"))
        tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _bwd_kernel(
        g_ptr, x_ptr, t_ptr, lse_ptr, dx_ptr, stride_x, stride_dx, n_cols, ignore_index, smoothing, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = x_ptr + row * stride_x
        out_ptr = dx_ptr + row * stride_dx
        cols = tl.arange(0, BLOCK)
        t = tl.load(t_ptr + row)
        valid = t != ignore_index
        g = tl.where(valid, tl.load(g_ptr + row).to(tl.float32), 0.0)
        g = tl.where(valid & ((t < 0) | (t >= n_cols)), float("nan"), g)
        lse = tl.load(lse_ptr + row).to(tl.float32)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            x = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse) - smoothing / n_cols
            p = tl.where(offs == t, p - (1.0 - smoothing), p)
            tl.store(out_ptr + offs, (p * g).to(dx_ptr.dtype.element_ty), mask=mask)

    return _fwd_kernel, _bwd_kernel


def _check(logits: torch.Tensor, target: torch.Tensor):
    if not TRITON_AVAILABLE:
        raise RuntimeError("triton is not installed")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"triton cross_entropy supports float16, bfloat16 and float32 logits, not {logits.dtype}")
    if logits.ndim == 1:
        logits, target = logits.unsqueeze(0), target.reshape(1)
    if logits.ndim != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"expected (N, C) logits and (N,) targets, got {tuple(logits.shape)} and {tuple(target.shape)}"
        )
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return logits, target.contiguous()


def _block(n_cols: int, block_size: int | None) -> int:
    import triton

    return triton.next_power_of_2(block_size if block_size else min(max(n_cols, 16), MAX_BLOCK))


def triton_cross_entropy_forward(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    *,
    block_size: int | None = None,
):
    """Per-row losses (0 for ignored rows) and log-sum-exps of (N, C) logits, both (N,) float32."""
    shape = logits.shape
    x, t = _check(logits, target)
    n, c = x.shape
    losses = torch.empty(n, dtype=torch.float32, device=x.device)
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    if n:
        fwd, _ = _kernels()
        fwd[(n,)](
            x, t, losses, lse, x.stride(0), c, int(ignore_index), float(label_smoothing), BLOCK=_block(c, block_size)
        )
    if len(shape) == 1:
        losses, lse = losses.reshape(()), lse.reshape(())
    return losses, lse


def triton_cross_entropy_backward(
    grad_losses: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    *,
    block_size: int | None = None,
) -> torch.Tensor:
    """Gradient of the per-row losses wrt the logits, given their (N,) cotangent ``grad_losses`` and the saved
    (N,) ``lse``; the logits' shape and dtype."""
    shape = logits.shape
    x, t = _check(logits, target)
    n, c = x.shape
    g = grad_losses.reshape(n).contiguous()
    lse = lse.reshape(n).contiguous()
    dx = torch.empty((n, c), dtype=x.dtype, device=x.device)
    if n:
        _, bwd = _kernels()
        bwd[(n,)](
            g,
            x,
            t,
            lse,
            dx,
            x.stride(0),
            dx.stride(0),
            c,
            int(ignore_index),
            float(label_smoothing),
            BLOCK=_block(c, block_size),
        )
    return dx.reshape(shape)
