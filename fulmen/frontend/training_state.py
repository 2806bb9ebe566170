"""What traced code reads and writes of training state it does not receive: gradients and optimizers.

An optimizer step or a gradient clip traced by ``fulmen.jit`` reads ``p.grad`` of parameters that are not inputs
and Python numbers from ``optimizer.param_groups``. The program captures the gradient objects and holds the
numbers, so the cache's guard checks each gradient object by identity (``zero_grad()`` and the next backward put a
new one there) and each hyperparameter by value (an LR scheduler changes ``lr``); an assignment to ``p.grad``
(``zero_grad()`` setting it to None) would happen while tracing only, and is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fulmen.core.proxies import _user_location
from fulmen.core.trace import Trace, get_tracectx

#: ``Tensor.grad``'s descriptor: reading or assigning ``t.grad`` reaches a torch function mode as its
#: ``__get__`` / ``__set__``
GRAD_ATTRIBUTE = torch._C.TensorBase.__dict__["grad"]


def grad_access(func: Callable, args: tuple, kwargs: dict, reads: list, by_fulmen: bool):
    """``t.grad`` (``func`` is the descriptor's ``__get__``) or ``t.grad = v`` (``__set__``) of a tensor ``t`` that
    is not a proxy, made while tracing; a read by the user's code is added to ``reads`` as (t, its grad, where)."""
    if func.__name__ == "__set__":
        if not by_fulmen:  # refused before the write: the caller's gradients stay as they were
            raise NotImplementedError(
                "the function assigns the .grad of a tensor it does not receive (optimizer.zero_grad() sets it to "
                f"None) at {_user_location()}; a compiled program does not repeat Python attribute writes, so later "
                "calls would not make it. Call zero_grad() outside the compiled function, or "
                "zero_grad(set_to_none=False), whose in-place zeroing is compiled."
            )
        return func(*args, **kwargs)
    grad = func(*args, **kwargs)
    if not by_fulmen:
        reads.append((args[0], grad, _user_location()))
    return grad


@contextlib.contextmanager
def recording_optimizer_steps(trace: Trace, stepped: list) -> Iterator[None]:
    """Collect into ``stepped`` the optimizers whose ``step()`` runs in this thread while ``trace`` records (torch's
    global step pre-hook runs for every optimizer's step, also through an LR scheduler's wrapper of it)."""

    def record(opt, args, kwargs):
        if get_tracectx() is trace and all(opt is not o for o in stepped):
            stepped.append(opt)

    handle = register_optimizer_step_pre_hook(record)
    try:
        yield
    finally:
        handle.remove()
