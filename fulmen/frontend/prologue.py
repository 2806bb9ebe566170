"""The prologue: what a call must match to reuse a compiled program, as Python source that is the check that runs.

A cache entry's prologue is generated from the key it was compiled for (``fulmen.frontend.cache``), one check
per fact of the key: each tensor's type, shape, dtype, device, ``requires_grad`` and lazy conjugate/negative
bit; each non-tensor value; the structure of containers and of the call (how many arguments, which keywords);
for a module, the version of its structure and its parameters' and buffers' metadata; the global state (grad
mode, default dtype, autocast); then the guards tracing recorded (the relations between dynamic sizes, the
globals and closure variables the code read). ``fulmen.last_prologue_traces(f)`` prints the very string that
is compiled and called on every call that reuses the program: ``prologue(...)`` returns the program's flat
tensor inputs, or None when a check fails. The cache's dictionary lookup by key only finds the candidate.

Values reach the source through a constants table (``c0``, ``c1``, ...), never as text: only ints, bools and
None are written literally; comments show values shortened to one line.

The tensors' checks come last, after the structure that reaches them: when the tensors the program was compiled
for are given (``examples``), one call of PyTorch's C++ ``TensorGuards`` (Dynamo's tensor check) first compares
every tensor's exact type, dispatch keys (device, lazy conjugate and negative bits), dtype, device index,
``requires_grad``, sizes and strides with theirs, the dynamic sizes left out. It accepts a subset of what the
per-tensor checks accept (its sizes and strides are the key's; every other fact it takes from an example tensor
that was verified to have the key's), so the per-tensor checks run, and decide, only when it finds a difference
(a tensor subclass, another stride of a size-1 dimension): the printed checks are still what a call must pass.
"""

from __future__ import annotations

import builtins
import itertools
import linecache
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fulmen.core.codeutils import sanitize_name
from fulmen.core.proxies import Proxy
from fulmen.frontend.cache import (
    ALIAS,
    OBJECT,
    content_key,
    default_device,
    functorch_active,
    is_same_key,
    is_tensor_key,
    member_names,
    member_values,
    overrides_torch,
    user_modes_active,
    value_key,
)
from fulmen.frontend.dynamic import int_carrier
from fulmen.frontend.training_state import GradOf

_LITERAL = (int, bool, type(None))
_Parameter = torch.nn.Parameter
_counter = itertools.count()
_HEADER = ("# Constructed by prologue: what a call must match to reuse the compiled program.\n"
           "# This source is the check that runs: it is compiled once and called on every call that reuses the\n"
           "# program; it returns the program's tensor inputs, or None (the call misses and compiles).\n")


def _short(v: Any) -> str:
    text = " ".join(repr(v).split())
    return text if len(text) <= 60 else text[:57] + "..."


def _dict_keys(d: dict) -> tuple:
    """The keys of a dict as its cache key holds them."""
    return tuple([k if type(k) is str else content_key(k) for k in d])


def _key_of(v: Any) -> Any:
    """The key of a value that holds no tensor input (``value_key`` with nowhere to put tensors)."""
    return value_key(v, [])


class Prologue:
    """``source`` is the prologue's text; ``check`` is the function that text defines."""

    def __init__(self, source: str, env: dict[str, Any]):
        self.source = source
        # registered with linecache under a name of its own: tracebacks and inspect.getsource show this text
        filename = f"<fulmen prologue {next(_counter)}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        exec(compile(source, filename, "exec"), env)
        self.check: Callable = env["prologue"]
        self.fast: Any = None  # the one C++ check of the tensors (build_prologue), or None
        weakref.finalize(self, linecache.cache.pop, filename, None)

    def __str__(self) -> str:
        return self.source

    __repr__ = __str__


def _none_is(x: Any, tensors: Sequence) -> bool:
    return all(x is not t for t in tensors)


def _distinct_grads(grads: tuple, others: tuple) -> bool:
    return len(set(map(id, grads))) == len(grads) and all(g is not t for g in grads for t in others)


class _Writer:
    def __init__(self, symbolic=None):
        self.dims = symbolic.dims if symbolic is not None else {}  # flat input -> its dynamic dims
        # the symbolic ints, by slot (fulmen.frontend.dynamic.map_call_ints)
        self.int_slots = symbolic.int_slots if symbolic is not None else frozenset()
        self.n_ints = 0  # the ints of the arguments met so far (the next one's slot)
        self.int_exprs: dict[int, str] = {}  # symbolic slot -> the expression reading it
        self.env: dict[str, Any] = {"Tensor": torch.Tensor, "math": math, "torch": torch, "Proxy": Proxy,
                                    "overrides_torch": overrides_torch, "_dict_keys": _dict_keys,
                                    "_key_of": _key_of, "_member_names": member_names, "_member_values": member_values}
        self.holders: list[str] = []  # the expressions of the holders (objects, lists and dicts inside them) in order
        self._in_object = 0  # how many objects the walk is inside: their lists and dicts are holders too
        self.lines: list[str] = []
        self.flat: list[str] = []  # the expressions of the tensor inputs, in order
        # per tensor input, in order: (its check's condition, its comment, its key, dynamic dims, module state)
        self.tensor_checks: list[tuple[str, str, tuple, frozenset, bool]] = []
        self.inference_checks: list[str] = []  # TensorGuards does not tell inference tensors from others
        self.names: set[str] = set(self.env) | {"args", "kwargs", "params", "version", "prologue", "device"}
        self._consts: dict[Any, str] = {}
        self._keep: list[Any] = []
        self._n_unnamed = 0
        if symbolic is not None:  # the symbols are the guards' names: no value of the prologue may take one
            self.names |= {str(sym) for sym, *_ in symbolic.symbols} | {str(sym) for sym, _ in symbolic.int_symbols}

    def name(self, hint: str) -> str:
        base = sanitize_name(hint)
        name, i = base, 0
        while name in self.names:
            i += 1
            name = f"{base}_{i}"
        self.names.add(name)
        return name

    def const(self, value: Any, hint: str | None = None) -> str:
        if type(value) in _LITERAL:
            return repr(value)
        if isinstance(value, type) and getattr(builtins, value.__name__, None) is value:
            return value.__name__  # int, float, tuple, dict, ...
        ident = (type(value), value) if isinstance(value, (torch.dtype, torch.device, type)) else id(value)
        name = self._consts.get(ident)
        if name is None:
            if hint is None:
                hint, self._n_unnamed = f"c{self._n_unnamed}", self._n_unnamed + 1
            name = self._consts[ident] = self.name(hint)
            self.env[name] = value
            self._keep.append(value)  # ids stay unique while the table is built
        return name

    def check(self, condition: str, comment: str | None = None, indent: str = "") -> None:
        if comment:
            self.lines += [f"{indent}# {line}" for line in comment.split("\n")]
        self.lines.append(f"{indent}if not ({condition}):")
        self.lines.append(f"{indent}    return None")

    # ---- one fact of a key, read from the expression ``expr`` ----
    def value(self, key: Any, expr: str, label: str) -> None:
        if is_tensor_key(key):
            self.tensor(key, expr, label)
            return
        if type(key) is tuple and len(key) == 4 and key[0] == OBJECT:
            self.object(key, expr, label)
            return
        if is_same_key(key):
            self.check(f"{expr} is {self.flat[key[1]]}", f"{label}: the tensor {self.flat[key[1]]} again")
            return
        if type(key) is tuple and len(key) == 2 and key[0] == ALIAS:
            self.check(f"{expr} is {self.holders[key[1]]}", f"{label}: the object {self.holders[key[1]]} again")
            return
        if self._in_object and type(key) is tuple and len(key) == 2 and isinstance(key[0], type) \
                and issubclass(key[0], (list, dict)):
            self.holders.append(expr)
        if type(key) is tuple and len(key) == 2 and isinstance(key[0], type):
            t, inner = key
            if t is int and type(inner) is int:
                slot, self.n_ints = self.n_ints, self.n_ints + 1
                if slot in self.int_slots:  # symbolic: its value is bound below and checked by the guards
                    self.int_exprs[slot] = expr
                    self.check(f"type({expr}) is int", f"{label}: an int, symbolic (traced with {inner})")
                    return
            if t in (int, bool, str, type(None)):
                self.check(f"type({expr}) is {self.const(t)} and {expr} == {self.const(inner)}",
                           f"{label}: {_short(inner)}")
                return
            if t is float:  # a nonzero number (0.0, -0.0 and NaN have a key of three parts: _key_of below)
                self.check(f"type({expr}) is float and {expr} == {self.const(inner)}", f"{label}: {_short(inner)}")
                return
            if issubclass(t, (tuple, list)) and t is not torch.Size and type(inner) is tuple:
                self.sequence(t, inner, expr, label)
                return
            if issubclass(t, dict) and type(inner) is tuple:
                self.mapping(t, inner, expr, label)
                return
        # an atom is its own key (``value_key``), and only an atom's key is one: a dtype is a singleton, a device is
        # compared by value
        if type(key) is torch.dtype:
            self.check(f"{expr} is {self.const(key, str(key).removeprefix('torch.'))}", f"{label}: {key}")
            return
        if type(key) is torch.device:
            self.env["device"] = torch.device
            self.check(f"type({expr}) is device and {expr} == {self.const(key)}", f"{label}: {key}")
            return
        # a float 0.0, -0.0 or NaN, another atom (memory format, layout), an object keyed by its contents or identity
        if type(key) is tuple and len(key) == 3 and key[0] is float:
            shown = f"float {key[1]} (compared by sign and NaN-ness)"
        elif type(key) is tuple and len(key) == 2 and isinstance(key[0], type):
            shown = f"a {key[0].__name__} equal in contents to {_short(key[1])}"
        else:
            shown = _short(key)
        self.check(f"_key_of({expr}) == {self.const(key)}", f"{label}: {shown}")

    def object(self, key: tuple, expr: str, label: str) -> None:
        """An instance of a user class (``fulmen.frontend.cache.object_key``): its class, its member names, and
        each member as a value of its own."""
        _, t, names, keys = key
        self.holders.append(expr)
        self.check(f"type({expr}) is {self.const(t, t.__name__)} and _member_names({expr}) == {self.const(names)}",
                   f"{label}: a {t.__name__} with members {_short(names)}")
        if names:
            values = [self.name(f"{label}_{n}") for n in names]
            self.lines.append(f"{', '.join(values)}{',' if len(values) == 1 else ''} = _member_values({expr})")
            self._in_object += 1
            for k, name in zip(keys, values):
                self.value(k, name, name)
            self._in_object -= 1

    def sequence(self, t: type, keys: tuple, expr: str, label: str) -> None:
        self.check(f"type({expr}) is {self.const(t)} and len({expr}) == {len(keys)}",
                   f"{label}: a {t.__name__} of {len(keys)}")
        if keys:
            names = [self.name(f"{label}_{i}") for i in range(len(keys))]
            self.lines.append(f"{', '.join(names)}{',' if len(names) == 1 else ''} = {expr}")
            for k, name in zip(keys, names):
                self.value(k, name, name)

    def mapping(self, t: type, items: tuple, expr: str, label: str) -> None:
        keys = tuple(k for k, _ in items)
        self.check(f"type({expr}) is {self.const(t)} and _dict_keys({expr}) == {self.const(keys)}",
                   f"{label}: a {t.__name__} with keys {_short(keys)}")
        if items:
            names = [self.name(f"{label}_{k}" if type(k) is str else f"{label}_{i}") for i, (k, _) in enumerate(items)]
            self.lines.append(f"{', '.join(names)}{',' if len(names) == 1 else ''} = {expr}.values()")
            for (_, k), name in zip(items, names):
                self.value(k, name, name)

    def tensor(self, key: tuple, expr: str, label: str, bits: bool = True, state: bool = False) -> None:
        """``bits=False``: the lazy conjugate and negative bits are not part of the key (a module's parameters).
        ``state``: a module's parameter or buffer, which is a proxy only while a trace has swapped proxies in, a
        case the module's call path tells apart before the prologue runs (``_ModuleProgram.__call__``)."""
        shape, dtype, device, requires_grad, *strides = key
        lazy = None
        if type(dtype) is tuple:
            dtype, lazy = dtype
        index = len(self.flat)
        self.flat.append(expr)
        dynamic = self.dims.get(index)
        if dynamic:
            sizes = [f"{expr}.shape[{d}] == {s}" for d, s in enumerate(shape) if d not in dynamic]
            shape_test = " and ".join([f"len({expr}.shape) == {len(shape)}", *sizes])
            shown = ", ".join("?" if d in dynamic else str(s) for d, s in enumerate(shape))
        else:
            shape_test = f"{expr}.shape == {tuple(int(s) for s in shape)!r}"
            shown = ", ".join(str(s) for s in shape)
        dtype_name = self.const(dtype, str(dtype).removeprefix("torch."))
        device_name = self.const(device, f"{device.type}{device.index if device.index is not None else ''}")
        # a proxy is a Tensor too: a jitted function called inside another's trace runs its Python code on the proxies
        # a subclass with its own __torch_function__ or __torch_dispatch__ is refused (fulmen.frontend.cache)
        terms = [f"isinstance({expr}, Tensor)", *([] if state else [f"not isinstance({expr}, Proxy)"]),
                 f"not overrides_torch({expr})", shape_test,
                 f"{expr}.dtype is {dtype_name}", f"{expr}.device == {device_name}",
                 f"{expr}.requires_grad is {bool(requires_grad)}",  # None: an inference tensor, which never does
                 f"{expr}.stride() == {tuple(strides[0])!r}" if strides else f"{expr}.is_contiguous()"]
        if not state:  # a module's state is keyed by identity; checked for all tensors at once (``tensors``)
            self.inference_checks.append(f"{expr}.is_inference()" if requires_grad is None else
                                         f"not {expr}.is_inference()")
        if lazy == "conj":
            terms.append(f"{expr}.is_conj()")
        elif lazy == "neg":
            terms += [f"{expr}.is_neg()"] + ([f"not {expr}.is_conj()"] if dtype.is_complex else [])
        elif bits:
            terms += [f"not {expr}.is_neg()"] + ([f"not {expr}.is_conj()"] if dtype.is_complex else [])
        grad = ", requires_grad" if requires_grad else ", an inference tensor" if requires_grad is None else ""
        layout = f", strides {tuple(strides[0])}" if strides else ", contiguous"
        comment = (f"{label}: {device} {str(dtype).removeprefix('torch.')}[{shown}]{grad}{layout}"
                   + (f", a lazy {'conjugate' if lazy == 'conj' else 'negative'} view" if lazy else ""))
        self.tensor_checks.append((" and ".join(terms), comment, key, frozenset(dynamic or ()), state))

    def tensors(self, examples: list[torch.Tensor] | None, fast: Any) -> Any:
        """The checks of the tensor inputs, behind one ``TensorGuards`` check of them all when ``fast`` (or one
        built from ``examples``, the tensors the key was computed from) is given; returns that check."""
        checks = self.tensor_checks
        if fast is None and examples is not None:
            fast = tensor_guards([c[2] for c in checks], [c[3] for c in checks], [c[4] for c in checks], examples)
        if fast is None or not checks:
            for condition, comment, *_ in checks:
                self.check(condition, comment)
            self._inference_check()
            return fast
        name = self.const(fast.guards, "tensor_guards")
        exprs = ", ".join(self.flat[: len(checks)])
        contiguous = "".join(f" or not {e}.is_contiguous()" for e, (_, _, k, d, _) in zip(self.flat, checks)
                             if d and len(k) == 4)
        self.lines += [f"# the {len(checks)} tensors: type, device, dtype, lazy bits, requires_grad, sizes and strides "
                       "as compiled for, in one C++ check",
                       "# (torch's TensorGuards); the checks below decide when it finds any difference",
                       f"if not {name}.check({exprs}){contiguous}:"]
        for condition, comment, *_ in checks:
            self.check(condition, comment, indent="    ")
        self._inference_check(fast)
        return fast

    def symbolic_guards(self, symbolic) -> list[str]:
        """The relations tracing assumed between the dynamic sizes and ints (``fulmen.frontend.dynamic``); returns
        the carriers the program reads each symbolic int from."""
        for sym, i, d in symbolic.symbols:
            self.lines.append(f"{sym} = {self.flat[i]}.shape[{d}]")
        for sym, slot in symbolic.int_symbols:
            self.lines.append(f"{sym} = {self.int_exprs[slot]}")
        self.check(symbolic.guard_source(), "the guards on the dynamic sizes and ints")
        if not symbolic.int_symbols:
            return []
        carrier = self.const(int_carrier, "int_carrier")
        return [f"{carrier}({sym})" for sym, _ in symbolic.int_symbols]

    def _inference_check(self, fast: _TensorsCheck | None = None) -> None:
        """Right after the ``TensorGuards`` block when ``fast``: the per-tensor checks run inside that block (the C++
        check failed), and where it passed, a comparison of the dispatch TLS may stand for them."""
        if not self.inference_checks:
            return
        each = " and ".join(self.inference_checks)
        comment = "inference tensors where compiled for them, only there"
        if fast is None or fast.dispatch_tls is None or len(self.inference_checks) < MIN_TENSORS_FOR_TLS:
            self.check(each, comment)
            return
        self.check(each, comment, indent="    ")
        # TensorGuards compares each tensor's dispatch keys as the thread's dispatch TLS leaves them: under the TLS it
        # was built with (no autograd key included or excluded) a tensor passes only with the autograd keys of the
        # one compiled for, and an inference tensor is one without them. Under another TLS the tensors are asked.
        include, exclude = (self.const(ks, n) for ks, n in zip(fast.dispatch_tls, ("tls_include", "tls_exclude")))
        now_include = self.const(torch._C._dispatch_tls_local_include_set, "dispatch_include")
        now_exclude = self.const(torch._C._dispatch_tls_local_exclude_set, "dispatch_exclude")
        self.lines += [f"# {comment}: where the C++ check passed, implied by it while the dispatch TLS is the one it "
                       "was built under",
                       f"elif not (({now_include}() == {include} and {now_exclude}() == {exclude}) or ({each})):",
                       "    return None"]

    def distinct(self, start: int) -> None:
        """The tensor inputs from ``start`` on (a call's, past a module's state) are distinct objects: the program
        was traced with one proxy each, and a call passing one of them twice (``f(a, a)``) was traced otherwise
        (``fulmen.frontend.cache.same_tensors``)."""
        exprs = self.flat[start:]
        if len(exprs) < 2:
            return
        if len(exprs) <= 10:  # pairwise `is not` is cheaper than a set of ids up to about ten tensors
            condition = " and ".join(f"{a} is not {b}" for i, a in enumerate(exprs) for b in exprs[i + 1:])
        else:
            condition = f"len({{{', '.join(f'id({e})' for e in exprs)}}}) == {len(exprs)}"
        self.check(condition, f"the {len(exprs)} tensor arguments are distinct objects")

    def params(self, version: int, param_keys: tuple, param_names: list[str]) -> None:
        """A module's structure ``version`` and its parameters and buffers: ``params``, named ``param_names``."""
        self.check(f"version == {version}", "the module tree's structure (fulmen.frontend.module_guard) is the one "
                   "traced")
        self.check(f"len(params) == {len(param_keys)}", f"{len(param_keys)} parameter(s) and buffer(s)")
        names = [self.name(param_names[i] if i < len(param_names) else f"p{i}") for i in range(len(param_keys))]
        if names:
            self.lines.append(f"{', '.join(names)}{',' if len(names) == 1 else ''} = params")
        for k, name in zip(param_keys, names):
            self.tensor(k, name, name, bits=False, state=True)

    def none_of_state(self, start: int, state: Any) -> None:
        """The tensor inputs from ``start`` on (a module call's arguments) are none of the module's parameters and
        buffers (``params``), which a call passing one (``m(m.weight)``) was keyed and traced as. ``state`` knows
        their ids (``fulmen.frontend.module``'s ``_ModuleState``: ``known_ids``, else ``ids(params)``)."""
        exprs = self.flat[start:]
        if not start or not exprs:
            return
        self.env["state"] = state
        self.env["_none_is"] = _none_is
        self.names |= {"state", "state_ids", "_none_is"}
        self.lines.append("state_ids = state.known_ids or state.ids(params)")
        # an id found may be a freed tensor's (a wrapper such as FSDP2 registers new parameter objects each call): the
        # tensors themselves decide then
        self.check(" and ".join(f"(id({e}) not in state_ids or _none_is({e}, params))" for e in exprs),
                   f"the {len(exprs)} tensor argument(s) are none of the module's parameters and buffers")

    def grads_read(self, captured: Sequence) -> list[str]:
        """The expressions of the ``captured`` inputs, where a ``GradOf`` is its tensor's ``.grad`` now (which
        ``check_globals()`` checked), read into a local that is checked to be none of the other inputs: the program
        was traced with one input each (``x is p.grad`` was False)."""
        exprs, grads = [], []
        for c in captured:
            if type(c) is GradOf:
                name = self.name("grad")
                self.lines.append(f"{name} = {self.const(c.owner, 'grad_of')}.grad")
                grads.append(name)
                exprs.append(name)
            else:
                exprs.append(self.const(c, "captured"))
        if len(grads) > 1 or self.flat:
            self.env["_distinct_grads"] = _distinct_grads
            self.names.add("_distinct_grads")
            others = "".join(f"{e}, " for e in self.flat)
            self.check(f"_distinct_grads(({', '.join(grads)},), ({others}))",
                       f"the {len(grads)} gradient(s) read are distinct objects, and none of the tensor arguments")
        return exprs

    def call(self, args_key: tuple, arg_names: list[str]) -> None:
        """The arguments of the call: ``args`` and ``kwargs``."""
        kwargs_part = args_key[-1] if args_key and type(args_key[-1]) is tuple and args_key[-1][:1] == ("kwargs",) \
            else None
        positional = args_key[:-1] if kwargs_part is not None else args_key
        self.check(f"len(args) == {len(positional)}", f"{len(positional)} positional argument(s)")
        names = [self.name(arg_names[i] if i < len(arg_names) else f"arg{i}") for i in range(len(positional))]
        if names:
            self.lines.append(f"{', '.join(names)}{',' if len(names) == 1 else ''} = args")
        for k, name in zip(positional, names):
            self.value(k, name, name)
        if kwargs_part is None:
            self.check("not kwargs", "no keyword arguments")
            return
        items = kwargs_part[1:]
        keys = tuple(k for k, _ in items)
        self.check(f"tuple(kwargs) == {self.const(keys)}", f"keyword arguments {_short(keys)}")
        knames = [self.name(k) for k in keys]
        self.lines.append(f"{', '.join(knames)}{',' if len(knames) == 1 else ''} = kwargs.values()")
        for (_, k), name in zip(items, knames):
            self.value(k, name, name)

    def global_state(self, state: tuple) -> None:
        grad, inference, default_dtype, cpu_ac, cuda_ac, cpu_dtype, cuda_dtype, factory_device = state
        env = self.env
        env.update(is_grad_enabled=torch.is_grad_enabled, get_default_dtype=torch.get_default_dtype,
                   is_autocast_enabled=torch.is_autocast_enabled, get_autocast_dtype=torch.get_autocast_dtype,
                   functorch_active=functorch_active, is_inference_mode_enabled=torch.is_inference_mode_enabled,
                   user_modes_active=user_modes_active)
        # programs are compiled outside torch.func transforms and user modes only (JittedFunction._find runs the
        # function eagerly there)
        terms = [f"is_grad_enabled() is {grad}", f"is_inference_mode_enabled() is {inference}",
                 "not functorch_active()", "not user_modes_active()",
                 f"get_default_dtype() is {self.const(default_dtype, str(default_dtype).removeprefix('torch.'))}",
                 f"is_autocast_enabled('cpu') is {cpu_ac}", f"is_autocast_enabled('cuda') is {cuda_ac}"]
        for device, enabled, dtype in (("cpu", cpu_ac, cpu_dtype), ("cuda", cuda_ac, cuda_dtype)):
            if enabled:
                name = self.const(dtype, str(dtype).removeprefix("torch."))
                terms.append(f"get_autocast_dtype('{device}') is {name}")
        env.update(default_device=default_device)
        terms.append("default_device() is None" if factory_device is None else
                     f"default_device() == {self.const(factory_device, f'{factory_device.type}_device')}")
        self.check(" and ".join(terms), "global state: grad and inference mode, no torch.func transform or user "
                   "mode, default dtype, autocast, default device")


def _example_strides(t: torch.Tensor, key: tuple, dims: frozenset) -> list[int | None] | None:
    """The strides the C++ check compares for the tensor input ``t`` of ``key``: exactly the key's when it has them;
    for a contiguous one, the contiguous strides of its static shape, none at a dimension of size 1 (which
    ``is_contiguous`` ignores) and none at all when a size is dynamic (``is_contiguous()`` is then checked in
    Python) or zero; None when ``t`` does not have its key's layout."""
    shape = key[0]
    if len(key) == 5:
        return list(key[4]) if not dims and tuple(t.stride()) == tuple(key[4]) else None
    if not t.is_contiguous():
        return None
    if dims or 0 in shape:  # a tensor of no elements is contiguous whatever its strides
        return [None] * len(shape)
    strides, expected = [], 1
    for size in reversed(shape):
        strides.append(None if size == 1 else expected)
        expected *= int(size)
    return strides[::-1]


def _has_key_facts(t: torch.Tensor, key: tuple, dims: frozenset, state: bool) -> bool:
    """Whether the tensor ``t`` has every fact its key states (the sizes at ``dims`` aside)."""
    shape, dtype, device, requires_grad, *_ = key
    lazy = None
    if type(dtype) is tuple:
        dtype, lazy = dtype
    if type(t) is not torch.Tensor and type(t) is not _Parameter:
        return False
    if t.dim() != len(shape) or any(t.shape[d] != s for d, s in enumerate(shape) if d not in dims):
        return False
    if t.dtype is not dtype or t.device != device or t.is_inference() is not (requires_grad is None):
        return False
    if t.requires_grad is not bool(requires_grad):
        return False
    if state:  # a module's state: the key has no lazy bits, and the C++ check compares the example's
        return True
    neg, conj = t.is_neg(), dtype.is_complex and t.is_conj()
    return conj if lazy == "conj" else (neg and not conj) if lazy == "neg" else not (neg or conj)


#: From this many tensors on, the prologue checks the inference bits by comparing the dispatch TLS (two C calls)
#: rather than asking each tensor (``_Writer._inference_check``).
MIN_TENSORS_FOR_TLS = 8

_AUTOGRAD_KEYS = tuple(
    getattr(torch._C.DispatchKey, k) for k in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor")
)


class _TensorsCheck:
    """A ``TensorGuards`` (``guards``) and the dispatch TLS (include set, exclude set) it was built under, or None
    when that TLS includes or excludes an autograd key (then its dispatch-key comparison does not tell inference
    tensors from others)."""

    __slots__ = ("dispatch_tls", "guards")

    def __init__(self, guards: Any):
        self.guards = guards
        include = torch._C._dispatch_tls_local_include_set()
        exclude = torch._C._dispatch_tls_local_exclude_set()
        plain = not any(ks.has(k) for ks in (include, exclude) for k in _AUTOGRAD_KEYS)
        self.dispatch_tls = (include, exclude) if plain else None


def tensor_guards(keys: list[tuple], dims: list[frozenset], states: list[bool], examples: list[torch.Tensor]
                  ) -> _TensorsCheck | None:
    """One ``TensorGuards`` comparing tensors with ``examples``, whose keys are ``keys`` (``dims``: the dynamic
    dims of each; ``states``: which are a module's parameters and buffers): sizes and strides from the keys, the
    other facts from the examples, each verified to have its key's. None when one does not, or when torch has no
    such check: the per-tensor checks then run alone."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:
        return None
    if len(examples) != len(keys):
        return None
    sizes, strides = [], []
    for t, k, d, state in zip(examples, keys, dims, states):
        if not _has_key_facts(t, k, d, state):
            return None
        stride = _example_strides(t, k, d)
        if stride is None:
            return None
        sizes.append([None if i in d else int(s) for i, s in enumerate(k[0])])
        strides.append(stride)
    try:
        fast = _TensorsCheck(TensorGuards(*examples, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides))
        return fast if fast.guards.check(*examples) else None
    except Exception:  # a tensor TensorGuards does not take (it compares dense tensors)
        return None


def build_prologue(key: Any, arg_names: list[str], *, module: bool = False, param_names: list[str] = (),
                   symbolic=None, guard=None, captured: list[torch.Tensor] = (), holders: tuple[int, ...] = (),
                   examples: list[torch.Tensor] | None = None, fast: Any = None, distinct: bool = True,
                   state_ids: Any = None) -> Prologue:
    """The prologue of the entry compiled for ``key``. A function's is ``prologue(args, kwargs)``; a module's
    (``module=True``, key ``((version, parameter keys, call key), global state)``) is
    ``prologue(version, params, args, kwargs)``, ``param_names`` naming the parameters and buffers. ``symbolic``
    (dynamic sizes) replaces the exact dynamic sizes by its guards; ``guard`` checks the globals the code read;
    ``captured`` tensors are appended to the inputs (for a ``GradOf``, its tensor's ``.grad`` now), then the
    ``holders`` (their indices in the order the key's walk met them) that the program updates or returns
    (``fulmen.frontend.objects``). ``examples``: the tensors the key
    was computed from, for the one C++ check of all tensors (``Prologue.fast`` keeps it; ``fast`` reuses one).
    ``distinct``: the call's tensors are checked to be distinct objects past its repeats (``_Writer.distinct``), and
    none of a module's parameters and buffers, which were keyed as repeats (``state_ids``: its ``known_ids``, else
    ``ids(params)``, are their ids: ``fulmen.frontend.module``)."""
    w = _Writer(symbolic)
    call_key, state = key
    preamble = ""
    if guard is not None:  # the globals and closure variables the traced code read (fulmen.frontend.global_guard)
        comment = "".join(f"# {' '.join(line.split())}\n" for line in guard.describe())
        guard_source = getattr(guard.check, "source", None)
        if guard_source is not None and guard_source.startswith("def guard():"):  # printed here, and run from here
            guard_env = {k: v for k, v in guard.check.__globals__.items() if k != "__builtins__"}
            w.names |= set(guard_env) | {"check_globals"}
            w.env.update(guard_env)
            preamble = ("# the globals and closure variables the traced code read:\n" + comment
                        + guard_source.replace("def guard():", "def check_globals():", 1) + "\n\n")
        else:
            w.names.add("check_globals")
            w.env["check_globals"] = guard.check
            preamble = "# check_globals() compares the globals and closure variables the traced code read:\n" + comment
    if module:
        version, param_keys, call_key = call_key
        w.params(version, param_keys, param_names)
    n_state = len(w.flat)
    w.call(call_key, arg_names)
    fast = w.tensors(examples, fast)
    w.distinct(n_state if distinct else len(w.flat))
    if distinct and state_ids is not None:
        w.none_of_state(n_state, state_ids)
    w.global_state(state)
    flat = list(w.flat)
    if symbolic is not None:
        flat += w.symbolic_guards(symbolic)
    if guard is not None:
        w.check("check_globals()", "the globals and closure variables the traced code read (above)")
    if any(type(c) is GradOf for c in captured):
        flat += w.grads_read(captured)
    elif captured:
        flat.append(f"*{w.const(list(captured), 'captured')}")
    flat += [w.holders[i] for i in holders]
    w.lines.append(f"return [{', '.join(flat)}]")
    signature = "version, params, args, kwargs" if module else "args, kwargs"
    body = "\n".join("        " + line for line in w.lines)
    # an exception while checking (a size guard dividing by zero, an object that cannot be read) is a miss
    source = (f"{_HEADER}{preamble}def prologue({signature}):\n    try:\n{body}\n    except Exception:\n"
              "        return None\n")
    prologue = Prologue(source, w.env)
    prologue.fast = fast
    return prologue
