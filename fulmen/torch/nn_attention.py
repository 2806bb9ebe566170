"""Torch language: ``torch.nn.functional.multi_head_attention_forward``, the body of ``nn.MultiheadAttention``
and hence of ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``.

The decomposition is torch's own Python function run on proxies, so every option (masks and their merging, the
``is_causal`` hint, ``need_weights``, ``bias_k`` / ``add_zero_attn``, separate projection weights, static keys)
means what it means in eager with the installed torch. Its ``has_torch_function`` check would send the call back
here, so the decomposition is a copy of the function whose globals answer "no" to it (the torch functions it calls
still dispatch on proxies). Those parts (linear, sdpa or baddbmm + softmax + dropout) have rules, so autodiff
differentiates them as usual, and dropout's mask is drawn once, in the forward, as eager draws it (an opaque op's
backward would rerun it and draw another).

``F._none_or_dtype`` (called by ``nn.MultiheadAttention.forward`` and the transformer layers before anything
reaches a torch function) takes proxies as they are (a proxy is a ``torch.Tensor``), so torch's own runs.
``torch.is_floating_point``, which they also call, is answered from the proxy's dtype.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from fulmen.core.symbol import OpTags
from fulmen.torch.registry import register_function, torchsymbol

__all__ = ["multi_head_attention_forward"]

_torch_mha = F.multi_head_attention_forward

# The module and F._canonical_mask ask torch.is_floating_point(mask): a dtype question, answered while tracing
# (as the method ``mask.is_floating_point()`` is), not an opaque op that runs at every call.
register_function((torch.is_floating_point,), lambda input: input.is_floating_point())


def _without_torch_function_check(fn):
    """``fn`` with ``has_torch_function*`` false in its globals: its body runs on proxies instead of dispatching."""
    checks = {name: (lambda *args: False) for name in fn.__code__.co_names if name.startswith("has_torch_function")}
    scope = dict(vars(F), **checks)
    body = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    body.__kwdefaults__ = fn.__kwdefaults__
    return body


_mha_body = _without_torch_function_check(_torch_mha)


@torchsymbol(F.multi_head_attention_forward, tags=(OpTags.RANDOM_OP,))
def multi_head_attention_forward(query, key, value, embed_dim_to_check: int, num_heads: int, in_proj_weight,
                                 in_proj_bias, bias_k, bias_v, add_zero_attn: bool, dropout_p: float, out_proj_weight,
                                 out_proj_bias, training: bool = True, key_padding_mask=None, need_weights: bool = True,
                                 attn_mask=None, use_separate_proj_weight: bool = False, q_proj_weight=None,
                                 k_proj_weight=None, v_proj_weight=None, static_k=None, static_v=None,
                                 average_attn_weights: bool = True, is_causal: bool = False):
    """``(attn_output, attn_weights or None)`` as ``nn.MultiheadAttention`` computes them.

    Tagged random because ``dropout_p > 0`` in training draws from torch's generator (as sdpa is)."""
    return _mha_body(query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias, bias_k, bias_v,
                     add_zero_attn, dropout_p, out_proj_weight, out_proj_bias, training=training,
                     key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
                     use_separate_proj_weight=use_separate_proj_weight, q_proj_weight=q_proj_weight,
                     k_proj_weight=k_proj_weight, v_proj_weight=v_proj_weight, static_k=static_k, static_v=static_v,
                     average_attn_weights=average_attn_weights, is_causal=is_causal)
