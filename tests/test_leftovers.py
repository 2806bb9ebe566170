"""Soundness leftovers: sparse embedding gradients, process state read while tracing, a global tensor passed as
the argument, an in-place write after a matmul that saved its input, and layouts fulmen cannot know.

Every test compares a compiled call with eager PyTorch on the same inputs.
"""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fulmen

IDX = torch.tensor([[1, 2, 1], [0, 2, 3]])


# ---------------------------------------------------------------------------------------------------------
# sparse=True embeddings: eager's sparse COO weight gradient


def _grads(fn, weight: torch.Tensor, compiled) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's gradient after eager and after the compiled call (a second call: the cache hit)."""
    w = nn.Parameter(weight.clone())
    fn(IDX, w).backward()
    eager = w.grad
    for _ in range(2):
        w.grad = None
        compiled(IDX, w).backward()
    return eager, w.grad


def _assert_same_gradient(eager: torch.Tensor, got: torch.Tensor) -> None:
    assert got.layout == eager.layout
    if eager.is_sparse:
        # eager's own COO tensor: the same indices in the same order, uncoalesced as eager's
        assert got.is_coalesced() == eager.is_coalesced()
        assert torch.equal(got._indices(), eager._indices())
        torch.testing.assert_close(got._values(), eager._values(), rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-6)


def _lookup(i, w):
    return F.embedding(i, w, sparse=True).exp().sum()


def _two_lookups(i, w):  # two sparse gradients: their sum is sparse, as eager's autograd adds them
    return (F.embedding(i, w, sparse=True) * F.embedding(i + 1, w, sparse=True, padding_idx=2)).exp().sum()


def _tied(i, w):  # a sparse and a dense gradient: dense, as in eager (a control: already so before sparse gradients)
    h = F.embedding(i, w, sparse=True)
    return ((h @ w.t()).sin().sum() * (w * 2).sum()).cos()


def _bag(i, w):  # a control with unfused regions (already sparse before); the slow test below compiles the regions
    return F.embedding_bag(i, w, mode="sum", sparse=True).exp().sum()


def _bag_weighted(i, w):  # the per-sample weights' gradient is dense, and flows on into view's backward
    return F.embedding_bag(i, w, mode="sum", sparse=True, per_sample_weights=(w[:2, :3] * 2).reshape(2, 3)).exp().sum()


def _gather(i, w):
    return torch.gather(w, 0, i % 5, sparse_grad=True).exp().sum()


@pytest.mark.parametrize(
    "fn", [_lookup, _two_lookups, _tied, _bag, _bag_weighted, _gather], ids=lambda f: f.__name__.strip("_")
)
@pytest.mark.parametrize("executors", [["torch"], None], ids=["torch", "default"])
def test_sparse_embedding_gradients_are_eagers(fn, executors):
    eager, got = _grads(fn, torch.randn(5, 3, dtype=torch.float64), fulmen.jit(fn, executors=executors))
    _assert_same_gradient(eager, got)


def test_sparse_embedding_module_gradient_through_jit_and_backend():
    torch.manual_seed(0)
    m = nn.Embedding(6, 4, sparse=True)
    m(IDX).pow(2).sum().backward()
    eager = m.weight.grad
    for compiled in (fulmen.jit(m, executors=["torch"]), torch.compile(m, backend="fulmen")):
        for _ in range(2):
            m.weight.grad = None
            compiled(IDX).pow(2).sum().backward()
        _assert_same_gradient(eager, m.weight.grad)
    # SparseAdam takes only sparse gradients
    torch.optim.SparseAdam(m.parameters(), lr=0.1).step()


def test_no_fused_region_reads_a_sparse_gradient():
    jitted = fulmen.jit(_tied)
    w = nn.Parameter(torch.randn(5, 3))
    jitted(IDX, w).backward()
    text = str(fulmen.last_backward_traces(jitted)[-1])
    sparse = [
        line.split(" = ")[0].strip()
        for line in text.splitlines()
        if "embedding_sparse_backward(" in line and not line.strip().startswith("#")
    ]
    assert sparse
    for line in text.splitlines():
        if "fusion" in line and not line.strip().startswith("#"):
            assert not any(f"{name}," in line or f"{name})" in line for name in sparse), line


def test_sparse_gradient_into_another_backward_is_refused_naming_the_line():
    def scaled(i, w):
        return F.embedding(i, w * 2, sparse=True).sum()

    with pytest.raises(NotImplementedError, match=r"sparse=True(.|\n)*test_leftovers.py"):
        fulmen.jit(scaled, executors=["torch"])(IDX, nn.Parameter(torch.randn(5, 3)))

    def bag_of_scaled(i, w):
        return F.embedding_bag(i, w * 2, mode="sum", sparse=True).sum()

    with pytest.raises(NotImplementedError, match="sparse gradient"):
        fulmen.jit(bag_of_scaled, executors=["torch"])(IDX, nn.Parameter(torch.randn(5, 3))).backward()


def test_sparse_embedding_without_gradient_is_traced_as_before():
    w = torch.randn(5, 3)
    with torch.no_grad():
        expected = F.embedding(IDX, w, sparse=True)
    torch.testing.assert_close(
        fulmen.jit(lambda i, w: F.embedding(i, w, sparse=True), executors=["torch"])(IDX, w), expected, rtol=0, atol=0
    )


# ---------------------------------------------------------------------------------------------------------
# process state read while tracing: thread counts, seeds, the environment


def _threads(x):
    return x * 2 if torch.get_num_threads() > 1 else x * 3


def _seed(x):
    return x + torch.initial_seed()


def _environ(x):
    return x * 2 if os.environ.get("FULMEN_TEST_LEFTOVER_FLAG") == "1" else x * 3


def _getenv(x):
    return x * 2 if os.getenv("FULMEN_TEST_LEFTOVER_FLAG", "0") == "1" else x * 3


def _distributed(x):
    dist = torch.distributed
    return x * dist.get_world_size() if dist.is_initialized() else x * 7


def _join_group():
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, store=torch.distributed.HashStore())


def _leave_group():
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _set_env(value):
    if value is None:
        os.environ.pop("FULMEN_TEST_LEFTOVER_FLAG", None)
    else:
        os.environ["FULMEN_TEST_LEFTOVER_FLAG"] = value


_THREADS = torch.get_num_threads()


@pytest.mark.parametrize(
    "fn, before, after",
    [
        (_threads, lambda: torch.set_num_threads(2), lambda: torch.set_num_threads(1)),
        (_seed, lambda: torch.manual_seed(7), lambda: torch.manual_seed(123)),
        (_environ, lambda: _set_env(None), lambda: _set_env("1")),
        (_getenv, lambda: _set_env("0"), lambda: _set_env("1")),
        (_distributed, _leave_group, _join_group),
    ],
    ids=["get_num_threads", "initial_seed", "os.environ", "os.getenv", "distributed"],
)
def test_process_state_read_while_tracing_is_checked(fn, before, after):
    x = torch.ones(2)
    jitted = fulmen.jit(fn, executors=["torch"])
    try:
        before()
        torch.testing.assert_close(jitted(x), fn(x), rtol=0, atol=0)
        after()
        torch.testing.assert_close(jitted(x), fn(x), rtol=0, atol=0)
        before()
        torch.testing.assert_close(jitted(x), fn(x), rtol=0, atol=0)
    finally:
        torch.set_num_threads(_THREADS)
        _set_env(None)
        _leave_group()
    assert fulmen.compile_stats(jitted).cache_misses == 2  # one program per state, each used again


def test_environment_change_names_the_variable():
    jitted = fulmen.jit(_environ, executors=["torch"])
    try:
        _set_env(None)
        jitted(torch.ones(2))
        _set_env("1")
        jitted(torch.ones(2))
    finally:
        _set_env(None)
    assert any("FULMEN_TEST_LEFTOVER_FLAG unset -> '1'" in r for r in fulmen.compile_stats(jitted).recompile_reasons)


# ---------------------------------------------------------------------------------------------------------
# a global or closure tensor also passed as the argument: one object in eager


W_GLOBAL = torch.ones(3)


def _is_global(x):
    return x * 2 if x is W_GLOBAL else x * 3


def _make_closure():
    c = torch.ones(3)

    def is_closure(x):
        return x + c if x is c else x - c

    return is_closure, c


class _ReadsGlobal(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("mask", torch.ones(3))
        self.plain = torch.full((3,), 2.0)  # a tensor attribute: read like a global

    def forward(self, x):
        scale = 2.0 if x is W_GLOBAL else 3.0
        scale += 10.0 if x is self.plain else 0.0
        return self.lin(x) * scale + (x is self.mask)


def test_global_or_closure_tensor_passed_as_the_argument_is_that_tensor():
    closure, c = _make_closure()
    for fn, same in ((_is_global, W_GLOBAL), (closure, c)):
        jitted = fulmen.jit(fn, executors=["torch"])
        for x in (same, torch.ones(3), same):  # traced with it, then another tensor (compiled), then it again
            torch.testing.assert_close(jitted(x), fn(x), rtol=0, atol=0)
    m = _ReadsGlobal()
    jitted = fulmen.jit(m, executors=["torch"])
    with torch.no_grad():
        for x in (W_GLOBAL, torch.ones(3), m.plain, m.mask, torch.ones(3)):
            torch.testing.assert_close(jitted(x), m(x), rtol=0, atol=0)
    assert fulmen.compile_stats(jitted).cache_hits >= 1  # other tensors still run the compiled program


# ---------------------------------------------------------------------------------------------------------
# fuzz seed 3826 (extended): an in-place write into a matmul operand whose value eager's backward never reads


def _write_after_matmul(c, d, left):
    v6 = c * 1.5  # laid out as c
    v7 = (d @ v6.mT) if left else (v6 @ d)
    v9 = v6.narrow(-1, 0, 1).mul_(-1)
    return v6, v7, v9


def _run_write_after_matmul(c_layout: str, d_shape: tuple, left: bool, compiled: bool):
    g = torch.Generator().manual_seed(3826)
    c = torch.randn(3, 4, 5, dtype=torch.float64, generator=g)
    c = (c.transpose(-1, -2) if c_layout == "transposed" else c.reshape(3, 5, 4)).requires_grad_()
    d = torch.randn(d_shape, dtype=torch.float64, generator=g).requires_grad_()
    fn = fulmen.jit(_write_after_matmul, executors=["torch"]) if compiled else _write_after_matmul
    try:
        outs = fn(c, d, left)
        sum(o.sum() * (i + 1) for i, o in enumerate(outs)).backward()
    except RuntimeError as e:
        return "modified by an inplace operation" in str(e)
    return [o.detach() for o in outs] + [c.grad, d.grad]


@pytest.mark.parametrize(
    "c_layout, d_shape, left",
    [
        ("transposed", (4,), False),
        ("transposed", (4, 2), False),
        ("transposed", (2, 4), True),
        ("contiguous", (4,), False),
    ],
    ids=["3d@1d-copied", "3d@2d-copied", "2d@3d-copied", "3d@1d-viewed"],
)
def test_write_into_a_matmul_operand_eager_saved_a_copy_of(c_layout, d_shape, left):
    # eager folds the 3-d operand with reshape: a copy for a transposed batch (its backward works after the
    # write), a view for a contiguous one (its backward raises eager's error, and so must fulmen's). The 3-d operands
    # on the left were refused before the fix; 2d@3d and the viewed case were already eager's and guard the exemption
    want = _run_write_after_matmul(c_layout, d_shape, left, compiled=False)
    got = _run_write_after_matmul(c_layout, d_shape, left, compiled=True)
    if isinstance(want, bool):
        assert want and got is True
    else:
        assert not isinstance(got, bool), "fulmen refused what eager runs"
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# the layout of a CPU convolution of a channels_last input: as the backend PyTorch picks for the call


def _conv_layout(x, w):
    y = F.conv3d(x, w)
    return y * 1, y.is_contiguous(), y.stride()


def test_conv_of_channels_last_input_is_laid_out_as_the_backend_picked():
    # a 1x1x1 filter: ATen's CPU convolution takes oneDNN (a channels_last_3d result) with more than one thread and
    # its own kernel (a contiguous one) with one, or with oneDNN switched off
    x = torch.randn(2, 3, 4, 4, 4).contiguous(memory_format=torch.channels_last_3d)
    w = torch.randn(2, 3, 1, 1, 1)
    jitted = fulmen.jit(_conv_layout, executors=["torch"])
    enabled = torch.backends.mkldnn.enabled
    try:
        for threads, mkldnn in ((2, True), (1, True), (2, False), (2, True)):
            torch.set_num_threads(threads)
            torch.backends.mkldnn.enabled = mkldnn
            want, got = _conv_layout(x, w), jitted(x, w)
            assert got[1:] == want[1:], (threads, mkldnn)
            torch.testing.assert_close(got[0], want[0])
    finally:
        torch.set_num_threads(_THREADS)
        torch.backends.mkldnn.enabled = enabled


@pytest.mark.slow
def test_sparse_gradients_with_inductor_regions_compiled():
    # the fused regions compiled by Inductor: a region reading a sparse gradient failed ("Cannot access data pointer
    # of Tensor that doesn't have storage")
    for fn in (_tied, _two_lookups, _bag_weighted):
        eager, got = _grads(fn, torch.randn(5, 3, dtype=torch.float64), fulmen.jit(fn, compile="sync"))
        _assert_same_gradient(eager, got)
