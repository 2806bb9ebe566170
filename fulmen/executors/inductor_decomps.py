"""The decompositions fulmen hands Inductor: PyTorch's own table, with a few operations written for faster kernels.

Each replacement computes the same mathematical function as PyTorch's decomposition, to float32 rounding, and
changes only how Inductor's generated code gets there. Each applies only where it was measured faster
(``GELU_DEVICES``, ``CROSS_ENTROPY_DTYPES``); other devices and dtypes keep PyTorch's decompositions.

- ``gelu(approximate="tanh")`` and its backward: ``0.5 * (1 + tanh(z))`` is ``sigmoid(2 * z)``. The vectorized
  ``tanh`` (the Sleef routine both ATen and Inductor's C++ kernels call) costs several times an ``exp`` plus a
  division. Written with ``exp(-|u|)``, the sigmoid and its derivative
  cannot overflow, and the result is at least as accurate as eager's tanh formula, which cancels in
  ``1 + tanh(z)`` for negative inputs.
- cross-entropy's backward, ``_log_softmax_backward_data(nll_loss_backward(g, ...), logp)``: PyTorch's
  decompositions scatter ``-1`` into a zero tensor the size of the logits, which Inductor materializes (4 MB for
  256 tokens of a 4,096-word vocabulary), and then sum each row of it again. Here the one-hot gradient is a
  comparison of class indices with the target, a pointwise expression, and its row sums -- one nonzero per
  row, so the sums are exactly that value -- are handed to the log-softmax backward, which then needs no
  reduction: the whole backward is one pass over the logits, with the same results. On CPU, half-dtype logits
  keep PyTorch's rule, where the rewrite measured slower.

- ``var`` and ``var_mean`` (with ``correction``) of a one-element input: Inductor lowers them itself, and when it
  picks its Welford reduction (always for a reduction to one element) a reduction over one element becomes the
  constants ``m2 = 0, weight = 1`` without reading the value, so the variance of a lone NaN or infinity comes out
  0 where eager gives NaN (``inf - inf``). Here that variance is ``(x - x)^2`` summed over the one element and
  divided by ``max(0, 1 - correction)``, as eager computes it: 0 for a finite value, NaN for a non-finite one.
  Larger inputs keep Inductor's own lowering (its reductions over more elements read every value).

The tanh-GELU rewrite stays on CPU: on CUDA, Triton's ``tanh`` is cheap and the rewrite measured slower. The
measurements behind both choices are in docs/performance.md ("Inductor decompositions").
"""

from __future__ import annotations

import functools
import weakref

import torch

aten = torch.ops.aten

#: Where each replacement applies: where it was measured faster. Other devices and dtypes keep PyTorch's rule.
GELU_DEVICES = {"cpu"}
CROSS_ENTROPY_DTYPES = {
    "cpu": {torch.float32, torch.float64},
    "cuda": {torch.float32, torch.float64, torch.float16, torch.bfloat16},
}

_SQRT_2_OVER_PI = 0.7978845608028654
_KAPPA = 0.044715


def _opmath(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _gelu_tanh_parts(x: torch.Tensor):
    """For ``u = 2 sqrt(2/pi) (x + 0.044715 x^3)``, so that tanh-GELU is ``x * sigmoid(u)``: ``sigmoid(u)`` and
    ``sigmoid(u) * (1 - sigmoid(u))``, from one ``exp`` that cannot overflow. With ``a = exp(-|u|)``,
    ``sigmoid(|u|) = 1 / (1 + a)``, ``sigmoid(-|u|) = a / (1 + a)``, and their product is ``a / (1 + a)^2``.
    Forward and backward build them the same way, so a kernel that recomputes the forward for the backward
    computes the ``exp`` once."""
    u = x * (2 * _SQRT_2_OVER_PI + (2 * _SQRT_2_OVER_PI * _KAPPA) * (x * x))
    a = torch.exp(-u.abs())
    r = 1 / (1 + a)
    return torch.where(u >= 0, r, a * r), a * r * r


def _gelu(default, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    if approximate != "tanh" or x.device.type not in GELU_DEVICES:
        return default(x, approximate=approximate)
    xf = _opmath(x)
    s, _ = _gelu_tanh_parts(xf)
    return (xf * s).to(x.dtype)


def _gelu_backward(default, grad: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    if approximate != "tanh" or x.device.type not in GELU_DEVICES:
        return default(grad, x, approximate=approximate)
    xf, gf = _opmath(x), _opmath(grad)
    s, ds = _gelu_tanh_parts(xf)
    du = 2 * _SQRT_2_OVER_PI + (6 * _SQRT_2_OVER_PI * _KAPPA) * (xf * xf)  # u'
    # d/dx [x * sigmoid(u)] = sigmoid(u) + x * sigmoid'(u) * u'
    return (gf * (s + xf * ds * du)).to(grad.dtype)


#: id(one-hot gradient built by ``_nll_loss_backward``) -> (a weak reference to it, its row sums, class dim).
#: Filled and read while ``make_fx`` traces one region: a decomposition's result is the object the next
#: operation receives, so ``_log_softmax_backward_data`` recognizes it by identity.
_one_hot_rows: dict[int, tuple[weakref.ref, torch.Tensor, int]] = {}


def _nll_loss_backward(default, grad_output, self, target, weight, reduction, ignore_index, total_weight):
    """PyTorch's decomposition, with the scatter of ``-1`` into zeros written as a comparison with the class
    indices, remembering its row sums (without class weights: ``-grad_output`` of each row)."""
    if (self.dtype not in CROSS_ENTROPY_DTYPES.get(self.device.type, ()) or self.dim() not in (1, 2)
            or target.dim() > 1):
        return default(grad_output, self, target, weight, reduction, ignore_index, total_weight)
    channel_dim = 0 if self.dim() < 2 else 1
    if reduction == 1:  # mean
        grad_output = grad_output / total_weight
    if self.dim() == 1 and target.dim() > 0:
        target = target[0]
    target = target.unsqueeze(channel_dim)
    safe_target = torch.where(target != ignore_index, target, 0)
    classes = torch.arange(self.shape[channel_dim], device=self.device)
    if self.dim() == 2:
        classes = classes.unsqueeze(0)
    one_hot = torch.where(classes == safe_target, -1.0, 0.0).to(self.dtype)
    if one_hot.dim() > grad_output.dim() > 0:
        grad_output = grad_output.unsqueeze(channel_dim)
    if weight is not None:
        shape = [1] * self.dim()
        shape[channel_dim] = weight.shape[0]
        grad_output = grad_output * weight.reshape(shape)
    grad_output = torch.where(target != ignore_index, grad_output, 0)
    result = one_hot * grad_output
    if weight is None:
        for key in [k for k, (ref, _, _) in _one_hot_rows.items() if ref() is None]:
            _one_hot_rows.pop(key, None)
        _one_hot_rows[id(result)] = (weakref.ref(result), -grad_output.expand(target.shape), channel_dim)
    return result


def _log_softmax_backward_data(default, grad_output, output, dim, input_dtype):
    """``grad_output - exp(output) * grad_output.sum(dim)``, with the sums known when ``grad_output`` is a one-hot
    gradient of ``_nll_loss_backward``."""
    entry = _one_hot_rows.pop(id(grad_output), None)
    if (entry is None or entry[0]() is not grad_output or entry[2] != dim % output.dim()
            or not grad_output.dtype == output.dtype == input_dtype):
        return default(grad_output, output, dim, input_dtype)
    return grad_output - torch.exp(output) * entry[1]


def _var_mean_of_one(x: torch.Tensor, dim, correction, keepdim: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``var_mean`` of a one-element ``x``, as eager computes it: the mean is the element, the variance the
    square of ``x - mean`` (0, or NaN for a NaN or infinite element) over ``max(0, 1 - correction)``."""
    xf = _opmath(x)
    dims = list(range(x.dim())) if dim is None or (not isinstance(dim, int) and len(dim) == 0) else dim
    d = xf - xf
    denominator = max(0.0, 1.0 - (1.0 if correction is None else float(correction)))
    var = (d * d).sum(dims, keepdim=keepdim) / denominator
    return var.to(x.dtype), xf.sum(dims, keepdim=keepdim).to(x.dtype)


def _one_element(x: torch.Tensor) -> bool:
    return x.dtype.is_floating_point and isinstance(x.numel(), int) and x.numel() == 1


def _var(default, x, dim=None, *, correction=None, keepdim=False):
    """``var`` of a one-element input (see ``_var_mean_of_one``); any other is left to Inductor's lowering
    (``NotImplemented`` keeps the operation in the graph, as without an entry in the table)."""
    if not _one_element(x):
        return NotImplemented
    return _var_mean_of_one(x, dim, correction, keepdim)[0]


def _var_mean(default, x, dim=None, *, correction=None, keepdim=False):
    """``var_mean`` of a one-element input (see ``_var_mean_of_one``); any other is left to Inductor's lowering."""
    if not _one_element(x):
        return NotImplemented
    return _var_mean_of_one(x, dim, correction, keepdim)


_REPLACEMENTS = {
    aten.var.correction: _var,
    aten.var_mean.correction: _var_mean,
    aten.gelu.default: _gelu,
    aten.gelu_backward.default: _gelu_backward,
    aten.nll_loss_backward.default: _nll_loss_backward,
    aten._log_softmax_backward_data.default: _log_softmax_backward_data,
}


@functools.cache
def decomposition_table() -> dict:
    """Inductor's decomposition table with fulmen's replacements; each falls back to PyTorch's own entry for the
    cases it does not cover."""
    from torch._decomp import decomposition_table as torch_decompositions
    from torch._inductor.decomposition import select_decomp_table

    table = dict(select_decomp_table())
    for op, replacement in _REPLACEMENTS.items():
        default = table.get(op) or torch_decompositions.get(op)
        if default is not None:  # without one, Inductor lowers the op itself and needs no replacement
            table[op] = functools.partial(replacement, default)
    return table
