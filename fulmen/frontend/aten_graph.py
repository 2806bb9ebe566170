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

from fulmen.frontend.user_frames import user_entry
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
    "softplus.default": F.softplus,
    "remainder.Scalar": torch.remainder,
    "remainder.Tensor": torch.remainder,
    "select.int": torch.select,
    "stack.default": torch.stack,
    "cat.default": torch.cat,
    "copy_.default": torch.Tensor.copy_,
    "split_with_sizes.default": torch.split_with_sizes,
    "zeros.default": torch.zeros,
    "zeros_like.default": torch.zeros_like,
    "ones.default": torch.ones,
    "ones_like.default": torch.ones_like,
    "full.default": torch.full,
    "full_like.default": torch.full_like,
    "empty.memory_format": torch.empty,
    "empty_like.default": torch.empty_like,
    "arange.default": torch.arange,
    "arange.start": torch.arange,
    "arange.start_step": torch.arange,
    "new_zeros.default": torch.Tensor.new_zeros,
    "new_ones.default": torch.Tensor.new_ones,
    "new_full.default": torch.Tensor.new_full,
    "new_empty.default": torch.Tensor.new_empty,
}


# aten overloads whose torch-level form takes its arguments in another order or under other names
def _slice(a, dim=0, start=None, end=None, step=1):
    """``aten.slice.Tensor``: Python's slice semantics along one dim (a view; ``step`` is positive)."""
    dim = dim + a.ndim if dim < 0 else dim
    return a[(slice(None),) * dim + (slice(start, end, step),)]


def _split(a, split_size, dim=0):
    return torch.split(a, split_size, dim)


def _alias(a):
    """``aten.alias``: a view of all of ``a`` with its strides."""
    return a.view(a.shape)


def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """``aten.embedding``: -1 is aten's "no padding index" (``F.embedding`` has already made a negative one
    positive before it calls the aten op)."""
    return F.embedding(
        indices, weight, None if padding_idx == -1 else padding_idx, None, 2.0, scale_grad_by_freq, sparse
    )


def _constant_pad_nd(a, pad, value=0):
    return F.pad(a, pad, "constant", value)


def _convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """``aten.convolution``: the ``convNd`` / ``conv_transposeNd`` call of the weight's dimensionality."""
    n = weight.ndim - 2
    if transposed:
        conv_t = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[n - 1]
        return conv_t(input, weight, bias, stride, padding, output_padding, groups, dilation)
    if any(output_padding):  # ignored by aten without transposed=True; no torch-level call takes it
        return torch.ops.aten.convolution.default(
            input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
        )
    return (F.conv1d, F.conv2d, F.conv3d)[n - 1](input, weight, bias, stride, padding, dilation, groups)


@user_entry  # its torch.full is the program's, made at every call, not a constant made by fulmen while tracing
def _scalar_tensor(s, *, dtype=None, layout=None, device=None, pin_memory=None):
    """``aten.scalar_tensor``: a 0-d tensor of ``s``, of the default dtype whatever the scalar's type."""
    return torch.full((), s, dtype=torch.get_default_dtype() if dtype is None else dtype, device=device)


def _softmax(a, dim, half_to_float):
    return torch.softmax(a, dim, dtype=torch.float32 if half_to_float else None)


def _log_softmax(a, dim, half_to_float):
    return torch.log_softmax(a, dim, dtype=torch.float32 if half_to_float else None)


def _nll_loss_forward(a, target, weight, reduction, ignore_index):
    """``aten.nll_loss_forward``: the loss and the total weight of the targets not ignored (0 without reduction)."""
    loss = F.nll_loss(a, target, weight, ignore_index=ignore_index, reduction=("none", "mean", "sum")[reduction])
    kept = target != ignore_index
    if reduction == 0:
        return loss, a.new_zeros(())
    if weight is None:
        return loss, kept.sum().to(a.dtype)
    return loss, (weight[torch.where(kept, target, 0)] * kept).sum().to(a.dtype)


# For graphs fulmen differentiates (not AOTAutograd's, which are differentiated already): the torch-level forms of
# the aten ops that would otherwise become fulmen's backward-only symbols (``_GRAD_OPS``, which have no grad rule).
_DIFFERENTIABLE: dict[str, Callable] = {
    "_softmax.default": _softmax,
    "_log_softmax.default": _log_softmax,
    "nll_loss_forward.default": _nll_loss_forward,
}


_REARRANGED: dict[str, Callable] = {
    "slice.Tensor": _slice,
    "split.Tensor": _split,
    "alias.default": _alias,
    "embedding.default": _embedding,
    "constant_pad_nd.default": _constant_pad_nd,
    "convolution.default": _convolution,
    "scalar_tensor.default": _scalar_tensor,
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


def _targets(differentiable: bool) -> dict:
    table = {}
    for name, fn in (_SAME_ARGUMENTS | _REARRANGED | (_DIFFERENTIABLE if differentiable else {})).items():
        packet, _, overload = name.partition(".")
        op = getattr(getattr(_aten, packet, None), overload, None)
        if op is not None:
            table[op] = fn
    if not differentiable:
        for sym in _GRAD_OPS:  # declared as the aten op itself: the default overload takes the same arguments
            table[getattr(_aten, sym.name).default] = sym
    return table


_TARGETS: dict[bool, dict] = {}


class TorchCalls(torch.fx.Interpreter):
    """Runs an aten graph calling, for each aten node with a torch-level form, that form instead. Meant to run while
    fulmen traces (once per compilation), not per call. ``differentiable``: the graph is one fulmen will
    differentiate (a Dynamo graph ``make_fx`` retraced), so every op keeps a gradient; otherwise it is one of
    AOTAutograd's forward or backward graphs, whose backward kernels become fulmen's backward symbols."""

    def __init__(self, gm: torch.fx.GraphModule, differentiable: bool = False):
        super().__init__(gm)
        self.differentiable = differentiable

    @user_entry
    def call_function(self, target, args, kwargs):
        table = _TARGETS.get(self.differentiable)
        if table is None:
            table = _TARGETS[self.differentiable] = _targets(self.differentiable)
        return super().call_function(table.get(target, target), args, kwargs)
