"""Proxies stand for values while a program is traced.

``TensorProxy`` is deliberately *not* a ``torch.Tensor`` subclass: torch calls reach fulmen through
``__torch_function__``, methods and operators through the language context, and nothing can silently
read tensor data. Shapes are concrete ints, or ``torch.SymInt`` in a trace compiled for dynamic sizes
(``fulmen.core.symbolic``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from fulmen.core import dtypes, langctx
from fulmen.core.devices import Device, to_device
from fulmen.core.tracectx import current


class DataDependentError(RuntimeError):
    """Raised when a traced program needs a tensor's *value* in Python (``bool(t)``, ``t.item()``)."""


_FULMEN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def is_library_file(filename: str) -> bool:
    """Whether a code path belongs to fulmen's package or torch's (the user's code is everything else)."""
    return filename.startswith((_FULMEN_DIR, _TORCH_DIR)) or filename.startswith("<fulmen")


def _user_location() -> str:
    """The first stack frame outside fulmen and torch: the user's line that needed a value."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_library_file(filename):
            import linecache

            line = linecache.getline(filename, frame.f_lineno).strip()
            return f'File "{filename}", line {frame.f_lineno}' + (f": {line}" if line else "")
        frame = frame.f_back
    return "<unknown location>"


def _data_dependent(what: str, proxy: TensorProxy, kind: str | None = None):
    trace = current.trace
    read = trace.read_value if trace is not None and kind is not None else None
    if read is not None:  # the frontend reads the value from the call's tensors (fulmen.frontend.split_points)
        return read(kind, proxy, what)
    raise DataDependentError(
        f"{what} needs the value of tensor {proxy.name} ({proxy.type_string()}), which is not known while fulmen "
        f"traces the program.\n  at {_user_location()}\n"
        "fulmen.jit compiles the whole function into one trace, so Python control flow that depends on tensor values "
        "cannot be traced. Either move that logic out of the compiled function, express it with tensor operations "
        "(torch.where, masking), or use torch.compile(model, backend=\"fulmen\"), which splits the program there "
        "and compiles the parts around it."
    )


class Proxy:
    """Base class of everything that stands for a value in a trace; it has a unique ``name``."""

    __slots__ = ("name", "__weakref__")

    def __init__(self, name: str | None = None, prefix: str = "t"):
        if name is None:
            trc = current.trace  # get_tracectx(), inlined: this runs for every value traced
            name = trc.make_name(prefix) if trc is not None else f"_{prefix}{id(self):x}"
        self.name = name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def _is_ndarray(x) -> bool:
    np = sys.modules.get("numpy")  # a NumPy array exists only once NumPy is imported
    return np is not None and isinstance(x, np.ndarray)


def _binop(name: str, reflected: bool = False):
    # With a NumPy array, torch.Tensor's operators return NotImplemented and NumPy's take over (the array's reflected
    # operator calls the ufunc, which reaches TensorProxy.__array_ufunc__); a proxy does the same.
    if reflected:
        def fn(self, other):
            if _is_ndarray(other):
                return NotImplemented
            return langctx.method(name)(other, self)
    else:
        def fn(self, other):
            if _is_ndarray(other):
                return NotImplemented
            return langctx.method(name)(self, other)
    fn.__name__ = name
    return fn


def _unop(name: str):
    def fn(self):
        return langctx.method(name)(self)
    fn.__name__ = name
    return fn


class TensorProxy(Proxy):
    """Stands for a ``torch.Tensor`` while tracing: name, shape, dtype, device and requires_grad.

    ``TensorProxy(like=t)`` copies the metadata of ``t``; any keyword given overrides it::

        out = TensorProxy(like=a, dtype=torch.float32)
    """

    __slots__ = ("shape", "dtype", "device", "requires_grad", "_latest", "_view_of", "_views", "_origin", "_lazy_bits")

    def __init__(
        self,
        name: str | None = None,
        *,
        like: TensorProxy | torch.Tensor | None = None,
        shape: tuple[int, ...] | torch.Size | None = None,
        dtype: torch.dtype | None = None,
        device: Device | str | torch.device | None = None,
        requires_grad: bool | None = None,
        prefix: str = "t",
    ):
        super().__init__(name, prefix)
        if like is not None:
            shape = like.shape if shape is None else shape
            dtype = like.dtype if dtype is None else dtype
            device = like.device if device is None else device
            requires_grad = like.requires_grad if requires_grad is None else requires_grad
        if shape is None or dtype is None or device is None:
            raise TypeError("TensorProxy needs shape, dtype and device (or like=) to be known")
        self.shape = shape if type(shape) is torch.Size else torch.Size(shape)
        self.dtype = dtypes.to_torch_dtype(dtype)
        self.device = to_device(device)
        self.requires_grad = bool(requires_grad) if requires_grad is not None else False
        self._latest = None  # set when an in-place op replaces this value (see fulmen.torch.inplace)
        self._view_of = None  # (base proxy, fn(base) -> this view) for views made by view ops
        self._views = None
        self._origin = None
        self._lazy_bits = None  # (is_conj, is_neg) for views eager marks lazily (fulmen.torch.registry.lazy_bits)

    # ---- metadata, as on torch.Tensor ----
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    ndimension = dim

    def size(self, dim: int | None = None):
        if dim is None:
            return self.shape
        from fulmen.core.utils import canonicalize_dim

        return self.shape[canonicalize_dim(len(self.shape), dim)]

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    nelement = numel

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype, device="meta").element_size()

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def is_meta(self) -> bool:
        return False

    def is_floating_point(self) -> bool:
        return dtypes.is_float_dtype(self.dtype)

    def is_complex(self) -> bool:
        return dtypes.is_complex_dtype(self.dtype)

    def get_device(self) -> int:
        return -1 if self.device.index is None else self.device.index

    @property
    def layout(self):
        return torch.strided

    @property
    def is_sparse(self) -> bool:
        return False

    @property
    def is_quantized(self) -> bool:
        return False

    @property
    def is_nested(self) -> bool:
        return False

    @property
    def grad(self):
        raise NotImplementedError(
            f"Tensor.grad of {self.name} ({self.type_string()}) is read inside a function fulmen traces.\n"
            f"  at {_user_location()}\nA traced tensor stands for every later call's tensor, and their .grad "
            "attributes are not part of what fulmen compiles. Pass the gradients in as arguments (for example "
            "[p.grad for p in params]) instead of reading them inside the compiled function.")

    @property
    def data(self):
        return langctx.properties["data"](self)

    @data.setter
    def data(self, value) -> None:
        raise NotImplementedError(
            f"Tensor.data of {self.name} ({self.type_string()}) is assigned inside a function fulmen traces.\n"
            f"  at {_user_location()}\nThe assignment makes the tensor share another tensor's memory and metadata, "
            "which the compiled program cannot give the caller's tensor. For new values of the same shape write "
            "`with torch.no_grad(): x.copy_(value)`; otherwise assign .data outside the compiled function.")

    @property
    def grad_fn(self):
        return None

    @property
    def _is_param(self) -> bool:  # read by torch.nn.Parameter's path for tensor-like data
        return False

    @_is_param.setter
    def _is_param(self, value: bool) -> None:
        raise NotImplementedError(
            f"nn.Parameter(...) is created from the traced tensor {self.name} ({self.type_string()}) inside a "
            f"function fulmen traces.\n  at {_user_location()}\nA module built inside the compiled function "
            "(nn.Linear(4, 4)(x) in forward) would create new parameters on every call, which the compiled program "
            "cannot hand out to an optimizer. Build the module once, outside the compiled function (in your model's "
            "__init__), and call it inside.")

    @property
    def is_leaf(self) -> bool:
        # as autograd: a tensor that does not require grad, or one that requires it and was given as a leaf
        return not self.requires_grad or self._origin == "input-leaf"

    def type_string(self) -> str:
        dims = ", ".join(str(s) for s in self.shape)
        return f"{self.device} {dtypes.short_name(self.dtype)}[{dims}]"

    def __repr__(self) -> str:
        return f"<TensorProxy(name={self.name}, shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})>"

    # ---- values fulmen cannot know while tracing ----
    def __bool__(self):
        return _data_dependent("bool(tensor) (an `if`, `while`, `and`/`or` or `assert` on a tensor)", self, "bool")

    def item(self):
        return _data_dependent("Tensor.item()", self, "item")

    def tolist(self):
        return _data_dependent("Tensor.tolist()", self, "tolist")

    def numpy(self, *args, **kwargs):
        _data_dependent("Tensor.numpy()", self)

    def __array__(self, *args, **kwargs):
        _data_dependent("converting a tensor to a NumPy array (np.asarray(tensor))", self)

    # as torch.Tensor's: a NumPy scalar's operator defers to the tensor's reflected one
    __array_priority__ = 1000

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if not langctx.numpy_ufunc:
            return NotImplemented
        return langctx.numpy_ufunc[0](ufunc, method, inputs, kwargs)

    def __float__(self):
        return _data_dependent("float(tensor)", self, "float")

    def __int__(self):
        return _data_dependent("int(tensor)", self, "int")

    def __index__(self):
        return _data_dependent("using a tensor as a Python index", self, "index")

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __iter__(self):
        if not self.shape:
            raise TypeError("iteration over a 0-d tensor")
        return iter(langctx.method("unbind")(self, 0))

    __hash__ = object.__hash__

    # ---- the torch language ----
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        fn = langctx.torch_functions.get(func)
        if fn is None:
            fn = langctx.fallback[0](func)
        if kwargs and kwargs.get("out") is not None:
            return call_with_out(fn, func, args, kwargs)
        return fn(*args, **(kwargs or {}))

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        prop = langctx.properties.get(name)
        if prop is not None:
            return prop(self)
        fn = langctx.methods.get(name)
        if fn is not None:
            return lambda *args, **kwargs: fn(self, *args, **kwargs)
        fallback = langctx.fallback[0] if langctx.fallback else None
        tensor_attr = getattr(torch.Tensor, name, None)
        if fallback is not None and callable(tensor_attr):
            record = fallback(tensor_attr)
            return lambda *args, **kwargs: record(self, *args, **kwargs)
        raise AttributeError(f"'TensorProxy' (standing for a torch.Tensor) has no attribute {name!r}")

    def __setitem__(self, key, value):
        langctx.method("__setitem__")(self, key, value)

    __getitem__ = _binop("__getitem__")
    __add__, __radd__, __iadd__ = _binop("add"), _binop("add", True), _binop("add_")
    __sub__, __rsub__, __isub__ = _binop("sub"), _binop("sub", True), _binop("sub_")
    __mul__, __rmul__, __imul__ = _binop("mul"), _binop("mul", True), _binop("mul_")
    __truediv__, __rtruediv__, __itruediv__ = _binop("true_divide"), _binop("true_divide", True), _binop("div_")
    __floordiv__, __rfloordiv__, __ifloordiv__ = (_binop("floor_divide"), _binop("floor_divide", True),
                                                  _binop("floor_divide_"))
    __mod__, __rmod__, __imod__ = _binop("remainder"), _binop("remainder", True), _binop("remainder_")
    __pow__, __rpow__, __ipow__ = _binop("pow"), _binop("pow", True), _binop("pow_")
    __matmul__, __rmatmul__ = _binop("matmul"), _binop("matmul", True)
    __and__, __rand__, __iand__ = _binop("bitwise_and"), _binop("bitwise_and", True), _binop("bitwise_and_")
    __or__, __ror__, __ior__ = _binop("bitwise_or"), _binop("bitwise_or", True), _binop("bitwise_or_")
    __xor__, __rxor__, __ixor__ = _binop("bitwise_xor"), _binop("bitwise_xor", True), _binop("bitwise_xor_")
    __lshift__, __rshift__ = _binop("bitwise_left_shift"), _binop("bitwise_right_shift")
    __rlshift__, __rrshift__ = _binop("bitwise_left_shift", True), _binop("bitwise_right_shift", True)
    __ilshift__, __irshift__ = _binop("bitwise_left_shift_"), _binop("bitwise_right_shift_")
    __eq__, __ne__ = _binop("eq"), _binop("ne")
    __lt__, __le__, __gt__, __ge__ = _binop("lt"), _binop("le"), _binop("gt"), _binop("ge")
    __neg__, __pos__, __abs__, __invert__ = _unop("neg"), _unop("positive"), _unop("abs"), _unop("bitwise_not")


def is_proxy(x: Any) -> bool:
    return isinstance(x, Proxy)


def latest(p: TensorProxy) -> TensorProxy:
    """The current value of a proxy that in-place operations may have replaced."""
    while p._latest is not None:
        p = p._latest
    return p


def has_symbolic(bsym: Any) -> bool:
    """Whether a bound symbol reads or produces symbolic sizes (a trace compiled for dynamic shapes), in its
    arguments or in its proxies' shapes."""
    from fulmen.core.symbolic import contains_symbolic

    return contains_symbolic((bsym.args, bsym.kwargs)) or contains_symbolic(bsym.output)


def call_with_out(fn, func, args: tuple, kwargs: dict) -> Any:
    """``torch.f(..., out=t)``: the result computed as without ``out``, then copied into ``t`` in place (cast to its
    dtype where torch allows the cast), and ``t`` returned; ``out=(a, b)`` for ops with several results."""
    kwargs = dict(kwargs)
    out = kwargs.pop("out")
    name = getattr(func, "__name__", str(func))
    if torch.is_grad_enabled() and any(getattr(a, "requires_grad", False) for a in (*args, *kwargs.values())):
        raise RuntimeError(f"{name}(): functions with out=... arguments don't support automatic differentiation, "
                           "but one of the arguments requires grad.")
    result = fn(*args, **kwargs)
    outs, results = (out, result) if isinstance(out, (tuple, list)) else ((out,), (result,))
    if not isinstance(results, (tuple, list)) or len(outs) != len(results):
        raise TypeError(f"{name}(): out= must hold {len(results) if isinstance(results, (tuple, list)) else 1} "
                        f"tensor(s), got {len(outs)}")
    for o in outs:
        if not isinstance(o, (TensorProxy, torch.Tensor)):
            raise TypeError(f"{name}(): argument 'out' must be Tensor, not {type(o).__name__}")
    from fulmen.core.out_dtypes import out_dtype_error

    refused = out_dtype_error(func, args, kwargs, outs, results, not isinstance(out, (tuple, list)))
    if refused is not None:
        raise RuntimeError(f"{name}(): {refused}")
    inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, TensorProxy)]
    for check_out in langctx.out_checks:
        for o in outs:
            check_out(name, o, *inputs)
    for o, r in zip(outs, results):
        if tuple(o.shape) != tuple(r.shape):
            raise NotImplementedError(
                f"{name}(): out= holds a tensor of shape {list(o.shape)} but the result has shape {list(r.shape)}; "
                "eager PyTorch would resize it, which fulmen.jit does not support. Pass a tensor of the result's "
                "shape, or use the returned tensor instead of out=.")
        have, want = dtypes.to_torch_dtype(r.dtype), dtypes.to_torch_dtype(o.dtype)
        if not torch.can_cast(have, want):
            raise RuntimeError(f"result type {dtypes.scalar_type_name(have)} can't be cast to the desired output type "
                               f"{dtypes.scalar_type_name(want)}")
        langctx.method("copy_")(o, r)
    if hasattr(result, "n_fields"):  # torch.max(..., out=(v, i)) returns torch.return_types.max of the out tensors
        return type(result)(outs)
    if hasattr(result, "_fields"):
        return type(result)(*outs)
    return out


def has_proxy(x: Any) -> bool:
    """Whether ``x`` is a proxy or a tuple, list or dict holding one (at any depth)."""
    if isinstance(x, Proxy):
        return True
    if isinstance(x, (tuple, list)):
        return any(has_proxy(v) for v in x)
    if isinstance(x, dict):
        return any(has_proxy(v) for v in x.values())
    return False
