"""Torch language: ``torch.nn.functional.scaled_dot_product_attention``.

The decomposition is torch's math path (``_scaled_dot_product_attention_math``): float16/bfloat16 inputs are
computed in float32; query and key are each scaled by sqrt(scale) before the matmul; boolean and causal masks
become 0 / -inf additive masks; the softmax is the "safe" one (a row with every score -inf gives zeros, not
NaN); dropout draws its mask with ``prims.bernoulli`` over the attention weights, the same generator calls
as ATen's dropout, so seeded runs match eager; grouped-query attention repeats each key/value head
(``repeat_interleave`` over the head dim) as torch does with ``enable_gqa=True``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fulmen import clang, prims
from fulmen.core import dtypes
from fulmen.core.symbol import OpTags
from fulmen.core.utils import check
from fulmen.torch.elementwise import add, eq, ge, mul, where
from fulmen.torch.nn import _amax, _dropout_with_noise, _opmath, _to
from fulmen.torch.reductions import softmax
from fulmen.torch.registry import torchsymbol

__all__ = ["scaled_dot_product_attention"]

_DTYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
                torch.bfloat16: "c10::BFloat16", torch.int64: "long int", torch.int32: "int", torch.bool: "bool"}


def _name(dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _repeat_heads(t, repeats: int):
    """repeat_interleave(t, repeats, dim=-3): each head repeated ``repeats`` times in place."""
    if repeats == 1:
        return t
    *batch, heads, s, e = t.shape
    n = len(batch)
    expanded = prims.broadcast_in_dim(t, (*batch, heads, repeats, s, e), (*range(n), n, n + 2, n + 3))
    return clang.reshape(expanded, (*batch, heads * repeats, s, e))


def _causal_mask(length: int, source_length: int, device):
    """Boolean (L, S): position i attends to j <= i (the top-left aligned lower triangle torch builds)."""
    rows = prims.broadcast_in_dim(prims.iota(length, start=0, step=1, device=device, dtype=torch.int64),
                                  (length, source_length), (0,))
    cols = prims.broadcast_in_dim(prims.iota(source_length, start=0, step=1, device=device, dtype=torch.int64),
                                  (length, source_length), (1,))
    return ge(rows, cols)


def _additive(mask, dtype):
    """0 where a boolean mask is true, -inf where false; float masks are converted to ``dtype``."""
    if mask.dtype is torch.bool:
        return where(mask, clang.full((), 0.0, device=mask.device, dtype=dtype), -math.inf)
    return _to(mask, dtype)


def _checks(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
    check(query.dtype == key.dtype == value.dtype, lambda: f"Expected query, key, and value to have the same dtype, "
          f"but got query.dtype: {_name(query.dtype)} key.dtype: {_name(key.dtype)} and value.dtype: "
          f"{_name(value.dtype)} instead.", RuntimeError)
    check(query.ndim >= 2 and key.ndim >= 2 and value.ndim >= 2, lambda: "Expected query, key, and value to all be  "
          f"at least 2 dimensional, but got query.dim: {query.ndim} key.dim: {key.ndim} and value.dim: {value.ndim} "
          "instead.", RuntimeError)
    check(dtypes.is_float_dtype(query.dtype), lambda: f"scaled_dot_product_attention: expected floating point inputs, "
          f"got {query.dtype}", RuntimeError)
    check(0.0 <= dropout_p <= 1.0, lambda: f"dropout probability has to be between 0 and 1, but got {dropout_p}",
          RuntimeError)
    if attn_mask is not None:
        check(attn_mask.dtype is torch.bool or attn_mask.dtype == query.dtype,
              lambda: f"Expected attn_mask dtype to be bool or float or to match query dtype, but got attn_mask.dtype: "
              f"{_name(attn_mask.dtype)} and  query.dtype: {_name(query.dtype)} instead.", RuntimeError)
        # torch's math path refuses the combination (its fused CPU kernel accepts it when the inputs' shapes and
        # strides suit it, which a trace cannot see): refuse it always, as torch documents.
        check(not is_causal, lambda: "_scaled_dot_product_attention: Explicit attn_mask should not be set when "
              "is_causal=True", RuntimeError)
    check(key.shape[-1] == query.shape[-1], lambda: f"scaled_dot_product_attention: query and key must have the same "
          f"embedding size, got {query.shape[-1]} and {key.shape[-1]}", RuntimeError)
    check(key.shape[-2] == value.shape[-2], lambda: f"scaled_dot_product_attention: key and value must have the same "
          f"sequence length, got {key.shape[-2]} and {value.shape[-2]}", RuntimeError)
    if enable_gqa and query.ndim >= 3:
        hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
        check(hk > 0 and hv > 0 and hq % hk == 0 and hq % hv == 0, lambda: "Number of heads in key and value must "
              "divide the number of heads in query", RuntimeError)


@torchsymbol(F.scaled_dot_product_attention, tags=(OpTags.RANDOM_OP,))
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False):
    """softmax(q k^T * scale + mask) v, optionally with dropout on the attention weights.

    Tagged random because ``dropout_p > 0`` draws from torch's generator: two identical calls are never
    merged, and fusion leaves the call (and its draws) in place.
    """
    _checks(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    q, k, v = _opmath(query), _opmath(key), _opmath(value)
    if enable_gqa and query.ndim >= 3:
        k = _repeat_heads(k, query.shape[-3] // key.shape[-3])
        v = _repeat_heads(v, query.shape[-3] // value.shape[-3])
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    factor = math.sqrt(abs(scale))
    q = mul(q, -factor if scale < 0 else factor)
    scores = prims.matmul(q, clang.matrix_transpose(mul(k, factor)))
    length, source_length = query.shape[-2], key.shape[-2]
    if is_causal:
        scores = add(scores, _additive(_causal_mask(length, source_length, query.device), scores.dtype))
    if attn_mask is not None:
        scores = add(scores, _additive(attn_mask, scores.dtype))
    # torch's softmax (not its decomposition): under autodiff it keeps its own rule, aten's _softmax and its
    # backward kernel, so the weights, and what dropout multiplies, are eager's to the bit
    # fully masked rows give zeros (_safe_softmax); their scores are replaced before the softmax too, so that its
    # backward multiplies by those zeros rather than by the NaN weights of an all -inf row (eager's gradient is 0)
    masked = eq(_amax(scores, -1, keepdim=True), -math.inf)
    attn = where(masked, 0.0, softmax(where(masked, 0.0, scores), -1))
    if dropout_p > 0:
        attn = _dropout_with_noise(attn, dropout_p, attn.shape)
    out = prims.matmul(attn, v)
    return _to(out, query.dtype)
