"""Data-dependent sizes and values under ``fulmen.jit`` (issue 44).

Ops whose result size depends on the data (nonzero, masked_select, boolean-mask indexing, unique, repeat_interleave
with tensor repeats) trace with an unbacked size (``u0``): one compilation serves every data pattern, forward and
backward, and the code after them stays in the trace. Each case runs three data patterns: no element selected,
every element selected, and some.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fulmen

PATTERNS = ("none", "all", "some")


def _data(shape, pattern: str, *, requires_grad: bool = False, seed: int = 0) -> torch.Tensor:
    """Values whose sign decides what the cases select: all negative, all positive, or mixed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g, dtype=torch.float64) + 0.1
    if pattern == "none":
        x = -x
    elif pattern == "some":
        x = x * torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    return x.requires_grad_(requires_grad)


def _check(fn, shape=(4, 5), *, grad: bool = True, executors=("torch",)):
    """fn under fulmen.jit vs eager on every pattern (values, then gradients of a weighted sum of the outputs),
    compiled once."""
    jfn = fulmen.jit(fn, executors=list(executors))
    for k, pattern in enumerate(PATTERNS):
        x = _data(shape, pattern, requires_grad=grad, seed=k)
        xe = x.detach().clone().requires_grad_(grad)
        got, want = jfn(x), fn(xe)
        got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype, (pattern, g.shape, w.shape)
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
        if grad:
            floats = [(g, w) for g, w in zip(got, want) if g.requires_grad]
            seed = torch.Generator().manual_seed(7)
            weights = [torch.rand(w.shape, generator=seed, dtype=w.dtype) for _, w in floats]
            sum(((g * c).sum() for (g, _), c in zip(floats, weights)), torch.zeros((), dtype=torch.float64)).backward()
            sum(((w * c).sum() for (_, w), c in zip(floats, weights)), torch.zeros((), dtype=torch.float64)).backward()
            want_grad = xe.grad if xe.grad is not None else torch.zeros_like(xe)
            got_grad = x.grad if x.grad is not None else torch.zeros_like(x)
            torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    assert fulmen.cache_misses(jfn) == 1, fulmen.compile_stats(jfn).recompile_reasons
    assert fulmen.cache_hits(jfn) == len(PATTERNS) - 1
    return jfn


def _masked_write_tensor(x):
    y = torch.zeros_like(x)
    m = x > 0
    y[m] = x[m] * 2  # values of the mask's data-dependent length
    return y + 1


def _masked_write_scalar(x):
    y = x.clone()
    y[y > 0] = 0.0
    return y * 3


def _columns(x):
    return x[:, x[0] > 0].tanh() * 2


def _rows_then_matmul(x):
    rows = x[x.sum(1) > 0]
    return (rows @ torch.linspace(-1, 1, 15, dtype=x.dtype).reshape(5, 3)).relu().sum(0)


def _unique(x):
    values, inverse, counts = torch.unique((x * 2).round().detach(), sorted=True, return_inverse=True,
                                           return_counts=True)
    return values * counts, inverse, x * values.sum()


def _repeat_interleave(x):
    repeats = (x > 0).long().sum(1)
    return torch.repeat_interleave(x, repeats, dim=0).sum(0) * 2


CASES = {
    "nonzero": (lambda x: torch.nonzero(x > 0) * 2 + 1, False),
    "argwhere": (lambda x: torch.argwhere(x > 0) + 1, False),
    "masked_select": (lambda x: torch.masked_select(x, x > 0).exp() * 2, True),
    "mask_read": (lambda x: x[x > 0].sin() + 1, True),
    "mask_read_sum": (lambda x: x[x > 0].sum() + x.sum(), True),
    "mask_read_twice": (lambda x: (m := x > 0) is not None and x[m] * x.exp()[m], True),
    "mask_write_tensor": (_masked_write_tensor, True),
    "mask_write_scalar": (_masked_write_scalar, True),
    "mask_columns": (_columns, True),
    "mask_rows_matmul": (_rows_then_matmul, True),
    "index_put_mask": (lambda x: (m := x > 0) is not None and x.index_put((m,), x[m] * 5), True),
    "unique": (_unique, True),
    "repeat_interleave": (_repeat_interleave, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_data_dependent_size_matches_eager_and_compiles_once(name):
    fn, grad = CASES[name]
    _check(fn, grad=grad)


def test_trace_shows_the_data_dependent_size():
    jfn = fulmen.jit(lambda x: x[x > 0] * 3, executors=["torch"])
    jfn(torch.randn(6))
    source = str(fulmen.last_traces(jfn)[-1])
    assert 'f32[u0]' in source  # the result's length is the symbol u0
    assert "nonzero" in str(fulmen.last_traces(jfn)[0])


def test_data_dependent_size_with_dynamic_input_sizes():
    def fn(x):
        return (x[x > 0] * 2).sum() + x.sum(0)

    jfn = fulmen.jit(fn, executors=["torch"])
    for n in (5, 7, 9, 7):
        for k, pattern in enumerate(PATTERNS):
            x = _data((n, 3), pattern, seed=n + k)
            torch.testing.assert_close(jfn(x), fn(x), rtol=1e-12, atol=1e-12)
    # the first size, then once more when dim 0 is marked dynamic; data patterns never recompile
    assert fulmen.cache_misses(jfn) == 2, fulmen.compile_stats(jfn).recompile_reasons


def test_same_mask_twice_gives_the_same_size():
    # y[m] = x[m] reads m twice: both sides must have the same data-dependent length, or tracing would have to ask
    # whether two unknown sizes are equal
    _check(_masked_write_tensor, shape=(3, 4, 2))


def test_inductor_regions_around_data_dependent_ops():
    def fn(x):
        h = (x * 2).sin() + 1  # fusable, static sizes
        picked = h[x > 0]  # data-dependent: stays on the torch executor
        return picked.exp().sum() + (h * h).sum()

    jfn = fulmen.jit(fn, compile="sync")
    for k, pattern in enumerate(PATTERNS):
        x = _data((8, 8), pattern, seed=k)
        torch.testing.assert_close(jfn(x), fn(x), rtol=1e-10, atol=1e-10)
    assert fulmen.cache_misses(jfn) == 1
    source = str(fulmen.last_traces(jfn)[-1])
    assert "inductor_fusion" in source  # the static part still fuses


def test_mask_shape_mismatch_is_eagers_index_error():
    with pytest.raises(IndexError, match="The shape of the mask"):
        fulmen.jit(lambda x, m: x[m], executors=["torch"])(torch.randn(3, 4), torch.tensor([True, False]))


def test_two_masks_computed_apart_are_a_clear_error():
    # the same values, but two mask tensors: nothing while tracing says their counts agree (eager learns it from
    # the data), so fulmen names the line rather than guess
    with pytest.raises(fulmen.DataDependentError, match="test_data_dependent.py") as info:
        fulmen.jit(lambda x: x.index_put((x > 0,), x[x > 0] * 5), executors=["torch"])(torch.randn(5))
    assert "Eq(u0, u1)" in str(info.value)


# ---------------------------------------------------------------------------------------------------------
# split points: values the traced Python reads (fulmen.frontend.split_points)


def _branchy(x):
    h = x * 2
    if h.sum() > 0:  # split point: bool
        h = h.sin()
    else:
        h = h.cos()
    n = int((x > 0).sum())  # split point: int
    return h * n + x


def _signs(sign: float, seed: int, *, requires_grad: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return ((torch.rand(5, generator=g, dtype=torch.float64) + 0.1) * sign).requires_grad_(requires_grad)


def test_branch_on_a_value_compiles_each_branch_once_and_matches_eager():
    jfn = fulmen.jit(_branchy, executors=["torch"])
    for k, sign in enumerate((1.0, 1.0, -1.0, -1.0, 1.0, -1.0)):
        x = _signs(sign, k)
        xe = x.detach().clone().requires_grad_()
        got, want = jfn(x), _branchy(xe)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        got.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(x.grad, xe.grad, rtol=1e-12, atol=1e-12)
    # two branches (the int read follows the bool: all positive, or all negative), each compiled once
    assert fulmen.cache_misses(jfn) == 2, fulmen.compile_stats(jfn).recompile_reasons
    assert fulmen.cache_hits(jfn) == 4
    assert "split point 0" in fulmen.compile_stats(jfn).last_recompile_reason


def test_split_points_are_in_the_trace_and_the_logs(caplog):
    jfn = fulmen.jit(_branchy, executors=["torch"])
    with caplog.at_level("INFO", logger="fulmen"):
        jfn(_signs(1.0, 0, requires_grad=False))
    source = str(fulmen.last_traces(jfn)[0])
    assert source.count("fulmen.value_guard(") == 2
    assert "'bool', True, 0" in source and "'int', 5, 1" in source
    assert "line" in source and "if h.sum() > 0:" in source  # the user's line
    assert any("split point 0" in r.getMessage() and "if h.sum() > 0:" in r.getMessage() for r in caplog.records)


def test_item_and_tolist_values_feed_python():
    def fn(x, lengths):
        parts = torch.split(x, lengths.tolist())  # split sizes from a tensor
        scale = lengths.max().item()
        return torch.stack([p.sum(0) for p in parts]) / scale

    jfn = fulmen.jit(fn, executors=["torch"])
    x = torch.randn(6, 3, dtype=torch.float64)
    for lengths in ([1, 2, 3], [1, 2, 3], [3, 2, 1]):
        t = torch.tensor(lengths)
        torch.testing.assert_close(jfn(x, t), fn(x, t), rtol=1e-12, atol=1e-12)
    assert fulmen.cache_misses(jfn) == 2


def test_a_while_loop_on_a_value_runs_its_iterations():
    def fn(x):
        while x.sum() < 10:
            x = x * 2
        return x

    jfn = fulmen.jit(fn, executors=["torch"])
    for v in (1.0, 1.0, 3.0):
        x = torch.full((2,), v, dtype=torch.float64)
        torch.testing.assert_close(jfn(x), fn(x))
    assert fulmen.cache_misses(jfn) == 2  # 1.0 doubles three times, 3.0 once


def test_writes_into_inputs_happen_once_when_the_branch_changes():
    def fn(x):
        x.add_(1)
        if x.sum() > 3:
            return x * 2
        return x * 3

    jfn = fulmen.jit(fn, executors=["torch"])
    for v in (1.0, -5.0, 1.0, -5.0):
        a, b = torch.full((3,), v), torch.full((3,), v)
        torch.testing.assert_close(jfn(a), fn(b))
        torch.testing.assert_close(a, b)  # the program that met the other value wrote nothing


def test_random_numbers_before_a_split_point_match_eager():
    def fn(x):
        noise = torch.rand(4, dtype=torch.float64)
        if noise.sum() > 2:
            return x + noise
        return x - noise

    jfn = fulmen.jit(fn, executors=["torch"])
    x = torch.zeros(4, dtype=torch.float64)
    for seed in (0, 1, 2, 3):
        torch.manual_seed(seed)
        got = jfn(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(got, fn(x), rtol=0, atol=0)


def test_branch_in_a_module():
    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3, dtype=torch.float64)

        def forward(self, x):
            h = self.fc(x)
            if h.mean() > 0:
                return h.relu()
            return h.tanh()

    torch.manual_seed(0)
    model = Gate()
    jm = fulmen.jit(model, executors=["torch"])
    for sign in (1.0, -1.0, 1.0, -1.0):
        x = torch.full((2, 3), 50.0 * sign, dtype=torch.float64) + torch.randn(2, 3, dtype=torch.float64)
        got, want = jm(x), model(x)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert fulmen.cache_misses(jm) == len({bool(model.fc(torch.full((2, 3), 50.0 * s, dtype=torch.float64)).mean() > 0)
                                           for s in (1.0, -1.0)})


def test_index_into_a_data_dependent_size_is_checked_when_the_program_runs():
    def fn(x):
        return x[x > 0][0] * 2  # eager raises IndexError when no element is positive

    jfn = fulmen.jit(fn, executors=["torch"])
    for k, pattern in enumerate(("some", "all")):
        x = _data((6,), pattern, seed=k)
        torch.testing.assert_close(jfn(x), fn(x))
    assert "check_sizes" in str(fulmen.last_traces(jfn)[-1])
    x = _data((6,), "none")
    with pytest.raises(IndexError, match="index 0 is out of bounds"):
        fn(x)
    with pytest.raises(IndexError, match="index 0 is out of bounds"):
        jfn(x)
    assert fulmen.cache_misses(jfn) == 1


def test_a_tensor_as_a_size_is_a_split_point():
    def fn(x, n):
        return torch.zeros(2, n, dtype=x.dtype) + x.sum()  # as LSTM does with a PackedSequence

    jfn = fulmen.jit(fn, executors=["torch"])
    x = torch.randn(3)
    for n in (2, 2, 4):
        torch.testing.assert_close(jfn(x, torch.tensor(n)), fn(x, torch.tensor(n)))
    assert fulmen.cache_misses(jfn) == 2


class _TopOneMoE(torch.nn.Module):
    """Top-1 routing, as benchmarks/bench_data_dependent.py: each expert reads its tokens and gates by mask."""

    def __init__(self, dim: int = 8, experts: int = 2):
        super().__init__()
        self.router = torch.nn.Linear(dim, experts, dtype=torch.float64)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(dim, dim, dtype=torch.float64) for _ in range(experts))

    def forward(self, x):
        gate, choice = self.router(x).softmax(-1).max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            out[mask] = expert(x[mask]) * gate[mask].unsqueeze(-1)
        return out.square().sum()


def test_two_reads_of_one_mask_with_the_default_executors():
    # each read of a mask is claimed whole by an executor, which hides the positions its decomposition computed
    # from the next read: each computes its own, and the ShapeEnv learns that their lengths are one size
    torch.manual_seed(0)
    model = _TopOneMoE()
    jm = fulmen.jit(model, compile="sync")
    for k in range(3):
        x = torch.randn(32, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
        model.zero_grad()
        jm(x).backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).backward()
        for g, w in zip(got, [p.grad for p in model.parameters()]):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert fulmen.cache_misses(jm) == 1


def test_ctc_loss_forward_and_gradients_compile_once():
    # Wav2Vec2's loss: the fake-tensor kernel refuses the alignment table's data-dependent length, but the loss's
    # shape does not depend on the data
    def fn(logits, targets, input_lengths, target_lengths):
        return F.ctc_loss(logits.log_softmax(-1), targets, input_lengths, target_lengths) * 2

    jfn = fulmen.jit(fn, executors=["torch"])
    for k in range(3):
        g = torch.Generator().manual_seed(k)
        logits = torch.randn(12, 2, 6, generator=g, dtype=torch.float64, requires_grad=True)
        targets = torch.randint(1, 6, (2, 4), generator=g)
        lengths = (torch.tensor([12, 10 - k]), torch.tensor([4, 3 - k]))
        le = logits.detach().clone().requires_grad_()
        got, want = jfn(logits, targets, *lengths), fn(le, targets, *lengths)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        got.backward()
        want.backward()
        torch.testing.assert_close(logits.grad, le.grad, rtol=1e-10, atol=1e-12)
    assert fulmen.cache_misses(jfn) == 1


def test_packed_sequence_lstm_forward_and_gradients_compile_once():
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 5, batch_first=True, dtype=torch.float64)

    def fn(x, lengths):
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, (h, c) = lstm(packed)
        out, out_lengths = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return out.tanh().sum(1) + h.sum(0) + c.sum(0), out_lengths

    jfn = fulmen.jit(fn, executors=["torch"])
    for k, lengths in enumerate(([6, 3, 4], [6, 2, 5], [5, 1, 6])):
        x = torch.randn(3, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(k), requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        lstm.zero_grad()
        got, got_lengths = jfn(x, torch.tensor(lengths))
        got.sum().backward()
        weight_grad = lstm.weight_hh_l0.grad.clone()
        lstm.zero_grad()
        want, want_lengths = fn(xe, torch.tensor(lengths))
        want.sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert torch.equal(got_lengths, want_lengths)
        torch.testing.assert_close(x.grad, xe.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(weight_grad, lstm.weight_hh_l0.grad, rtol=1e-10, atol=1e-12)
    assert fulmen.cache_misses(jfn) == 1, fulmen.compile_stats(jfn).recompile_reasons
