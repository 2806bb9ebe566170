"""Symbols (named operations) and bound symbols (one recorded call of a symbol).

Calling a symbol while a trace is being built hands the call to the thread's tracer (``fulmen.core.tracer``), which
records a ``BoundSymbol``. A composite symbol's ``meta`` (its decomposition) runs in a fresh scope, so everything it
calls is kept as its ``subsymbols``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from fulmen.core.codeutils import Printer, outputs_of, type_comment
from fulmen.core.proxies import Proxy
from fulmen.core.tracectx import current


class OpTags(Enum):
    """Groups of operations that passes match on."""

    ELEMENTWISE = auto()
    REDUCTION = auto()
    SHAPE_OP = auto()
    MATMUL_OP = auto()
    CREATION = auto()
    RANDOM_OP = auto()
    DEVICE_OP = auto()
    SIDE_EFFECT = auto()  # never removed by dead-code elimination
    DONT_DCE = auto()
    FALLBACK = auto()  # an opaque torch call fulmen has no rule for
    NON_DIFFERENTIABLE = auto()
    IN_PLACE = auto()
    VIEW = auto()
    COMMUNICATION = auto()  # exchanges data with other processes: kept, never merged, recomputed, copied or fused
    WAIT = auto()  # waits for a communication's result: scheduled as late as its readers allow
    BOOKKEEPING = auto()  # computes nothing (``del``): never claimed by an executor, carried along by passes
    #: rematerialization may run it again in the backward although its other tags keep it from being recomputed
    #: (FSDP2's parameter all-gather: every rank runs the same backward, and gathering again is what FSDP2 does)
    RECOMPUTABLE = auto()
    #: collectives holding large buffers, one of each symbol in flight at a time with overlap on, as FSDP2 runs them
    #: (``fulmen.executors.partition``). PREFETCH (the parameter all-gather): each starts once the previous one is
    #: waited for, which is as late as its readers allow. ONE_IN_FLIGHT (the gradient reduce-scatter, which holds its
    #: full-size input until its wait): the previous one is waited for as soon as this one can start.
    PREFETCH = auto()
    ONE_IN_FLIGHT = auto()
    CHECKS_VALUES = auto()  # raises on its inputs' values (an index out of bounds): kept while unused, never hidden


class SymbolCalledOutsideTracing(RuntimeError):
    pass


@dataclass(eq=False, slots=True)
class Symbol:
    """A named operation.

    ``meta`` maps proxies to output proxies (for a prim: checks inputs and computes metadata; for a
    composite: the decomposition, which is traced). ``module`` is the prefix traces print (``prims``,
    ``ltorch``, ``torch``). An *executable* symbol has an ``impl`` that generated code calls.

    Every fact a pass or executor reads about a symbol is a declared field below (slots: a misspelt field is an
    ``AttributeError``, read or written); the groups passes match on are its ``tags``.
    """

    name: str
    meta: Callable | None = None
    id: Any = None
    is_prim: bool = False
    tags: tuple = ()
    module: str | None = None
    impl: Callable | None = None
    executor: Any = None
    python_printer: Callable | None = None
    is_fusion: bool = False  # a region a fusion executor made (its impl runs the fused kernel)
    torch_fns: tuple = ()
    post_hook: Callable | None = None  # called with the new BoundSymbol (view ops record their base here)
    normalize: Callable | None = None  # (args, kwargs) -> (args, kwargs) before recording, so calls stay valid
    #: what the torch executor calls for this symbol: a prim's implementation, an opaque torch call, an aten op
    torch_impl: Callable | None = None
    #: the torch executor may run the whole symbol as one call of ``torch_fns[0]`` (and autograd differentiate it)
    torch_executable: bool = False
    #: ``check_trace`` does not run this prim's meta again (it runs user code, or guards values at run time)
    skip_meta_check: bool = False
    #: the signature grad rules bind a call's arguments to, when not ``meta``'s (``register_operator(like=)``)
    like: Callable | None = None
    #: a view op's function run on meta tensors to learn eager's strides and aliasing (default ``torch_fns[0]``)
    view_meta_fn: Callable | None = None
    #: a view op whose outputs alias its input even where the meta tensors' do not say so
    always_alias: bool = False
    #: a view op returning several views that eager makes one view op each (``tensor_split``'s ``narrow``s), so
    #: autograd lets each be written in place, unlike ``split``'s (which it marks as one op's multiple outputs)
    separate_views: bool = False
    doc: str = ""  # one line: what the operation computes
    #: the symbol generated code calls for this one, by the executor that made it (``execution_symbol``): kept on
    #: the symbol, so it dies with it (symbols made per call come and go, and a map keyed by ``id`` would hand a
    #: new one at a reused address a dead one's implementation)
    execution_symbols: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.id is None:
            self.id = self.name
        self.tags = tuple(self.tags or ())

    def __repr__(self) -> str:
        return f"[Symbol name={self.name}]"

    def __hash__(self):
        return id(self)

    @property
    def qualified_name(self) -> str:
        return f"{self.module}.{self.name}" if self.module else self.name

    def __call__(self, *args, **kwargs):
        tracer = current.tracer  # get_tracer(), inlined: this runs for every operation traced
        if tracer is None:
            raise SymbolCalledOutsideTracing(
                f"{self.qualified_name} was called outside of tracing. Symbols record operations into a trace; "
                f"call it from a function compiled with fulmen.jit (or traced with fulmen.trace())."
            )
        return tracer.process_symbol(self, args, kwargs)  # the active tracer decides what is recorded

    def bind(self, *args, output: Any, subsymbols: Sequence[BoundSymbol] = (), **kwargs) -> BoundSymbol:
        """A bound symbol for this symbol without running anything."""
        return BoundSymbol(self, args, kwargs, output, tuple(subsymbols))


class BoundSymbol:
    """One recorded call: symbol, arguments, output and the subsymbols its decomposition produced."""

    __slots__ = ("sym", "args", "kwargs", "output", "subsymbols", "header", "_flat_args", "_flat_outs", "no_grad")

    def __init__(self, sym: Symbol, args: tuple, kwargs: dict, output: Any, subsymbols: tuple = (), header=None,
                 no_grad: bool = False):
        self.no_grad = no_grad  # recorded under torch.no_grad(): autodiff does not differentiate through it
        self.sym = sym
        self.args = tuple(args)
        self.kwargs = dict(kwargs)
        self.output = output
        self.subsymbols = subsymbols
        self.header = header
        self._flat_args = None
        self._flat_outs = None

    # ---- structure ----
    @property
    def flat_args(self) -> list[Proxy]:
        """Every proxy the call reads (positional and keyword), in order, with repeats."""
        if self._flat_args is None:
            self._flat_args = outputs_of((self.args, self.kwargs))
        return self._flat_args

    @property
    def flat_proxy_outs(self) -> list[Proxy]:
        if self._flat_outs is None:
            self._flat_outs = outputs_of(self.output)
        return self._flat_outs

    @property
    def defined_outs(self) -> list[Proxy]:
        """The outputs this call computes: ``flat_proxy_outs`` less those that are its own arguments. A symbol may
        return an input unchanged (``broadcast_tensors`` of a tensor that has the common shape already, ``x.float()``
        of a float32 ``x``); that value keeps its name and is still produced by whatever computed it first."""
        outs = self.flat_proxy_outs
        if not outs:
            return outs
        arg_names = {p.name for p in self.flat_args}
        return [p for p in outs if p.name not in arg_names]

    def from_bsym_swap_proxies(self, swap: dict[str, Proxy], skip_output: bool = False) -> BoundSymbol:
        """A copy with proxies renamed through ``swap`` (keyed by proxy name), recursively in subsymbols."""
        if not swap:
            return self

        def sub(x):
            if isinstance(x, Proxy):
                return swap.get(x.name, x)
            if isinstance(x, tuple) and not hasattr(x, "_fields"):
                return tuple(sub(v) for v in x)
            if isinstance(x, list):
                return [sub(v) for v in x]
            if isinstance(x, dict):
                return {k: sub(v) for k, v in x.items()}
            return x

        return BoundSymbol(
            self.sym, sub(self.args), sub(self.kwargs), self.output if skip_output else sub(self.output),
            tuple(s.from_bsym_swap_proxies(swap, skip_output) for s in self.subsymbols), self.header, self.no_grad,
        )

    # ---- printing ----
    def _output_lhs(self, printer: Printer, unused: set[str] | None) -> str:
        def pr(v):
            if isinstance(v, Proxy):
                return "_" if unused is not None and v.name in unused else v.name
            if isinstance(v, (tuple, list)):
                inner = ", ".join(pr(e) for e in v)
                return f"({inner},)" if len(v) == 1 else f"({inner})"
            return "_"

        out = self.output
        if out is None:
            return ""
        if isinstance(out, Proxy):
            return pr(out)
        if isinstance(out, (tuple, list)) and outputs_of(out):
            return pr(out)
        return ""

    def call_string(self, printer: Printer, unused: set[str] | None = None, name: str | None = None) -> str:
        if self.sym.python_printer is not None:
            return self.sym.python_printer(self, printer)
        parts = [printer(a) for a in self.args]
        parts += [f"{k}={printer(v)}" for k, v in self.kwargs.items()]
        call = f"{name or self.sym.qualified_name}({', '.join(parts)})"
        lhs = self._output_lhs(printer, unused)
        return f"{lhs} = {call}" if lhs else call

    def python_lines(self, printer: Printer | None = None, *, with_subsymbols: bool = True,
                     unused: set[str] | None = None, name: str | None = None) -> list[str]:
        """The call line with type comments, then the decomposition as commented, indented lines."""
        printer = printer if printer is not None else Printer()
        line = self.call_string(printer, unused, name)
        comments = [type_comment(p) for p in self.flat_proxy_outs]
        comments = [c for c in comments if c]
        if OpTags.FALLBACK in self.sym.tags:
            comments.append("fallback: no fulmen rule, runs as one torch call")
        if comments:
            line += "  # " + ", ".join(comments)
        if self.header:
            lines = [f"# {h}" for h in self.header.splitlines()] + [line]
        else:
            lines = [line]
        if with_subsymbols:
            sub_printer = Printer({})
            for s in self.subsymbols:
                for sl in s.python_lines(sub_printer):
                    if sl.startswith(" "):
                        lines.append("  " + sl)
                    else:  # a custom python_printer's text may hold several lines: each stays a comment
                        lines.extend("  # " + piece for piece in sl.splitlines())
        return lines

    def __str__(self) -> str:
        return "\n".join(self.python_lines())

    def __repr__(self) -> str:
        return str(self)
