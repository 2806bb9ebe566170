"""How eager lays out the results of ops that are neither views nor pointwise iterations, where that is not what
PyTorch's meta device says.

Two sources, in order:

- ``KERNEL_RULES``: ops whose kernels allocate their result by a rule of their own that torch's fake (meta)
  kernels do not follow. ATen's CPU kernels of ``logsigmoid`` and ``rrelu`` write a contiguous result whatever the
  input's layout, and its CPU batch norm one in the input's suggested memory format (channels_last stays, a
  transposed input gives a contiguous result), as are its CPU pads but circular ones, where the fake kernels keep the
  input's strides or make a contiguous result. Each rule names the device types it holds for, and depends only on
  the op, its arguments and its inputs' sizes and strides, never on the machine (which instruction set or library a
  CPU kernel happens to use).
- the op run on fake tensors on the inputs' own device, rather than on the meta device: fake kernels are written
  per device (a CPU convolution of a channels_last input or weight is channels_last, as is CPU group norm of a
  channels_last input), while the meta device takes none of those branches.

A CPU convolution of a channels_last input or weight is the exception: its layout follows the backend ATen picks
for the call (oneDNN, or its own kernels), which reads ``torch.backends.mkldnn.enabled``, the thread count and the
sizes, and which the fake kernel does not always pick alike. It runs once on zeros of the call's sizes, and the
trace notes the flags (``flag_names_read``) for its guard to check.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch._prims_common import compute_elementwise_output_strides, suggest_memory_format

from fulmen.core.devices import to_torch_device
from fulmen.core.proxies import TensorProxy
from fulmen.core.trace import get_tracectx
from fulmen.core.utils import contiguous_strides

#: the kernel allocates a contiguous result
CONTIGUOUS = "contiguous"
#: the kernel allocates ``empty_like(input, memory_format=input.suggest_memory_format())``: a channels_last (3d)
#: input gives a channels_last (3d) result, any other layout a contiguous one
SUGGESTED = "suggested"

#: the kernel is a pointwise iteration over its tensor arguments (TensorIterator), though its fake kernel is not
POINTWISE = "pointwise"


def _pad_rule(input, pad=None, mode: str = "constant", value=None) -> str:
    # ATen's CPU constant, reflection and replication pads allocate in the input's suggested format; circular
    # padding is a contiguous result assembled from slices
    return CONTIGUOUS if mode == "circular" else SUGGESTED


#: torch callable (or torch-language symbol id) -> {device type: rule, or a function of the op's arguments giving
#: it}, for results of its first argument's rank
KERNEL_RULES: dict[Callable | str, dict[str, str | Callable]] = {
    F.pad: {"cpu": _pad_rule},
    F.logsigmoid: {"cpu": CONTIGUOUS},
    F.rrelu: {"cpu": CONTIGUOUS},
    torch.rrelu: {"cpu": CONTIGUOUS},
    torch.masked_fill: {"cpu": CONTIGUOUS, "cuda": CONTIGUOUS},  # a contiguous clone of the input, then filled
    torch.Tensor.masked_fill: {"cpu": CONTIGUOUS, "cuda": CONTIGUOUS},
    F.batch_norm: {"cpu": SUGGESTED},
    torch.batch_norm: {"cpu": SUGGESTED},
    torch.native_batch_norm: {"cpu": SUGGESTED},
    torch._native_batch_norm_legit: {"cpu": SUGGESTED},
    "ltorch.batch_norm_with_update": {"cpu": SUGGESTED},
    torch.ops.aten._batch_norm_with_update: {"cpu": SUGGESTED},
    torch.ops.aten._batch_norm_with_update.default: {"cpu": SUGGESTED},
    F.max_unpool2d: {"cpu": SUGGESTED},
    F.channel_shuffle: {"cpu": SUGGESTED},
    torch.channel_shuffle: {"cpu": SUGGESTED},
    torch.native_channel_shuffle: {"cpu": SUGGESTED},
    torch.ops.aten.native_dropout_backward: {"cpu": POINTWISE, "cuda": POINTWISE},
    torch.ops.aten.native_dropout_backward.default: {"cpu": POINTWISE, "cuda": POINTWISE},
}


def rule_strides(fns: tuple, args: tuple, kwargs: dict, out_shapes: list[tuple], strides_of: Callable) -> list | None:
    """The strides ``KERNEL_RULES`` give each result of the op ``fns`` name (torch callables or a symbol id; None
    for a result of another rank than its first argument), or None when no rule holds for this op on this
    device."""
    first = args[0] if args else None
    if not isinstance(first, TensorProxy):
        return None
    device = to_torch_device(first.device).type
    rule = next((KERNEL_RULES[fn][device] for fn in fns if device in KERNEL_RULES.get(fn, ())), None)
    if callable(rule):
        rule = rule(*args, **kwargs)
    if rule is None:
        return None
    return [_laid_out(rule, args, s, strides_of) if len(s) == first.ndim else None for s in out_shapes]


def _laid_out(rule: str, args: tuple, shape: tuple[int, ...], strides_of: Callable) -> tuple[int, ...] | None:
    if rule == CONTIGUOUS:
        return contiguous_strides(shape)
    with torch._C.DisableTorchFunction():
        if rule == SUGGESTED:
            fmt = suggest_memory_format(torch.empty_strided(tuple(args[0].shape), strides_of(args[0]), device="meta"))
            return torch.empty(shape, device="meta", memory_format=fmt).stride()
        try:
            metas = [
                torch.empty_strided(tuple(a.shape), strides_of(a), device="meta").broadcast_to(shape)
                for a in args
                if isinstance(a, TensorProxy) and a.ndim
            ]
        except RuntimeError:  # an operand that does not broadcast to this result: no layout said for it
            return None
        return tuple(compute_elementwise_output_strides(*metas)) if metas else contiguous_strides(shape)


def _to_fake(x, strides_of: Callable, lazy_bits: Callable):
    if isinstance(x, TensorProxy):
        t = torch.empty_strided(tuple(x.shape), strides_of(x), dtype=x.dtype, device=to_torch_device(x.device))
        return lazy_bits(t, x)
    if type(x) in (tuple, list):
        return type(x)(_to_fake(v, strides_of, lazy_bits) for v in x)
    return x


#: convolutions: their fake kernel lays the result out as the backend PyTorch picks for the call would
#: (``torch._C._select_conv_backend``), which for a channels_last input or weight depends on process state:
#: ATen's CPU choice of oneDNN reads ``torch.backends.mkldnn.enabled`` and, for 1x1 filters, the thread count
_BACKEND_CHOSEN = frozenset((F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
                             F.conv_transpose3d, torch.conv1d, torch.conv2d, torch.conv3d, torch.convolution))
#: the names of the flag readers (``frontend/ambient_flags.py``) such a layout depends on
BACKEND_FLAG_NAMES = frozenset(("get_num_threads", "mkldnn", "enabled"))
_flag_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # trace -> the flag names its layouts read


def flag_names_read(trace) -> frozenset[str]:
    """The names of the process-wide flags the layouts believed in ``trace`` depend on: its guard checks them."""
    return frozenset(_flag_names.get(trace, ()))


def _backend_chosen(fn: Callable, args: tuple, strides_of: Callable) -> bool:
    """Whether ``fn`` is a CPU convolution of a channels_last (or otherwise laid out) input or weight, whose result
    is laid out as the backend PyTorch picks (oneDNN or not): noted on the trace, whose guard then checks the flags
    that choice reads."""
    if fn not in _BACKEND_CHOSEN or not all(isinstance(a, TensorProxy) for a in args[:2]):
        return False
    if to_torch_device(args[0].device).type != "cpu":
        return False
    if all(tuple(strides_of(a)) == contiguous_strides(a.shape) for a in args[:2]):
        return False
    trace = get_tracectx()
    if trace is not None:
        _flag_names.setdefault(trace, set()).update(BACKEND_FLAG_NAMES)
    return all(isinstance(n, int) for a in args[:2] for n in a.shape)


def _on_zeros(fn: Callable, args: tuple, kwargs: dict, strides_of: Callable):
    """``fn`` run on real zero tensors laid out as ``strides_of`` says: the fake kernel of a CPU convolution does not
    always pick the backend the real one picks (a 1x1 filter with one thread), and the layout follows that choice.
    Done once per compilation, on the call's sizes."""

    def zeros(x):
        if isinstance(x, TensorProxy):
            t = torch.empty_strided(tuple(x.shape), strides_of(x), dtype=x.dtype, device="cpu").zero_()
            return t.requires_grad_(x.requires_grad)  # as the call's: the backend's choice may read it
        return x

    with torch._C.DisableTorchFunction(), torch.inference_mode(False):
        return fn(*[zeros(a) for a in args], **{k: zeros(v) for k, v in kwargs.items()})


def on_fake(fn: Callable, args: tuple, kwargs: dict, strides_of: Callable, lazy_bits: Callable):
    """``fn`` run on fake tensors on the proxies' own devices, laid out as ``strides_of`` says."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if _backend_chosen(fn, args, strides_of):
        return _on_zeros(fn, args, kwargs, strides_of)
    with (
        torch._C.DisableTorchFunction(),
        torch.inference_mode(False),
        FakeTensorMode(allow_non_fake_inputs=True),
        torch.autocast("cpu", enabled=False),
        torch.autocast("cuda", enabled=False),
    ):
        fargs = [_to_fake(a, strides_of, lazy_bits) for a in args]
        return fn(*fargs, **{k: _to_fake(v, strides_of, lazy_bits) for k, v in kwargs.items()})
