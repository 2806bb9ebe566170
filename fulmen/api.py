"""The seeds' older entry points and the examine report: ``fulmen.trace``, ``fulmen.compile``, ``fulmen.examine``.

``trace()(fn, *args)`` and ``compile(fn, executors_list=...)`` are thin layers over the tracer and
``fulmen.jit``; ``examine(fn, *args)`` tells which operations fulmen has rules for, which ran opaquely
through PyTorch, and whether the compiled result matches eager PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from fulmen.core.codeutils import Printer, sanitize_name
from fulmen.core.symbol import BoundSymbol, OpTags, Symbol
from fulmen.core.trace import Trace
from fulmen.executors.base import Executor
from fulmen.frontend.tracing import trace_program
from fulmen.prims import PrimIDs

__all__ = ["trace", "compile", "examine", "ExamineReport", "ProgramTrace"]


# ---- fulmen.trace() ----

def _print_unpack(bsym: BoundSymbol, printer: Printer) -> str:
    (p,) = bsym.args
    return f'# {p.name}: "{p.type_string()}"' if hasattr(p, "type_string") else f"# {p.name}"


def _print_return(bsym: BoundSymbol, printer: Printer) -> str:
    return f"return {printer(bsym.args[0])}"


#: Display-only symbols: an input's unpacking (printed as its type comment) and the return statement.
UNPACK_TRIVIAL = Symbol(name="unpack_trivial", id=PrimIDs.UNPACK_TRIVIAL, is_prim=True, module="prims",
                        python_printer=_print_unpack)
RETURN = Symbol(name="python_return", id=PrimIDs.RETURN, is_prim=True, module="prims", python_printer=_print_return)


class ProgramTrace(Trace):
    """A computation trace in the seeds' display form: inputs and the return are bound symbols too.

    ``bound_symbols`` starts with one ``PrimIDs.UNPACK_TRIVIAL`` entry per input and ends with a
    ``PrimIDs.RETURN`` entry; printing shows ``@torch.no_grad()`` and the traced function's own name.
    """

    def python(self, *, printer: Printer | None = None, include_decorator: bool = True, **_: Any) -> str:
        printer = printer if printer is not None else Printer()
        modules = {b.sym.module for b in self.bound_symbols if b.sym.python_printer is None}
        lines = ["import torch", "from fulmen.core import devices, dtypes"]
        if "ltorch" in modules:
            lines.append("import fulmen.torch as ltorch")
        if "prims" in modules:
            lines.append("from fulmen import prims")
        lines.append("")
        header = len(lines)
        if include_decorator:
            lines.append("@torch.no_grad()")
        lines.append(f"def {self.fn_name}({', '.join(self.signature_names())}):")
        for bsym in self.bound_symbols:
            lines.extend("  " + ln for ln in bsym.python_lines(printer))
        if printer.constants:  # what each constant holds, for a reader
            lines[header:header] = [*printer.constant_comments(), ""]
        return "\n".join(lines) + "\n"


def _program_trace(computation: Trace, fn_name: str) -> ProgramTrace:
    shown = ProgramTrace(fn_name, parent=computation)
    shown.args, shown.output = list(computation.args), computation.output
    shown.bound_symbols[:] = [
        *(UNPACK_TRIVIAL.bind(p, output=None) for p in computation.args),
        *computation.bound_symbols,
        RETURN.bind(computation.output, output=None),
    ]
    return shown


def trace() -> Callable[..., ProgramTrace]:
    """``fulmen.trace()(fn, *args, **kwargs)``: the computation trace of one call, without compiling it.

        t = fulmen.trace()(fun, a, b)
        print(t)                                  # @torch.no_grad() def fun(a, b): ...
        for bsym in t.bound_symbols:              # UNPACK_TRIVIAL per input, the ops, RETURN
            print(bsym.sym.id, [s.sym.id for s in bsym.subsymbols])
    """

    def trace_call(fn: Callable, *args, **kwargs) -> ProgramTrace:
        if not callable(fn):
            raise TypeError(f"fulmen.trace()(fn, *args) expects a callable, but got {type(fn).__name__}")
        computation, _ = trace_program(fn, args, kwargs, same_tensors=False)  # one input per argument, as called
        return _program_trace(computation, sanitize_name(getattr(fn, "__name__", "computation")))

    return trace_call


# ---- fulmen.compile ----

def compile(fn: Callable, executors_list: Sequence[Executor | str] | None = None, *,
            disable_preprocessing: bool = True, **options: Any) -> Callable:
    """The seeds' ``thunder.compile``: ``fulmen.jit`` with an explicit executor list.

    With ``executors_list`` exactly those executors run the program, in that order: the torch executor is
    *not* added, so a symbol none of them can run fails with "Could not find executor for bound symbol
    ...". Without it, the default executors and the torch executor are used, as in ``fulmen.jit``.
    ``disable_preprocessing`` is accepted for compatibility; fulmen always traces the function as written.

        cfun = fulmen.compile(fun, executors_list=["custom_add_executor", fulmen.executors.TORCH])
    """
    from fulmen import jit

    if not isinstance(disable_preprocessing, bool):
        raise TypeError(f"fulmen.compile: disable_preprocessing must be a bool, but got {disable_preprocessing!r}")
    if executors_list is not None:
        if isinstance(executors_list, (str, Executor)):
            executors_list = [executors_list]
        options.setdefault("add_torch_executor", False)
    return jit(fn, executors=executors_list, **options)


# ---- fulmen.examine ----

@dataclass
class ExamineReport:
    """What ``fulmen.examine`` found; ``str(report)`` is the printed report."""

    name: str
    supported: dict[str, int] = field(default_factory=dict)  # torch ops fulmen has rules for -> count
    fallbacks: dict[str, int] = field(default_factory=dict)  # torch ops run opaquely by PyTorch -> count
    other: dict[str, int] = field(default_factory=dict)  # prims and executor operators called directly
    matches_eager: bool | None = None
    max_abs_error: float | None = None
    error: str | None = None
    trace: Trace | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.matches_eager is True

    def __str__(self) -> str:
        def listing(ops: dict[str, int]) -> str:
            return ", ".join(f"{k} x{v}" if v > 1 else k for k, v in ops.items()) or "-"

        n = sum(self.supported.values()) + sum(self.fallbacks.values()) + sum(self.other.values())
        lines = [f"fulmen.examine({self.name}): {n} operation(s) traced"]
        lines.append(f"  with fulmen rules ({len(self.supported)}): {listing(self.supported)}")
        lines.append(f"  run opaquely by PyTorch, no fulmen rule ({len(self.fallbacks)}): {listing(self.fallbacks)}")
        if self.other:
            lines.append(f"  prims and executor operators ({len(self.other)}): {listing(self.other)}")
        if self.error is not None:
            lines.append(f"  FAILED: {self.error}")
        elif self.matches_eager:
            lines.append(f"  result matches eager PyTorch (max abs error {self.max_abs_error:.3g})")
        else:
            err = "" if self.max_abs_error is None else f" (max abs error {self.max_abs_error:.3g})"
            lines.append(f"  result DIFFERS from eager PyTorch{err}")
        return "\n".join(lines)


def _clone(args: Any) -> Any:
    return tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, args)


def _compare(actual: Any, expected: Any) -> tuple[bool, float]:
    a_flat, a_spec = tree_flatten(actual)
    e_flat, e_spec = tree_flatten(expected)
    if a_spec != e_spec:
        return False, float("nan")
    ok, worst = True, 0.0
    for a, e in zip(a_flat, e_flat):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.shape != e.shape or a.dtype != e.dtype:
                return False, float("nan")
            if e.numel():
                diff = (a.detach().double() - e.detach().double()).abs()
                diff = diff[~(torch.isnan(a.double()) & torch.isnan(e.double()))]
                worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
            try:
                torch.testing.assert_close(a, e, equal_nan=True)
            except AssertionError:
                ok = False
        elif a != e:
            ok = False
    return ok, worst


def examine(fn: Callable, *args, show: bool = True, **kwargs) -> ExamineReport:
    """Run ``fn(*args, **kwargs)`` through fulmen and report what it found (forward only, under no_grad).

        report = fulmen.examine(model, x)       # prints the report; report.fallbacks lists opaque ops
        assert report.ok
    """
    from fulmen import jit, last_traces

    name = getattr(fn, "__name__", type(fn).__name__)
    report = ExamineReport(name=name)
    with torch.no_grad():
        expected = fn(*_clone(args), **_clone(kwargs))
        jitted = jit(fn)
        try:
            actual = jitted(*_clone(args), **_clone(kwargs))
        except Exception as e:
            actual = None
            report.error = f"{type(e).__name__}: {e}"
    try:
        report.trace = last_traces(jitted)[0]
    except (TypeError, IndexError):
        report.trace = None
    if report.trace is not None:
        for bsym in report.trace.bound_symbols:
            if OpTags.FALLBACK in bsym.sym.tags:
                table = report.fallbacks
            elif bsym.sym.module == "ltorch":
                table = report.supported
            else:
                table = report.other
            key = str(bsym.sym.id) if bsym.sym.module == "ltorch" else bsym.sym.qualified_name
            table[key] = table.get(key, 0) + 1
    if report.error is None:
        report.matches_eager, report.max_abs_error = _compare(actual, expected)
    if show:
        print(report)
    return report
