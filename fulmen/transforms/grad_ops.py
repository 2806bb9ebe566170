"""The operations fulmen's gradient rules (``grad_rules.py``) call, declared as prims are.

``aten_op`` declares ``torch.ops.aten.<name>`` as a symbol: an id (``aten.<name>``), a meta function, tags and the
torch implementation (the aten op itself). The torch executor claims them through its normal path and prints
them as the callable they run (``torch.ops.aten.gelu_backward(...)``); a fusion executor takes them by their
tags, as it takes prims. ``executable_symbol`` is for runtime helpers bound to the torch executor at declaration
(never claimed or fused): ``autograd_vjp(fn)``, the backward of opaque ops, recomputes ``fn`` under autograd and
calls ``torch.autograd.grad``; ``rng_state`` snapshots a generator for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fulmen.core.devices import to_device
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import OpTags, Symbol

_aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def declare_op(name: str, impl: Callable, meta: Callable, *, module: str | None = None, tags=()) -> Symbol:
    """An operation the rules call, declared as a prim is (``prims.make_prim``): id, meta, tags and its torch
    implementation, which the torch executor runs. Traces print it as ``module.name(...)``."""
    sym = Symbol(
        name=name,
        meta=meta,
        id=f"{module or 'autodiff'}.{name}".removeprefix("torch.ops."),
        is_prim=True,
        module=module,
        tags=tuple(tags),
        torch_impl=impl,
    )
    return sym


def aten_op(name: str, meta: Callable, *, tags=()) -> Symbol:
    """``torch.ops.aten.<name>`` as a symbol (id ``aten.<name>``)."""
    return declare_op(name, getattr(_aten, name), meta, module="torch.ops.aten", tags=tags)


def executable_symbol(name: str, impl: Callable, meta: Callable, *, tags=()) -> Symbol:
    """A runtime helper that the torch executor runs as it is: bound to it at declaration, so no executor claims
    or fuses it (its implementation is Python that only runs eagerly)."""
    from fulmen.executors.torchex import ex as torch_ex

    return Symbol(
        name=name,
        meta=meta,
        id=f"autodiff:{name}",
        is_prim=True,
        module=None,
        impl=impl,
        executor=torch_ex,
        tags=tuple(tags),
    )


def _like(x: TensorProxy, **changes) -> TensorProxy:
    return TensorProxy(like=x, requires_grad=False, **changes)


def _stats_dtype(x: TensorProxy, *, always_opmath: bool = False) -> torch.dtype:
    """The dtype aten normalization kernels give their statistics (float32 for half types, on CUDA always)."""
    if x.dtype in _HALF and (always_opmath or x.device.type != "cpu"):
        return torch.float32
    return x.dtype


def _stats_shape(x: TensorProxy, normalized_shape) -> tuple[int, ...]:
    k = x.ndim - len(normalized_shape)
    return tuple(x.shape[:k]) + (1,) * len(normalized_shape)


def _masked(mask, *likes):
    return tuple(_like(t) if m and t is not None else None for m, t in zip(mask, likes))


# ---- normalization ----
_RED, _EW, _MM = (OpTags.REDUCTION,), (OpTags.ELEMENTWISE,), (OpTags.MATMUL_OP,)


def _native_layer_norm_meta(a, shape, w, b, eps):
    stats = _like(a, shape=_stats_shape(a, shape), dtype=_stats_dtype(a))
    return _like(a), stats, _like(stats)


def _native_layer_norm_backward_meta(g, a, shape, mean, rstd, w, b, mask):
    return _masked(mask, a, w, b)


def _fused_rms_norm_meta(a, shape, w, eps):
    return _like(a), _like(a, shape=_stats_shape(a, shape), dtype=_stats_dtype(a, always_opmath=True))


native_layer_norm = aten_op("native_layer_norm", _native_layer_norm_meta, tags=_RED)
native_layer_norm_backward = aten_op("native_layer_norm_backward", _native_layer_norm_backward_meta, tags=_RED)
fused_rms_norm = aten_op("_fused_rms_norm", _fused_rms_norm_meta, tags=_RED)

# ---- softmax, losses ----


def _softmax_meta(a, dim, half_to_float):
    return _like(a, dtype=torch.float32 if half_to_float else a.dtype)


def _softmax_backward_meta(g, out, dim, dtype):
    return _like(g, dtype=dtype)


_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


def _nll_loss_forward_meta(a, target, w, reduction, ignore_index):
    return _like(a, shape=(a.shape[0],) if reduction == 0 and a.ndim == 2 else ()), _like(a, shape=())


def _nll_loss_backward_meta(g, a, target, w, reduction, ignore_index, total):
    return _like(a)


softmax = aten_op("_softmax", _softmax_meta, tags=_RED)
softmax_backward = aten_op("_softmax_backward_data", _softmax_backward_meta, tags=_RED)
log_softmax = aten_op("_log_softmax", _softmax_meta, tags=_RED)
log_softmax_backward = aten_op("_log_softmax_backward_data", _softmax_backward_meta, tags=_RED)
nll_loss_forward = aten_op("nll_loss_forward", _nll_loss_forward_meta, tags=_RED)
nll_loss_backward = aten_op("nll_loss_backward", _nll_loss_backward_meta)

# ---- pointwise activations (elementwise: the backward may recompute them instead of saving) ----
# Their backward kernels carry no tag: tagged elementwise they would become recomputable too, which would change
# what a second-order backward saves.


def _pointwise_meta(a, *args, **kwargs):
    return _like(a)


def _pointwise_backward_meta(g, *args, **kwargs):
    return _like(g)


def _polygamma_meta(n, a):
    return _like(a)


def _elu_backward_meta(g, alpha, scale, input_scale, is_result, a):
    return _like(a)


gelu = aten_op("gelu", _pointwise_meta, tags=_EW)
gelu_backward = aten_op("gelu_backward", _pointwise_backward_meta)
silu = aten_op("silu", _pointwise_meta, tags=_EW)
silu_backward = aten_op("silu_backward", _pointwise_backward_meta)
polygamma = aten_op("polygamma", _polygamma_meta, tags=_EW)
relu = aten_op("relu", _pointwise_meta, tags=_EW)
threshold_backward = aten_op("threshold_backward", _pointwise_backward_meta)
elu = aten_op("elu", _pointwise_meta, tags=_EW)
elu_backward = aten_op("elu_backward", _elu_backward_meta)

# ---- embedding, attention, convolution, unfold ----


def _embedding_meta(w, idx, padding_idx=-1, scale=False, sparse=False):
    return _like(w, shape=tuple(idx.shape) + (w.shape[-1],))


def _embedding_dense_backward_meta(g, idx, n, padding_idx, scale):
    return _like(g, shape=(n, g.shape[-1]))


embedding = aten_op("embedding", _embedding_meta)
embedding_dense_backward = aten_op("embedding_dense_backward", _embedding_dense_backward_meta)

def _embedding_sparse_backward_meta(g, idx, n, padding_idx, scale):
    return _like(g, shape=(n, g.shape[-1]))


def _add_gradients_meta(a, b):
    return _like(a)


#: eager's weight gradient of ``F.embedding(..., sparse=True)``, a sparse COO tensor: uncoalesced, one row per index
#: other than padding_idx (``transforms/sparse_gradients.py`` keeps it off fused regions)
embedding_sparse_backward = executable_symbol(
    "embedding_sparse_backward", _aten.embedding_sparse_backward, _embedding_sparse_backward_meta
)
#: the sum of two gradients of which one at least is sparse, as eager's autograd adds them (dense if either is)
add_sparse_gradients = executable_symbol(
    "add_sparse_gradients",
    lambda a, b: b + a if a.is_sparse and not b.is_sparse else a + b,  # PyTorch adds a sparse tensor to a dense one
    _add_gradients_meta,
)


def _flash_meta(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    lse_dtype = torch.float64 if q.dtype is torch.float64 else torch.float32
    return _like(q, shape=tuple(q.shape[:-1]) + (v.shape[-1],)), _like(q, shape=tuple(q.shape[:-1]), dtype=lse_dtype)


def _attention_backward_meta(g, q, k, v, *args, **kwargs):
    return _like(q), _like(k), _like(v)


flash_attention_cpu = aten_op("_scaled_dot_product_flash_attention_for_cpu", _flash_meta, tags=_MM)
flash_attention_cpu_backward = aten_op(
    "_scaled_dot_product_flash_attention_for_cpu_backward", _attention_backward_meta, tags=_MM
)


def efficient_attention_forward(q, k, v, attn_mask, is_causal, scale):
    """CUDA memory-efficient attention without dropout: the output and the per-row log-sum-exp."""
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
        _last_dim_dense(q), _last_dim_dense(k), _last_dim_dense(v), attn_mask, True, 0.0, is_causal, scale=scale
    )
    return out, lse


def efficient_attention_backward(g, q, k, v, out, lse, attn_mask, is_causal, scale):
    philox = torch.zeros((), dtype=torch.int64, device=q.device)  # read only with dropout, which is never used here
    gq, gk, gv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        _last_dim_dense(g),
        _last_dim_dense(q),
        _last_dim_dense(k),
        _last_dim_dense(v),
        attn_mask,
        out,
        lse,
        philox,
        philox,
        0.0,
        [True, True, True, False],
        is_causal,
        scale=scale,
    )
    return gq, gk, gv


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    """The kernels need unit stride in the head dimension, as eager's dispatcher requires before picking them."""
    return t if t.stride(-1) == 1 else t.contiguous()


def efficient_attention_meta(q, k, v, attn_mask, is_causal, scale):
    # the log-sum-exp rows are padded to a multiple of 32, as the kernel writes them
    lse_shape = tuple(q.shape[:-2]) + (-(-q.shape[-2] // 32) * 32,)
    return _like(q, shape=tuple(q.shape[:-1]) + (v.shape[-1],)), _like(q, shape=lse_shape, dtype=torch.float32)


#: The head sizes the CUDA memory-efficient kernels take on every GPU: a multiple of 8 elements (16-byte
#: aligned rows in half precision), at most 128.
_CUDA_HEAD_DIMS = range(8, 129, 8)


def efficient_attention_supported(q, k, v, mask, scale) -> bool:
    """Whether CUDA proxies ``q, k, v`` are inputs ``efficient_attention_cuda`` takes: eager's memory-efficient kernel
    without a mask (masks need padding to 16 columns and expanding to 4-D, as eager's dispatcher does before it
    calls the kernel; they take the decomposition), with as many key/value heads as query heads. The gradient rule
    and the ``sdpa`` executor both decide by it."""
    if mask is not None or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if q.dtype is torch.bfloat16 and torch.cuda.get_device_capability(to_device(q.device).index or 0)[0] < 8:
        return False  # bfloat16 kernels need Ampere or newer
    if q.shape[-1] not in _CUDA_HEAD_DIMS or v.shape[-1] not in _CUDA_HEAD_DIMS or k.shape[-1] != q.shape[-1]:
        return False
    if q.shape[0] != k.shape[0] or k.shape[0] != v.shape[0] or k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        return False
    if k.shape[2] != v.shape[2]:
        return False
    # a scale of zero or below was never run through the kernels here: the decomposition takes it
    return q.numel() > 0 and k.numel() > 0 and not (isinstance(scale, (int, float)) and scale <= 0)


#: CUDA memory-efficient attention (eager's choice for float32; usable for every float dtype): output and the
#: per-row log-sum-exp, which with the inputs and output is all the backward needs. Python functions around the
#: aten kernels, which Inductor traces into a fused region as it does aten ops.
efficient_attention_cuda = declare_op(
    "efficient_attention", efficient_attention_forward, efficient_attention_meta, tags=_MM
)
efficient_attention_cuda_backward = declare_op(
    "efficient_attention_backward", efficient_attention_backward, _attention_backward_meta, tags=_MM
)


def _convolution_backward_meta(
    g, a, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask
):
    return (
        _like(a) if mask[0] else None,
        _like(w) if mask[1] else None,
        _like(g, shape=tuple(bias_sizes)) if mask[2] and bias_sizes is not None else None,
    )


def _unfold_backward_meta(g, sizes, dim, size, step):
    return _like(g, shape=tuple(sizes))


convolution_backward = aten_op("convolution_backward", _convolution_backward_meta, tags=_MM)
unfold_backward = aten_op("unfold_backward", _unfold_backward_meta)


# ---------------------------------------------------------------------------------------------------------
# PyTorch's autograd as a backward: opaque ops, and prims whose exact VJP is intricate


def _rng_state_meta(device: str) -> TensorProxy:
    n = torch.cuda.get_rng_state(to_device(device).index) if device.startswith("cuda") else torch.get_rng_state()
    return TensorProxy(shape=(n.numel(),), dtype=torch.uint8, device="cpu")


def _rng_state_impl(device: str) -> torch.Tensor:
    if device.startswith("cuda"):
        return torch.cuda.get_rng_state(torch.device(device).index)
    return torch.get_rng_state()


rng_state = executable_symbol("rng_state", _rng_state_impl, _rng_state_meta, tags=(OpTags.RANDOM_OP,))

#: eager's error when a backward goes through a write to a view whose elements share memory
OVERLAPPING_WRITE_MESSAGE = ("unsupported operation: more than one element of the written-to tensor refers to a "
                             "single memory location. Please clone() the tensor before performing the operation.")


def _overlapping_write_error_impl(g: torch.Tensor, where: str) -> torch.Tensor:
    raise RuntimeError(f"{OVERLAPPING_WRITE_MESSAGE}\n  (the backward of an in-place write through an expanded view, "
                       f"at {where}; clone() the view before writing to it)")


#: the backward of ``ltorch.overlapping_write``: raises when run, as eager's backward does there
overlapping_write_error = executable_symbol("overlapping_write_error", _overlapping_write_error_impl,
                                            lambda g, where: _like(g))


@contextlib.contextmanager
def _replaying_rng(state: torch.Tensor | None, device: torch.device | None):
    if state is None:
        yield
        return
    cuda = device is not None and device.type == "cuda"
    with torch.random.fork_rng(devices=[device.index or 0] if cuda else []):
        if cuda:
            torch.cuda.set_rng_state(state, device.index or 0)
        else:
            torch.set_rng_state(state)
        yield


_vjp_symbols: dict = {}


def _autograd_vjp_meta(args, kwargs, cotangents, which, state):
    tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, TensorProxy)]
    return tuple(_like(tensors[i]) for i in which)


def autograd_vjp(fn: Callable) -> Symbol:
    """The backward symbol of ``fn`` computed by PyTorch: ``vjp(args, kwargs, cotangents, which, rng_state)``
    returns the gradients of the ``which``-th tensor arguments (counting tensors only)."""
    sym = _vjp_symbols.get(fn)
    if sym is not None:
        return sym

    # user code (a torch.autograd.Function's forward) may write to its arguments (a running statistic, mark_dirty):
    # run again here, it must write to copies, or the caller's tensors would be updated twice
    on_copies = getattr(fn, "recomputes_user_code", False)

    def impl(args, kwargs, cotangents, which, state):
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        inputs = []
        for j in which:
            t = flat[positions[j]].detach()
            # an integer input (a PackedSequence's batch_sizes) reached from differentiable values gets zeros
            t = t.requires_grad_() if t.is_floating_point() or t.is_complex() else t
            if on_copies:  # a clone of a leaf may be written (mark_dirty); backward runs with grad mode off
                with torch.enable_grad():
                    flat[positions[j]] = t.clone()
            else:
                flat[positions[j]] = t
            inputs.append(t)
        if on_copies:
            differentiated = {positions[j] for j in which}
            for i in positions:
                if i not in differentiated:
                    flat[i] = flat[i].detach().clone()
        args, kwargs = tree_unflatten(flat, spec)
        device = inputs[0].device if inputs else None
        with torch.enable_grad(), _replaying_rng(state, device):
            out = fn(*args, **kwargs)
        outs, cts = [], []
        out_tensors = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        for o, c in zip(out_tensors, cotangents):
            if c is not None and o.requires_grad:
                outs.append(o)
                cts.append(c)
        wrt = [x for x in inputs if x.requires_grad]
        found = iter(torch.autograd.grad(outs, wrt, cts, allow_unused=True) if outs and wrt else (None,) * len(wrt))
        grads = [next(found) if x.requires_grad else None for x in inputs]
        return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs))

    base = getattr(fn, "__name__", None) or "op"
    sym = executable_symbol(f"{base}_autograd_vjp", impl, _autograd_vjp_meta)
    sym.skip_meta_check = True
    _vjp_symbols[fn] = sym
    return sym


def autograd_vjp_function(sym: Symbol) -> Callable | None:
    """The function whose backward ``sym`` is, if ``sym`` is an ``autograd_vjp`` symbol."""
    return next((fn for fn, s in _vjp_symbols.items() if s is sym), None)
