"""Whether a trace with symbolic sizes or ints is, at given values, the program an exact trace is.

While tracing, a symbolic int (an int argument made symbolic, or a dynamic size: ``x.shape[0]``) is a
``torch.SymInt``: its arithmetic and comparisons are guarded, and its text is its value's
(``fulmen.frontend.symbolic_text``), but Python that asks for its *type* sees a SymInt, not an int:
``isinstance(n, int)``, ``type(n) is int`` and ``type(n) == int`` are False, and nothing can guard them. Code that
branches on that takes another path than eager with no guard to notice. So each trace with symbolic sizes or ints is
compared with an exact trace of one call its guards accept (the exact trace already compiled for earlier values, or
else one of the current call): evaluated at that call's values, the
symbolic trace must record the same operations, with the same constants, output metadata, result and writes into
objects, as the exact one. Where they differ, the caller keeps them exact (``SymbolicTraceDiffers``).

A type check whose two paths record the same operations at one value (``x * (n if isinstance(n, int) else 2)`` at
2) differs at another, so the check is made at two values: each symbol has another value in the second set where the
guards allow (the values of the call that compiled it, or values moved off the first). It is a check of two values,
not a proof: paths that agree at both and differ elsewhere are not caught (docs/recompilation.md, "Symbolic ints").
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import sympy
import torch

from fulmen.core.proxies import Proxy, TensorProxy
from fulmen.core.symbolic import SYMBOLIC_TYPES, expr_of, is_symbolic
from fulmen.core.trace import Trace

_NUMBER_OF = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}


class SymbolicTraceDiffers(RuntimeError):
    """The trace with symbolic sizes or ints is not, at an exact trace's values, the exact trace's program."""


class _Canonical:
    """Values of one trace in a form two traces can be compared in: proxies by input position or by the order
    operations define them, symbolic numbers by their value at ``values`` (sympy symbol -> int)."""

    def __init__(self, trace: Trace, values: dict, skip: frozenset[str]):
        inputs = [p for p in trace.args if p.name not in skip]
        self.ids: dict[str, tuple] = {p.name: ("input", i) for i, p in enumerate(inputs)}
        self.values = values
        self.memo: dict[Any, Any] = {}
        self.n_defined = 0

    def number(self, x: Any) -> Any:
        """As ``value`` gives the Python number it stands for: ``("int", 3)``."""
        kind = _NUMBER_OF[type(x)]
        if not is_symbolic(x):
            return ("float", float(x).hex()) if kind is float else (kind.__name__, kind(x))
        expr = expr_of(x)
        value = self.memo.get((kind, expr))
        if value is None:
            value = expr.xreplace(self.values)
            if value.is_number or value.is_Boolean and not value.free_symbols:
                value = kind(value)
                value = ("float", value.hex()) if kind is float else (kind.__name__, value)
            else:  # a symbol without a value (a data-dependent size): compared by its text
                value = ("expr", str(value))
            self.memo[(kind, expr)] = value
        return value

    def value(self, x: Any) -> Any:
        if isinstance(x, Proxy):
            return self.ids.get(x.name, ("unknown", x.name))
        if isinstance(x, SYMBOLIC_TYPES):
            return self.number(x)
        if isinstance(x, (tuple, list)):
            return (type(x).__name__, tuple(self.value(v) for v in x))
        if isinstance(x, dict):
            return ("dict", tuple((k, self.value(v)) for k, v in x.items()))
        if isinstance(x, slice):
            return ("slice", self.value(x.start), self.value(x.stop), self.value(x.step))
        if type(x) is float:
            return ("float", x.hex())  # 0.0 and -0.0 differ, NaN equals NaN
        if x is None or type(x) in (
            int,
            bool,
            str,
            complex,
            torch.dtype,
            torch.device,
            torch.layout,
            torch.memory_format,
        ):
            return (type(x).__name__, x)
        return ("object", type(x).__qualname__, id(x))  # functions, classes, modules: the same object

    def defined(self, x: Any) -> Any:
        """An operation's output: a proxy seen for the first time gets the next number, with its metadata."""
        if isinstance(x, Proxy) and x.name not in self.ids:
            self.ids[x.name] = ("value", self.n_defined)
            self.n_defined += 1
            if isinstance(x, TensorProxy):
                return (self.ids[x.name], x.dtype, x.device, x.requires_grad, tuple(self.value(s) for s in x.shape))
            return self.ids[x.name]
        if isinstance(x, (tuple, list)):
            return (type(x).__name__, tuple(self.defined(v) for v in x))
        if isinstance(x, dict):
            return ("dict", tuple((k, self.defined(v)) for k, v in x.items()))
        return self.value(x)


def _node(node: tuple, tensors: list, canon: _Canonical, seen: set) -> Any:
    """A template of ``fulmen.frontend.objects`` (what a call writes into or builds as an object) with its program
    outputs resolved: an int written back is ``("tensor", k)`` of a symbolic trace and ``("constant", 3)`` of an
    exact one."""
    kind = node[0]
    if kind == "tensor":
        return canon.value(tensors[node[1]])
    if kind == "constant":
        return canon.value(node[1])
    if kind == "sequence":
        return (kind, node[1], node[2], tuple(_node(e, tensors, canon, seen) for e in node[3]))
    if kind == "dict":
        return (kind, node[1], tuple((k, _node(e, tensors, canon, seen)) for k, e in node[2]))
    if kind == "object":
        if node[1] in seen:  # shared or cyclic
            return ("object", node[1])
        seen.add(node[1])
        return (
            kind,
            node[1],
            node[2],
            tuple((n, _node(m, tensors, canon, seen)) for n, m in node[3]),
            tuple((k, _node(e, tensors, canon, seen)) for k, e in node[4]),
        )
    return node  # ("holder", i)


def _result(trace: Trace, spec: Any, canon: _Canonical) -> Any:
    """What a call returns and does to the caller's objects (``fulmen.frontend.tracing.trace_program`` builds the
    output as ``((result, object values), attribute values)``, the parts present)."""
    out, attributes = trace.output, None
    if spec.attributes:
        out, attributes = out
    objects = spec.objects
    if objects is None:
        return canon.value(out), canon.value(attributes)
    result, tensors = out
    seen: set = set()
    effects = tuple(
        (i, kind, tuple((n, _node(v, tensors, canon, seen)) for n, v in changed), tuple(removed))
        for i, kind, changed, removed in objects.effects
    )
    placed = tuple((path, _node(v, tensors, canon, seen)) for path, v in objects.placed)
    return canon.value(result), canon.value(attributes), effects, placed


def _operations(trace: Trace, spec: Any, canon: _Canonical):
    """Each operation of ``trace`` (then its result) in canonical form, with its output, defined once the caller asks
    (``define``), so that an output can first be matched with the other trace's (``_same_value``)."""
    for bsym in trace.bound_symbols:
        yield (bsym.sym.qualified_name, bsym.no_grad, canon.value(bsym.args), canon.value(bsym.kwargs)), bsym
    yield ("return", _result(trace, spec, canon)), None


def _same_value(ours: Any, theirs: Any, canon: _Canonical, other: _Canonical) -> bool:
    """An operation that returns its input in one trace and a new tensor of the same metadata in the other: with
    exact sizes ``x.contiguous()`` of a contiguous ``x`` is ``x``; with symbolic strides it is a new value. Its
    later uses are compared as uses of the value the exact trace has."""
    if not (isinstance(ours, TensorProxy) and isinstance(theirs, TensorProxy)):
        return False
    if ours.name in canon.ids or theirs.name not in other.ids:
        return False
    meta = (ours.dtype, ours.device, ours.requires_grad, tuple(canon.value(s) for s in ours.shape))
    if meta != (theirs.dtype, theirs.device, theirs.requires_grad, tuple(other.value(s) for s in theirs.shape)):
        return False
    canon.ids[ours.name] = other.ids[theirs.name]
    return True


def check_same_program(
    symbolic: tuple[Trace, Any], values: dict, carriers: frozenset[str], exact: tuple[Trace, Any]
) -> None:
    """Raise ``SymbolicTraceDiffers`` naming the first operation where the trace ``symbolic`` (trace, its
    ``InputSpec``) at ``values`` (sympy symbol -> int) differs from ``exact``; ``carriers``: the names of the
    symbolic trace's int carriers."""
    canon, other = _Canonical(symbolic[0], values, carriers), _Canonical(exact[0], {}, frozenset())
    for (a, bsym), (b, them) in zip(_operations(*symbolic, canon), _operations(*exact, other)):
        if a == b and (
            bsym is None
            or _same_value(bsym.output, them.output, canon, other)
            or canon.defined(bsym.output) == other.defined(them.output)
        ):
            continue
        where = bsym.sym.qualified_name if bsym is not None else "the result"
        there = them.sym.qualified_name if them is not None else "the result"
        where = f"{where} with other values" if where == there else f"{where} where the exact trace has {there}"
        raise SymbolicTraceDiffers(
            f"traced with symbolic sizes or ints, the function records another program than traced with their "
            f"values ({where}): its Python code takes another path when a size or int is a torch.SymInt, not an int "
            "(isinstance(n, int), type(n) is int), so they stay exact"
        )


def check_symbolic_trace(
    history: Any, symbolic: Any, entry: Any, current: tuple[list, list], trace_at: Callable[..., tuple[Trace, Any]]
) -> None:
    """The trace of ``entry`` (compiled with ``symbolic``, a ``SymbolicSizes``, for a call of ``current`` (ints,
    sizes)) checked against exact traces at two sets of values its guards accept: ``history.exact`` (ints, sizes, raw
    trace and ``InputSpec`` of the structure's last exact compilation; ``history`` a ``SizeHistory``) if they accept
    its values, else the call traced exactly (``trace_at()``); then the call's values if each symbol has another value
    there, else values of the symbols moved off the first ones (``trace_at(sizes, ints)``: the call traced with those
    sizes and ints). A type check whose two paths agree at one value (``n if isinstance(n, int) else 2`` at 2) differs
    at the other. Every compilation with symbolic sizes or ints is checked: one made after a guard failed traced
    other branches."""
    program = entry.program
    if not program.steps or program.steps[0] != "trace":
        raise SymbolicTraceDiffers("the trace with symbolic sizes or ints is not kept to check against the exact one")
    n_tensors = len(entry.spec.tensor_proxies)
    carriers = frozenset(p.name for p in program.traces[0].args[n_tensors : n_tensors + len(symbolic.int_symbols)])
    ours = (program.traces[0], entry.spec)
    exact = history.exact
    if exact is None or not _accepts(symbolic, exact[0], exact[1]):
        exact = (*current, *trace_at())
    first = _values(symbolic, exact[0], exact[1])
    check_same_program(ours, first, carriers, tuple(exact[2:]))
    second = _values(symbolic, *current)
    if all(second[s] != first[s] for s in first):
        check_same_program(ours, second, carriers, _traced_at(trace_at))
        return
    moved = _moved(symbolic, first, exact[0], exact[1])
    if moved is not None:  # None: the guards pin every symbol to its value, and one value is all there is
        check_same_program(ours, _values(symbolic, *moved), carriers, _traced_at(trace_at, *moved, symbolic))


def _values(symbolic: Any, ints: list, sizes: list) -> dict:
    """Each symbol's value (sympy) for these ints and sizes."""
    values = {sym: sympy.Integer(sizes[i][d]) for sym, i, d in symbolic.symbols}
    values.update((sym, sympy.Integer(ints[slot])) for sym, slot in symbolic.int_symbols)
    return values


def _accepts(symbolic: Any, ints: list, sizes: list) -> bool:
    return symbolic.guard([SimpleNamespace(shape=s) for s in sizes], ints)


def _with(symbolic: Any, values: dict, ints: list, sizes: list) -> tuple[list, list]:
    """``ints`` and ``sizes`` with each symbol's place set to its value in ``values``."""
    ints, sizes = list(ints), [list(s) for s in sizes]
    for sym, i, d in symbolic.symbols:
        sizes[i][d] = int(values[sym])
    for sym, slot in symbolic.int_symbols:
        ints[slot] = int(values[sym])
    return ints, [torch.Size(s) for s in sizes]


_SHIFTS = (1, -1, 2, -2, 3, 5)


def _moved(symbolic: Any, values: dict, ints: list, sizes: list) -> tuple[list, list] | None:
    """Ints and sizes the guards accept with as many symbols as a few tries move off ``values`` (all together, else one
    at a time); None when none moves. Symbols stay at least 2, as they were made."""

    def accepted(candidate: dict) -> tuple[list, list] | None:
        if any(v < 2 for v in candidate.values()):
            return None
        moved = _with(symbolic, candidate, ints, sizes)
        return moved if _accepts(symbolic, *moved) else None

    for shift in _SHIFTS:
        found = accepted({s: v + shift for s, v in values.items()})
        if found is not None:
            return found
    current, found = dict(values), None
    for s in values:
        for shift in _SHIFTS:
            tried = accepted({**current, s: current[s] + shift})
            if tried is not None:
                current, found = {**current, s: current[s] + shift}, tried
                break
    return found


def _traced_at(
    trace_at: Callable[..., tuple[Trace, Any]],
    ints: list | None = None,
    sizes: list | None = None,
    symbolic: Any = None,
) -> tuple[Trace, Any]:
    """The function traced exactly: for the call, or at other ``ints`` and ``sizes`` (those of ``symbolic``'s
    symbols replaced); a trace that fails there (a check of the user's on the values) counts as another program."""
    try:
        if ints is None:
            return trace_at()
        return trace_at(sizes, {slot: ints[slot] for _, slot in symbolic.int_symbols})
    except Exception as e:
        raise SymbolicTraceDiffers(
            f"traced exactly at other values of its symbolic sizes or ints, the function failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''}), so they stay exact"
        ) from e
