"""Regressions found by running PyTorch's op_db through fulmen.jit (``benchmarks/op_db_coverage.py``): checks that
were stricter than eager's, and random ops that must draw eager's numbers exactly with the torch executor."""

from __future__ import annotations

import pytest
import torch

import fulmen
from fulmen.testing import clone_args


def _jit(fn):
    return fulmen.jit(fn, executors=["torch"])


def _grads(out, inputs):
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if o.requires_grad]
    cotangents = [torch.linspace(-1, 1, o.numel(), dtype=o.dtype).reshape(o.shape) for o in outs]
    return torch.autograd.grad(outs, inputs, cotangents, allow_unused=True, materialize_grads=True)


def check_vs_eager(fn, *args, rtol=None, atol=None, grad=True):
    """fulmen.jit(fn) (torch executor) against eager: outputs and, for float inputs that require grad, gradients."""
    e_args, a_args = clone_args(args), clone_args(args)
    expected, actual = fn(*e_args), _jit(fn)(*a_args)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    diff = [i for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.requires_grad]
    if grad and diff:
        torch.testing.assert_close(_grads(actual, [a_args[i] for i in diff]),
                                   _grads(expected, [e_args[i] for i in diff]), rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------------------
# checks no stricter than eager's


@pytest.mark.parametrize("op", ["gather", "scatter", "scatter_value", "scatter_add", "scatter_"])
def test_gather_scatter_int32_index(op):
    fns = {
        "gather": lambda x, i, s: torch.gather(x, 1, i),
        "scatter": lambda x, i, s: torch.scatter(x, 1, i, s),
        "scatter_value": lambda x, i, s: torch.scatter(x, 1, i, 2.5),
        "scatter_add": lambda x, i, s: torch.scatter_add(x, 1, i, s),
        "scatter_": lambda x, i, s: (x * 1).scatter_(1, i, s),
    }
    x = torch.randn(3, 5, requires_grad=True)
    src = torch.randn(3, 2, requires_grad=True)
    index = torch.tensor([[0, 4], [2, 2], [1, 3]], dtype=torch.int32)
    check_vs_eager(fns[op], x, index, src)


def test_gather_scatter_int16_index_is_rejected_as_eager_does():
    x, index = torch.randn(3, 5), torch.zeros(3, 2, dtype=torch.int16)
    for fn in (lambda x, i: torch.gather(x, 1, i), lambda x, i: torch.scatter_add(x, 1, i, x[:, :2])):
        with pytest.raises(RuntimeError, match="Expected dtype int32/int64 for index"):
            fn(x, index)
        with pytest.raises(RuntimeError, match="Expected dtype int32/int64 for index"):
            _jit(fn)(x, index)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64])
def test_gather_scatter_empty_index_of_any_shape(dtype):
    # eager checks neither the dtype nor the number of dimensions of an index with no entries
    x = torch.randn(5, requires_grad=True)
    index = torch.zeros(2, 0, dtype=dtype)
    check_vs_eager(lambda x, i: torch.gather(x, 0, i) * 2, x, index)
    check_vs_eager(lambda x, i: torch.scatter(x, 0, i, 1.0) * 2, x, index)
    check_vs_eager(lambda x, i: torch.scatter_add(x, 0, i, x.detach().reshape(1, 5)) * 2, x, index)
