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
