"""Benchmark one built-in model under one backend: step time, first-call time, compile time, peak memory.

``run_benchmark(BenchConfig(model="gpt-small", mode="train", backend="fulmen"))`` returns a ``BenchRow``.
What each number means:

- ``eager_median_ms`` and ``speedup``: eager PyTorch runs a fresh copy of the model in the same process, one
  step after each of the backend's timed steps; ``speedup`` is eager's median over those steps divided by the
  backend's. Interleaved steps see the same machine, so the ratio does not drift with a shared machine's speed
  between processes and over minutes.
- ``median_ms``: median wall time of ``steps`` timed steps after warm-up (``time.perf_counter``, with
  ``torch.cuda.synchronize()`` around each step on CUDA). A step is one forward under ``torch.no_grad()``
  (inference) or ``zero_grad`` + forward + ``loss.backward()`` + ``optimizer.step()`` (train), with the
  optimizer ``OPTIMIZERS[optimizer]`` builds (every backend gets the same one; see ``OPTIMIZERS``).
- ``first_result_s``: wall time from wrapping the model (``torch.compile(model)``, ``fulmen.jit(model)``) to the
  end of the very first step, compilation included. Without
  isolation the process may already hold warm caches (``torch.compile`` keeps Inductor's in-memory and
  on-disk caches across models even after ``torch._dynamo.reset()``; CPU kernels and allocators are warm).
  ``isolate=True`` runs the measurement in a fresh Python subprocess with empty Inductor/Triton cache
  directories and a fresh temporary directory (where Inductor keeps its precompiled C++ headers), unless
  ``warm_cache=True``: the honest "first time ever on this machine" number.
- ``compiled_s``: wall time from wrapping the model until the backend reports that nothing is left to compile.
  Backends that compile synchronously (eager, ``torch.compile``, ``fulmen-sync``) report the first-call time;
  a backend that compiles in the background implements ``Backend.pending`` and the runner keeps stepping
  (those steps count as warm-up) until it reports zero, so steady-state timing starts fully compiled.
- ``peak_mb``: see ``fulmen.bench.memory`` (CUDA: max allocated; CPU: profiler-based, method in the row).
- ``tokens_per_s``, ``model_flops``, ``mfu``: tokens of a step over its median time, and its model FLOPs and MFU
  (``fulmen.bench.flops``; MFU on CUDA cards with a known peak only).
- ``interleave=False`` (``fulmen.bench.scale``): eager runs only the two steps ``max_diff`` needs, and the speed-up
  comes from the eager row of the same model; ``timeout_s`` (isolated only) stops a measurement's process, keeping
  the step times if they were in.
- ``max_diff``: max abs difference between this backend's first two results (logits, or the loss in train mode)
  and eager PyTorch's on a fresh copy of the model; it catches a fast but wrong backend. Two, because fulmen runs
  a training step's first call on PyTorch autograd and its own compiled program from the second call
  (``fulmen.frontend.warm_start``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fulmen.bench import flops, memory, step_profile
from fulmen.bench.models import CONFIGS, build_any, checkpoint_blocks, model_names, size_overrides

MODES = ("inference", "train")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: The optimizers a training step can take. The optimizer step is the same code under every backend (neither
#: fulmen nor ``torch.compile`` compiles it), so a slow one adds the same milliseconds to every step and pulls
#: every speed-up towards 1. The default is PyTorch's fused AdamW, its fastest implementation on CPU and CUDA
#: (docs/performance.md, "CUDA graphs", compares it with the for-loop that ``AdamW()`` picks on CPU);
#: ``adamw`` is what ``torch.optim.AdamW(params)`` picks by itself (a for-loop on CPU, ``foreach`` on CUDA).
OPTIMIZERS: dict[str, Callable] = {
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
    "adamw-foreach": lambda params: torch.optim.AdamW(params, lr=1e-4, foreach=True),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
}

#: How long the runner keeps stepping while a background-compiling backend still reports pending work.
MAX_BACKGROUND_WAIT_S = 600.0

Progress = Callable[[str, "int | None", "int | None"], None]


def _no_progress(phase: str, done: int | None = None, total: int | None = None) -> None:
    pass


@dataclass
class BenchConfig:
    model: str
    mode: str = "inference"
    backend: str = "eager"
    steps: int = 20
    warmup: int = 3
    batch_size: int = 2
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    isolate: bool = False
    warm_cache: bool = False
    threads: int | None = None  # torch.set_num_threads for the measurement (None: leave as is)
    optimizer: str = "adamw-fused"  # a key of OPTIMIZERS; train mode only
    n_layer: int | None = None  # size overrides of a built-in GPT or LLaMA (``models.size_overrides``)
    width: int | None = None
    seq_len: int | None = None
    autocast: bool = False  # forward under torch.autocast(bfloat16), weights in ``dtype`` (float32 master weights)
    checkpoint: bool = False  # each transformer block under torch.utils.checkpoint (``models.checkpoint_blocks``)
    interleave: bool = True  # time eager's steps between the backend's (False: eager only checks the results)
    timeout_s: float | None = None  # with isolate: stop the measurement's process after this long

    def validate(self) -> None:
        if self.model not in model_names():
            raise ValueError(f"unknown model {self.model!r}; available: {', '.join(model_names())}")
        if self.sized and self.model not in CONFIGS:
            raise ValueError(f"--n-layer, --width and --seq-len apply to the built-in models, not {self.model!r}")
        if self.sized:
            size_overrides(self.model, self.n_layer, self.width, self.seq_len)  # raises naming a bad size
        if self.autocast and self.dtype != "float32":
            raise ValueError(f"bf16-autocast keeps float32 master weights; got dtype {self.dtype!r}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; use one of {', '.join(MODES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; available: {', '.join(BACKENDS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
        if self.steps < 1 or self.warmup < 0 or self.batch_size < 1:
            raise ValueError(f"steps and batch size must be positive and warmup non-negative, got steps={self.steps}, "
                             f"warmup={self.warmup}, batch_size={self.batch_size}")

    @property
    def sized(self) -> bool:
        return (self.n_layer, self.width, self.seq_len) != (None, None, None)

    @property
    def precision(self) -> str:
        return "bf16-autocast" if self.autocast else {"float32": "fp32", "bfloat16": "bf16"}.get(self.dtype, self.dtype)


@dataclass
class BenchRow:
    model: str
    mode: str
    backend: str
    device: str
    dtype: str
    batch_size: int
    steps: int
    optimizer: str | None = None  # train mode: the key of OPTIMIZERS every step used
    median_ms: float | None = None
    min_ms: float | None = None
    eager_median_ms: float | None = None  # eager's median over steps interleaved with this backend's
    speedup: float | None = None  # eager median / this median, filled in by ``add_speedups``
    first_result_s: float | None = None
    compiled_s: float | None = None
    peak_mb: float | None = None
    state_mb: float | None = None
    peak_method: str | None = None
    max_diff: float | None = None
    isolated: bool = False
    repeats: int = 1  # fresh processes whose figures this row's are the medians of (``combine_repeats``)
    first_result_runs: list[float] | None = None  # each process's first-result time, when repeated
    precision: str | None = None  # fp32, bf16 (weights), bf16-autocast (float32 master weights)
    checkpoint: bool = False
    seq_len: int | None = None  # tokens per sequence (token models)
    parameters: int | None = None  # every parameter, each once
    tokens_per_s: float | None = None  # batch x seq_len / median step time
    model_flops: float | None = None  # per step (``fulmen.bench.flops``: 6 N + 12 L H Q T per token in training)
    device_name: str | None = None
    peak_flops: float | None = None  # the card's dense bfloat16 peak, FLOP/s (None on CPU)
    mfu: float | None = None  # model_flops / (median step time x peak_flops)
    # what a step is made of (``fulmen.bench.step_profile``): compiled calls, host time, device time
    calls_per_step: dict | None = None
    host_ms: float | None = None  # median time until the step's Python returned (CUDA: before synchronizing)
    host_cpu_ms: float | None = None  # median CPU time of the calling thread in a step
    device_busy_ms: float | None = None  # CUDA: the kernels' time in one step
    error: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- backends ----

class Backend:
    """How a backend wraps a model. ``pending`` says how many compilations are still running in the background."""

    name = "eager"

    def prepare(self) -> None:
        """Called before wrapping, to start from a fresh state where the backend keeps global caches."""

    def wrap(self, model: torch.nn.Module) -> Callable:
        return model

    def pending(self, wrapped: Callable) -> int:
        return 0


class TorchCompileBackend(Backend):
    """``torch.compile(model)``, or with ``mode`` (``"reduce-overhead"``: CUDA graphs)."""

    def __init__(self, name: str = "torch.compile", mode: str | None = None):
        self.name = name
        self.mode = mode

    def prepare(self) -> None:
        import torch._dynamo

        torch._dynamo.reset()

    def wrap(self, model):
        return torch.compile(model, mode=self.mode)


class FulmenBackend(Backend):
    """``fulmen.jit(model, executors=...)``; ``imports`` are modules that register the executors named."""

    def __init__(self, executors: list[str] | None = None, name: str = "fulmen", imports: tuple[str, ...] = (),
                 compile: str | None = None, cuda_graphs: bool = False):
        self.executors = executors
        self.name = name
        self.imports = imports
        self.compile = compile
        self.cuda_graphs = cuda_graphs

    def wrap(self, model):
        import importlib

        import fulmen

        for module in self.imports:
            importlib.import_module(module)
        return fulmen.jit(model, executors=self.executors, compile=self.compile, cuda_graphs=self.cuda_graphs)

    def pending(self, wrapped) -> int:
        """Compilations not finished (``compile_stats(...).pending_compilations``): training programs whose first
        call ran on PyTorch autograd and that compile at their next call, plus the Inductor region compilations
        started and not finished, across the process. The execution traces do not always hold the regions that
        actually run (a training backward specialized to the cotangents present is compiled at its first call),
        so a count from them would report "done" too early; regions never called are not compiling."""
        import fulmen

        try:
            return fulmen.compile_stats(wrapped).pending_compilations
        except TypeError:
            return 0


BACKENDS: dict[str, Backend] = {
    "eager": Backend(),
    "torch.compile": TorchCompileBackend(),
    # Inductor benchmarks GEMM and kernel choices while compiling; no CUDA graphs
    "torch.compile-max-autotune": TorchCompileBackend(name="torch.compile-max-autotune",
                                                      mode="max-autotune-no-cudagraphs"),
    "fulmen": FulmenBackend(),
    "fulmen-sync": FulmenBackend(name="fulmen-sync", compile="sync"),
    "fulmen-torch": FulmenBackend(executors=["torch"], name="fulmen-torch"),
    # CUDA graphs (on CUDA; elsewhere these run as their plain counterparts, and fulmen logs why)
    "fulmen-cudagraphs": FulmenBackend(name="fulmen-cudagraphs", cuda_graphs=True),
    "torch.compile-cudagraphs": TorchCompileBackend(name="torch.compile-cudagraphs", mode="reduce-overhead"),
}


# ---- one measurement ----

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Callable, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - t0


def _make_step(fn: Callable, mode: str, inputs: tuple, optimizer,
               autocast: torch.device | None = None) -> Callable[[], torch.Tensor]:
    """One step; with ``autocast`` (a device), the forward runs under bfloat16 autocast there and the backward
    outside it, as PyTorch's mixed-precision recipe does."""
    def forward():
        if autocast is None:
            return fn(*inputs)
        with torch.autocast(autocast.type, dtype=torch.bfloat16):
            return fn(*inputs)

    if mode == "inference":
        def step():
            with torch.no_grad():
                return forward()
    else:
        def step():
            optimizer.zero_grad(set_to_none=True)
            _, loss = forward()
            loss.backward()
            optimizer.step()
            return loss.detach()
    return step


def _setup(config: BenchConfig):
    if config.threads:
        torch.set_num_threads(config.threads)
    device = torch.device(config.device)
    overrides = size_overrides(config.model, config.n_layer, config.width, config.seq_len) if config.sized else {}
    model, make_inputs = build_any(config.model, device=device, dtype=DTYPES[config.dtype], seed=config.seed,
                                   **overrides)
    if config.checkpoint:
        checkpoint_blocks(model)
    train = config.mode == "train"
    model.train(train)
    inputs = make_inputs(config.batch_size, targets=train)
    optimizer = OPTIMIZERS[config.optimizer](model.parameters()) if train else None
    return device, model, inputs, optimizer


def _short_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0].rstrip(":") if text else ""
    msg = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return msg if len(msg) <= 160 else msg[:157] + "..."


def _autocast_device(config: BenchConfig, device: torch.device) -> torch.device | None:
    return device if config.autocast else None


def _throughput(config: BenchConfig, row: BenchRow, device: torch.device, model, inputs) -> None:
    """Parameters, tokens/s, model FLOPs and MFU of a token model's step (``fulmen.bench.flops``)."""
    row.parameters = sum(p.numel() for p in model.parameters())
    row.device_name = flops.device_name(device)
    row.peak_flops = flops.peak_flops(row.device_name) if device.type == "cuda" else None
    idx = inputs[0]
    if idx.dtype != torch.long or idx.ndim != 2 or not row.median_ms:
        return  # not token ids (the MLP)
    batch, row.seq_len = idx.shape
    step_s = row.median_ms / 1e3
    row.tokens_per_s = batch * row.seq_len / step_s
    row.model_flops = flops.flops_per_token(model, row.seq_len, train=config.mode == "train") * batch * row.seq_len
    row.mfu = flops.mfu(row.model_flops, step_s, row.peak_flops)


def _measure(config: BenchConfig, row: BenchRow, progress: Progress, timed: Callable[[BenchRow], None]) -> None:
    device, model, inputs, optimizer = _setup(config)
    wrapped, step, first, second = _until_compiled(config, row, progress, device, model, inputs, optimizer)
    expected, expected_second = _time_against_eager(config, row, progress, step, device)
    row.calls_per_step = step_profile.calls_per_step(config.backend, wrapped)
    row.device_busy_ms = step_profile.device_busy_ms(step, device)
    _throughput(config, row, device, model, inputs)
    timed(row)
    _measure_memory(row, progress, step, device, model, optimizer, inputs)
    del wrapped, step, optimizer

    if first.shape != expected.shape:
        row.error = f"result shape {tuple(first.shape)} differs from eager's {tuple(expected.shape)}"
        return
    diff = max((a - b).abs().max().item() if a.numel() else 0.0
               for a, b in ((first, expected), (second, expected_second)))
    if math.isfinite(diff):
        row.max_diff = diff
    else:
        row.error = "result differs from eager's by a non-finite amount (NaN or inf)"


def _until_compiled(config: BenchConfig, row: BenchRow, progress: Progress, device, model, inputs, optimizer):
    """Wrap the model, take the first step and warm up until every compilation is done: ``row.first_result_s``
    and ``row.compiled_s``; returns (the wrapped model, its step, the first and second steps' results)."""
    backend = BACKENDS[config.backend]
    progress("compiling" if config.backend != "eager" else "first call", None, None)
    _sync(device)
    # The clock starts before the model is wrapped: what a backend does when the user wraps the model (torch.compile
    # imports Dynamo in a fresh process) is as much a part of the wait as the first call.
    start = time.perf_counter()
    backend.prepare()
    wrapped = backend.wrap(model)
    step = _make_step(wrapped, config.mode, inputs, optimizer, _autocast_device(config, device))
    first = step()
    _sync(device)
    now = time.perf_counter()
    row.first_result_s = now - start
    first = first.detach().float().clone()

    pending = backend.pending(wrapped)
    compiled_at = now if pending == 0 else None
    second = None  # the first warm-up step's result, also checked against eager (at least one warm-up step runs)
    done_warmup = 0
    while done_warmup < max(config.warmup, 1) or compiled_at is None:
        if compiled_at is None:
            progress(f"compiling in background, {pending} left", None, None)
        else:
            progress("warming up", done_warmup, config.warmup)
        result = step()
        _sync(device)
        if second is None:
            second = result.detach().float().clone()
        done_warmup += 1
        if compiled_at is None:
            pending = backend.pending(wrapped)
            if pending == 0:
                compiled_at = time.perf_counter()
        if compiled_at is None and time.perf_counter() - start > MAX_BACKGROUND_WAIT_S:
            raise TimeoutError(f"{config.backend} still compiling after {MAX_BACKGROUND_WAIT_S:.0f} s")
    row.compiled_s = compiled_at - start
    return wrapped, step, first, second


def _time_against_eager(config: BenchConfig, row: BenchRow, progress: Progress, step, device):
    """Time ``step`` interleaved with eager's on a fresh copy of the model: ``row.median_ms``, ``min_ms`` and
    ``eager_median_ms``; returns eager's first two results (the reference of max_diff)."""
    # Eager PyTorch on a fresh copy of the model: its first result is the reference for max_diff, and its steps
    # are timed interleaved with this backend's, so that the speed-up compares steps taken side by side (a shared
    # machine's speed drifts between processes and over minutes; the medians of interleaved steps do not).
    progress("checking against eager", None, None)
    _, ref_model, ref_inputs, ref_optimizer = _setup(config)
    ref_step = _make_step(ref_model, config.mode, ref_inputs, ref_optimizer, _autocast_device(config, device))
    expected = ref_step().detach().float()
    expected_second = ref_step().detach().float()
    pair = config.backend != "eager" and config.interleave
    for _ in range(config.warmup - 1 if pair else 0):
        ref_step()

    times, eager_times, host, host_cpu = [], [], [], []
    for i in range(config.steps):
        progress("timing", i, config.steps)
        wall, host_s, cpu_s = step_profile.timed_step(step, device)
        times.append(wall)
        host.append(host_s)
        host_cpu.append(cpu_s)
        if pair:
            eager_times.append(_timed(ref_step, device))
    row.host_ms = statistics.median(host) * 1e3
    row.host_cpu_ms = statistics.median(host_cpu) * 1e3
    row.median_ms = statistics.median(times) * 1e3
    row.min_ms = min(times) * 1e3
    row.eager_median_ms = statistics.median(eager_times) * 1e3 if pair else None
    if config.backend == "eager":
        row.eager_median_ms = row.median_ms
    del ref_model, ref_inputs, ref_optimizer, ref_step
    return expected, expected_second


def _measure_memory(row: BenchRow, progress: Progress, step, device, model, optimizer, inputs) -> None:
    """``row.state_mb`` and the peak of a step, ``row.peak_mb`` (``fulmen.bench.memory``)."""
    progress("measuring memory", None, None)
    row.state_mb = memory.tensor_bytes(memory.state_tensors(model, optimizer, inputs)) / 2**20
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the eager copy is freed: this counts the backend's alone
        for _ in range(2):
            step()
        _sync(device)
        row.peak_mb = torch.cuda.max_memory_allocated(device) / 2**20
        row.peak_method = memory.CUDA_METHOD
    else:
        row.peak_mb = row.state_mb + memory.cpu_step_peak_bytes(step) / 2**20
        row.peak_method = memory.CPU_METHOD


def _new_row(config: BenchConfig, **figures) -> BenchRow:
    """A row saying what ``config`` measures, with no figures yet but ``figures``."""
    return BenchRow(model=config.model, mode=config.mode, backend=config.backend, device=config.device,
                    dtype=config.dtype, batch_size=config.batch_size, steps=config.steps,
                    optimizer=config.optimizer if config.mode == "train" else None, precision=config.precision,
                    checkpoint=config.checkpoint, **figures)


def run_benchmark(config: BenchConfig, progress: Progress = _no_progress, *, verbose: bool = False,
                  timed: Callable[[BenchRow], None] = lambda row: None) -> BenchRow:
    """Measure one (model, mode, backend); failures are recorded in ``row.error``, never raised. ``timed`` is
    given the row once its step times are in, before peak memory and the comparison with eager's results."""
    config.validate()
    if config.isolate:
        return _run_isolated(config, progress)
    row = _new_row(config)
    try:
        _measure(config, row, progress, timed)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # a failing backend must not stop the other measurements
        row.error = _short_error(e)
        if verbose:
            traceback.print_exc(file=sys.stderr)
    return row


def add_speedups(rows: list[BenchRow]) -> None:
    """Fill ``speedup`` = eager median / row median, with eager's steps interleaved with the row's (rows from
    older JSON without them fall back to the eager row of the same model and mode)."""
    eager = {(r.model, r.mode): r.median_ms for r in rows if r.backend == "eager" and r.median_ms}
    for r in rows:
        base = r.eager_median_ms or eager.get((r.model, r.mode))
        r.speedup = base / r.median_ms if base and r.median_ms else None


def combine_repeats(rows: Sequence[BenchRow]) -> BenchRow:
    """One row from repeated isolated measurements of the same (model, mode, backend): the median of each
    figure over the processes (the first-result time of one process is a single noisy sample), the largest
    difference from eager, and the first error if any measurement failed."""
    first = rows[0]
    failed = next((r for r in rows if r.error), None)
    if failed is not None:
        return dataclasses.replace(failed, repeats=len(rows),
                                   error=f"{failed.error} (in {sum(1 for r in rows if r.error)} of {len(rows)} runs)")

    def median(name: str) -> float | None:
        values = [getattr(r, name) for r in rows if getattr(r, name) is not None]
        return statistics.median(values) if values else None

    diffs = [r.max_diff for r in rows if r.max_diff is not None]
    step_ms = median("median_ms")
    # throughput and MFU are inversely proportional to the step time: taken from the combined median
    per_step = first.median_ms / step_ms if first.median_ms and step_ms else None
    return dataclasses.replace(
        first, median_ms=step_ms, min_ms=min((r.min_ms for r in rows if r.min_ms is not None), default=None),
        eager_median_ms=median("eager_median_ms"), first_result_s=median("first_result_s"),
        compiled_s=median("compiled_s"), peak_mb=median("peak_mb"), state_mb=median("state_mb"),
        host_ms=median("host_ms"), host_cpu_ms=median("host_cpu_ms"), device_busy_ms=median("device_busy_ms"),
        max_diff=max(diffs) if diffs else None, repeats=len(rows),
        first_result_runs=[r.first_result_s for r in rows if r.first_result_s is not None],
        tokens_per_s=first.tokens_per_s * per_step if first.tokens_per_s and per_step else None,
        mfu=first.mfu * per_step if first.mfu and per_step else None)


# ---- isolation: one fresh subprocess per measurement ----

_ROW_MARKER = "FULMEN_BENCH_ROW "
_TIMED_MARKER = "FULMEN_BENCH_TIMED "


def _run_isolated(config: BenchConfig, progress: Progress) -> BenchRow:
    child = dataclasses.replace(config, isolate=False)
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="fulmen-bench-") as cache_dir:
        if not config.warm_cache:
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")
            env["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")
            env["FULMEN_CACHE_DIR"] = os.path.join(cache_dir, "fulmen")
            # Inductor keeps its precompiled C++ headers outside its cache directory, under the temporary
            # directory (<tmp>/torchinductor_<user>/precompiled_headers), so a fresh TMPDIR makes them cold too:
            # building them is a large part of the first CPU compilation on a machine (docs/performance.md)
            env["TMPDIR"] = os.path.join(cache_dir, "tmp")
            os.makedirs(env["TMPDIR"])
        progress("starting a fresh process", None, None)
        out_path = os.path.join(cache_dir, "row.txt")
        command = [sys.executable, "-m", "fulmen.bench.runner", json.dumps(dataclasses.asdict(child))]
        code, tail, timed_out = run_child(command, env, out_path, progress, config.timeout_s)
        with open(out_path) as f:
            return row_from_output(config, f.readlines(), code, tail, timed_out)


def row_from_output(config: BenchConfig, lines: list[str], code: int, tail: list[str], timed_out: bool) -> BenchRow:
    """The row a measuring process printed (``_child_main``), or one saying why there is none."""
    row_json = next((line[len(_ROW_MARKER):] for line in lines if line.startswith(_ROW_MARKER)), None)
    if timed_out and row_json is None:
        error = f"timed out after {config.timeout_s:.0f} s ({tail[-1]})"
        timed_json = next((line[len(_TIMED_MARKER):] for line in lines if line.startswith(_TIMED_MARKER)), None)
        if timed_json is None:
            return _new_row(config, isolated=True, error=error)
        # the step times were in: kept, with the error saying what is missing (peak memory, the check against eager)
        return dataclasses.replace(BenchRow(**json.loads(timed_json)), isolated=True,
                                   error=error + "; step times kept, results not checked against eager's")
    if row_json is None:
        detail = next((t for t in reversed(tail) if t.strip()), "")
        return _new_row(config, isolated=True, error=f"benchmark subprocess exited with code {code}: {detail}"[:200])
    row = BenchRow(**json.loads(row_json))
    row.isolated = True
    return row


def run_child(command: list[str], env: dict, out_path: str, progress: Progress,
              timeout_s: float | None = None) -> tuple[int, list[str], bool]:
    """Run ``command`` with stdout to ``out_path``, relaying its "@phase<TAB>done<TAB>total" stderr lines to
    ``progress``; returns (exit code, the last lines of other stderr output and the last phase, whether it was
    stopped after ``timeout_s``). The child leads its own process group, so that stopping it also stops what it
    started (Inductor's compile workers), which would otherwise hold its stderr open."""
    tail: list[str] = []
    phase = "starting"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        expired = threading.Event()

        def stop() -> None:
            expired.set()
            _kill_group(proc)

        timer = threading.Timer(timeout_s, stop) if timeout_s else None
        if timer is not None:
            timer.start()
        try:
            assert proc.stderr is not None
            for line in proc.stderr:
                parts = line.rstrip("\n").split("\t")
                if len(parts) == 3 and parts[0].startswith("@"):
                    phase = parts[0][1:]
                    progress(phase, int(parts[1]) if parts[1] else None, int(parts[2]) if parts[2] else None)
                elif line.strip():
                    tail = (tail + [line.rstrip()])[-20:]
            code = proc.wait()
        finally:
            if timer is not None:
                timer.cancel()
            _kill_group(proc)  # leftovers of a finished child
    timed_out = expired.is_set()
    return code, tail + ([f"while {phase}"] if timed_out else []), timed_out


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _child_main(argv: list[str]) -> int:
    config = BenchConfig(**json.loads(argv[0]))

    def report(phase, done=None, total=None):
        print(f"@{phase}\t{'' if done is None else done}\t{'' if total is None else total}", file=sys.stderr,
              flush=True)

    row = run_benchmark(config, report, verbose=True,
                        timed=lambda timed: print(_TIMED_MARKER + json.dumps(timed.to_dict()), flush=True))
    print(_ROW_MARKER + json.dumps(row.to_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
