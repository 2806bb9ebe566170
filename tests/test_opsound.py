"""Op-level soundness: programs eager runs that fulmen refused or computed otherwise, found by the wide fuzzer and
the op_db sweeps (tests/test_opdb_layouts.py holds the metadata sweep)."""

from __future__ import annotations

import pytest
import torch

import fulmen


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- take_along_dim wraps its index and saves the wrapped copy (wide fuzz seeds 1300 and 2422) ----


def _take_then_fill(a, d, e):
    v = a.take_along_dim(d, 1)
    v.add_(d)
    d.fill_(2)  # eager's backward reads the wrapped copy its take_along_dim made, not d
    return d, torch.nn.functional.linear(v, e.mT)


def test_take_along_dim_then_fill_of_the_index_runs_and_differentiates_as_eager():
    # fulmen's backward read the caller's index itself, saw it overwritten and raised; eager saved remainder(index)
    a = torch.randn(1, 3, 4, dtype=torch.float64, generator=_gen(0), requires_grad=True)
    e = torch.randn(4, 2, dtype=torch.float64, generator=_gen(1), requires_grad=True)
    index = torch.randint(0, 3, (1, 2, 4), generator=_gen(2))
    d_eager, d_fulmen = index.clone(), index.clone()
    want = _take_then_fill(a, d_eager, e)
    got = fulmen.jit(_take_then_fill, executors=["torch"])(a, d_fulmen, e)
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0)
    assert torch.equal(d_fulmen, d_eager)
    ct = torch.randn(want[1].shape, dtype=torch.float64, generator=_gen(3))
    grads_want = torch.autograd.grad(want[1], (a, e), ct)
    grads_got = torch.autograd.grad(got[1], (a, e), ct)
    torch.testing.assert_close(grads_got, grads_want, rtol=1e-13, atol=1e-13)


def _take_negative(x, i):
    return torch.take_along_dim(x, i, 1) * torch.arange(1.0, 5.0, dtype=x.dtype)


@pytest.mark.parametrize("compile", ["off", pytest.param("sync", marks=pytest.mark.slow)])
def test_take_along_dim_wraps_negative_and_too_large_indices_as_eager(compile):
    # eager takes index -1 as the last entry and 4 of a size-4 dim as the first; a fused region's gather read the
    # raw index and raised "index -1 is out of bounds"
    x = torch.randn(3, 4, dtype=torch.float64, generator=_gen(4), requires_grad=True)
    i = torch.tensor([[-1, 0, -4, 3], [4, -2, 7, 1], [0, 0, -3, 2]])
    opts = {"executors": ["torch"]} if compile == "off" else {"compile": "sync"}
    want, got = _take_negative(x, i), fulmen.jit(_take_negative, **opts)(x, i)
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0)
    ct = torch.randn(3, 4, dtype=torch.float64, generator=_gen(5))
    torch.testing.assert_close(torch.autograd.grad(got, x, ct), torch.autograd.grad(want, x, ct), rtol=1e-15, atol=0)


@pytest.mark.parametrize(("seed", "extended"), [(1300, False), (2422, True)])
def test_wide_fuzz_seeds_with_take_along_dim_and_fill_match_eager(seed, extended):
    from fulmen.fuzz import check, generate

    m = check(generate(seed, 6, extended=extended, wide=True), "torch")
    assert m is None, f"{m}\n{m.program.script('torch')}"
