"""``fulmen.jit(functools.partial(f, *bound, **bound_keywords))``: the bound arguments are arguments.

A partial's ``args`` and ``keywords`` can change after the jit (``p.keywords["scale"] = 3``), and so can the
objects they hold (a dict or list bound as an argument and updated in place). The guard on globals follows neither,
so a program traced through the partial would keep the values it saw. Instead, ``f`` is traced, and every call
passes it the partial's current bound arguments ahead of its own, as the partial itself does: they are keyed and
checked as the call's own arguments are (contents of dicts, lists and objects; tensors as inputs).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from fulmen.executors.base import Executor
from fulmen.frontend.jit import JittedFunction


class JittedPartial(JittedFunction):
    """The JittedFunction of a ``functools.partial``: traces ``partial.func``, called with the bound arguments
    read from the partial at every call."""

    def __init__(self, partial: functools.partial, executors: Sequence[Executor | str] | None = None, **options):
        super().__init__(partial.func, executors, **options)
        self._init_args = (partial, executors)  # a pickled copy rebuilds from the partial
        self.partial = partial

    def __call__(self, *args, **kwargs):
        partial = self.partial
        keywords = partial.keywords
        return super().__call__(*partial.args, *args, **({**keywords, **kwargs} if keywords else kwargs))
