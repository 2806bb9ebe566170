"""What traced code reads and writes of training state it does not receive: gradients and optimizers.

An optimizer step or a gradient clip traced by ``fulmen.jit`` reads ``p.grad`` of parameters that are not inputs
and Python numbers from ``optimizer.param_groups``. ``zero_grad()`` (set_to_none) and the next backward put a new
gradient object in ``p.grad`` before every step, so a gradient the program uses as a tensor is one of its inputs,
read from ``p.grad`` on every call (``GradOf``) and checked by metadata: a new gradient like the last one runs the
same program, while None for a tensor, or another shape, stride, dtype or device, compiles again. None, a gradient
the program does not take as a tensor (only its shape or None-ness read), and one also reached another way (two
parameters holding one gradient, ``p.grad.data``, one passed as an argument) are checked by identity instead.
Hyperparameters are checked by value (an LR scheduler changes ``lr``), and the parameters each group lists by
identity (``add_param_group`` compiles again); an assignment to ``p.grad`` (``zero_grad()`` setting it to None) would
happen while tracing only, and is refused.
"""

from __future__ import annotations

import contextlib
import operator
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

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


class GradOf:
    """A captured input of a program read on every call from ``owner.grad`` (the prologue reads it), not a tensor
    object captured once."""

    __slots__ = ("owner",)

    def __init__(self, owner: torch.Tensor):
        self.owner = owner


def grad_meta(grad: torch.Tensor) -> tuple:
    """What a program that read ``grad`` as an input was traced for (the guard compares a call's gradient with it)."""
    return (type(grad), grad.shape, grad.stride(), grad.dtype, grad.device, grad.requires_grad, grad.is_inference(),
            grad.is_neg() or grad.is_conj())


def grad_facts(grad: torch.Tensor) -> tuple:
    """What a call's gradient is compared with: ``grad_meta(grad)``, and torch's C++ check of the same facts (type,
    dispatch keys, dtype, device, requires_grad, sizes, strides) made for ``grad``, or None where it takes no such
    tensor. The gradient itself is not kept."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        fast = TensorGuards(grad, dynamic_dims_sizes=[list(grad.shape)], dynamic_dims_strides=[list(grad.stride())])
        fast = fast if fast.check(grad) else None
    except Exception:  # noqa: BLE001 - a tensor TensorGuards does not take: the Python comparison decides
        fast = None
    return grad_meta(grad), fast


def grad_check(read: str, i: int, facts: tuple, env: dict) -> str:
    """The guard's condition that the tensor ``read`` (an expression) has the ``facts`` (``grad_facts``); names it
    needs go into ``env``, suffixed with ``i``."""
    (kind, shape, stride, dtype, device, requires_grad, inference, lazy), fast = facts
    if fast is not None:  # the inference bit is compared in Python, as the prologue does for its tensors
        env[f"g{i}"] = fast
        return f"(g{i}.check(x := {read}) and x.is_inference() is {inference})"
    env.update({f"t{i}": kind, f"s{i}": shape, f"st{i}": stride, f"d{i}": dtype, f"e{i}": device})
    return (f"(type(x := {read}) is t{i} and x.shape == s{i} and x.stride() == st{i} and x.dtype is d{i} "
            f"and x.device == e{i} and x.requires_grad is {requires_grad} and x.is_inference() is {inference} "
            f"and (x.is_neg() or x.is_conj()) is {lazy})")


def grad_meta_or_none(t: torch.Tensor) -> tuple | None:
    """``grad_meta(t)``, or None for a tensor that has none of it."""
    try:
        return grad_meta(t)
    except (RuntimeError, NotImplementedError):  # a sparse gradient has no strides
        return None


def describe_grad(meta: tuple) -> str:
    """``grad_meta``'s tuple in words, for the prologue's comments and the reason a call compiled again."""
    kind, shape, stride, dtype, device, requires_grad, inference, lazy = meta
    extra = "".join(text for flag, text in ((requires_grad, ", requiring grad"), (inference, ", an inference tensor"),
                                            (lazy, ", with a lazy negation or conjugation"),
                                            (kind is not torch.Tensor, f", a {kind.__name__}")) if flag)
    return f"a tensor {str(dtype).removeprefix('torch.')}{list(shape)} with strides {stride} on {device}{extra}"


def grads_at_call_time(reads: list[tuple[torch.Tensor, Any, str]], names: Sequence[str], captured: list,
                       arguments: Sequence = ()) -> tuple[list, list, list[torch.Tensor]]:
    """Make the gradients a program captured (``captured``, their input ``names``) read on every call where a call
    may replace them by new objects: those read (``reads``: tensor, its grad, where) through one tensor's ``.grad``
    only, sharing memory with no other captured tensor (``p.grad.data``, a view made outside the program, would
    still hold the traced gradient's memory) and none of the call's tensor ``arguments`` (a gradient passed in as
    well is one object in eager). Each becomes a ``GradOf`` in ``captured``, and ``reads`` is emptied (the traced
    gradients are not kept). Returns (name, tensor) of the other captured tensors, the reads, and the tensors whose
    gradients are now read on every call (``global_guard.build_guard``'s ``captured``, ``grads``, ``grads_at_call``)."""
    owners: dict[int, dict[int, torch.Tensor]] = {}
    for owner, grad, _ in reads:
        if isinstance(grad, torch.Tensor):
            owners.setdefault(id(grad), {})[id(owner)] = owner
    passed = {id(t) for t in arguments}
    memory = Counter(_memory(t) for t in captured)
    found = {}
    for i, t in enumerate(captured):
        by_id = owners.get(id(t))
        alone = memory[_memory(t)] == 1 or not _memory(t)
        if by_id is not None and len(by_id) == 1 and id(t) not in passed and alone:
            found[i] = next(iter(by_id.values()))
    checked = [(name, t) for i, (name, t) in enumerate(zip(names, captured)) if i not in found]
    for i, owner in found.items():
        captured[i] = GradOf(owner)
    moved = list(reads)
    reads.clear()
    return checked, moved, list(found.values())


def _memory(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor with no storage of its own (a subclass): its own id
        return id(t)


class OptimizerParameters:
    """Whether an optimizer's step would update the parameters it was traced with: the same ``param_groups`` list,
    group dicts and tensors in each group's ``params``, compared by identity (a C-level ``is`` per parameter, no id
    made). A program traced for these parameters updates only them, so ``add_param_group``, a group removed or
    replaced, a parameter appended to, removed from or replaced in ``group["params"]``, or ``param_groups`` rebound
    must compile again. The guard calls it and compares the result with True."""

    __slots__ = ("opt", "groups", "traced")

    def __init__(self, opt: torch.optim.Optimizer):
        self.opt = opt
        self.groups = opt.param_groups
        self.traced = [(group, list(group["params"])) for group in self.groups]

    def __call__(self) -> bool:
        groups = self.opt.param_groups
        if groups is not self.groups or len(groups) != len(self.traced):
            return False
        for group, (traced, params) in zip(groups, self.traced):
            now = group["params"]
            if group is not traced or len(now) != len(params) or not all(map(operator.is_, now, params)):
                return False
        return True

    def change(self) -> str:
        """What differs from the traced parameters, in words (the reason a call compiled again)."""
        groups = self.opt.param_groups
        if groups is not self.groups:
            return "param_groups was rebound to another list"
        if len(groups) != len(self.traced):
            return (
                f"it has {len(groups)} parameter group(s), traced with {len(self.traced)} (add_param_group, or a "
                "group removed)"
            )
        for i, (group, (traced_group, params)) in enumerate(zip(groups, self.traced)):
            if group is not traced_group:
                return f"param_groups[{i}] was replaced by another dict"
            now = group["params"]
            if len(now) != len(params):
                return f"param_groups[{i}]['params'] holds {len(now)} parameter(s), traced with {len(params)}"
            if any(p is not q for p, q in zip(now, params)):
                return f"a parameter in param_groups[{i}]['params'] was replaced by another tensor"
        return "its parameters changed"
