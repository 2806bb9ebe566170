"""aten graphs (AOTAutograd's forward and backward graphs) as torch-level programs fulmen traces into its own ops.

An aten operation reaching fulmen's tracer has no torch-language symbol: it is recorded as one opaque operation,
which no fusion executor takes. Most operations of a training graph are aten overloads whose torch-level callable
takes the same arguments and computes the same values (``aten.addmm.default`` and ``torch.addmm``); retargeting
those nodes lets fulmen trace them through its own symbols (their decompositions, fusion). The backward kernels
with no torch-level callable (``aten.gelu_backward``) are the aten symbols fulmen's own gradient rules emit
(``fulmen.transforms.grad_ops``), which the fusion executor takes. Any other node stays as it is (opaque).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from fulmen.transforms import grad_ops

_aten = torch.ops.aten

# aten overload -> the torch callable taking the same arguments (positional and keyword) and giving the same result
_SAME_ARGUMENTS: dict[str, Callable] = {
    "view.default": torch.Tensor.view,
    "_unsafe_view.default": torch.reshape,
    "reshape.default": torch.reshape,
    "t.default": torch.t,
    "permute.default": torch.permute,
    "transpose.int": torch.transpose,
    "unsqueeze.default": torch.unsqueeze,
    "squeeze.dim": torch.squeeze,
    "expand.default": torch.Tensor.expand,
    "clone.default": torch.clone,
    "detach.default": torch.detach,
    "mm.default": torch.mm,
    "bmm.default": torch.bmm,
    "addmm.default": torch.addmm,
    "add.Tensor": torch.add,
    "add.Scalar": torch.add,
    "sub.Tensor": torch.sub,
    "mul.Tensor": torch.mul,
    "mul.Scalar": torch.mul,
    "div.Tensor": torch.div,
    "div.Scalar": torch.div,
    "pow.Tensor_Scalar": torch.pow,
    "neg.default": torch.neg,
    "exp.default": torch.exp,
    "tanh.default": torch.tanh,
    "sigmoid.default": torch.sigmoid,
    "rsqrt.default": torch.rsqrt,
    "where.self": torch.where,
    "sum.default": torch.sum,
    "sum.dim_IntList": torch.sum,
    "mean.default": torch.mean,
    "mean.dim": torch.mean,
    "gelu.default": F.gelu,
    "relu.default": torch.relu,
    "silu.default": F.silu,
}

_GRAD_OPS = (
    grad_ops.gelu_backward,
    grad_ops.silu_backward,
    grad_ops.threshold_backward,
    grad_ops.native_layer_norm,
    grad_ops.native_layer_norm_backward,
    grad_ops.softmax,
    grad_ops.softmax_backward,
    grad_ops.log_softmax,
    grad_ops.log_softmax_backward,
    grad_ops.embedding_dense_backward,
)


def _targets() -> dict:
    table = {}
    for name, fn in _SAME_ARGUMENTS.items():
        packet, _, overload = name.partition(".")
        op = getattr(getattr(_aten, packet, None), overload, None)
        if op is not None:
            table[op] = fn
    for sym in _GRAD_OPS:  # declared as the aten op itself: the default overload takes the same arguments
        table[getattr(_aten, sym.name).default] = sym
    return table


_TARGETS: dict | None = None


class TorchCalls(torch.fx.Interpreter):
    """Runs an aten graph calling, for each aten node with a torch-level form, that form instead. Meant to run while
    fulmen traces (once per compilation), not per call."""

    def call_function(self, target, args, kwargs):
        global _TARGETS
        if _TARGETS is None:
            _TARGETS = _targets()
        return super().call_function(_TARGETS.get(target, target), args, kwargs)
