"""Seed 000, ported: a custom forward and backward for ``torch.nn.functional.cross_entropy``.

The seed wraps Apex's ``xentropy_cuda`` extension; here the two kernels are plain PyTorch functions with
the same contract (the forward returns the per-row losses and log-sum-exp, the backward returns
``(softmax - one_hot) * grad``), so the example runs on any machine. Sizes are smaller than the seed's
(256 x 1000 instead of 2048 x 50257) to keep it quick on a CPU; it uses CUDA when present.

Run it as a script (``python examples/custom_forward_backward.py``). It asserts what the seed shows: the
joint trace calls ``xentropy_forward`` and ``xentropy_backward``, the compiled program runs them as
``xentropy_forward_impl`` / ``xentropy_backward_impl``, and the gradient agrees with PyTorch's autograd
to better than 1e-6.
"""

import warnings

import torch

import fulmen
from fulmen.core.proxies import TensorProxy
from fulmen.core.symbol import Symbol

device = "cuda" if torch.cuda.is_available() else "cpu"
calls = {"forward meta": 0, "backward meta": 0, "forward impl": 0, "backward impl": 0}


# ---- symbols for the two kernels, with meta functions ----
def xentropy_forward_meta(
    a,
    target,
    weight=None,
    size_average=None,
    ignore_index=-100,
    reduce=None,
    reduction="mean",
    label_smoothing=0.0,
):
    calls["forward meta"] += 1
    # As in the seed, both outputs are declared `like=target` (int64), while the kernel returns float losses and
    # log-sum-exp. fulmen checks an implementation's first outputs against its meta: it warns, and compiles again
    # with what the kernel returned (`dtype=a.dtype` here would compile once).
    max_log_sum_exp = TensorProxy(like=target)
    if reduction == "none":
        return TensorProxy(like=target), max_log_sum_exp
    else:
        raise ValueError(f"Invalid reduction: {reduction}")


xentropy_forward = Symbol(
    id="xentropy_forward",
    name="xentropy_forward",
    meta=xentropy_forward_meta,
    is_prim=True,
)


def xentropy_backward_meta(
    grad,
    logits,
    labels,
    max_log_sum_exp,
    smoothing,
):
    calls["backward meta"] += 1
    return TensorProxy(like=logits)


xentropy_backward = Symbol(
    id="xentropy_backward",
    name="xentropy_backward",
    meta=xentropy_backward_meta,
    is_prim=True,
)

# ---- the augmented forward and the backward of cross_entropy ----
from fulmen.core.transforms import register_augmented_forward, register_backward  # noqa: E402


@register_augmented_forward("torch.nn.functional.cross_entropy")
def xentropy_forward_rule(
    a,
    target,
    weight=None,
    size_average=None,
    ignore_index=-100,
    reduce=None,
    reduction="mean",
    label_smoothing=0.0,
):
    loss, max_log_sum_exp = xentropy_forward(
        a,
        target,
        weight,
        size_average,
        ignore_index,
        reduce,
        reduction,
        label_smoothing,
    )
    primal = loss
    saved_for_backward = (a, target, max_log_sum_exp, reduction, label_smoothing)
    return primal, saved_for_backward


@register_backward("torch.nn.functional.cross_entropy")
def xentropy_backward_rule(
    logits,
    labels,
    max_log_sum_exp,
    reduction,
    smoothing,
    grad,
):
    if reduction != "none":
        raise ValueError(f"Invalid reduction: {reduction}")

    grad_logits = xentropy_backward(
        grad,
        logits,
        labels,
        max_log_sum_exp,
        smoothing,
    )
    return grad_logits, *([None] * 7)


# ---- the function: value and gradient of the per-row loss ----
from fulmen import torch as ltorch  # noqa: E402
from fulmen.core.transforms import inline, value_and_grad  # noqa: E402

torch.manual_seed(0)

logits = torch.randn([256, 1000], device=device)
labels = torch.randint(0, 1000, [256], device=device)
labels[::17] = -1  # ignored rows: zero loss and zero gradient, as in PyTorch


@inline
@value_and_grad
def fun(logits, labels):
    return ltorch.cross_entropy(logits, labels, reduction="none", ignore_index=-1)


trace = fulmen.trace()(fun, logits, labels)
print(trace)
text = str(trace)
assert "= xentropy_forward(logits, labels, None, None, -1, None, 'none', 0.0)" in text
assert "= xentropy_backward(" in text
assert calls["forward meta"] >= 1 and calls["backward meta"] >= 1


# ---- the kernels: plain PyTorch in place of xentropy_cuda ----
def xentropy_forward_impl(
    a,
    target,
    weight=None,
    size_average=None,
    ignore_index=-100,
    reduce=None,
    reduction="mean",
    label_smoothing=0.0,
):
    calls["forward impl"] += 1
    if reduction != "none" or label_smoothing != 0.0 or weight is not None:
        raise ValueError("this kernel supports reduction='none' without weights or label smoothing")
    max_log_sum_exp = torch.logsumexp(a, dim=-1)
    valid = target != ignore_index
    picked = a.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    losses = torch.where(valid, max_log_sum_exp - picked, 0.0).to(a.dtype)
    return losses, max_log_sum_exp


def xentropy_backward_impl(
    grad,
    logits,
    labels,
    max_log_sum_exp,
    smoothing,
):
    calls["backward impl"] += 1
    # Rows whose label is not a class index (the ignore_index) get no gradient.
    valid = (labels >= 0) & (labels < logits.shape[-1])
    grad = torch.where(valid, grad, 0.0).contiguous()
    softmax = torch.exp(logits - max_log_sum_exp.unsqueeze(-1))
    one_hot = torch.zeros_like(logits).scatter_(-1, torch.where(valid, labels, 0).unsqueeze(-1), 1.0)
    return (softmax - one_hot) * grad.unsqueeze(-1)


def always_executable(*args, **kwargs):
    return True


op_to_xentropy = {
    "xentropy_forward": ("xentropy_forward_impl", always_executable, xentropy_forward_impl),
    "xentropy_backward": ("xentropy_backward_impl", always_executable, xentropy_backward_impl),
}

from fulmen.executors import add_operator_executor  # noqa: E402

add_operator_executor("xentropy", op_to_xentropy)

# ---- compile and run ----
cfun = fulmen.compile(fun, disable_preprocessing=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out, (grad_logits, grad_labels) = cfun(logits, labels)
# the first program's check stopped it at the forward kernel: the call ran again on the program compiled again
assert calls["forward impl"] == 2 and calls["backward impl"] == 1, calls
messages = [str(w.message) for w in caught]
assert any("xentropy_forward" in m and "f32[256]" in m and "i64[256]" in m for m in messages), messages
assert out.dtype == logits.dtype and fulmen.cache_misses(cfun) == 2
assert grad_labels is None  # integer labels have no gradient

execution = fulmen.last_traces(cfun)[-1]
print(execution)
text = str(execution)
assert "= xentropy_forward_impl(logits, labels, None, None, -1, None, 'none', 0.0)" in text
assert "= xentropy_backward_impl(" in text

# a second call reuses the compiled program
out2, (grad_logits2, _) = cfun(logits, labels)
assert calls["forward impl"] == 3 and fulmen.cache_hits(cfun) == 1
torch.testing.assert_close(grad_logits2, grad_logits)

# ---- compare with PyTorch's autograd ----
logits.requires_grad_(True)

loss = torch.nn.functional.cross_entropy(logits, labels, reduction="none", ignore_index=-1)
logits.grad = None
loss.sum().backward()

error = (grad_logits - logits.grad).abs().max()
print("Max error in logits grad:", error)
assert error < 1e-6, error
torch.testing.assert_close(out, loss.detach())
assert bool((out[::17] == 0).all()) and bool((grad_logits[::17] == 0).all())

print("seed 000: OK")
