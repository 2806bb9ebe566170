"""``fulmen bench --mode generate``: Hugging Face ``generate()`` per backend: time to first token, decode speed.

``run_generate(GenerateConfig(model="hf:llama", backend="torch.compile-fulmen"))`` returns a ``GenerateRow``. The
model is a tiny decoder built from a config with seeded random weights (``fulmen.bench.hf``; nothing is
downloaded), generating greedily with its key/value cache. What each number means:

- ``ttft_ms``: median wall time of ``generate(max_new_tokens=1)``: the prompt's forward and the first token.
- ``decode_tok_s``: tokens per second of the decode steps: ``batch * (new_tokens - 1)`` over the difference of the
  medians of ``generate(max_new_tokens=new_tokens)`` and ``generate(max_new_tokens=1)`` (``min_new_tokens`` is
  set too, so that an end-of-sequence token never stops a run early). Each timed step runs both calls.
- ``eager_ttft_ms`` and ``eager_decode_tok_s``: eager PyTorch's figures on a second copy of the model, its
  generations timed in turns with the backend's, so that the ``x eager`` ratios compare generations taken side by
  side (a shared machine's speed drifts over minutes).
- ``first_generate_s``: wall time from wrapping the model to the end of its first ``generate`` of ``new_tokens``
  tokens, compilation included (in this process: caches may be warm).
- ``compilations``: what the backend compiled: ``torch.compile``'s graphs (Dynamo's ``unique_graphs``), the
  Dynamo graphs handed to fulmen (``fulmen.frontend.dynamo.backend_stats``), or ``fulmen.jit``'s programs.
- ``tokens_match``: whether the backend's first generated tokens are eager PyTorch's, token for token (eager
  runs the same model in the same process); ``note`` says what went wrong otherwise, and when a backend left the
  model to eager PyTorch (a Dynamo graph fulmen could not trace, a jitted model whose compiled program was never
  called).

The backends wrap the model the way Hugging Face recommends for compiled decoding: ``model.forward =
torch.compile(model.forward, ...)``; ``fulmen`` is ``fulmen.jit(model)`` and calls the wrapper's ``generate``.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fulmen.bench.hf import HF_MODELS, hf_model

__all__ = ["GENERATE_BACKENDS", "GenerateConfig", "GenerateRow", "generate_model_names", "run_generate"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: How long the runner keeps generating while a background-compiling backend still reports pending work.
MAX_BACKGROUND_WAIT_S = 600.0

Progress = Callable[[str, "int | None", "int | None"], None]


def generate_model_names() -> list[str]:
    """The decoder-only models of ``fulmen.bench.hf`` (the ones ``generate`` continues a prompt with)."""
    return [f"hf:{name}" for name, (_, cls, _) in HF_MODELS.items() if cls.endswith(("ForCausalLM", "LMHeadModel"))
            and name not in ("qwen2_moe", "mixtral")]  # MoE routing is data-dependent: not a decode benchmark


class _Backend:
    """How one backend wraps a model for ``generate``, and what it reports it compiled."""

    def __init__(self, name: str, kind: str, options: dict | None = None):
        self.name = name
        self.kind = kind  # "eager", "torch.compile" or "fulmen"
        self.options = options or {}

    def wrap(self, model: torch.nn.Module):
        import torch._dynamo
        from torch._dynamo.utils import counters

        if self.kind == "torch.compile":
            from fulmen.frontend.dynamo import reset_backend_stats

            torch._dynamo.reset()
            reset_backend_stats()
            counters.clear()
            model.forward = torch.compile(model.forward, **self.options)
            return model
        if self.kind == "fulmen":
            import fulmen

            return fulmen.jit(model, **self.options)
        return model

    def pending(self, wrapped) -> int:
        if self.kind != "fulmen":
            return 0
        import fulmen

        return fulmen.compile_stats(wrapped).pending_compilations

    def compilations(self, wrapped) -> tuple[int | None, str | None]:
        """How many graphs or programs were compiled, and a note when part of the model ran on eager PyTorch."""
        if self.kind == "torch.compile":
            from torch._dynamo.utils import counters

            graphs = counters["stats"]["unique_graphs"]
            if self.options.get("backend") != "fulmen":
                return graphs, None
            from fulmen.frontend.dynamo import backend_stats

            stats = backend_stats()
            note = None
            if stats.eager_graphs:
                note = f"{stats.eager_graphs} of {stats.graphs} Dynamo graphs ran on eager PyTorch"
            elif stats.graphs != graphs:
                note = f"Dynamo captured {graphs} graphs, fulmen was handed {stats.graphs}"
            return stats.compilations, note
        if self.kind == "fulmen":
            import fulmen

            stats = fulmen.compile_stats(wrapped)
            note = None if stats.calls else "ran on eager PyTorch: generate() never called the jitted module"
            return stats.cache_misses, note
        return None, None


#: The backends of ``--mode generate``. ``torch.compile-fulmen`` compiles fused regions before the call returns
#: (``compile="sync"``): a region compiling in the background while Dynamo traces the next graph is not safe yet.
GENERATE_BACKENDS: dict[str, _Backend] = {
    "eager": _Backend("eager", "eager"),
    "torch.compile": _Backend("torch.compile", "torch.compile"),
    "fulmen": _Backend("fulmen", "fulmen"),
    "fulmen-sync": _Backend("fulmen-sync", "fulmen", {"compile": "sync"}),
    "fulmen-torch": _Backend("fulmen-torch", "fulmen", {"executors": ["torch"]}),
    "torch.compile-fulmen": _Backend("torch.compile-fulmen", "torch.compile",
                                     {"backend": "fulmen", "options": {"compile": "sync"}}),
    "torch.compile-fulmen-torch": _Backend("torch.compile-fulmen-torch", "torch.compile",
                                           {"backend": "fulmen", "options": {"executors": ["torch"]}}),
}


@dataclass
class GenerateConfig:
    model: str = "hf:llama"
    backend: str = "eager"
    prompt_len: int = 32
    new_tokens: int = 32
    batch_size: int = 1
    steps: int = 5
    warmup: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    threads: int | None = None

    def validate(self) -> None:
        if self.model not in generate_model_names():
            raise ValueError(f"--mode generate: unknown model {self.model!r}; use one of "
                             f"{', '.join(generate_model_names())}")
        if self.backend not in GENERATE_BACKENDS:
            raise ValueError(f"--mode generate: unknown backend {self.backend!r}; use one of "
                             f"{', '.join(GENERATE_BACKENDS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPES)}")
        if self.new_tokens < 2 or self.prompt_len < 1 or self.steps < 1 or self.batch_size < 1 or self.warmup < 0:
            raise ValueError("--mode generate needs new_tokens >= 2 (the first token is timed apart from the decode "
                             f"steps), a positive prompt length, steps and batch size; got new_tokens="
                             f"{self.new_tokens}, prompt_len={self.prompt_len}, steps={self.steps}, batch_size="
                             f"{self.batch_size}, warmup={self.warmup}")


@dataclass
class GenerateRow:
    model: str
    backend: str
    device: str
    dtype: str
    batch_size: int
    prompt_len: int
    new_tokens: int
    steps: int
    ttft_ms: float | None = None
    decode_tok_s: float | None = None
    eager_ttft_ms: float | None = None  # eager's figures from generations interleaved with this row's
    eager_decode_tok_s: float | None = None
    first_generate_s: float | None = None
    compilations: int | None = None
    tokens_match: bool | None = None
    note: str | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(config: GenerateConfig) -> tuple[torch.nn.Module, torch.Tensor]:
    device = torch.device(config.device)
    positions = config.prompt_len + config.new_tokens
    # GPT-2 has a learned position table: it must be as long as the prompt and the tokens generated
    overrides = {"n_positions": positions} if config.model == "hf:gpt2" else {"max_position_embeddings": positions}
    model = hf_model(config.model, device, DTYPES[config.dtype], config.seed, **overrides).eval()
    model.config.use_cache = True  # hf_model turns the cache off for training; decoding uses it
    model.generation_config.use_cache = True
    gen = torch.Generator().manual_seed(config.seed + 1)
    ids = torch.randint(2, model.config.vocab_size, (config.batch_size, config.prompt_len), generator=gen)
    return model, ids.to(device)


def _generate(holder, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return holder.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


def _first_difference(got: torch.Tensor, expected: torch.Tensor) -> str:
    if got.shape != expected.shape:
        return f"tokens of shape {tuple(got.shape)}, eager's {tuple(expected.shape)}"
    rows, cols = (got != expected).nonzero(as_tuple=True)
    return f"first differing token: sequence {rows[0].item()}, position {cols[0].item()}"


def _figures(one: list[float], full: list[float], config: GenerateConfig) -> tuple[float, float | None]:
    """Time to first token (ms) and decode tokens/s from the times of generate(1) and generate(new_tokens)."""
    decode_s = statistics.median(full) - statistics.median(one)
    tok_s = config.batch_size * (config.new_tokens - 1) / decode_s if decode_s > 0 else None
    return statistics.median(one) * 1e3, tok_s


def _measure(config: GenerateConfig, row: GenerateRow, progress: Progress) -> None:
    if config.threads:
        torch.set_num_threads(config.threads)
    backend = GENERATE_BACKENDS[config.backend]
    device = torch.device(config.device)

    progress("eager reference", None, None)
    ref_model, ids = _build(config)
    expected = _generate(ref_model, ids, config.new_tokens)
    pair = backend.kind != "eager"  # eager's steps are timed side by side with the backend's
    if not pair:
        del ref_model

    model, ids = _build(config)
    progress("compiling" if backend.kind != "eager" else "first generate", None, None)
    _sync(device)
    start = time.perf_counter()
    holder = backend.wrap(model)
    first = _generate(holder, ids, config.new_tokens)
    _sync(device)
    row.first_generate_s = time.perf_counter() - start
    row.tokens_match = bool(first.shape == expected.shape and torch.equal(first, expected))
    if not row.tokens_match:
        row.note = _first_difference(first, expected)

    while backend.pending(holder):  # a background compilation finishes before the timing starts
        if time.perf_counter() - start > MAX_BACKGROUND_WAIT_S:
            raise TimeoutError(f"{config.backend} still compiling after {MAX_BACKGROUND_WAIT_S:.0f} s")
        progress("compiling in background", None, None)
        _generate(holder, ids, config.new_tokens)
    runs = [holder, ref_model] if pair else [holder]
    for i in range(config.warmup):
        progress("warming up", i, config.warmup)
        for run in runs:
            _generate(run, ids, 1)
            _generate(run, ids, config.new_tokens)

    times = [([], []) for _ in runs]  # per run: generate(1) times, generate(new_tokens) times
    for i in range(config.steps):
        progress("timing", i, config.steps)
        for run, (one, full) in zip(runs, times):
            for out, n in ((one, 1), (full, config.new_tokens)):
                _sync(device)
                t0 = time.perf_counter()
                _generate(run, ids, n)
                _sync(device)
                out.append(time.perf_counter() - t0)
    figures = [_figures(one, full, config) for one, full in times]
    row.ttft_ms, row.decode_tok_s = figures[0]
    row.eager_ttft_ms, row.eager_decode_tok_s = figures[-1]
    row.compilations, note = backend.compilations(holder)
    if note:
        row.note = f"{row.note}; {note}" if row.note else note


def run_generate(config: GenerateConfig, progress: Progress | None = None, *, verbose: bool = False) -> GenerateRow:
    """Measure one (model, backend) generating; a failure is recorded in ``row.error``, never raised."""
    config.validate()
    row = GenerateRow(model=config.model, backend=config.backend, device=config.device, dtype=config.dtype,
                      batch_size=config.batch_size, prompt_len=config.prompt_len, new_tokens=config.new_tokens,
                      steps=config.steps)
    try:
        _measure(config, row, progress or (lambda phase, done=None, total=None: None))
    except KeyboardInterrupt:
        raise
    except Exception as e:  # a failing backend must not stop the other measurements
        text = str(e).strip().splitlines()
        row.error = f"{type(e).__name__}: {text[0][:150] if text else ''}"
        if verbose:
            traceback.print_exc(file=sys.stderr)
    return row


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_generate_table(rows: list[GenerateRow]) -> str:
    """An aligned text table of generate rows; the ``x eager`` columns divide by eager's figures from generations
    interleaved with the row's own (``eager_ttft_ms``, ``eager_decode_tok_s``)."""
    headers = ["model", "backend", "first token ms", "x eager", "decode tok/s", "x eager", "first generate s",
               "compiled", "tokens", "note"]
    body = []
    for r in rows:
        ttft_ratio = r.ttft_ms / r.eager_ttft_ms if r.ttft_ms and r.eager_ttft_ms else None
        decode_ratio = r.decode_tok_s / r.eager_decode_tok_s if r.decode_tok_s and r.eager_decode_tok_s else None
        tokens = "-" if r.tokens_match is None else ("same" if r.tokens_match else "DIFFER")
        body.append([r.model, r.backend, _fmt(r.ttft_ms, ".2f"), _fmt(ttft_ratio, ".2f"), _fmt(r.decode_tok_s, ".1f"),
                     _fmt(decode_ratio, ".2f"), _fmt(r.first_generate_s, ".2f"), _fmt(r.compilations, "d"), tokens,
                     r.error or r.note or ""])
    numeric = set(range(2, 8))
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(b) for b in body)])
