"""What a training step's forward leaves saved for the backward (issue 46): no more than torch.compile keeps.

A model that returns its logits keeps them alive with the caller; fulmen's forward then saves those logits (and
O(N) row statistics) for the cross-entropy backward rather than a second (N, C) tensor. Rematerialization
counts any value the forward returns as free to save, as it does the inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.bench.memory import saved_tensors


def _extra_storages(saved: list[torch.Tensor], alive: list[torch.Tensor]) -> dict[int, int]:
    """``{storage: bytes}`` of the saved tensors whose memory none of ``alive`` (inputs, parameters, outputs) holds."""
    skip = {t.untyped_storage().data_ptr() for t in alive}
    return {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in saved
        if t.untyped_storage().data_ptr() not in skip
    }


class _Head(torch.nn.Module):
    """An LM head and its loss, returning (logits, loss) as Hugging Face causal LMs do."""

    def __init__(self, width: int, vocab: int, dtype: torch.dtype, reduction: str):
        super().__init__()
        self.proj = torch.nn.Linear(width, width, dtype=dtype)
        self.head = torch.nn.Linear(width, vocab, bias=False, dtype=dtype)
        self.reduction = reduction

    def forward(self, h, target):
        logits = self.head(torch.tanh(self.proj(h)))
        return logits, F.cross_entropy(logits, target, ignore_index=-1, reduction=self.reduction)


def _step(model, h, target, ct):
    logits, loss = model(h, target)
    loss.backward(ct)
    return logits, loss, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_lm_head_returning_logits_saves_no_second_n_by_c_tensor(dtype, reduction):
    """The forward saves nothing of (N, C) size beyond the logits it returns: every other saved tensor that no
    input, parameter or output holds has at most N elements (torch.compile keeps the logits and two (N, 1) row
    statistics). Loss and gradients match eager's, and the float32 ones a float64 reference within float32
    rounding."""
    n, width, vocab = 24, 16, 97
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(n, width, generator=gen, dtype=dtype)
    target = torch.randint(0, vocab, (n,), generator=gen)
    target[:5] = -1  # ignored rows
    torch.manual_seed(0)
    eager = _Head(width, vocab, dtype, reduction)
    model = _Head(width, vocab, dtype, reduction)
    model.load_state_dict(eager.state_dict())
    reference = _Head(width, vocab, torch.float64, reduction)
    reference.load_state_dict({k: v.double() for k, v in eager.state_dict().items()})
    jitted = fulmen.jit(model, executors=["torch"])
    ct = torch.randn(() if reduction != "none" else (n,), generator=gen, dtype=dtype)

    logits, loss, grads = _step(jitted, h, target, ct)
    e_logits, e_loss, e_grads = _step(eager, h, target, ct)
    torch.testing.assert_close(loss, e_loss)
    torch.testing.assert_close(logits, e_logits)
    for g, e in zip(grads, e_grads):
        torch.testing.assert_close(g, e)
    _, r_loss, r_grads = _step(reference, h.double(), target, ct.double())
    torch.testing.assert_close(loss.double(), r_loss, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, r_grads):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5)

    logits, loss = jitted(h, target)
    extra = _extra_storages(saved_tensors(loss), [h, target, logits, loss, *model.parameters()])
    big = [b for b in extra.values() if b > n * dtype.itemsize]
    # the tanh activation the head's matmul reads (N, width) is the one larger tensor the forward must save
    assert big == [n * width * dtype.itemsize], (sorted(extra.values()), str(fulmen.last_traces(jitted)[-1]))


def test_lm_head_saves_no_more_than_eager():
    """Returning only the loss, the forward saves one (N, C) tensor for the cross-entropy, as eager does (which
    keeps its log-probabilities): fulmen's saved bytes are at most eager's."""
    n, width, vocab = 24, 16, 97
    gen = torch.Generator().manual_seed(1)
    h, target = torch.randn(n, width, generator=gen), torch.randint(0, vocab, (n,), generator=gen)
    torch.manual_seed(0)
    model = _Head(width, vocab, torch.float32, "mean")
    params = list(model.parameters())

    def loss_only(h, target):
        return model(h, target)[1]

    eager_saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: eager_saved.append(t) or t, lambda t: t):
        e_loss = loss_only(h, target)
    jitted = fulmen.jit(loss_only, executors=["torch"])
    jitted(h, target)
    loss = jitted(h, target)
    torch.testing.assert_close(loss, e_loss)
    alive = [h, target, *params]
    ours, eagers = _extra_storages(saved_tensors(loss), alive), _extra_storages(eager_saved, alive)
    assert sum(ours.values()) <= sum(eagers.values()), (sorted(ours.values()), sorted(eagers.values()))


def test_a_returned_value_is_saved_rather_than_a_same_sized_one_computed_from_it():
    """Generic rematerialization: the backward of ``exp(y)`` reads its output, which is as large as ``y``; when the
    program returns ``y``, saving ``y`` and recomputing the exp costs no memory, so only ``y`` is kept."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, generator=gen, dtype=torch.float64, requires_grad=True)

    def f(x, w):
        y = x @ w
        return y, torch.exp(y).sum()

    jitted = fulmen.jit(f, executors=["torch"])
    y, s = jitted(x, w)
    e_y, e_s = f(x, w)
    torch.testing.assert_close(s, e_s)
    torch.testing.assert_close(torch.autograd.grad(s, (x, w)), torch.autograd.grad(e_s, (x, w)))
    y, s = jitted(x, w)
    assert _extra_storages(saved_tensors(s), [x, w, y, s]) == {}, str(fulmen.last_traces(jitted)[-1])


def test_a_saved_returned_value_modified_in_place_raises_rather_than_a_wrong_gradient():
    """The returned logits the cross-entropy backward reads are saved through ``ctx.save_for_backward``: writing into
    them before ``backward()`` raises PyTorch's version-counter error (as under torch.compile), never a gradient
    computed from the new values."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 6, (8,), generator=gen)

    def f(x, w):
        logits = x @ w
        return logits, F.cross_entropy(logits, target)

    jitted = fulmen.jit(f, executors=["torch"])
    jitted(x, w)  # the first call runs eagerly while fulmen compiles
    logits, loss = jitted(x, w)
    with torch.no_grad():
        logits.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
