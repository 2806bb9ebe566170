"""Whether eager PyTorch accepts ``out=`` tensors of a dtype other than the result's.

Eager has no single rule: elementwise ops and most reductions cast their result into ``out`` where
``torch.can_cast`` allows it, while ``gather``, ``mm``, ``max(dim)``, ``aminmax``, ``where``, ``complex``,
``multinomial`` ... require the exact dtype, and meta kernels do not always check what the real ones do. So the
torch function itself is asked, on CPU stand-ins of the arguments (one element each, expanded to their shapes),
once with ``out`` tensors of the result's dtypes and once with the dtypes given: an error the second call alone
raises is the one eager raises. This runs while tracing, and only for ``out=`` tensors whose dtype differs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from fulmen.core.symbolic import contains_symbolic


def _stand_in(x: Any) -> Any:
    if not hasattr(x, "shape") or not hasattr(x, "dtype") or not isinstance(x.dtype, torch.dtype):
        return x
    # ones for floating values (a valid probability, a positive scale), zeros for integers (a valid index)
    fill = 1 if x.dtype.is_floating_point or x.dtype.is_complex else 0
    return torch.full((), fill, dtype=x.dtype).expand(tuple(x.shape))


def out_dtype_error(func, args: tuple, kwargs: dict, outs, results, single: bool) -> RuntimeError | None:
    """The error eager raises for ``func(*args, **kwargs, out=outs)`` because of the dtypes of ``outs``
    (``results``: what fulmen computed without ``out``), or None when eager accepts them (or cannot be asked)."""
    wanted = [o.dtype for o in outs]
    computed = [r.dtype for r in results]
    if wanted == computed or contains_symbolic((args, kwargs, [o.shape for o in outs])):
        return None
    try:
        with torch._C.DisableTorchFunction(), torch.random.fork_rng(devices=[]):
            cpu_args, cpu_kwargs = tree_map(_stand_in, args), tree_map(_stand_in, kwargs)

            def call(dtypes):
                out = [torch.empty(tuple(o.shape), dtype=d) for o, d in zip(outs, dtypes)]
                try:
                    func(*cpu_args, **cpu_kwargs, out=out[0] if single else tuple(out))
                except RuntimeError as e:
                    return e
                return None

            if call(computed) is not None:  # the stand-ins themselves are refused: eager cannot be asked this way
                return None
            return call(wanted)
    except Exception:  # arguments that have no CPU stand-in (devices, dtypes CPU lacks): not asked
        return None
