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


# ---- strides of views made by opaque ops, and of narrow with a tensor start ----

_OPAQUE_VIEWS = {
    "linalg_diagonal": lambda x: torch.linalg.diagonal(x),
    "atleast_3d": lambda x: torch.atleast_3d(x),
    "vsplit": lambda x: torch.vsplit(x, 2)[0],
    "hsplit": lambda x: torch.hsplit(x, 2)[1],
    "meshgrid": lambda x: torch.meshgrid(x[0], indexing="ij")[0],
    "unsafe_chunk": lambda x: x.unsafe_chunk(2)[0],
    "narrow_tensor_start": lambda x: x.narrow(1, torch.tensor(-3), 2),
}


@pytest.mark.parametrize("case", sorted(_OPAQUE_VIEWS))
def test_views_of_a_transposed_input_have_eagers_strides_inside_the_trace(case):
    # the views were linked to their base (a write reached it) but read as contiguous: stride(), is_contiguous()
    # and a later .view() inside the traced function answered otherwise than eager's
    view = _OPAQUE_VIEWS[case]

    def program(x):
        v = view(x)
        facts = v.stride(), v.is_contiguous()
        v.mul_(10)
        return v * 1, facts

    x_eager, x_fulmen = (torch.arange(36.0).reshape(6, 6).t() for _ in range(2))
    want, got = program(x_eager), fulmen.jit(program, executors=["torch"])(x_fulmen)
    assert got[1] == want[1]
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(x_fulmen, x_eager, rtol=0, atol=0)


def test_an_op_returning_a_sparse_tensor_inside_the_trace_is_refused_naming_the_line():
    # the op_db layout sweep: x.to_sparse() was traced as a strided tensor, so is_sparse read False where eager's
    # reads True (and .layout, and every later op, took it for a dense tensor)
    def program(x):
        s = x.to_sparse()
        return s.to_dense() * 2 if s.is_sparse else x

    with pytest.raises(NotImplementedError, match=r"(?s)to_sparse returns a sparse_coo tensor.*test_opsound"):
        fulmen.jit(program, executors=["torch"])(torch.randn(3, 3))


def _fill_a_view_of_itself(c):
    v = c[None]
    v.mul_(0.5)
    v[:1] = c  # eager fills v[:1] with the 0-d c (TensorIndexing's copy_to): no overlap check
    w = (c * 1)[None, None]
    w[0] = w[0, 0]
    return v, w, c * 1


def test_setitem_of_a_0d_cpu_value_that_is_the_target_itself_runs_as_eager():
    # wide fuzz (extended, seed 3529): fulmen raised eager's overlap error for v[:1] = c with v a view of c
    c = torch.randn((), dtype=torch.float64, generator=_gen(6))
    c_eager, c_fulmen = c.clone(), c.clone()
    want, got = _fill_a_view_of_itself(c_eager), fulmen.jit(_fill_a_view_of_itself, executors=["torch"])(c_fulmen)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(c_fulmen, c_eager, rtol=0, atol=0)


def _normal_in_place(x):
    return x.normal_(2.0, 3.0) * 1


def test_normal_in_place_of_a_gapped_input_draws_eagers_numbers():
    # op_db with rearranged inputs (normal.in_place, sliced): the opaque in-place op ran on x.clone(), which is
    # contiguous for a gapped x; eager's CPU normal_ draws another sequence into a non-contiguous tensor (serial, not
    # the 16-wide Box-Muller fill), so every number differed
    def gapped():
        return torch.zeros(5, 11, dtype=torch.float64)[:, 1::2][:, :5]

    x_eager, x_fulmen = gapped(), gapped()
    torch.manual_seed(0)
    want = _normal_in_place(x_eager)
    torch.manual_seed(0)
    got = fulmen.jit(_normal_in_place, executors=["torch"])(x_fulmen)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(x_fulmen, x_eager, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs", [{}, {"length": 90}, {"hop_length": 5}])
def test_istft_runs_and_differentiates_as_eager(kwargs):
    # op_db ops without a float dtype: istft was refused as data-dependent (its fake kernel stops at eager's check
    # of the window's overlap-add envelope, a value); its length depends on the arguments only
    window = torch.hann_window(16, dtype=torch.float64)
    spec = torch.stft(
        torch.randn(2, 100, dtype=torch.float64, generator=_gen(7)),
        16,
        hop_length=4,
        window=window,
        return_complex=True,
    ).requires_grad_()

    def program(s, w):
        return torch.istft(s, 16, window=w, **({"hop_length": 4} | kwargs)) * 2

    want, got = program(spec, window), fulmen.jit(program, executors=["torch"])(spec, window)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    ct = torch.randn(want.shape, dtype=torch.float64, generator=_gen(8))
    torch.testing.assert_close(
        torch.autograd.grad(got, spec, ct), torch.autograd.grad(want, spec, ct), rtol=1e-12, atol=1e-12
    )
    with pytest.raises(RuntimeError, match="window overlap add min"):  # eager's check of the window still holds
        fulmen.jit(lambda s, w: torch.istft(s, 16, hop_length=4, window=w, center=False))(spec, window)
