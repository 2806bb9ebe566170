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


@pytest.mark.parametrize("make", ["detached_intermediate", "input"])
def test_requires_grad_changing_a_flag_inside_a_compiled_function_is_refused(make):
    # fuzz (wide, seed 24): y = x.detach().requires_grad_() came back not requiring grad (a program with a
    # backward marked it non-differentiable), a value computed from such a leaf lost its gradient (seed 96), and
    # x.requires_grad_() on an input left the caller's tensor without the flag; eager makes a leaf in each case
    def program(x, w):
        y = (x * w).detach().requires_grad_() if make == "detached_intermediate" else x.requires_grad_()
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
