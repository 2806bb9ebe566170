"""PyTorch's higher-order control-flow operators, traced as eager PyTorch runs them.

``torch.cond``, ``torch._higher_order_ops.while_loop`` and ``torch._higher_order_ops.associative_scan`` take
Python functions. Eager PyTorch runs them on real tensors: ``cond`` calls the branch its predicate picks,
``while_loop`` calls the body while the condition holds, and ``associative_scan`` (mode ``"generic"``) combines
elements pairwise in a fixed tree, the combine function applied to each element (``torch.vmap``). Here the same
calls are made on proxies, so the functions' operations are traced into the program (and differentiated by
fulmen's autodiff, as eager's autograd differentiates what ran). A predicate or condition that is a tensor needs
its value: ``bool()`` on it stops tracing with fulmen's data-dependent error, naming the user's line, as any
Python branch on a tensor does. ``fulmen.frontend.higher_order`` routes the calls here while a program is traced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fulmen.core.proxies import TensorProxy
from fulmen.core.utils import canonicalize_dim, check


def _is_tensor(x: Any) -> bool:
    return isinstance(x, TensorProxy | torch.Tensor)  # a proxy first: it may also be a torch.Tensor


def cond(pred, true_fn: Callable, false_fn: Callable, operands: tuple | list = ()) -> Any:
    """``torch.cond``: ``true_fn(*operands)`` if ``pred`` else ``false_fn(*operands)``."""
    check(isinstance(pred, bool | int | float) or _is_tensor(pred),
          lambda: f"Expected pred to be bool or tensor, but got {pred}.", RuntimeError)
    check(not _is_tensor(pred) or pred.numel() == 1,
          lambda: f"Expected pred to be bool or single-element tensor, but got {pred}.", RuntimeError)
    check(callable(true_fn) and callable(false_fn), lambda: "Expect both branches to be callable.", RuntimeError)
    check(isinstance(operands, tuple | list) and all(_is_tensor(t) for t in pytree.tree_leaves(operands)),
          lambda: "Expect operands to be a tuple of possibly nested dict/list/tuple that only consists of tensor "
          f"leaves, but got {operands}.", RuntimeError)
    return true_fn(*operands) if bool(pred) else false_fn(*operands)


def while_loop(cond_fn: Callable, body_fn: Callable, carried_inputs: tuple | list) -> Any:
    """``torch._higher_order_ops.while_loop``: ``carried = body_fn(*carried)`` while ``cond_fn(*carried)``."""
    check(callable(cond_fn) and callable(body_fn), lambda: "Expect cond_fn and body_fn to be callable.",
          RuntimeError)
    check(isinstance(carried_inputs, tuple | list) and all(
        _is_tensor(t) or isinstance(t, int) for t in pytree.tree_leaves(carried_inputs)),
        lambda: "Expect carried_inputs to be a tuple of possibly nested dict/list/tuple that only consists of "
        f"tensor or int leaves, but got {carried_inputs}.", RuntimeError)
    carried = tuple(carried_inputs)
    while True:
        pred = cond_fn(*carried)
        check(isinstance(pred, bool) or (_is_tensor(pred) and pred.numel() == 1 and pred.dtype is torch.bool),
              lambda: f"cond_fn must return a boolean scalar tensor or a boolean but got {pred}", RuntimeError)
        if not bool(pred):
            return carried
        out = body_fn(*carried)
        out = tuple(out) if isinstance(out, tuple | list) else (out,)
        check(pytree.tree_structure(out) == pytree.tree_structure(carried), lambda: "body_fn should return the "
              f"same pytree as the carried inputs: got {pytree.tree_structure(out)}, expected "
              f"{pytree.tree_structure(carried)}", RuntimeError)
        for new, old in zip(pytree.tree_leaves(out), pytree.tree_leaves(carried)):
            if _is_tensor(old):
                check(_is_tensor(new) and (tuple(new.shape), new.dtype) == (tuple(old.shape), old.dtype),
                      lambda: f"body_fn should return tensors with the metadata of the carried inputs: {new} for "
                      f"{old}", RuntimeError)
        carried = out


def associative_scan(combine_fn: Callable, xs: Any, dim: int, reverse: bool = False,
                     combine_mode: str = "pointwise") -> Any:
    """``torch._higher_order_ops.associative_scan``: the inclusive scan of ``xs`` (a tensor or a pytree of tensors
    of one shape) along ``dim`` with the associative ``combine_fn``.

    The elements are combined in eager's order (``generic_associative_scan``'s tree), the combine function called
    on single elements as ``torch.vmap`` calls it, so values agree with eager to the last bit for elementwise
    combine functions."""
    leaves, spec = pytree.tree_flatten(xs)
    check(callable(combine_fn), lambda: f"Combine_fn must be a callable, but got {combine_fn}", ValueError)
    check(isinstance(dim, int), lambda: "Dim must be an int, but got " + str(type(dim)), ValueError)
    check(isinstance(reverse, bool), lambda: "Reverse must be a bool, but got " + str(type(reverse)), RuntimeError)
    check(combine_mode in ("pointwise", "generic"),
          lambda: f"Combine_mode must either 'pointwise' or 'generic', but got {combine_mode}", ValueError)
    check(len(leaves) > 0, lambda: "Expected at least 1 xs leaf", ValueError)
    check(all(_is_tensor(x) for x in leaves), lambda: "xs leaves must be a Tensor", ValueError)
    check(combine_mode == "generic" or all(x.device.type in ("cuda", "xpu") for x in leaves),
          lambda: "For combine_mode='pointwise', all input tensors need to be on CUDA or XPU", ValueError)
    dim = canonicalize_dim(leaves[0].ndim, dim)
    check(all(x.ndim > dim and x.shape[dim] > 0 for x in leaves),
          lambda: "All xs leaves must at least have 'dim' number of dimensions and scan dimension > 0", ValueError)
    n = leaves[0].shape[dim]
    check(all(x.shape[dim] == n for x in leaves), lambda: "All xs leaves must have the same size along 'dim'",
          ValueError)

    def combine(a: list, b: list) -> list:
        out = pytree.tree_leaves(combine_fn(pytree.tree_unflatten(a, spec), pytree.tree_unflatten(b, spec)))
        check(len(out) == len(a), lambda: f"Combine_fn returned {len(out)} leaves for inputs of {len(a)}",
              RuntimeError)
        return out

    # element i of every leaf; reversed, the scan runs from the last element
    order = range(n - 1, -1, -1) if reverse else range(n)
    elements = [[x.select(dim, i) for x in leaves] for i in order]
    scanned = _tree_scan(combine, elements)
    if reverse:
        scanned = scanned[::-1]
    out = [torch.stack([e[k] for e in scanned], dim) for k in range(len(leaves))]
    return pytree.tree_unflatten(out, spec)


def _tree_scan(combine: Callable[[list, list], list], elems: list[list]) -> list[list]:
    """``torch._higher_order_ops.associative_scan.generic_associative_scan``'s recursion, element by element:
    the same pairs are combined in the same order."""
    n = len(elems)
    if n < 2:
        return elems
    reduced = [combine(elems[2 * k], elems[2 * k + 1]) for k in range(n // 2)]
    odd = _tree_scan(combine, reduced)
    pairs = len(odd) - 1 if n % 2 == 0 else len(odd)
    even = [elems[0]] + [combine(odd[k], elems[2 * k + 2]) for k in range(pairs)]
    out = []
    for k in range(n):
        out.append(even[k // 2] if k % 2 == 0 else odd[k // 2])
    return out
