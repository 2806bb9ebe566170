"""The ``sdpa`` executor: ``scaled_dot_product_attention`` through PyTorch's fused attention kernels.

Forward and backward are the aten kernels eager's dispatcher would pick (CPU: flash attention; CUDA: memory
efficient attention), with an explicit grad rule: the forward returns the output and the per-row
log-sum-exp, which is all the backward saves besides the inputs and the output -- never the (L, S) attention
matrix. Calls the kernels do not support (dropout, masks that need gradients, mismatched head counts,
non-float dtypes, other ranks; on CUDA, masks and what else ``efficient_attention_supported`` declines, as the
default path's gradient rule does) are declined; fulmen's default path runs them instead.

    jfn = fulmen.jit(attention, executors=["sdpa"])
"""

from __future__ import annotations

import math

import torch

from fulmen.core.proxies import TensorProxy
from fulmen.executors.base import OperatorExecutor, register_executor
from fulmen.transforms.grad_ops import (
    efficient_attention_backward,
    efficient_attention_forward,
    efficient_attention_meta,
    efficient_attention_supported,
)

SDPA_ID = "torch.nn.functional.scaled_dot_product_attention"
_aten = torch.ops.aten

sdpa_ex = OperatorExecutor("sdpa", version=torch.__version__)
register_executor(sdpa_ex)


def _lse_dtype(q) -> torch.dtype:
    return torch.float64 if q.dtype is torch.float64 else torch.float32


def _like(x: TensorProxy, **changes) -> TensorProxy:
    return TensorProxy(like=x, requires_grad=False, **changes)


# ---- the kernels, as executable operations ----

def _fwd_meta(q, k, v, attn_mask, dropout_p, is_causal, scale):
    if q.device.type == "cuda":  # the memory-efficient kernel pads its log-sum-exp rows
        return efficient_attention_meta(q, k, v, attn_mask, is_causal, scale)
    return _like(q, shape=tuple(q.shape[:-1]) + (v.shape[-1],)), _like(q, shape=tuple(q.shape[:-1]),
                                                                      dtype=_lse_dtype(q))


def _fwd_impl(q, k, v, attn_mask, dropout_p, is_causal, scale):
    if q.device.type == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask=attn_mask,
                                                                 scale=scale)
    return efficient_attention_forward(q, k, v, attn_mask, is_causal, scale)  # no dropout on CUDA (``_checker``)


def _bwd_meta(g, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale):
    return _like(q), _like(k), _like(v)


def _bwd_impl(g, q, k, v, out, lse, attn_mask, dropout_p, is_causal, scale):
    if q.device.type == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, dropout_p, is_causal,
                                                                          attn_mask=attn_mask, scale=scale)
    return efficient_attention_backward(g, q, k, v, out, lse, attn_mask, is_causal, scale)


sdpa_forward = sdpa_ex.register_operator("sdpa_fused_forward", meta=_fwd_meta, fn=_fwd_impl)
sdpa_backward = sdpa_ex.register_operator("sdpa_fused_backward", meta=_bwd_meta, fn=_bwd_impl)


# ---- what is supported ----

_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _checker(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False) -> bool:
    from fulmen.transforms.linearize import needs_grad

    q, k, v = query, key, value
    if not all(isinstance(t, TensorProxy) and t.ndim == 4 and t.dtype == q.dtype and t.device == q.device
               for t in (q, k, v)):
        return False
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1] or k.shape[2] != v.shape[2] or q.shape[-1] != k.shape[-1]:
        return False  # grouped-query attention (and malformed calls) go the default way
    if q.numel() == 0 or k.numel() == 0:
        return False
    if q.device.type == "cpu":
        if q.dtype not in _CPU_DTYPES or dropout_p != 0.0:
            return False
    elif q.device.type == "cuda":
        # dropout would need the Philox state replayed; the rest is what the kernel takes, as the gradient rule
        # decides it (a mask would need eager's padding and expansion first)
        return dropout_p == 0.0 and efficient_attention_supported(q, k, v, attn_mask, scale)
    else:
        return False
    if is_causal and attn_mask is not None:
        return False  # eager rejects this combination; let the default path raise its error
    if attn_mask is not None:
        if not isinstance(attn_mask, TensorProxy) or needs_grad(attn_mask):
            return False
        if attn_mask.dtype is not torch.bool and attn_mask.dtype != q.dtype:
            return False
        if attn_mask.ndim > 4:
            return False
    return True


def _float_mask(attn_mask, q):
    """Boolean masks become additive ones (0 where attending, -inf elsewhere), as eager does before the kernel."""
    import fulmen.torch as ltorch

    if attn_mask is None or attn_mask.dtype is not torch.bool:
        return attn_mask
    return ltorch.where(attn_mask, 0.0, -math.inf).to(q.dtype)


def _execution_transform(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False):
    out, _ = sdpa_forward(query, key, value, _float_mask(attn_mask, query), dropout_p, is_causal, scale)
    return out


def _grad_transform(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    from fulmen.transforms.linearize import get_grad, put_grads

    mask = _float_mask(attn_mask, query)
    out, lse = sdpa_forward(query, key, value, mask, dropout_p, is_causal, scale)
    gq, gk, gv = sdpa_backward(get_grad(out), query, key, value, out, lse, mask, dropout_p, is_causal, scale)
    put_grads((query, key, value), (gq, gk, gv))
    return out


sdpa_ex.register_implementation(SDPA_ID, checker=_checker, execution_transform=_execution_transform,
                                grad_transform=_grad_transform)
