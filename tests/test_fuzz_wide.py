"""The wide fuzz mode (``generate(seed, wide=True)``: grad-mode regions, 0-d and scalar type promotion, ``out=``,
``where`` with scalar branches, empty reductions, a view returned with its base; outputs' strides and aliasing
compared), and what it found."""

from __future__ import annotations

import pytest
import torch

import fulmen
from fulmen.fuzz import check, generate


def _mismatches(seeds, executors: str, extended: bool = False, max_ops: int = 6) -> list[str]:
    found = []
    for seed in seeds:
        m = check(generate(seed, max_ops, extended=extended, wide=True), executors)
        if m is not None:
            found.append(f"seed {seed}: {m}\n{m.program.script(executors)}")
    return found


def test_wide_fuzz_slice_torch_executor():
    found = _mismatches(range(0, 30), "torch")
    assert not found, "\n\n".join(found)


@pytest.mark.slow
@pytest.mark.parametrize("extended", [False, True])
def test_wide_fuzz_bigger_slice_torch_executor(extended):
    found = _mismatches(range(1000, 1400), "torch", extended=extended)
    assert not found, "\n\n".join(found)


@pytest.mark.slow
def test_wide_fuzz_slice_fused_regions():
    found = _mismatches(range(0, 8), "default", max_ops=3)
    assert not found, "\n\n".join(found)


def test_wide_programs_are_reproducible_and_other_modes_unchanged():
    assert generate(5, wide=True).script() == generate(5, wide=True).script()
    assert generate(5).script() == generate(5, wide=False).script()
    assert any(s.category == "wide" for seed in range(20) for s in generate(seed, wide=True).stmts)


def test_requires_grad_changing_the_flag_of_an_input_is_refused():
    # fuzz (wide, seed 24): y = x.detach().requires_grad_() came back not requiring grad (a program with a
    # backward marked it non-differentiable), a value computed from such a leaf lost its gradient (seed 96), and
    # x.requires_grad_() on an input left the caller's tensor without the flag; eager makes a leaf in each case.
    # Leaves made of tensors made inside now run (tests/test_false_refusals.py); an input's flag stays refused.
    def program(x, w):
        y = x.requires_grad_()
        return y * 2, x * w

    x, w = torch.randn(3), torch.randn(3, requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"(?s)requires_grad_\(True\).*test_fuzz_wide"):
        fulmen.jit(program, executors=["torch"])(x, w)


def test_requires_grad_asking_for_the_flag_a_tensor_has_still_runs():
    def program(x):
        return (x * 2).requires_grad_() * 3, x.detach().requires_grad_(False)

    x = torch.randn(3, requires_grad=True)
    got, want = fulmen.jit(program, executors=["torch"])(x), program(x)
    torch.testing.assert_close(got, want)
    assert [t.requires_grad for t in got] == [t.requires_grad for t in want]


_LIKE = {
    "zeros_like": lambda x: torch.zeros_like(x),
    "full_like": lambda x: torch.full_like(x, 2.0, dtype=torch.float64),
    "empty_like_out": lambda x: torch.add(x, 1, out=torch.empty_like(x)),
    "rand_like": lambda x: torch.rand_like(x),
    "randn_like": lambda x: torch.randn_like(x) * x,
}


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
@pytest.mark.parametrize("case", sorted(_LIKE))
def test_like_factories_keep_eager_s_layout_and_draws(case, layout):
    # fuzz (wide, seed 406): torch.add(b, 1, out=torch.empty_like(b)) of a transposed b came back contiguous; eager's
    # *_like keep a dense input's layout, and rand_like/randn_like fill it in memory order (other numbers otherwise)
    fn = _LIKE[case]
    x = torch.randn(2, 3, 4, 5)
    x = x.to(memory_format=torch.channels_last) if layout == "channels_last" else x.transpose(1, 3)
    torch.manual_seed(0)
    expected = fn(x)
    jitted = fulmen.jit(fn, executors=["torch"])
    for _ in range(2):
        torch.manual_seed(0)
        got = jitted(x)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert got.stride() == expected.stride()


def test_results_computed_under_no_grad_do_not_require_grad_while_tracing():
    # fuzz (wide, seed 895): a value computed under no_grad reported requires_grad True inside the traced function,
    # so code reading the flag took the other branch than eager's, and a later out= call raised eager's error for
    # arguments that require grad
    def program(a):
        with torch.no_grad():
            b = a * 2
        flag = torch.tensor(1.0 if b.requires_grad else 0.0)
        return torch.add(b, 0.5, out=torch.empty_like(b)), flag, a * b

    a = torch.randn(3, requires_grad=True)
    expected, got = program(a), fulmen.jit(program, executors=["torch"])(a)
    torch.testing.assert_close(got, expected)
    assert [t.requires_grad for t in got] == [t.requires_grad for t in expected]


def _written_movedim(a, c):
    v1 = torch.nn.functional.softplus(a)
    v6 = v1.movedim(0, 1).div_(3)
    return v1, v6


def _written_diagonal(a, c):
    v2 = torch.relu(a * a)
    v3 = v2.diagonal()
    v3.copy_(c)
    return v2, v3


@pytest.mark.parametrize("program", [_written_movedim, _written_diagonal])
def test_a_view_written_in_place_stays_a_view_of_its_base(program):
    # fuzz (wide, seeds 1282, 578): the view a write went through kept the written value itself as its value, so a
    # returned view did not share memory with the returned base (and a diagonal written by copy_ of a 0-d tensor
    # came back as an expand of the caller's tensor, stride 0); it is now remade from the base's new value
    a, c = torch.randn(4, 3, 5), torch.randn(())
    want = program(a.clone(), c.clone())
    got = fulmen.jit(program, executors=["torch"])(a.clone(), c)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got[1].stride() == want[1].stride()
    assert got[1].untyped_storage().data_ptr() == got[0].untyped_storage().data_ptr()
    before = c.clone()
    got[1].zero_()
    assert torch.equal(c, before) and torch.count_nonzero(got[0]) < got[0].numel()
