"""Sparse gradients in a backward trace: ``F.embedding(..., sparse=True)``, ``F.embedding_bag(..., sparse=True)``
and ``gather(..., sparse_grad=True)`` give their weight eager's sparse COO gradient.

SparseAdam needs one, and user code branches on ``.grad.is_sparse``. A traced value is strided, and a fused region
cannot read a sparse tensor, so ``keep_sparse_gradients`` follows the values these backwards make
(``grad_ops.embedding_sparse_backward``, and the ``autograd_vjp`` of an opaque op called with ``sparse=True`` or
``sparse_grad=True``) through the backward trace: a sum of gradients becomes ``add_sparse_gradients``, which
PyTorch runs as eager's autograd adds gradients (sparse + sparse stays sparse, sparse + dense is dense), and the
gradient is returned to the program's input as it is. Any other reader (the backward of an operation that made the
weight inside the program) is refused, naming the operation: fulmen does not trace sparse tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fulmen.torch as ltorch
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol
from fulmen.core.trace import Trace
from fulmen.prims import PrimIDs
from fulmen.transforms.grad_ops import add_sparse_gradients, autograd_vjp_function, embedding_sparse_backward

#: opaque functions whose backward gives one argument a sparse gradient: (the flag asking for it, the argument's
#: position among the function's tensor arguments)
_SPARSE_GRADIENT_OF = {
    F.embedding_bag: ("sparse", 1),
    torch.gather: ("sparse_grad", 0),
    torch.Tensor.gather: ("sparse_grad", 0),
}


def _sparse_outputs(b: BoundSymbol) -> list:
    """The sparse gradients ``b`` makes."""
    if b.sym.id == embedding_sparse_backward.id:
        return [b.output]
    fn = autograd_vjp_function(b.sym)
    flag, position = _SPARSE_GRADIENT_OF.get(fn, (None, None))
    if flag is None:
        return []
    args, kwargs, _, which = b.args[:4]  # vjp(args, kwargs, cotangents, which, rng_state)
    if kwargs.get(flag) is not True or position not in which:
        return []
    return [b.output[which.index(position)]]


def _names(values) -> list[str]:
    return [p.name for p in values if isinstance(p, TensorProxy)]


def sparse_gradient_refused(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"a sparse gradient (of F.embedding or F.embedding_bag with sparse=True, or gather with sparse_grad=True) "
        f"would flow into the backward of {name}: fulmen.jit hands sparse gradients to the program's inputs only, "
        "as eager does. Look up rows of the weight as it is passed in (a module's parameter, or an argument) and "
        "transform the rows instead, or use sparse=False."
    )


def keep_sparse_gradients(trace: Trace) -> Trace:
    """Sums of sparse gradients run by PyTorch (``add_sparse_gradients``); see the module docstring."""
    sparse: set[str] = set()
    changed = False
    new = []
    for b in trace.bound_symbols:
        read = [n for n in _names(b.flat_args) if n in sparse]
        if read and b.sym.id == ltorch.add.id and len(b.args) == 2 and not b.kwargs:
            b = add_sparse_gradients.bind(*b.args, output=b.output)
            changed = True
            if len(read) == 2:  # the sum of two sparse gradients is sparse
                sparse.add(b.output.name)
        elif read and b.sym.id is not PrimIDs.RETURN:
            raise sparse_gradient_refused(b.sym.qualified_name)
        else:
            sparse.update(_names(_sparse_outputs(b)))
        new.append(b)
    return trace.derive("Sparse gradients kept off fused regions", new) if changed else trace
