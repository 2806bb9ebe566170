"""``Tensor.register_hook`` on a value computed inside a traced function.

Eager PyTorch calls the hook with the gradient of the tensor (summed over all its uses) and passes on what
the hook returns. fulmen records ``t2 = grad_hook(t1, hook)`` and makes ``t2`` the value later uses of the
Python object read (as in-place operations do, see ``fulmen.torch.inplace``), so every use is downstream of
the hook and the gradient reaching ``t1`` is the hook's result. ``grad_hook`` is an opaque op: the torch
executor runs it as an identity through an ``autograd.Function`` whose backward calls the hook, and autodiff
gets its gradient from PyTorch's autograd, so the hook runs at backward time on real gradients, side effects
included.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import torch

from fulmen.core import langctx
from fulmen.core.proxies import TensorProxy, _user_location, latest
from fulmen.core.symbol import OpTags, Symbol
from fulmen.core.trace import get_tracectx
from fulmen.core.utils import check
from fulmen.torch.fallback import opaque_symbol


class _GradHook(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, hook):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        new = ctx.hook(grad)
        return grad if new is None else new, None


def grad_hook(x: torch.Tensor, hook: Callable) -> torch.Tensor:
    """``x`` itself, whose gradient is passed through ``hook`` (as ``x.register_hook(hook)`` would)."""
    return _GradHook.apply(x, hook)


def grad_hook_reading(x: torch.Tensor, hook: Callable, cells: tuple[int, ...], *tensors: torch.Tensor) -> torch.Tensor:
    """``grad_hook`` for a hook whose closure holds tensors the traced function computed (``lambda g: g * mask``):
    the ``cells``-th closure cells hold this call's ``tensors`` instead of the values seen while tracing."""
    closure = list(hook.__closure__)
    for i, t in zip(cells, tensors):
        closure[i] = types.CellType(t)
    bound = types.FunctionType(hook.__code__, hook.__globals__, hook.__name__, hook.__defaults__, tuple(closure))
    bound.__kwdefaults__ = hook.__kwdefaults__
    return _GradHook.apply(x, bound)


def _traced_cells(hook: Callable) -> tuple[tuple[int, ...], list[TensorProxy]]:
    """The closure cells of ``hook`` that hold proxies, and those proxies (their current values); a proxy held
    deeper (in a list the hook closes over) is refused, naming the line."""
    if not isinstance(hook, types.FunctionType) or not hook.__closure__:
        return (), []
    cells, values = [], []
    for i, cell in enumerate(hook.__closure__):
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(v, TensorProxy):
            cells.append(i)
            values.append(latest(v))
        elif isinstance(v, (list, tuple, dict)) and any(
                isinstance(x, TensorProxy) for x in (v.values() if isinstance(v, dict) else v)):
            raise NotImplementedError(
                f"the tensor hook {hook.__qualname__} reads tensors computed by the traced function through the "
                f"{type(v).__name__} {hook.__code__.co_freevars[i]!r}.\n  at {_user_location()}\nClose over the "
                "tensors themselves (one variable each), which fulmen passes to the hook on every call.")
    return tuple(cells), values


class _TracedHookHandle:
    """What ``register_hook`` returns while tracing: the hook is part of the compiled program."""

    def remove(self) -> None:
        check(get_tracectx() is None, lambda: (
            "removing a tensor hook inside a function compiled by fulmen is not supported: the hook is part of the "
            f"compiled program.\n  at {_user_location()}\nRegister it only when it should run."), NotImplementedError)


def _used_since_defined(trc, x: TensorProxy) -> bool:
    return any(p is x for bsym in trc.bound_symbols for p in bsym.flat_args)


def register_hook(t: TensorProxy, hook: Callable) -> _TracedHookHandle:
    trc = get_tracectx()
    check(trc is not None, lambda: "register_hook on a proxy can only be traced", RuntimeError)
    current = latest(t)
    check(current.requires_grad, lambda: "cannot register a hook on a tensor that doesn't require gradient",
          RuntimeError)
    if any(current is p for p in trc.args):
        raise NotImplementedError(
            f"register_hook on an input of a function compiled by fulmen ({current.name}) is not supported.\n"
            f"  at {_user_location()}\nRegister the hook on the tensor before passing it in (it then sees the "
            "gradient of every use, as here), or on a value computed inside the function.")
    if _used_since_defined(trc, current):
        # the hook would miss the gradient of the earlier uses, which eager includes
        raise NotImplementedError(
            f"register_hook on a tensor ({current.name}) that the function already used: fulmen supports hooks "
            f"registered before a tensor's first use.\n  at {_user_location()}\nMove the register_hook call to "
            "right after the line that computes the tensor.")
    cells, tensors = _traced_cells(hook)
    if cells:  # the hook reads this call's values of tensors the function computed (lambda g: g * mask)
        hooked = opaque_symbol(grad_hook_reading)(current, hook, cells, *tensors)
    else:
        hooked = opaque_symbol(grad_hook)(current, hook)
    trc.has_mutations = True  # later uses of `t` read `hooked` (proxies.latest)
    current.replace_with(hooked)
    trc.mutations += 1
    return _TracedHookHandle()


langctx.methods["register_hook"] = register_hook


def retain_grad(t: TensorProxy) -> None:
    """``Tensor.retain_grad`` inside a traced function: refused with the way out. The compiled program's
    intermediates are not tensors autograd keeps, so there is no ``.grad`` to fill."""
    raise NotImplementedError(
        f"Tensor.retain_grad() on {t.name} ({t.type_string()}) inside a function fulmen compiles is not supported.\n"
        f"  at {_user_location()}\nReturn the tensor from the function and call .retain_grad() on the returned "
        "tensor before backward, or register a hook on it (Tensor.register_hook) to see its gradient.")


langctx.methods["retain_grad"] = retain_grad


def _make_leaf_meta(a: TensorProxy) -> TensorProxy:
    check(a.dtype.is_floating_point or a.dtype.is_complex,
          lambda: "only Tensors of floating point and complex dtype can require gradients", RuntimeError)
    return TensorProxy(like=a, requires_grad=True)


#: ``t.requires_grad_()`` of a tensor the program made: run as it is, under PyTorch autograd (the program holding it
#: runs there, fulmen.frontend.leaves), so ``t`` becomes a leaf whose ``.grad`` fills as in eager
make_leaf = Symbol(name="requires_grad_", meta=_make_leaf_meta, id="ltorch.make_leaf", is_prim=True,
                   tags=(OpTags.FALLBACK,), module="torch.Tensor", torch_fns=(torch.Tensor.requires_grad_,),
                   torch_impl=torch.Tensor.requires_grad_)


def requires_grad_(t: TensorProxy, requires_grad: bool = True) -> TensorProxy:
    """``Tensor.requires_grad_`` inside a traced function. Asking for the flag the tensor already has changes
    nothing, as in eager (transformers' ``enable_input_require_grads`` hook asks it of embeddings that already
    require grad, for gradient checkpointing). ``requires_grad_()`` of a tensor made inside makes a leaf, as in
    eager (``make_leaf``); another change raises ``NotImplementedError`` naming the line."""
    current = latest(t)
    if bool(requires_grad) == current.requires_grad:
        return t
    # Eager changes the flag of a leaf: of the caller's tensor (whose later .grad the compiled program would not
    # fill), or of a new leaf made here. The second is recorded and its program runs under PyTorch autograd.
    if _from_parameter_constructor():
        current._is_param = True  # raises the error for nn.Parameter(...) of a traced tensor, naming the line
    trc = get_tracectx()
    is_input = trc is not None and any(current is p for p in trc.args)
    if requires_grad and not is_input and trc is not None and current.is_leaf:
        leaf = make_leaf(current)
        leaf.mark_input(leaf=True, param=False)  # an autograd leaf, as eager's (.grad_fn None, no in-place writes)
        trc.leaves_made.append((leaf, _user_location()))
        trc.has_mutations = True  # later uses of `t` read `leaf` (proxies.latest)
        current.replace_with(leaf)
        trc.mutations += 1
        return t
    what = "an input of a function fulmen compiles" if is_input else "a tensor made inside a function fulmen compiles"
    raise NotImplementedError(
        f"Tensor.requires_grad_({bool(requires_grad)}) on {what} ({t.name}, {t.type_string()}) is not supported: "
        f"eager would change the flag of a leaf whose gradient fulmen's program does not return.\n  at "
        f"{_user_location()}\nSet requires_grad on the tensor before passing it in, or call requires_grad_() on a "
        "tensor the function returns.")


def _from_parameter_constructor() -> bool:
    """Whether ``nn.Parameter.__new__`` is the caller (it calls ``requires_grad_`` on a detached tensor subclass):
    its own error says what to do. Read on the error path only."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == "torch.nn.parameter":
            return True
        frame = frame.f_back
    return False


langctx.methods["requires_grad_"] = requires_grad_


def _differentiating_inside(what: str) -> Callable:
    def refuse(*args, **kwargs):
        raise NotImplementedError(
            f"{what} inside a function fulmen compiles is not supported: the function is traced once into a "
            f"program that fulmen differentiates itself, and traced tensors have no autograd graph to walk.\n"
            f"  at {_user_location()}\nCall it on the compiled function's result instead (loss = f(x); "
            "loss.backward()), use fulmen.grad / fulmen.value_and_grad, or torch.compile(model, backend=\"fulmen\"), "
            "which runs it between compiled graphs.")

    return refuse


langctx.torch_functions[torch.Tensor.backward] = _differentiating_inside("Tensor.backward()")
langctx.torch_functions[torch.autograd.backward] = _differentiating_inside("torch.autograd.backward()")
langctx.torch_functions[torch.autograd.grad] = _differentiating_inside("torch.autograd.grad()")
