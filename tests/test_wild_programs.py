"""Programs nobody on the team wrote, as users write them: each must match eager PyTorch call after call.

Every test here reproduces a silently wrong result found by running such a program under ``fulmen.jit``: the
values, gradients and buffers are compared with eager's.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import fulmen


def _reads_after_inplace(x, n):
    n.add_(1)
    return x * float(n), x * n.item(), x + int(n), x[: n.tolist()]


def test_value_read_after_an_inplace_update_is_the_updated_value():
    """``n.add_(1); float(n)`` reads n after the update: the read is a split point on the value now, not on the
    tensor the caller passed in (which still held the old value)."""
    jfn = fulmen.jit(_reads_after_inplace, executors=["torch"])
    x = torch.arange(4.0)
    n_eager, n_jit = torch.tensor(1), torch.tensor(1)
    for _ in range(3):  # the value changes every call: a new branch each time, each eager's
        want, got = _reads_after_inplace(x, n_eager), jfn(x, n_jit)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert torch.equal(n_jit, n_eager)


def test_batchnorm_cumulative_average_momentum_none():
    """``BatchNorm1d(momentum=None)`` averages its running stats with ``1 / float(num_batches_tracked)`` after
    incrementing it in place; the read must see the incremented count (it saw 0 and divided by zero)."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=None)).double()
    jitted_module = copy.deepcopy(eager)
    jm = fulmen.jit(jitted_module, executors=["torch"])
    for step in range(3):
        x = torch.randn(6, 3, dtype=torch.float64)
        torch.testing.assert_close(jm(x), eager(x))
        for name, want in eager.named_buffers():
            torch.testing.assert_close(dict(jitted_module.named_buffers())[name], want, msg=f"{name} step {step}")
