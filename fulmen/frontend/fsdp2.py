"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under ``fulmen.jit``, unit-wise: which modules' bodies fulmen
compiles where the model is not traced whole (``fulmen.frontend.fsdp2_program`` traces models with FSDP2's default
policies whole, its collectives in the trace; the rest, and blocks jitted before ``fully_shard``, come here).

FSDP2 keeps each unit's parameters sharded as DTensors between calls. Its forward pre-hook all-gathers them into
plain tensors, which the unit's ``forward`` reads, and its post-hook and autograd hooks reshard them and
reduce-scatter the gradients. fulmen compiles what runs between those hooks: the ``forward`` of each innermost unit
(one holding no other unit), whose parameters are plain tensors while it runs, so FSDP's collectives stay PyTorch's
and the program is the one ``fulmen.jit`` compiles for an unsharded block. Code outside the innermost units (the
root's own forward, which calls the blocks) runs with PyTorch: tracing it would run the blocks' hooks on traced
tensors.
"""

from __future__ import annotations

import logging
import sys

from torch import nn

log = logging.getLogger("fulmen")


def _fsdp_module_class() -> type | None:
    # no module is sharded unless FSDP2 was imported: checking costs nothing for programs that never use it
    module = sys.modules.get("torch.distributed.fsdp._fully_shard._fully_shard")
    return getattr(module, "FSDPModule", None)


def fsdp_module_class(root: nn.Module) -> type | None:
    """FSDP2's ``FSDPModule`` class if ``root`` or a submodule of it is sharded by FSDP2, else None."""
    fsdp_module = _fsdp_module_class()
    if fsdp_module is None or not any(isinstance(m, fsdp_module) for m in root.modules()):
        return None
    return fsdp_module


def innermost_units(root: nn.Module) -> list[nn.Module] | None:
    """The FSDP2 units under ``root`` (itself included) that hold no other unit, or None if ``root`` has no unit."""
    fsdp_module = _fsdp_module_class()
    if fsdp_module is None:
        return None
    units = [m for m in root.modules() if isinstance(m, fsdp_module)]
    if not units:
        return None
    inner = [u for u in units if not any(isinstance(m, fsdp_module) for m in u.modules() if m is not u)]
    log.info(
        "fulmen: %s is sharded by FSDP2 (fully_shard): fulmen compiles the forward of its %d innermost units; "
        "FSDP's hooks and the code around the units run with PyTorch",
        type(root).__name__,
        len(inner),
    )
    return inner


class ShardedModelCall:
    """What ``fulmen.jit(model)`` calls for a model sharded by FSDP2: the model itself (its hooks and the code around
    its units run with PyTorch; the units' forwards are compiled). Asking it for traces or statistics says where
    they are."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    @property
    def _stats(self):
        raise TypeError(
            f"fulmen.jit({type(self.model).__name__}): the model is sharded by FSDP2 (fully_shard), so fulmen compiled "
            "the forward of each innermost FSDP unit, not the model: ask a unit's forward for its traces and "
            "statistics, e.g. fulmen.last_traces(model.layers[0].forward)"
        )
