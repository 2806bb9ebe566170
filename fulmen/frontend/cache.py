"""Cache keys: everything a compiled program depends on, computed cheaply on every call.

A key holds each tensor's shape, dtype, device and requires_grad (and a lazy conjugate or negative bit), the
values of non-tensor arguments, the structure of containers, and the global state tracing read: grad mode,
autocast, the default dtype and the default device. Tensors found along the way are collected in call order;
they are the program's inputs.

A tensor object passed more than once (``f(x, x)``) is one input, its repeats keyed as such (``same_tensors``).
Otherwise a key says nothing about inputs sharing memory: a program is traced as if distinct tensors did not. For
a program that writes to its inputs that matters (``f(x, x[1:])`` writing to its first argument and reading its
second), so such a program checks, per call, whether an input it writes to shares memory with another
(``aliases_written_input``).
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import sys
from typing import Any

import torch
import torch.utils._python_dispatch as _python_dispatch
from torch.utils._device import DeviceContext as _DeviceContext

from fulmen.core.proxies import Proxy
from fulmen.core.trace import Trace
from fulmen.core.utils import IdentityRef
from fulmen.frontend import module_guard
from fulmen.transforms.passes import overwritten_inputs

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
log = logging.getLogger("fulmen")


_function_modes = torch._C._len_torch_function_stack


_disabled_torch_function = torch._C._disabled_torch_function_impl
_tensor_torch_function = torch.Tensor.__torch_function__.__func__
_disabled_torch_dispatch = torch._C._disabled_torch_dispatch_impl


def overrides_torch(t: torch.Tensor) -> bool:
    """Whether ``t``'s class is a tensor subclass with a ``__torch_function__`` or ``__torch_dispatch__`` of its
    own (a parameter subclass without one, or a plain tensor, has neither): eager runs every operation on it through
    that code, which a compiled program, traced with plain tensors, would not."""
    cls = type(t)
    function = cls.__torch_function__
    overrides = (function is not _disabled_torch_function and getattr(function, "__func__", None) is not
                 _tensor_torch_function) or cls.__torch_dispatch__ is not _disabled_torch_dispatch
    return overrides and not _is_dtensor(t) and not _transparent(t)


#: Subclasses that stand for a plain tensor (module, class): a collective's result that waits for its data on first
#: use, PyTorch's fake and functional tensors (compilation's own). DTensor programs are traced whole instead
#: (fulmen.frontend.dtensor_program).
_TRANSPARENT = (("torch.distributed._functional_collectives", "AsyncCollectiveTensor"),
                ("torch._subclasses.fake_tensor", "FakeTensor"),
                ("torch._subclasses.functional_tensor", "FunctionalTensor"))


def _transparent(t: torch.Tensor) -> bool:
    # none of them exists unless its module was imported
    for module, name in _TRANSPARENT:
        module = sys.modules.get(module)
        if module is not None and isinstance(t, getattr(module, name)):
            return True
    return False


def subclass_error(t: torch.Tensor) -> NotImplementedError:
    return NotImplementedError(
        f"fulmen.jit: a {type(t).__qualname__} tensor is passed in, a subclass of torch.Tensor with its own "
        "__torch_function__ or __torch_dispatch__, which fulmen does not trace (the compiled program would skip "
        "it). Call the function without fulmen.jit for such inputs, or pass a plain tensor "
        "(t.as_subclass(torch.Tensor)).")


def default_device() -> torch.device | None:
    """The device of a ``with torch.device(...)`` block or ``torch.set_default_device``; None when neither is active
    (factory calls make CPU tensors). Such a context is a function mode, so with none on the stack the answer is
    known without asking (``torch.get_default_device`` costs a few microseconds)."""
    return torch.get_default_device() if _function_modes() else None


#: Whether a torch.func transform (grad, vmap, ...) is running: its wrapped tensors pass every tensor check, but a
#: compiled program's autograd.Function and kernels do not take them.
functorch_active = torch._C._are_functorch_transforms_active

_function_mode_stack = torch.overrides._get_current_function_mode_stack
_dispatch_mode_stack = _python_dispatch._get_current_dispatch_mode_stack


def _is_dtensor(t: torch.Tensor) -> bool:
    # no DTensor exists unless its module was imported
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def saved_tensors_hooks() -> tuple | None:
    """The innermost ``torch.autograd.graph.saved_tensors_hooks`` (pack, unpack) in effect, or None."""
    return _top_saved_tensors_hooks(False)


def user_modes_active() -> bool:
    """Whether a ``TorchFunctionMode`` or ``TorchDispatchMode`` of the user's (a logging, counting or rewriting mode,
    ``FlopCounterMode``) is active. Eager runs every operation through it; a compiled program's fused kernels never
    reach it, so such calls run eagerly. A ``with torch.device(...)`` block (keyed as the default device) and
    fulmen's own tracing mode do not count, nor do PyTorch's infrastructure modes (fake, functional tensors)."""
    if _python_dispatch._is_in_non_infra_torch_dispatch_mode and _users(_dispatch_mode_stack()):
        return True
    return bool(_function_modes()) and _users(_function_mode_stack())


# PyTorch's private machinery (AOTAutograd's runtime wrappers run a compiled graph under a mode of theirs) and
# fulmen's own modes; public torch modes (FlopCounterMode) are the user's
_NOT_USERS = ("fulmen.", "torch._")


def _users(modes) -> bool:
    return any(not isinstance(m, _DeviceContext) and not type(m).__module__.startswith(_NOT_USERS) for m in modes)


def global_state_key() -> tuple:
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),  # values computed under it are inference tensors
        torch.get_default_dtype(),
        torch.is_autocast_enabled("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None,
        torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None,
        default_device(),  # factory calls without device= were traced on it
    )


def value_key(x: Any, flat: list[torch.Tensor], seen: dict[int, int] | None = None) -> Any:
    """A hashable description of ``x``; tensors are appended to ``flat``.

    Two arguments get equal keys only when traced code reading them would read the same values: a float by its
    value, sign and NaN-ness (``0.0`` and ``-0.0`` differ, NaN equals NaN), an instance of a user class by its
    structure (``object_key``: its tensors are inputs like any other), another object by a snapshot of its contents
    (``content_key``), never by an address that a freed object's successor can reuse. ``seen``: the holders
    (``object_key``) met so far in the call, by id."""
    t = type(x)
    if t is _Tensor or t is _Parameter or (isinstance(x, _Tensor) and not isinstance(x, Proxy)):
        if t is not _Tensor and t is not _Parameter and overrides_torch(x):
            raise subclass_error(x)  # the call path names the argument (tracing.check_supported_tensors)
        flat.append(x)
        dtype = x.dtype
        # a lazy view (z.conj(), z.conj().imag) flips values with a bit that compiled code would ignore
        if x.is_neg() or (dtype.is_complex and x.is_conj()):
            dtype = (dtype, "conj" if x.is_conj() else "neg")
        # an inference tensor (made under torch.inference_mode; it never requires grad) is keyed None there: traced
        # code reads is_inference(), and eager refuses to write to one outside inference mode
        grad = None if x.is_inference() else x.requires_grad
        if x.is_contiguous():
            return (x.shape, dtype, x.device, grad)
        # traced code decides copy-or-view (contiguous(), reshape, view) from the layout: strides are keyed
        return (x.shape, dtype, x.device, grad, x.stride())
    if t is int or t is bool or t is str or x is None:
        return (t, x)
    if t is float:
        return (float, x) if x == x and x != 0.0 else _float_key(x)
    if t is tuple or t is list:
        return (t, tuple([value_key(v, flat, seen) for v in x]))
    if t is dict:
        return (dict, tuple([(k if type(k) is str else content_key(k), value_key(v, flat, seen))
                             for k, v in x.items()]))
    if isinstance(x, _ATOMS):
        return x
    if isinstance(x, (tuple, list)) and not isinstance(x, torch.Size):  # namedtuples and subclasses: proxify's walk
        return (t, tuple([value_key(v, flat, seen) for v in x]))
    if isinstance(x, dict):
        return (t, tuple([(k if type(k) is str else content_key(k), value_key(v, flat, seen)) for k, v in x.items()]))
    if is_holder(x):
        return object_key(x, flat, seen if seen is not None else {})
    return content_key(x)


# ---- instances of user classes: their tensors are inputs (a Hugging Face cache, a dataclass of tensors) ----
#: The first part of the key of an instance of a user class: ``(OBJECT, class, member names, member keys)``; a holder
#: met before in the same call is ``(ALIAS, its index)``. Holders are the objects and the lists and dicts inside them,
#: numbered in the order the walk meets them (``fulmen.frontend.objects`` swaps proxies into them in that order).
OBJECT = "<object>"
ALIAS = "<alias>"


def holds_objects(key: Any) -> bool:
    """Whether a key describes an instance of a user class (``object_key``) somewhere."""
    if type(key) is not tuple:
        return False
    if len(key) == 4 and key[0] == OBJECT:
        return True
    return any(holds_objects(k) for k in key)


def key_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """Where two keys of one argument first differ: a path into it (``.layers[0].keys``, ``['mask']``) and the two
    parts there; None when they are equal. For recompile reasons."""
    if a == b:
        return None
    if type(a) is not tuple or type(b) is not tuple or is_tensor_key(a) or is_tensor_key(b):
        return path, a, b
    if len(a) == 4 and len(b) == 4 and a[0] == OBJECT and b[0] == OBJECT:
        if a[1] is not b[1] or a[2] != b[2]:
            return path, a[1:3], b[1:3]
        return next(filter(None, (key_difference(x, y, f"{path}.{n}") for n, x, y in zip(a[2], a[3], b[3]))), None)
    if len(a) == 2 and len(b) == 2 and a[0] is b[0] and isinstance(a[0], type) and type(a[1]) is tuple \
            and type(b[1]) is tuple and issubclass(a[0], (tuple, list, dict)) and a[0] is not torch.Size:
        if len(a[1]) != len(b[1]):
            return f"{path} (length)", len(a[1]), len(b[1])
        if issubclass(a[0], dict):
            if [k for k, _ in a[1]] != [k for k, _ in b[1]]:
                return f"{path} (keys)", [k for k, _ in a[1]], [k for k, _ in b[1]]
            parts = ((f"{path}[{k!r}]", x, y) for (k, x), (_, y) in zip(a[1], b[1]))
        else:
            parts = ((f"{path}[{i}]", x, y) for i, (x, y) in enumerate(zip(a[1], b[1])))
        return next(filter(None, (key_difference(x, y, p) for p, x, y in parts)), None)
    return path, a, b


def describe_key_part(k: Any) -> str:
    """A part of a key in words: ``cpu float32[1, 6]`` for a tensor, the class and members of an object."""
    if is_same_key(k):
        return f"the same tensor object as tensor input {k[1]}"
    if is_tensor_key(k):
        dtype = k[1][0] if type(k[1]) is tuple else k[1]
        grad = ", requires_grad" if k[3] else ""
        return f"{k[2]} {str(dtype).removeprefix('torch.')}[{', '.join(map(str, k[0]))}]{grad}"
    if type(k) is tuple and len(k) == 2 and isinstance(k[0], type) and k[0].__name__ in ("int", "float", "bool",
                                                                                          "str", "NoneType"):
        return repr(k[1])
    if type(k) is tuple and len(k) == 2 and isinstance(k[0], type) and type(k[1]) is tuple and issubclass(
            k[0], (tuple, list, dict)):
        return f"a {k[0].__name__} of {len(k[1])}"
    if type(k) is tuple and len(k) == 4 and k[0] == OBJECT:
        return f"a {k[1].__name__}"
    if type(k) is tuple and len(k) == 2 and isinstance(k[0], type) and type(k[1]) is tuple:  # class, member names
        return f"a {k[0].__name__} with members {', '.join(k[1])}"
    text = repr(k)
    return text if len(text) < 80 else text[:77] + "..."


def is_holder(x: Any) -> bool:
    """Whether ``x`` is an instance of a user class whose members are walked (its tensors become inputs): not a
    module (keyed by identity and contents), a class, an enum, or a subclass of a builtin value type."""
    t = type(x)
    return bool(t.__flags__ & _HEAPTYPE) and not isinstance(x, _NOT_HOLDERS) and not _is_native(t)


@functools.lru_cache(maxsize=256)
def _is_native(t: type) -> bool:
    """Whether ``t`` is (or derives from) a C++ class bound with pybind11 (a ``ProcessGroup``): its state is out of
    Python's sight, so its instances are keyed by identity, never by their (empty) Python members."""
    return any(c.__name__ == "pybind11_object" and c.__module__ == "pybind11_builtins" for c in t.__mro__)


def member_names(x: Any) -> tuple[str, ...]:
    """The names of an object's members: its ``__dict__`` in order, then its slots that are set."""
    attrs = getattr(x, "__dict__", None)
    names = tuple(attrs) if attrs is not None else ()
    slots = _slots(type(x))
    if slots:
        names += tuple(n for n in slots if _slot_value(x, n) is not _UNSET)
    return names


def member_values(x: Any) -> list[Any]:
    """The values of ``member_names(x)``, in that order."""
    attrs = getattr(x, "__dict__", None)
    values = list(attrs.values()) if attrs is not None else []
    slots = _slots(type(x))
    if slots:
        values += [v for v in (_slot_value(x, n) for n in slots) if v is not _UNSET]
    return values


_UNSET = object()


def _slot_value(x: Any, name: str) -> Any:
    try:
        return object.__getattribute__(x, name)
    except AttributeError:
        return _UNSET


def object_key(x: Any, flat: list[torch.Tensor], seen: dict[int, int]) -> Any:
    """The key of an instance of a user class: its class, member names and each member's key, recursively (lists
    and dicts inside by their items). Tensors inside are appended to ``flat``: they are inputs, keyed by shape, dtype
    and device as arguments are. An object too large or too deep (``MAX_CONTENT_ITEMS``, ``MAX_CONTENT_DEPTH``) is
    keyed by ``content_key`` (by identity) instead, its tensors read as captured ones."""
    n, holders = len(flat), dict(seen)
    try:
        return _object_key(x, flat, seen, [MAX_CONTENT_ITEMS], 0)
    except _TooLarge:
        del flat[n:]
        seen.clear()
        seen.update(holders)
        return content_key(x)


def _alias_or_number(x: Any, seen: dict[int, int]) -> tuple | None:
    """``(ALIAS, n)`` for a holder the walk met before as its ``n``-th; otherwise numbers it and returns None."""
    index = seen.get(id(x))
    if index is not None:
        return (ALIAS, index)
    seen[id(x)] = len(seen)
    return None


def _object_key(x: Any, flat: list, seen: dict[int, int], budget: list[int], depth: int) -> Any:
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_CONTENT_DEPTH:
        raise _TooLarge
    alias = _alias_or_number(x, seen)
    if alias is not None:
        return alias
    return (OBJECT, type(x), member_names(x), tuple([_member_key(v, flat, seen, budget, depth + 1)
                                                     for v in member_values(x)]))


def _member_key(v: Any, flat: list, seen: dict[int, int], budget: list[int], depth: int) -> Any:
    t = type(v)
    if t is _Tensor or t is _Parameter or isinstance(v, _Tensor):
        return value_key(v, flat)
    if t is int or t is bool or t is str or v is None or t is float:
        return value_key(v, flat)
    if isinstance(v, (list, dict)):  # mutable holders inside an object: numbered, updated in place
        budget[0] -= len(v)
        if budget[0] < 0 or depth > MAX_CONTENT_DEPTH:
            raise _TooLarge
        alias = _alias_or_number(v, seen)
        if alias is not None:
            return alias
        if isinstance(v, list):
            return (t, tuple([_member_key(e, flat, seen, budget, depth + 1) for e in v]))
        return (t, tuple([(k if type(k) is str else content_key(k), _member_key(e, flat, seen, budget, depth + 1))
                             for k, e in v.items()]))
    if isinstance(v, tuple) and t is not torch.Size:  # by its items, as value_key and the prologue read a tuple
        budget[0] -= len(v)
        return (t, tuple([_member_key(e, flat, seen, budget, depth + 1) for e in v]))
    if is_holder(v):
        return _object_key(v, flat, seen, budget, depth)
    return _content(v, budget, depth)


_ATOMS = (torch.dtype, torch.device, torch.memory_format, torch.layout)


def _float_key(x: float) -> tuple:
    # 0.0 == -0.0 and NaN != NaN: keyed by text and sign bit so that -0.0 gets its own entry and NaN hits
    return (type(x), repr(float(x)), math.copysign(1.0, x))


#: How many values a snapshot of one argument's contents may hold, and how deep it follows attributes; beyond
#: that the argument is keyed by identity (logged: changing it in place between calls is then not seen).
MAX_CONTENT_ITEMS = 1024
MAX_CONTENT_DEPTH = 6


class _TooLarge(Exception):
    pass


def content_key(x: Any) -> Any:
    """A hashable snapshot of the value of ``x`` as Python code can read it: the contents of sets, bytearrays and
    NumPy arrays, the attributes of instances of user classes (dataclasses, configs), recursively. Tensors inside
    are keyed by identity: traced code reads them as captured inputs, by identity."""
    try:
        return _content(x, [MAX_CONTENT_ITEMS], 0)
    except _TooLarge:
        _warn_identity(x)
        return IdentityRef(x)


def _content(x: Any, budget: list[int], depth: int) -> Any:
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_CONTENT_DEPTH:
        raise _TooLarge
    t = type(x)
    if t is int or t is bool or t is str or t is bytes or x is None:
        return (t, x)
    if isinstance(x, float):
        return (t, x) if x == x and x != 0.0 else _float_key(x)
    if isinstance(x, (int, str, bytes)):  # subclasses (IntEnum, a str enum): by type and value
        return (t, x)
    if isinstance(x, complex):
        return (t, _content(x.real, budget, depth), _content(x.imag, budget, depth))
    if isinstance(x, _Tensor) or isinstance(x, Proxy):
        return IdentityRef(x)
    if isinstance(x, (tuple, list, set, frozenset)):  # in iteration order: the order traced code sees
        return (t, tuple([_content(v, budget, depth + 1) for v in x]))
    if isinstance(x, dict):
        return (t, tuple([(_content(k, budget, depth + 1), _content(v, budget, depth + 1)) for k, v in x.items()]))
    if isinstance(x, bytearray):
        return (t, bytes(x))
    if t is slice:  # unhashable before Python 3.12
        return (t, _content(x.start, budget, depth), _content(x.stop, budget, depth), _content(x.step, budget, depth))
    if isinstance(x, _ATOMS) or isinstance(x, enum.Enum):
        return x
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(x, (numpy.ndarray, numpy.generic)):
        budget[0] -= x.nbytes // 8
        if budget[0] < 0 or x.dtype.hasobject:  # an array of Python objects: its bytes are their addresses
            raise _TooLarge
        return (t, x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, torch.nn.Module):
        # a module passed in: by identity, and by the submodules, parameters and buffers it holds now, which traced
        # code reaches through nn.Module.__getattr__ and reads by identity (a parameter replaced recompiles), and by
        # the rest of its tree's structure as a jitted module is (train/eval, plain attributes, configs, hooks:
        # fulmen.frontend.module_guard)
        return (t, IdentityRef(x), tuple((name, IdentityRef(m)) for name, m in x.named_modules(remove_duplicate=False)),
                tuple((name, IdentityRef(v)) for name, v in x.named_parameters(remove_duplicate=False)),
                tuple((name, IdentityRef(v)) for name, v in x.named_buffers(remove_duplicate=False)),
                module_guard.structure(x))
    if t.__flags__ & _HEAPTYPE and not isinstance(x, type) and not _is_native(t):  # an instance of a user class
        attrs = getattr(x, "__dict__", None)
        items = [] if attrs is None else [(k, _content(v, budget, depth + 1)) for k, v in attrs.items()]
        for name in _slots(t):
            v = getattr(x, name, IdentityRef)  # an unset slot: IdentityRef, the class, as a marker
            items.append((name, IdentityRef if v is IdentityRef else _content(v, budget, depth + 1)))
        return (t, tuple(items))
    try:
        hash(x)
    except TypeError:  # an object whose contents cannot be read: by identity
        raise _TooLarge from None
    return (t, x)  # functions, classes, modules, C objects: by hash and equality (held by the key)


_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined by Python code
_NOT_HOLDERS = (torch.nn.Module, type, enum.Enum, int, float, complex, str, bytes, bytearray, tuple, list, dict, set,
                frozenset, _Tensor, Proxy)


@functools.lru_cache(maxsize=1024)
def _slots(cls: type) -> tuple[str, ...]:
    names = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [s for s in slots if s not in ("__dict__", "__weakref__")]
    return tuple(names)


_warned_identity: set[type] = set()


def _warn_identity(x: Any) -> None:
    if type(x) not in _warned_identity:
        _warned_identity.add(type(x))
        log.warning("fulmen: an argument of type %s is keyed by identity (its contents are too large, too deep or "
                    "cannot be read: more than %d values or %d levels): a new object recompiles, but changing this "
                    "one in place between calls is not seen. Pass the values the function reads as tensors or "
                    "numbers instead.", type(x).__name__, MAX_CONTENT_ITEMS, MAX_CONTENT_DEPTH)


def state_key(tensors: list[torch.Tensor], flat: list[torch.Tensor]) -> tuple:
    """The key of a module's parameters and buffers (never lazy conjugate or negative views)."""
    flat += tensors
    return tuple((t.shape, t.dtype, t.device, t.requires_grad) if t.is_contiguous()
                 else (t.shape, t.dtype, t.device, t.requires_grad, t.stride()) for t in tensors)


def is_tensor_key(x: Any) -> bool:
    """Whether ``x`` is the part of a key describing one tensor (``value_key``): ``(shape, dtype, device,
    requires_grad)`` for a contiguous tensor, with its strides as a fifth part for any other; requires_grad is None
    for an inference tensor."""
    return type(x) is tuple and (len(x) == 4 or len(x) == 5) and type(x[0]) is torch.Size


def tensor_keys(key: Any, out: list | None = None) -> list[tuple]:
    """The parts of a key describing tensors, in flat-input order."""
    out = out if out is not None else []
    if is_tensor_key(key):
        out.append(key)
    elif type(key) is tuple:
        for v in key:
            tensor_keys(v, out)
    return out


def lazy_view_inputs(key: Any) -> list[int]:
    """Positions, among the flat inputs, of the tensors whose key says they carry a lazy conjugate or negative bit
    (``value_key``): a program gets them resolved (``resolve_conj``/``resolve_neg``)."""
    return [i for i, k in enumerate(tensor_keys(key)) if type(k[1]) is tuple]




def args_key(args: tuple, kwargs: dict, flat: list[torch.Tensor], same: bool = True,
             state: frozenset[int] = frozenset()) -> tuple:
    """The key of a call's arguments; their tensors are appended to ``flat``, each object once (``same_tensors``)
    unless ``same`` is False. ``state``: the ids of a module's parameters and buffers, already in ``flat``; an
    argument that is one of them (``m(m.weight)``) is keyed as that input again."""
    seen: dict[int, int] = {}
    start = len(flat)
    key = tuple(value_key(a, flat, seen) for a in args)
    if kwargs:
        key += (("kwargs",) + tuple((k, value_key(v, flat, seen)) for k, v in kwargs.items()),)
    if same and len(flat) > start and (len(set(map(id, flat[start:]))) < len(flat) - start
                                       or not state.isdisjoint(map(id, flat[start:]))):
        key = same_tensors(key, flat, start)
    return key


#: The key of a tensor argument that is the very object met before in the same call: ``(SAME, its flat index)``.
SAME = "<same tensor>"


def same_tensors(key: Any, flat: list[torch.Tensor], start: int) -> Any:
    """A call passing one tensor object more than once (``f(a, a)``, ``mha(x, x, x)``): each repeat's key becomes
    ``(SAME, index)`` of its first occurrence in ``flat``, from which the repeats are removed. Traced code then sees
    one proxy (``x is y`` holds, a write through one is read through the other), and the prologue checks the
    pattern: ``y is x`` for a repeat, all others distinct (``fulmen.frontend.prologue``). The tensors before
    ``start`` (a module's parameters and buffers) count as met: an argument that is one of them is keyed as it."""
    first: dict[int, int] = {id(t): i for i, t in enumerate(flat[:start])}
    kept = flat[:start]
    positions = iter(range(start, len(flat)))

    def walk(k: Any) -> Any:
        if is_tensor_key(k):
            t = flat[next(positions)]
            index = first.get(id(t))
            if index is not None:
                return (SAME, index)
            first[id(t)] = len(kept)
            kept.append(t)
            return k
        return tuple([walk(v) for v in k]) if type(k) is tuple else k

    key = walk(key)
    flat[:] = kept
    return key


def is_same_key(key: Any) -> bool:
    """Whether ``key`` is a repeated tensor's (``same_tensors``)."""
    return type(key) is tuple and len(key) == 2 and key[0] == SAME


def written_inputs(trace: Trace) -> frozenset[int]:
    """Positions, among a trace's inputs, of those its program writes to."""
    names = overwritten_inputs(trace)
    return frozenset(i for i, p in enumerate(trace.args) if p.name in names)


def read_tensor_ids(spec) -> frozenset[int]:
    """The ids of the tensors a trace (its ``InputSpec``) read from globals, closures and objects: those it
    captured as inputs and those its global guard checks by identity."""
    ids = frozenset(map(id, spec.captured))
    return ids | spec.guard.tensor_ids() if spec.guard is not None else ids


def passes_a_read_tensor(flat: list, read: frozenset[int], start: int, n_captured: int) -> bool:
    """Whether an argument (past the ``start`` tensors of a module's state, before the ``n_captured`` ones the code
    read from globals and closures) is one of the tensors, by id, the traced code read from a global, a closure
    or an object (``read``): the trace holds two inputs where eager has one object (``x is W`` was False)."""
    return not read.isdisjoint(map(id, flat[start : len(flat) - n_captured]))


def aliases_written_input(flat: list[torch.Tensor], written: frozenset[int], start: int = 0) -> bool:
    """Whether an input at a ``written`` position shares memory with another input. Inputs before ``start`` (a
    module's parameters and buffers, keyed by identity) are checked only against the written ones."""
    if len(flat) < 2:
        return False
    targets: set[int] = set()
    for i in written:
        ptr = flat[i].untyped_storage().data_ptr()
        if ptr:  # 0: no memory (an empty tensor)
            if ptr in targets:
                return True
            targets.add(ptr)
    # past the tensors, the objects a program updates (``fulmen.frontend.objects``)
    return bool(targets) and any(
        j not in written and isinstance(flat[j], _Tensor) and flat[j].untyped_storage().data_ptr() in targets
        for j in range(start, len(flat)))
