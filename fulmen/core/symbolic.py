"""Symbolic sizes: ``torch.SymInt`` dimensions in proxies, printed as Python expressions of named symbols.

A trace compiled for dynamic sizes holds ``torch.SymInt`` values (from a ``ShapeEnv`` of
``torch.fx.experimental.symbolic_shapes``) in proxy shapes and in every integer computed from them. Metas do
their arithmetic and comparisons on them as on ints; the ShapeEnv records each comparison a meta made as a
guard, which the cache checks before reusing the compiled program for new sizes (``fulmen.frontend.dynamic``).

Generated code binds each symbol from an input's size at the top of the function (``s0 = idx.shape[1]``) and
prints every symbolic int as an expression of the symbols (``(s0 * 4)``).
"""

from __future__ import annotations

from numbers import Number
from typing import Any

import torch

from fulmen.core.proxies import Proxy

SYMBOLIC_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)
#: What a meta accepts where it accepts an int: a Python int or a symbolic one.
INT_TYPES = (int, torch.SymInt)
#: Symbolic values that stand for a Python number (``isinstance(x, numbers.Number)`` is false for them).
SYMBOLIC_NUMBERS = (torch.SymInt, torch.SymFloat)
#: Python numbers and symbolic ones (what elementwise ops accept as scalars).
NUMBER_TYPES = (Number, torch.SymInt, torch.SymFloat, torch.SymBool)

#: Set once the process has traced anything with symbolic sizes; until then no value can be symbolic and the
#: scans for symbols (codegen's binder, fusion's check) are skipped.
in_use = False

def is_symbolic(x: Any) -> bool:
    """Whether ``x`` is a SymInt/SymFloat/SymBool that is not a known constant."""
    return isinstance(x, SYMBOLIC_TYPES) and not _constant(x)[0]


def _constant(x) -> tuple[bool, Any]:
    node = x.node
    if isinstance(x, torch.SymInt):
        v = node.maybe_as_int()
        return (v is not None), v
    if isinstance(x, torch.SymBool):
        v = node.maybe_as_bool()
        return (v is not None), v
    v = node.maybe_as_float()
    return (v is not None), v


def size_hint(x: Any) -> Any:
    """The value a symbolic int had when the program was traced (``x`` itself when it is not symbolic); for
    heuristics (costs, chunk sizes) that must not add guards."""
    if isinstance(x, torch.SymInt):
        node = x.node
        v = node.maybe_as_int()
        if v is not None:
            return v
        hint = node.hint if node.has_hint() else None
        return int(hint) if hint is not None else int(node.shape_env.optimization_hint(node.expr))
    return x


def expr_of(x) -> Any:
    """The sympy expression of a symbolic value, with the ShapeEnv's replacements applied."""
    node = x.node
    return node.shape_env.replace(node.expr)


def contains_symbolic(x: Any, *, shapes: bool = True) -> bool:
    """Whether a (nested) value holds a symbolic number. With ``shapes``, a proxy's symbolic shape counts too;
    without, only symbolic numbers in the value itself do (a size expression passed to ``view``)."""
    if isinstance(x, SYMBOLIC_TYPES):
        return is_symbolic(x)
    if isinstance(x, (tuple, list)):
        return any(contains_symbolic(v, shapes=shapes) for v in x)
    if isinstance(x, dict):
        return any(contains_symbolic(v, shapes=shapes) for v in x.values())
    if isinstance(x, slice):
        return contains_symbolic((x.start, x.stop, x.step), shapes=shapes)
    shape = getattr(x, "shape", None) if shapes else None
    if type(shape) is torch.Size and (isinstance(x, Proxy) or not isinstance(x, torch.Tensor)):
        return any(isinstance(s, torch.SymInt) and is_symbolic(s) for s in shape)
    return False


def free_symbols(x: Any, into: set | None = None) -> set:
    """The sympy symbols the symbolic numbers in a (nested) value depend on (not those of proxy shapes)."""
    out = into if into is not None else set()
    if isinstance(x, SYMBOLIC_TYPES):
        if is_symbolic(x):
            out.update(expr_of(x).free_symbols)
    elif isinstance(x, (tuple, list)):
        for v in x:
            free_symbols(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            free_symbols(v, out)
    elif isinstance(x, slice):
        free_symbols((x.start, x.stop, x.step), out)
    return out


def symbol_name(sym) -> str:
    return str(sym)


def python_expr(x) -> str:
    """A symbolic value as Python source over its symbols' names (``s3``), or its literal when constant."""
    known, value = _constant(x)
    if known:
        return repr(value)
    from torch.utils._sympy.printers import PythonPrinter

    expr = expr_of(x)
    text = PythonPrinter().doprint(expr)
    return text if expr.is_Atom else f"({text})"


def bare_symbol(dim: Any):
    """The sympy symbol a dimension *is* (``s0``, not ``2*s0``), or None."""
    if not isinstance(dim, torch.SymInt) or dim.node.maybe_as_int() is not None:
        return None
    expr = expr_of(dim)
    return expr if expr.is_Symbol else None


def _solve_lines(defined: Any, needed: set, bound: set) -> list[str]:
    """Bind a symbol no proxy carries bare from a dimension ``a*s + b`` (a cotangent of shape ``2*s0``)."""
    import sympy

    lines: list[str] = []
    for p in defined:
        shape = getattr(p, "shape", None)
        if type(shape) is not torch.Size:
            continue
        for i, d in enumerate(shape):
            if not isinstance(d, torch.SymInt) or d.node.maybe_as_int() is not None:
                continue
            expr = expr_of(d)
            free = expr.free_symbols
            if len(free) != 1:
                continue
            (sym,) = free
            if sym not in needed or sym in bound:
                continue
            poly = sympy.Poly(expr, sym) if expr.is_polynomial(sym) else None
            if poly is None or poly.degree() != 1:
                continue
            a, b = poly.all_coeffs()
            if not (a.is_Integer and b.is_Integer and int(a) > 0):
                continue
            bound.add(sym)
            lines.append(f"{symbol_name(sym)} = ({p.name}.shape[{i}] - {int(b)}) // {int(a)}")
    return lines


class SymbolBinder:
    """Emits the lines that bind the symbols a trace's code refers to, as soon as a proxy carrying them exists.

    ``lines_for(proxies)`` after the inputs and after each operation; ``check(bsym)`` before printing one.
    """

    def __init__(self, bound_symbols, output: Any = None):
        needed: set = set()
        if in_use:
            for b in bound_symbols:
                free_symbols((b.args, b.kwargs), needed)
            free_symbols(output, needed)
        self.needed = needed
        self.bound: set = set()

    def lines_for(self, defined: Any) -> list[str]:
        if not self.needed or len(self.bound) == len(self.needed):
            return []
        lines = []
        for p in defined:
            shape = getattr(p, "shape", None)
            if type(shape) is not torch.Size:
                continue
            for i, d in enumerate(shape):
                sym = bare_symbol(d)
                if sym is not None and sym in self.needed and sym not in self.bound:
                    self.bound.add(sym)
                    lines.append(f"{symbol_name(sym)} = {p.name}.shape[{i}]")
        return lines + _solve_lines(defined, self.needed, self.bound)

    def carriers(self, values: Any) -> list:
        """Those of ``values`` whose shapes carry, bare, a needed symbol not bound yet."""
        if not self.needed or len(self.bound) == len(self.needed):
            return []
        out = []
        for p in values:
            shape = getattr(p, "shape", None)
            if type(shape) is torch.Size and any(
                    (sym := bare_symbol(d)) is not None and sym in self.needed and sym not in self.bound
                    for d in shape):
                out.append(p)
        return out

    def check(self, x: Any, where: str) -> None:
        if not self.needed:
            return
        missing = free_symbols(x) - self.bound
        if missing:
            raise RuntimeError(f"symbolic size(s) {sorted(map(str, missing))} used by {where} cannot be bound from "
                               "the sizes of the values defined before it")


def symbolic_value(x: Any, inputs: Any):
    """``value(flat)``: the int the symbolic ``x`` stands for in a call whose inputs ``flat`` are the values of the
    proxies ``inputs``, from their sizes (a symbolic int a program returns as a Python value, outside its code).
    NotImplementedError when an input does not carry one of its symbols bare."""
    from torch.utils._sympy.printers import PythonPrinter

    needed = set(expr_of(x).free_symbols)
    binds = []
    for i, p in enumerate(inputs):
        for d, n in enumerate(getattr(p, "shape", ())):
            sym = bare_symbol(n)
            if sym in needed:
                needed.discard(sym)
                binds.append(f"    {symbol_name(sym)} = flat[{i}].shape[{d}]\n")
    if needed:
        missing = sorted(map(str, needed))
        raise NotImplementedError(f"the symbolic value {x} is returned, but no input carries {missing}")
    namespace: dict[str, Any] = {}
    exec(f"def value(flat):\n{''.join(binds)}    return int({PythonPrinter().doprint(expr_of(x))})\n", namespace)
    return namespace["value"]
