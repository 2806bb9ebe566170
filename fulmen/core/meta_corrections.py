"""Output metadata an implementation returned where its symbol's meta declared other metadata.

An executor's implementation is checked against its symbol's meta at its first call
(``fulmen.executors.checked_implementation``). When both return tensors in the same places and only a tensor's
shape, dtype or device differs (seed 000's meta declares int64 losses for a kernel that returns float32), the
check records what the implementation returned here, for that meta function and those argument types, warns, and
the jitted function traces again: ``Symbol.__call__`` then gives the trace proxies with the returned metadata, so
every later operation is traced for the values the program really computes (``check_trace`` reads them too). Keyed
by the meta function, they hold for every symbol that shares it: the traced symbol and the executor's symbol that
runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fulmen.core.devices import to_device
from fulmen.core.proxies import TensorProxy

#: meta function -> {argument signature: ([(shape, dtype, device) of each output tensor, in order], epoch)}
corrections: dict[Callable, dict[tuple, tuple[list[tuple], int]]] = {}
#: How many corrections were recorded: a trace remembers it (``Trace.meta_epoch``), and its program's check tells a
#: correction it was traced with from one recorded after (``recorded_after``).
epoch = 0


def signature(args: tuple, kwargs: dict) -> tuple:
    """What a call's outputs may depend on, alike for proxies (tracing) and tensors (running): each tensor's shape,
    dtype and device, the other values as they are."""

    def sig(x):
        if isinstance(x, TensorProxy | torch.Tensor):  # a proxy may also be a torch.Tensor: same description
            return ("tensor", _sizes(x), x.dtype, str(to_device(x.device)))
        if type(x) in (tuple, list):
            return (type(x).__name__, *map(sig, x))
        if type(x) is dict:
            return ("dict", *((k, sig(v)) for k, v in x.items()))
        try:
            hash(x)
        except TypeError:
            return ("unhashable", repr(x))
        return x

    return sig(args), sig(kwargs)


def _sizes(x) -> tuple:
    # a symbolic size by its name: int() would record a guard that specializes the program on its value
    return tuple(s if type(s) is int else str(s) for s in x.shape)


def tensor_metas(out: Any) -> list[tuple]:
    """(shape, dtype, device) of each tensor in ``out`` (tuples and lists walked in order)."""
    if isinstance(out, TensorProxy | torch.Tensor):
        return [(_sizes(out), out.dtype, str(to_device(out.device)))]
    if isinstance(out, tuple | list):
        return [m for v in out for m in tensor_metas(v)]
    return []


def record(meta: Callable, args: tuple, kwargs: dict, actual: Any) -> None:
    global epoch
    epoch += 1
    corrections.setdefault(meta, {})[signature(args, kwargs)] = (tensor_metas(actual), epoch)


def recorded_after(meta: Callable, args: tuple, kwargs: dict, traced_at: int) -> bool:
    """Whether the correction for this call was recorded after a trace made at epoch ``traced_at``."""
    table = corrections.get(meta)
    found = table.get(signature(args, kwargs)) if table else None
    return found is not None and found[1] > traced_at


def corrected(meta: Callable, args: tuple, kwargs: dict, out: Any) -> Any:
    """``out`` (what ``meta`` returned for these arguments) with the recorded metadata, if any was recorded."""
    table = corrections.get(meta)
    found = table.get(signature(args, kwargs)) if table else None
    if found is None:
        return out
    remaining = iter(found[0])

    def fix(v):
        if isinstance(v, TensorProxy):
            shape, dtype, device = next(remaining)
            if (tuple(v.shape), v.dtype, str(v.device)) == (shape, dtype, device):
                return v
            return TensorProxy(like=v, shape=shape, dtype=dtype, device=device)
        if type(v) in (tuple, list):
            return type(v)(fix(x) for x in v)
        return v

    return fix(out)
