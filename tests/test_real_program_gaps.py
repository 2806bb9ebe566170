"""Smaller gaps real programs hit (issue 42): pickling jitted code, Embedding(max_norm), RNN flat weights, higher-order
ops, and a custom op whose meta disagrees with its kernel. Each compares against eager PyTorch."""

import copy

import pytest
import torch
import torch.nn.functional as F

import fulmen

# ---- nn.Embedding(max_norm=...): rows renormalized in place before the lookup


def _big_embedding(**kwargs) -> torch.nn.Embedding:
    torch.manual_seed(0)
    e = torch.nn.Embedding(10, 4, **kwargs)
    with torch.no_grad():
        e.weight.mul_(3)  # most rows' norms exceed max_norm
    return e


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_embedding_max_norm_renormalizes_the_weight_in_place_as_eager(norm_type):
    eager = _big_embedding(max_norm=1.5, norm_type=norm_type)
    mine = copy.deepcopy(eager)
    jitted = fulmen.jit(mine, executors=["torch"])
    calls = [torch.tensor([[1, 2, 2], [3, 9, 1]]), torch.tensor([[0, 5, 5], [1, 1, 7]]), torch.tensor([[4, 4, 4]])]
    for idx in calls:  # several calls in a row: each renormalizes the rows it picks
        expected, got = eager(idx), jitted(idx)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        torch.testing.assert_close(mine.weight, eager.weight, rtol=0, atol=0)  # the write is visible after the call
        (expected * torch.arange(4.0)).sum().backward()
        (got * torch.arange(4.0)).sum().backward()
        torch.testing.assert_close(mine.weight.grad, eager.weight.grad, rtol=0, atol=0)
    assert (eager.weight.norm(p=norm_type, dim=1)[[0, 1, 2, 3, 4, 5, 7, 9]] <= 1.5 + 1e-5).all()
    assert eager.weight.norm(p=norm_type, dim=1)[8] > 1.5  # a row never picked keeps its norm


def test_functional_embedding_max_norm_writes_the_weight_argument():
    def f(idx, w):
        return F.embedding(idx, w, max_norm=1.0).sum(-1)

    w = _big_embedding().weight.detach().clone()
    w_eager = w.clone()
    idx = torch.tensor([0, 3, 3, 6])
    torch.testing.assert_close(fulmen.jit(f, executors=["torch"])(idx, w), f(idx, w_eager), rtol=0, atol=0)
    torch.testing.assert_close(w, w_eager, rtol=0, atol=0)


# ---- LSTM/GRU: forward rebuilds _flat_weights from the parameters it sees (the proxies, while tracing)


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
def test_rnn_traces_silently_and_keeps_its_flat_weights_real(cls, caplog, recwarn):
    torch.manual_seed(0)
    eager = cls(4, 5, num_layers=2, batch_first=True, bidirectional=True)
    mine = copy.deepcopy(eager)
    jitted = fulmen.jit(mine, executors=["torch"])
    x = torch.randn(2, 3, 4, requires_grad=True)
    x_mine = x.detach().clone().requires_grad_()
    with caplog.at_level("WARNING", logger="fulmen"):
        for _ in range(2):
            expected, got = eager(x)[0], jitted(x_mine)[0]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
            expected.square().sum().backward()
            got.square().sum().backward()
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert not [str(w.message) for w in recwarn.list if "weight" in str(w.message)]
    torch.testing.assert_close(x_mine.grad, x.grad, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(mine.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    # the module's own bookkeeping holds its parameters, as eager leaves it (not a tracing placeholder)
    params = [getattr(mine, n) for n in mine._flat_weights_names]
    assert all(w is p for w, p in zip(mine._flat_weights, params, strict=True))
    assert all(r() is p for r, p in zip(mine._flat_weight_refs, params, strict=True))
