"""Programs eager runs that fulmen refused (false refusals): each now runs and matches eager's values, strides,
aliasing and gradients."""

from __future__ import annotations

import pytest
import torch

import fulmen


def _run(fn, make_args, jit: bool):
    """(outputs, arguments after the call, gradients of the leaves) of one call, eager or under fulmen.jit."""
    leaves, args = make_args()
    out = (fulmen.jit(fn, executors=["torch"]) if jit else fn)(*args)
    outs = out if isinstance(out, tuple) else (out,)
    differentiable = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    if differentiable:
        # weights that tell elements apart, so a gradient reaching the wrong element shows
        loss = sum(
            (o.abs() if o.is_complex() else o).mul(torch.arange(o.numel()).reshape(o.shape).sin()).sum()
            for o in differentiable
        )
        loss.backward()
    return outs, args, [leaf.grad for leaf in leaves]


def _same_as_eager(fn, make_args) -> None:
    want, want_args, want_grads = _run(fn, make_args, jit=False)
    got, got_args, got_grads = _run(fn, make_args, jit=True)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert g.stride() == w.stride() and g.requires_grad == w.requires_grad
    for g, w in zip(got_args, want_args):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    # which outputs and arguments share memory with which
    shares = [
        [a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for a in tensors for b in tensors]
        for tensors in ([*got, *got_args], [*want, *want_args])
    ]
    assert shares[0] == shares[1]


def _leaf(*shape, dtype=torch.float32):
    def make():
        x = torch.linspace(-2, 3, torch.Size(shape).numel(), dtype=dtype).reshape(shape).requires_grad_()
        return [x], [x]

    return make


# ---- 1. writes through inputs whose elements share memory (expand): traced as views of that memory ----


def _expanded(*shapes):
    def make():
        g = torch.Generator().manual_seed(0)
        return [], [torch.randn(shape[0], generator=g).expand(shape[1]) for shape in shapes]

    return make


def _fill_then_read(a):
    a.fill_(2.5)
    return a * 2, a


def _zero_then_softmax(a):
    a.zero_()
    return torch.log_softmax(a, -2)


def _index_assignment(a):
    a[1] = 5.0  # every row is the same memory: eager's result has 5 in every row
    return a.sum(), a + 0


def _fill_through_a_strided_view(b):
    v = b.view(-1)[::2].fill_(3)  # fuzz (wide, seed 446)
    return v + 1, b


def _zero_through_a_transposed_row(d):
    v = d.mT[0].zero_()  # fuzz (wide, seed 1364)
    return v.clone(), d.sum()


_EXPANDED_WRITES = {
    "fill_then_read": (_fill_then_read, _expanded(((1, 3), (4, 3)))),
    "zero_then_softmax": (_zero_then_softmax, _expanded(((1, 1), (3, 1)))),
    "index_assignment": (_index_assignment, _expanded(((1, 3), (4, 3)))),
    "fill_through_a_strided_view": (_fill_through_a_strided_view, _expanded(((1,), (4,)))),
    "zero_through_a_transposed_row": (_zero_through_a_transposed_row, _expanded(((2, 1), (2, 3)))),
}


@pytest.mark.parametrize("case", sorted(_EXPANDED_WRITES))
def test_a_write_through_an_expanded_input_reaches_its_memory(case):
    # the caller's expanded tensor could not take the new value (eager's copy_ refuses a destination whose elements
    # share memory), and a write modelled element by element would leave the other elements of that memory stale
    fn, make = _EXPANDED_WRITES[case]
    _same_as_eager(fn, make)
    jitted = fulmen.jit(fn, executors=["torch"])
    for _ in range(2):  # the cache hit writes the caller's memory too
        _, args = make()
        want_args = make()[1]  # expanded as the caller's (a clone would be a dense copy)
        fn(*want_args)
        jitted(*args)
        for got, want in zip(args, want_args):
            assert torch.equal(got, want)


def test_an_update_that_reads_what_it_writes_through_an_expanded_input_raises_eager_s_error():
    def program(a):
        a.add_(1)
        return a

    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        program(torch.randn(1, 3).expand(4, 3))
    with pytest.raises(RuntimeError, match="(?s)more than one element of the written-to tensor.*test_false_refusals"):
        fulmen.jit(program, executors=["torch"])(torch.randn(1, 3).expand(4, 3))


# ---- 2. opaque view-like ops written in place: their backward reads the base's geometry, not its values ----

_OPAQUE_VIEWS = {
    "atleast_3d": lambda y: torch.atleast_3d(y),
    "ravel": lambda y: torch.ravel(y),
    "hsplit": lambda y: torch.hsplit(y, 2)[0],
    "as_strided": lambda y: torch.as_strided(y, (2, 2), (1, 2)),
    "view_as_real": lambda y: torch.view_as_real(torch.complex(y, y * 0.5)),
}


@pytest.mark.parametrize("op", sorted(_OPAQUE_VIEWS))
def test_an_opaque_view_written_in_place_keeps_a_working_backward(op):
    # fulmen's check that a backward reads no value overwritten later took the view's own backward (PyTorch
    # recomputing the view from its base) for one that reads the base's values; eager's view saves no tensor
    def program(x):
        y = x * 2
        v = _OPAQUE_VIEWS[op](y)
        v.add_(1)
        return v, y.sin()

    _same_as_eager(program, _leaf(4, 4))


def test_ravel_of_a_transposed_tensor_is_a_copy_as_in_eager():
    # the fake run deciding whether an opaque op returns a view took every tensor as contiguous, so ravel of a
    # transposed value counted as a view of it, and a write into the copy changed the value (no grad needed)
    def program(x):
        y = x * 2
        v = torch.ravel(y.t())
        v.add_(1)
        return v, y

    _same_as_eager(program, lambda: ([], [torch.arange(9.0).reshape(3, 3)]))
    _same_as_eager(program, _leaf(3, 3))


def test_a_view_s_backward_still_refused_where_eager_refuses():
    # a value the backward of another op needs (sin saves its input) overwritten through an opaque view: eager fails
    def program(x):
        y = x * 2
        z = y.sin()
        torch.atleast_3d(y).add_(1)
        return z

    x = torch.randn(3, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        program(x).sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fulmen.jit(program, executors=["torch"])(x).sum().backward()


# ---- 3. tensor_split's pieces are separate views (eager's narrow), which autograd lets be written ----


@pytest.mark.parametrize(
    "split",
    [lambda a: torch.tensor_split(a, 1), lambda a: a.tensor_split([1, 3], dim=1), lambda a: torch.tensor_split(a, 3)],
    ids=["one", "indices", "three"],
)
def test_a_tensor_split_piece_written_in_place(split):
    def program(x):
        a = x * 2
        split(a)[0].mul_(3)
        return a

    _same_as_eager(program, _leaf(4, 4))


def test_a_split_piece_written_in_place_is_still_refused_as_in_eager():
    def program(x):
        a = x * 2
        torch.split(a, 2)[0].mul_(3)
        return a

    x = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="multiple views"):
        program(x)
    with pytest.raises(RuntimeError, match="multiple views"):
        fulmen.jit(program, executors=["torch"])(x)


# ---- 4. packed GRUs and RNNs: the packed data's row count is data-dependent, as for the LSTM ----


@pytest.mark.parametrize("kind", ["GRU", "RNN"])
def test_a_packed_bidirectional_two_layer_recurrent_net_matches_eager_and_compiles_once(kind):
    torch.manual_seed(0)
    net = getattr(torch.nn, kind)(4, 5, num_layers=2, bidirectional=True, batch_first=True, dtype=torch.float64)

    def fn(x, lengths):
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, h = net(packed)
        out, out_lengths = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return out.tanh().sum(1).sum(-1, keepdim=True) + h.sum(0), out_lengths

    jfn = fulmen.jit(fn, executors=["torch"])
    for k, lengths in enumerate(([6, 2, 4], [5, 6, 1])):
        x = torch.randn(3, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(k), requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        results = []
        for f, inp in ((jfn, x), (fn, xe)):
            net.zero_grad()
            out, out_lengths = f(inp, torch.tensor(lengths))
            out.mul(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
            results.append((out, out_lengths, net.weight_hh_l1_reverse.grad.clone(), net.weight_ih_l0.grad.clone()))
        (got, got_lengths, *got_grads), (want, want_lengths, *want_grads) = results
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert torch.equal(got_lengths, want_lengths)
        torch.testing.assert_close(x.grad, xe.grad, rtol=1e-10, atol=1e-12)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert fulmen.cache_misses(jfn) == 1, fulmen.compile_stats(jfn).recompile_reasons


# ---- 5. requires_grad_() of a tensor made inside: a leaf, as in eager (the program runs under PyTorch autograd) ----


def _new_leaf(x, w):
    leaf = torch.linspace(-1, 1, 3, dtype=x.dtype).requires_grad_()
    return leaf * x + w, leaf


def _detached_leaf(x, w):
    # fuzz (wide, seeds 24 and 96)
    y = (x * w).detach().requires_grad_()
    return y * 2, x * w, (y * y).sum()


def _leaf_under_no_grad_caller_part(x, w):
    leaf = torch.ones(3).mul(0.5).requires_grad_()
    with torch.enable_grad():
        out = (leaf * x).sin()
    return out, leaf.exp()


@pytest.mark.parametrize("program", [_new_leaf, _detached_leaf, _leaf_under_no_grad_caller_part])
def test_a_leaf_made_inside_returns_requiring_grad_and_collects_its_gradient(program):
    def make():
        x = torch.linspace(0.5, 2, 3).requires_grad_()
        w = torch.linspace(-2, 1, 3).requires_grad_()
        return [x, w], [x, w]

    jitted = fulmen.jit(program, executors=["torch"])
    for _ in range(2):  # the cache hit makes a new leaf, as each eager call does
        got, got_args, got_grads = _run(jitted, make, jit=False)
        want, want_args, want_grads = _run(program, make, jit=False)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
            assert (g.requires_grad, g.is_leaf) == (w.requires_grad, w.is_leaf)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        # the returned leaves' own gradients (the loss in _run reaches them through the other outputs too)
        for g, w in zip(got, want):
            if w.is_leaf and w.requires_grad:
                torch.testing.assert_close(g.grad, w.grad, rtol=1e-6, atol=1e-6)
    assert fulmen.cache_misses(jitted) == 1


def test_a_leaf_made_inside_under_default_executors_and_no_grad_caller():
    jitted = fulmen.jit(_new_leaf)
    x, w = torch.randn(3), torch.randn(3)
    with torch.no_grad():
        got, want = jitted(x, w), _new_leaf(x, w)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
        assert (g.requires_grad, g.is_leaf) == (e.requires_grad, e.is_leaf)


def test_a_leaf_made_inside_a_program_that_writes_an_input_is_refused_naming_the_line():
    def program(x, buf):
        leaf = torch.zeros(3).requires_grad_()
        buf.add_(leaf * x)  # an input written with a value that requires grad: the write-back is no autograd op
        return leaf * x

    with pytest.raises(
        NotImplementedError, match=r"(?s)requires_grad_\(\) on a tensor made inside.*test_false_refusals"
    ):
        fulmen.jit(program, executors=["torch"])(torch.randn(3), torch.zeros(3))


def test_an_index_assignment_of_a_value_to_its_own_memory_runs():
    # fuzz (wide, extended, seed 1566): v4[0] = v2 with v4 = v2[:, 0] and v2 of shape (1, 1) writes the one element
    # onto itself; eager drops the value's leading size-1 dims before its overlap check, so the overlap is full
    def program(x):
        v2 = x * 2
        v4 = v2[:, 0]
        v4[0] = v2
        return v2, v4

    _same_as_eager(program, lambda: ([], [torch.full((1, 1), 3.0)]))
