"""Ambient state changed between calls, and less common tensor kinds: a jitted function called several times, with
the state changed between calls, must match eager PyTorch on every call, or refuse with an error that says what to
change.

Every test here reproduces a silently wrong result (or an unclear failure) found by running such a program under
``fulmen.jit``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fulmen


def _sin_times_input(x):
    return (x.sin() * x).sum()


class _SinTimesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x):
        y = self.linear(x)
        return (y.sin() * y).sum()


def _pack_to_half(log: list):
    """A compressing hook, as activation-compression code writes one: gradients depend on what is saved."""

    def pack(t):
        log.append(t.shape)
        return t.to(torch.float16)

    return pack, lambda t: t.to(torch.float32)


def test_saved_tensors_hooks_entered_after_compiled_calls_see_what_eager_saves():
    """The first calls run compiled; a later call under a compressing ``saved_tensors_hooks`` must pack the tensors
    eager's operations save (and so get eager's gradient), not the compiled program's one saved tensor."""
    jitted = fulmen.jit(_sin_times_input, executors=["torch"])
    x = torch.randn(8, requires_grad=True)
    for _ in range(2):
        jitted(x).backward()
    results = []
    for fn in (_sin_times_input, jitted, jitted):
        log: list = []
        x.grad = None
        with torch.autograd.graph.saved_tensors_hooks(*_pack_to_half(log)):
            fn(x).backward()
        results.append((len(log), x.grad.clone()))
    for packed, grad in results[1:]:
        assert packed == results[0][0]
        torch.testing.assert_close(grad, results[0][1], rtol=0, atol=0)


def test_saved_tensors_hooks_around_a_jitted_module_after_compiled_calls():
    torch.manual_seed(0)
    model = _SinTimesInput()
    jitted = fulmen.jit(model, executors=["torch"])
    x = torch.randn(4, 3)
    for _ in range(2):
        jitted(x).backward()
    results = []
    for fn in (model, jitted):
        log: list = []
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(*_pack_to_half(log)):
            fn(x).backward()
        results.append((len(log), model.linear.weight.grad.clone()))
    assert results[1][0] == results[0][0]
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=0)
    model.zero_grad(set_to_none=True)
    jitted(x).backward()  # outside the hooks again: compiled, with the same gradient up to rounding
    assert fulmen.cache_hits(jitted) >= 2


def _sparse_aware(s, d):
    scale = 2.0 if s.layout is not torch.strided else 1.0  # library code branches on the layout
    return d + s.to_dense() * scale


@pytest.mark.parametrize("layout", ["coo", "csr", "csc"])
def test_sparse_argument_is_refused_naming_it(layout):
    """A sparse COO argument was traced as a dense tensor, so ``s.layout`` read strided (a silently wrong result);
    CSR and CSC arguments failed inside the cache key with PyTorch's own error."""
    dense = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    sparse = {"coo": dense.to_sparse, "csr": dense.to_sparse_csr, "csc": dense.to_sparse_csc}[layout]()
    torch.testing.assert_close(_sparse_aware(sparse, dense), dense * 3)
    jitted = fulmen.jit(_sparse_aware, executors=["torch"])
    with pytest.raises(NotImplementedError, match="argument s is a sparse tensor.*to_dense"):
        jitted(sparse, dense)
    torch.testing.assert_close(jitted(dense, dense), dense * 2)  # dense arguments still compile


def test_sparse_tensor_made_inside_is_refused_naming_the_line():
    """``x.to_sparse()`` inside was traced as a dense tensor: ``(s + s).is_sparse`` read False where eager's is
    True."""

    def f(x):
        s = x.to_sparse()
        return x * (s + s).is_sparse

    x = torch.tensor([0.0, 1.0, 2.0])
    assert torch.equal(f(x), x)
    with pytest.raises(NotImplementedError, match=r"(?s)to_sparse returns a sparse_coo tensor.*test_wild_ambient.py"):
        fulmen.jit(f, executors=["torch"])(x)


def _batched_sin_exp(x):
    return torch.func.vmap(lambda row: row.sin() * row.exp())(x)


def test_vmap_inside_a_jitted_function_is_refused_naming_the_line():
    """``torch.func.vmap`` inside: its batched tensors wrapped the proxies and the trace failed with an internal
    error deep in functorch; now a clear refusal that names the line and the way out."""
    x = torch.randn(3, 4)
    jitted = fulmen.jit(_batched_sin_exp, executors=["torch"])
    with pytest.raises(NotImplementedError, match="torch.func transform.*\n.*test_wild_ambient.py.*\nApply the"):
        jitted(x)
    # the way out the message gives: the transform outside the compiled function
    torch.testing.assert_close(
        torch.func.vmap(fulmen.jit(lambda r: r.sin() * r.exp(), executors=["torch"]))(x), x.sin() * x.exp()
    )


class _SinMethodAsCos(torch.overrides.TorchFunctionMode):
    """A rewriting mode keyed on the method users call (``x.sin()``), as patching and logging modes are."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.sin:
            return torch.cos(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class _SinAsSeven(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return torch.full_like(out, 7.0) if func is torch.ops.aten.sin.default else out


def _sin_plus_one(x):
    return (x.sin() + 1) * 2


def test_torch_function_mode_around_compiled_calls_sees_what_eager_calls():
    """The compiled program calls ``torch.sin``, not the ``Tensor.sin`` the user wrote, so a mode keyed on the
    method never ran; such calls now run eagerly, under the mode, and compiled again once it is left."""
    x = torch.randn(5)
    jitted = fulmen.jit(_sin_plus_one, executors=["torch"])
    for _ in range(2):
        jitted(x)
    for _ in range(2):
        with _SinMethodAsCos():
            expected = _sin_plus_one(x)
            torch.testing.assert_close(jitted(x), expected, rtol=0, atol=0)
        torch.testing.assert_close(expected, (x.cos() + 1) * 2)
    hits = fulmen.cache_hits(jitted)
    torch.testing.assert_close(jitted(x), _sin_plus_one(x))
    assert fulmen.cache_hits(jitted) == hits + 1


def test_a_with_device_block_still_runs_compiled():
    """``with torch.device(...)`` is a function mode too, keyed as the default device: it does not count as the
    user's mode."""
    x = torch.randn(5)
    jitted = fulmen.jit(_sin_plus_one, executors=["torch"])
    with torch.device("cpu"):
        for _ in range(3):
            torch.testing.assert_close(jitted(x), _sin_plus_one(x))
    assert fulmen.cache_hits(jitted) == 2


@pytest.mark.slow
def test_dispatch_mode_around_a_fused_program_sees_every_operation():
    """Fused kernels never reach a ``TorchDispatchMode`` (a flop counter, a numerics checker): with fusion, the mode
    saw no ``sin`` at all, first call or later."""
    x = torch.randn(5)
    jitted = fulmen.jit(_sin_plus_one, compile="sync")
    jitted(x)
    with _SinAsSeven():
        expected = _sin_plus_one(x)
        torch.testing.assert_close(jitted(x), expected, rtol=0, atol=0)
        torch.testing.assert_close(fulmen.jit(_sin_plus_one, compile="sync")(x), expected, rtol=0, atol=0)
    torch.testing.assert_close(expected, torch.full_like(x, 16.0))


def _scale_if_deterministic(x):
    return x * (2.0 if torch.are_deterministic_algorithms_enabled() else 3.0)


def _scale_by_precision(x):
    return x * (2.0 if torch.get_float32_matmul_precision() == "highest" else 3.0)


def _scale_if_cudnn_deterministic(x):
    return x * (2.0 if torch.backends.cudnn.deterministic else 3.0)


def _scale_if_fastpath(x):
    return x * (2.0 if torch.backends.mha.get_fastpath_enabled() else 3.0)


def _set_cudnn_deterministic(on: bool) -> None:
    torch.backends.cudnn.deterministic = on


_FLAG_CASES = {
    "deterministic": (
        _scale_if_deterministic,
        torch.use_deterministic_algorithms,
        (False, True),
        "torch.are_deterministic_algorithms_enabled()",
    ),
    "matmul_precision": (
        _scale_by_precision,
        torch.set_float32_matmul_precision,
        ("highest", "high"),
        "torch.get_float32_matmul_precision()",
    ),
    "cudnn_deterministic": (
        _scale_if_cudnn_deterministic,
        _set_cudnn_deterministic,
        (False, True),
        "torch.backends.cudnn.deterministic",
    ),
    "mha_fastpath": (
        _scale_if_fastpath,
        torch.backends.mha.set_fastpath_enabled,
        (True, False),
        "torch.backends.mha.get_fastpath_enabled()",
    ),
}


@pytest.mark.parametrize("case", sorted(_FLAG_CASES))
def test_a_torch_flag_read_in_python_is_guarded(case):
    """A branch on a process-wide torch flag was baked in at the first call: after the flag changed, the program
    kept the old branch. Now the flag is checked with the globals, and a change recompiles, naming it."""
    fn, set_flag, (first, second), where = _FLAG_CASES[case]
    jitted = fulmen.jit(fn, executors=["torch"])
    x = torch.ones(3)
    try:
        for value in (first, second, first, second):
            set_flag(value)
            torch.testing.assert_close(jitted(x), fn(x), rtol=0, atol=0)
    finally:
        set_flag(first)
    assert where in fulmen.compile_stats(jitted).last_recompile_reason
    assert fulmen.cache_misses(jitted) == 2  # each value compiled once, then reused


class _NegatedSum(torch.Tensor):
    """A ``__torch_function__`` subclass keyed on the method users call, as logging and unit-carrying tensors are."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return -out if func is torch.Tensor.sum else out


def _sum_plus_one(x):
    return x.sum() + 1


def test_a_torch_function_subclass_after_a_plain_tensor_is_refused():
    """The subclass passed the prologue's checks as a tensor of the same shape: the program compiled for a plain
    tensor ran, calling ``torch.sum`` where eager runs the subclass's ``Tensor.sum``."""
    x = torch.randn(4)
    jitted = fulmen.jit(_sum_plus_one, executors=["torch"])
    for _ in range(2):
        jitted(x)
    sub = x.as_subclass(_NegatedSum)
    torch.testing.assert_close(_sum_plus_one(sub).as_subclass(torch.Tensor), 1 - x.sum())
    with pytest.raises(NotImplementedError, match="argument x is a _NegatedSum .*subclass.*as_subclass"):
        jitted(sub)
    with pytest.raises(NotImplementedError, match="argument xs\\[0\\] is a _NegatedSum"):
        fulmen.jit(lambda xs: _sum_plus_one(xs[0]), executors=["torch"])([sub])
    torch.testing.assert_close(jitted(x), x.sum() + 1)  # plain tensors still run compiled


class _Offset(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("offset", torch.ones(4))

    def forward(self, x):
        return x + self.offset.sum()


def test_a_module_buffer_replaced_by_a_subclass_is_refused():
    model = _Offset()
    jitted = fulmen.jit(model, executors=["torch"])
    x = torch.randn(4)
    for _ in range(2):
        jitted(x)
    model.offset = torch.ones(4).as_subclass(_NegatedSum)
    torch.testing.assert_close(model(x).as_subclass(torch.Tensor), x - 4)
    with pytest.raises(NotImplementedError, match="_NegatedSum"):
        jitted(x)


class _CenterAndTrack(torch.autograd.Function):
    """Centers its input and updates a running mean passed in, as custom normalization layers do."""

    @staticmethod
    def forward(ctx, x, running_mean):
        mean = x.mean(0)
        running_mean.mul_(0.9).add_(0.1 * mean)
        return x - mean

    @staticmethod
    def backward(ctx, grad):
        return grad - grad.mean(0), None


class _AddOneInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.add_(1)

    @staticmethod
    def backward(ctx, grad):
        return grad * 5


def _centered_energy(x, running_mean):
    return (_CenterAndTrack.apply(x, running_mean) ** 2).sum()


def _bumped(x):
    return _AddOneInPlace.apply(x * 2).sum()


def test_autograd_function_writing_an_argument_updates_it_once_per_call():
    """The backward of a user Function runs its forward again (for PyTorch's autograd to differentiate): that
    second run updated the caller's running mean again on every compiled call."""
    torch.manual_seed(0)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    eager_mean, jitted_mean = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    jitted = fulmen.jit(_centered_energy, executors=["torch"])
    for _ in range(3):  # the first call runs on PyTorch's autograd (warm start), the later ones compiled
        expected = torch.autograd.grad(_centered_energy(x, eager_mean), x)[0]
        got = torch.autograd.grad(jitted(x, jitted_mean), x)[0]
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(jitted_mean, eager_mean)
    assert fulmen.cache_hits(jitted) >= 1


def test_autograd_function_marking_its_input_dirty_differentiates_on_compiled_calls():
    """A ``mark_dirty`` forward run again in the backward wrote to a leaf and raised eager's "leaf Variable ...
    in-place" error once the program was compiled."""
    x = torch.randn(4, requires_grad=True)
    jitted = fulmen.jit(_bumped, executors=["torch"])
    for _ in range(3):
        torch.testing.assert_close(torch.autograd.grad(jitted(x), x)[0], torch.full((4,), 10.0))
    torch.testing.assert_close(torch.autograd.grad(_bumped(x), x)[0], torch.full((4,), 10.0))
