"""The Triton cross-entropy kernels against torch (on CPU through Triton's interpreter).

Not collected directly: tests/test_triton_cross_entropy.py runs this file in a fresh process, because Triton reads
TRITON_INTERPRET once and other tests in a shared process may initialise Triton first."""

import os

import pytest
import torch

# Without a GPU the kernels run through Triton's interpreter, which triton.jit picks when TRITON_INTERPRET is set at
# decoration time (fulmen decorates them on first use). With a GPU they are compiled and run on it, and the
# interpreter stays off so other Triton users in the process are unaffected.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from fulmen.executors.triton_cross_entropy import (  # noqa: E402
    TRITON_AVAILABLE,
    triton_cross_entropy_backward,
    triton_cross_entropy_forward,
)

N, C, BLOCK = 7, 37, 16  # three column blocks, the last one partial

CASES = [
    pytest.param(-100, 0.0, False, id="plain"),
    pytest.param(-100, 0.1, False, id="smoothing"),
    pytest.param(3, 0.0, True, id="ignore_index"),
    pytest.param(-1, 0.25, True, id="ignore_index+smoothing"),
]


def _inputs(ignore_index, with_ignored, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, C, generator=g) * 3
    target = torch.randint(0, C, (N,), generator=g)
    if with_ignored:
        target[1] = ignore_index
        target[4] = ignore_index
    else:
        target[target == ignore_index] = 0
    return logits.to(DEVICE), target.to(DEVICE)


def test_available():
    assert TRITON_AVAILABLE


@pytest.mark.parametrize("ignore_index,smoothing,with_ignored", CASES)
def test_forward(ignore_index, smoothing, with_ignored):
    logits, target = _inputs(ignore_index, with_ignored)
    losses, lse = triton_cross_entropy_forward(logits, target, ignore_index, smoothing, block_size=BLOCK)
    expected = F.cross_entropy(logits, target, reduction="none", ignore_index=ignore_index,
                               label_smoothing=smoothing)
    assert losses.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ignore_index,smoothing,with_ignored", CASES)
def test_backward(ignore_index, smoothing, with_ignored):
    logits, target = _inputs(ignore_index, with_ignored)
    g = torch.randn(N, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x = logits.clone().requires_grad_()
    loss = F.cross_entropy(x, target, reduction="none", ignore_index=ignore_index, label_smoothing=smoothing)
    (expected,) = torch.autograd.grad(loss, x, g)
    _, lse = triton_cross_entropy_forward(logits, target, ignore_index, smoothing, block_size=BLOCK)
    grad = triton_cross_entropy_backward(g, logits, target, lse, ignore_index, smoothing, block_size=BLOCK)
    assert grad.shape == logits.shape and grad.dtype == logits.dtype
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)
    if with_ignored:
        assert not grad[target == ignore_index].any()


def test_default_block_and_1d():
    """One block covering every column, and (C,) logits with a 0-d target."""
    logits, target = _inputs(-100, False)
    losses, lse = triton_cross_entropy_forward(logits, target)
    torch.testing.assert_close(losses, F.cross_entropy(logits, target, reduction="none"), rtol=1e-5, atol=1e-5)
    loss0, lse0 = triton_cross_entropy_forward(logits[2], target[2], block_size=BLOCK)
    assert loss0.shape == lse0.shape == ()
    torch.testing.assert_close(loss0, losses[2], rtol=1e-5, atol=1e-5)
    one = torch.tensor(1.0, device=DEVICE)
    grad0 = triton_cross_entropy_backward(one, logits[2], target[2], lse0, block_size=BLOCK)
    x = logits[2].clone().requires_grad_()
    (expected,) = torch.autograd.grad(F.cross_entropy(x, target[2]), x)
    torch.testing.assert_close(grad0, expected, rtol=1e-5, atol=1e-5)


def test_noncontiguous_logits():
    logits, target = _inputs(-100, False)
    wide = torch.randn(N, 2 * C, device=DEVICE)
    wide[:, ::2] = logits
    view = wide[:, ::2]
    losses, lse = triton_cross_entropy_forward(view, target, block_size=BLOCK)
    torch.testing.assert_close(losses, F.cross_entropy(logits, target, reduction="none"), rtol=1e-5, atol=1e-5)


def test_minus_inf_logits():
    """Masked-out classes (-inf logits) filling whole lanes of the first block."""
    logits, target = _inputs(-100, False)
    logits[:, :20] = float("-inf")
    target = target.clamp(min=20)
    losses, lse = triton_cross_entropy_forward(logits, target, block_size=BLOCK)
    torch.testing.assert_close(losses, F.cross_entropy(logits, target, reduction="none"), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=1), rtol=1e-5, atol=1e-5)
    grad = triton_cross_entropy_backward(torch.ones(N, device=DEVICE), logits, target, lse, block_size=BLOCK)
    x = logits.clone().requires_grad_()
    (expected,) = torch.autograd.grad(F.cross_entropy(x, target, reduction="sum"), x)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)
