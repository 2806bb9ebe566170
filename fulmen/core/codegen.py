"""Turn an execution trace into a Python function: print it, ``exec`` it once, keep the callable.

The generated source is registered with ``linecache`` so a failing operation shows its trace line in
the traceback.
"""

from __future__ import annotations

import linecache
import math
from collections.abc import Callable
from itertools import count
from typing import Any

import torch

from fulmen.core import devices, dtypes
from fulmen.core.bookkeeping import is_bookkeeping
from fulmen.core.codeutils import Printer, comment_text, sanitize_name
from fulmen.core.symbol import Symbol
from fulmen.core.symbolic import SymbolBinder
from fulmen.core.trace import Trace

_counter = count()
_ROOTS = {"torch": torch}


def _resolve(qualified: str) -> Any:
    parts = qualified.split(".")
    obj = _ROOTS.get(parts[0])
    for p in parts[1:]:
        if obj is None:
            return None
        obj = getattr(obj, p, None)
    return obj


def _is_dotted_identifier(qualified: str) -> bool:
    return all(part.isascii() and part.isidentifier() for part in qualified.split("."))


class _ExecPrinter:
    """Gives each executable symbol a printed name that resolves, in the generated module, to its impl: the
    torch function it is (``torch.mul``), or a name bound to the impl in ``ctx`` that no value of the trace
    (``reserved``) uses."""

    def __init__(self, ctx: dict[str, Any], reserved: set[str]):
        self.ctx = ctx
        self.reserved = reserved
        self.names: dict[int, str] = {}

    def name_for(self, sym: Symbol) -> str:
        name = self.names.get(id(sym))
        if name is not None:
            return name
        qualified = sym.qualified_name
        if sym.impl is None:
            raise RuntimeError(f"{qualified} has no implementation; claim the trace with executors before "
                               "generating code")
        if not _is_dotted_identifier(qualified):
            name = None
        elif sym.module and sym.module.split(".")[0] == "torch" and _resolve(qualified) is sym.impl:
            name = qualified
        elif sym.module in _NAMESPACES and getattr(_NAMESPACES[sym.module], sym.name, None) is sym.impl:
            self.ctx[sym.module] = _NAMESPACES[sym.module]
            name = qualified
        else:
            name = None
        if name is None:
            base = sanitize_name(sym.name)
            name, i = base, 0
            while name in self.reserved or (name in self.ctx and self.ctx[name] is not sym.impl):
                i += 1
                name = f"{base}_{i}"
            self.ctx[name] = sym.impl
        self.names[id(sym)] = name
        return name


_FIXED_GLOBALS = ("torch", "devices", "dtypes", "inf", "nan", "math", "torchex")

#: Objects generated code reaches executors' functions through, by the module prefix traces print
#: (``torchex.broadcast_in_dim(...)``); an executor registers its own (``register_namespace``).
_NAMESPACES: dict[str, Any] = {}


def register_namespace(prefix: str, namespace: Any) -> None:
    """Let generated code call ``prefix.<name>`` for symbols printed under ``prefix`` whose impl is
    ``namespace.<name>``. ``prefix`` must be a global no value of a trace is named (``_FIXED_GLOBALS``)."""
    if prefix not in _FIXED_GLOBALS:
        raise ValueError(f"register_namespace: {prefix!r} is not a name generated code reserves for its globals "
                         f"({', '.join(_FIXED_GLOBALS)})")
    _NAMESPACES[prefix] = namespace


def _value_names(trace: Trace) -> set[str]:
    """Every name the trace's values (its inputs and what each operation reads and defines) are bound to."""
    names = set(trace.names)
    names.update(p.name for p in trace.args)
    for bsym in trace.bound_symbols:
        names.update(p.name for p in bsym.flat_args)
        names.update(p.name for p in bsym.flat_proxy_outs)
    clash = names.intersection(_FIXED_GLOBALS)
    if clash:  # sanitize_name keeps users' names off these; a transform that named a value so is a bug
        raise RuntimeError(f"trace {trace.fn_name} names values {sorted(clash)}, which generated code needs for "
                           "its own globals")
    return names


#: The name under which a program's globals hold its trace's ``meta_epoch`` (read by executors' output checks).
META_EPOCH = "__fulmen_meta_epoch__"


def python_source(trace: Trace, ctx: dict[str, Any] | None = None, *, comments: bool = True
                  ) -> tuple[str, dict[str, Any]]:
    """Source of an execution trace and the globals it needs (torch, implementations, constants). Without
    ``comments`` the source leaves out type comments' companions: the decompositions under each call.

    Values reach the code only as names bound in the returned namespace or as literals of plain builtin types
    (``Printer``); every name is a legal identifier, distinct, after Python's NFKC normalization, from every
    other name the code uses."""
    ctx = ctx if ctx is not None else {}
    # math: symbolic ints print their floor and ceiling as math.floor(...) (torch's PythonPrinter)
    ctx.update({"torch": torch, "devices": devices, "dtypes": dtypes, "inf": math.inf, "nan": math.nan, "math": math,
                META_EPOCH: trace.meta_epoch})
    reserved = _value_names(trace)
    fn_name = sanitize_name(trace.fn_name)
    reserved.add(fn_name)  # a global of the module: no constant or implementation may take its name
    printer = Printer(ctx, reserved)
    names = _ExecPrinter(ctx, reserved)
    lines: list[str] = []
    if trace.provenance:
        took = f" (took {trace.elapsed_ms:.0f} milliseconds)" if trace.elapsed_ms is not None else ""
        lines.append(f"# Constructed by {comment_text(trace.provenance)}{took}")
    lines.append("import torch")
    lines.append("")
    lines.append(f"def {fn_name}({', '.join(trace.signature_names())}):")
    body: list[str] = []
    for a in trace.args:
        if hasattr(a, "type_string"):
            body.append(f'# {a.name}: "{a.type_string()}"')
    binder = SymbolBinder(trace.bound_symbols, trace.output)
    body.extend(binder.lines_for(trace.args))
    unused = trace.unused_outputs or ()
    for bsym in trace.bound_symbols:
        if is_bookkeeping(bsym):
            body.append(bsym.call_string(printer))
            continue
        if binder.needed:
            binder.check((bsym.args, bsym.kwargs), bsym.sym.qualified_name)
        # an output nothing reads is printed "_", unless it is the one value that carries a size the code uses
        carriers = binder.carriers([p for p in bsym.flat_proxy_outs if p.name in unused]) if unused else []
        if carriers:
            unused = set(unused) - {p.name for p in carriers}
        body.extend(bsym.python_lines(printer, name=names.name_for(bsym.sym), unused=unused,
                                      with_subsymbols=comments))
        if binder.needed:
            body.extend(binder.lines_for([p for p in bsym.flat_proxy_outs if p.name not in unused]))
        if carriers:
            body.append("del " + ", ".join(p.name for p in carriers))
    binder.check(trace.output, "the return statement")
    body.append(f"return {printer(trace.output)}")
    if printer.constants:  # after "import torch": what each constant holds, for a reader
        lines[lines.index("import torch") + 1:lines.index("import torch") + 1] = ["", *printer.constant_comments()]
    lines.extend("  " + ln for ln in body)
    return "\n".join(lines) + "\n", ctx


def compile_trace(trace: Trace, *, comments: bool = True) -> tuple[Callable, str]:
    """The callable for an execution trace, and its source (``comments=False``: without decompositions, for code
    nobody reads, such as a fused region's unfused path, whose operations the outer trace already shows)."""
    source, ctx = python_source(trace, comments=comments)
    filename = f"<fulmen {trace.fn_name}_{next(_counter)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    code = compile(source, filename, "exec")
    exec(code, ctx)
    fn = ctx[sanitize_name(trace.fn_name)]
    fn.__fulmen_source__ = source
    return fn, source
