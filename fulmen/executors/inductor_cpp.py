"""Building the C++ kernels of fused CPU regions in batches: one compiler run for many kernels.

Inductor turns a CPU graph into several C++ kernels and builds each into its own shared library: one g++ run
per kernel. Most of such a run is fixed cost: parsing ATen's vector headers, or loading them precompiled (once
a precompiled header exists, which takes one core a while to build, once per machine), and linking; the kernel
itself takes a fraction of that. A GPT training step on CPU makes a dozen kernels in a few regions, so a dozen
runs pay that cost (figures: docs/performance.md, "What individual changes bought").

Inside ``merged_cpp_build(batch)``, Inductor's ``cpp_pybinding`` (the call its generated module makes for each
kernel) only records the kernel's source and hands back a placeholder. The background compiler collects every
region waiting to compile into one batch; ``build()`` then writes all of the batch's kernels into one
translation unit, each in a namespace of its own, with one Python binding per kernel, and builds it once
through Inductor's own C++ cache (same flags; the precompiled header once it is ready, ATen's headers parsed
in the same run before). The placeholders in the generated modules are replaced by the built functions, so
calls go straight to C++. A library index in Inductor's cache directory records which library holds each
compilation's kernels, so a second process finds them, whatever batch they were built in.

Anything the merge does not understand (a kernel source of an unexpected shape, a failed build) falls back to
Inductor's own per-kernel builds for that batch, so the merge can make compilation faster but never change
what runs.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import re
import threading
import time
from typing import Any

from fulmen.core.shared_patch import SharedPatch
from fulmen.core.utils import compiler_import_lock
from fulmen.executors.inductor_isa import remembered_probe_loads

log = logging.getLogger("fulmen.inductor")

_state = threading.local()
_lock = threading.Lock()
#: Inductor's ``AsyncCompile.cpp_pybinding`` while ``merged_cpp_build`` has put its own in place.
_original_cpp_pybinding = None

_ENTRY = re.compile(r'extern\s+"C"\s+void\s+kernel\s*\(')
#: Preprocessor lines that would leak from one kernel into the next in a shared translation unit.
_LEAKY_DIRECTIVE = re.compile(r"^\s*#\s*(include|define|undef)\b")
#: The argument types Inductor's CPU kernels take, and how the binding reads each from Python.
_PARSERS = {"int64_t": "parse_int", "float": "parse_float", "uintptr_t": "parse_address"}


class _Pending:
    """Stands in for one kernel in Inductor's generated module until the batch's library is built."""

    __slots__ = ("batch", "index", "fn")

    def __init__(self, batch: MergedBuild, index: int):
        self.batch = batch
        self.index = index
        self.fn = None

    def __call__(self, *args):
        if self.fn is None:
            self.batch.build()
        return self.fn(*args)


class MergedBuild:
    """The C++ kernels of one or more Inductor compilations (a batch), built together.

    Each ``merged_cpp_build(batch)`` block adds a group: the kernels of one compilation. The library index
    records, for each group's kernels, the library and functions that hold them, so a later process finds a
    region's kernels whatever batch they were built in.
    """

    def __init__(self):
        self.kernels: list[tuple[list[str], str]] = []  # (argument types, source)
        self.pending: list[_Pending] = []
        self.groups: list[list[int]] = []  # kernel indices, one list per compilation
        self.built = False
        self.merged = False  # whether the kernels run from merged libraries (False: Inductor's per-kernel builds)
        self.compiled = 0  # kernels this build compiled (the others came from the library index)

    def add(self, argtypes: list[str], source: str) -> _Pending:
        self.groups[-1].append(len(self.kernels))  # the group of the enclosing merged_cpp_build() block
        self.kernels.append((list(argtypes), source))
        self.pending.append(_Pending(self, len(self.pending)))
        return self.pending[-1]

    def build(self) -> None:
        """Build the kernels (once); afterwards every placeholder holds its function."""
        if self.built:
            return
        self.built = True
        if not self.kernels:
            return
        start = time.perf_counter()
        try:
            self._build_merged()
            self.merged = True
            log.debug("fulmen: %d C++ kernels of %d compilations ready in %.2f s (%d compiled as one library)",
                      len(self.kernels), len(self.groups), time.perf_counter() - start, self.compiled)
        except Exception as e:  # Inductor's own builds, one per kernel
            log.info("fulmen: building %d C++ kernels one by one (%s: %s)", len(self.kernels), type(e).__name__,
                     str(e).splitlines()[0] if str(e) else "")
            from torch._inductor.async_compile import AsyncCompile

            for p, (argtypes, src) in zip(self.pending, self.kernels):
                if p.fn is None:
                    fn = _original_cpp_pybinding(AsyncCompile(), argtypes, src)
                    p.fn = fn.result() if hasattr(fn, "result") else fn

    def _build_merged(self) -> None:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        groups = [g for g in self.groups if g]
        keys = [_group_key([self.kernels[i] for i in g]) for g in groups]
        missing = []
        for group, key in zip(groups, keys):
            found = _index_lookup(key)
            if found is None or len(found) != len(group):
                missing.append((group, key))
                continue
            for i, fn in zip(group, found):
                self.pending[i].fn = fn
        if not missing:
            return
        order = [i for group, _ in missing for i in group]
        # with the precompiled header when it is ready; otherwise parsing the headers beats waiting for it
        cache = CppPythonBindingsCodeCache if _header_ready else _code_cache_without_header()
        module = cache.load_async(merged_source([self.kernels[i] for i in order]), "cpu")()
        self.compiled = len(order)
        _loaded[module.__file__] = module
        position = {i: n for n, i in enumerate(order)}
        for group, key in missing:
            names = [f"kernel_{position[i]}" for i in group]
            for i, name in zip(group, names):
                self.pending[i].fn = getattr(module, name)
            _index_write(key, module.__file__, names)

    def resolve_in(self, fn: Any) -> None:
        """Replace the placeholders among ``fn``'s module globals by the built functions (no indirection left)."""
        scope = getattr(getattr(fn, "__func__", fn), "__globals__", None)  # a function, or a method of Runner
        if scope is None:
            return
        for name, value in list(scope.items()):
            if isinstance(value, _Pending) and value.batch is self and value.fn is not None:
                scope[name] = value.fn


# ---- the library index: which built library holds a compilation's kernels ----

#: Bumped when the generated binding code changes, so libraries with the old bindings are not reused.
_BINDING_VERSION = 1
_fingerprint: str | None = None
_loaded: dict[str, Any] = {}  # library path -> module


def _build_fingerprint() -> str:
    """What, besides the source, decides a kernel library's machine code: torch's version, the compiler, and
    the command line Inductor builds CPU kernels with (flags, vector instructions, include paths)."""
    global _fingerprint
    if _fingerprint is None:
        import torch
        from torch._inductor.codecache import CppPythonBindingsCodeCache, get_compiler_version_info
        from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        with remembered_probe_loads():
            vec_isa = pick_vec_isa()
        options = CppTorchDeviceOptions(vec_isa=vec_isa, device_type="cpu",
                                        **CppPythonBindingsCodeCache.cpp_compile_command_flags)
        command = CppBuilder(name="o", sources="i", BuildOption=options).get_command_line()
        _fingerprint = "\n".join([torch.__version__, str(_BINDING_VERSION), command,
                                   get_compiler_version_info(options.get_compiler())])
    return _fingerprint


def _group_key(kernels: list[tuple[list[str], str]]) -> str:
    text = _build_fingerprint() + "\n" + "\n".join(f"{argtypes}\n{source}" for argtypes, source in kernels)
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def _index_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "fulmen_kernels")


def _index_lookup(key: str) -> list | None:
    """The functions holding a compilation's kernels, from a library built earlier; ``None`` if there is none."""
    try:
        with open(os.path.join(_index_dir(), key + ".json")) as f:
            entry = json.load(f)
        path, names = entry["library"], entry["functions"]
        module = _loaded.get(path) or _load_library(path)
        return [getattr(module, name) for name in names]
    except (OSError, ValueError, KeyError, ImportError, AttributeError):
        return None


def _index_write(key: str, path: str, names: list[str]) -> None:
    try:
        directory = _index_dir()
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{key}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump({"library": path, "functions": names}, f)
        os.replace(tmp, os.path.join(directory, key + ".json"))  # atomic: readers see the old entry or the new
    except OSError as e:  # an optimization only: a later process builds the kernels again
        log.info("fulmen: could not record the kernel library %s (%s)", path, e)


def _load_library(path: str) -> Any:
    import importlib.util

    import torch

    # the bindings read tensors' data pointers through this function of torch's, as Inductor's own do
    os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = str(
        torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr)
    name = "fulmen_kernels_" + hashlib.sha256(path.encode()).hexdigest()[:16] + ".kernel"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _loaded[path] = module
    return module


def merged_source(kernels: list[tuple[list[str], str]]) -> str:
    """One translation unit: the kernels' shared includes, each kernel in its own namespace, and a Python module
    ``kernel`` whose function ``kernel_<i>`` calls kernel ``i``."""
    includes: list[str] = []
    bodies: list[str] = []
    bindings: list[str] = []
    for i, (argtypes, source) in enumerate(kernels):
        lines = source.splitlines()
        start = 0
        while start < len(lines) and (not lines[start].strip() or lines[start].lstrip().startswith("#include")):
            if lines[start].strip() and lines[start].strip() not in includes:
                includes.append(lines[start].strip())
            start += 1
        body = "\n".join(lines[start:])
        if any(_LEAKY_DIRECTIVE.match(line) for line in lines[start:]):
            raise ValueError(f"kernel {i} has preprocessor directives after its includes")
        body, n = _ENTRY.subn("void kernel(", body)
        if n != 1:
            raise ValueError(f"kernel {i} does not define exactly one extern \"C\" kernel()")
        bodies.append(f"namespace fulmen_k{i} {{\n{body}\n}}  // namespace fulmen_k{i}")
        args = ", ".join(_parse(t, n) for n, t in enumerate(argtypes))
        bindings.append(_BINDING.format(i=i, n=len(argtypes), args=args))
    methods = "\n".join(f'    {{"kernel_{i}", kernel_{i}_py, METH_VARARGS, ""}},' for i in range(len(kernels)))
    return "\n".join([*includes, *bodies, _PRELUDE, *bindings, _MODULE.replace("@METHODS@", methods)])


def _parse(argtype: str, n: int) -> str:
    t = argtype.replace("const ", "").strip()
    if t.endswith("*"):
        return f"static_cast<{t}>(tensor_data(args, {n}))"
    if t not in _PARSERS:
        raise ValueError(f"argument type {argtype!r} has no binding")
    return f"{_PARSERS[t]}(args, {n})"


_PRELUDE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>

// Tensor data pointers come from a function in torch's guards module; Inductor passes its address in the
// environment variable below when it loads the library.
static void* (*fulmen_tensor_data_ptr)(PyObject*);

static inline void* tensor_data(PyObject* args, Py_ssize_t n) {
    return fulmen_tensor_data_ptr(PyTuple_GET_ITEM(args, n));
}
static inline int64_t parse_int(PyObject* args, Py_ssize_t n) {
    auto v = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, n));
    if (v == -1 && PyErr_Occurred()) throw std::runtime_error("expected an int argument");
    return v;
}
static inline uintptr_t parse_address(PyObject* args, Py_ssize_t n) {
    auto v = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, n));
    if (v == reinterpret_cast<void*>(-1) && PyErr_Occurred()) throw std::runtime_error("expected an int argument");
    return reinterpret_cast<uintptr_t>(v);
}
static inline float parse_float(PyObject* args, Py_ssize_t n) {
    auto v = PyFloat_AsDouble(PyTuple_GET_ITEM(args, n));
    if (v == -1.0 && PyErr_Occurred()) throw std::runtime_error("expected a float argument");
    return static_cast<float>(v);
}
"""

_BINDING = r"""
static PyObject* kernel_{i}_py(PyObject* self, PyObject* args) {{
    try {{
        if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != {n})
            throw std::runtime_error("kernel_{i} takes {n} arguments");
        fulmen_k{i}::kernel({args});
        Py_RETURN_NONE;
    }} catch (std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }} catch (...) {{
        PyErr_SetString(PyExc_RuntimeError, "unhandled C++ exception");
        return nullptr;
    }}
}}
"""

_MODULE = r"""
static PyMethodDef fulmen_methods[] = {
@METHODS@
    {nullptr, nullptr, 0, nullptr}};

static struct PyModuleDef fulmen_module = {PyModuleDef_HEAD_INIT, "kernel", nullptr, -1, fulmen_methods};

PyMODINIT_FUNC PyInit_kernel(void) {
    const char* address = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    if (!address) {
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR is not set");
        return nullptr;
    }
    char* end = nullptr;
    errno = 0;
    uintptr_t value = std::strtoull(address, &end, 10);
    if (errno != 0 || end == address || value == 0) {
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR is not an address");
        return nullptr;
    }
    fulmen_tensor_data_ptr = reinterpret_cast<void* (*)(PyObject*)>(value);
    return PyModule_Create(&fulmen_module);
}
"""


def _cpp_pybinding(self, argtypes, source_code):
    batch = getattr(_state, "batch", None)
    if batch is None:
        return _original_cpp_pybinding(self, argtypes, source_code)
    return batch.add(argtypes, source_code)


def _install_binding() -> None:
    global _original_cpp_pybinding
    from torch._inductor.async_compile import AsyncCompile

    _original_cpp_pybinding = AsyncCompile.cpp_pybinding
    AsyncCompile.cpp_pybinding = _cpp_pybinding


def _uninstall_binding() -> None:
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.cpp_pybinding = _original_cpp_pybinding


#: Inductor's ``AsyncCompile.cpp_pybinding`` is ours while some thread is inside ``merged_cpp_build()``, and
#: torch's again when the last one leaves. Ours delegates to torch's in a thread without a batch, so another
#: thread that compiles meanwhile builds as Inductor does.
_binding_in_place = SharedPatch(_install_binding, _uninstall_binding)


#: A kernel-like source: it uses ATen's vector types, so its build takes the same flags (and the same
#: precompiled header) as the kernels Inductor writes.
_HEADER_PROBE = """#include <torch/csrc/inductor/cpp_prefix.h>
extern "C" void kernel(float* out_ptr0) { at::vec::Vectorized<float>(0.0f).store(out_ptr0); }
"""
_header_started = False
#: Whether the header is built: C++ builds use it from then on, and parse the headers themselves before.
_header_ready = False


def prefetch_header() -> None:
    """Start Inductor's precompiled header on a thread of its own: a quick check where it is built already, a
    build (seconds of one core, once per machine and compiler flags) where it is not.

    Until the header is ready, C++ builds parse ATen's headers themselves instead of waiting for it: a first build of
    the header takes longer than one build parsing them, so it pays off for later builds and later processes, not for
    the one at hand (figures: docs/performance.md, "First call"). It runs at the lowest CPU priority, so it takes only
    the time the user's program and the compilation leave idle.

    Call it in the compiling thread with Inductor's configuration in place: the vector instructions are picked
    here, so the thread builds exactly the header the kernels will use. The thread only asks Inductor's C++ cache
    for a probe's build command, which precompiles the header (a no-op when it exists) and compiles nothing else.
    """
    global _header_started
    with _lock:
        if _header_started:
            return
        _header_started = True
    try:
        with compiler_import_lock:  # everything the thread uses, imported here (not two threads importing at once)
            import torch.utils._filelock  # noqa: F401
            from torch._inductor import config
            from torch._inductor.codecache import _HEADER_DIR, CppPythonBindingsCodeCache
            from torch._inductor.cpu_vec_isa import pick_vec_isa

        if not config.cpp_cache_precompile_headers:
            return
        with remembered_probe_loads():
            pick_vec_isa()  # settles (and caches) the vector instructions under the caller's configuration
    except Exception as e:  # an optimization only
        log.info("fulmen: not prefetching Inductor's precompiled header (%s: %s)", type(e).__name__, e)
        return

    def build():
        global _header_ready
        if not glob.glob(os.path.join(_HEADER_DIR, "*.gch")):
            _lower_priority()  # a first build on this machine: it must not slow the user's program or compiling
        try:
            CppPythonBindingsCodeCache.load_async(_HEADER_PROBE, "cpu")
            _header_ready = True
        except Exception as e:
            log.info("fulmen: prefetching Inductor's precompiled header failed (%s: %s)", type(e).__name__, e)

    # Not a daemon: at exit the interpreter waits for g++ to finish writing the header, never leaving half of one.
    threading.Thread(target=build, name="fulmen-precompiled-header").start()


def _lower_priority() -> None:
    """Give this thread, and the compiler processes it starts, the lowest CPU priority (Linux: per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


_without_header = None


def _code_cache_without_header():
    """Inductor's C++ cache for Python-bound libraries, building without the precompiled header (same flags,
    same on-disk cache: the header changes how long a build takes, not what it makes)."""
    global _without_header
    if _without_header is None:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        class WithoutHeader(CppPythonBindingsCodeCache):
            cache: dict = {}

            @classmethod
            def _get_uncompiled_header(cls, device: str) -> None:
                return None

        _without_header = WithoutHeader
    return _without_header


@contextlib.contextmanager
def merged_cpp_build(batch: MergedBuild):
    """Collect the CPU kernels Inductor asks for in this thread into ``batch``, as one group; the caller builds
    the batch with ``build()``."""
    batch.groups.append([])
    previous = getattr(_state, "batch", None)
    _state.batch = batch
    try:
        with _binding_in_place:
            yield batch
    finally:
        _state.batch = previous
