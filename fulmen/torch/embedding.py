"""``F.embedding`` and ``torch.embedding_renorm_``: rows of a weight picked by integer indices.

With ``sparse=True`` and a weight that gets a gradient, the gradient is eager's sparse COO tensor
(``transforms/grad_rules._embedding_rule``; ``transforms/sparse_gradients.py`` keeps it off fused regions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fulmen import clang, prims
from fulmen.core.proxies import TensorProxy, _user_location
from fulmen.core.utils import check
from fulmen.torch.elementwise import add, gt, mul, true_divide, where
from fulmen.torch.inplace import mutate
from fulmen.torch.reductions import vector_norm
from fulmen.torch.registry import register_function, torchsymbol

__all__ = ["embedding"]


@torchsymbol(F.embedding)
def embedding(
    input,
    weight,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
):
    """Rows of ``weight`` picked by the integer ``input``; output shape ``input.shape + (embedding_dim,)``.

    ``padding_idx`` only changes the gradient (that row gets none), so the forward is a plain gather.
    """
    check(weight.ndim == 2, lambda: "'weight' must be 2-D", RuntimeError)
    check(
        input.dtype in (torch.int64, torch.int32),
        lambda: (
            "Expected tensor for argument #1 'indices' to have one of "
            f"the following scalar types: Long, Int; but got {_tensor_type_name(input)} instead (while checking "
            "arguments for embedding)"
        ),
        RuntimeError,
    )
    if padding_idx is not None:
        check(
            -weight.shape[0] <= padding_idx < weight.shape[0],
            lambda: "Padding_idx must be within num_embeddings",
            AssertionError,
        )
    check(
        max_norm is None,
        lambda: (
            "ltorch.embedding takes max_norm=None: F.embedding(max_norm=...) renormalizes "
            "the weight in place first (embedding_renorm_)"
        ),
        NotImplementedError,
    )
    flat = clang.reshape(input, (input.numel(),))
    rows = prims.take(weight, flat, 0)
    return clang.reshape(rows, (*input.shape, weight.shape[1]))


def _embedding(
    input,
    weight,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
):
    """``F.embedding``: with ``max_norm``, eager first renormalizes (in place, under no_grad) the rows of ``weight``
    that ``input`` picks, then looks them up in the updated weight."""
    if max_norm is not None:
        with torch.no_grad():
            embedding_renorm_(weight, input, max_norm, norm_type)
    _check_sparse_gradient(weight, sparse)
    return embedding(input, weight, padding_idx, None, norm_type, scale_grad_by_freq, sparse)


def _check_sparse_gradient(weight, sparse: bool) -> None:
    """``sparse=True`` gives the weight eager's sparse COO gradient (``grad_rules._embedding_rule``), which only a
    program input can receive: a weight computed here would pass it on through other operations' backwards."""
    check(
        not sparse
        or not isinstance(weight, TensorProxy)
        or not (weight.requires_grad and torch.is_grad_enabled())
        or weight.origin in ("input", "input-leaf"),
        lambda: (
            "F.embedding(..., sparse=True) of a weight computed inside the traced function: its sparse "
            f"gradient would flow back through the operations that made it, which fulmen.jit does not trace.\n  at "
            f"{_user_location()}\nLook up rows of the weight as it is passed in (a module's parameter or an argument) "
            "and transform the rows instead, or use sparse=False."
        ),
        NotImplementedError,
    )


def embedding_renorm_(weight, input, max_norm: float, norm_type: float):
    """``torch.embedding_renorm_``: each row of ``weight`` that ``input`` picks whose ``norm_type``-norm exceeds
    ``max_norm`` is scaled by ``max_norm / (norm + 1e-7)``, in place. Eager computes that scale in double
    precision and multiplies the row by it; a row picked twice is scaled once (the same value written twice)."""
    check(
        isinstance(weight, TensorProxy) and weight.ndim == 2,
        lambda: "embedding_renorm_: weight must be a 2-D tensor",
        RuntimeError,
    )
    check(
        input.dtype in (torch.int64, torch.int32),
        lambda: f"embedding_renorm_: indices must be Long or Int, got {input.dtype}",
        RuntimeError,
    )
    flat = clang.reshape(input, (input.numel(),))
    rows = prims.take(weight, flat, 0)
    norms = vector_norm(rows, norm_type, (1,), keepdim=True)
    norms = clang.maybe_convert_to_dtype(norms, torch.float64)
    scale = where(gt(norms, max_norm), true_divide(max_norm, add(norms, 1e-7)), 1.0)
    scaled = mul(rows, clang.maybe_convert_to_dtype(scale, weight.dtype))
    mutate(weight, prims.index_put(weight, [flat], scaled, False))
    return weight


register_function((F.embedding,), _embedding)
register_function((torch.embedding_renorm_,), embedding_renorm_)


def _tensor_type_name(t) -> str:
    names = {
        torch.float32: "Float",
        torch.float64: "Double",
        torch.float16: "Half",
        torch.bfloat16: "BFloat16",
        torch.int64: "Long",
        torch.int32: "Int",
        torch.int16: "Short",
        torch.int8: "Char",
        torch.uint8: "Byte",
        torch.bool: "Bool",
    }
    return f"torch.{names.get(t.dtype, str(t.dtype))}Tensor"


def _torch_embedding(weight, input, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    _check_sparse_gradient(weight, sparse)
    return embedding(input, weight, None if padding_idx == -1 else padding_idx, None, 2.0, scale_grad_by_freq, sparse)


register_function((torch.embedding,), _torch_embedding)
