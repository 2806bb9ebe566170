"""Collectives (``torch.distributed``) as traced operations with their real semantics.

Every collective is recorded as two symbols, as PyTorch's functional collectives run it: one that starts the
communication and returns a tensor still in flight, and ``wait_tensor``, which waits for it::

    t1 = torch.ops._c10d_functional.all_reduce(t0, 'sum', '0')  # t1: "cpu f32[4]"
    t2 = torch.ops._c10d_functional.wait_tensor(t1)  # t2: "cpu f32[4]"

The group is a static argument (its name), the result a new value: readers of the collective's input before the
call read the old value, readers after it read ``t2``, so no pass can move a reader across it. Both symbols are
tagged ``COMMUNICATION`` (never removed, merged, recomputed, copied or fused; starts keep their order, since every
rank must issue the same collectives in the same order), and ``wait_tensor`` also ``WAIT`` (schedulers move it as
late as its readers allow, ``fulmen.transforms.overlap``).

The c10d API (``dist.all_reduce(t)``, which writes ``t`` in place, ``async_op=True`` with ``work.wait()``) becomes
these symbols plus an in-place update (``fulmen.torch.inplace.mutate``) made as autograd does not see it: eager's
autograd ignores c10d collectives, so the gradient passes through them unchanged. The functional collectives
(``torch.distributed._functional_collectives``, the ``torch.ops._c10d_functional`` ops) are differentiable, and
so are ``torch.distributed.nn.functional``'s ``all_reduce``, ``all_gather`` and ``reduce_scatter``: their
gradient rules are in ``fulmen.transforms.collective_grads``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from fulmen.core import langctx
from fulmen.core.proxies import TensorProxy, _user_location
from fulmen.core.shared_patch import SharedPatch
from fulmen.core.symbol import OpTags, Symbol
from fulmen.core.trace import get_tracectx
from fulmen.core.utils import check, contiguous_strides
from fulmen.torch.registry import register_function
from fulmen.torch.shape import layout_of

_REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")
_TAGS = (OpTags.COMMUNICATION, OpTags.DONT_DCE)


def group_name(group, where: str) -> str:
    """The name of the process group a collective's ``group`` argument stands for (``None``: the default one).
    Traces hold the name, a static argument: each call resolves it to the group registered under it."""
    if isinstance(group, str):
        return group
    if group is None:
        check(
            dist.is_initialized(),
            lambda: (
                f"{where}: torch.distributed is not initialized; call "
                "dist.init_process_group() before calling the jitted function"
            ),
            RuntimeError,
        )
        group = dist.group.WORLD
    name = getattr(group, "group_name", None)
    if isinstance(name, str):
        return name
    from torch.distributed._functional_collectives import _resolve_group_name

    return _resolve_group_name(group)


def _op_name(op, where: str) -> str:
    """``ReduceOp.SUM`` or ``"sum"`` -> ``"sum"``."""
    name = op.lower() if isinstance(op, str) else str(getattr(op, "name", op)).rsplit(".", 1)[-1].lower()
    check(
        name in _REDUCE_OPS,
        lambda: f"{where}: unsupported reduce op {op!r}; use one of {list(_REDUCE_OPS)}",
        ValueError,
    )
    return name


def _in_flight(x: TensorProxy, shape=None) -> TensorProxy:
    return TensorProxy(like=x, shape=tuple(x.shape if shape is None else shape), requires_grad=x.requires_grad)


def _contiguous(x):
    """``x``, or a contiguous copy where its layout is another (the collectives read memory in order)."""
    strides = layout_of(x) if isinstance(x, TensorProxy) else None
    return x if strides is None or tuple(strides) == contiguous_strides(x.shape) else x.contiguous()


def _check_tensor(x, where: str) -> None:
    check(isinstance(x, TensorProxy), lambda: f"{where}: expected a tensor, got {type(x).__name__}", TypeError)


def _all_reduce_meta(x, reduce_op: str, group_name: str):
    _check_tensor(x, "all_reduce")
    check(reduce_op in _REDUCE_OPS, lambda: f"all_reduce: unsupported reduce op {reduce_op!r}", ValueError)
    return _in_flight(x)


def _all_gather_meta(x, group_size: int, group_name: str):
    _check_tensor(x, "all_gather_into_tensor")
    check(x.ndim > 0, lambda: "all_gather_into_tensor: the input must have at least one dimension", ValueError)
    return _in_flight(x, (x.shape[0] * group_size, *x.shape[1:]))


def _reduce_scatter_meta(x, reduce_op: str, group_size: int, group_name: str):
    _check_tensor(x, "reduce_scatter_tensor")
    check(
        x.ndim > 0 and x.shape[0] % group_size == 0,
        lambda: (
            f"reduce_scatter_tensor: the input's first dimension "
            f"({x.shape[0] if x.ndim else 'none'}) must be a multiple of the group size {group_size}"
        ),
        ValueError,
    )
    return _in_flight(x, (x.shape[0] // group_size, *x.shape[1:]))


def _broadcast_meta(x, src: int, group_name: str):
    _check_tensor(x, "broadcast")
    return _in_flight(x)


def _wait_meta(x):
    _check_tensor(x, "wait_tensor")
    return TensorProxy(like=x, requires_grad=x.requires_grad)


def _symbol(name: str, meta: Callable, tags: tuple = _TAGS, variant: str = "") -> Symbol:
    op = getattr(torch.ops._c10d_functional, name)
    sym = Symbol(
        name=name,
        meta=meta,
        id=f"torch.ops._c10d_functional.{name}{variant}",
        is_prim=True,
        tags=tags,
        module="torch.ops._c10d_functional",
        torch_fns=(op,),
    )
    sym.torch_impl = op  # generated code calls the op itself: torch.ops._c10d_functional.<name>(...)
    if variant:  # a symbol fulmen records itself (below), never what a torch call maps to
        return sym
    langctx.torch_functions[op] = langctx.torch_functions[op.default] = sym
    # the differentiable twins (all_gather_tensor_autograd, which DTensor uses): the same op, gradients included
    twin = getattr(torch.ops._c10d_functional_autograd, name, None)
    if twin is not None:
        langctx.torch_functions[twin] = langctx.torch_functions[twin.default] = sym
    return sym


all_reduce = _symbol("all_reduce", _all_reduce_meta)
all_gather_into_tensor = _symbol("all_gather_into_tensor", _all_gather_meta)
reduce_scatter_tensor = _symbol("reduce_scatter_tensor", _reduce_scatter_meta)
broadcast = _symbol("broadcast", _broadcast_meta)
wait_tensor = _symbol("wait_tensor", _wait_meta, _TAGS + (OpTags.WAIT,))

# FSDP2's parameter all-gather (``fulmen.frontend.fsdp2_program``): the same two ops, printed and run as above, as
# two symbols of their own. They are ``RECOMPUTABLE``: rematerialization gathers a unit's parameters again in the
# backward instead of keeping the full-size parameters alive from the forward (FSDP2 reshards after forward), which
# is sound because every rank runs the same backward program. The gradient is FSDP2's (``collective_grads``): the
# reduce-scatter of the full gradient, averaged over the ranks. With overlap on, one unit's gather is in flight at
# a time, started while the unit before computes (``PREFETCH``: FSDP2's prefetch), and one unit's reduce-scatter,
# waited for when the next one starts (``ONE_IN_FLIGHT``: a reduce-scatter holds its full-size input until its wait).
param_all_gather = _symbol(
    "all_gather_into_tensor", _all_gather_meta, _TAGS + (OpTags.RECOMPUTABLE, OpTags.PREFETCH), ".param"
)
param_reduce_scatter = _symbol(
    "reduce_scatter_tensor", _reduce_scatter_meta, _TAGS + (OpTags.ONE_IN_FLIGHT,), ".param"
)
param_wait = _symbol("wait_tensor", _wait_meta, _TAGS + (OpTags.WAIT, OpTags.RECOMPUTABLE), ".param")


def is_wait_wrapper(func) -> bool:
    """Whether ``func`` is ``_c10d_functional._wrap_tensor_autograd``: ``_functional_collectives.all_reduce`` and
    friends hand it the in-flight tensor, and it waits when the result is first used; while tracing, that is
    ``wait_tensor``. (A Python custom op that exists once ``torch.distributed._functional_collectives`` is
    imported, which fulmen leaves to the program: it is recognized when it is met.)"""
    return getattr(func, "namespace", None) == "_c10d_functional" and getattr(func, "_opname", None) == (
        "_wrap_tensor_autograd"
    )


# ---------------------------------------------------------------------------------------------------------
# the c10d API: in-place collectives, async_op=True and Work.wait()


class TracedWork:
    """What ``dist.<collective>(..., async_op=True)`` returns while tracing: ``wait()`` records the waits and
    makes the results the tensors' new values (until then they hold their old values)."""

    def __init__(self, writes: list[tuple[TensorProxy, TensorProxy, Callable | None]]):
        self._writes = writes
        self._done = False

    def wait(self, timeout=None) -> bool:
        if not self._done:
            self._done = True
            _finish(self._writes)
        return True

    def is_completed(self) -> bool:
        return self._done

    def __getattr__(self, name: str):
        raise NotImplementedError(
            f"Work.{name}() on a collective inside a function compiled with fulmen.jit is not supported (only "
            f"wait() and is_completed() are).\n  at {_user_location()}\nCall work.wait() instead."
        )


def _finish(writes) -> None:
    from fulmen.torch.inplace import mutate

    with torch.no_grad():  # eager's autograd does not see c10d collectives: gradients pass through unchanged
        for target, in_flight, finish in writes:
            value = wait_tensor(in_flight)
            if finish is not None:
                finish(value)
            else:
                mutate(target, value if tuple(value.shape) == tuple(target.shape) else value.reshape(target.shape))


def _same_dtype(out, x, where: str) -> None:
    check(
        out.dtype == x.dtype,
        lambda: f"{where}: the output's dtype {out.dtype} differs from the input's {x.dtype}; make them equal",
        TypeError,
    )


def _c10d(writes, async_op: bool):
    work = TracedWork(writes)
    if async_op:
        return work
    work.wait()
    return None


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _start(fn: Callable, *args):
    with torch.no_grad():
        return fn(*args)


def c10d_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """``dist.all_reduce``: ``tensor`` takes the reduced value."""
    name = group_name(group, "dist.all_reduce")
    started = _start(all_reduce, _contiguous(tensor), _op_name(op, "dist.all_reduce"), name)
    return _c10d([(tensor, started, None)], async_op)


def c10d_all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
    """``dist.all_gather_into_tensor`` / ``all_gather_single``: ``output_tensor`` takes the ranks' inputs, stacked
    along the first dimension (or concatenated: only the number of elements has to match, as in eager)."""
    size, name = _group_size(group), group_name(group, "dist.all_gather_into_tensor")
    _same_dtype(output_tensor, input_tensor, "dist.all_gather_into_tensor")
    x = _contiguous(input_tensor)
    if x.ndim == 0:
        x = x.reshape(1)
    started = _start(all_gather_into_tensor, x, size, name)
    return _c10d([(output_tensor, started, None)], async_op)


def c10d_reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """``dist.reduce_scatter_tensor`` / ``reduce_scatter_single``: ``output`` takes this rank's part of the reduced
    ``input``."""
    size, name = _group_size(group), group_name(group, "dist.reduce_scatter_tensor")
    _same_dtype(output, input, "dist.reduce_scatter_tensor")
    started = _start(reduce_scatter_tensor, _contiguous(input), _op_name(op, "dist.reduce_scatter_tensor"), size, name)
    return _c10d([(output, started, None)], async_op)


def c10d_broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    """``dist.broadcast``: ``tensor`` takes rank ``src``'s value."""
    name = group_name(group, "dist.broadcast")
    if group_src is None:
        check(src is not None, lambda: "dist.broadcast: give src or group_src", ValueError)
        group_src = src if group is None else dist.get_group_rank(group, src)
    started = _start(broadcast, _contiguous(tensor), group_src, name)
    return _c10d([(tensor, started, None)], async_op)


def c10d_all_gather(tensor_list, tensor, group=None, async_op=False):
    """``dist.all_gather`` (the list form): each tensor of ``tensor_list`` takes one rank's ``tensor``."""
    from fulmen.torch.inplace import mutate

    size, name = _group_size(group), group_name(group, "dist.all_gather")
    check(
        len(tensor_list) == size,
        lambda: f"dist.all_gather: tensor_list has {len(tensor_list)} tensors for a group of {size} ranks",
        ValueError,
    )
    started = _start(all_gather_into_tensor, _contiguous(tensor).reshape(1, *tensor.shape), size, name)

    def scatter_to_list(value):
        for target, piece in zip(tensor_list, value.unbind(0)):
            mutate(target, piece)

    return _c10d([(None, started, scatter_to_list)], async_op)


if dist.is_available():
    register_function([dist.all_reduce], c10d_all_reduce)
    def _present(*names: str) -> list:
        """The functions of these names (``module.name`` under torch.distributed) this torch release has."""
        found = (getattr(dist.distributed_c10d if "." in n else dist, n.rpartition(".")[2], None) for n in names)
        return [f for f in found if f is not None]

    register_function(_present("all_gather_single", "all_gather_into_tensor", "c10d._all_gather_base"),
                      c10d_all_gather_single)
    register_function(_present("reduce_scatter_single", "reduce_scatter_tensor", "c10d._reduce_scatter_base"),
                      c10d_reduce_scatter_single)
    register_function([dist.broadcast], c10d_broadcast)
    register_function([dist.all_gather], c10d_all_gather)


# ---------------------------------------------------------------------------------------------------------
# torch.distributed.nn.functional: the differentiable c10d collectives (autograd Functions)


def _nn_all_reduce(op, group, tensor):
    """``_AllReduce.apply(op, group, tensor)``: a new tensor, the reduced value; its gradient the all-reduce of
    the cotangents."""
    name = group_name(group, "torch.distributed.nn.functional.all_reduce")
    return wait_tensor(all_reduce(_contiguous(tensor), _op_name(op, "all_reduce"), name))


def _nn_all_gather(group, tensor):
    """``_AllGather.apply(group, tensor)``: one tensor per rank; the gradient reduce-scatters the cotangents."""
    size, name = _group_size(group), group_name(group, "torch.distributed.nn.functional.all_gather")
    gathered = wait_tensor(all_gather_into_tensor(_contiguous(tensor).reshape(1, *tensor.shape), size, name))
    return tuple(gathered.unbind(0))


def _nn_reduce_scatter(op, group, output, *inputs):
    """``_Reduce_Scatter.apply(op, group, output, *inputs)``: this rank's part of the reduced inputs; the gradient
    all-gathers the cotangents. Eager also writes the result into ``output``, outside autograd, as done here."""
    from fulmen.torch.inplace import mutate

    size, name = _group_size(group), group_name(group, "torch.distributed.nn.functional.reduce_scatter")
    check(
        len(inputs) == size,
        lambda: f"torch.distributed.nn.functional.reduce_scatter: {len(inputs)} inputs for a group of {size} ranks",
        ValueError,
    )
    stacked = torch.stack([_contiguous(x).reshape(output.shape) for x in inputs])
    result = wait_tensor(reduce_scatter_tensor(stacked, _op_name(op, "reduce_scatter"), size, name))
    result = result.reshape(output.shape)
    with torch.no_grad():
        mutate(output, result)
    return result


_NN = "torch.distributed.nn.functional."
_original_refusal: Callable | None = None


def _refuse_unless_traced(name, *, suggestion=None):
    if get_tracectx() is None:  # another thread under torch.compile: PyTorch's refusal
        return _original_refusal(name, suggestion=suggestion)
    return None


def _lift_refusal() -> None:
    global _original_refusal
    module = sys.modules["torch.distributed.nn.functional"]
    _original_refusal = module._not_supported_under_compile
    module._not_supported_under_compile = _refuse_unless_traced


def _restore_refusal() -> None:
    sys.modules["torch.distributed.nn.functional"]._not_supported_under_compile = _original_refusal


_refusal_lifted = SharedPatch(_lift_refusal, _restore_refusal)


@contextlib.contextmanager
def nn_functional_traceable():
    """While fulmen traces, ``torch.distributed.nn.functional`` sees ``torch.compiler.is_compiling()`` and refuses
    to run; its Functions are recorded as fulmen's collectives (above), so the refusal is lifted for the threads
    that trace, for as long as any traces (a scoped patch; other threads keep PyTorch's behaviour)."""
    module = sys.modules.get("torch.distributed.nn.functional")  # not imported: nothing to lift
    if module is None or not hasattr(module, "_not_supported_under_compile"):
        yield
        return
    with _refusal_lifted:
        yield


langctx.autograd_functions.update(
    {
        _NN + "_AllReduce": _nn_all_reduce,
        _NN + "_AllGather": _nn_all_gather,
        _NN + "_Reduce_Scatter": _nn_reduce_scatter,
    }
)


# ---------------------------------------------------------------------------------------------------------
# every other c10d call on traced tensors (send/recv, all_to_all, reduce, gather, scatter, ...)

_opaque: dict[Callable, Symbol] = {}


def is_c10d(func) -> bool:
    """Whether ``func`` is a c10d function (``torch.distributed.distributed_c10d``) with no symbol above."""
    return getattr(func, "__module__", None) == "torch.distributed.distributed_c10d"


def _tensor_leaves(tree) -> list:
    from torch.utils._pytree import tree_leaves

    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _on_copies(func: Callable) -> Callable:
    """``func`` run on copies of its tensor arguments, synchronously; returns the copies, as the call left them."""

    signature = inspect.signature(func)

    def run(*args, **kwargs):
        from torch.utils._pytree import tree_map

        bound = signature.bind(*args, **kwargs)
        if "async_op" in signature.parameters:
            bound.arguments["async_op"] = False
        args, kwargs = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (bound.args, bound.kwargs))
        work = func(*args, **kwargs)
        if hasattr(work, "wait"):  # isend / irecv
            work.wait()
        return tuple(_tensor_leaves((args, kwargs)))

    run.__name__ = run.__qualname__ = f"{func.__name__}_on_copies"
    return run


def record_c10d(func: Callable) -> Callable:
    """What a c10d call without a symbol of its own records: one operation running it on copies of its tensors,
    whose new values then replace them (as ``mutate`` does for any in-place update), outside autograd as in eager.
    It is tagged ``COMMUNICATION`` and ``SIDE_EFFECT``: nothing moves across it, nothing removes or repeats it."""
    sym = _opaque.get(func)
    if sym is None:
        impl = _on_copies(func)

        def meta(*args, **kwargs):
            return tuple(TensorProxy(like=t, requires_grad=False) for t in _tensor_leaves((args, kwargs)))

        sym = Symbol(
            name=impl.__name__,
            meta=meta,
            id=f"c10d:{func.__name__}",
            is_prim=True,
            tags=(OpTags.COMMUNICATION, OpTags.SIDE_EFFECT, OpTags.DONT_DCE),
            torch_fns=(impl,),
        )
        sym.torch_impl = impl
        _opaque[func] = sym

    def call(*args, **kwargs):
        from fulmen.torch.inplace import mutate

        with torch.no_grad():
            new = sym(*args, **kwargs)
            for target, value in zip(_tensor_leaves((args, kwargs)), new):
                mutate(target, value, refuse_overlap=False)
        returns_work = kwargs.get("async_op") or func.__name__ in ("isend", "irecv")
        return TracedWork([]) if returns_work else None

    return call
