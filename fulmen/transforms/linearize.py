"""Linearization: how each forward symbol is differentiated, before any backward is written.

``linearize`` walks forward bound symbols and returns a ``Joint``:

- a tree of ``Node``: each forward symbol, which the forward trace may run whole (``ltorch.gelu`` as one
  call) or by its ``parts`` when the backward needs a value only the parts compute (an intermediate of a
  decomposition, the statistics a rule saves);
- a list of ``Unit`` in forward order: what the backward walk (``autodiff.backward_pass``) calls with
  the cotangents of a unit's outputs to get ``(value, gradient)`` pairs.

A symbol is differentiated by the first entry of the gradient table (``grad_table.py``: an executor's grad
transform, ``register_grad``, a seed-000 augmented forward and backward, fulmen's own rules in ``grad_rules.py``,
a prim's VJP from ``autodiff.py``) that accepts the call, otherwise by PyTorch's autograd for opaque (fallback)
ops, otherwise through its decomposition. The registration functions here write into that table.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from fulmen import clang
from fulmen.core import dtypes
from fulmen.core.codeutils import outputs_of
from fulmen.core.draws import callable_draws
from fulmen.core.proxies import Proxy, TensorProxy, call_with_device_views
from fulmen.core.symbol import BoundSymbol, OpTags, Symbol
from fulmen.core.trace import get_tracectx
from fulmen.core.utils import check
from fulmen.prims import PrimIDs
from fulmen.transforms import grad_ops, grad_table
from fulmen.transforms.grad_table import Convention, GradEntry, Source


class NotDifferentiableError(NotImplementedError):
    """A symbol on the path from an input that requires grad to an output cannot be differentiated."""


def is_differentiable_dtype(dtype: torch.dtype) -> bool:
    return dtypes.is_float_dtype(dtype) or dtypes.is_complex_dtype(dtype)


# ---------------------------------------------------------------------------------------------------------
# the registration APIs: thin adapters that write into the gradient table (grad_table.py)

#: Torch-language symbols that stop gradients (besides those tagged ``OpTags.NON_DIFFERENTIABLE``).
grad_table.mark_non_differentiable("torch.Tensor.detach", "torch.detach")
has_user_rule = grad_table.has_user_rule


def register_grad(sym_or_id: Symbol | str, fn: Callable | None = None):
    """Give a symbol a grad transform (``None`` removes it). ``fn(*args, **kwargs)`` computes the forward,
    reads the output's cotangent with ``get_grad`` and hands inputs theirs with ``put_grad`` / ``put_grads``::

        @register_grad("torch.mul")
        def mymul_grad(a, b):
            out = a * b
            g = get_grad(out)
            put_grads((a, b), (g * b, g * a))
            return out
    """
    if fn is None:
        if isinstance(sym_or_id, (Symbol, str)) and grad_table.get(sym_or_id, Source.REGISTER_GRAD) is not None:
            return grad_table.put(sym_or_id, Source.REGISTER_GRAD, None).rule
        return lambda f: register_grad(sym_or_id, f)
    grad_table.put(sym_or_id, Source.REGISTER_GRAD, GradEntry(fn, Convention.TRANSFORM))
    return fn


def register_augmented_forward(sym_id: Symbol | str) -> Callable:
    """Decorator (seed 000): ``fwd(*args, **kwargs) -> (primal, saved_for_backward)`` replaces the symbol's
    forward when it is differentiated; ``saved_for_backward`` goes to the matching ``register_backward``."""
    def decorator(fn: Callable) -> Callable:
        grad_table.put_augmented(sym_id, forward=fn)
        return fn
    return decorator


def register_backward(sym_id: Symbol | str) -> Callable:
    """Decorator (seed 000): ``bwd(*saved_for_backward, *output_cotangents)`` returns one gradient per parameter
    of the augmented forward, in its signature's order (``None`` for non-tensor or non-differentiable ones)."""
    def decorator(fn: Callable) -> Callable:
        grad_table.put_augmented(sym_id, backward=fn)
        return fn
    return decorator


def builtin_rule(*sym_ids: str, checker: Callable | None = None) -> Callable:
    """fulmen's own grad transforms (``grad_rules.py``): keyed by symbol id, called with ``RuleArgs``; a rule
    may return ``NotImplemented`` (or ``checker`` may refuse) to fall back to the decomposition."""
    def decorator(fn: Callable) -> Callable:
        for sid in sym_ids:
            grad_table.put(sid, Source.BUILTIN, GradEntry(fn, Convention.RULE_ARGS, checker=checker))
        return fn
    return decorator


# ---------------------------------------------------------------------------------------------------------
# get_grad / put_grad: markers recorded while a grad transform runs

_linearizers: list[_Linearizer] = []

GET_GRAD = Symbol(name="get_grad", meta=lambda p: TensorProxy(like=p, requires_grad=False), id="autodiff.get_grad",
                  is_prim=True, module="autodiff")
PUT_GRAD = Symbol(name="put_grad", meta=lambda x, g: None, id="autodiff.put_grad", is_prim=True, module="autodiff")


def _check_in_transform(what: str) -> None:
    check(_linearizers and get_tracectx() is not None,
          lambda: f"{what} can only be called inside a grad transform (a function given to register_grad or an "
          "executor's grad_transform=, run while fulmen differentiates a program)", RuntimeError)


def get_grad(x: TensorProxy) -> TensorProxy:
    """Inside a grad transform: the cotangent of the forward value ``x`` (zeros when it receives none)."""
    _check_in_transform("get_grad")
    check(isinstance(x, TensorProxy), lambda: f"get_grad expects a tensor proxy, got {type(x).__name__}", TypeError)
    return GET_GRAD(x)


def put_grad(x: TensorProxy, g: TensorProxy | None) -> None:
    """Inside a grad transform: add ``g`` to the gradient of ``x`` (``None`` adds nothing)."""
    _check_in_transform("put_grad")
    if g is not None and isinstance(x, TensorProxy):
        PUT_GRAD(x, g)


def put_grads(xs: Sequence, gs: Sequence) -> None:
    """``put_grad`` for each pair of ``xs`` and ``gs``."""
    check(len(xs) == len(gs), lambda: f"put_grads got {len(xs)} values and {len(gs)} gradients", ValueError)
    for x, g in zip(xs, gs):
        put_grad(x, g)


def compute_in_forward(*xs: Any) -> None:
    """Inside a grad rule: compute these values in the forward although only the backward reads them. A rule's
    operations that its outputs do not need otherwise run in the backward; a value marked here is one the
    backward may save instead (rematerialization still recomputes it when saving it costs more memory)."""
    _check_in_transform("compute_in_forward")
    _linearizers[-1].in_forward.update(x.name for x in xs if isinstance(x, TensorProxy))


def needs_grad(x: Any) -> bool:
    """Inside a grad transform: whether a gradient for ``x`` is wanted (it depends on an input being
    differentiated). Rules use it for the ``output_mask`` of aten backward ops."""
    return isinstance(x, TensorProxy) and bool(_linearizers) and x.name in _linearizers[-1].active


class RuleArgs:
    """A call's arguments bound to its symbol's signature (defaults applied), for fulmen's own rules::

        a, eps = p[0], p.get("eps", 1e-5)
    """

    def __init__(self, bsym: BoundSymbol):
        self.bsym = bsym
        self.named: dict[str, Any] = bind_arguments(bsym.sym.like or bsym.sym.meta, bsym)
        self.values = list(self.named.values())

    def __getitem__(self, i: int) -> Any:
        return self.values[i] if i < len(self.values) else None

    def get(self, name: str, default: Any = None) -> Any:
        return self.named.get(name, default)


@functools.lru_cache(maxsize=None)
def _signature(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def bind_arguments(fn: Callable | None, bsym: BoundSymbol) -> dict[str, Any]:
    """``{parameter: value}`` for the call recorded in ``bsym`` bound to ``fn``'s signature."""
    sig = _signature(fn) if fn is not None else None
    if sig is not None:
        try:
            bound = sig.bind(*bsym.args, **bsym.kwargs)
            bound.apply_defaults()
            return dict(bound.arguments)
        except TypeError:
            pass
    return {f"_{i}": v for i, v in enumerate(bsym.args)} | dict(bsym.kwargs)


# ---------------------------------------------------------------------------------------------------------
# nodes and units

@dataclass(eq=False)
class Node:
    """A forward bound symbol that the forward may run whole, or by ``parts`` (``None`` for a leaf)."""

    bsym: BoundSymbol
    parts: list[Node] | None = None
    _internal: set[str] | None = None

    def leaves(self) -> list[BoundSymbol]:
        """The finest-grained symbols of this node (what rematerialization reasons about)."""
        if self.parts is None:
            return [self.bsym]
        return [b for p in self.parts for b in p.leaves()]

    def internal(self) -> set[str]:
        """Values computed by the parts but not returned by the whole symbol."""
        if self._internal is None:
            produced = {p.name for b in self.leaves() for p in b.flat_proxy_outs}
            self._internal = produced - {p.name for p in self.bsym.flat_proxy_outs}
        return self._internal


@dataclass(eq=False)
class Unit:
    """One step of the backward walk: ``backward(cotangents of outputs) -> [(value, gradient), ...]``."""

    outputs: list[TensorProxy]
    backward: Callable[[list], list[tuple[TensorProxy, Any]]]
    name: str = ""


@dataclass
class Joint:
    """A linearized forward: its decomposition tree, its units in forward order and the active value names."""

    nodes: list[Node]
    units: list[Unit]
    active: set[str]
    executors: Sequence = field(default_factory=tuple)


def zeros_like(p: TensorProxy) -> TensorProxy:
    return clang.full(tuple(p.shape), 0, device=p.device, dtype=p.dtype)


def _is_identity(bsym: BoundSymbol) -> bool:
    """A symbol that returned its inputs and computed nothing: cotangents flow through by name."""
    arg_names = {p.name for p in bsym.flat_args}
    return all(p.name in arg_names for p in bsym.flat_proxy_outs)


def _stops_gradient(sym: Symbol) -> bool:
    return OpTags.NON_DIFFERENTIABLE in sym.tags or grad_table.is_non_differentiable(sym.id)


class _Linearizer:
    def __init__(self, active: set[str], executors: Sequence):
        self.active = set(active)
        self.executors = list(executors or ())
        self.units: list[Unit] = []
        self.in_forward: set[str] = set()  # compute_in_forward's values, for the rule running now

    def is_active(self, x) -> bool:
        return isinstance(x, TensorProxy) and x.name in self.active

    def activate(self, bsym: BoundSymbol, as_traced: bool = False) -> None:
        """Mark ``bsym``'s floating outputs as carrying gradient; ``as_traced``: only those whose proxies require
        grad (an opaque op's proxies got eager's flags from running it on fake tensors: ``lu_unpack``'s
        permutation does not require grad, though computed from an input that does)."""
        for p in bsym.flat_proxy_outs:
            if isinstance(p, TensorProxy) and is_differentiable_dtype(p.dtype) and (p.requires_grad or not as_traced):
                self.active.add(p.name)

    def visit(self, bsym: BoundSymbol) -> Node:
        sym = bsym.sym
        if not any(self.is_active(p) for p in bsym.flat_args) or bsym.no_grad or _stops_gradient(sym) \
                or _is_identity(bsym):
            return Node(bsym)
        for entry in grad_table.candidates(sym.id, self.executors):
            node = self._by_entry(bsym, entry)
            if node is not None:
                return node
        if sym.is_prim and isinstance(sym.id, PrimIDs):
            raise NotDifferentiableError(f"prims.{sym.name} has no VJP rule (see fulmen.transforms.autodiff)")
        if OpTags.FALLBACK in sym.tags:
            return self._by_torch_autograd(bsym, sym.torch_impl)
        if bsym.subsymbols:
            n_units, active = len(self.units), set(self.active)
            try:
                return Node(bsym, [self.visit(s) for s in bsym.subsymbols])
            except NotDifferentiableError:
                if not sym.torch_executable:
                    raise
                del self.units[n_units:]
                self.active = active
        if sym.torch_executable and sym.torch_fns:
            return self._by_torch_autograd(bsym, sym.torch_fns[0])
        raise NotDifferentiableError(
            f"fulmen cannot differentiate {sym.qualified_name}: it has no grad rule and no decomposition. Give it "
            f"one with fulmen.transforms.autodiff.register_grad({sym.id!r}, fn), register_augmented_forward / "
            f"register_backward, an executor's grad_transform=, or register_operator(like=...).\n  in: "
            f"{bsym.python_lines(with_subsymbols=False)[0]}")

    # ---- the table's entries ----
    def _by_entry(self, bsym: BoundSymbol, entry: GradEntry) -> Node | None:
        """Differentiate ``bsym`` by one entry of the gradient table; ``None`` when the entry declines the call."""
        conv = entry.convention
        if conv is Convention.VJP:
            self.units.append(Unit(bsym.flat_proxy_outs, functools.partial(_prim_backward, bsym, entry.rule),
                                   bsym.sym.name))
            self.activate(bsym)
            return Node(bsym)
        if conv is Convention.AUGMENTED:
            check(entry.rule is not None and entry.backward is not None,
                  lambda: f"{bsym.sym.id!r} has a registered augmented forward or backward but not both; register "
                  "both with register_augmented_forward and register_backward", RuntimeError)
        elif entry.checker is not None:
            accepted = entry.checker(RuleArgs(bsym)) if conv is Convention.RULE_ARGS else call_with_device_views(
                entry.checker, bsym.args, bsym.kwargs)
            if not accepted:
                return None
        return self._by_transform(bsym, entry)

    # ---- rules that run their own forward ----
    def _by_transform(self, bsym: BoundSymbol, entry: GradEntry) -> Node | None:
        fn, conv = entry.rule, entry.convention
        trc = get_tracectx()
        scope: list[BoundSymbol] = []
        trc.scopes.append(scope)
        _linearizers.append(self)
        outer, self.in_forward = self.in_forward, set()
        try:
            result = fn(RuleArgs(bsym)) if conv is Convention.RULE_ARGS else fn(*bsym.args, **bsym.kwargs)
        finally:
            _linearizers.pop()
            trc.scopes.pop()
            in_forward, self.in_forward = self.in_forward, outer
        if result is NotImplemented:
            return None
        saved = None
        if conv is Convention.AUGMENTED:
            check(isinstance(result, tuple) and len(result) == 2,
                  lambda: f"the augmented forward of {bsym.sym.id!r} must return (primal, saved_for_backward)",
                  TypeError)
            result, saved = result
        got, want = outputs_of(result), bsym.flat_proxy_outs
        check(len(got) == len(want), lambda: f"the grad rule of {bsym.sym.qualified_name} returned {len(got)} values "
              f"but the symbol has {len(want)} outputs", RuntimeError)
        arg_names = {p.name for p in bsym.flat_args}
        if any(g.name in arg_names and g.name != w.name for g, w in zip(got, want)):
            return None  # the rule returned an input unchanged: differentiate the decomposition instead
        swap = {g.name: w for g, w in zip(got, want) if g.name != w.name}
        recorded = [b.from_bsym_swap_proxies(swap) for b in scope]
        saved = _swap_values(saved, swap)
        # what an augmented forward saves is computed in the forward, whether or not its primal needs it
        in_forward |= {p.name for p in outputs_of(saved)}
        forward, rest = _partition(recorded, want, in_forward)
        if conv is Convention.AUGMENTED:
            backward = functools.partial(_augmented_backward, bsym, entry, saved)
        else:
            backward = functools.partial(_replay_backward, rest, list(want))
        self.units.append(Unit(list(want), backward, bsym.sym.name))
        self.activate(bsym)
        return Node(bsym, [Node(b) for b in forward])

    def _by_torch_autograd(self, bsym: BoundSymbol, fn: Callable) -> Node:
        leaves, _ = tree_flatten((bsym.args, bsym.kwargs))
        # positions among the tensor arguments only, as grad_ops.autograd_vjp reads them
        tensors = [x for x in leaves if isinstance(x, TensorProxy)]
        which = tuple(i for i, x in enumerate(tensors) if self.is_active(x))
        parts, state = None, None
        if callable_draws(fn):
            # The backward recomputes the op: it must draw the same random numbers, so snapshot the generator.
            scope: list[BoundSymbol] = []
            get_tracectx().scopes.append(scope)
            try:
                device = next(x.device for x in leaves if isinstance(x, TensorProxy))
                state = grad_ops.rng_state(str(device))
            finally:
                get_tracectx().scopes.pop()
            parts = [Node(scope[0]), Node(bsym)]
        backward = functools.partial(_autograd_backward, bsym, fn, which, state)
        self.units.append(Unit(bsym.flat_proxy_outs, backward, bsym.sym.name))
        self.activate(bsym, as_traced=OpTags.FALLBACK in bsym.sym.tags)
        return Node(bsym, parts)


def _swap_values(x, swap: dict[str, Proxy]):
    if isinstance(x, Proxy):
        return swap.get(x.name, x)
    if isinstance(x, (tuple, list)):
        return type(x)(_swap_values(v, swap) for v in x)
    return x


def _partition(recorded: list[BoundSymbol], outputs: list[Proxy], also: set[str] = frozenset()
               ) -> tuple[list[BoundSymbol], list[BoundSymbol]]:
    """Split what a grad rule recorded into what computes ``outputs`` and the values named in ``also`` (its
    forward) and the rest (its backward)."""
    wanted = {p.name for p in outputs} | set(also)
    in_forward: set[int] = set()
    for i in range(len(recorded) - 1, -1, -1):
        b = recorded[i]
        if b.sym is not GET_GRAD and b.sym is not PUT_GRAD and any(p.name in wanted for p in b.flat_proxy_outs):
            in_forward.add(i)
            wanted.update(p.name for p in b.flat_args)
    return ([b for i, b in enumerate(recorded) if i in in_forward],
            [b for i, b in enumerate(recorded) if i not in in_forward])


# ---- the units' backward functions (called by autodiff.backward_pass inside the backward's trace) ----

def _prim_backward(bsym: BoundSymbol, rule: Callable, cts: list) -> list[tuple]:
    grads = rule(bsym, cts[0] if len(cts) == 1 else tuple(cts))
    pairs = []
    for arg, g in zip(bsym.args, grads):
        if isinstance(arg, (list, tuple)) and isinstance(g, (list, tuple)):
            pairs += [(a, x) for a, x in zip(arg, g) if isinstance(a, TensorProxy) and x is not None]
        elif isinstance(arg, TensorProxy) and g is not None:
            pairs.append((arg, g))
    return pairs


def _replay_backward(recorded: list[BoundSymbol], outputs: list[TensorProxy], cts: list) -> list[tuple]:
    """Emit a grad transform's backward part, its ``get_grad`` placeholders bound to the cotangents."""
    ct_of = {o.name: c for o, c in zip(outputs, cts)}
    swap: dict[str, Proxy] = {}
    pairs = []
    for b in recorded:
        if b.sym is GET_GRAD:
            p = b.args[0]
            c = ct_of.get(p.name)
            swap[b.output.name] = c if c is not None else zeros_like(p)
            continue
        b = b.from_bsym_swap_proxies(swap)
        if b.sym is PUT_GRAD:
            pairs.append((b.args[0], b.args[1]))
        else:
            get_tracectx().scopes[-1].append(b)
    return pairs


def _augmented_backward(bsym: BoundSymbol, entry: GradEntry, saved: Any, cts: list) -> list[tuple]:
    filled = [c if c is not None else zeros_like(o) for c, o in zip(cts, bsym.flat_proxy_outs)]
    saved = saved if isinstance(saved, (tuple, list)) else (saved,)
    grads = entry.backward(*saved, *filled)
    grads = grads if isinstance(grads, (tuple, list)) else (grads,)
    values = list(bind_arguments(entry.rule, bsym).values())
    return [(x, g) for x, g in zip(values, grads) if isinstance(x, TensorProxy) and g is not None]


def _autograd_backward(bsym: BoundSymbol, fn: Callable, which: tuple, state, cts: list) -> list[tuple]:
    if not which:
        return []
    tensors = [x for x in tree_flatten((bsym.args, bsym.kwargs))[0] if isinstance(x, TensorProxy)]
    grads = grad_ops.autograd_vjp(fn)(bsym.args, bsym.kwargs, tuple(cts), which, state)
    return [(tensors[i], g) for i, g in zip(which, grads)]


def linearize(bsyms: Sequence[BoundSymbol], active: set[str], executors: Sequence = ()) -> Joint:
    """Decide how each forward symbol is differentiated. Runs inside the trace context that names new values;
    ``active`` names the inputs whose gradients are wanted."""
    lin = _Linearizer(active, executors)
    _linearizers.append(lin)
    try:
        nodes = [lin.visit(b) for b in bsyms]
    finally:
        _linearizers.pop()
    return Joint(nodes, lin.units, lin.active, executors)
