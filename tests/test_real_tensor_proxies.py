"""A traced tensor is a real ``torch.Tensor``: library code that checks types takes eager's branch under fulmen.jit.

Each test compares the jitted function with the same function run eagerly; the errors a traced tensor must still
raise (its value asked for, a kernel reached) are checked by message.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import fulmen
from fulmen.core.proxies import DataDependentError, TensorProxy


def _jit(fn):
    return fulmen.jit(fn, executors=["torch"])


def test_isinstance_tensor_and_is_tensor_take_eagers_branch():
    def f(x):
        a = x * 2 if isinstance(x, torch.Tensor) else x * 3
        b = a + 1 if torch.is_tensor(x) else a - 1
        return b

    x = torch.randn(3)
    torch.testing.assert_close(_jit(f)(x), f(x))


def test_proxy_is_a_tensor_subclass():
    seen = []

    def f(x):
        seen.append((type(x), isinstance(x, torch.Tensor), isinstance(x, nn.Parameter)))
        return x + 1

    _jit(f)(torch.ones(2))
    assert seen == [(TensorProxy, True, False)]


class _BranchesOnParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.register_buffer("b", torch.ones(1))

    def forward(self, x):
        total = x
        for t in (self.w, self.b, x):
            total = total + (t * 10 if isinstance(t, nn.Parameter) else t)
        return total


def test_isinstance_parameter_is_true_for_parameters_only():
    m = _BranchesOnParameter()
    x = torch.zeros(1)
    out = fulmen.jit(m, executors=["torch"])(x)
    torch.testing.assert_close(out, m(x))
    assert out.item() == 11.0


def test_parameter_passed_as_an_argument_is_a_parameter():
    def f(p, x):
        return x * (2 if isinstance(p, nn.Parameter) else 3) + p

    p, x = nn.Parameter(torch.ones(2)), torch.ones(2)
    torch.testing.assert_close(_jit(f)(p, x), f(p, x))
    torch.testing.assert_close(_jit(f)(torch.ones(2), x), f(torch.ones(2), x))


def test_functional_call_inside_a_jitted_function():
    lin = nn.Linear(3, 2)

    def f(x, w):
        return torch.func.functional_call(lin, {"weight": w, "bias": torch.zeros(2)}, (x,))

    x, w = torch.randn(4, 3), torch.randn(2, 3)
    torch.testing.assert_close(_jit(f)(x, w), f(x, w))


def test_torch_func_grad_and_vmap_of_a_jitted_function(caplog):
    def f(x):
        return (x.sin() * x).sum()

    def g(x):
        return x.sin() * 2 + x

    x = torch.randn(4, 3, dtype=torch.float64)
    jf, jg = _jit(f), _jit(g)
    torch.testing.assert_close(jf(x), f(x))  # a compiled program exists; a transform's call must not run it
    with caplog.at_level("WARNING", logger="fulmen"):
        torch.testing.assert_close(torch.func.grad(jf)(x), torch.func.grad(f)(x))
    assert "inside a torch.func transform" in caplog.text
    torch.testing.assert_close(torch.func.grad(jf)(x), x.cos() * x + x.sin())
    torch.testing.assert_close(torch.func.vmap(jg)(x), torch.func.vmap(g)(x))
    hits = fulmen.cache_hits(jf)
    torch.testing.assert_close(jf(x), f(x))  # outside the transform: the compiled program again
    assert fulmen.cache_hits(jf) == hits + 1


def test_unbound_tensor_methods_and_operators():
    # issue 44: these raised "descriptor ... doesn't apply to a 'TensorProxy' object"
    def f(x):
        return (torch.Tensor.__getitem__(x, 0) + torch.Tensor.__radd__(x, 1)[1] + torch.Tensor.__rsub__(x, 2)[2]
                + torch.Tensor.add(x, 1, alpha=3)[0] + torch.Tensor.__mul__(x, x)[1] + torch.Tensor.__rpow__(x, 2)[0])

    x = torch.randn(3, 2)
    torch.testing.assert_close(_jit(f)(x), f(x))


def test_unbound_operators_under_another_name_and_protocols():
    # torch.Tensor.__rtruediv__ is the function named __rdiv__
    def f(x):
        torch.Tensor.__setitem__(x, 0, 1.0)
        return (torch.Tensor.__rtruediv__(x, 2.0) + torch.Tensor.__rmatmul__(x, torch.ones(2)).sum()
                + reversed(x) + torch.Tensor.size(x, 0) * torch.Tensor.ndim.__get__(x) + x.new_zeros(2))

    x = torch.randn(2, 2) + 3
    torch.testing.assert_close(_jit(f)(x.clone()), f(x.clone()))


def test_complex_conversions_and_property_getters():
    def f(x):
        return (x.cfloat().real + x.cdouble().imag.float() + torch.Tensor.cfloat(x).real + x.mT.sum()
                + torch.Tensor.mT.__get__(x).sum() + x.T.sum())

    x = torch.randn(3, 3)
    torch.testing.assert_close(_jit(f)(x), f(x))


def test_metadata_properties_read_from_the_wrapper():
    def f(x):
        return x * (x.itemsize + x.nbytes + x.is_mps + x.is_xpu + x.is_sparse_csr + x.ndim + x.is_cpu)

    x = torch.randn(3)
    torch.testing.assert_close(_jit(f)(x), f(x))


def test_device_works_as_users_use_it():
    def f(x):
        d = x.device
        same = d == torch.device("cpu") and torch.device(d).type == "cpu" and d.type == "cpu" and d.index is None
        return x + torch.ones(3, device=d) * same

    x = torch.randn(3)
    torch.testing.assert_close(_jit(f)(x), f(x))


def _reads_a_value(call):
    def f(x):
        s = x.sum()
        if call == "method":
            return x * s.item()  # the line
        if call == "unbound":
            return x * torch.Tensor.item(s)  # the line
        if call == "bool":
            return x if s > 0 else -x  # the line
        return x * float(f"{s:.3f}")  # the line

    return f


@pytest.mark.parametrize("call", ["method", "unbound", "bool"])
def test_values_read_by_method_unbound_or_bool_are_split_points_as_eager(call):
    # every spelling of the read reaches fulmen's split point (fulmen.frontend.split_points), not a torch kernel
    f = _reads_a_value(call)
    jf = _jit(f)
    for x in (torch.ones(3), -torch.ones(3), torch.tensor([1.0, 2.0, -0.5])):
        torch.testing.assert_close(jf(x), f(x), rtol=0, atol=0)


def test_a_formatted_value_still_raises_a_data_dependent_error_naming_the_line():
    with pytest.raises(DataDependentError, match=r"test_real_tensor_proxies\.py.*# the line"):
        _jit(_reads_a_value("format"))(torch.randn(3))


def test_a_kernel_reached_on_a_proxy_is_a_clear_error():
    def f(x):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.add(x, 1)

    with pytest.raises(RuntimeError, match=re.escape("aten operator aten.add.Tensor was called on a traced tensor")):
        _jit(f)(torch.randn(3))


def test_parameter_built_from_a_traced_tensor_is_refused():
    def f(x):
        return nn.Parameter(x) * 2

    with pytest.raises(NotImplementedError, match=r"nn\.Parameter\(\.\.\.\) is created from the traced tensor"):
        _jit(f)(torch.randn(3))


def test_jitted_function_called_inside_another_trace_runs_its_code_on_the_proxies():
    inner = _jit(lambda x: x * 3)
    x = torch.randn(3)
    torch.testing.assert_close(inner(x), x * 3)  # an entry whose prologue a proxy of the same shape must not pass

    def outer(x):
        return inner(x) + 1

    jouter = _jit(outer)
    torch.testing.assert_close(jouter(x), x * 3 + 1)
    ids = [b.sym.id for b in fulmen.last_traces(jouter)[0].bound_symbols]
    assert "torch.mul" in ids


def test_closure_tensor_is_still_captured_as_an_input():
    w = torch.randn(3)

    def f(x):
        return x * w

    jf = _jit(f)
    x = torch.randn(3)
    torch.testing.assert_close(jf(x), x * w)
    w.mul_(2)  # captured by reference, read on every call
    torch.testing.assert_close(jf(x), x * w)


def test_jitted_submodule_inside_a_jitted_module_runs_on_the_proxies():
    inner = fulmen.jit(nn.Linear(3, 3), executors=["torch"])
    x = torch.randn(2, 3)
    expected = x @ inner.weight.detach().T + inner.bias.detach()
    torch.testing.assert_close(inner(x), expected)  # an entry whose prologue the proxies must not pass

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.sub = inner

        def forward(self, x):
            return self.sub(x) * 2

    out = fulmen.jit(Outer(), executors=["torch"])(x)
    torch.testing.assert_close(out, expected * 2)
    out.sum().backward()
    torch.testing.assert_close(inner.bias.grad, torch.full((3,), 4.0))


def test_hugging_face_model_reads_a_4d_mask_as_a_tensor():
    # transformers keeps a 4-D mask as given only when isinstance(mask, torch.Tensor)
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    model = transformers.LlamaModel(cfg).eval()
    ids = torch.randint(0, 64, (1, 6))
    causal = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    mask = torch.zeros(1, 1, 6, 6).masked_fill(causal, float("-inf"))
    mask[..., 4:, 3] = float("-inf")  # a custom additive mask: later positions do not see position 3
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        out = fulmen.jit(model, executors=["torch"])(input_ids=ids, attention_mask=mask, use_cache=False)
    torch.testing.assert_close(out.last_hidden_state, expected)
