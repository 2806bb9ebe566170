"""``fulmen.jit(DDP(model))``: DDP's forward runs eagerly on every call, around the compiled ``model``.

DDP's forward does per-call work in Python: ``_pre_forward`` prepares the reducer when gradients are to be synced
(``require_backward_grad_sync``, which ``no_sync()`` clears), ``_post_forward`` tells it which outputs the backward
starts from. Tracing it would record none of that, so cached calls would never all-reduce gradients. The wrapper
returned here calls the DDP object itself, as eager does, with DDP's ``module`` seen as ``fulmen.jit(module)`` for
the duration of the call: DDP's hooks on the parameters' gradient accumulators fire as the compiled backward
accumulates into ``.grad``, exactly as for ``DDP(fulmen.jit(model))``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

from torch import nn

from fulmen.executors.base import Executor
from fulmen.frontend.module import JittedModule


class JittedDDP(JittedModule):
    """``fulmen.jit(ddp)``: behaves as ``ddp`` (parameters and ``state_dict`` under its names, ``no_sync()``,
    ``module``); a call runs ``ddp``'s forward with ``ddp.module`` compiled::

        model = fulmen.jit(DistributedDataParallel(model))
        with model.no_sync():
            model(x).sum().backward()   # accumulates locally
        model(x).sum().backward()       # all-reduces
    """

    def __init__(self, ddp: nn.Module, executors: Sequence[Executor | str] | None = None, **options):
        nn.Module.__init__(self)
        self._parameters = ddp._parameters
        self._buffers = ddp._buffers
        self._modules = ddp._modules
        self._non_persistent_buffers_set = ddp._non_persistent_buffers_set
        inner = ddp.module if isinstance(ddp.module, JittedModule) else JittedModule(ddp.module, executors, **options)
        object.__setattr__(self, "_fulmen_module", ddp)
        object.__setattr__(self, "_fulmen_inner", inner)
        object.__setattr__(self, "_fulmen_jitted", inner._fulmen_jitted)  # last_traces, compile_stats
        object.__setattr__(self, "_fulmen_swap_lock", threading.RLock())

    def forward(self, *args, **kwargs):
        ddp = self._fulmen_module
        with self._inner_compiled():
            return ddp(*args, **kwargs)

    @contextlib.contextmanager
    def _inner_compiled(self) -> Iterator[None]:
        """DDP's forward calls ``self.module``: for this call, that is the compiled module (which shares the
        original's parameter, buffer and submodule dictionaries, so whatever DDP reads through it is unchanged)."""
        modules, inner = self._fulmen_module._modules, self._fulmen_inner
        with self._fulmen_swap_lock:
            original = modules["module"]
            if original is inner:  # DDP(fulmen.jit(model)) jitted again, or a nested call
                yield
                return
            modules["module"] = inner
            try:
                yield
            finally:
                modules["module"] = original

    def __getattr__(self, name: str):
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            return getattr(self._fulmen_module, name)  # no_sync, join, module, ...: DDP's own, unrouted

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_fulmen_swap_lock", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        object.__setattr__(self, "_fulmen_swap_lock", threading.RLock())

    def __repr__(self) -> str:
        return f"fulmen.jit({self._fulmen_module!r})"
