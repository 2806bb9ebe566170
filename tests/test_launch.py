"""fulmen.launch.run_on_ranks: the 2-process gloo harness the distributed tests and benchmarks stand on."""

import pytest
import torch
import torch.distributed as dist

from fulmen.launch import run_on_ranks


def _all_reduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, world_size, t


def _fails_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def test_each_rank_runs_in_one_process_group_and_returns_in_rank_order():
    out = run_on_ranks(_all_reduce, timeout=120)
    assert [(r, w) for r, w, _ in out] == [(0, 2), (1, 2)]
    for _, _, t in out:
        torch.testing.assert_close(t, torch.tensor([3.0]), rtol=0, atol=0)


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(RuntimeError, match="rank 1 of _fails_on_rank_1 failed:(.|\n)*rank one refuses"):
        run_on_ranks(_fails_on_rank_1, timeout=120)
