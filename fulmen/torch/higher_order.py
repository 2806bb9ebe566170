"""PyTorch's higher-order control-flow operators, traced as eager PyTorch runs them.

``torch.cond``, ``torch._higher_order_ops.while_loop`` and ``torch._higher_order_ops.associative_scan`` take
Python functions. Eager PyTorch runs them on real tensors: ``cond`` calls the branch its predicate picks,
``while_loop`` calls the body while the condition holds, and ``associative_scan`` (mode ``"generic"``) combines
elements pairwise in a fixed tree, the combine function applied to each element (``torch.vmap``). Here the same
calls are made on proxies, so the functions' operations are traced into the program (and differentiated by
fulmen's autodiff, as eager's autograd differentiates what ran). ``cond`` with a tensor predicate traces both
branches and selects; ``while_loop`` with a tensor condition runs eager's loop as one opaque op (their
docstrings). ``fulmen.frontend.higher_order`` routes the calls here while a program is traced.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fulmen import clang, prims
from fulmen.core.draws import draws
from fulmen.core.proxies import TensorProxy, _user_location
from fulmen.core.symbol import OpTags, Symbol
from fulmen.core.trace import get_tracectx
from fulmen.core.tracer import get_tracer
from fulmen.core.utils import canonicalize_dim, check
from fulmen.torch.elementwise import logical_not, ne, where
from fulmen.torch.fallback import _fake_meta as fake_meta
from fulmen.torch.registry import torchsymbol

_loops = itertools.count()


def _is_tensor(x: Any) -> bool:
    return isinstance(x, TensorProxy | torch.Tensor)  # a proxy first: it may also be a torch.Tensor


@torchsymbol(id="ltorch.cond_gate")
def cond_gate(a: TensorProxy, taken: TensorProxy) -> TensorProxy:
    """``a`` as one branch of a ``torch.cond`` with a tensor predicate reads it; ``taken`` (a bool scalar) says
    whether the predicate picks that branch. Its gradient is ``a``'s cotangent where ``taken``, else zeros
    (``fulmen.transforms.grad_rules``): selected, not multiplied, so what the other branch's backward computes
    (NaN or inf from values it would not have seen in eager) never reaches ``a``."""
    return prims.reshape(a, tuple(a.shape))


def cond(pred, true_fn: Callable, false_fn: Callable, operands: tuple | list = ()) -> Any:
    """``torch.cond``: ``true_fn(*operands)`` if ``pred`` else ``false_fn(*operands)``.

    A tensor predicate's value is not known while tracing: both branches are traced, each reading its inputs
    (the operands, and the tensors it reads from elsewhere: module parameters, closures) through ``cond_gate``,
    and each output is ``where(pred, true_out, false_out)``, which is the branch eager takes, to the bit, with its
    gradients. Branches that write in place or draw random numbers cannot run both: refused."""
    check(isinstance(pred, bool | int | float) or _is_tensor(pred),
          lambda: f"Expected pred to be bool or tensor, but got {pred}.", RuntimeError)
    check(not _is_tensor(pred) or pred.numel() == 1,
          lambda: f"Expected pred to be bool or single-element tensor, but got {pred}.", RuntimeError)
    check(callable(true_fn) and callable(false_fn), lambda: "Expect both branches to be callable.", RuntimeError)
    check(isinstance(operands, tuple | list) and all(_is_tensor(t) for t in pytree.tree_leaves(operands)),
          lambda: "Expect operands to be a tuple of possibly nested dict/list/tuple that only consists of tensor "
          f"leaves, but got {operands}.", RuntimeError)
    if not _is_tensor(pred):
        return true_fn(*operands) if pred else false_fn(*operands)
    trc = get_tracectx()
    if not isinstance(pred, TensorProxy):
        pred = get_tracer().capture(pred)  # a real tensor the code holds (a global): read at every call
    pred = clang.reshape(pred, ())
    if pred.dtype is not torch.bool:
        pred = ne(pred, 0)
    true_out = _branch(trc, true_fn, operands, pred, "true_fn")
    false_out = _branch(trc, false_fn, operands, logical_not(pred), "false_fn")
    true_leaves, true_spec = pytree.tree_flatten(true_out)
    false_leaves, false_spec = pytree.tree_flatten(false_out)
    check(true_spec == false_spec, lambda: "Unmatched output spec from torch.cond branches: true branch tree_spec "
          f"{true_spec} vs false branch tree_spec {false_spec}.", RuntimeError)
    out = []
    for t, f in zip(true_leaves, false_leaves):
        check(_is_tensor(t) and _is_tensor(f), lambda: f"torch.cond branches must return tensors, got {t} and {f}",
              RuntimeError)
        check((tuple(t.shape), t.dtype, t.device) == (tuple(f.shape), f.dtype, f.device),
              lambda: f"torch.cond branches returned tensors with different metadata: {t} and {f}", RuntimeError)
        out.append(where(pred, t, f))
    return pytree.tree_unflatten(out, true_spec)


def _branch(trc, fn: Callable, operands, taken: TensorProxy, name: str) -> Any:
    """``fn(*operands)`` traced with every tensor it reads that requires grad behind ``cond_gate(tensor, taken)``."""
    scope, mutations = trc.scopes[0], trc.mutations
    start = len(scope)
    with get_tracer().branch():
        out = fn(*operands)
    recorded = scope[start:]
    check(trc.mutations == mutations, lambda: f"the {name} of a torch.cond with a tensor predicate writes to a "
          f"tensor in place; fulmen traces both branches of such a cond, so they must not write in place (at "
          f"{_user_location()}). Assign the result instead.", NotImplementedError)
    check(not any(map(draws, recorded)), lambda: f"the {name} of a torch.cond with a tensor predicate "
          f"draws random numbers; fulmen traces both branches of such a cond, and eager draws only in the one it "
          f"takes (at {_user_location()}).", NotImplementedError)
    made = {p.name for b in recorded for p in b.flat_proxy_outs}
    read = {}
    for b in recorded:
        for p in b.flat_args:
            if isinstance(p, TensorProxy) and p.name not in made:
                read.setdefault(p.name, p)
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, TensorProxy) and leaf.name not in made:
            read.setdefault(leaf.name, leaf)  # returned as it was read (lambda x: x)
    del scope[start:]
    swap = {n: cond_gate(p, taken) for n, p in read.items() if p.requires_grad}  # only gradients need it
    scope.extend(b.from_bsym_swap_proxies(swap, skip_output=True) for b in recorded)
    return pytree.tree_map(lambda v: swap.get(v.name, v) if isinstance(v, TensorProxy) else v, out)


def while_loop(cond_fn: Callable, body_fn: Callable, carried_inputs: tuple | list) -> Any:
    """``torch._higher_order_ops.while_loop``: ``carried = body_fn(*carried)`` while ``cond_fn(*carried)``.

    A condition that is a Python value unrolls the loop into the trace. A tensor condition's value is not known
    while tracing: the loop becomes one opaque op that runs eager's loop on the real tensors at every call (and is
    differentiated by PyTorch's autograd, as eager's). Its functions must then read no traced tensor other than the
    carried ones (autograd could not give the others gradients): refused otherwise."""
    check(callable(cond_fn) and callable(body_fn), lambda: "Expect cond_fn and body_fn to be callable.",
          RuntimeError)
    check(isinstance(carried_inputs, tuple | list) and all(
        _is_tensor(t) or isinstance(t, int) for t in pytree.tree_leaves(carried_inputs)),
        lambda: "Expect carried_inputs to be a tuple of possibly nested dict/list/tuple that only consists of "
        f"tensor or int leaves, but got {carried_inputs}.", RuntimeError)
    carried = tuple(carried_inputs)
    trc = get_tracectx()
    while True:
        start, mutations = len(trc.scopes[0]), trc.mutations
        pred = cond_fn(*carried)
        _check_condition(pred)
        if _is_tensor(pred):
            check(trc.mutations == mutations, lambda: "the cond_fn of a while_loop writes to a tensor in place (at "
                  f"{_user_location()}); a condition must not have side effects.", NotImplementedError)
            del trc.scopes[0][start:]  # the opaque op evaluates the condition itself, at every call
            return _opaque_loop(cond_fn, body_fn, carried)
        if not pred:
            return carried
        out = body_fn(*carried)
        out = tuple(out) if isinstance(out, tuple | list) else (out,)
        _check_body_output(out, carried)
        carried = out


def _check_condition(pred) -> None:
    check(isinstance(pred, bool) or (_is_tensor(pred) and pred.numel() == 1 and pred.dtype is torch.bool),
          lambda: f"cond_fn must return a boolean scalar tensor or a boolean but got {pred}", RuntimeError)


def _check_body_output(out: tuple, carried: tuple) -> None:
    check(pytree.tree_structure(out) == pytree.tree_structure(carried), lambda: "body_fn should return the "
          f"same pytree as the carried inputs: got {pytree.tree_structure(out)}, expected "
          f"{pytree.tree_structure(carried)}", RuntimeError)
    for new, old in zip(pytree.tree_leaves(out), pytree.tree_leaves(carried)):
        if _is_tensor(old):
            check(_is_tensor(new) and (tuple(new.shape), new.dtype) == (tuple(old.shape), old.dtype),
                  lambda: f"body_fn should return tensors with the metadata of the carried inputs: {new} for {old}",
                  RuntimeError)


def _opaque_loop(cond_fn: Callable, body_fn: Callable, carried: tuple) -> Any:
    leaves, spec = pytree.tree_flatten(carried)
    check(all(_is_tensor(x) for x in leaves), lambda: "while_loop with a tensor condition carries Python ints, whose "
          "values after the loop are not known while fulmen traces the program; carry them as tensors "
          f"(torch.tensor(i)).\n  at {_user_location()}", NotImplementedError)

    def run(*flat):
        state = pytree.tree_unflatten(list(flat), spec)
        while cond_fn(*state):  # eager's loop (while_loop_dense), on the real tensors
            state = tuple(body_fn(*state))
        return tuple(pytree.tree_leaves(state))

    run.__name__ = run.__qualname__ = "while_loop"
    run.draws_random = True  # its backward runs it again: with the random numbers it drew, if it draws any

    def meta(*flat):
        # the functions run once on fake tensors: they must accept the carried values and read no other traced
        # tensor (reading one records it into this op's scope)
        scope = get_tracectx().scopes[-1]
        try:
            fake_meta(lambda *f: (cond_fn(*pytree.tree_unflatten(list(f), spec)),
                                  body_fn(*pytree.tree_unflatten(list(f), spec))), "while_loop")(*flat)
        except Exception as e:
            if scope:
                raise _reads_traced("while_loop") from e
            raise
        if scope:
            raise _reads_traced("while_loop")
        return tuple(TensorProxy(like=x) for x in flat)

    sym = Symbol(name="while_loop", meta=meta, id=f"fallback:while_loop:{next(_loops)}", is_prim=True,
                 tags=(OpTags.FALLBACK,), torch_fns=(run,), torch_impl=run,
                 skip_meta_check=True)  # its meta runs user functions; the first run's outputs are checked
    return pytree.tree_unflatten(list(sym(*leaves)), spec)


def _reads_traced(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"{name} with a tensor condition runs as one op, whose cond_fn and body_fn here read tensors of the traced "
        "program they are not given (a module's parameters, or tensors they close over); autograd could not give "
        f"those gradients.\n  at {_user_location()}\nCarry those tensors in carried_inputs instead.")


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


# ---- the operators themselves, as Dynamo's graphs call them (torch.compile(backend="fulmen")) ----


def cond_op(pred, true_fn: Callable, false_fn: Callable, operands) -> Any:
    return cond(pred, true_fn, false_fn, tuple(operands))


def while_loop_op(cond_fn: Callable, body_fn: Callable, carried_inputs, additional_inputs=(), *,
                  mutated_arg_indices: str = "") -> Any:
    """The operator's functions take ``(*carried, *additional)``; the additional inputs (lifted parameters) are
    carried through the loop unchanged, so a loop run as one op receives them as its inputs."""
    check(not mutated_arg_indices, lambda: f"while_loop writes to its inputs in place ({mutated_arg_indices}); "
          "fulmen runs loops on their values: return the new values instead", NotImplementedError)
    carried, extra = tuple(carried_inputs), tuple(additional_inputs)
    if not extra:
        return while_loop(cond_fn, body_fn, carried)
    n = len(carried)
    out = while_loop(lambda *c: cond_fn(*c), lambda *c: (*body_fn(*c), *c[n:]), carried + extra)
    return tuple(out[:n])
