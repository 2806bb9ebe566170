"""The functional autodiff APIs: ``grad``, ``value_and_grad`` and ``vjp`` of a function.

Inside a trace they differentiate inline (``fulmen.transforms.split.differentiate_inline``); called directly they
compile the differentiated function with ``fulmen.jit``, which is why they live in the frontend.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from fulmen.core.trace import get_tracectx
from fulmen.frontend.jit import JittedFunction
from fulmen.frontend.module import JittedModule
from fulmen.transforms.split import differentiate_inline

__all__ = ["grad", "value_and_grad", "vjp"]


class _Transformed:
    """``grad(f)`` and friends: traced inline inside another trace, compiled with ``fulmen.jit`` otherwise."""

    def __init__(self, fn: Callable, kind: str, executors: Sequence | None = None):
        inner, jit_executors = fn, executors
        if isinstance(fn, JittedFunction):
            inner, jit_executors = fn.fn, fn.executors
        elif isinstance(fn, JittedModule):  # gradients with respect to the call's arguments
            inner, jit_executors = fn.original_module, fn._fulmen_jitted.executors
        self.fn, self.kind = inner, kind
        signature_of = inner.forward if isinstance(inner, torch.nn.Module) else inner
        if kind == "vjp":

            def traced(primals, cotangents):
                return self._traced(primals, cotangents)
        else:

            def traced(*args, **kwargs):
                return self._traced(*args, **kwargs)

            functools.update_wrapper(traced, signature_of)  # argument names in traces come from fn
        self._fulmen_jitted = JittedFunction(traced, jit_executors, disable_torch_autograd=True)
        # gradients by position, as torch.func.grad: f(a, a) differentiates each argument on its own
        self._fulmen_jitted._same_tensors = False
        self.executors = self._fulmen_jitted.executors
        functools.update_wrapper(self, signature_of, updated=())

    def _traced(self, *args, **kwargs):
        if self.kind == "vjp":
            primals, cotangents = args
            out, grads = differentiate_inline(self.fn, tuple(primals), {}, self.executors, cotangents=cotangents)
            return out, grads
        out, grads = differentiate_inline(self.fn, args, kwargs, self.executors)
        return grads if self.kind == "grad" else (out, grads)

    def __call__(self, *args, **kwargs):
        if get_tracectx() is not None:
            return self._traced(*args, **kwargs)
        return self._fulmen_jitted(*args, **kwargs)


def grad(fn: Callable) -> Callable:
    """The gradients of the sum of ``fn``'s (floating point) outputs with respect to every tensor argument.

    Returns a function giving a list with one entry per tensor in the arguments (flattened): the gradient,
    zeros when the output does not depend on it, ``None`` for integer and boolean tensors. ``fn`` may be a
    function or an already-jitted one (its executors are used); ``fulmen.last_traces(grad(fn))`` shows the
    combined forward and backward trace::

        g = fulmen.grad(lambda x, y: (x * y).sin())
        gx, gy = g(x, y)
    """
    return _Transformed(fn, "grad")


def value_and_grad(fn: Callable) -> Callable:
    """Like ``grad``, but the function returns ``(fn's output, gradients)`` (seed 000)::

    out, (grad_logits, grad_labels) = fulmen.value_and_grad(loss_fn)(logits, labels)
    """
    return _Transformed(fn, "value_and_grad")


def vjp(fn: Callable) -> Callable:
    """Vector-Jacobian product in the primals/cotangents form:
    ``vjp(fn)(primals, cotangents) -> (outputs, grads)``.

    ``primals`` is the tuple of ``fn``'s arguments; ``cotangents`` holds one tensor per floating point tensor
    output of ``fn`` (flattened, in order; ``None`` for an output with no cotangent). ``grads`` has one entry
    per tensor in ``primals`` (flattened): the gradient, zeros when unconnected, ``None`` for integer tensors.
    """
    return _Transformed(fn, "vjp")
