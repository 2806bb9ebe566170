"""Executors decide who runs each operation of a trace.

An ``OperatorExecutor`` holds implementations keyed by symbol id; a ``FusionExecutor`` groups regions of
a trace into fused callables. ``claim_symbols`` walks a trace in order and gives each bound symbol to the
first executor whose checker accepts it; a symbol nobody claims is replaced by its subsymbols and tried
again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fulmen.core.proxies import Proxy, TensorProxy, call_with_device_views
from fulmen.core.symbol import BoundSymbol, OpTags, Symbol
from fulmen.core.trace import Trace, tracectx
from fulmen.transforms import grad_table
from fulmen.transforms.grad_table import Convention, GradEntry


class ExecutorError(RuntimeError):
    """An executor's checker, transform or implementation failed; the message names executor and symbol."""


@dataclass
class ImplInfo:
    symbol: Symbol | None = None  # the executable symbol that replaces the bound symbol's
    checker: Callable | None = None
    execution_transform: Callable | None = None


class Executor:
    """Something that can run bound symbols. ``name`` is unique among registered executors.

    An executor that rewrites traces declares it in ``steps``: ``fulmen.Step`` objects that every compilation it
    is listed for runs (``fulmen.core.steps``; ``fused_linear_ce`` rewrites linear + cross_entropy with one)."""

    #: the pipeline steps this executor adds (``fulmen.frontend.compile`` runs them)
    steps: tuple = ()

    def __init__(self, name: str, *, version: Any = None):
        self.name = name
        self.version = version

    def can_execute(self, bsym: BoundSymbol) -> bool:
        return False

    def get_grad_transform(self, sym: Symbol) -> Callable | None:
        """The grad transform this executor gave ``sym`` (its entry in the gradient table), if any."""
        entry = grad_table.get(sym, self)
        return entry.rule if entry is not None else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def __reduce_ex__(self, protocol):
        # a registered executor is one per process: pickled by name, it is the same object after loading (code
        # compiled with it pickles with it, fulmen.frontend.jit)
        if _executors.get(self.name) is self:
            return get_executor, (self.name,)
        return super().__reduce_ex__(protocol)


class OperatorExecutor(Executor):
    """Runs individual operations with its own implementations.

    Example (seed 001)::

        myex = OperatorExecutor("myex", version="0.1")
        multimul = myex.register_operator("multimul", like=multimul_like, fn=multimul_impl)
        myex.register_implementation(ltorch.mul, checker=ok, execution_transform=mul_to_multimul)
    """

    def __init__(self, name: str, *, version: Any = None):
        super().__init__(name, version=version)
        self.implmap: dict[Any, ImplInfo] = {}
        self.opmap: dict[str, Symbol] = {}

    # ---- declaring operations ----
    def register_operator(self, name: str, *, meta: Callable | None = None, like: Callable | None = None,
                          fn: Callable, tags: Sequence = (), module: str | None = None,
                          bind_postprocess: Callable | None = None) -> Symbol:
        """A new symbol ``name`` that this executor runs with ``fn``.

        Exactly one of ``meta`` (computes output proxies) or ``like`` (a traceable function with the same
        semantics; gives metadata *and* gradients by decomposition) must be given. ``bind_postprocess(bsym)``, when
        given, is called with each new bound symbol of the operator as it is recorded (to adjust its header, say).
        """
        if (meta is None) == (like is None):
            raise TypeError(f"register_operator({name!r}) on executor {self.name!r} needs exactly one of meta= or "
                            f"like= (got {'both' if meta is not None else 'neither'})")
        if name in self.opmap:
            raise ValueError(f"executor {self.name!r} already has an operator named {name!r}; choose another name")
        if not callable(fn):
            raise TypeError(f"register_operator({name!r}): fn must be callable, got {type(fn).__name__}")
        if bind_postprocess is not None and not callable(bind_postprocess):
            raise TypeError(f"register_operator({name!r}): bind_postprocess must be callable (it receives each new "
                            f"bound symbol), got {type(bind_postprocess).__name__}")
        from fulmen.executors import checked_implementation  # the first call checks fn's outputs against the meta

        sym = Symbol(name=name, meta=meta if meta is not None else like, id=name, is_prim=meta is not None,
                     tags=tuple(tags or ()), module=module, executor=self, post_hook=bind_postprocess,
                     impl=checked_implementation(fn, executor=self.name, symbol=name,
                                                 meta=meta if meta is not None else like,
                                                 corrects=name if meta is not None else None), like=like)
        self.opmap[name] = sym
        self.implmap[name] = ImplInfo(symbol=sym)
        return sym

    def register_implementation(self, sym_or_id: Symbol | Any, op: Symbol | None = None, *,
                                checker: Callable | None = None, execution_transform: Callable | None = None,
                                grad_transform: Callable | None = None) -> None:
        """Run the symbol ``sym_or_id`` with ``op`` (an executable symbol) or through ``execution_transform``.

        ``checker(*args, **kwargs) -> bool`` sees proxies and says whether this executor can take the call.
        ``grad_transform`` replaces the symbol's gradient (see ``fulmen.core.transforms.get_grad``) where
        ``checker`` accepts the call: it is this executor's entry in the gradient table (``grad_table.py``).
        """
        sym_id = sym_or_id.id if isinstance(sym_or_id, Symbol) else sym_or_id
        if op is None and execution_transform is None and grad_transform is None:
            raise TypeError(f"register_implementation for {sym_id!r} on executor {self.name!r} needs op= or "
                            "execution_transform= (or a grad_transform=)")
        self.implmap[sym_id] = ImplInfo(symbol=op, checker=checker, execution_transform=execution_transform)
        entry = GradEntry(grad_transform, Convention.TRANSFORM, checker=checker) if grad_transform else None
        grad_table.put(sym_id, self, entry)

    def implements(self, sym_or_id) -> bool:
        return (sym_or_id.id if isinstance(sym_or_id, Symbol) else sym_or_id) in self.implmap

    def can_execute(self, bsym: BoundSymbol) -> bool:
        info = self.implmap.get(bsym.sym.id)
        if info is None or (info.symbol is None and info.execution_transform is None):
            return False
        if info.checker is None:
            return True
        try:
            return bool(call_with_device_views(info.checker, bsym.args, bsym.kwargs))
        except Exception as e:
            raise ExecutorError(f"the checker of executor {self.name!r} for {bsym.sym.qualified_name} raised "
                                f"{type(e).__name__}: {e}\n  while checking: {bsym.python_lines()[0]}") from e

    def execution_symbol(self, bsym: BoundSymbol) -> Symbol:
        """The executable symbol that runs ``bsym`` (an operator this executor registered is its own)."""
        info = self.implmap[bsym.sym.id]
        return info.symbol if info.symbol is not None else bsym.sym


class FusionExecutor(Executor):
    """Claims regions of a trace and compiles each into one callable.

    Subclasses implement ``can_fuse(bsym)`` and ``fuse_region(bsyms, inputs, outputs) -> BoundSymbol``;
    ``fusion_pass`` groups consecutive fusible symbols without creating dependency cycles.
    """

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        return False

    def can_execute(self, bsym: BoundSymbol) -> bool:
        return self.can_fuse(bsym)

    def fusion_pass(self, trace: Trace) -> Trace:
        return trace


# ---- the registry ----

_executors: dict[str, Executor] = {}
_default_executors: list[Executor] = []
_always: list[Executor] = []  # the torch executor: always available as the last resort


def register_executor(ex: Executor) -> Executor:
    if not isinstance(ex, Executor):
        raise TypeError(f"register_executor expects an Executor, got {type(ex).__name__}")
    existing = _executors.get(ex.name)
    if existing is not None and existing is not ex:
        raise ValueError(f"an executor named {ex.name!r} is already registered; deregister it first or choose "
                         "another name")
    _executors[ex.name] = ex
    return ex


def deregister_executor(ex: Executor | str) -> None:
    name = ex if isinstance(ex, str) else ex.name
    removed = _executors.pop(name, None)
    if removed is not None and removed in _default_executors:
        _default_executors.remove(removed)


#: Executors that ship with fulmen and register themselves when their module is imported.
SHIPPED_EXECUTORS = {
    "inductor": "fulmen.executors.inductor",
    "sdpa": "fulmen.executors.sdpa",
    "cross_entropy": "fulmen.executors.cross_entropy",
    "fused_linear_ce": "fulmen.executors.fused_linear_ce",
}


def get_executor(name: str) -> Executor:
    ex = _executors.get(name)
    if ex is None and name in SHIPPED_EXECUTORS:
        import importlib

        importlib.import_module(SHIPPED_EXECUTORS[name])
        ex = _executors.get(name)
    if ex is None:
        raise ValueError(f"no executor named {name!r}; registered executors are {sorted(_executors)}")
    return ex


def get_all_executors() -> tuple[Executor, ...]:
    return tuple(_executors.values())


def get_default_executors() -> tuple[Executor, ...]:
    return tuple(_default_executors)


def set_default_executors(executors: Sequence[Executor | str]) -> None:
    _default_executors[:] = [resolve_executor(e) for e in executors]


def add_default_executor(ex: Executor | str) -> None:
    ex = resolve_executor(ex)
    if ex in _default_executors:
        _default_executors.remove(ex)
    _default_executors.insert(0, ex)


def get_always_executors() -> tuple[Executor, ...]:
    return tuple(_always)


def resolve_executor(ex: Executor | str) -> Executor:
    if isinstance(ex, Executor):
        return ex
    if isinstance(ex, str):
        return get_executor(ex)
    raise TypeError(f"executors must be Executor objects or registered names, got {type(ex).__name__} ({ex!r})")


def resolve_executors(executors: Sequence[Executor | str] | None, *, add_always: bool = True) -> list[Executor]:
    """The executor list a compilation uses: given (or default) ones in order, then the torch executor."""
    if executors is None:
        chosen = list(_default_executors)
    else:
        if isinstance(executors, (str, Executor)):
            executors = [executors]
        chosen = [resolve_executor(e) for e in executors]
    if add_always:
        for ex in _always:
            if ex not in chosen:
                chosen.append(ex)
    return chosen


# ---- claiming ----

def _swap_outputs(produced: list[BoundSymbol], result: Any, wanted: Any) -> list[BoundSymbol]:
    """Rename the proxies an execution transform returned to the names the trace already uses."""
    swap: dict[str, Proxy] = {}

    def pair(r, w):
        if isinstance(w, Proxy) and isinstance(r, Proxy):
            if r.name != w.name:
                swap[r.name] = w
        elif isinstance(w, (tuple, list)) and isinstance(r, (tuple, list)):
            for a, b in zip(r, w):
                pair(a, b)

    pair(result, wanted)
    return [b.from_bsym_swap_proxies(swap) for b in produced]


def _check_transform_output(ex: Executor, bsym: BoundSymbol, result: Any) -> None:
    from fulmen.core.codeutils import outputs_of

    got, want = outputs_of(result), outputs_of(bsym.output)
    if len(got) != len(want):
        raise ExecutorError(f"the execution transform of executor {ex.name!r} for {bsym.sym.qualified_name} returned "
                            f"{len(got)} tensors, but the symbol has {len(want)} outputs")
    for g, w in zip(got, want):
        if isinstance(g, TensorProxy) and isinstance(w, TensorProxy) and (tuple(g.shape), g.dtype) != (
                tuple(w.shape), w.dtype):
            raise ExecutorError(f"the execution transform of executor {ex.name!r} for {bsym.sym.qualified_name} "
                                f"returned {g.type_string()} where the meta promises {w.type_string()}")


class _Unclaimed(Exception):
    def __init__(self, bsym: BoundSymbol):
        self.bsym = bsym


def claim_symbols(trace: Trace, executors: Sequence[Executor], *, provenance: str = "Transform for execution",
                  fuse: bool = True, _depth: int = 0) -> Trace:
    """Give each bound symbol to the first executor that accepts it, decomposing what nobody takes.

    Symbols a fusion executor accepts stay as they are; with ``fuse`` its fusion pass then groups them into
    regions (the execution pipeline passes ``fuse=False`` and calls ``fuse_regions`` after CSE and DCE)."""
    new = trace.derive(provenance)
    out: list[BoundSymbol] = []

    def visit(bsym: BoundSymbol, depth: int):
        if OpTags.BOOKKEEPING in bsym.sym.tags:
            out.append(bsym)
            return
        for ex in executors:
            if isinstance(ex, FusionExecutor):
                if ex.can_fuse(bsym):
                    out.append(bsym)  # kept as it is; fuse_regions gives it to ex's fusion pass
                    return
                continue
            if not ex.can_execute(bsym):
                if bsym.subsymbols and isinstance(ex, OperatorExecutor) and _runs_decomposition(ex, bsym):
                    # an earlier executor that can run every piece of the decomposition takes precedence over
                    # a later one that runs the whole symbol (seed 002: ltorch.add runs as add_numpy)
                    for s in bsym.subsymbols:
                        visit(s, depth)
                    return
                continue
            info = ex.implmap.get(bsym.sym.id) if isinstance(ex, OperatorExecutor) else None
            if info is not None and info.execution_transform is not None:
                if depth > 8:
                    raise ExecutorError(f"execution transforms of {bsym.sym.qualified_name} keep producing symbols "
                                        "that need further transforms")
                for p in _run_execution_transform(new, ex, bsym, info.execution_transform):
                    if p.sym.executor is not None and p.sym.impl is not None:
                        out.append(p)
                    else:
                        visit(p, depth + 1)
                return
            out.append(_claimed(ex, bsym))
            return
        if bsym.subsymbols:
            for s in bsym.subsymbols:
                visit(s, depth)
            return
        if {p.name for p in bsym.flat_proxy_outs} <= {p.name for p in bsym.flat_args}:
            return  # an identity (x.reshape(x.shape), +x): its decomposition is empty, nothing to run
        raise _Unclaimed(bsym)

    for bsym in trace.bound_symbols:
        try:
            visit(bsym, _depth)
        except _Unclaimed as e:  # name the operation the user wrote; its decomposition shows the prims
            tried = ", ".join(repr(ex.name) for ex in executors) or "none"
            raise RuntimeError(f"Could not find executor for bound symbol {bsym}\n(executors tried: {tried}; "
                               f"none of them runs {e.bsym.sym.qualified_name})") from None
    new.bound_symbols[:] = out
    return fuse_regions(new, executors) if fuse else new


def _claimed(ex: Executor, bsym: BoundSymbol) -> BoundSymbol:
    """``bsym`` as ``ex`` runs it. The claimed symbol is kept as a comment, unless it would print the same line (an
    opaque op, an aten op)."""
    exec_sym = ex.execution_symbol(bsym)
    same = exec_sym is bsym.sym or exec_sym.qualified_name == bsym.sym.qualified_name
    shown = bsym.subsymbols if same else (bsym,)
    return BoundSymbol(exec_sym, bsym.args, bsym.kwargs, bsym.output, shown)


def fuse_regions(trace: Trace, executors: Sequence[Executor]) -> Trace:
    """Run each fusion executor's fusion pass, in order. Before its pass, ``trace.claims`` maps each operation
    the executor can fuse (and nobody has replaced by an execution symbol) to it."""
    for ex in executors:
        if isinstance(ex, FusionExecutor):
            trace.claims = {id(b): ex for b in trace.bound_symbols
                            if OpTags.BOOKKEEPING not in b.sym.tags and ex.can_fuse(b)}
            trace = ex.fusion_pass(trace)
    return trace


def _runs_decomposition(ex: OperatorExecutor, bsym: BoundSymbol) -> bool:
    """True when ``ex`` can run every operation of ``bsym``'s decomposition (recursively)."""
    return all(ex.can_execute(s) or (bool(s.subsymbols) and _runs_decomposition(ex, s)) for s in bsym.subsymbols)


def _run_execution_transform(trace: Trace, ex: Executor, bsym: BoundSymbol, transform: Callable) -> list[BoundSymbol]:
    scratch = Trace("execution_transform", parent=trace)
    with tracectx(scratch):
        try:
            result = transform(*bsym.args, **bsym.kwargs)
        except Exception as e:
            raise ExecutorError(f"the execution transform of executor {ex.name!r} for {bsym.sym.qualified_name} "
                                f"raised {type(e).__name__}: {e}\n  while transforming: "
                                f"{bsym.python_lines()[0]}") from e
    trace.names.update(scratch.names)
    _check_transform_output(ex, bsym, result)
    produced = _swap_outputs(scratch.bound_symbols, result, bsym.output)
    return produced
