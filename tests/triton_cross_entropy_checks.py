"""The Triton cross-entropy kernels, and the ``cross_entropy`` executor's path through them, against torch (on CPU
through Triton's interpreter).

Not collected directly: tests/test_triton_cross_entropy.py runs this file in a fresh process, because Triton picks
its interpreter from TRITON_INTERPRET when ``triton.language`` is first imported (its own helpers such as
``tl.zeros`` are decorated then), and other tests in a shared process may import Triton first."""

import os

import pytest
import torch

# Without a GPU the kernels run through Triton's interpreter, and the executor sends CPU logits to them. With a GPU
# they are compiled and run on it, and the interpreter stays off so other Triton users in the process are unaffected.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

import fulmen  # noqa: E402
from fulmen.executors import cross_entropy as ce_module  # noqa: E402
from fulmen.executors import triton_cross_entropy as tce  # noqa: E402
from fulmen.executors.triton_cross_entropy import (  # noqa: E402
    triton_cross_entropy_backward,
    triton_cross_entropy_forward,
)

if DEVICE == "cpu":
    ce_module.TRITON_DEVICE_TYPES = frozenset({"cuda", "cpu"})  # this process only

N, C, BLOCK = 7, 37, 16  # three column blocks, the last one partial

CASES = [
    pytest.param(-100, 0.0, False, id="plain"),
    pytest.param(-100, 0.1, False, id="smoothing"),
    pytest.param(3, 0.0, True, id="ignore_index"),
    pytest.param(-1, 0.25, True, id="ignore_index+smoothing"),
]


def _inputs(ignore_index, with_ignored, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, C, generator=g) * 3
    target = torch.randint(0, C, (N,), generator=g)
    if with_ignored:
        target[1] = ignore_index
        target[4] = ignore_index
    else:
        target[target == ignore_index] = 0
    return logits.to(DEVICE, dtype), target.to(DEVICE)


def test_available():
    assert tce.TRITON_AVAILABLE


@pytest.mark.parametrize("ignore_index,smoothing,with_ignored", CASES)
def test_forward_and_backward(ignore_index, smoothing, with_ignored):
    logits, target = _inputs(ignore_index, with_ignored)
    g = torch.randn(N, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x = logits.clone().requires_grad_()
    expected = F.cross_entropy(x, target, reduction="none", ignore_index=ignore_index, label_smoothing=smoothing)
    (expected_grad,) = torch.autograd.grad(expected, x, g)
    losses, lse = triton_cross_entropy_forward(logits, target, ignore_index, smoothing, block_size=BLOCK)
    assert losses.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(losses, expected.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=1), rtol=1e-5, atol=1e-5)
    grad = triton_cross_entropy_backward(g, logits, target, lse, ignore_index, smoothing, block_size=BLOCK)
    assert grad.shape == logits.shape and grad.dtype == logits.dtype
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5)
    if with_ignored:
        assert not grad[target == ignore_index].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits(dtype):
    """The kernels read 16-bit logits, compute in float32 and write the gradient in the logits' dtype: against
    torch on the same values in float32, the losses agree to float32 rounding and the gradient to one rounding to
    ``dtype``."""
    logits, target = _inputs(-100, False, dtype=dtype)
    wide = logits.float().requires_grad_()
    expected = F.cross_entropy(wide, target, reduction="none")
    (expected_grad,) = torch.autograd.grad(expected.sum(), wide)
    losses, lse = triton_cross_entropy_forward(logits, target, block_size=BLOCK)
    torch.testing.assert_close(losses, expected.detach(), rtol=1e-5, atol=1e-5)
    grad = triton_cross_entropy_backward(torch.ones(N, device=DEVICE), logits, target, lse, block_size=BLOCK)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, expected_grad.to(dtype), rtol=0, atol=torch.finfo(dtype).eps)


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
    losses, lse = triton_cross_entropy_forward(wide[:, ::2], target, block_size=BLOCK)
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


@pytest.mark.parametrize("bad", [C, -2])
def test_out_of_range_target_gives_nan_not_another_rows_logit(bad):
    """Eager raises for a target outside [0, C) (on CUDA, a device-side assertion); the kernels do not read the
    logit at that index (which lies in another row) but give that row NaN, and only that row."""
    logits, target = _inputs(-100, False)
    target[2] = bad
    losses, lse = triton_cross_entropy_forward(logits, target, block_size=BLOCK)
    assert losses[2].isnan() and not losses[torch.arange(N) != 2].isnan().any()
    grad = triton_cross_entropy_backward(torch.ones(N, device=DEVICE), logits, target, lse, block_size=BLOCK)
    assert grad[2].isnan().all() and not grad[torch.arange(N) != 2].isnan().any()


# ---- the cross_entropy executor's path through the kernels ----


@pytest.mark.parametrize("reduction,dtype", [("mean", torch.float32), ("sum", torch.bfloat16), ("none", torch.float32)])
def test_executor_runs_the_kernels(reduction, dtype, monkeypatch):
    """``fulmen.jit(..., executors=["cross_entropy"])`` on logits the kernels take: its loss and gradient are the
    kernels' (counted), and eager's to the rounding of the logits' dtype."""
    calls = []
    for name in ("triton_cross_entropy_forward", "triton_cross_entropy_backward"):
        original = getattr(ce_module, name)
        monkeypatch.setattr(ce_module, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    logits, target = _inputs(5, True, dtype=dtype)

    def f(x, t):
        return F.cross_entropy(x, t, reduction=reduction, ignore_index=5, label_smoothing=0.1)

    jf = fulmen.jit(f, executors=["cross_entropy"])
    results = []
    for fn in (jf, f):
        x = logits.clone().requires_grad_()
        loss = fn(x, target)
        loss.backward(torch.ones_like(loss))
        results.append((loss.detach(), x.grad))
    assert calls == ["triton_cross_entropy_forward", "triton_cross_entropy_backward"]
    (loss, grad), (expected, expected_grad) = results
    assert loss.dtype == expected.dtype and grad.dtype == expected_grad.dtype
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(loss, expected, **tol)
    torch.testing.assert_close(grad, expected_grad, **tol)
