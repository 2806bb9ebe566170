"""The public API for executor authors: new operations, new implementations of existing ones, the registry.

A minimal operator executor (seed 001)::

    import fulmen
    from fulmen.extend import OperatorExecutor

    myex = OperatorExecutor("myex", version="0.1")

    def multimul_like(a, b, c, d):          # same semantics in fulmen operations: metadata and gradients
        return a * b, c * d

    multimul = myex.register_operator("multimul", like=multimul_like, fn=multimul_impl)
    cfoo = fulmen.jit(lambda a, b: multimul(a, b, a, b), executors=[myex])

``register_operator(name, *, meta= | like=, fn, tags=None)`` declares a new symbol run by ``fn``;
``register_implementation(symbol_or_id, op=None, *, checker=, execution_transform=, grad_transform=)``
lets the executor run an existing symbol. Executors go to ``fulmen.jit(..., executors=[...])`` as objects
or registered names, in priority order; the torch executor is always added last. ``docs/writing_an_executor.md``
walks through all of it.
"""

from __future__ import annotations

from fulmen.executors import add_operator_executor, checked_implementation
from fulmen.executors.base import (
    Executor,
    ExecutorError,
    FusionExecutor,
    ImplInfo,
    OperatorExecutor,
    add_default_executor,
    deregister_executor,
    get_all_executors,
    get_default_executors,
    get_executor,
    register_executor,
    set_default_executors,
)

__all__ = [
    "Executor",
    "OperatorExecutor",
    "FusionExecutor",
    "ExecutorError",
    "ImplInfo",
    "register_executor",
    "deregister_executor",
    "get_executor",
    "get_all_executors",
    "get_default_executors",
    "set_default_executors",
    "add_default_executor",
    "add_operator_executor",
    "checked_implementation",
]
