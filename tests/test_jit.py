"""``fulmen.jit`` as a user meets it: functions and modules, the cache and what makes it recompile, inspection.

Op coverage lives in the OpInfo tests; the programs here are small and use only elementwise ops and
``nn.Linear`` so that a failure points at the frontend rather than at an op rule.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import fulmen
from fulmen.frontend.jit import RECOMPILE_WARNING_THRESHOLD
from fulmen.testing import assert_close


def _counts(f) -> tuple[int, int]:
    return fulmen.cache_hits(f), fulmen.cache_misses(f)


# ---------------------------------------------------------------------------------------------------------------
# functions
# ---------------------------------------------------------------------------------------------------------------

def test_function_matches_eager_and_keeps_name():
    def scaled_sum(a, b):
        """Docstring kept."""
        return a + b * a

    f = fulmen.jit(scaled_sum)
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(f(a, b), a + b * a)
    assert f.__name__ == "scaled_sum"
    assert f.__doc__ == "Docstring kept."
    assert fulmen.jit(f) is f  # jitting twice is a no-op


def test_jit_rejects_non_callables_and_stats_of_plain_functions():
    with pytest.raises(TypeError, match="function or an nn.Module"):
        fulmen.jit(3)
    with pytest.raises(TypeError, match="not compiled by fulmen.jit"):
        fulmen.last_traces(lambda x: x)


def test_kwargs_and_nested_containers():
    def fn(pair, mapping, *, scale=1.0, bias=None):
        a, (b, c) = pair
        out = {"sum": (a + b) * scale, "parts": [c - mapping["x"], mapping["y"] * 2]}
        if bias is not None:
            out["sum"] = out["sum"] + bias
        return out, (a * c,)

    f = fulmen.jit(fn)
    a, b, c, x, y, bias = (torch.randn(3) for _ in range(6))
    args = ((a, (b, c)), {"x": x, "y": y})
    assert_close(f(*args, scale=2.0, bias=bias), fn(*args, scale=2.0, bias=bias))
    assert_close(f(*args, scale=2.0), fn(*args, scale=2.0))
    out, _ = f(*args, scale=2.0)
    assert isinstance(out, dict) and isinstance(out["parts"], list)


def test_none_and_python_number_outputs():
    def fn(x):
        return x + 1, None, x.shape[0] * 2, 0.5, "tag"

    f = fulmen.jit(fn)
    x = torch.randn(4, 2)
    out = f(x)
    torch.testing.assert_close(out[0], x + 1)
    assert out[1:] == (None, 8, 0.5, "tag")


def test_same_input_twice_and_outputs_that_are_inputs():
    f = fulmen.jit(lambda a, b: (a * b, a))
    x = torch.randn(3)
    prod, same = f(x, x)
    torch.testing.assert_close(prod, x * x)
    assert torch.equal(same, x)


def test_closure_tensors_are_captured_by_reference():
    w = torch.randn(3)

    def fn(x):
        return x * w

    f = fulmen.jit(fn)
    x = torch.randn(3)
    torch.testing.assert_close(f(x), x * w)
    w.add_(1.0)  # an in-place change of a captured tensor is seen: it is passed by reference on every call
    torch.testing.assert_close(f(x), x * w)
    assert _counts(f) == (1, 1)


def test_traces_are_printable_python():
    f = fulmen.jit(lambda a, b: a + b * a)
    f(torch.randn(2, 2), torch.randn(2, 2))
    traces = fulmen.last_traces(f)
    assert len(traces) >= 2
    first, last = str(traces[0]), str(traces[-1])
    assert "def computation(a, b):" in first
    assert 'cpu f32[2, 2]' in first
    assert "ltorch.mul" in first
    compile(last, "<final trace>", "exec")  # the execution trace is valid Python source
    prologue = fulmen.last_prologue_traces(f)
    assert prologue and "(2, 2)" in str(prologue[0])


def test_compile_stats_phase_times():
    f = fulmen.jit(lambda a: (a * 2).exp())
    f(torch.randn(5))
    stats = fulmen.compile_stats(f)
    for phase in ("trace", "claim", "codegen"):
        assert phase in stats.phase_times_ms, f"missing phase {phase}: {sorted(stats.phase_times_ms)}"
        assert stats.phase_times_ms[phase] >= 0.0
    assert stats.last_compile_time_ms >= stats.last_trace_time_ms > 0.0
    assert stats.calls == 1


# ---------------------------------------------------------------------------------------------------------------
# the cache: what recompiles and what does not
# ---------------------------------------------------------------------------------------------------------------

def test_same_metadata_hits_the_cache_and_uses_new_values():
    f = fulmen.jit(lambda a, b: a * b + 1)
    a1, b1, a2, b2 = (torch.randn(2, 3) for _ in range(4))
    f(a1, b1)
    torch.testing.assert_close(f(a2, b2), a2 * b2 + 1)
    torch.testing.assert_close(f(a1, b1), a1 * b1 + 1)
    assert _counts(f) == (2, 1)


@pytest.mark.parametrize("change", ["shape", "dtype", "rank", "non-contiguous-same-shape"])
def test_tensor_metadata_changes(change):
    f = fulmen.jit(lambda a: a * 2 - 1)
    x = torch.randn(3, 4)
    f(x)
    if change == "shape":
        y, expect_miss = torch.randn(5, 4), True
    elif change == "dtype":
        y, expect_miss = torch.randn(3, 4, dtype=torch.float64), True
    elif change == "rank":
        y, expect_miss = torch.randn(12), True
    else:  # traced code decides copy-or-view (contiguous(), reshape, view) by the layout: keyed apart
        y, expect_miss = torch.randn(4, 3).t(), True
    out = f(y)
    torch.testing.assert_close(out, y * 2 - 1)
    assert out.dtype == y.dtype
    assert _counts(f) == ((0, 2) if expect_miss else (1, 1))


def test_device_change_recompiles():
    # Only a CPU here; the meta device stands in for a second device (ops run on meta tensors).
    f = fulmen.jit(lambda a: a * 2)
    f(torch.randn(2))
    out = f(torch.randn(2, device="meta"))
    assert out.device.type == "meta"
    assert _counts(f) == (0, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_cuda_device_change_recompiles():
    f = fulmen.jit(lambda a: a * 2)
    f(torch.randn(2))
    x = torch.randn(2, device="cuda")
    torch.testing.assert_close(f(x), x * 2)
    assert _counts(f) == (0, 2)


def test_requires_grad_change_recompiles():
    f = fulmen.jit(lambda a: a * 3)
    x = torch.randn(3)
    with torch.no_grad():  # keeps this on the inference path: only the cache key is under test
        f(x)
        f(x.clone().requires_grad_(True))
        f(x.clone().requires_grad_(True))
    assert _counts(f) == (1, 2)


def test_requires_grad_input_gets_gradients():
    f = fulmen.jit(lambda a, b: a * b + a)
    a, b = torch.randn(3, requires_grad=True), torch.randn(3)
    out = f(a, b)
    out.backward(torch.ones(3))
    torch.testing.assert_close(a.grad, b + 1)


def test_non_tensor_argument_value_recompiles():
    f = fulmen.jit(lambda a, k, flag: a * k if flag else a + k)
    x = torch.randn(3)
    torch.testing.assert_close(f(x, 2, True), x * 2)
    torch.testing.assert_close(f(x, 3, True), x * 3)
    torch.testing.assert_close(f(x, 3, False), x + 3)
    torch.testing.assert_close(f(x, 2.0, True), x * 2)  # float 2.0 is not int 2: a new key
    torch.testing.assert_close(f(x, 3, True), x * 3)
    assert _counts(f) == (1, 4)


def test_grad_mode_change_recompiles():
    f = fulmen.jit(lambda a: a + 1)
    x = torch.randn(3)
    f(x)
    with torch.no_grad():
        f(x)
        f(x)
    f(x)
    assert _counts(f) == (2, 2)
    assert "grad mode" in fulmen.compile_stats(f).last_recompile_reason


def test_default_dtype_change_recompiles():
    # int tensor * Python float takes the default dtype, so the change must reach the output.
    f = fulmen.jit(lambda a: a * 2.5)
    x = torch.arange(4)
    assert f(x).dtype == torch.float32
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        out = f(x)
    finally:
        torch.set_default_dtype(previous)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, x * torch.tensor(2.5, dtype=torch.float64))
    assert _counts(f) == (0, 2)
    assert "default dtype" in fulmen.compile_stats(f).last_recompile_reason


def test_repeated_recompiles_log_a_warning(caplog):
    f = fulmen.jit(lambda a: a + 1, dynamic=False)  # exact sizes: each new size recompiles
    with caplog.at_level(logging.WARNING, logger="fulmen"):
        for n in range(1, RECOMPILE_WARNING_THRESHOLD + 1):
            f(torch.randn(n))
        assert not [r for r in caplog.records if r.name == "fulmen"], "warned before the threshold"
        f(torch.randn(RECOMPILE_WARNING_THRESHOLD + 1))
    warnings = [r for r in caplog.records if r.name == "fulmen" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert str(RECOMPILE_WARNING_THRESHOLD + 1) in message and "argument 0" in message
    assert fulmen.cache_misses(f) == RECOMPILE_WARNING_THRESHOLD + 1


# ---------------------------------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------------------------------

class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0]))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scratch", torch.ones(2), persistent=False)

    def forward(self, x):
        self.calls.add_(1)
        h = torch.tanh(self.fc1(x))
        out = self.fc2(h) * self.scale
        return out * 0.5 if self.training else out


def _net_pair():
    torch.manual_seed(0)
    model = _Net()
    return model, fulmen.jit(model)


def test_module_wrapper_shares_parameters_and_buffers():
    model, jm = _net_pair()
    assert isinstance(jm, nn.Module)
    assert [(n, id(p)) for n, p in jm.named_parameters()] == [(n, id(p)) for n, p in model.named_parameters()]
    assert [(n, id(b)) for n, b in jm.named_buffers()] == [(n, id(b)) for n, b in model.named_buffers()]
    assert list(jm.state_dict().keys()) == list(model.state_dict().keys())
    assert "scratch" not in jm.state_dict()  # non-persistent buffers stay out, as in the original
    for (name, a), (_, b) in zip(jm.state_dict(keep_vars=True).items(), model.state_dict(keep_vars=True).items()):
        assert a is b, name
    assert jm.fc1 is model.fc1
    text = repr(jm)
    assert "fulmen" in text and "Linear(in_features=4, out_features=8" in text


def test_module_forward_matches_eager_and_updates_buffers_in_place():
    model, jm = _net_pair()
    reference = _Net()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(5, 4)
    with torch.no_grad():
        out = jm(x)
        jm(x)
        expected = reference(x)
        reference(x)
    torch.testing.assert_close(out, expected)
    assert model.calls.item() == 2 == reference.calls.item()


def test_module_train_eval_propagate_and_recompile():
    model, jm = _net_pair()
    x = torch.randn(2, 4)
    with torch.no_grad():
        train_out = jm(x)
        assert jm.eval() is jm
        assert not model.training and not model.fc1.training and not jm.training
        eval_out = jm(x)
        jm.train()
        assert model.training and model.fc2.training and jm.training
        jm(x)
    torch.testing.assert_close(train_out, eval_out * 0.5)
    assert _counts(jm) == (1, 2)
    # Switching the original module (not the wrapper) is seen too: the key reads every submodule's flag.
    model.fc1.eval()
    with torch.no_grad():
        jm(x)
    assert _counts(jm) == (1, 3)


def test_module_load_state_dict_reaches_the_original():
    model, jm = _net_pair()
    other = _Net()
    x = torch.randn(3, 4)
    with torch.no_grad():
        jm(x)
        jm.load_state_dict(other.state_dict())
        torch.testing.assert_close(model.fc1.weight, other.fc1.weight)
        torch.testing.assert_close(jm(x), other(x))
    assert _counts(jm) == (1, 1)  # load_state_dict copies into the same tensors: no recompile


def test_parameter_updated_in_place_is_seen_without_recompiling():
    model, jm = _net_pair()
    x = torch.randn(3, 4)
    with torch.no_grad():
        jm(x)
        model.fc2.bias.add_(10.0)
        out = jm(x)
        expected = model(x)
    torch.testing.assert_close(out, expected)
    assert _counts(jm) == (1, 1)


def test_replacing_a_parameter_uses_the_new_one_without_recompiling():
    model, jm = _net_pair()
    x = torch.randn(3, 4)
    with torch.no_grad():
        jm(x)
        model.fc2.weight = nn.Parameter(torch.randn(3, 8))
        out = jm(x)
        expected = model(x)
    torch.testing.assert_close(out, expected)
    assert fulmen.cache_misses(jm) == 1  # same shape, dtype, device, requires_grad: the program reads the new one
    assert jm.fc2.weight is model.fc2.weight


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(6, 6, bias=False)
        self.decode = nn.Linear(6, 6, bias=False)
        self.decode.weight = self.encode.weight

    def forward(self, x):
        return self.decode(torch.relu(self.encode(x)))


def test_tied_weights_are_one_input():
    model = _Tied()
    jm = fulmen.jit(model)
    x = torch.randn(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(jm(x), model(x))
    trace = fulmen.last_traces(jm)[0]
    assert len(trace.args) == 2, f"expected the shared weight once plus x, got {[a.name for a in trace.args]}"
    assert [n for n, _ in jm.named_parameters()] == ["encode.weight"]


def test_module_trace_names_inputs_after_the_forward_signature():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

        def forward(self, tokens, offset):
            return tokens * self.gain + offset

    jm = fulmen.jit(Scale())
    with torch.no_grad():
        jm(torch.randn(4, 3), torch.randn(3))
    assert "def computation(gain, tokens, offset):" in str(fulmen.last_traces(jm)[0])


def _net_and_copy(outputs: int):
    """A small MLP (seeded) and an identical copy for eager PyTorch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, outputs))
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, outputs))
    reference.load_state_dict(model.state_dict())
    return model, reference


def test_module_gradients_match_eager():
    model, reference = _net_and_copy(outputs=2)
    jm = fulmen.jit(model)
    x = torch.randn(5, 4)
    jm(x).square().sum().backward()
    reference(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_optimizer_steps_match_eager_without_recompiling():
    model, reference = _net_and_copy(outputs=1)
    jm = fulmen.jit(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, target = torch.randn(6, 4), torch.randn(6, 1)
    for _ in range(3):
        for net, optimizer in ((jm, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            (net(x) - target).square().mean().backward()
            optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    assert _counts(jm) == (2, 1)


def test_wrapper_forwards_attributes_of_the_original():
    model, jm = _net_pair()
    model.custom_flag = "kept"
    assert jm.custom_flag == "kept"
    assert jm.original_module is model


def test_a_returned_namedtuple_holds_the_computed_tensors():
    from collections import namedtuple

    Pair = namedtuple("Pair", "double plus_one")

    def f(x):
        return {"pair": Pair(x * 2, x + 1), "n": 3}

    x = torch.randn(3)
    for compile_mode in ("off", "sync"):
        out = fulmen.jit(f, compile=compile_mode)(x)
        assert type(out["pair"]) is Pair and out["n"] == 3
        torch.testing.assert_close(out["pair"].double, x * 2)
        torch.testing.assert_close(out["pair"].plus_one, x + 1)


def test_numpy_scalars_act_as_python_numbers():
    np = pytest.importorskip("numpy")

    def f(a, i):
        return a * np.float64(2.5) + np.float32(0.5), i * np.int64(3)

    a, i = torch.randn(4), torch.arange(4)
    expected = f(a, i)
    actual = fulmen.jit(f)(a, i)
    for e, o in zip(expected, actual):
        assert o.dtype == e.dtype
        torch.testing.assert_close(o, e)


def test_a_random_op_without_a_rule_draws_on_every_call():
    """torch.randperm has no torch-language rule: it must run on every call (an opaque op), drawing from the
    global generator as eager does, not be drawn once while tracing and baked in as a constant."""
    def f(x):
        return x[torch.randperm(8)], torch.randperm(8)

    x = torch.arange(8.0)
    torch.manual_seed(3)
    expected = [f(x) for _ in range(3)]
    jf = fulmen.jit(f)
    torch.manual_seed(3)
    actual = [jf(x) for _ in range(3)]
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e)
    assert not torch.equal(actual[0][1], actual[1][1])


def test_is_leaf_follows_autograd_and_reading_grad_is_a_clear_error():
    def branch(a):
        b = a * 2
        return b * (2.0 if b.is_leaf else 3.0)

    for x in (torch.ones(2, requires_grad=True), torch.ones(2)):
        torch.testing.assert_close(fulmen.jit(branch)(x), branch(x))

    def reads_grad(p):
        return p * 0 + (p.grad if p.grad is not None else -1.0)

    p = torch.ones(3, requires_grad=True)
    (p * 5).sum().backward()
    with torch.no_grad(), pytest.raises(NotImplementedError, match="Tensor.grad of p "):
        fulmen.jit(reads_grad)(p)


def test_data_real_imag_and_as_tensor_of_a_traced_tensor():
    def f(x, z):
        return x.data * 2 + z.real * 3 + z.imag, torch.as_tensor(x, dtype=torch.float64) + 1

    x, z = torch.randn(3, requires_grad=True), torch.randn(3, dtype=torch.complex128)
    expected, actual = f(x, z), fulmen.jit(f)(x, z)
    for e, a in zip(expected, actual):
        assert a.dtype == e.dtype and a.requires_grad == e.requires_grad
        torch.testing.assert_close(a, e)
