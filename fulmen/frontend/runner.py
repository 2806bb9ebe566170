"""The one function a cache entry calls: a compiled program's ``run`` with what the call around it must do.

A program may need, around its generated code: autocast switched off (its trace holds autocast's casts already),
the random-number state put back when it stops at a split point, conjugate/negative views resolved (and written
back), the object holders the prologue appended taken off the inputs, module attributes assigned from its extra
outputs, objects passed in updated, and a module's rebound buffers stored. ``RunPlan`` lists which of these a
program needs and ``compose`` builds one function that does them in one frame; a program that needs none runs
as it is, with nothing in between.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fulmen.frontend.split_points import ValueChanged


@dataclass
class RunPlan:
    """What the call around a program does; the defaults do nothing."""

    autocast_devices: tuple[str, ...] = ()  # autocast switched off on these device types while it runs
    restores_rng: bool = False  # split points: a program that stops at one must not have used up random numbers
    lazy_views: tuple[int, ...] = ()  # inputs resolved (resolve_conj / resolve_neg) before the call
    written: frozenset[int] = frozenset()  # of those, the positions copied back after it (the program wrote them)
    attributes: Callable[[Any], None] | None = None  # assigns the module attribute values the program returns
    objects: Any = None  # fulmen.frontend.objects' spec: holders taken off the inputs, objects updated and built
    rebind: Callable[[Any], Any] | None = None  # stores a module's rebound buffers, returns the result
    # grad mode switched on while it runs: called under no_grad, the function turns it on itself (enable_grad)
    enables_grad: bool = False

    def needed(self) -> bool:
        return bool(
            self.autocast_devices
            or self.restores_rng
            or self.lazy_views
            or self.attributes is not None
            or self.objects is not None
            or self.rebind is not None
            or self.enables_grad
        )


def compose(run: Callable, plan: RunPlan) -> Callable:
    """``run(flat)`` with everything ``plan`` asks for around it, as one function (``run`` itself when nothing)."""
    if not plan.needed():
        return run
    if plan.enables_grad:
        run = _with_grad(run)
    devices, restores_rng, rebind = plan.autocast_devices, plan.restores_rng, plan.rebind
    lazy, written, assign, objects = plan.lazy_views, plan.written, plan.attributes, plan.objects
    n_holders = len(objects.holders) if objects is not None else 0

    def run_program(flat):
        if lazy:
            flat, originals = list(flat), [flat[i] for i in lazy]
            for i in lazy:
                flat[i] = flat[i].resolve_conj().resolve_neg()
        inputs = flat[:-n_holders] if n_holders else flat
        out = _run_guarded(run, inputs, devices, restores_rng)
        if assign is not None:  # the program returns (result, module attribute values)
            out, values = out
            assign(values)
        if objects is not None:  # it returns (result, object tensors)
            out = objects.finish(out, flat[len(flat) - n_holders :] if n_holders else ())
        for i, original in zip(lazy, originals if lazy else ()):
            if i in written:
                original.copy_(flat[i])
        return rebind(out) if rebind is not None else out

    return run_program


def _with_grad(run: Callable) -> Callable:
    def run_with_grad(flat):
        with torch.enable_grad():
            return run(flat)

    return run_with_grad


def _run_guarded(run: Callable, flat, devices: tuple[str, ...], restores_rng: bool):
    """``run(flat)`` without autocast on ``devices``; with the random-number state put back if it stops at a
    split point (``restores_rng``: it may have drawn numbers before it, which the other branch's program draws
    again, as eager draws them once)."""
    if restores_rng:
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        if not devices:
            return run(flat)
        with contextlib.ExitStack() as stack:
            for device_type in devices:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            return run(flat)
    except ValueChanged:
        if restores_rng:
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
        raise
