"""Opaque symbols for torch callables that have no torch-language rule.

The op is recorded as one symbol whose metadata comes from running it on fake tensors; the torch
executor calls the original callable, and autodiff differentiates it with PyTorch's own autograd. The
trace marks it, and ``fulmen.examine`` lists such ops. In-place Tensor methods (``x.foo_()``) run on a
copy and the result replaces ``x`` (see ``fulmen.torch.inplace``), and so do the arguments other functions write
(``fulmen.torch.argument_writes``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.utils._pytree import tree_leaves, tree_map

from fulmen.core import dtypes, langctx
from fulmen.core.devices import to_torch_device
from fulmen.core.draws import callable_draws
from fulmen.core.proxies import DataDependentError, TensorProxy, _user_location
from fulmen.core.symbol import OpTags, Symbol
from fulmen.core.trace import get_tracectx
from fulmen.core.unbacked import GuardOnDataDependentSymNode, data_dependent_guard, shape_env_of, trace_shape_env
from fulmen.torch import kernel_layouts
from fulmen.torch.registry import link_views, set_lazy_bits, torch_id, with_lazy_bits
from fulmen.torch.views import set_strides, strides_of

_opaque: dict[Any, Symbol] = {}
# torch logs fake-tensor failures at ERROR level before fulmen recovers from them (see _run_on_zeros)
logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)


def _to_fake(mode, x):
    if isinstance(x, TensorProxy):
        # laid out as eager's tensor is: whether the op copies or returns a view (torch.ravel of a transposed
        # tensor copies), and its results' strides, depend on it
        t = torch.empty_strided(tuple(x.shape), strides_of(x), dtype=x.dtype, device=to_torch_device(x.device))
        t = t.requires_grad_(x.requires_grad) if x.dtype.is_floating_point or x.dtype.is_complex else t
        return with_lazy_bits(t, x)
    return x


def _fake_meta(func: Callable, name: str, views: bool = False) -> Callable:
    """The meta function of an opaque op: its outputs' metadata from running it on fake tensors. With ``views``,
    outputs that eager returns as views of the first argument (``torch.ravel``, ``torch.conj`` of a real tensor)
    are recorded as views of it, so in-place updates of either reach the other."""

    def meta(*args, **kwargs):
        fargs, out = _fake_outputs(func, name, args, kwargs)
        if fargs is None:  # a meta of its own gave the result
            return out
        if views and fargs and out is fargs[0] and isinstance(args[0], TensorProxy):
            return args[0]  # eager returns its input itself (torch.atleast_1d of a matrix): under no_grad too
        if any(isinstance(x, torch.Tensor) and _is_dtensor(x) for x in tree_leaves(out)):
            raise _makes_dtensor(name)
        layouts = {x.layout for x in tree_leaves(out) if isinstance(x, torch.Tensor)} - {torch.strided}
        if layouts:
            raise _makes_layout(name, layouts.pop())
        if type(out).__module__ == "torch.return_types":  # keep .values / .indices, as eager does
            result = type(out)(tuple(tree_map(_as_proxy, x) for x in out))
        else:
            result = tree_map(_as_proxy, out)
        if views and fargs and isinstance(fargs[0], torch.Tensor):
            _link_aliases(func, args, kwargs, fargs[0], out, result)
            for fake, proxy in zip(tree_leaves(out), tree_leaves(result)):
                if isinstance(fake, torch.Tensor) and isinstance(proxy, TensorProxy):
                    set_lazy_bits(proxy, fake.is_conj(), fake.is_neg())
        for fake, proxy in zip(tree_leaves(out), tree_leaves(result)):  # a result's layout (a view's too), as eager's
            if (isinstance(fake, torch.Tensor) and isinstance(proxy, TensorProxy)
                    and all(type(n) is int for n in (*fake.shape, *fake.stride()))):
                set_strides(proxy, fake.stride())
        _apply_kernel_rule(func, args, kwargs, result)
        return result

    return meta


def _apply_kernel_rule(func: Callable, args: tuple, kwargs: dict, result) -> None:
    """Results laid out by the kernel's own rule where the fake kernel keeps another layout (batch norm on CPU)."""
    proxies = [p for p in tree_leaves(result) if isinstance(p, TensorProxy) and p.view_of is None]
    fns = (func, func.writes_of) if hasattr(func, "writes_of") else (func,)  # a writing kernel run on copies
    ruled = kernel_layouts.rule_strides(fns, args, kwargs, [tuple(p.shape) for p in proxies], strides_of)
    for p, strides in zip(proxies, ruled or ()):
        if strides is not None:
            set_strides(p, strides)


def _is_dtensor(t: torch.Tensor) -> bool:
    # no DTensor exists unless its module was imported
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _makes_dtensor(name: str) -> NotImplementedError:
    # a traced tensor cannot stand for a DTensor: the operations after this one would be traced as plain-tensor ones
    return NotImplementedError(
        f"{name} makes a DTensor inside a traced function, which fulmen.jit does not trace (DTensor operations run "
        f"through DTensor's own dispatch and collectives).\n  at {_user_location()}\nMake the DTensors outside: "
        "fulmen.jit(model) of a module holding DTensor parameters (parallelize_module first) traces its DTensor "
        "program whole, collectives included; or use torch.compile(model, backend=\"fulmen\").")


def _makes_layout(name: str, layout: torch.layout) -> NotImplementedError:
    # a traced tensor is strided: is_sparse, .layout and every later operation would be traced as a dense tensor's
    return NotImplementedError(
        f"{name} returns a {str(layout).removeprefix('torch.')} tensor inside a traced function; fulmen.jit traces "
        f"strided tensors only.\n  at {_user_location()}\nMake it outside the compiled function, or use "
        "torch.compile(model, backend=\"fulmen\"), which runs it eagerly.")


def _as_proxy(x):
    if isinstance(x, torch.Tensor):
        return TensorProxy(shape=tuple(x.shape), dtype=x.dtype, device=x.device, requires_grad=x.requires_grad)
    return x


_DATA_DEPENDENT_OUTPUT = (torch._subclasses.fake_tensor.DynamicOutputShapeException,
                          torch._subclasses.fake_tensor.DataDependentOutputException)


def _fake_outputs(func: Callable, name: str, args: tuple, kwargs: dict) -> tuple[tuple | None, Any]:
    """``(fake arguments, fake outputs)`` of ``func`` on the proxies' metadata; ``(None, proxies)`` when a meta of
    fulmen's own answers (data-dependent sizes), or a clear error naming the user's line."""
    # a trace with symbolic sizes: fake tensors get the same symbols, and the op's checks record guards
    env = _shape_env_of((args, kwargs))
    try:
        try:
            return _run_fake(func, args, kwargs, env)
        except _DATA_DEPENDENT_OUTPUT:
            if env is not None:
                raise
            # an output size that depends on the data (nonzero, masked_select): an unbacked size of the
            # trace's ShapeEnv (fulmen.core.unbacked)
            return _run_fake(func, args, kwargs, trace_shape_env())
    except _DATA_DEPENDENT_OUTPUT as e:
        static = STATIC_RESULT_METAS.get(func)
        if static is not None:
            return None, static(*args, **kwargs)
        raise DataDependentError(
            f"{name} returns a tensor whose shape depends on tensor values, which fulmen.jit cannot trace.\n"
            f"  at {_user_location()}\nUse torch.compile(model, backend=\"fulmen\") to run it eagerly between "
            "compiled parts, or move it out of the compiled function."
        ) from e
    except GuardOnDataDependentSymNode as e:
        special = DATA_DEPENDENT_INPUT_METAS.get(func)
        out = special(*args, **kwargs) if special is not None else None
        if out is not None:
            return None, out
        raise data_dependent_guard(name, e) from e
    except RuntimeError:
        # Some meta kernels are stricter than the real ones (grouped_mm's demands bf16; the CPU kernel takes
        # float32, and Hugging Face MoE models call it so): learn the output metadata from one real call on
        # zero-filled tensors, and re-raise the fake-tensor error if that fails too.
        out = _run_on_zeros(func, args, kwargs)
        if out is None:
            raise
        return (), out
    except AssertionError as e:  # PyTorch's fake kernel refuses this form (exponential_ with generator=)
        raise NotImplementedError(
            f"{name} cannot be traced by fulmen.jit in this form: PyTorch cannot compute its result's metadata "
            f"without running it ({e}).\n  at {_user_location()}\nMove it out of the compiled function (for a "
            "generator= argument: seed the default generator with torch.manual_seed and drop generator=)."
        ) from e


def _ctc_loss_meta(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean",
                   zero_infinity=False):
    batched = log_probs.ndim == 3
    shape = (log_probs.shape[1],) if batched and reduction == "none" else ()
    return TensorProxy(shape=shape, dtype=log_probs.dtype, device=log_probs.device,
                       requires_grad=log_probs.requires_grad)


def _istft_meta(input, n_fft, hop_length=None, win_length=None, window=None, center=True, normalized=False,
                onesided=None, length=None, return_complex=False):
    # the fake kernel stops at eager's check of the window's overlap-add envelope (a value); the length is not one
    frames = input.shape[-1]
    if length is None:
        length = n_fft + (n_fft // 4 if hop_length is None else hop_length) * (frames - 1)
        length -= 2 * (n_fft // 2) if center else 0
    dtype = input.dtype if return_complex else dtypes.corresponding_real_dtype(input.dtype)
    return TensorProxy(shape=(*input.shape[:-2], length), dtype=dtype, device=input.device,
                       requires_grad=input.requires_grad or getattr(window, "requires_grad", False))


#: Results of ops whose fake-tensor kernels refuse data-dependent sizes they only use inside (ctc_loss's alignment
#: table is as long as the longest target) although the result's shape does not depend on the data; the torch
#: executor runs the op and checks its arguments, and PyTorch's autograd differentiates it.
STATIC_RESULT_METAS: dict[Callable, Callable] = {
    torch.nn.functional.ctc_loss: _ctc_loss_meta,
    torch.istft: _istft_meta,
    torch.Tensor.istft: _istft_meta,
}


def _packed_rnn_meta(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional):
    """``torch.lstm`` / ``torch.gru`` / ``torch.rnn_tanh`` / ``torch.rnn_relu`` on a PackedSequence's data, whose row
    count (the sum of the lengths) is data-dependent: one output row per input row; the final states (``(h, c)``
    for an LSTM, ``h`` otherwise) have the shapes of the initial ones."""
    if not isinstance(batch_sizes, TensorProxy):  # the padded form: its fake kernel takes every size
        return None
    states = tuple(hx) if isinstance(hx, (tuple, list)) else (hx,)
    h = states[0]
    out = TensorProxy(like=data, shape=(data.shape[0], h.shape[2] * (2 if bidirectional else 1)),
                      requires_grad=data.requires_grad or h.requires_grad or any(p.requires_grad for p in params))
    return (out, *(TensorProxy(like=s, requires_grad=out.requires_grad) for s in states))


def _pad_packed_meta(data, batch_sizes, batch_first, padding_value, total_length):
    """``torch._pad_packed_sequence``: ``(max length, batch, *features)`` (batch first if asked) and the lengths;
    the batch is ``batch_sizes[0]``, a value, so a new data-dependent size."""
    batch = trace_shape_env().create_unbacked_symint()
    torch._check(batch >= 0)
    steps = batch_sizes.shape[0] if total_length is None or total_length < 0 else total_length
    dims = (batch, steps) if batch_first else (steps, batch)
    padded = TensorProxy(like=data, shape=(*dims, *data.shape[1:]))
    return padded, TensorProxy(shape=(batch,), dtype=torch.int64, device=batch_sizes.device)


#: Metas for ops whose fake-tensor kernels cannot take a data-dependent size in their inputs (None: not this form).
DATA_DEPENDENT_INPUT_METAS: dict[Callable, Callable] = {torch.lstm: _packed_rnn_meta, torch.gru: _packed_rnn_meta,
                                                        torch.rnn_tanh: _packed_rnn_meta,
                                                        torch.rnn_relu: _packed_rnn_meta,
                                                        torch._pad_packed_sequence: _pad_packed_meta}


def _run_fake(func: Callable, args, kwargs, env) -> tuple:
    """(the fake arguments, the op's fake result) from running it under a FakeTensorMode of ``env``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=env)
    # autocast casts are explicit in the trace and generated code runs without autocast
    with mode, torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        fargs, fkwargs = tree_map(lambda x: _to_fake(mode, x), (args, kwargs))
        return fargs, func(*fargs, **fkwargs)


def _link_aliases(func: Callable, args, kwargs, base: torch.Tensor, out, result) -> None:
    """Record the outputs that eager makes views of ``base`` as views of the first argument."""
    fakes = out if isinstance(out, (tuple, list)) else (out,)
    which = [i for i, o in enumerate(fakes) if isinstance(o, torch.Tensor) and _shares_storage(o, base)]
    if not which:
        return
    # a write through a view with another dtype, or one that conjugates or negates lazily, cannot be scattered
    # element by element into the base (that only moves elements): refuse it rather than write wrong values
    transforms = any(fakes[i].dtype != base.dtype or fakes[i].is_conj() != base.is_conj()
                     or fakes[i].is_neg() != base.is_neg() for i in which)
    unview = _refuse_write(func) if transforms else None
    link_views(opaque_symbol(func), args, kwargs, result, which if isinstance(out, (tuple, list)) else None,
               unview)


def _shares_storage(out: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether eager's ``out`` is ``base``'s memory: a view, or a tensor sharing its storage without being an autograd
    view (``unsafe_split``, ``unsafe_chunk``: a write to one still shows in the other)."""
    if out is base or out._base is base:
        return True
    try:
        return out.untyped_storage()._cdata == base.untyped_storage()._cdata
    except Exception:  # a tensor without storage
        return False


def _refuse_write(func: Callable) -> Callable:
    def unview(new):
        raise NotImplementedError(
            f"an in-place update of the result of {torch_id(func)}, a view of its input holding other values "
            "(another dtype, or conjugated) that fulmen.jit has no rule for: the update could not reach the input."
            f"\n  at {_user_location()}\n"
            "Update a copy (.clone()) instead, or use torch.compile(model, backend=\"fulmen\").")

    return unview


_shape_env_of = shape_env_of


def _run_on_zeros(func: Callable, args, kwargs):
    def zeros(x):
        if isinstance(x, TensorProxy):
            return torch.zeros(tuple(x.shape), dtype=x.dtype, device=to_torch_device(x.device))
        return x

    try:
        # fork_rng: a random op run here must not move the caller's generator (the run is only for metadata)
        with torch.no_grad(), torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False), \
                torch.random.fork_rng(devices=[]):
            zargs, zkwargs = tree_map(zeros, (args, kwargs))
            out = func(*zargs, **zkwargs)
    except Exception:
        return None
    # requires_grad as autograd would set it: any floating-point input that requires grad
    needs_grad = any(isinstance(x, TensorProxy) and x.requires_grad for x in torch.utils._pytree.tree_leaves(
        (args, kwargs)))
    return tree_map(lambda t: t.requires_grad_(needs_grad) if isinstance(t, torch.Tensor) and needs_grad and (
        t.dtype.is_floating_point or t.dtype.is_complex) else t, out)


def opaque_symbol(func: Callable) -> Symbol:
    """The (cached) opaque symbol for a torch callable. One that draws random numbers is also tagged ``RANDOM_OP``:
    never merged with an identical call, recomputed or fused, and its backward replays the generator."""
    sym = _opaque.get(func)
    if sym is None:
        full = torch_id(func)
        module, _, name = full.rpartition(".")
        tags = (OpTags.FALLBACK, OpTags.RANDOM_OP) if callable_draws(func) else (OpTags.FALLBACK,)
        sym = Symbol(name=name, meta=_fake_meta(func, full, views=True), id=f"fallback:{full}", is_prim=True,
                     tags=tags, module=module or None, torch_fns=(func,), torch_impl=func)
        _opaque[func] = sym
    return sym


_functions: dict[tuple, Symbol] = {}


def autograd_function_symbol(cls: type, autocast: tuple = ()) -> Symbol:
    """The opaque symbol for ``cls.apply``, a user ``torch.autograd.Function`` called on proxies.

    The trace shows ``t1 = Clip.apply(t0)``; the torch executor calls ``Clip.apply`` and autodiff differentiates
    it with PyTorch's autograd, so the Function's own ``backward`` gives the gradient (PyTorch would otherwise run
    ``forward`` on the proxies, inlining it and losing the custom backward). ``autocast`` holds the
    ``(device type, dtype)`` autocast states the call was made under: eager runs ``forward`` under them, and
    generated code runs without autocast, so the call enters them itself.
    """
    key = (cls, autocast)
    sym = _functions.get(key)
    if sym is None:
        if cls.__module__ == "torch._functorch.autograd_function":  # Dynamo's autograd_function_apply
            name = "autograd_function_apply"
        else:
            name = f"{cls.__name__}.apply"

        def apply(*args, **kwargs):
            with contextlib.ExitStack() as stack:
                for device_type, dtype in autocast:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype))
                return cls.apply(*args, **kwargs)

        apply.__name__ = apply.__qualname__ = name.replace(".", "_")
        # the backward recomputes the forward (grad_rules.autograd_vjp): a Function that draws random numbers
        # must draw the same ones again, and nothing tells which Functions do
        apply.draws_random = True
        apply.recomputes_user_code = True  # ... on copies of its tensors: the forward may write to them
        sym = Symbol(name=name, meta=_function_meta(apply, name), id=f"fallback:{cls.__module__}.{cls.__qualname__}",
                     is_prim=True, tags=(OpTags.FALLBACK,), torch_fns=(apply,), torch_impl=apply)
        _functions[key] = sym
    return sym


def _function_meta(apply: Callable, name: str) -> Callable:
    fake = _fake_meta(apply, name)

    def meta(*args, **kwargs):
        # a traced value the forward reads without receiving it (a module's parameter, a closure) reaches the
        # torch language, which records into this prim's scope; autograd could not give it a gradient
        scope = get_tracectx().scopes[-1]
        try:
            out = fake(*args, **kwargs)
        except Exception as e:
            if scope:
                raise _reads_traced_values(name) from e
            raise
        if scope:
            raise _reads_traced_values(name)
        return out

    return meta


def _reads_traced_values(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"{name}: the Function's forward uses tensors of the traced program that are not arguments of apply() "
        f"(a module's parameters, or tensors it closes over), so its backward could not give them gradients "
        f"under fulmen.\n  at {_user_location()}\nPass those tensors to apply() as arguments.")


def _is_inplace_method(func: Callable) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.endswith("__") and getattr(torch.Tensor, name, None) is func


def _is_inplace_function(func: Callable) -> bool:
    """A torch function written in Python and named as an in-place one (``torch.nn.init.constant_``): by torch's
    convention it writes its first argument and returns it."""
    name = getattr(func, "__name__", "")
    return (
        inspect.isfunction(func)
        and name.endswith("_")
        and not name.endswith("__")
        and (func.__module__ or "").startswith("torch.")
    )


def writes_arguments(func: Callable) -> bool:
    """Whether ``func`` (a torch callable without a torch-language rule) updates tensors it is given."""
    from fulmen.torch import argument_writes

    return _is_inplace_method(func) or _is_inplace_function(func) or bool(argument_writes.written_arguments(func))


def _written_first(func: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args, kwargs`` with the tensor an in-place call writes first in ``args``: torch hands Python functions
    their arguments as it was given them (``init.constant_(tensor=w, val=0.5)``)."""
    if args or not kwargs:
        return args, kwargs
    first = next(iter(inspect.signature(func).parameters))
    kwargs = dict(kwargs)
    return (kwargs.pop(first),), kwargs


def record(func: Callable) -> Callable:
    """What ``TensorProxy.__torch_function__`` calls for a torch callable without a rule."""
    from fulmen.torch import argument_writes, collectives, custom_ops

    if collectives.is_wait_wrapper(func):
        langctx.torch_functions[func] = collectives.wait_tensor
        return collectives.wait_tensor
    if custom_ops.is_custom_op(func):  # torch.library custom ops: named symbols with their own autograd
        return custom_ops.record(func)
    if collectives.is_c10d(func):  # communicates and writes its tensors in place
        return collectives.record_c10d(func)
    if _is_inplace_method(func) or _is_inplace_function(func):
        out_of_place = _out_of_place(func)

        def inplace(*args, **kwargs):
            from fulmen.torch.inplace import mutate

            (self, *args), kwargs = _written_first(func, args, kwargs)
            result = opaque_symbol(out_of_place)(self, *args, **kwargs)
            return mutate(self, result)

        return inplace
    if argument_writes.written_arguments(func):  # torch._foreach_lerp_(ema, ...): a functional form, then writes
        return argument_writes.recorder(func)
    return opaque_symbol(func)


_out_of_place_cache: dict = {}


def _laid_out_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides, gaps included (``clone`` makes a gapped tensor contiguous): an in-place
    kernel may pick its algorithm by the layout it writes (CPU ``normal_`` draws another sequence into a
    non-contiguous tensor), so the copy it runs on is laid out as eager's tensor. Overlapping tensors are cloned."""
    if isinstance(t, TensorProxy) or not isinstance(t, torch.Tensor) or is_non_overlapping_and_dense_or_false(t):
        return t.clone()
    try:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
    except RuntimeError:  # overlapping memory: no copy can keep the layout
        return t.clone()


def _out_of_place(func: Callable) -> Callable:
    fn = _out_of_place_cache.get(func)
    if fn is None:
        def fn(self, *args, **kwargs):
            return func(_laid_out_copy(self), *args, **kwargs)

        fn.__name__ = func.__name__.rstrip("_") + "_out_of_place"
        fn.draws_random = callable_draws(func)  # torch.nn.init.uniform_ draws: so does its copy (core.draws)
        fn.__qualname__ = fn.__name__
        fn.__module__ = "fulmen.torch.fallback"
        _out_of_place_cache[func] = fn
    return fn


def fallback_ops(trace) -> list[str]:
    """Names of the opaque (fallback) ops in a trace."""
    names = []
    for bsym in trace.bound_symbols:
        if OpTags.FALLBACK in bsym.sym.tags:
            names.append(bsym.sym.qualified_name)
    return names


langctx.fallback.append(record)
