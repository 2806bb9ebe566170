"""Traces: an ordered list of bound symbols with inputs and an output, printed as runnable Python."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from fulmen.core import meta_corrections
from fulmen.core.bookkeeping import DEL
from fulmen.core.codeutils import Printer, comment_text, outputs_of, sanitize_name, type_comment
from fulmen.core.proxies import Proxy, TensorProxy
from fulmen.core.symbol import BoundSymbol, OpTags
from fulmen.core.symbolic import SymbolBinder
from fulmen.core.tracectx import get_tracectx  # noqa: F401  (where callers have always found it)
from fulmen.core.tracer import tracectx  # noqa: F401  (where callers have always found it)
from fulmen.core.unbacked import shapes_agree


class Trace:
    """A straight-line program: ``args`` (input proxies), ``bound_symbols`` and ``output``.

    ``str(trace)`` is Python source; each line is one operation with its output's device, dtype and shape::

        t1 = ltorch.mul(b, a)  # t1: "cpu f32[2, 2]"
          # t0 = prims.broadcast_in_dim(b, (2, 2), (0, 1))  # t0: "cpu f32[2, 2]"
          # t1 = prims.mul(t0, a)  # t1: "cpu f32[2, 2]"
    """

    def __init__(self, fn_name: str = "computation", *, parent: Trace | None = None):
        self.fn_name = fn_name
        self.args: list[Proxy] = []
        self.bound_symbols: list[BoundSymbol] = []
        self.scopes: list[list[BoundSymbol]] = [self.bound_symbols]
        self.output: Any = None
        self.names: set[str] = set(parent.names) if parent is not None else set()
        self._counters: dict[str, int] = dict(parent._counters) if parent is not None else {}
        self.provenance: str | None = None
        self.elapsed_ms: float | None = None
        self.has_mutations = False
        self.mutations = 0  # in-place updates recorded so far (fulmen.torch.inplace.mutate, register_hook)
        # (old value, new value, index in bound_symbols, index where the user's in-place call began or None) of each
        # in-place update (fulmen.torch.inplace.mutate)
        self.overwritten: list[tuple[Any, Any, int, int | None]] = []
        self.inplace_start: int | None = None  # set while a user's in-place call runs (fulmen.torch.registry)
        self.claims: dict[int, Any] = {}
        self.unused_outputs: set[str] | None = None  # printed as "_" (set by del_last_used)
        # the meta corrections its symbols' outputs were traced with (fulmen.core.meta_corrections)
        self.meta_epoch = parent.meta_epoch if parent is not None else meta_corrections.epoch
        # the ShapeEnv of the trace's symbolic sizes, dynamic or data-dependent (fulmen.core.unbacked.trace_shape_env)
        self.shape_env = parent.shape_env if parent is not None else None
        # torch.utils.checkpoint regions recorded while tracing, copied into the traces derived from this one
        # (fulmen.transforms.checkpoint_regions.CheckpointRegion, recorded by fulmen.frontend.checkpointing)
        self.checkpoint_regions: list = list(parent.checkpoint_regions) if parent is not None else []
        # (leaf proxy, user's line) of each Tensor.requires_grad_() that made a leaf of a tensor made inside
        # (fulmen.torch.hooks, fulmen.frontend.leaves)
        self.leaves_made: list = list(parent.leaves_made) if parent is not None else []

    # ---- names ----
    def make_name(self, prefix: str = "t") -> str:
        n = self._counters.get(prefix, 0)
        while True:
            name = f"{prefix}{n}"
            n += 1
            if name not in self.names:
                break
        self._counters[prefix] = n
        self.names.add(name)
        return name

    def add_name(self, name: str) -> str:
        """Reserve a user-chosen name (an argument name), renaming it when it is taken or reserved."""
        name = sanitize_name(name)
        base, i = name, 0
        while name in self.names:
            name = f"{base}_{i}"
            i += 1
        self.names.add(name)
        return name

    def derive(self, provenance: str, bound_symbols: list[BoundSymbol] | None = None) -> Trace:
        """A new trace with the same signature, names and output; transforms build their result this way."""
        t = Trace(self.fn_name, parent=self)
        t.args, t.output = list(self.args), self.output
        t.bound_symbols = list(bound_symbols) if bound_symbols is not None else []
        t.scopes = [t.bound_symbols]
        t.provenance = provenance
        return t

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.elapsed_ms = (time.perf_counter() - start) * 1e3

    # ---- printing ----
    def signature_names(self) -> list[str]:
        return [a.name for a in self.args]

    def is_execution_trace(self) -> bool:
        """True when every operation has an implementation (the trace is claimed and can be compiled)."""
        return bool(self.bound_symbols) and all(
            b.sym.impl is not None or OpTags.BOOKKEEPING in b.sym.tags for b in self.bound_symbols)

    def python(self, *, printer: Printer | None = None, include_decorator: bool = False) -> str:
        if self.is_execution_trace() and printer is None:
            from fulmen.core.codegen import python_source  # an execution trace prints as the code that runs

            return python_source(self)[0]
        printer = printer if printer is not None else Printer()
        lines: list[str] = []
        if self.provenance:
            took = f" (took {self.elapsed_ms:.0f} milliseconds)" if self.elapsed_ms is not None else ""
            lines.append(f"# Constructed by {comment_text(self.provenance)}{took}")
        lines.append("import torch")
        lines.append("from fulmen.core import devices, dtypes")
        if any(b.sym.module == "ltorch" for b in self.bound_symbols):
            lines.append("import fulmen.torch as ltorch")
        if any(b.sym.module == "prims" for b in self.bound_symbols):
            lines.append("from fulmen import prims")
        if any(b.sym.module == "torchex" for b in self.bound_symbols):
            lines.append("from fulmen.executors.torchex import torchex_namespace as torchex")
        lines.append("")
        imports_end = len(lines)
        if include_decorator:
            lines.append("@torch.no_grad()")
        sig = ", ".join(self.signature_names())
        lines.append(f"def {self.fn_name}({sig}):")
        body: list[str] = []
        for a in self.args:
            c = type_comment(a)
            if c:
                body.append(f"# {c}")
        binder = SymbolBinder(self.bound_symbols, self.output)
        body.extend(binder.lines_for(self.args))
        for bsym in self.bound_symbols:
            body.extend(bsym.python_lines(printer))
            if binder.needed:
                body.extend(binder.lines_for(bsym.flat_proxy_outs))
        body.append(f"return {printer(self.output)}")
        if printer.constants:  # what each constant holds, for a reader
            lines[imports_end:imports_end] = [*printer.constant_comments(), ""]
        lines.extend("  " + ln for ln in body)
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.python()

    def __repr__(self) -> str:
        return self.python()

    def _repr_pretty_(self, p, cycle):  # IPython shows the program, as the seeds do
        p.text(self.python())


class TraceCheckError(AssertionError):
    pass


def check_trace(trace: Trace) -> None:
    """Verify single assignment, use after definition and that every prim's meta agrees with its outputs.

    Tests call this after every transform; it raises ``TraceCheckError`` naming the offending line.
    """
    defined: dict[str, Proxy] = {}
    for a in trace.args:
        if a.name in defined:
            raise TraceCheckError(f"input {a.name} appears twice in the signature of {trace.fn_name}")
        defined[a.name] = a
    deleted: set[str] = set()
    for bsym in trace.bound_symbols:
        for p in bsym.flat_args:
            if p.name not in defined:
                raise TraceCheckError(f"{p.name} is used before it is defined in:\n{bsym}")
            if p.name in deleted:
                raise TraceCheckError(f"{p.name} is used after it was deleted in:\n{bsym}")
        if bsym.sym is DEL:
            deleted.update(p.name for p in bsym.flat_args)
            continue
        for p in bsym.flat_proxy_outs:
            if p.name in defined and defined[p.name] is not p and p.name not in {a.name for a in bsym.flat_args}:
                raise TraceCheckError(f"{p.name} is assigned twice; second time in:\n{bsym}")
            defined[p.name] = p
        _check_meta(bsym)
    for p in outputs_of(trace.output):
        if p.name not in defined:
            raise TraceCheckError(f"output {p.name} is never defined")
        if p.name in deleted:
            raise TraceCheckError(f"output {p.name} is deleted before it is returned")


def _check_meta(bsym: BoundSymbol) -> None:
    """Re-run a prim's meta on its inputs and compare shapes, dtypes and devices with the recorded outputs."""
    sym = bsym.sym
    if not sym.is_prim or sym.meta is None or sym.skip_meta_check:
        return
    scratch = Trace("check")
    with tracectx(scratch):
        try:
            expected = meta_corrections.corrected(sym.meta, bsym.args, bsym.kwargs,
                                                  sym.meta(*bsym.args, **bsym.kwargs))
        except Exception as e:  # a meta that now rejects its own recorded inputs is a broken trace
            raise TraceCheckError(f"meta of {sym.qualified_name} rejects its recorded inputs ({e}) in:\n{bsym}") from e
    got, want = outputs_of(bsym.output), outputs_of(expected)
    if len(got) != len(want):
        raise TraceCheckError(f"{sym.qualified_name} records {len(got)} outputs but its meta gives "
                              f"{len(want)}:\n{bsym}")
    for g, w in zip(got, want):
        if isinstance(g, TensorProxy) and isinstance(w, TensorProxy):
            if not shapes_agree(g.shape, w.shape) or (g.dtype, g.device) != (w.dtype, w.device):
                raise TraceCheckError(
                    f"{g.name} is recorded as {g.type_string()} but the meta of {sym.qualified_name} gives "
                    f"{w.type_string()}:\n{bsym}"
                )
