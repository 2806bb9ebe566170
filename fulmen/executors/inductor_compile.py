"""Compiling fused regions with Inductor: shared kernels, a background worker and its bookkeeping.

A ``Kernel`` is one Inductor compilation of a region's code for one input layout (shapes, strides, dtypes,
devices). Kernels are shared: regions whose code is the same up to the names of their values (a model's
identical layers, or the same program traced again) and whose inputs have the same layout compile once.

In ``"async"`` mode (the default) compilations run on one background thread; a program that exits waits for
the compilation in flight, not for the queued ones. The thread starts working only
once the program has stopped discovering new work for ``QUIET_SECONDS``: the first call of a program traces,
runs and schedules its regions without competing with the compiler for the interpreter, so it returns at
eager speed; compilation then fills the time of the following calls. Everything queued by then compiles as one
batch: Inductor lowers each kernel, then the batch's C++ kernels build in one compiler run (``inductor_cpp``;
a training step's forward and backward regions together). ``"sync"`` compiles each kernel before its first call
returns (tests, benchmarks). Inductor's FX graph cache and fulmen's library index keep compiled code on disk,
so a second process finds its kernels there.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from fulmen.core.ambient import Ambient, switches
from fulmen.core.options import COMPILE_MODES, env_seconds
from fulmen.core.utils import compiler_import_lock
from fulmen.executors import inductor_graph_cache as graph_cache
from fulmen.executors import inductor_triton_wait as triton_wait
from fulmen.executors.fx_isolation import fx_tracing_kept_to_this_thread
from fulmen.executors.inductor_cpp import MergedBuild, merged_cpp_build, prefetch_header
from fulmen.executors.inductor_decomps import decomposition_table
from fulmen.executors.inductor_layout import keep_output_strides, with_eager_strides

log = logging.getLogger("fulmen.inductor")

_env_mode = os.environ.get("FULMEN_COMPILE", "async")
if _env_mode not in COMPILE_MODES:
    raise ValueError(f"FULMEN_COMPILE={_env_mode!r} is not a compile mode; use one of {', '.join(COMPILE_MODES)}")

#: "async" (default): regions compile in the background while the torch executor runs them;
#: "sync": each region compiles before its first call returns (tests, benchmarks);
#: "off": regions never compile and keep running with the torch executor (debugging, and the test suite's
#: default, where hundreds of programs run once). The environment variable FULMEN_COMPILE sets the default.
compile_mode: contextvars.ContextVar[str] = contextvars.ContextVar("fulmen_compile_mode", default=_env_mode)


@contextlib.contextmanager
def compile_mode_set(mode: str | None):
    """Regions created inside the block use ``mode`` (``None``: leave the current mode)."""
    if mode is None:
        yield
        return
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    token = compile_mode.set(mode)
    try:
        yield
    finally:
        compile_mode.reset(token)


#: The background compiler waits until no new compilation was requested for this long (seconds). Shared by every
#: jitted function of the process; the environment variable FULMEN_COMPILE_QUIET_SECONDS sets it.
QUIET_SECONDS = env_seconds("FULMEN_COMPILE_QUIET_SECONDS", 0.3)

_jobs: queue.SimpleQueue = queue.SimpleQueue()
_workers: list[threading.Thread] = []
#: Compile threads. One: Inductor's compilation is not written for two threads at once (shared caches and
#: counters); its C++ compiles already run in worker processes.
WORKERS = 1
_worker_lock = threading.Lock()
_shutting_down = False
_last_request = 0.0
_kernels: dict[tuple, Kernel] = {}
_pool_started = False  # Inductor's Triton compile workers (``_start_triton_workers``)
_compiling = False  # the background worker is compiling a batch now (not merely holding one back)
_capped = threading.local()  # .threads: the count ``call_leaving_a_core`` capped this thread's PyTorch threads from


class Kernel:
    """One Inductor compilation; ``fn`` is the compiled callable (taking a list of tensors) once it is ready.

    ``ambient``: the default dtype and device its region was traced under, which its compilation reads again.
    ``parked``: the job the background compiler set aside because the process's settings (default dtype, ...)
    were others (``resume`` queues it again)."""

    __slots__ = ("name", "fn", "failed", "done", "seconds", "threads", "ambient", "parked", "dims", "check")

    def __init__(self, name: str, ambient: Ambient, dims: frozenset[tuple[int, int]] | None = None):
        self.name = name
        self.fn: Callable | None = None
        self.failed = False
        self.done = False
        self.seconds = 0.0
        self.threads: int | None = None  # the CPU threads of the program that asked for it (``program_threads``)
        self.ambient = ambient
        self.parked: tuple | None = None
        self.dims = dims  # the (input, dim) sizes that are symbols in its compilation (None: every size a constant)
        self.check = None  # for such a kernel, once compiled: the ``LayoutCheck`` a call's inputs must pass


def _submit(job: tuple) -> None:
    with _worker_lock:
        while len(_workers) < WORKERS:
            # Not a daemon: at exit the interpreter waits for the compilation in flight (queued ones are dropped).
            # A daemon thread killed inside Inductor's C++ code aborts the process ("terminate called without an
            # active exception").
            _workers.append(threading.Thread(target=_work, name=f"fulmen-inductor-{len(_workers)}"))
            _workers[-1].start()
    _jobs.put(job)


def _work() -> None:
    global _compiling
    # PyTorch gives a thread the process-wide thread count of the moment it first asks for it, and keeps it. Asked
    # now, before this worker's first batch, no program is capped (``call_leaving_a_core`` caps only while a batch
    # compiles), so the worker has the program's count and its compilations need no ``cpp.threads`` patch (which
    # would be part of the keys of Inductor's on-disk cache).
    torch.get_num_threads()
    while True:
        jobs = [_jobs.get()]
        while jobs[0] is not None and not _shutting_down and time.monotonic() - _last_request < QUIET_SECONDS:
            time.sleep(0.05)
        with contextlib.suppress(queue.Empty):
            while True:  # everything queued by now compiles as one batch
                jobs.append(_jobs.get_nowait())
        _compiling = True
        try:
            _compile([j for j in jobs if j is not None])  # at exit (a None was queued) it only marks them done
        finally:
            _compiling = False
        if _shutting_down:
            return
        # The example inputs are real allocations (device memory on a GPU): dropped now, not when the next job
        # arrives, which may be never.
        jobs = None


def _stop_compiling() -> None:
    """At interpreter exit, before threads are joined: start no new compilation, and wake idle workers."""
    global _shutting_down
    _shutting_down = True
    for _ in _workers:
        _jobs.put(None)


threading._register_atexit(_stop_compiling)  # runs before atexit's hooks, while threads still run


def get_kernel(key: tuple, name: str, eager: Callable, args: tuple, mode: str, ambient: Ambient,
               dims: frozenset[tuple[int, int]] | None = None) -> Kernel:
    """The shared kernel for ``key`` (which includes ``ambient.key()``: the same code compiles to different kernels
    under other defaults); a new one is compiled now (sync), scheduled (async) or never (off), under ``ambient``.
    ``dims``: the (input, dim) sizes to compile as symbols (part of ``key``)."""
    global _last_request
    kernel = _kernels.get(key)
    if kernel is not None:
        return kernel
    kernel = Kernel(name, ambient, dims)
    kernel.threads = program_threads()
    if mode == "off":
        kernel.done = True
        return kernel  # not shared: a later program in another mode compiles it
    _kernels[key] = kernel
    if not _pool_started and any(a.device.type == "cuda" for a in args):
        _start_triton_workers()
    # example inputs with the same layout; tracing is fake, so their values do not matter
    example = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device) for a in args]
    if mode == "sync":
        _compile([(kernel, eager, example)])
    else:
        _last_request = time.monotonic()
        _submit((kernel, eager, example))
    return kernel


def resume(kernel: Kernel) -> None:
    """Queue a parked kernel again, if the process's settings are now its own (a call of its program, which runs
    only under the default dtype it was traced with, is the time to look)."""
    global _last_request
    job = kernel.parked
    if job is not None and kernel.ambient.matches():
        kernel.parked = None
        _last_request = time.monotonic()
        _submit((kernel, *job))


def _start_triton_workers() -> None:
    """Start Inductor's Triton compile processes now, as ``torch.compile`` does when its backend is first called.

    Inductor compiles a kernel in its worker processes only once they are all up; until then it compiles in
    the calling process, one kernel after another. The first regions of a program would otherwise pay that
    serial compile while the pool starts beside them.
    """
    global _pool_started
    _pool_started = True
    try:
        with compiler_import_lock:
            from torch._inductor.async_compile import maybe_warm_pool
        maybe_warm_pool()
    except Exception as e:  # an optimization only: compilation works without the pool
        log.info("fulmen: could not start Inductor's compile workers early (%s: %s)", type(e).__name__, e)


def _vector_isa_known() -> bool:
    """Whether ATen itself runs AVX2 or AVX-512 kernels on this x86 CPU.

    Inductor decides which vector instructions its C++ kernels may use by compiling and loading a probe library for each
    candidate, once per cache directory: on a cold start that costs as much as compiling a region. ATen has already made
    the same decision at startup (CPU and operating-system support, and the ``ATEN_CPU_CAPABILITY`` override), so when
    it runs AVX2 or AVX-512 kernels fulmen tells Inductor the instructions are usable (``config.cpp.vec_isa_ok``)
    instead of probing. A C++ compiler that cannot emit them would fail the region's compilation, and the region keeps
    running with the torch executor (logged).
    """
    import platform

    return platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _lower(fn: Callable, example: list[torch.Tensor], cpp: MergedBuild, threads: int | None = None,
           dims: frozenset[tuple[int, int]] | None = None) -> Any:
    """Inductor's compilation of ``fn`` for inputs like ``example``, except for its CPU kernels' C++ build: those
    join ``cpp``, and the returned callable works once ``cpp`` is built. ``threads``: the PyTorch CPU threads the
    kernels will run with (default: the calling thread's). ``dims``: the (input, dim) sizes compiled as symbols;
    then ``(callable, LayoutCheck)`` (``fulmen.executors.inductor_dynamic``)."""
    on_cpu = all(a.device.type == "cpu" for a in example)
    with compiler_import_lock:
        import torch._dynamo  # noqa: F401  (before Inductor: its modules import Dynamo's)
        from torch._inductor import codecache, config
    # The FX graph cache's key hashes the source files of torch and Triton (once per process, not cheap): on
    # threads of PyTorch's own, beside the rest of Inductor's imports (a no-op once they are computed; older torch
    # releases have no prefetch and compute them when first asked).
    for key in (getattr(codecache, "torch_key", None), getattr(codecache, "triton_key", None)):
        getattr(key, "prefetch", lambda: None)()
    # A region computes what its operations compute one by one: a cast to a lower precision rounds there, even
    # when Inductor fuses it with the operations around it (which it otherwise computes in float32 throughout).
    patch = {"emulate_precision_casts": True}
    # Inductor gathers the Triton kernels of the compilation in flight into one process-wide list (TritonBundler),
    # one compilation at a time. The compile lock below keeps Dynamo's compilations apart from a lowering; Inductor
    # entry points that do not take it (torch._inductor.compile, standalone compiles) would fail on the list.
    # Without the bundle a region's Triton kernels come from Triton's own on-disk cache.
    patch["bundle_triton_into_fx_graph_cache"] = False
    if config.cpp.vec_isa_ok is None and on_cpu and _vector_isa_known():
        patch["cpp.vec_isa_ok"] = True
    if on_cpu and threads and threads != torch.get_num_threads():
        # Inductor's C++ code specializes on the compiling thread's PyTorch thread count: with one thread, its
        # kernels have no OpenMP loops at all. A compiling thread whose count is not the program's (a sync
        # compilation inside ``call_leaving_a_core``'s cap, or a program that changed its count after the worker
        # started) says the program's count explicitly.
        patch["cpp.threads"] = threads
    with config.patch(patch):
        if on_cpu:
            prefetch_header()  # before the rest of Inductor's imports, which then run beside the header's check
        with compiler_import_lock:
            from torch._dynamo.convert_frame import compile_lock
            from torch._guards import TracingContext, tracing  # noqa: F401  (imported under the lock)
            from torch._inductor.compile_fx import compile_fx_inner  # noqa: F401  (imported under the lock)

            from fulmen.executors.inductor_dynamic import LayoutCheck, check_output_strides
            from fulmen.executors.inductor_graph import aten_graph  # noqa: F401  (imported under the lock)
            from fulmen.executors.inductor_sympy import shortcut_here  # noqa: F401  (imports sympy)

            decompositions = decomposition_table()
        # Inductor's compilation has process-wide moments: its own passes trace with FX (pattern replacements,
        # loop bounds), which replaces nn.Module.__call__ for the process while it runs, and it keeps one
        # compilation's state in class attributes. Dynamo compiles (and Inductor compiles a backward) holding
        # Dynamo's compile lock; a lowering holds it too, so it never runs while Dynamo traces the user's code on
        # another thread, which would see FX's wrappers. The C++ build after it runs without the lock. Threads that
        # are only running code meanwhile (a torch.compile'd step) see FX's traces neither (fx_isolation).
        with compile_lock, fx_tracing_kept_to_this_thread():
            key = graph_cache.region_key(fn, example, decompositions, dims)
            found = _cached_compilation(key, example, cpp) if key is not None else None
            gm, compiled, fake_mode, fakes = found or _captured_compilation(fn, example, decompositions, dims, cpp, key)
        call = getattr(compiled, "current_callable", compiled)
        if dims:
            check_output_strides(compiled, gm)
            return call, LayoutCheck(fakes, fake_mode.shape_env)
        return with_eager_strides(call, compiled, gm, fn, example)


def _captured_compilation(fn: Callable, example: list[torch.Tensor], decompositions, dims, cpp: MergedBuild,
                          key: str | None) -> tuple:
    """``(graph, compilation, fake mode, fake inputs)`` of ``fn``'s region, its graph captured now; kept in
    ``graph_cache`` under ``key`` (unless ``None``)."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner

    from fulmen.executors.inductor_sympy import shortcut_here as index_shortcut

    gm, fake_mode, fakes = _region_graph(fn, example, decompositions, dims)
    keep_output_strides(gm)
    entry = _entry_to_keep(gm, fakes) if key is not None else None  # before Inductor's passes rewrite gm in place
    with merged_cpp_build(cpp), tracing(TracingContext(fake_mode)), index_shortcut():
        compiled = compile_fx_inner(gm, fakes)
    if entry is not None:
        graph_cache.store(key, entry)
    return gm, compiled, fake_mode, fakes


class _NotInInductorCache(Exception):
    pass


@contextlib.contextmanager
def _only_from_inductor_cache():
    """Inside the block, ``compile_fx_inner`` returns a compilation from Inductor's FX graph cache or raises
    ``_NotInInductorCache`` instead of lowering the graph. Scoped to the caller's lowering, which holds Dynamo's
    compile lock (every other Inductor compilation of the process waits for it)."""
    import torch._inductor.compile_fx as compile_fx

    def refuse(*args, **kwargs):
        raise _NotInInductorCache

    original = compile_fx.fx_codegen_and_compile
    compile_fx.fx_codegen_and_compile = refuse
    try:
        yield
    finally:
        compile_fx.fx_codegen_and_compile = original


def _cached_compilation(key: str, example: list[torch.Tensor], cpp: MergedBuild) -> tuple | None:
    """``(graph, compilation, fake mode, fake inputs)`` of a region whose graph ``graph_cache`` kept under ``key``
    and whose compilation Inductor's FX graph cache holds; ``None`` otherwise (the region is then captured and
    lowered)."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner

    from fulmen.executors.inductor_sympy import shortcut_here as index_shortcut

    entry = graph_cache.load(key)
    if entry is None:
        return None
    fake_mode = _fake_mode()
    fakes = [fake_mode.from_tensor(a) for a in example]
    gm = graph_cache.rebuild(entry, fake_mode)
    if gm is None:
        return None
    keep_output_strides(gm)
    try:
        with _only_from_inductor_cache(), merged_cpp_build(cpp), tracing(TracingContext(fake_mode)), index_shortcut():
            return gm, compile_fx_inner(gm, fakes), fake_mode, fakes
    except Exception as e:  # Inductor wraps what its lowering raised
        if isinstance(e, _NotInInductorCache) or isinstance(getattr(e, "inner_exception", None), _NotInInductorCache):
            return None
        raise


def _entry_to_keep(gm, fakes: list) -> dict | None:
    """``gm`` as ``graph_cache`` keeps it, if the graph rebuilt from that gives Inductor's cache the same key."""
    from torch._inductor.codecache import compiled_fx_graph_hash

    entry = graph_cache.graph_entry(gm)
    if entry is None:
        return None
    rebuilt = graph_cache.rebuild(entry, fakes[0].fake_mode if fakes else _fake_mode())
    try:
        if rebuilt is not None and (
            compiled_fx_graph_hash(rebuilt, fakes, {}, [])[0] == compiled_fx_graph_hash(gm, fakes, {}, [])[0]
        ):
            return entry
    except Exception as e:  # Inductor cannot key it: nothing to find it by later
        log.debug("fulmen: a region's graph is not kept (%s: %s)", type(e).__name__, e)
        return None
    log.debug("fulmen: a region's graph is not kept: rebuilt, it keys Inductor's cache differently")
    return None


def _region_graph(fn: Callable, example: list[torch.Tensor], decompositions, dims) -> tuple:
    """The aten graph of ``fn``, the fake mode to compile it in and its fake inputs (the sizes at ``dims``
    symbolic)."""
    from fulmen.executors.inductor_graph import aten_graph, symbolic_aten_graph

    if dims:
        return symbolic_aten_graph(fn, example, decompositions, dims)
    fake_mode = _fake_mode()
    return aten_graph(fn, example, decompositions), fake_mode, [fake_mode.from_tensor(a) for a in example]


def _fake_mode():
    """The fake mode Inductor compiles a region's graph in: with a shape environment, inside a tracing context, as
    Dynamo provides one around Inductor.

    Inductor's FX graph cache (the on-disk cache of whole compilations, keyed by the graph, the input layouts,
    Inductor's configuration and the torch version) refuses a compilation without a shape environment ("Bypassing FX
    Graph Cache because 'No shape env'"), and it hashes real example inputs by value, as constants. Without both, a
    second process lowers every region again and only the C++ build comes from the disk. The shapes are static, so the
    environment records no guards and a cached graph matches on its key alone.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)


def _compile(jobs: list[tuple[Kernel, Callable, list[torch.Tensor]]]) -> None:
    """Compile a batch of kernels: each is lowered by Inductor, then all of their C++ kernels build as one
    library (one compiler run pays for parsing ATen's headers once). A kernel whose lowering fails keeps running
    with the torch executor, and the log says so; the others are unaffected.

    Each kernel is lowered under the settings its region was traced under (``Kernel.ambient``: default dtype and
    device, ...). On the program's thread (a sync compilation) they are applied for the lowering. The background
    compiler must not change process-wide settings under the program's threads: it lowers a kernel only while
    they already are the kernel's (and still are when the lowering ends), and parks the others."""
    background = threading.current_thread() in _workers
    cpp = MergedBuild()
    lowered = []
    for kernel, eager, example in jobs:
        if _shutting_down:
            kernel.done = True
            continue
        start = time.perf_counter()
        try:
            before = switches()
            if background and not kernel.ambient.matches():
                _park(kernel, eager, example)
                continue
            waits: list = []  # its modules' waits for their Triton kernels, done once the batch is lowered
            with kernel.ambient.applied(), triton_wait.deferring_waits(waits):  # ambient: the default device only
                call = _lower(eager, example, cpp, kernel.threads, kernel.dims)
                if kernel.dims:
                    call, kernel.check = call
            triton_wait.expect_ready(waits, getattr(call, "__wrapped__", call))
            if background and (switches() != before or not kernel.ambient.matches()):  # changed while it lowered
                triton_wait.finish(waits)  # its kernels compiled: the next lowering finds them in Triton's cache
                _park(kernel, eager, example)
                continue
            lowered.append((kernel, call, waits))
        except Exception as e:  # the region keeps running with the torch executor
            _failed(kernel, e)
        finally:
            kernel.seconds += time.perf_counter() - start
    start = time.perf_counter()
    lowered = _finish_triton_waits(lowered)
    try:
        cpp.build()
        for kernel, call in lowered:
            cpp.resolve_in(getattr(call, "__wrapped__", call))
            kernel.fn = call
    except Exception as e:
        for kernel, _ in lowered:
            _failed(kernel, e)
    finally:
        share = (time.perf_counter() - start) / max(len(lowered), 1)
        for kernel, _ in lowered:
            kernel.seconds += share
        for kernel, _, _ in jobs:
            kernel.done = kernel.parked is None


def _finish_triton_waits(lowered: list[tuple[Kernel, Callable, list]]) -> list[tuple[Kernel, Callable]]:
    """The batch's lowered kernels whose Triton kernels compiled (each waited for once the whole batch is lowered,
    ``inductor_triton_wait``); a kernel whose Triton compilation failed fails, and the others are kept."""
    ready = []
    for kernel, call, waits in lowered:
        try:
            triton_wait.finish(waits)
        except Exception as e:
            _failed(kernel, e)
        else:
            ready.append((kernel, call))
    return ready


def _park(kernel: Kernel, eager: Callable, example: list[torch.Tensor]) -> None:
    kernel.parked = (eager, example)
    log.info("fulmen: %s waits to compile until the process's settings are those it was traced under again "
             "(%s; now %s)", kernel.name, kernel.ambient, Ambient.capture())


def _failed(kernel: Kernel, e: Exception) -> None:
    kernel.failed = True
    if kernel.dims and not _shutting_down:  # the region still compiles a kernel per layout
        log.info("fulmen: %s has no kernel with symbolic sizes (%s: %s); it compiles one per input layout",
                 kernel.name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return
    if not _shutting_down:  # at interpreter exit nothing will call the region again
        log.warning("fulmen: Inductor could not compile %s (%s: %s); it keeps running with the torch executor",
                    kernel.name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")


def pending_compilations() -> int:
    """Region compilations queued or running (0 once every region seen so far is compiled or failed, or parked
    until its program runs under its default dtype again)."""
    return sum(1 for k in list(_kernels.values()) if not k.done and k.parked is None)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def call_leaving_a_core(fn: Callable, *args):
    """``fn(*args)``; while the background compiler works, with this thread's PyTorch CPU threads capped one below
    the cores the process may use, so that the compiler (a Python thread, then g++) keeps a core to itself.

    The jitted program's calls (forward, and the backward autograd runs) go through here: while regions compile,
    the whole program runs beside the compiler, its matrix products (two thirds of a GPT training step on CPU)
    as much as its unfused regions. Without the cap, a machine with few cores runs the compiler beside OpenMP
    threads that spin while they wait for each other. Outside a compilation this is a flag read and the call
    (compiled code runs at full speed), as it is where the threads already leave a core free, or on one core.
    PyTorch's thread count is per thread; a thread created inside the call would inherit the cap, and a
    jitted program creates none. A nested call finds the threads capped already and changes nothing."""
    if not _compiling:
        return fn(*args)
    threads, cap = torch.get_num_threads(), usable_cores() - 1
    if cap < 1 or threads <= cap:
        return fn(*args)
    torch.set_num_threads(cap)
    _capped.threads = threads
    try:
        return fn(*args)
    finally:
        _capped.threads = None
        torch.set_num_threads(threads)


def program_threads() -> int:
    """The PyTorch CPU threads the calling thread's program runs with: its thread count, or, inside
    ``call_leaving_a_core``'s cap, the count it was capped from. Kernels compile for this count."""
    return getattr(_capped, "threads", None) or torch.get_num_threads()


def wait_for_compilations(timeout: float | None = None) -> None:
    """Block until every queued region compilation has finished (benchmarks and tests use this)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending_compilations() and (deadline is None or time.monotonic() < deadline):
        time.sleep(0.02)


def kernel_stats() -> dict[str, float]:
    kernels = list(_kernels.values())
    return {"kernels": len(kernels), "kernels_compiled": sum(1 for k in kernels if k.fn is not None),
            "kernels_failed": sum(1 for k in kernels if k.failed),
            "compile_seconds": sum(k.seconds for k in kernels)}
