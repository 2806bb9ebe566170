"""Seed 001, ported: ``fulmen.extend`` -- a new operator, new implementations of ``mul``, grad transforms.

Run it as a script (``python examples/writing_an_executor.py``). It asserts what the seed shows: ``multimul``
runs through its NumPy implementation, ``ltorch.mul`` is executed as ``multimul`` through an execution
transform (also in the backward pass), a grad transform makes the backward of ``mul`` a single
``multimul``, and a transform may interleave torch operations (``contiguous``) with the new operator.

The seed's last cells use NVIDIA Apex's cross-entropy executor, which needs CUDA and Apex; they are left
out here. fulmen ships its own cross-entropy executor, and ``examples/custom_forward_backward.py``
shows a custom forward and backward for ``cross_entropy`` built with the same API.
"""

import warnings
from numbers import Number

import numpy as np
import torch

import fulmen
import fulmen.torch as ltorch
from fulmen.core.devices import DeviceType
from fulmen.core.proxies import TensorProxy
from fulmen.core.transforms import get_grad, grad, put_grads
from fulmen.extend import OperatorExecutor

warnings.filterwarnings("ignore", category=DeprecationWarning)  # NumPy 2 ufuncs on torch tensors


def code_lines(trace) -> list[str]:
    """The statements of a printed trace, without comments."""
    lines = (ln.split("  # ")[0].strip() for ln in str(trace).splitlines())
    return [ln for ln in lines if ln and not ln.startswith("#")]


# Registers a new operator executor
myex = OperatorExecutor("myex", version="0.1")


# "multimul" uses NumPy to perform two multiplications of four inputs.
def multimul_impl(
        a: Number | torch.Tensor,
        b: Number | torch.Tensor,
        c: Number | torch.Tensor,
        d: Number | torch.Tensor,) -> tuple[torch.Tensor, torch.Tensor]:
    return np.multiply(a, b), np.multiply(c, d)


# multimul is a valid Python function that operates on PyTorch tensors (on the CPU)
a = torch.randn((2, 2))
b = torch.randn((2, 2))
print(multimul_impl(a, b, a, b))


# The "like" function gives multimul's metadata and a decomposition, used for transforms like grad.
def multimul_like(
        a: Number | TensorProxy,
        b: Number | TensorProxy,
        c: Number | TensorProxy,
        d: Number | TensorProxy,):
    return a * b, c * d


# register_operator returns a Symbol that can be called from compiled code
multimul = myex.register_operator('multimul', like=multimul_like, fn=multimul_impl)


def foo(a, b, c, d):
    return multimul(a, b, c, d)


cfoo = fulmen.jit(foo, executors=[myex])
out = cfoo(a, b, a, b)
print(out)
torch.testing.assert_close(out, (a * b, a * b))

# The symbol is recorded into the trace, with its like function's decomposition as comments
trace = fulmen.last_traces(cfoo)[-1]
print(trace)
assert "(t0, t1) = multimul(a, b, a, b)" in code_lines(trace)  # a tensor passed twice is one input
assert "# t0 = ltorch.mul(a, b)" in str(trace)

# multimul is even differentiable because its "like" function is differentiable
cfoo_grad = grad(cfoo)
grads = cfoo_grad(a, b, a, b)
print(grads)
trace = fulmen.last_traces(cfoo_grad)[-1]
print(trace)
for g, expected in zip(grads, (b, a, b, a)):  # d/da sum(a * b) = b, ...
    torch.testing.assert_close(g, expected)
assert "multimul" not in " ".join(code_lines(trace))  # the backward multiplies with torch: nothing claims mul yet


# Execute existing operations with multimul: a transform from mul to multimul, and a checker.
def mul_to_multimul(a: Number | TensorProxy, b: Number | TensorProxy) -> TensorProxy:
    result, _ = multimul(a, b, 0, 0)
    return result


def mul_to_multimul_checker(a: Number | TensorProxy, b: Number | TensorProxy) -> bool:
    def is_cpu(x: Number | TensorProxy) -> bool:
        if isinstance(a, TensorProxy):
            return a.device.devicetype == DeviceType.CPU
        return True

    return all(is_cpu(x) for x in (a, b))


myex.register_implementation(ltorch.mul, checker=mul_to_multimul_checker, execution_transform=mul_to_multimul)


def bar(a, b):
    return a * b


cbar = fulmen.jit(bar, executors=[myex])
torch.testing.assert_close(cbar(a, b), a * b)
trace = fulmen.last_traces(cbar)[-1]
print(trace)
assert "(t0, _) = multimul(a, b, 0, 0)" in code_lines(trace)

# Execution transforms happen after grad, so the backward's two multiplications run as multimul too
cbar_grad = grad(cbar)
grads = cbar_grad(a, b)
trace = fulmen.last_traces(cbar_grad)[-1]
print(trace)
torch.testing.assert_close(grads[0], b)
torch.testing.assert_close(grads[1], a)
calls = [ln for ln in code_lines(trace) if "multimul(" in ln]
assert len(calls) == 2 and all(ln.endswith(", 0, 0)") for ln in calls), calls


# A grad transform for mul that calls multimul once for both gradients
def mymul_grad(a: TensorProxy, b: TensorProxy) -> TensorProxy:
    fwd = a * b

    g = get_grad(fwd)
    a_grad, b_grad = multimul(b, g, a, g)
    put_grads((a, b), (a_grad, b_grad))

    return fwd


myex.register_implementation(ltorch.mul, checker=mul_to_multimul_checker, execution_transform=mul_to_multimul,
                             grad_transform=mymul_grad)
cbar_grad = grad(cbar)
grads = cbar_grad(a, b)
trace = fulmen.last_traces(cbar_grad)[-1]
print(trace)
torch.testing.assert_close(grads[0], b)
torch.testing.assert_close(grads[1], a)
calls = [ln for ln in code_lines(trace) if "multimul(" in ln]
assert len(calls) == 1 and calls[0].startswith("(t") and "0, 0)" not in calls[0], calls


# A transform may prepare inputs with torch operations, here by making them contiguous
def mul_to_contiguous_multimul(a: Number | TensorProxy, b: Number | TensorProxy) -> TensorProxy:
    a = a.contiguous()
    b = b.contiguous()
    result, _ = multimul(a, b, 0, 0)
    return result


myex.register_implementation(ltorch.mul, checker=mul_to_multimul_checker,
                             execution_transform=mul_to_contiguous_multimul)


def caz(a, b):
    return a * b


ccaz = fulmen.jit(caz, executors=[myex])
torch.testing.assert_close(ccaz(a.t(), b), a.t() * b)
trace = fulmen.last_traces(ccaz)[-1]
print(trace)
lines = code_lines(trace)
assert sum("contiguous(" in ln for ln in lines) == 2, lines
assert "(t0, _) = multimul(t1, b, 0, 0)" in lines, lines  # b is contiguous: b.contiguous() is b, as in eager

print("seed 001: OK")
