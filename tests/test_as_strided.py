"""``torch.as_strided`` addresses the storage its input views (its input's own strides and offset are ignored, an
offset given is absolute): reads, writes through the view, and the view after its base changes match eager."""

import pytest
import torch

import fulmen


def _matrix():
    return torch.arange(12.0).reshape(3, 4)


def _transposed_input():
    return torch.arange(12.0).reshape(3, 4).t()


def _write_t_offset(x):
    v = torch.as_strided(x.t(), (2, 2), (1, 4), 1)
    v.mul_(10)
    return v + 0


def _write_slice_column_offset(x):
    y = x[:, 1:]
    y.as_strided((3,), (4,), 1).zero_()
    return y + 0


def _write_select_of_t_own_offset(x):
    y = x.t()[1]  # storage offset 1, taken by as_strided when no offset is given
    y.as_strided((2,), (4,)).add_(torch.tensor([1.0, 2.0]))
    return y + 0


def _index_into_slice_t(x):
    v = x[1:].t().as_strided((2, 3), (4, 1))
    v[0, 1] = -7
    return v + 0


def _write_intermediate_t(x):
    y = (x + 1).t()
    torch.as_strided(y, (2, 2), (1, 4), 1).mul_(10)
    return y + 0


def _write_transposed_input(x):
    v = torch.as_strided(x, (2, 2), (1, 3), 1)
    v.mul_(10)
    return v * 1


def _fill_expanded_input(x):
    x.as_strided((2,), (1,), 1).fill_(-5)
    return x + 0


def _base_changes_then_view_read(x):
    v = torch.as_strided(x.t(), (2, 2), (1, 4), 1)
    x.add_(100)
    return v * 1


def _slice_scatter(x):
    return torch.as_strided_scatter(x[1:].t(), torch.full((2, 2), -1.0), (2, 2), (1, 4), 1)


CASES = [
    (_write_t_offset, _matrix),
    (_write_slice_column_offset, _matrix),
    (_write_select_of_t_own_offset, _matrix),
    (_index_into_slice_t, _matrix),
    (_write_intermediate_t, _matrix),
    (_write_transposed_input, _transposed_input),
    (_fill_expanded_input, lambda: torch.arange(4.0).expand(3, 4)),
    (_base_changes_then_view_read, _matrix),
    (_slice_scatter, _matrix),
]


# an explicit offset into a program input's storage: where the caller's tensor starts in it is not known
OFFSET_INTO_INPUT = {_write_t_offset, _write_slice_column_offset, _write_transposed_input, _fill_expanded_input,
                     _base_changes_then_view_read}


def _on_a_copy(fn):
    def on_copy(x):
        return fn(x.clone())  # clone keeps a dense layout: the storage is the copy's own, from position 0

    return on_copy


@pytest.mark.parametrize("fn, make", CASES, ids=[fn.__name__.lstrip("_") for fn, _ in CASES])
def test_as_strided_matches_eager(fn, make):
    """The result and the caller's tensor after the call are eager's, element for element. With an explicit offset
    into an input's storage the call is refused, the caller's tensor untouched, and the same program on a copy made
    inside (whose storage fulmen knows) is eager's."""
    if fn in OFFSET_INTO_INPUT:
        x = make()
        before = x.clone()
        with pytest.raises(NotImplementedError, match=r"storage_offset(.|\n)*test_as_strided.py"):
            fulmen.jit(fn, executors=["torch"])(x)
        torch.testing.assert_close(x, before, rtol=0, atol=0)
        fn = _on_a_copy(fn)
    expected_x, x = make(), make()
    expected = fn(expected_x)
    out = fulmen.jit(fn, executors=["torch"])(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(x, expected_x, rtol=0, atol=0)


def test_as_strided_write_gradient_matches_eager():
    """A write through as_strided of a transposed intermediate: the value and the gradient are eager's (float64)."""

    def fn(x):
        y = (x * 2).t()
        torch.as_strided(y, (2, 2), (1, 4), 1).mul_(3)
        return (y * y).sum()

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    expected = fn(x)
    (expected_grad,) = torch.autograd.grad(expected, x)
    out = fulmen.jit(fn, executors=["torch"])(x)
    (grad,) = torch.autograd.grad(out, x)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad, expected_grad)


def test_as_strided_write_outside_known_storage_is_refused():
    """A view of a program input reaching storage positions beyond the input's own elements: eager writes memory
    fulmen does not hold, so the write is refused naming the line instead of reaching other elements."""

    def fn(x):
        torch.as_strided(x[:, 1:], (2,), (1,), 11).fill_(0)  # storage positions 11 and 12: x's last and one more
        return x + 0

    fn(torch.zeros(4, 4)[:3])  # eager runs it: the storage goes on past x
    x = torch.zeros(4, 4)[:3]
    with pytest.raises(NotImplementedError, match=r"as_strided(.|\n)*test_as_strided.py"):
        fulmen.jit(fn, executors=["torch"])(x)


def test_as_strided_offset_into_an_input_that_starts_inside_its_storage_is_refused():
    """An explicit storage_offset is absolute in the input's storage; the caller's ``base[1:]`` starts at position 1,
    which the program's key does not hold. A write through such a view is refused naming the line (it reached the
    elements one further along); without an offset, or for reads, the view is eager's."""

    def write_at(x):
        torch.as_strided(x, (2,), (1,), 3).mul_(10)
        return x * 1

    def write_own(x):
        torch.as_strided(x, (2,), (1,)).mul_(10)
        return x * 1

    def read_at(x):
        return torch.as_strided(x, (2,), (1,), 3) * 2

    with pytest.raises(NotImplementedError, match=r"storage_offset(.|\n)*test_as_strided.py"):
        fulmen.jit(write_at, executors=["torch"])(torch.arange(12.0)[1:])
    for fn in (write_own, read_at):
        torch.testing.assert_close(
            fulmen.jit(fn, executors=["torch"])(torch.arange(12.0)[1:]), fn(torch.arange(12.0)[1:])
        )
