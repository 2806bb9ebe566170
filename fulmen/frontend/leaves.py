"""Leaves made inside a compiled function: ``w = torch.zeros(3).requires_grad_()``.

Eager makes ``w`` a leaf: the caller gets it back requiring grad, and a backward through anything computed from it
fills ``w.grad``. fulmen's own forward and backward could not do that (its backward returns the gradients of the
program's inputs only), so a program that makes leaves (``fulmen.torch.hooks.make_leaf``) runs as its torch calls
under PyTorch autograd, as a warm-started first call does (``fulmen.frontend.warm_start``): the torch executor alone,
no fused regions, and every gradient is eager's. Where PyTorch autograd would not differentiate the program as eager
does (an operation on values that require grad that is no torch call, one under ``torch.no_grad()``, a grad rule
of the user's, a write to an input of such a value, or a later write to the leaf's memory), the ``requires_grad_()``
call is refused, naming its line. Operations on values that do not require grad only need their values.
"""

from __future__ import annotations

import logging

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol
from fulmen.core.trace import Trace
from fulmen.frontend.warm_start import differentiated_as_in_eager

log = logging.getLogger("fulmen")


def makes_leaves(trace: Trace) -> bool:
    """Whether the traced function made leaves; raises ``NotImplementedError`` where its program could not give
    them eager's gradients."""
    if not trace.leaves_made:
        return False
    where = trace.leaves_made[0][1]
    reason = None
    if any(leaf.replaced_by is not None for leaf, _ in trace.leaves_made):
        reason = "the leaf's memory is written afterwards (through a tensor it views or shares memory with)"
    elif trace.checkpoint_regions:
        reason = "the function has torch.utils.checkpoint regions"
    else:
        bsym = next((b for b in trace.bound_symbols if _reads_grad(b) and not differentiated_as_in_eager(b)), None)
        if bsym is not None:
            reason = (f"the program's {bsym.sym.qualified_name} does not run as a torch call under autograd (an "
                      "in-place update of an input, an operation under torch.no_grad(), or a grad rule of yours)")
    if reason is not None:
        raise NotImplementedError(
            f"Tensor.requires_grad_() on a tensor made inside a function fulmen compiles makes a leaf, which fulmen "
            f"runs under PyTorch autograd, but {reason}.\n  at {where}\nMake the leaf outside the function and pass "
            "it in, or use torch.compile(model, backend=\"fulmen\").")
    log.info("fulmen: the function makes leaves (requires_grad_() at %s): its program runs under PyTorch autograd "
             "with the torch executor", where)
    return True


def _reads_grad(bsym: BoundSymbol) -> bool:
    """Whether ``bsym`` reads a value that requires grad (only such an operation is differentiated)."""
    return any(isinstance(p, TensorProxy) and p.requires_grad for p in bsym.flat_args)
