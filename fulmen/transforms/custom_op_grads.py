"""Gradients of ``torch.library`` custom ops: the op's own ``register_autograd`` formula traced on proxies.

``setup_context`` and ``backward`` run on proxies with a recording ``ctx``, so the backward becomes ordinary fulmen
operations in the backward trace (whether ``setup_context`` saves inputs or outputs). The torch language makes the
ops' symbols (``fulmen.torch.custom_ops``) and tells this module of each one (``when_symbol_made``).
"""

from __future__ import annotations

from collections.abc import Callable

from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import Symbol
from fulmen.core.utils import check
from fulmen.torch.custom_ops import normalize_arguments, when_symbol_made
from fulmen.transforms.linearize import get_grad, needs_grad, put_grad, register_grad


class RecordingContext:
    """Stands for the ``ctx`` of ``setup_context`` / ``backward`` while fulmen traces them: saved tensors are
    proxies, other attributes are kept as set."""

    def __init__(self, needs_input_grad: tuple[bool, ...]):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tuple(tensors)

    def save_for_forward(self, *tensors) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        pass

    def mark_dirty(self, *tensors) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = bool(value)


def _register_autograd_rule(sym: Symbol, opdef) -> None:
    register_grad(sym.id, _grad_transform(sym, opdef))


def _grad_transform(sym: Symbol, opdef) -> Callable:
    def transform(*args, **kwargs):
        out = sym(*args, **kwargs)
        backward_fn = getattr(opdef, "_backward_fn", None)
        if backward_fn is None:
            raise RuntimeError(
                f"Trying to backward through {opdef._qualname} but no autograd formula was registered. "
                "Please use register_autograd to add one."
            )
        inputs, kw = normalize_arguments(opdef, args, kwargs)
        ctx = RecordingContext(tuple(_any(needs_grad, x) for x in inputs))
        setup = getattr(opdef, "_setup_context_fn", None)
        if setup is not None:
            if kw:
                setup(ctx=ctx, inputs=inputs, keyword_only_inputs=kw, output=out)
            else:
                setup(ctx=ctx, inputs=inputs, output=out)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        grads_out = [
            get_grad(o) if isinstance(o, TensorProxy) and (o.dtype.is_floating_point or o.dtype.is_complex) else None
            for o in outs
        ]
        result = backward_fn(ctx, *grads_out)
        result = result if isinstance(result, tuple) else (result,)
        check(
            len(result) == len(inputs),
            lambda: (
                f"the backward of {opdef._qualname} returned {len(result)} "
                f"gradients, but the op has {len(inputs)} inputs"
            ),
            RuntimeError,
        )
        for x, g in zip(inputs, result):
            if isinstance(x, (tuple, list)) and isinstance(g, (tuple, list)):
                for xi, gi in zip(x, g):
                    if isinstance(xi, TensorProxy) and isinstance(gi, TensorProxy):
                        put_grad(xi, gi)
            elif isinstance(x, TensorProxy) and isinstance(g, TensorProxy):
                put_grad(x, g)
        return out

    return transform


def _any(pred: Callable, x) -> bool:
    if isinstance(x, (tuple, list)):
        return any(pred(v) for v in x)
    return pred(x)


when_symbol_made(_register_autograd_rule)
