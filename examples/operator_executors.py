"""Seed 002, ported: an operator executor for ``prims.add`` that calls NumPy, made with ``add_operator_executor``.

Run it as a script (``python examples/operator_executors.py``); every cell of the seed runs and the
script asserts what the seed shows: the trace and its bound symbols, the error when only the NumPy
executor is allowed, which executor runs ``add``, executor order, and the checker rejecting inputs.
It uses CUDA when present and the CPU otherwise.
"""

import functools
import warnings

import numpy as np
import torch

import fulmen

warnings.filterwarnings("ignore", category=DeprecationWarning)  # NumPy 2 on torch tensors

device = "cuda" if torch.cuda.is_available() else "cpu"
dev = "cuda:0" if device == "cuda" else "cpu"

# ---- logging helpers, as in the seed ----
_indentation = 0


def _log(msg=None):
    if msg is not None:
        print("  " * _indentation + msg)


def log(func):
    """A decorator for functions to log arguments and results."""
    name = func.__name__

    def pp(v):
        if isinstance(v, tuple):
            return "({})".format(", ".join(pp(x) for x in v))
        if isinstance(v, fulmen.core.proxies.TensorProxy):
            return f"TensorProxy(name={v.name}, shape={tuple(v.shape)}, dtype={v.dtype}, device={v.device})"
        if isinstance(v, torch.Tensor):
            return f"Tensor(shape={v.shape}, stride={v.stride()}, dtype={v.dtype}, device={v.device})"
        return str(v)

    @functools.wraps(func)
    def func_wrapper(*args):
        global _indentation
        _log("call {}({})".format(name, ", ".join(pp(a) for a in args)))
        _indentation += 2
        res = func(*args)
        _indentation -= 2
        _log("|<- {} = {}\n".format(name, pp(res)))
        return res

    return func_wrapper


# ---- the test function and inputs ----
def fun(a, b):
    return a + b * a


a = torch.randn(2, 2, device=device)
b = torch.randn(2, 1, device=device)

# ---- how the function is represented as a trace ----
trace = fulmen.trace()(fun, a, b)
print(trace)
text = str(trace)
assert "@torch.no_grad()" in text and "def fun(a, b):" in text
assert f't1 = ltorch.mul(b, a)  # t1: "{dev} f32[2, 2]"' in text
assert f'# t0 = prims.broadcast_in_dim(b, [2, 2], (0, 1))  # t0: "{dev} f32[2, 2]"' in text

for bound_symbol in trace.bound_symbols:
    print(f"Bound symbol with id={bound_symbol.sym.id} is represented in the trace as |{bound_symbol}|")
    if bound_symbol.subsymbols:
        print("  It has the following subsymbols:")
        for subsymbol in bound_symbol.subsymbols:
            print(f"    id={subsymbol.sym.id}  |{subsymbol}|")

PrimIDs = fulmen.prims.PrimIDs
assert [bsym.sym.id for bsym in trace.bound_symbols] == [
    PrimIDs.UNPACK_TRIVIAL, PrimIDs.UNPACK_TRIVIAL, "torch.mul", "torch.add", PrimIDs.RETURN]
assert str(trace.bound_symbols[0]) == f'# a: "{dev} f32[2, 2]"'
assert [s.sym.id for s in trace.bound_symbols[2].subsymbols] == [PrimIDs.BROADCAST_IN_DIM, PrimIDs.MUL]
assert [s.sym.id for s in trace.bound_symbols[3].subsymbols] == [PrimIDs.ADD]

# ---- the executor ----
from fulmen.executors import add_operator_executor  # noqa: E402

help(add_operator_executor)


@log
def add_numpy(a, b):
    assert isinstance(a, np.ndarray), "a must be a NumPy ndarray"
    assert isinstance(b, np.ndarray), "b must be a NumPy ndarray"
    return np.add(a, b)


@log
def torch_to_numpy(tensors):
    return tuple(t.detach().cpu().numpy() for t in tensors)


@log
def numpy_to_torch(arrays, device):
    return tuple(torch.from_numpy(arr).to(device) for arr in arrays)


checker_calls = []


@log
def checker_add_numpy(a, b):
    # Suppose we only support float32 dtype, 2D, and (2, N) shape
    checker_calls.append((a.name, b.name))
    first_condition = a.dtype == b.dtype == fulmen.dtypes.float32
    second_condition = a.ndim == b.ndim == 2
    third_condition = a.shape[0] == b.shape[0] == 2
    return first_condition and second_condition and third_condition


impl_calls = []


@log
def executor_add_numpy(a, b):
    impl_calls.append((a.shape, b.shape))
    np_a, np_b = torch_to_numpy((a, b))
    np_res = add_numpy(np_a, np_b)
    res, = numpy_to_torch((np_res,), a.device)
    return res


op_map = {
    fulmen.prims.PrimIDs.ADD: ("add_numpy", checker_add_numpy, executor_add_numpy)
}
add_operator_executor("custom_add_executor", op_map, add_to_default_executors=False)

# ---- only the custom executor: ltorch.mul has no executor ----
cfun = fulmen.compile(fun, executors_list=["custom_add_executor"])
try:
    cfun(a, b)
except RuntimeError as e:
    print(e)
    message = str(e)
else:
    raise AssertionError("compiling with only custom_add_executor should fail on ltorch.mul")
assert message.startswith(f'Could not find executor for bound symbol t1 = ltorch.mul(b, a)  # t1: "{dev} f32[2, 2]"')
assert f'  # t0 = prims.broadcast_in_dim(b, [2, 2], (0, 1))  # t0: "{dev} f32[2, 2]"' in message

# ---- the custom executor, then the torch executor ----
cfun = fulmen.compile(fun, executors_list=["custom_add_executor", fulmen.executors.TORCH])
checker_calls.clear()
print(cfun(a, b))
# The checker saw proxies twice (ltorch.add's decomposition, then prims.add) and said yes both times;
# the implementation got real tensors.
assert checker_calls == [("a", "t1"), ("a", "t1")], checker_calls
assert len(impl_calls) == 1

execution_trace = fulmen.last_traces(cfun)[-1]
print(execution_trace)
text = str(execution_trace)
assert f't1 = torch.mul(b, a)  # t1: "{dev} f32[2, 2]"' in text
assert f't2 = add_numpy(a, t1)  # t2: "{dev} f32[2, 2]"' in text

# ---- is the result correct? ----
cfun_torch = fulmen.compile(fun, executors_list=[fulmen.executors.TORCH])
expected = cfun_torch(a, b)
actual = cfun(a, b)
torch.testing.assert_close(expected, actual)
torch.testing.assert_close(actual, fun(a, b))
assert len(impl_calls) == 2

# ---- an OpInfo sample: 4 x 4 inputs, the checker says no ----
from fulmen.tests.opinfos import add_opinfo  # noqa: E402

sample = next(add_opinfo.sample_input_generator(add_opinfo, device=device, dtype=torch.float32,
                                                requires_grad=False))
print(sample)
checker_calls.clear()
expected = cfun_torch(*sample.args)
actual = cfun(*sample.args)
torch.testing.assert_close(expected, actual)
if sample.args[0].ndim == 2 and sample.args[0].shape[0] != 2:
    assert "add_numpy" not in str(fulmen.last_traces(cfun)[-1])

# ---- the order of executors matters: the torch executor first takes everything ----
cfun_torch_first = fulmen.compile(fun, executors_list=[fulmen.executors.TORCH, "custom_add_executor"])
cfun_torch_first(a, b)
text = str(fulmen.last_traces(cfun_torch_first)[-1])
print(text)
assert "t2 = torch.add(a, t1)" in text and "add_numpy" not in text

# ---- inputs the executor does not support: float64, (3, 2) ----
a = torch.randn(3, 2, device=device, dtype=torch.float64)
b = torch.randn(3, 1, device=device, dtype=torch.float64)
checker_calls.clear()
torch.testing.assert_close(cfun(a, b), fun(a, b))
text = str(fulmen.last_traces(cfun)[-1])
print(text)
assert checker_calls == [("a", "t1")]  # asked once, said no
assert f't2 = torch.add(a, t1)  # t2: "{dev} f64[3, 2]"' in text and "add_numpy" not in text

print("seed 002: OK")
