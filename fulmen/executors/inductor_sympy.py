"""A faster index analysis for Inductor's C++ code generator: ``sympy.simplify`` skipped where its answer is known.

To decide how to vectorize each loop, Inductor's C++ backend asks for the stride of every index expression along
the vectorized variable (``torch._inductor.sizevars.stride_at_vec_range``), and it first passes the index through
``sympy.simplify``, a search that costs milliseconds a call. Most calls get a plain linear index, such as
``8192*x0 + 64*x1 + 32*x2 + x3``, and ``simplify`` returns it unchanged; about half the calls of a model's
compilation are of that kind, and they make up most of the time spent in ``simplify`` (figures:
docs/performance.md, "What individual changes bought").

The ``simplify`` installed here returns such an index as it is, without sympy's search. The shape it answers is a
sum of positive integer multiples of symbols plus a nonnegative integer constant, with at least one coefficient
equal to 1. No common factor can come out of such a sum, and sympy has nothing to cancel or combine in it, so it
is already in the form ``sympy.simplify`` returns. The tests compare the shortcut with sympy on thousands of
random indices. Any other expression goes to ``sympy.simplify`` itself.

The shortcut is put only where Inductor's ``sizevars`` module looks up the name ``sympy``, and only while fulmen
lowers a region (``shortcut_here()``): that name then points to a copy of sympy's namespace with this one function
replaced. sympy itself, and every other module that uses it, see no change. It answers only on a thread inside
``shortcut_here()`` (fulmen's lowering of a region);
elsewhere, as for a ``torch.compile`` of the user's running beside the background compiler, it is
``sympy.simplify``.
"""

from __future__ import annotations

import contextlib
import threading
import types

import sympy

from fulmen.core.shared_patch import SharedPatch

_here = threading.local()


def is_plain_linear(expr: sympy.Basic) -> bool:
    """Whether ``expr`` is a symbol, or a sum of positive integer multiples of symbols plus a nonnegative integer,
    in which some symbol has coefficient 1: a form ``sympy.simplify`` hands back unchanged."""
    if isinstance(expr, sympy.Symbol):
        return True
    if not isinstance(expr, sympy.Add):
        return False
    unit = False
    for term in expr.args:
        if isinstance(term, sympy.Symbol):
            unit = True
        elif term.is_Integer:
            if term < 0:
                return False
        elif not (isinstance(term, sympy.Mul) and len(term.args) == 2 and term.args[0].is_Integer
                  and term.args[0] > 0 and isinstance(term.args[1], sympy.Symbol)):
            return False
    return unit


def simplify(expr, *args, **kwargs):
    """``sympy.simplify(expr, ...)``, answered without sympy's search for a plain linear index (inside
    ``shortcut_here()``)."""
    if getattr(_here, "on", False) and not args and not kwargs and is_plain_linear(expr):
        return expr
    return sympy.simplify(expr, *args, **kwargs)


_namespace = None


def _shortcut_namespace() -> types.ModuleType:
    """A copy of sympy's namespace whose ``simplify`` is the one above."""
    global _namespace
    if _namespace is None:
        namespace = types.ModuleType("sympy", sympy.__doc__)
        namespace.__dict__.update(sympy.__dict__)
        namespace.simplify = simplify
        _namespace = namespace
    return _namespace


def _install_shortcut() -> None:
    from torch._inductor import sizevars

    if getattr(sizevars, "sympy", None) is sympy:
        sizevars.sympy = _shortcut_namespace()


def _uninstall_shortcut() -> None:
    from torch._inductor import sizevars

    if getattr(sizevars, "sympy", None) is _namespace:
        sizevars.sympy = sympy


#: Inductor's ``sizevars`` module looks up the name ``sympy`` in the shortcut's namespace while some thread is
#: inside ``shortcut_here()``, and in sympy itself again once the last one left. A torch release that imports sympy
#: some other way is left as it is.
_in_place = SharedPatch(_install_shortcut, _uninstall_shortcut)


@contextlib.contextmanager
def shortcut_here():
    """The shortcut answers on the calling thread for the block (see ``_in_place``)."""
    with _in_place:
        before = getattr(_here, "on", False)
        _here.on = True
        try:
            yield
        finally:
            _here.on = before
