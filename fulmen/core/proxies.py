"""Proxies stand for values while a program is traced.

``TensorProxy`` is a ``torch.Tensor`` subclass with no data (a wrapper subclass, as PyTorch's fake tensors are):
type checks in user and library code pass as they do for the tensor it stands for, torch calls, methods and
properties reach fulmen through ``__torch_function__``, and nothing can silently read tensor data. Shapes are
concrete ints, or ``torch.SymInt`` in a trace compiled for dynamic sizes (``fulmen.core.symbolic``).
"""

from __future__ import annotations

import os
import sys
from operator import attrgetter
from typing import Any

import torch

from fulmen.core import dtypes, langctx
from fulmen.core.devices import device_view, to_device
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
    tracer = current.tracer
    if tracer is not None and kind is not None:  # the tracer may read it (fulmen.frontend.split_points)
        return tracer.read_value(kind, proxy, what)
    raise data_dependent_error(what, proxy)


def data_dependent_error(what: str, proxy: TensorProxy) -> DataDependentError:
    """The error for Python that needs the value of ``proxy`` while it is traced, naming the user's line."""
    return DataDependentError(
        f"{what} needs the value of tensor {proxy.name} ({proxy.type_string()}), which is not known while fulmen "
        f"traces the program.\n  at {_user_location()}\n"
        "fulmen.jit compiles the whole function into one trace, so Python control flow that depends on tensor values "
        "cannot be traced. Either move that logic out of the compiled function, express it with tensor operations "
        "(torch.where, masking), or use torch.compile(model, backend=\"fulmen\"), which splits the program there "
        "and compiles the parts around it."
    )


def _memory_unknown(what: str, proxy: TensorProxy) -> NotImplementedError:
    return NotImplementedError(
        f"{what} of {proxy.name} ({proxy.type_string()}) is read inside a function fulmen traces.\n"
        f"  at {_user_location()}\nA traced tensor has no memory while fulmen traces the program, and it stands for "
        "every later call's tensor, each in its own memory. Read it outside the compiled function.")


class Proxy:
    """Base class of everything that stands for a value in a trace; it has a unique ``name``.

    It has no ``__slots__``: ``TensorProxy`` also derives from ``torch.Tensor``, whose instance layout a base with
    slots would conflict with.
    """

    def __init__(self, name: str | None = None, prefix: str = "t"):
        self.name = _new_name(self, name, prefix)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def _new_name(proxy: Any, name: str | None, prefix: str) -> str:
    if name is None:
        trc = current.trace  # get_tracectx(), inlined: this runs for every value traced
        name = trc.make_name(prefix) if trc is not None else f"_{prefix}{id(proxy):x}"
    return name


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


def _compare(name: str, reflected: str):
    # Python tries the right operand's reflected comparison first when its type is a proper subclass of the left
    # one's (and, unlike arithmetic, whether or not it overrides it): in eager ``t == p`` with ``p`` an nn.Parameter
    # runs ``p.__eq__(t)``, so eq(p, t), laid out as ``p`` is. A parameter's proxy is a TensorProxy like any other
    # (it passes ``isinstance(p, nn.Parameter)``), so the rule is applied here.
    def fn(self, other):
        if _is_ndarray(other):
            return NotImplemented
        if isinstance(other, torch.nn.Parameter) and not isinstance(self, torch.nn.Parameter):
            return langctx.method(reflected)(other, self)
        return langctx.method(name)(self, other)
    fn.__name__ = name
    return fn


def _unop(name: str):
    def fn(self):
        return langctx.method(name)(self)
    fn.__name__ = name
    return fn


class TensorProxy(Proxy, torch.Tensor):
    """Stands for a ``torch.Tensor`` while tracing: name, shape, dtype, device and requires_grad.

    ``TensorProxy(like=t)`` copies the metadata of ``t``; any keyword given overrides it::

        out = TensorProxy(like=a, dtype=torch.float32)

    It is a real ``torch.Tensor`` (a wrapper subclass with no storage, as PyTorch's fake tensors are), so library
    code that checks ``isinstance(x, torch.Tensor)``, ``torch.is_tensor(x)`` or ``isinstance(p, nn.Parameter)``
    takes the branch it takes in eager. Every torch function, ``Tensor`` method and property that this class does
    not define itself reaches ``__torch_function__``, which routes it to the torch language; nothing reaches an
    aten kernel (``__torch_dispatch__`` raises). The metadata fulmen reads constantly is held in slots that shadow
    ``torch.Tensor``'s, so reading it never leaves Python. ``device`` is the canonical ``torch.device``
    (``fulmen.core.devices.to_device``), the object eager's ``Tensor.device`` would be.
    """

    __slots__ = ("name", "shape", "dtype", "device", "requires_grad", "_latest", "_view_of", "_views", "_origin",
                 "_lazy_bits", "_param")

    def __new__(
        cls,
        name: str | None = None,
        *,
        like: TensorProxy | torch.Tensor | None = None,
        shape: tuple[int, ...] | torch.Size | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        requires_grad: bool | None = None,
        prefix: str = "t",
    ):
        if like is not None:
            shape = like.shape if shape is None else shape
            dtype = like.dtype if dtype is None else dtype
            device = like.device if device is None else device
            requires_grad = like.requires_grad if requires_grad is None else requires_grad
        if shape is None or dtype is None or device is None:
            raise TypeError("TensorProxy needs shape, dtype and device (or like=) to be known")
        shape = shape if type(shape) is torch.Size else torch.Size(shape)
        dtype = dtypes.to_torch_dtype(dtype)
        device = to_device(device)
        self = _make_wrapper(cls, shape, dtype=dtype, device=device)
        self.name = _new_name(self, name, prefix)
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.requires_grad = bool(requires_grad) if requires_grad is not None else False
        self._latest = None  # set when an in-place op replaces this value (see fulmen.torch.inplace)
        self._view_of = None  # (base proxy, fn(base) -> this view) for views made by view ops
        self._views = None
        self._origin = None
        self._lazy_bits = None  # (is_conj, is_neg) for views eager marks lazily (fulmen.torch.registry.lazy_bits)
        self._param = False  # stands for an nn.Parameter (a program input that is one): isinstance(p, Parameter)
        return self

    __init__ = object.__init__  # not Proxy's: __new__ did the work (object's ignores the arguments when __new__ is set)

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
        # eager: None for a leaf, an autograd node otherwise (user code branches on `t.grad_fn is None`)
        return None if self.is_leaf else TracedGradFn(self)

    @property
    def retains_grad(self) -> bool:
        return False  # Tensor.retain_grad() is refused while tracing (fulmen.torch.hooks)

    @property
    def _is_param(self) -> bool:  # read by nn.Parameter's isinstance check (and its path for tensor subclasses)
        return self._param

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
        # as autograd: a tensor that does not require grad, one that requires it and was given as a leaf, or a view
        # made under no_grad (which keeps its base's requires_grad)
        return not self.requires_grad or self._origin in ("input-leaf", "no-grad-view")

    # ---- aliasing and in-place state: read by the torch language and the frontend, changed only through these ----
    # (read-only properties whose getter is C code: reading one costs no Python frame, and tracing reads them often)
    replaced_by = property(
        attrgetter("_latest"), doc="The value an in-place update made current in this one's place (``latest``)."
    )
    view_of = property(
        attrgetter("_view_of"),
        doc="``(base, remake)`` for a view made by a view op: ``remake(new_base)`` makes the view of a new base.",
    )
    views = property(
        attrgetter("_views"), doc="The views made of this value, which an in-place update of it changes too."
    )
    origin = property(
        attrgetter("_origin"),
        doc='"input-leaf" (an input autograd sees as a leaf), "input" (another input), "multi-output-view" (an '
        'output of split, chunk, unbind made under grad mode), "no-grad-view" (a view made under no_grad of a '
        "tensor that requires grad) or None.",
    )
    lazy_bits = property(
        attrgetter("_lazy_bits"),
        doc="``(is_conj, is_neg)`` as eager marks the tensor lazily, or None (``fulmen.torch.registry.lazy_bits``).",
    )

    def mark_input(self, *, leaf: bool, param: bool) -> None:
        """This proxy is an input of the program: ``leaf`` an autograd leaf that requires grad, ``param`` an
        ``nn.Parameter`` (so ``isinstance(p, nn.Parameter)`` holds, as in eager)."""
        self._origin = "input-leaf" if leaf else "input"
        self._param = param

    def mark_no_grad_result(self) -> None:
        """This value was made under no_grad: eager gives it ``requires_grad=False``, except a view, which keeps its
        base's and is a leaf."""
        if self._view_of is None:
            self.requires_grad = False
        elif self.requires_grad and self._origin is None:
            self._origin = "no-grad-view"

    def mark_multi_output_view(self) -> None:
        """This value is a view returned by an op returning several (autograd refuses in-place writes to it)."""
        if self._origin is None:
            self._origin = "multi-output-view"

    def set_lazy_bits(self, conj: bool, neg: bool) -> None:
        self._lazy_bits = (conj, neg)

    def make_view_of(self, base: TensorProxy, remake: Any) -> None:
        """This value is a view of ``base``, remade by ``remake(new_base)`` when the base changes in place."""
        self._view_of = (base, remake)
        if base._views is None:
            base._views = []
        # once: an opaque op inside a view op's decomposition (view_as_real's) links the same output first
        if not any(v is self for v in base._views):
            base._views.append(self)

    def replace_with(self, new: TensorProxy, *, links_of: TensorProxy | None = None) -> None:
        """An in-place update made ``new`` this value's current one: later reads get ``new`` (``latest``), which
        is a view of the same base and has the same views as ``links_of`` (default: this value)."""
        self._latest = new
        links_of = self if links_of is None else links_of
        if links_of._views is None:  # one list for every value of the tensor: a view made of `new` is one of ours
            links_of._views = []
        new._view_of, new._views = links_of._view_of, links_of._views

    def restore_views(self, views: list[TensorProxy]) -> None:
        """Make ``views`` (in place: later values share the list) the views of this value."""
        self._views[:] = views

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

    def data_ptr(self):
        raise _memory_unknown("Tensor.data_ptr()", self)

    def untyped_storage(self):
        raise _memory_unknown("Tensor.untyped_storage()", self)

    def storage(self):
        raise _memory_unknown("Tensor.storage()", self)

    _typed_storage = storage

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

    def __contains__(self, item):
        _data_dependent("`in` on a tensor", self)

    def __complex__(self):
        _data_dependent("complex(tensor)", self)

    def __format__(self, spec: str) -> str:
        if spec:  # eager formats a one-element tensor's value
            _data_dependent(f"formatting a tensor with {spec!r}", self)
        return repr(self)

    def __reversed__(self):
        return langctx.method("flip")(self, 0)

    __hash__ = object.__hash__

    # ---- the torch language ----
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        fn = langctx.torch_functions.get(func)
        if fn is None:
            fn = _tensor_member(func)
        if kwargs and kwargs.get("out") is not None:
            return call_with_out(fn, func, args, kwargs)
        return fn(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # every torch call on a proxy is routed by __torch_function__; reaching a kernel means something turned
        # that off (torch._C.DisableTorchFunctionSubclass) and would run an aten op on a tensor with no data
        raise RuntimeError(
            f"fulmen internal error: aten operator {func} was called on a traced tensor (TensorProxy), which has no "
            "data. Torch calls on traced tensors go through TensorProxy.__torch_function__; something ran this one "
            "with torch functions disabled. Please report this with the code that made the call.")

    def __getattr__(self, name: str):
        # attributes torch.Tensor does not have (torch.Tensor's own reach __torch_function__ instead)
        if name.startswith("__"):
            raise AttributeError(name)
        prop = langctx.properties.get(name)
        if prop is not None:
            return prop(self)
        fn = langctx.methods.get(name)
        if fn is not None:
            return lambda *args, **kwargs: fn(self, *args, **kwargs)
        raise AttributeError(f"'TensorProxy' (standing for a torch.Tensor) has no attribute {name!r}")

    def __setitem__(self, key, value):
        langctx.method("__setitem__")(self, key, value)

    def set_(self, *args, **kwargs):  # torch.Tensor.set_ goes to the kernel without asking __torch_function__
        return langctx.method("set_")(self, *args, **kwargs)

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
    __eq__, __ne__ = _compare("eq", "eq"), _compare("ne", "ne")
    __lt__, __le__ = _compare("lt", "gt"), _compare("le", "ge")
    __gt__, __ge__ = _compare("gt", "lt"), _compare("ge", "le")
    __neg__, __pos__, __abs__, __invert__ = _unop("neg"), _unop("positive"), _unop("abs"), _unop("bitwise_not")


_make_wrapper = torch.Tensor._make_wrapper_subclass
_DESCRIPTORS = (type(torch._C.TensorBase.grad), property)  # torch.Tensor's C properties, and its Python ones

#: torch.Tensor properties that are facts of a tensor's metadata alone, which the wrapper holds as the proxy does
_WRAPPER_FACTS = frozenset(("is_ipu", "is_maia", "is_mkldnn", "is_mps", "is_mtia", "is_sparse_csr", "is_vulkan",
                            "is_xla", "is_xpu", "itemsize", "nbytes", "_cdata", "_has_symbolic_sizes_strides"))

#: torch.Tensor member (method, operator, property getter or setter) -> (kind, name), kind "method" or "get"/"set"
_members: dict[Any, tuple[str, str] | None] = {}


def _member_of(func) -> tuple[str, str] | None:
    """Which ``torch.Tensor`` member ``func`` is (``torch.Tensor.add``, the getter of ``Tensor.mT``), or None for a
    function outside ``torch.Tensor`` (``torch.add``)."""
    try:
        return _members[func]
    except KeyError:
        pass
    except TypeError:  # an unhashable callable
        return None
    fname = getattr(func, "__name__", None)
    owner = getattr(func, "__self__", None)
    member = None
    if fname in ("__get__", "__set__", "__delete__") and isinstance(owner, _DESCRIPTORS):
        name = getattr(owner, "__name__", None) or owner.fget.__name__
        member = ("get" if fname == "__get__" else "set", name)
    else:
        name = _method_names().get(func)
        if name is not None:
            member = ("method", name)
    _members[func] = member
    return member


_names_of_methods: dict[Any, str] | None = None


def _method_names() -> dict[Any, str]:
    """``torch.Tensor``'s methods -> their names. Where one function has several (``__rtruediv__`` is ``__rdiv__``,
    whose ``__name__`` is the latter), the name ``TensorProxy`` defines wins. Built once, when first needed, and
    published whole (another thread tracing meanwhile never reads it half-filled)."""
    global _names_of_methods
    if _names_of_methods is None:
        names: dict[Any, str] = {}
        for name in dir(torch.Tensor):
            value = getattr(torch.Tensor, name, None)
            if value is None or isinstance(value, type) or not callable(value):
                continue
            try:
                known = names.get(value)
            except TypeError:  # unhashable
                continue
            if known is None or (name in TensorProxy.__dict__ and known not in TensorProxy.__dict__):
                names[value] = name
        _names_of_methods = names
    return _names_of_methods


def _tensor_member(func) -> Any:
    """What a torch callable with no torch-language function means on proxies: a ``torch.Tensor`` method, operator
    or property (called on a proxy, or unbound: ``torch.Tensor.__getitem__(t, i)``) runs as ``TensorProxy``'s own or
    the torch language's ``Tensor.<name>``; anything else is recorded as an opaque (fallback) op."""
    member = _member_of(func)
    if member is not None:
        kind, name = member
        own = TensorProxy.__dict__.get(name)
        if kind == "method":
            if callable(own):  # operators, item, size, ...: what x.name(...) runs
                return own
            fn = langctx.methods.get(name)
            if fn is not None:
                return fn
            if name.startswith("__"):
                return _unsupported(name)
        elif own is not None and hasattr(own, "__get__"):  # a slot or property TensorProxy shadows (shape, grad)
            return own.__get__ if kind == "get" else own.__set__
        elif kind == "get":
            prop = langctx.properties.get(name)
            if prop is not None:
                return prop
            if name in _WRAPPER_FACTS:
                return _wrapper_fact(func)
            return _missing_attribute(name)
        else:
            return _assigned(name)
    if not langctx.fallback:
        raise NotImplementedError(f"fulmen: {getattr(func, '__name__', func)} has no torch-language function")
    return langctx.fallback[0](func)


def _wrapper_fact(getter):
    def read(self):
        with torch._C.DisableTorchFunctionSubclass():
            return getter(self)
    return read


def _missing_attribute(name: str):
    def read(self):  # an AttributeError from a property makes Python try __getattr__, which raises it again
        raise AttributeError(f"'TensorProxy' (standing for a torch.Tensor) has no attribute {name!r}: fulmen does "
                             f"not know Tensor.{name} of a traced tensor")
    return read


def _assigned(name: str):
    def write(self, value=None):
        raise NotImplementedError(
            f"Tensor.{name} of {self.name} ({self.type_string()}) is assigned (or deleted) inside a function fulmen "
            f"traces.\n  at {_user_location()}\nThe compiled program cannot change this attribute of the tensor a "
            "later call passes; set it outside the compiled function.")
    return write


def _unsupported(name: str):
    def call(self, *args, **kwargs):
        raise NotImplementedError(
            f"Tensor.{name} is called on the traced tensor {self.name} ({self.type_string()}) inside a function "
            f"fulmen traces.\n  at {_user_location()}\nfulmen has no rule for it; call it outside the compiled "
            "function.")
    return call


class TracedGradFn:
    """``t.grad_fn`` of a traced tensor that is not a leaf: not None, as in eager, but the autograd node itself
    does not exist while tracing, so reading anything from it raises an error naming the user's line."""

    __slots__ = ("_proxy",)

    def __init__(self, proxy: TensorProxy):
        self._proxy = proxy

    def __getattr__(self, name: str):
        p = self._proxy
        raise NotImplementedError(
            f"Tensor.grad_fn.{name} of {p.name} ({p.type_string()}) is read inside a function fulmen traces.\n"
            f"  at {_user_location()}\nThe autograd graph of a traced tensor is built when the compiled program "
            "runs, not while fulmen traces it; only `t.grad_fn is None` (whether the tensor has a history) is known. "
            "Read the autograd node outside the compiled function, from a returned tensor.")

    def __call__(self, *args, **kwargs):
        return self.__getattr__("__call__")

    def __repr__(self) -> str:
        return f"<traced grad_fn of {self._proxy.name}>"


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


def call_with_device_views(fn, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` (an executor's checker) with the ``device`` of each proxy in the arguments shown as
    fulmen's ``Device``, the form Thunder's executor API reads (``a.device.devicetype == DeviceType.CPU``); it
    compares equal to the ``torch.device`` the proxy holds, which user code and the rest of fulmen see."""
    held = _tensor_proxies_in((args, kwargs), [])
    if not held:
        return fn(*args, **kwargs)
    devs = [p.device for p in held]
    try:
        for p, d in zip(held, devs):
            p.device = device_view(d)
        return fn(*args, **kwargs)
    finally:
        for p, d in zip(held, devs):
            p.device = d


def _tensor_proxies_in(x: Any, out: list) -> list:
    if isinstance(x, TensorProxy):
        out.append(x)
    elif isinstance(x, (tuple, list)):
        for v in x:
            _tensor_proxies_in(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _tensor_proxies_in(v, out)
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
