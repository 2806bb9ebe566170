"""Whether a trace with symbolic sizes or ints is, at given values, the program an exact trace is.

While tracing, a symbolic int (an int argument made symbolic, or a dynamic size: ``x.shape[0]``) is a
``torch.SymInt``: its arithmetic and comparisons are guarded, and its text is its value's
(``fulmen.frontend.symbolic_text``), but Python that asks for its *type* sees a SymInt, not an int:
``isinstance(n, int)``, ``type(n) is int`` and ``type(n) == int`` are False, and nothing can guard them. Code that
branches on that takes another path than eager with no guard to notice. So when a structure's sizes or ints first go
symbolic, the symbolic trace is compared with an exact trace of one call its guards accept (the exact trace
already compiled for earlier values, or else one of the current call): evaluated at that call's values, the
symbolic trace must record the same operations, with the same constants, output metadata, result and writes into
objects, as the exact one. Where they differ, the caller keeps them exact (``SymbolicTraceDiffers``).

The check is of one value: a type check whose two paths record the same operations at that value (and differ
only at others) is not caught; the documentation says so (docs/recompilation.md, "Symbolic ints").
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
    history: Any, symbolic: Any, entry: Any, current: tuple[list, list], trace_exactly: Callable[[], tuple[Trace, Any]]
) -> None:
    """Once per argument structure (``history``, a ``SizeHistory``) and set of symbolic sizes and ints: the trace of
    ``entry`` (compiled with ``symbolic``, a ``SymbolicSizes``) checked against ``history.exact`` (ints, sizes, raw
    trace and ``InputSpec`` of the structure's last exact compilation) if its guards accept those values, else
    against ``trace_exactly()`` at ``current`` (the call's ints and sizes). A size or int made symbolic later (the
    batch size after the sequence length) is checked again, as code may ask for its type only."""
    which = (frozenset((i, frozenset(ds)) for i, ds in symbolic.dims.items()), frozenset(symbolic.int_slots))
    if which in history.checked:
        return
    exact = history.exact
    if exact is None or not symbolic.guard([SimpleNamespace(shape=s) for s in exact[1]], exact[0]):
        exact = (*current, *trace_exactly())
    ints, sizes, *exact_trace = exact
    program = entry.program
    if not program.steps or program.steps[0] != "trace":
        raise SymbolicTraceDiffers("the trace with symbolic sizes or ints is not kept to check against the exact one")
    values = {sym: sympy.Integer(sizes[i][d]) for sym, i, d in symbolic.symbols}
    values.update((sym, sympy.Integer(ints[slot])) for sym, slot in symbolic.int_symbols)
    n_tensors = len(entry.spec.tensor_proxies)
    carriers = frozenset(p.name for p in program.traces[0].args[n_tensors : n_tensors + len(symbolic.int_symbols)])
    check_same_program((program.traces[0], entry.spec), values, carriers, tuple(exact_trace))
    history.checked.add(which)
