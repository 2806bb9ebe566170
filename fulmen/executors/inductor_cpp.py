"""One C++ build per fused region on CPU, instead of one per kernel.

Inductor turns a CPU graph into several C++ kernels and builds each into its own shared library: one g++ run
per kernel. Most of such a run is fixed cost: loading the 150 MB precompiled header of ATen's vector types
(about 0.7 s on the 2-core CI machine), or parsing those headers when there is no precompiled header yet
(about 3.3 s), and linking (0.2 s); the kernel itself takes a fraction of that. A GPT training step on CPU
makes 11 kernels in 3 regions, so 11 runs, 12 s of compiler time.

Inside ``merged_cpp_build()``, Inductor's ``cpp_pybinding`` (the call its generated module makes for each
kernel) only records the kernel's source and hands back a placeholder. ``build()`` then writes all of the
region's kernels into one translation unit, each in a namespace of its own, with one Python binding per kernel,
and builds it once through Inductor's own C++ cache (same flags, same precompiled header, same on-disk cache,
so a second process loads the library without compiling). The placeholders in the generated module are
replaced by the built functions, so calls go straight to C++.

Anything the merge does not understand (a kernel source of an unexpected shape, a failed build) falls back to
Inductor's own per-kernel build for that region, so the merge can make compilation faster but never change
what runs.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from typing import Any

from fulmen.core.utils import compiler_import_lock

log = logging.getLogger("fulmen.inductor")

_state = threading.local()
_lock = threading.Lock()
#: Inductor's ``AsyncCompile.cpp_pybinding``, once ``merged_cpp_build`` has put its own in place.
_original_cpp_pybinding = None

_ENTRY = re.compile(r'extern\s+"C"\s+void\s+kernel\s*\(')
#: Preprocessor lines that would leak from one kernel into the next in a shared translation unit.
_LEAKY_DIRECTIVE = re.compile(r"^\s*#\s*(include|define|undef)\b")
#: The argument types Inductor's CPU kernels take, and how the binding reads each from Python.
_PARSERS = {"int64_t": "parse_int", "float": "parse_float", "uintptr_t": "parse_address"}


class _Pending:
    """Stands in for one kernel in Inductor's generated module until the region's library is built."""

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
    """The C++ kernels of one Inductor compilation, built together."""

    def __init__(self):
        self.kernels: list[tuple[list[str], str]] = []  # (argument types, source)
        self.pending: list[_Pending] = []
        self.built = False
        self.merged = False  # whether the kernels run from one library (False: Inductor's per-kernel builds)

    def add(self, argtypes: list[str], source: str) -> _Pending:
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
        from torch._inductor.async_compile import AsyncCompile
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        start = time.perf_counter()
        try:
            source = merged_source(self.kernels)
            module = CppPythonBindingsCodeCache.load_async(source, "cpu")()
            for p in self.pending:
                p.fn = getattr(module, f"kernel_{p.index}")
            self.merged = True
            log.debug("fulmen: built %d C++ kernels as one library in %.2f s", len(self.kernels),
                      time.perf_counter() - start)
        except Exception as e:  # Inductor's own builds, one per kernel
            log.info("fulmen: building %d C++ kernels one by one (%s: %s)", len(self.kernels), type(e).__name__,
                     str(e).splitlines()[0] if str(e) else "")
            for p, (argtypes, src) in zip(self.pending, self.kernels):
                fn = _original_cpp_pybinding(AsyncCompile(), argtypes, src)
                p.fn = fn.result() if hasattr(fn, "result") else fn

    def resolve_in(self, fn: Any) -> None:
        """Replace the placeholders among ``fn``'s module globals by the built functions (no indirection left)."""
        scope = getattr(getattr(fn, "__func__", fn), "__globals__", None)  # a function, or a method of Runner
        if scope is None:
            return
        for name, value in list(scope.items()):
            if isinstance(value, _Pending) and value.batch is self and value.fn is not None:
                scope[name] = value.fn


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


def _install() -> None:
    global _original_cpp_pybinding
    with _lock:
        if _original_cpp_pybinding is not None:
            return
        from torch._inductor.async_compile import AsyncCompile

        _original_cpp_pybinding = AsyncCompile.cpp_pybinding
        AsyncCompile.cpp_pybinding = _cpp_pybinding  # delegates to the original outside merged_cpp_build()


#: A kernel-like source: it uses ATen's vector types, so its build takes the same flags (and the same
#: precompiled header) as the kernels Inductor writes.
_HEADER_PROBE = """#include <torch/csrc/inductor/cpp_prefix.h>
extern "C" void kernel(float* out_ptr0) { at::vec::Vectorized<float>(0.0f).store(out_ptr0); }
"""
_header_started = False


def prefetch_header() -> None:
    """Start building Inductor's precompiled header (about 7 s on 2 cores, once per machine) on a thread now,
    so that the first region's tracing and lowering run beside it instead of before it.

    Call it in the compiling thread with Inductor's configuration in place: the vector instructions are picked
    here, so the thread builds exactly the header the kernels will use. The thread only asks Inductor's C++ cache
    for the probe's build command, which precompiles the header (a no-op when it exists) and compiles nothing
    else; the first kernel build waits on Inductor's file lock for the header instead of building it again.
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
            from torch._inductor.codecache import CppPythonBindingsCodeCache
            from torch._inductor.cpu_vec_isa import pick_vec_isa

        if not config.cpp_cache_precompile_headers:
            return
        pick_vec_isa()  # settles (and caches) the vector instructions under the caller's configuration
    except Exception as e:  # an optimization only
        log.info("fulmen: not prefetching Inductor's precompiled header (%s: %s)", type(e).__name__, e)
        return

    def build():
        try:
            CppPythonBindingsCodeCache.load_async(_HEADER_PROBE, "cpu")
        except Exception as e:
            log.info("fulmen: prefetching Inductor's precompiled header failed (%s: %s)", type(e).__name__, e)

    # Not a daemon: at exit the interpreter waits for g++ to finish writing the header, never leaving half of one.
    threading.Thread(target=build, name="fulmen-precompiled-header").start()


@contextlib.contextmanager
def merged_cpp_build():
    """Collect the CPU kernels Inductor asks for in this thread; the caller builds them with ``build()``."""
    _install()
    batch = MergedBuild()
    previous = getattr(_state, "batch", None)
    _state.batch = batch
    try:
        yield batch
    finally:
        _state.batch = previous
