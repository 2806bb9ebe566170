"""Built-in models for ``fulmen bench``, ``fulmen demo`` and tests: small configs, random weights, no downloads.

The models are written the way real model code is written (``nn.Linear``, ``F.scaled_dot_product_attention``,
``view``/``transpose`` head splits, tied embeddings, rotary buffers), so that tracing them exercises what users'
models exercise::

    model, make_inputs = build("gpt-tiny")
    logits = model(*make_inputs(2))             # (2, seq_len, vocab)
    logits, loss = model(*make_inputs(2, targets=True))
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP", "GPT", "GPTConfig", "Llama", "LlamaConfig", "MLPConfig", "CONFIGS", "build", "model_names",
           "size_overrides", "checkpoint_blocks", "meta_model"]


# ---------------------------------------------------------------------------------------------------------------
# MLP
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MLPConfig:
    in_features: int = 256
    hidden: int = 1024
    out_features: int = 256
    depth: int = 4


class MLP(nn.Module):
    """``depth`` Linear layers with GELU between them (``depth >= 1``)."""

    def __init__(self, in_features: int, hidden: int, out_features: int, depth: int = 2):
        super().__init__()
        if depth < 1:
            raise ValueError(f"MLP depth must be at least 1, got {depth}")
        sizes = [in_features] + [hidden] * (depth - 1) + [out_features]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        if targets is None:
            return x
        return x, F.mse_loss(x, targets)


# ---------------------------------------------------------------------------------------------------------------
# GPT-2 style
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    vocab_size: int = 4096
    block_size: int = 128
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                           dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class GPTMLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class GPTBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = GPTMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2 style decoder; ``forward(idx, targets=None)`` returns logits, or ``(logits, loss)``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(GPTBlock(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.size()
        if t > self.config.block_size:
            raise ValueError(f"GPT: sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


class Checkpointed(nn.Module):
    """A block whose activations are recomputed in the backward (``torch.utils.checkpoint``)."""

    def __init__(self, block: nn.Module, use_reentrant: bool = False):
        super().__init__()
        self.block = block
        self.use_reentrant = use_reentrant

    def forward(self, *args):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, *args, use_reentrant=self.use_reentrant)


def checkpoint_blocks(model: nn.Module, use_reentrant: bool = False) -> nn.Module:
    """``model`` (a ``GPT`` or a ``Llama``) with each transformer block wrapped in ``Checkpointed`` (in place;
    returned for chaining)."""
    if isinstance(model, GPT):
        model.transformer.h = nn.ModuleList(Checkpointed(b, use_reentrant) for b in model.transformer.h)
    elif isinstance(model, Llama):
        model.layers = nn.ModuleList(Checkpointed(b, use_reentrant) for b in model.layers)
    else:
        raise TypeError(f"checkpoint_blocks: {type(model).__name__} has no transformer blocks to checkpoint; "
                        "give a GPT or a Llama")
    return model


# ---------------------------------------------------------------------------------------------------------------
# LLaMA style
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int = 4
    n_head: int = 8
    n_kv_head: int = 2
    n_embd: int = 256
    intermediate_size: int = 688
    vocab_size: int = 4096
    block_size: int = 128
    rope_base: float = 10000.0
    norm_eps: float = 1e-5


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight``, computed in float32 as LLaMA's reference code does."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def rope_cache(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # (seq, head_dim)
    return emb.cos(), emb.sin()


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        if config.n_embd % config.n_head or config.n_head % config.n_kv_head:
            raise ValueError(f"Llama: n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head}) and "
                             f"n_head by n_kv_head ({config.n_kv_head})")
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.q_proj = nn.Linear(config.n_embd, config.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_head * self.head_dim, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        groups = self.n_head // self.n_kv_head
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attention = LlamaAttention(config)
        self.ffn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.feed_forward = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """A LLaMA style decoder; ``forward(idx, targets=None)`` returns logits, or ``(logits, loss)``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.output = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        cos, sin = rope_cache(config.block_size, config.n_embd // config.n_head, config.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        _, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"Llama: sequence length {t} exceeds block_size {self.config.block_size}")
        h = self.tok_embeddings(idx)
        cos = self.rope_cos[:t].to(h.dtype)
        sin = self.rope_sin[:t].to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


# ---------------------------------------------------------------------------------------------------------------
# Named configurations and the builder
# ---------------------------------------------------------------------------------------------------------------

CONFIGS: dict[str, GPTConfig | LlamaConfig | MLPConfig] = {
    "gpt-tiny": GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=128, block_size=16),
    "gpt-small": GPTConfig(n_layer=4, n_head=4, n_embd=256, vocab_size=4096, block_size=128),
    "llama-tiny": LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64, vocab_size=128,
                              block_size=16),
    "llama-small": LlamaConfig(n_layer=4, n_head=8, n_kv_head=2, n_embd=256, intermediate_size=688,
                               vocab_size=4096, block_size=128),
    "mlp-tiny": MLPConfig(in_features=16, hidden=32, out_features=8, depth=3),
    "mlp": MLPConfig(in_features=256, hidden=1024, out_features=256, depth=4),
    # The models users train (docs/performance.md, "LLM scale"). llama-1b is shaped as Llama 3.2 1B (16 layers,
    # width 2048, 32 query and 8 key/value heads, SwiGLU intermediate 8192 = 4 x width) with LLaMA 2's 32k
    # vocabulary and untied embeddings as in LLaMA 2 and TinyLlama: 1.10 B parameters. TinyLlama's intermediate
    # size 5632 would make it 0.85 B at 16 layers. gpt2-124m is GPT-2 small with its real 50,257-token vocabulary
    # (nanoGPT pads it to 50,304 for faster kernels) and tied embeddings.
    "llama-1b": LlamaConfig(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, intermediate_size=8192,
                            vocab_size=32000, block_size=2048),
    "gpt2-124m": GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024),
}


def size_overrides(name: str, n_layer: int | None = None, width: int | None = None,
                   seq_len: int | None = None) -> dict:
    """Config-field overrides that make the model ``name`` ``n_layer`` deep, ``width`` wide and ``seq_len`` long,
    with the same code: a CPU run of ``llama-1b`` at toy size runs the layers a GPU run does.

    A new width keeps the head size, so that attention runs the kernels of the full model, and the number of
    query heads per key/value head as far as the heads allow; LLaMA's SwiGLU keeps its ratio to the width.
    """
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; available models are {', '.join(CONFIGS)}")
    config = CONFIGS[name]
    if isinstance(config, MLPConfig):
        if (n_layer, width, seq_len) != (None, None, None):
            raise ValueError(f"{name} is an MLP: --n-layer, --width and --seq-len apply to the GPT and LLaMA models")
        return {}
    overrides: dict = {}
    if n_layer is not None:
        overrides["n_layer"] = n_layer
    if seq_len is not None:
        overrides["block_size"] = seq_len
    if width is not None:
        head_dim = config.n_embd // config.n_head
        if width % head_dim:
            raise ValueError(f"{name}: --width {width} must be a multiple of the head size {head_dim}")
        overrides["n_embd"], overrides["n_head"] = width, width // head_dim
        if isinstance(config, LlamaConfig):
            groups = config.n_head // config.n_kv_head
            overrides["n_kv_head"] = max(1, overrides["n_head"] // groups)
            while overrides["n_head"] % overrides["n_kv_head"]:
                overrides["n_kv_head"] -= 1
            overrides["intermediate_size"] = config.intermediate_size * width // config.n_embd
    for key, value in overrides.items():
        if value < 1:
            raise ValueError(f"{name}: {key} must be positive, got {value}")
    return overrides


InputsFn = Callable[..., tuple]


def build(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
          **overrides) -> tuple[nn.Module, InputsFn]:
    """The model called ``name`` (see ``CONFIGS``) with seeded random weights, and its input maker.

    ``overrides`` replace config fields (``build("gpt-small", n_layer=2)``). The input maker is
    ``make_inputs(batch_size, targets=False) -> tuple`` of positional arguments: token ids of the config's
    full sequence length (or a float batch for the MLP), plus targets when asked, drawn from a generator
    seeded by ``seed`` so that every call returns the same values.
    """
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; available models are {', '.join(CONFIGS)}")
    config = replace(CONFIGS[name], **overrides) if overrides else CONFIGS[name]
    device = torch.device(device)
    # On a GPU the weights are drawn there (the same ones on every call, other ones than on the CPU): drawing a
    # billion of them on the host would take longer than the measurement.
    on_gpu = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if on_gpu else []), device if on_gpu else contextlib.nullcontext():
        torch.manual_seed(seed)
        model = _make_model(config)
    model = model.to(device=device, dtype=dtype)

    def make_inputs(batch_size: int = 2, targets: bool = False) -> tuple:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        gen = torch.Generator().manual_seed(seed + 1)
        if isinstance(config, MLPConfig):
            x = torch.randn(batch_size, config.in_features, generator=gen).to(device=device, dtype=dtype)
            if not targets:
                return (x,)
            y = torch.randn(batch_size, config.out_features, generator=gen).to(device=device, dtype=dtype)
            return (x, y)
        shape = (batch_size, config.block_size)
        idx = torch.randint(0, config.vocab_size, shape, generator=gen).to(device)
        if not targets:
            return (idx,)
        return (idx, torch.randint(0, config.vocab_size, shape, generator=gen).to(device))

    return model, make_inputs


def _make_model(config: GPTConfig | LlamaConfig | MLPConfig) -> nn.Module:
    if isinstance(config, GPTConfig):
        return GPT(config)
    if isinstance(config, LlamaConfig):
        return Llama(config)
    return MLP(config.in_features, config.hidden, config.out_features, config.depth)


def meta_model(name: str, **overrides) -> nn.Module:
    """The model called ``name`` on the meta device: its shapes and parameter count without memory or init time."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; available models are {', '.join(CONFIGS)}")
    with torch.device("meta"):
        return _make_model(replace(CONFIGS[name], **overrides))


def build_any(name: str, device="cpu", dtype=torch.float32, seed: int = 0, **overrides):
    """``build`` for built-in names, ``fulmen.bench.hf.build_hf`` for ``hf:<model>`` names."""
    from fulmen.bench.hf import build_hf, is_hf_model

    if is_hf_model(name):
        return build_hf(name, device=device, dtype=dtype, seed=seed, **overrides)
    return build(name, device=device, dtype=dtype, seed=seed, **overrides)


def model_names() -> list[str]:
    from fulmen.bench.hf import hf_model_names

    return [*CONFIGS, *hf_model_names()]
