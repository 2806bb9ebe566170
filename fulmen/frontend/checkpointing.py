"""While a program is traced, ``torch.utils.checkpoint`` regions are recorded so that the backward recomputes them.

Eager checkpointing drops the tensors the ops of a region save for the backward and runs the region again when
the backward first needs one. fulmen sees the region's operations while tracing (the checkpointed function runs
on proxies); what it must keep is *where the region was*. Each region is recorded on the trace as a
``CheckpointRegion``: the names of the values its operations defined, and the selective-checkpointing policy
given with it. Rematerialization (``fulmen.transforms.checkpoint_regions``) then recomputes those values in the
backward instead of saving them; only what enters a region (and what leaves it for later operations) is kept.

Both forms of ``torch.utils.checkpoint.checkpoint`` reach this module (``checkpoint_sequential`` calls it):

- ``use_reentrant=True`` calls ``CheckpointFunction.apply``, which ``fulmen.frontend.tracing`` intercepts: the
  function is traced inside ``region()``;
- ``use_reentrant=False`` calls ``_checkpoint_without_reentrant_generator`` around the function; while this thread
  traces, that call is routed (``fulmen.frontend.higher_order``) to ``without_reentrant`` below, which opens a
  region before the function runs and closes it after;
- a graph Dynamo captured around ``checkpoint`` (``torch.compile(backend="fulmen")``) calls the
  ``tag_activation_checkpoint`` operator, routed to ``tag_activation_checkpoint`` below. PyTorch's own version of
  that operator calls ``checkpoint(..., preserve_rng_state=False)`` whatever the user asked for, because Inductor
  keeps the forward's random numbers for the recomputation on its own; fulmen's regions keep them too, so the
  user's ``preserve_rng_state`` (recorded in the operator's arguments) is what decides.

``context_fn=functools.partial(create_selective_checkpoint_contexts, policy)`` is honoured: each operation of the
region is offered to the policy with the ATen operators eager would dispatch for it; an operation the policy saves
(``MUST_SAVE``/``PREFER_SAVE``) keeps its result, the others are recomputed. Any other ``context_fn`` is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from fulmen.core.devices import to_torch_device
from fulmen.core.draws import draws
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import BoundSymbol
from fulmen.core.symbolic import size_hint
from fulmen.core.trace import get_tracectx, tracectx
from fulmen.transforms.checkpoint_regions import CheckpointRegion


@contextlib.contextmanager
def region(policy: Callable | None = None, preserve_rng_state: bool = True) -> Iterator[None]:
    """Record the operations traced inside as one checkpointed region of the current trace. Outside tracing, or in
    a nested scope (``fulmen.grad`` inside the program), nothing is recorded: the region is traced as usual."""
    trc = get_tracectx()
    if trc is None or len(trc.scopes) != 1:
        yield
        return
    start = len(trc.bound_symbols)
    yield
    bsyms = trc.bound_symbols[start:]
    if not preserve_rng_state and any(map(draws, bsyms)):
        raise NotImplementedError(
            "torch.utils.checkpoint.checkpoint(..., preserve_rng_state=False) around random operations inside a "
            "fulmen-compiled function: eager draws new random numbers when it recomputes the region, fulmen's "
            "backward uses the forward's; pass preserve_rng_state=True (the default)"
        )
    names = frozenset(p.name for b in bsyms for p in b.flat_proxy_outs)
    saved: frozenset[str] = frozenset()
    if policy is not None:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        saved = frozenset(p.name for b in bsyms if _policy_saves(policy, b, fake) for p in b.flat_proxy_outs)
    if names:
        trc.checkpoint_regions.append(CheckpointRegion(names, saved))


def _selective_policy(context_fn: Callable) -> Callable | None:
    """The policy function of ``context_fn`` (``None`` for the default, which recomputes everything)."""
    if context_fn is torch_checkpoint.noop_context_fn:
        return None
    contexts = context_fn()
    forward = contexts[0] if isinstance(contexts, tuple) and len(contexts) == 2 else None
    policy = getattr(forward, "policy_fn", None)
    if not isinstance(forward, torch_checkpoint._CachingTorchDispatchMode) or policy is None:
        raise NotImplementedError(
            f"torch.utils.checkpoint.checkpoint(context_fn={context_fn!r}) inside a fulmen-compiled function: fulmen "
            "honours only the default context_fn and functools.partial(create_selective_checkpoint_contexts, "
            "policy); call this checkpoint outside the compiled function, or express the policy that way"
        )
    return policy


def without_reentrant(
    fn: Callable,
    preserve_rng_state: bool = True,
    context_fn: Callable = torch_checkpoint.noop_context_fn,
    *_: Any,
    **__: Any,
) -> Iterator[None]:
    """Traced stand-in for ``torch.utils.checkpoint._checkpoint_without_reentrant_generator``: ``checkpoint`` calls
    ``next`` on it once before running the function and once after (which ends it). The backward sees the forward's
    random numbers (``fulmen.transforms.checkpoint_regions``); ``preserve_rng_state=False`` around random operations
    is refused by ``region``."""
    policy = _selective_policy(context_fn)
    with region(policy, preserve_rng_state):
        yield


def tag_activation_checkpoint(gmod: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """Traced stand-in for ``torch.ops.higher_order.tag_activation_checkpoint`` (a checkpointed function in a graph
    Dynamo captured): the graph's operations are one region, with the ``context_fn`` Dynamo kept for it."""
    policy = _selective_policy(gmod.meta.get("_checkpoint_context_fn", torch_checkpoint.noop_context_fn))
    with region(policy, kwargs.get("preserve_rng_state", True)):
        return torch.fx.Interpreter(gmod).run(*args)


# ---------------------------------------------------------------------------------------------------------
# selective checkpointing: which operations the policy saves

_SAVE = (torch_checkpoint.CheckpointPolicy.MUST_SAVE, torch_checkpoint.CheckpointPolicy.PREFER_SAVE)


class _Dispatched(TorchDispatchMode):
    """Records the ATen operators (and their arguments) a torch call dispatches."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _fake(x: Any, fake: FakeTensorMode) -> Any:
    if isinstance(x, TensorProxy):
        with fake:
            return torch.empty([size_hint(s) for s in x.shape], dtype=x.dtype, device=to_torch_device(x.device))
    if isinstance(x, (tuple, list)):
        return type(x)(_fake(v, fake) for v in x)
    return x


def _dispatched(bsym: BoundSymbol, fake: FakeTensorMode) -> list[tuple[Any, tuple, dict]]:
    """The ATen operators (with their arguments) eager dispatches for ``bsym``'s torch call, found by running it on
    fake tensors of the same sizes, dtypes and devices (the device picks kernels: attention's, for one)."""
    torch_fn = bsym.sym.torch_fns[0] if bsym.sym.torch_fns else None
    if torch_fn is None:
        return []
    recorder = _Dispatched()
    try:
        args, kwargs = _fake(bsym.args, fake), {k: _fake(v, fake) for k, v in bsym.kwargs.items()}
        with tracectx(None), fake, recorder:  # not traced: a question about eager
            torch_fn(*args, **kwargs)
    except Exception:  # not replayable on fake tensors: offered as the torch callable itself
        return [(torch_fn, (), {})]
    return [(f, a, k) for f, a, k in recorder.calls if f not in torch_checkpoint.SAC_IGNORED_OPS]


def _policy_saves(policy: Callable, bsym: BoundSymbol, fake: FakeTensorMode) -> bool:
    """Whether ``policy`` saves the result of any ATen operator eager dispatches for ``bsym``'s torch call."""
    context = torch_checkpoint.SelectiveCheckpointContext(is_recompute=False)
    for func, args, kwargs in _dispatched(bsym, fake):
        decision = policy(context, func, *args, **kwargs)
        if isinstance(decision, bool):
            decision = torch_checkpoint._policy_from_bool(decision)
        if decision in _SAVE:
            return True
    return False
