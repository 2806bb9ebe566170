"""Printing values as Python source, for traces and generated code."""

from __future__ import annotations

import builtins
import keyword
import math
import re
import unicodedata
from collections.abc import Collection
from numbers import Number
from typing import Any

import torch

from fulmen.core import dtypes
from fulmen.core.devices import Device
from fulmen.core.proxies import Proxy, TensorProxy
from fulmen.core.symbolic import SYMBOLIC_TYPES, python_expr

#: Names generated code relies on; a user argument with one of these names is renamed. ``_`` is the target of
#: outputs nothing reads.
RESERVED_NAMES = frozenset(
    {"torch", "ltorch", "prims", "dtypes", "devices", "inf", "nan", "Tensor", "fulmen", "operator", "math",
     "torchex", "_"}
    | set(dir(builtins))
)

#: The names PyTorch's ShapeEnv gives size symbols (``s0``, ``u3``, ``zf1``): traces with dynamic sizes bind them as
#: locals (``s0 = x.shape[0]``), so no value may be named so.
_SIZE_SYMBOL = re.compile(r"(?:s|u|zf|zuf)[0-9]+")

#: Types whose ``repr`` is a Python literal that evaluates back to an equal value; only values of exactly these
#: types are pasted into generated code as text (a subclass may override ``__repr__``).
_LITERAL_TYPES = frozenset((bool, int, float, complex, str, type(None)))


def sanitize_name(name: str) -> str:
    """A legal identifier, in the form Python itself uses (NFKC-normalized: ``ｔ0`` is ``t0`` to Python), that
    shadows neither keywords, builtins, the modules traces use nor the size symbols of dynamic traces."""
    if not name.isascii():
        name = unicodedata.normalize("NFKC", name)
    if not name.isidentifier() or (not name.isascii() and unicodedata.normalize("NFKC", name) != name):
        # anything but ASCII letters, digits and "_" becomes "_": the result is its own normal form
        name = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in name) or "_"
        if name[0].isdigit():
            name = "_" + name
    if keyword.iskeyword(name) or name in RESERVED_NAMES or _SIZE_SYMBOL.fullmatch(name):
        name = name + "_"
    return name


def comment_text(text: str, limit: int = 200) -> str:
    """``text`` made safe to follow ``#`` on one line of generated code: characters that could end the comment
    (newlines, and any other unprintable character) are escaped, and long text is shortened."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def safe_repr(value: Any) -> str:
    """``repr(value)`` for a comment: escaped, shortened, and never raising."""
    try:
        return comment_text(repr(value), 80)
    except Exception:  # a user's __repr__ may fail; the comment is only for reading
        return f"<{comment_text(type(value).__qualname__, 60)} object>"


class Printer:
    """Prints arguments of bound symbols as Python source.

    Only values whose text is known to evaluate back to them are printed as text: plain ``bool``, ``int``,
    ``float``, ``complex``, ``str`` and ``None`` (exactly those types, not subclasses, whose ``repr`` the user
    controls), dtypes, devices, and containers of these. Every other value (an ``IntEnum``, a namedtuple's class,
    a user's object) becomes a *constant*: a name bound to the value itself in ``ctx``, the namespace the code
    runs in, so what runs never depends on a user object's ``repr`` or ``__name__``. Constant names avoid
    ``reserved`` (the trace's value names) and the names ``ctx`` already binds to other values.
    """

    def __init__(self, ctx: dict[str, Any] | None = None, reserved: Collection[str] = ()):
        self.ctx = ctx if ctx is not None else {}
        self.reserved = reserved
        self._const_ids: dict[int, str] = {}
        self.constants: dict[str, Any] = {}  # name -> value, in the order they were made

    def constant(self, value: Any, hint: str = "const") -> str:
        name = self._const_ids.get(id(value))
        if name is None:
            hint = hint if hint.isascii() and hint.isidentifier() else "const"
            base = f"_{hint}_{len(self._const_ids)}"
            name = base
            i = 0
            while name in self.reserved or (name in self.ctx and self.ctx[name] is not value):
                i += 1
                name = f"{base}_{i}"
            self._const_ids[id(value)] = name
            self.ctx[name] = value
            self.constants[name] = value
        return name

    def constant_comments(self) -> list[str]:
        """A comment line per constant, showing its value (for a reader; the code reads the value by name)."""
        return [f"# {name} = {safe_repr(value)}" for name, value in self.constants.items()]

    def __call__(self, x: Any) -> str:
        if isinstance(x, Proxy):
            return x.name
        kind = type(x)
        if kind in _LITERAL_TYPES:
            if kind is float and not math.isfinite(x):
                return "nan" if x != x else ("inf" if x > 0 else "-inf")
            if kind is complex and not (math.isfinite(x.real) and math.isfinite(x.imag)):
                return self.constant(x, "complex")  # repr gives inf/nan names inside complex(...)
            return repr(x)
        if isinstance(x, SYMBOLIC_TYPES):
            return python_expr(x)
        if isinstance(x, Number) and hasattr(x, "item") and not isinstance(x, torch.Tensor):
            item = x.item()  # a NumPy scalar: printed as the Python number it holds
            if type(item) in _LITERAL_TYPES:
                return self(item)
        if isinstance(x, tuple):
            if kind is not tuple:
                fields = "".join(self(v) + ", " for v in x)
                if kind.__module__ == "torch.return_types" and getattr(torch.return_types, kind.__name__, None) is kind:
                    return f"torch.return_types.{kind.__name__}(({fields}))"  # structseqs: torch.return_types.max
                if hasattr(x, "_fields"):  # a namedtuple: its class is a constant, its fields are printed
                    return f"{self.constant(kind, kind.__name__)}({fields})"
            inner = ", ".join(self(v) for v in x)
            return f"({inner},)" if len(x) == 1 else f"({inner})"
        if isinstance(x, list):
            return "[" + ", ".join(self(v) for v in x) + "]"
        if isinstance(x, dict):
            return "{" + ", ".join(f"{self(k)}: {self(v)}" for k, v in x.items()) + "}"
        if isinstance(x, torch.dtype):
            return str(x)
        if isinstance(x, Device):  # fulmen's own type: its text is a device torch.device parsed
            return repr(x)
        if kind is torch.device:
            return f'torch.device("{x}")'
        if kind is slice:
            return f"slice({self(x.start)}, {self(x.stop)}, {self(x.step)})"
        if x is Ellipsis:
            return "..."
        if isinstance(x, (torch.memory_format, torch.layout)):
            return str(x)
        return self.constant(x, kind.__name__.lower())


def type_comment(p: Any) -> str:
    if isinstance(p, TensorProxy):
        return f'{p.name}: "{p.type_string()}"'
    return ""


def outputs_of(x: Any) -> list[Proxy]:
    """Every proxy in a (nested) output structure, in order."""
    if isinstance(x, Proxy):
        return [x]
    out: list[Proxy] = []
    if isinstance(x, (tuple, list, dict)):
        _collect(x, out)
    return out


def _collect(container: tuple | list | dict, out: list[Proxy]) -> None:
    # runs for every bound symbol's arguments and outputs: leaves are tested here, not in a call each
    for e in container.values() if isinstance(container, dict) else container:
        if isinstance(e, Proxy):
            out.append(e)
        elif isinstance(e, (tuple, list, dict)):
            _collect(e, out)


def dtype_name(d: torch.dtype) -> str:
    return dtypes.short_name(d)
