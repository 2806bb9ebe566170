"""While the user's code is traced, the text of a symbolic value is the text of its value, guarded.

A ``torch.SymInt`` (a dynamic size, or an int argument made symbolic: ``fulmen.frontend.dynamic``) prints as its
symbol: ``str(n)``, ``repr(n)`` and ``f"{n}"`` give ``s24``, where eager gives ``"3"``. Code that builds a name, a
dict key or a message from it, or compares that text, would then take another path than eager, or return other
text, with no guard to notice. While a trace runs the user's code, the text of a SymInt, SymFloat or SymBool is the
text of its value (``str(int(n))``, ``format(int(n), spec)``): converting it to a Python value is what
``int(n)`` does, a guard ``n == value``, so the entry serves that value only and a new one recompiles it, as a
size turned into a Python int does. Values that never become text stay symbolic.

The wrappers are installed on the classes while some thread traces (``SharedPatch``) and act only for a thread
inside ``text_specializes()`` (the user's function running on proxies), for text asked for outside fulmen, torch
and sympy; the others (fulmen's and torch's messages, other threads, a trace printed afterwards) get the symbol.
Other libraries the user's function calls are user code here: a message one formats with a size specializes that
size, which is sound and costs the dynamism of that size only.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from fulmen.core.shared_patch import SharedPatch

#: Each symbolic type and the Python type whose value stands for it in text.
_VALUE_TYPES = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}
_METHODS = ("__repr__", "__str__", "__format__")
_LIBRARIES = frozenset({"fulmen", "torch", "sympy"})
_saved: dict[tuple[type, str], object] = {}


def _from_library(frame) -> bool:
    """Whether the text is asked for by fulmen, torch or sympy (a message built before it is needed, a name of a
    data-dependent size): those get the symbol, as outside a trace."""
    module = frame.f_globals.get("__name__", "")
    return module.partition(".")[0] in _LIBRARIES


def _wrap(cls: type, name: str, to_value: type):
    original = cls.__dict__.get(name)

    def text(self, *spec):
        if _patch.here and not _from_library(sys._getframe(1)):
            return getattr(to_value(self), name)(*spec)  # int(self): guarded, as in eager the value is an int
        if original is not None:
            return original(self, *spec)
        return getattr(super(cls, self), name)(*spec)

    text.__name__ = name
    return text


def _install() -> None:
    for cls, to_value in _VALUE_TYPES.items():
        for name in _METHODS:
            _saved[(cls, name)] = cls.__dict__.get(name)
            setattr(cls, name, _wrap(cls, name, to_value))


def _uninstall() -> None:
    for (cls, name), original in _saved.items():
        if original is None:
            delattr(cls, name)
        else:
            setattr(cls, name, original)
    _saved.clear()


_patch = SharedPatch(_install, _uninstall)


@contextlib.contextmanager
def text_specializes():
    """The tracing thread's user code gets a symbolic value's text from its (guarded) value."""
    with _patch.in_this_thread():
        yield
