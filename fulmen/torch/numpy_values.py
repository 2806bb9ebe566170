"""NumPy values meeting traced tensors, treated as eager PyTorch treats them.

- A NumPy scalar is read as the Python number torch's argument parser makes of it (``numpy_scalar``):
  ``x * np.float32(2)``, ``x.reshape(np.int64(4), 3)``, ``np.float32(2) * x`` follow torch's rules for Python numbers.
  A NumPy bool reads as a float (``x + np.bool_(True)`` is a float tensor in eager, whatever ``x``'s dtype).
- ``tensor OP array`` (``+ - * / // % ** @ & | ^ == !=``): torch's operator gives way to NumPy's, which converts the
  tensor (``Tensor.__array__``), computes with NumPy's type promotion and wraps the result back into a tensor. Traced
  (``numpy_ufunc``): the array becomes a captured input sharing its memory (read on every call, as eager reads it),
  the operands are converted to the dtypes NumPy's ufunc loop picks, and the result has NumPy's result dtype. As in
  eager, a tensor that requires grad, a bfloat16 tensor or one off the CPU raise, and so do ``array OP tensor`` and
  ``tensor < array`` (TypeError).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from fulmen.core import langctx
from fulmen.core.proxies import TensorProxy
from fulmen.core.utils import check

# NumPy ufunc name -> Tensor method; the comparisons only for NumPy scalars (eager's ``tensor < array`` raises)
_UFUNCS = {"add": "add", "subtract": "sub", "multiply": "mul", "true_divide": "true_divide", "divide": "true_divide",
           "floor_divide": "floor_divide", "remainder": "remainder", "power": "pow", "matmul": "matmul",
           "bitwise_and": "bitwise_and", "bitwise_or": "bitwise_or", "bitwise_xor": "bitwise_xor", "equal": "eq",
           "not_equal": "ne", "less": "lt", "less_equal": "le", "greater": "gt", "greater_equal": "ge"}
_SCALARS_ONLY = frozenset(("less", "less_equal", "greater", "greater_equal"))
# ``tensor == array`` reaches NumPy as ``array == tensor`` (Python's reflection of ==)
_SYMMETRIC = frozenset(("equal",))


def _numpy():
    return sys.modules.get("numpy")  # NumPy values exist only once NumPy is imported: never imported here


def numpy_scalar(x: Any) -> Any:
    """The Python number torch reads a NumPy scalar as (a NumPy bool: a float); anything else as it is."""
    np = _numpy()
    if np is None or not isinstance(x, np.generic):
        return x
    if isinstance(x, np.bool_):
        return float(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.complexfloating):
        return complex(x)
    return x


def is_ndarray(x: Any) -> bool:
    np = _numpy()
    return np is not None and isinstance(x, np.ndarray)


def numpy_data(data: Any) -> Any:
    """The data argument of ``torch.tensor``/``as_tensor``/``asarray`` with NumPy values made torch values: an array
    or NumPy scalar becomes a tensor of its dtype (an array's shares its memory), NumPy scalars inside lists Python
    numbers of their kind (``[np.bool_(True)]`` is a bool list, as eager reads it)."""
    np = _numpy()
    if np is None:
        return data
    if isinstance(data, (np.ndarray, np.generic)):
        return torch.as_tensor(data)
    if isinstance(data, (list, tuple)):
        return type(data)(v.item() if isinstance(v, np.generic) else numpy_data(v) for v in data)
    return data


def _numpy_dtype(x: Any):
    np = _numpy()
    if isinstance(x, TensorProxy):
        check(not x.requires_grad, lambda: "Can't call numpy() on Tensor that requires grad. Use "
              "tensor.detach().numpy() instead.", RuntimeError)
        check(x.device.type == "cpu", lambda: f"can't convert {x.device.type} device type tensor to numpy. Use "
              "Tensor.cpu() to copy the tensor to host memory first.", TypeError)
        check(x.dtype is not torch.bfloat16, lambda: "Got unsupported ScalarType BFloat16", TypeError)
        return torch.empty(0, dtype=x.dtype).numpy().dtype
    return np.asarray(x).dtype if isinstance(x, np.generic) else x.dtype


def numpy_ufunc(ufunc, method: str, inputs: tuple, kwargs: dict) -> Any:
    """``TensorProxy.__array_ufunc__``: a NumPy ufunc called with a traced tensor among its operands."""
    name = _UFUNCS.get(ufunc.__name__)
    if method != "__call__" or kwargs or name is None:
        return NotImplemented
    op = langctx.method(name)
    if not any(is_ndarray(x) for x in inputs):  # NumPy scalars defer to the tensor's operator, as in eager
        return op(*(numpy_scalar(x) for x in inputs))
    if ufunc.__name__ == "not_equal" and not isinstance(inputs[0], TensorProxy):
        return True  # eager's ``tensor != array``: both sides decline, Python compares identities
    if ufunc.__name__ in _SCALARS_ONLY or not (isinstance(inputs[0], TensorProxy) or ufunc.__name__ in _SYMMETRIC):
        return NotImplemented  # eager: array OP tensor and tensor < array raise TypeError
    loop = ufunc.resolve_dtypes(tuple(_numpy_dtype(x) for x in inputs) + (None,))
    to = langctx.method("to")
    args = []
    for x, np_dtype in zip(inputs, loop):
        if not isinstance(x, TensorProxy):
            x = torch.from_numpy(_numpy().asarray(x))  # a real tensor: captured as an input when the op records it
        args.append(to(x, dtype=_torch_dtype(np_dtype)))
    return to(op(*args), dtype=_torch_dtype(loop[-1]))


def _torch_dtype(np_dtype) -> torch.dtype:
    return torch.from_numpy(_numpy().empty(0, dtype=np_dtype)).dtype


langctx.numpy_ufunc.append(numpy_ufunc)
