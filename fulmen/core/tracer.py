"""The tracer: what the core calls while a trace is being built.

Calling a symbol hands the call to the thread's active tracer (``Symbol.__call__``), as a primitive's ``bind`` in
JAX hands it to the active interpreter. The core needs four things from a tracer, and asks for nothing else:

- ``process_symbol(sym, args, kwargs)``: record one call of ``sym`` and return its output;
- ``capture(x)``: the value a real tensor met while tracing stands for (an input of the trace, or itself);
- ``read_value(kind, proxy, what)``: a tensor's value that Python needs (``bool(t)``, ``t.item()``);
- ``branch()``: a block whose calls stand for no call made outside it (a ``torch.cond`` branch).

``Tracer`` records every call as it is made; transforms trace with it (``tracectx(trace)``). The frontend's tracer
of user programs (``fulmen.frontend.tracing.UserTracer``) subclasses it to turn closures and globals into inputs,
apply autocast, record what the user's code read and copy repeated calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from fulmen.core import meta_corrections
from fulmen.core.proxies import TensorProxy, data_dependent_error, latest
from fulmen.core.symbol import BoundSymbol, Symbol
from fulmen.core.tracectx import current

if TYPE_CHECKING:
    from fulmen.core.trace import Trace


class Tracer:
    """Records every symbol call into ``trace``, its decomposition as the call's subsymbols."""

    #: whether ``capture`` turns real tensors into inputs of the trace (the user-program tracer does)
    captures_tensors = False

    def __init__(self, trace: Trace):
        self.trace = trace

    def process_symbol(self, sym: Symbol, args: tuple, kwargs: dict) -> Any:
        """Record ``sym(*args, **kwargs)`` in the innermost scope of the trace and return its output."""
        if self.trace.has_mutations:  # a value replaced by an in-place update is read as its latest value
            args, kwargs = resolve_latest(args), {k: resolve_latest(v) for k, v in kwargs.items()}
        if sym.normalize is not None:
            args, kwargs = sym.normalize(args, kwargs)
        return record(self.trace, sym, args, kwargs).output

    def capture(self, x: Any) -> Any:
        """What a real tensor met while tracing stands for; this tracer keeps it as a constant of the trace."""
        return x

    def read_value(self, kind: str, proxy: TensorProxy, what: str) -> Any:
        """The value of ``proxy`` that Python asked for (``kind``: "bool", "item", ...): not known while tracing."""
        raise data_dependent_error(what, proxy)

    @contextlib.contextmanager
    def branch(self) -> Iterator[None]:
        """A block whose calls stand for no call made after it (one branch of a ``torch.cond``)."""
        yield


def record(trace: Trace, sym: Symbol, args: tuple, kwargs: dict) -> BoundSymbol:
    """Run ``sym``'s meta on ``args`` in a new scope of ``trace`` and append the resulting bound symbol (the calls
    the meta made are its subsymbols; a prim's meta makes none)."""
    meta = sym.meta
    if meta is None:
        raise NotImplementedError(f"{sym.qualified_name} has no meta function and cannot be traced")
    scope: list[BoundSymbol] = []
    scopes = trace.scopes
    scopes.append(scope)  # for a prim the scope stays empty: it marks "inside a meta"
    try:
        out = meta(*args, **kwargs)
    finally:
        scopes.pop()
    if meta_corrections.corrections and meta in meta_corrections.corrections:
        out = meta_corrections.corrected(meta, args, kwargs, out)  # what its implementation returned
    bsym = BoundSymbol(sym, args, kwargs, out, () if sym.is_prim else tuple(scope), no_grad=not torch.is_grad_enabled())
    if bsym.no_grad:
        _no_history(bsym)
    scopes[-1].append(bsym)
    if sym.post_hook is not None:
        sym.post_hook(bsym)
    return bsym


def _no_history(bsym: BoundSymbol) -> None:
    """Results computed under ``no_grad`` do not require grad, as eager's (code reading ``.requires_grad`` takes
    eager's branch); a result that is an argument itself keeps its flag."""
    args = {id(p) for p in bsym.flat_args}
    for p in bsym.flat_proxy_outs:
        if isinstance(p, TensorProxy) and p.requires_grad and id(p) not in args:
            p.requires_grad = False


def resolve_latest(x: Any) -> Any:
    """``x`` with every proxy an in-place update replaced swapped for its current value."""
    if isinstance(x, TensorProxy):
        return latest(x)
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(resolve_latest(v) for v in x)
    if isinstance(x, list):
        return [resolve_latest(v) for v in x]
    return x


def get_tracer() -> Tracer | None:
    """The tracer of the trace this thread is building, or None."""
    return current.tracer


@contextlib.contextmanager
def tracing(tracer: Tracer) -> Iterator[Tracer]:
    """Make ``tracer`` (and its trace) this thread's current one for the ``with`` block; the enclosing one comes
    back after."""
    state = current
    outer = state.trace, state.tracer
    state.trace, state.tracer = tracer.trace, tracer
    try:
        yield tracer
    finally:
        state.trace, state.tracer = outer


@contextlib.contextmanager
def tracectx(trace: Trace) -> Iterator[Trace]:
    """Record symbol calls into ``trace`` for the ``with`` block, each as it is made (what transforms use)."""
    with tracing(Tracer(trace)):
        yield trace
