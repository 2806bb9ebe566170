"""PyTorch's data-parallel wrappers as ``fulmen.jit`` meets them: which are compiled how, and which are refused.

A wrapper such as ``DistributedDataParallel`` does its work in Python around its module's forward, on every call:
DDP's forward arms the gradient reducer (``require_backward_grad_sync``, ``no_sync()``), FSDP's all-gathers the
sharded parameters and frees them again. Traced once, that work would run only on the call that traced it and be
missing from every cached call after it. So a wrapper is never traced:

- ``fulmen.jit(DDP(model))`` compiles ``model`` and runs DDP's own forward eagerly around the compiled call on
  every call (``fulmen.frontend.jitted_ddp``); ``DDP(fulmen.jit(model))`` is the same arrangement written
  the other way round.
- ``fulmen.jit(FSDP1(model))`` (``torch.distributed.fsdp.FullyShardedDataParallel``) is refused, naming the
  orders that work: ``FSDP(fulmen.jit(model), use_orig_params=True)`` (FSDP1 hands the module new parameter
  tensors on every call, so fulmen traces again each step: correct, not faster) and
  ``torch.compile(FSDP(model), backend="fulmen")``.
- Any such wrapper found inside a module tree that is being traced is refused (its Python would be traced).

The wrapper classes are looked up in ``sys.modules``: a program that never imported them has none to meet, and
``import fulmen`` imports no part of ``torch.distributed``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from torch import nn

_DDP_MODULE, _DDP_CLASS = "torch.nn.parallel.distributed", "DistributedDataParallel"
_FSDP1_MODULE, _FSDP1_CLASS = "torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"

_FSDP1_WORKS = (
    'torch.compile(FSDP(model), backend="fulmen") (Dynamo compiles the graphs between FSDP\'s '
    "hooks; FSDP's Python runs on every call)"
)


def _loaded_class(module_name: str, class_name: str) -> type | None:
    module = sys.modules.get(module_name)
    return getattr(module, class_name, None) if module is not None else None


def is_ddp(module: object) -> bool:
    """Whether ``module`` is a ``torch.nn.parallel.DistributedDataParallel``."""
    cls = _loaded_class(_DDP_MODULE, _DDP_CLASS)
    return cls is not None and isinstance(module, cls)


def is_fsdp1(module: object) -> bool:
    """Whether ``module`` is an FSDP1 ``FullyShardedDataParallel`` (FSDP2's ``fully_shard`` is not this class)."""
    cls = _loaded_class(_FSDP1_MODULE, _FSDP1_CLASS)
    return cls is not None and isinstance(module, cls)


def refuse_fsdp1_outside(module: nn.Module) -> None:
    """``fulmen.jit(FSDP(model))``: refused. FSDP1's forward all-gathers, swaps the module's parameters for views of
    flat parameters and reshards on every call; ``FSDP(fulmen.jit(model))`` runs that Python eagerly instead."""
    if is_fsdp1(module):
        raise NotImplementedError(
            "fulmen.jit(FullyShardedDataParallel(model)) is not supported: FSDP1's forward all-gathers the "
            "parameters and swaps them for views of flat parameters on every call, which a traced program would "
            "do only once. Wrap the other way round, FullyShardedDataParallel(fulmen.jit(model), "
            f"use_orig_params=True), or use {_FSDP1_WORKS}, or FSDP2 (torch.distributed.fsdp.fully_shard)."
        )


def refuse_traced_wrappers(modules: Iterable[nn.Module]) -> None:
    """Raise when a module tree about to be traced holds a DDP or FSDP1 wrapper (see the module docstring)."""
    ddp_cls = _loaded_class(_DDP_MODULE, _DDP_CLASS)
    fsdp1_cls = _loaded_class(_FSDP1_MODULE, _FSDP1_CLASS)
    wrappers = tuple(c for c in (ddp_cls, fsdp1_cls) if c is not None)
    if not wrappers:
        return
    for module in modules:
        if not isinstance(module, wrappers):
            continue
        if ddp_cls is not None and isinstance(module, ddp_cls):
            raise NotImplementedError(
                f"fulmen.jit: the traced module holds a DistributedDataParallel ({type(module.module).__name__} "
                "inside it); DDP's forward arms gradient all-reduction on every call, which tracing would run only "
                "once. Jit the DDP itself (fulmen.jit(DDP(model))) or the module inside it (DDP(fulmen.jit(model)))."
            )
        raise NotImplementedError(
            f"fulmen.jit: the traced module holds an FSDP1 FullyShardedDataParallel ({type(module).__name__}); "
            "FSDP1 swaps parameters for views of all-gathered flat parameters on every call, which tracing would run "
            "only once. Jit the modules FSDP1 wraps instead (FullyShardedDataParallel(fulmen.jit(block), "
            f"use_orig_params=True)), or use {_FSDP1_WORKS}, or FSDP2 (torch.distributed.fsdp.fully_shard)."
        )
