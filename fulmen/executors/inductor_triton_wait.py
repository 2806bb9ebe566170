"""Waiting for a batch's Triton kernels once, after every region of the batch is lowered, not once per region.

Inductor's output code hands each Triton kernel of a compilation to Inductor's compile workers and, as the module
loads inside ``compile_fx_inner``, waits for all of them (``async_compile.wait(globals())``). fulmen lowers a batch's
regions one after another on one thread (Inductor's lowering is not thread-safe, and holds Dynamo's compile lock):
each region would wait for its slowest kernel before the next one's lowering starts, and the workers would sit idle
while it lowers. ``torch.compile`` loads one module per graph, so all of a graph's kernels compile together.

Inside ``deferring_waits(scopes)``, the calling thread's waits only append the module's namespace to ``scopes``;
``finish(scopes)`` waits for them later, once the batch is lowered, while the kernels of every region have compiled
side by side. A region's callable reaches its program only after ``finish`` (its kernels are futures until then),
and a kernel that fails to compile fails that region's compilation, which keeps running with the torch executor.
This is the Triton counterpart of the batch's one C++ build (``inductor_cpp.MergedBuild``).

Not deferred: where Inductor runs kernels while it lowers (autotuning, benchmarked fusion, the C++ wrapper), and
other threads' compilations (the installed wait acts for the deferring thread only). ``FULMEN_DEFER_TRITON_WAIT=0``
turns it off.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator

from fulmen.core.shared_patch import SharedPatch
from fulmen.core.utils import compiler_import_lock

#: Whether lowerings defer their Triton waits (``FULMEN_DEFER_TRITON_WAIT=0``: each region waits as it loads).
ENABLED = os.environ.get("FULMEN_DEFER_TRITON_WAIT", "1") != "0"

_local = threading.local()  # .scopes: the list the deferring thread's waits append to
_original_wait = None
#: each future ``finish`` resolved, and its kernel (a future yields its kernel once; entries go with the futures)
_resolved: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _install() -> None:
    global _original_wait
    with compiler_import_lock:
        from torch._inductor.async_compile import AsyncCompile

    _original_wait = AsyncCompile.wait

    def wait(self, scope):
        scopes = getattr(_local, "scopes", None)
        if scopes is None or not _patch.here:
            return _original_wait(self, scope)
        scopes.append((self, scope))

    AsyncCompile.wait = wait


def _uninstall() -> None:
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.wait = _original_wait


_patch = SharedPatch(_install, _uninstall)


def _inductor_runs_kernels_while_lowering() -> bool:
    with compiler_import_lock:
        from torch._inductor import config

    return bool(
        config.max_autotune
        or config.max_autotune_gemm
        or config.benchmark_fusion
        or config.cpp_wrapper
        or config.triton.autotune_at_compile_time
    )


@contextlib.contextmanager
def deferring_waits(scopes: list) -> Iterator[None]:
    """Inside the block, this thread's Inductor modules record their Triton waits in ``scopes`` instead of waiting
    (unless turned off, or Inductor's settings run kernels while lowering)."""
    if not ENABLED or _inductor_runs_kernels_while_lowering():
        yield
        return
    outer = getattr(_local, "scopes", None)
    _local.scopes = scopes
    try:
        with _patch.in_this_thread():
            yield
    finally:
        _local.scopes = outer


def expect_ready(scopes: list, call) -> None:
    """Have ``finish(scopes)`` also check that the module of ``call`` (Inductor's compiled function) holds no kernel
    still compiling: Inductor reuses a module it loaded before, whose wait another region of the batch recorded."""
    namespace = getattr(call, "__globals__", None)
    if namespace is not None:
        scopes.append((None, namespace))


def _futures(scope: dict) -> dict:
    from concurrent.futures import Future

    from torch._inductor.codecache import CodeCacheFuture

    return {k: v for k, v in scope.items() if isinstance(v, (Future, CodeCacheFuture))}


def finish(scopes: list) -> None:
    """Wait for the kernels of the modules recorded in ``scopes`` (Inductor's own wait: each future in a module's
    namespace is replaced by its kernel); raises what a kernel's compilation raised.

    As the wait did inside the lowering: under Dynamo's compile lock, without Inductor's bundling of Triton kernels
    (which collects into one process-wide list for the compilation in flight). Inductor hands a kernel source still
    compiling to every module that asks for it, as one future, which yields its kernel once: a later module holding
    the same future gets the kernel the first one got."""
    if not scopes:
        return
    from torch._dynamo.convert_frame import compile_lock
    from torch._inductor import config

    with compile_lock, config.patch(bundle_triton_into_fx_graph_cache=False):
        while scopes:
            async_compile, scope = scopes.pop(0)
            pending = _futures(scope)
            for key, future in pending.items():
                if future in _resolved:
                    scope[key] = _resolved[future]
            if async_compile is None:
                if _futures(scope):
                    raise RuntimeError("a Triton kernel of this region's Inductor module did not compile")
                continue
            _original_wait(async_compile, scope)
            for key, future in pending.items():
                _resolved.setdefault(future, scope[key])
