"""An on-disk cache of regions' aten graphs, so that a process whose Inductor cache holds a region's compilation
finds it without capturing the region's graph again.

Inductor's FX graph cache keys a compilation by the aten graph, so before it can find one a region's graph must
exist: ``inductor_graph.aten_graph`` runs the region's Python on fake tensors under ``make_fx``'s dispatch mode
with Inductor's decompositions, which with a warm Inductor cache is most of the time a region takes to compile.
Inside one process regions with the same code share their kernel (``inductor_compile.get_kernel``); across
processes this cache keeps each captured graph under a key of everything the capture reads (``region_key``), and
a later process rebuilds the graph from it and asks Inductor's own cache for the compilation (``inductor_compile``).
Inductor computes its key from the rebuilt graph, which prints as the captured one did (checked when the entry is
written), so its own checks (its configuration, torch's sources, the inputs' layouts) still decide a hit; only
on a hit does the rebuilt graph stand in for a capture. On a miss the region is captured and lowered as before.

A wrong graph under a key would be a silent wrong result, so the key holds what ``make_fx``'s output depends on:
the region's code and the objects it calls (described by module and name, with closures and defaults; a region
calling anything else, a tensor constant or a user's function, is not cached), the inputs' layouts, the
decomposition table and where fulmen's own decompositions apply, fulmen's and torch's sources (digests of their
files), and the settings the capture reads: default dtype and device, grad and inference mode, autocast,
deterministic algorithms, the attention backends, and the configurations of Inductor, functorch and FX. A region
with symbolic sizes is not cached (its graph comes with shape guards).

What the key cannot see: a torch or fulmen function replaced inside the process (``torch.relu = ...``) and called
by another, rather than by the region's code. ``FULMEN_GRAPH_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import pickle
import re
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx

from fulmen.core.options import env_flag

log = logging.getLogger("fulmen.inductor")

#: Whether regions' graphs are kept and looked up (the environment variable FULMEN_GRAPH_CACHE sets it).
ENABLED = env_flag("FULMEN_GRAPH_CACHE", True)
#: Bumped when the entry format or the key's contents change.
FORMAT_VERSION = 1
#: Where a region's callables may come from to be described by module and name: code whose text is covered by the
#: key (fulmen's digest, torch's version) or by the interpreter's version.
_TRUSTED_MODULES = ("fulmen", "torch", "math", "operator", "_operator", "builtins")
_PLAIN = (type(None), bool, int, str, bytes)
_TORCH_VALUES = (torch.dtype, torch.device, torch.memory_format, torch.layout)
_DEF = re.compile(r"^def [A-Za-z_][A-Za-z0-9_]*\(", re.MULTILINE)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\s*\.\s*[A-Za-z_][A-Za-z0-9_]*)*")


class _Uncacheable(Exception):
    pass


# ---- the key ----


@functools.cache
def fulmen_digest() -> str:
    """A digest of fulmen's source files: a graph captured by other fulmen code is not reused."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for directory, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def _trusted(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in _TRUSTED_MODULES


def _describe(obj: Any, depth: int = 0) -> Any:
    """A description of ``obj`` that is equal in two processes exactly when the object computes the same thing (for
    code: when its text is the same, which the fulmen digest and torch's version cover); raises ``_Uncacheable``."""
    if depth > 6:
        raise _Uncacheable("nesting too deep")
    if isinstance(obj, _PLAIN):
        return (type(obj).__name__, obj)
    if isinstance(obj, float):
        return ("float", repr(obj))  # repr tells -0.0 from 0.0 and keeps nan
    if isinstance(obj, _TORCH_VALUES):
        return (type(obj).__name__, str(obj))
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, *(_describe(v, depth + 1) for v in obj))
    if isinstance(obj, slice):
        return ("slice", _describe((obj.start, obj.stop, obj.step), depth + 1))
    if isinstance(obj, types.ModuleType):
        if not _trusted(obj.__name__):
            raise _Uncacheable(f"module {obj.__name__}")
        return ("module", obj.__name__)
    if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return ("op", str(obj))
    if isinstance(obj, types.FunctionType):
        if not _trusted(obj.__module__):
            raise _Uncacheable(f"function {obj.__module__}.{obj.__qualname__}")
        cells = tuple(_describe(c.cell_contents, depth + 1) for c in obj.__closure__ or ())
        defaults = _describe((obj.__defaults__, tuple(sorted((obj.__kwdefaults__ or {}).items()))), depth + 1)
        return ("function", obj.__module__, obj.__qualname__, cells, defaults)
    if isinstance(obj, functools.partial):
        return (
            "partial",
            _describe(obj.func, depth + 1),
            _describe(obj.args, depth + 1),
            _describe(tuple(sorted(obj.keywords.items())), depth + 1),
        )
    if isinstance(obj, type) or callable(obj) and type(obj).__name__ in _BUILTIN_CALLABLES:
        module = getattr(obj, "__module__", None) or getattr(getattr(obj, "__objclass__", None), "__module__", None)
        if not _trusted(module):
            raise _Uncacheable(f"callable {obj!r}")
        return ("callable", type(obj).__name__, module, getattr(obj, "__qualname__", None) or repr(obj))
    raise _Uncacheable(f"a {type(obj).__name__} object")


_BUILTIN_CALLABLES = frozenset(
    {
        "builtin_function_or_method",
        "method_descriptor",
        "wrapper_descriptor",
        "getset_descriptor",
        "classmethod_descriptor",
        "method-wrapper",
        "_lru_cache_wrapper",
    }
)


def _code_objects(fn: Callable, source: str) -> tuple:
    """Each dotted name the region's code reads from its globals (``torch.nn.functional.linear``,
    ``torchex.reshape``), with a description of the object it resolves to now."""
    scope = fn.__globals__
    used = set(fn.__code__.co_names)
    found = {}
    for line in source.splitlines():
        code = line.split("#", 1)[0]
        for match in _NAME.finditer(code):
            parts = [p.strip() for p in match.group(0).split(".")]
            if parts[0] not in used or parts[0] not in scope:
                continue
            obj = scope[parts[0]]
            for i, attr in enumerate(parts[1:], 1):
                if not isinstance(obj, (types.ModuleType, types.SimpleNamespace, type)) or not hasattr(obj, attr):
                    parts = parts[:i]
                    break
                obj = getattr(obj, attr)
            name = ".".join(parts)
            if name not in found and not isinstance(obj, types.SimpleNamespace):
                found[name] = _describe(obj)
    return tuple(sorted(found.items()))


def _ambient() -> tuple:
    """The process's and thread's settings a capture reads."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.codecache import torch_key
    from torch.fx.experimental import _config as fx_config

    from fulmen.executors import inductor_decomps

    cuda = torch.backends.cuda
    return (
        sys.version,
        torch.__version__,
        torch_key(),  # a digest of torch's sources, which Inductor's own key computes in every compiling process
        fulmen_digest(),
        str(torch.get_default_dtype()),
        str(torch.get_default_device()),
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        tuple((d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))) for d in ("cpu", "cuda")),
        torch.is_autocast_cache_enabled(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(), cuda.cudnn_sdp_enabled()),
        torch.get_float32_matmul_precision(),
        torch.backends.mkldnn.enabled,
        torch.backends.cudnn.enabled,
        # where fulmen's own decompositions apply (module settings their code reads)
        _stable((inductor_decomps.GELU_DEVICES, inductor_decomps.CROSS_ENTROPY_DTYPES)),
        # (not Dynamo's, which a capture does not read and which holds paths under the working directory)
        *(_stable(c.save_config_portable()) for c in (inductor_config, functorch_config, fx_config)),
    )


def _stable(value: Any) -> str:
    """``repr`` of a configuration value, with sets and dicts in a fixed order (a set's order varies between
    processes with string hashing)."""
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_stable(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(sorted(f"{_stable(k)}: {_stable(v)}" for k, v in value.items())) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_stable(v) for v in value) + "]"
    return repr(value)


_tables: dict[int, tuple[Any, str]] = {}


def _function_name(fn: Any) -> str:
    """Which function decomposes an operation, by module and name; their code is covered by fulmen's digest and
    torch's version, and the table's other inputs (Inductor's configuration) are part of the key."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _table_digest(decompositions: Mapping) -> str:
    """A digest of the decomposition table: each operation and the function that decomposes it."""
    hit = _tables.get(id(decompositions))
    if hit is not None and hit[0] is decompositions:
        return hit[1]
    items = sorted((str(op), _function_name(fn)) for op, fn in decompositions.items())
    digest = hashlib.sha256(repr(items).encode()).hexdigest()
    _tables[id(decompositions)] = (decompositions, digest)
    return digest


def region_key(
    fn: Callable, example: Sequence[torch.Tensor], decompositions: Mapping, dims: frozenset | None = None
) -> str | None:
    """The key of the graph ``aten_graph(fn, example, decompositions)`` captures now, or ``None`` where the region
    cannot be cached (symbolic sizes, or code calling objects that cannot be described across processes)."""
    source = getattr(fn, "__fulmen_source__", None)
    if dims or source is None or not ENABLED:
        return None
    try:
        parts = (
            FORMAT_VERSION,
            _DEF.sub("def _(", source, count=1),  # the region's name is a counter's value, not part of its code
            _code_objects(fn, source),
            tuple(
                (tuple(a.shape), tuple(a.stride()), a.storage_offset(), str(a.dtype), str(a.device), a.requires_grad)
                for a in example
            ),
            _table_digest(decompositions),
            _ambient(),
        )
    except _Uncacheable as e:
        log.debug("fulmen: the graph of %s is not cached across processes (it calls %s)", fn.__name__, e)
        return None
    except Exception as e:  # the cache only saves time: a region it cannot key compiles as before
        log.debug("fulmen: the graph of %s is not cached across processes (%s: %s)", fn.__name__, type(e).__name__, e)
        return None
    return hashlib.sha256(repr(parts).encode()).hexdigest()


# ---- the entries: a graph as data, and back ----


class _Ref:
    """A node's argument that is another node, by name."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return (_Ref, (self.name,))


def _target(node: fx.Node) -> Any:
    target = node.target
    if node.op in ("placeholder", "output"):
        return target
    if node.op != "call_function":
        raise _Uncacheable(f"a {node.op} node")
    if isinstance(target, torch._ops.OpOverload):
        return ("op", target.namespace, target._opname, target._overloadname)
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if not _trusted(module) or not name or _resolve(("py", module, name)) is not target:
        raise _Uncacheable(f"the call of {target!r}")
    return ("py", module, name)


def _resolve(target: Any) -> Any:
    if not isinstance(target, tuple):
        return target
    if target[0] == "op":
        return getattr(getattr(getattr(torch.ops, target[1]), target[2]), target[3])
    obj: Any = importlib.import_module(target[1])
    for attr in target[2].split("."):
        obj = getattr(obj, attr, None)
    return obj


def _plain_args(value: Any) -> Any:
    if isinstance(value, fx.Node):
        return _Ref(value.name)
    if isinstance(value, (tuple, list)):
        return (
            type(value)(_plain_args(v) for v in value)
            if type(value) in (tuple, list)
            else [_plain_args(v) for v in value]
        )
    if isinstance(value, dict):
        return {k: _plain_args(v) for k, v in value.items()}
    if isinstance(value, (*_PLAIN, float, *_TORCH_VALUES, slice)):
        return value
    raise _Uncacheable(f"an argument of type {type(value).__name__}")


def _layout(node: fx.Node) -> tuple | None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), tuple(val.stride()), val.storage_offset(), val.dtype, str(val.device))
    return None


def graph_entry(gm: fx.GraphModule) -> dict | None:
    """``gm`` as plain data (``None`` if it holds something that is not): each node's operation, name, target
    and arguments, the layout of each tensor it computes, and the code it prints as."""
    try:
        if any(True for _ in gm.named_buffers()) or any(True for _ in gm.named_parameters()) or gm._modules:
            raise _Uncacheable("attributes")
        nodes = [
            (n.op, n.name, _target(n), _plain_args(n.args), _plain_args(n.kwargs), _layout(n)) for n in gm.graph.nodes
        ]
    except (_Uncacheable, ImportError, AttributeError) as e:
        log.debug("fulmen: a region's graph is not cached across processes (it holds %s)", e)
        return None
    return {"version": FORMAT_VERSION, "nodes": nodes, "code": gm.code, "name": gm.__class__.__name__}


def rebuild(entry: dict, fake_mode) -> fx.GraphModule | None:
    """The graph ``entry`` was made from, its tensors' ``val`` metadata fake tensors of ``fake_mode``; ``None`` if
    it does not print as the captured graph did."""
    from fulmen.executors.inductor_graph import _DispatchGraphTracer

    graph = fx.Graph(tracer_cls=_DispatchGraphTracer)
    env: dict[str, fx.Node] = {}

    def value(v):
        if isinstance(v, _Ref):
            return env[v.name]
        if isinstance(v, (tuple, list)):
            return type(v)(value(x) for x in v)
        if isinstance(v, dict):
            return {k: value(x) for k, x in v.items()}
        return v

    try:
        for op, name, target, args, kwargs, layout in entry["nodes"]:
            node = graph.create_node(op, _resolve(target), value(args), value(kwargs), name=name)
            if node.name != name:
                return None
            if layout is not None:
                node.meta["val"] = _fake(fake_mode, *layout)
            env[name] = node
        gm = fx._lazy_graph_module._make_graph_module(torch.nn.Module(), graph, entry["name"])
    except (KeyError, AttributeError, TypeError, ValueError, RuntimeError):  # an entry of another fulmen or torch
        return None
    return gm if gm.code == entry["code"] else None


def _fake(fake_mode, shape, stride, offset, dtype, device) -> torch.Tensor:
    """A fake tensor of ``fake_mode`` with this layout, made directly from a meta tensor (creating it under the mode
    dispatches a factory call, several times slower, for each of a graph's hundreds of values)."""
    from torch._subclasses.fake_tensor import FakeTensor

    meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    if offset:
        meta = meta.as_strided(shape, stride, offset)
    return FakeTensor(fake_mode, meta, torch.device(device))


# ---- the files ----


def _directory() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "fulmen_graphs")


def load(key: str) -> dict | None:
    """The entry stored under ``key``, or ``None``."""
    try:
        with open(os.path.join(_directory(), key + ".pkl"), "rb") as f:
            entry = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError):
        return None
    return entry if isinstance(entry, dict) and entry.get("version") == FORMAT_VERSION else None


def store(key: str, entry: dict) -> None:
    """Keep ``entry`` under ``key`` (atomically: a reader sees the old entry or the new one)."""
    try:
        directory = _directory()
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{key}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, os.path.join(directory, key + ".pkl"))
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:  # a later process captures it again
        log.info("fulmen: could not keep a region's graph (%s)", e)
