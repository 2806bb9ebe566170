"""Printing values as Python source, for traces and generated code."""

from __future__ import annotations

import builtins
import keyword
from numbers import Number
from typing import Any

import torch

from fulmen.core import dtypes
from fulmen.core.devices import Device
from fulmen.core.proxies import Proxy, TensorProxy
from fulmen.core.symbolic import SYMBOLIC_TYPES, python_expr

#: Names generated code relies on; a user argument with one of these names is renamed.
RESERVED_NAMES = frozenset(
    {"torch", "ltorch", "prims", "dtypes", "devices", "inf", "nan", "Tensor", "fulmen", "operator", "math"}
    | set(dir(builtins))
)


def sanitize_name(name: str) -> str:
    """A legal identifier that shadows neither keywords, builtins nor the modules traces use."""
    if not name.isidentifier():
        name = "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "_"
        if name[0].isdigit():
            name = "_" + name
    if keyword.iskeyword(name) or name in RESERVED_NAMES:
        name = name + "_"
    return name


class Printer:
    """Prints arguments of bound symbols; values without a literal form become named constants in ``ctx``."""

    def __init__(self, ctx: dict[str, Any] | None = None):
        self.ctx = ctx if ctx is not None else {}
        self._const_ids: dict[int, str] = {}

    def constant(self, value: Any, hint: str = "_const") -> str:
        name = self._const_ids.get(id(value))
        if name is None:
            name = f"{hint}_{len(self._const_ids)}"
            self._const_ids[id(value)] = name
            self.ctx[name] = value
        return name

    def __call__(self, x: Any) -> str:
        if isinstance(x, Proxy):
            return x.name
        if x is None or isinstance(x, (bool, str)):
            return repr(x)
        if isinstance(x, SYMBOLIC_TYPES):
            return python_expr(x)
        if isinstance(x, Number):
            if type(x) not in (int, float, complex) and hasattr(x, "item"):
                x = x.item()  # a NumPy scalar: its repr (np.float64(2.5)) names a module generated code lacks
            if isinstance(x, float):
                if x != x:
                    return "nan"
                if x in (float("inf"), float("-inf")):
                    return "inf" if x > 0 else "-inf"
            return repr(x)
        if isinstance(x, tuple):
            if type(x).__module__ == "torch.return_types":  # structseqs such as torch.return_types.max
                return f"torch.return_types.{type(x).__name__}(({''.join(self(v) + ', ' for v in x)}))"
            if hasattr(x, "_fields"):  # a namedtuple: its class is a constant, its fields are printed
                return f"{self.constant(type(x), '_' + type(x).__name__)}({''.join(self(v) + ', ' for v in x)})"
            inner = ", ".join(self(v) for v in x)
            return f"({inner},)" if len(x) == 1 else f"({inner})"
        if isinstance(x, list):
            return "[" + ", ".join(self(v) for v in x) + "]"
        if isinstance(x, dict):
            return "{" + ", ".join(f"{self(k)}: {self(v)}" for k, v in x.items()) + "}"
        if isinstance(x, torch.dtype):
            return str(x)
        if isinstance(x, Device):
            return f'torch.device("{x}")'
        if isinstance(x, torch.device):
            return f'torch.device("{x}")'
        if isinstance(x, slice):
            return f"slice({self(x.start)}, {self(x.stop)}, {self(x.step)})"
        if x is Ellipsis:
            return "..."
        if isinstance(x, torch.memory_format):
            return str(x)
        if isinstance(x, torch.layout):
            return str(x)
        return self.constant(x, "_" + type(x).__name__.lower())


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
