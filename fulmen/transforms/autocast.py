"""Autocast: trace under ``torch.autocast`` with the casts eager would apply, made explicit in the trace.

Eager autocast casts the inputs of listed operators at dispatch (to the autocast dtype, to float32, or to
the widest input type) and runs what those operators call internally without casting again. fulmen
applies the same policy to calls made by user code (the outermost calls in the trace); decompositions run
uncasted beneath them, and generated code runs with autocast disabled, so every dtype in the trace is what
actually runs.
"""

from __future__ import annotations

from typing import Any

import torch

from fulmen.core.proxies import TensorProxy

# ids of torch-language symbols by policy; lists follow PyTorch's autocast op reference (CUDA and CPU). A torch
# function fulmen records under another name is listed by that name (F.conv1d is torch.conv1d, F.prelu torch.prelu).
_LOWER_PRECISION_BOTH = {
    "torch.matmul", "torch.mm", "torch.bmm", "torch.addmm", "torch.addbmm", "torch.baddbmm",
    "torch.nn.functional.linear", "torch.conv1d", "torch.conv2d", "torch.conv3d", "torch.conv_transpose1d",
    "torch.conv_transpose2d", "torch.conv_transpose3d", "torch.conv_tbc", "torch.prelu",
    "torch.nn.functional.scaled_dot_product_attention", "torch.linalg.vecdot",
    # not autocast ops themselves but composites that always multiply matrices: eager casts the mm inside
    "torch.chain_matmul", "torch.linalg.multi_dot", "torch.tensordot",
}
#: CUDA's list adds matrix-vector products and einsum; on CPU they run in the input dtype (einsum as a composite:
#: ``CPU_COMPOSITES``)
LOWER_PRECISION_CUDA = _LOWER_PRECISION_BOTH | {"torch.mv", "torch.addmv", "torch.addr", "torch.einsum"}
LOWER_PRECISION_CPU = _LOWER_PRECISION_BOTH
#: Composites eager runs operation by operation under CPU autocast, each operation cast by its own policy (einsum
#: contracts with bmm, cast, or multiplies with mul, not cast): traced as the torch-language calls they make.
CPU_COMPOSITES = {"torch.einsum"}
FLOAT32_CUDA = {
    "torch.acos", "torch.asin", "torch.cosh", "torch.erfinv", "torch.exp", "torch.expm1", "torch.log",
    "torch.log10", "torch.log2", "torch.log1p", "torch.reciprocal", "torch.rsqrt", "torch.sinh", "torch.tan",
    "torch.pow", "torch.nn.functional.softplus", "torch.nn.functional.layer_norm", "torch.nn.functional.group_norm",
    "torch.norm", "torch.nn.functional.nll_loss", "torch.nn.functional.cross_entropy", "torch.softmax",
    "torch.log_softmax", "torch.cumsum",
    "torch.cumprod", "torch.sum", "torch.prod", "torch.logsumexp", "torch.nn.functional.mse_loss",
    "torch.nn.functional.l1_loss", "torch.nn.functional.smooth_l1_loss", "torch.nn.functional.huber_loss",
    "torch.nn.functional.binary_cross_entropy_with_logits", "torch.nn.functional.kl_div",
    "torch.cosine_similarity", "torch.nn.functional.normalize",
}
FLOAT32_CPU = {
    "torch.prod", "torch.nn.functional.binary_cross_entropy", "torch.nn.functional.mse_loss",
    "torch.nn.functional.nll_loss", "torch.nn.functional.cross_entropy", "torch.nn.functional.smooth_l1_loss",
    "torch.nn.functional.l1_loss", "torch.nn.functional.huber_loss", "torch.nn.functional.kl_div",
    "torch.nn.functional.binary_cross_entropy_with_logits",
}
PROMOTE = {
    "torch.cat", "torch.stack", "torch.addcdiv", "torch.addcmul", "torch.atan2", "torch.dot", "torch.index_put",
    "torch.scatter_add", "torch.bilinear",
}


class AutocastPolicy:
    """The casts for one autocast state: the device type it applies to and the lower-precision dtype."""

    def __init__(self, device_type: str, dtype: torch.dtype):
        self.device_type = device_type
        self.dtype = dtype
        cuda = device_type == "cuda"
        self.float32 = FLOAT32_CUDA if cuda else FLOAT32_CPU
        self.lower = LOWER_PRECISION_CUDA if cuda else LOWER_PRECISION_CPU
        self.composites = frozenset() if cuda else CPU_COMPOSITES

    def runs_as_composite(self, sym_id: Any) -> bool:
        """Whether eager runs the symbol as the operations it calls, each cast by its own policy."""
        return sym_id in self.composites

    def target(self, sym_id: Any, args: tuple, kwargs: dict) -> torch.dtype | None:
        if not isinstance(sym_id, str):
            return None
        # opaque (fallback) ops and Tensor-method spellings share the policy of the torch function
        sym_id = sym_id.removeprefix("fallback:").replace("torch.Tensor.", "torch.")
        if sym_id in self.lower:
            return self.dtype
        if sym_id in self.float32:
            return torch.float32
        if sym_id in PROMOTE:
            floats = [a.dtype for a in _tensors((args, kwargs))
                      if a.dtype.is_floating_point and a.dtype != torch.float64]
            if len(set(floats)) > 1:
                widest = floats[0]
                for d in floats[1:]:
                    widest = torch.promote_types(widest, d)
                return widest
        return None

    def cast(self, sym_id: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        dtype = self.target(sym_id, args, kwargs)
        if dtype is None:
            return args, kwargs
        from fulmen import clang

        def conv(x: Any) -> Any:
            if isinstance(x, TensorProxy):
                # as in eager, float64 tensors are never cast
                if (x.dtype.is_floating_point and x.dtype not in (dtype, torch.float64)
                        and x.device.type == self.device_type):
                    return clang.maybe_convert_to_dtype(x, dtype)
                return x
            if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
                return type(x)(conv(v) for v in x)
            return x

        return conv(args), {k: conv(v) for k, v in kwargs.items()}


def _tensors(x: Any) -> list[TensorProxy]:
    from fulmen.core.codeutils import outputs_of

    return [p for p in outputs_of(x) if isinstance(p, TensorProxy)]


def current_policies() -> list[AutocastPolicy]:
    """The autocast states enabled right now (CPU and/or CUDA)."""
    policies = []
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type):
            policies.append(AutocastPolicy(device_type, torch.get_autocast_dtype(device_type)))
    return policies
