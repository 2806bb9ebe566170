"""Hugging Face ``transformers`` models for ``fulmen bench --model hf:<name>`` and tests: tiny configs, random weights.

Nothing is downloaded: every model is built from a small config with seeded random weights. Dropout is off
(so that compiled and eager runs can be compared number for number) and the key/value cache is off (training
does not use it). ``transformers`` is imported only when a model is built::

    model, make_inputs = build_hf("hf:llama")
    logits = model(*make_inputs(2))                     # (2, seq_len, vocab)
    logits, loss = model(*make_inputs(2, targets=True))

``build_hf`` has the contract of ``fulmen.bench.models.build``. ``hf_model`` returns the bare Hugging Face
model (its ``forward`` takes ``input_ids=`` and ``labels=`` and returns a ``ModelOutput``) for code that wants
to call it the way users do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["HF_MODELS", "HFAdapter", "build_hf", "hf_config", "hf_model", "hf_model_names", "is_hf_model"]

PREFIX = "hf:"
VOCAB = 256
SEQ_LEN = 32

# name -> (config class name, model class name, config fields). Sizes are tiny on purpose: the tests compare
# every gradient and the bench measures the framework's per-op overhead as much as the arithmetic.
HF_MODELS: dict[str, tuple[str, str, dict]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
                   eos_token_id=0, pad_token_id=0)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, sliding_window=16,
                     bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
                   eos_token_id=0, pad_token_id=0)),
    "bert": ("BertConfig", "BertForMaskedLM",
             dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, pad_token_id=0)),
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
                       max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
                     max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)),
}


def hf_model_names(prefixed: bool = True) -> list[str]:
    return [PREFIX + n if prefixed else n for n in HF_MODELS]


def is_hf_model(name: str) -> bool:
    return name.startswith(PREFIX)


def _short_name(name: str) -> str:
    short = name[len(PREFIX):] if name.startswith(PREFIX) else name
    if short not in HF_MODELS:
        raise ValueError(f"unknown Hugging Face model {name!r}; available models are {', '.join(hf_model_names())}")
    return short


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("hf: models need the `transformers` package: pip install 'fulmen[test]' "
                          "(or pip install transformers)") from e
    return transformers


def hf_config(name: str, attn_implementation: str = "sdpa", **overrides):
    """The tiny config of model ``name`` (``"gpt2"`` or ``"hf:gpt2"``); ``overrides`` replace its fields.

    ``experts_implementation=`` (MoE models: "eager", "grouped_mm", "batched_mm") is passed through.
    """
    transformers = _transformers()
    config_cls, _, fields = HF_MODELS[_short_name(name)]
    config = getattr(transformers, config_cls)(**{**fields, **overrides})
    config.use_cache = False
    config._attn_implementation = attn_implementation
    return config


def hf_model(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
             attn_implementation: str = "sdpa", **overrides) -> nn.Module:
    """The bare Hugging Face model ``name`` with weights drawn from ``seed`` (the global RNG is left alone)."""
    transformers = _transformers()
    _, model_cls, _ = HF_MODELS[_short_name(name)]
    config = hf_config(name, attn_implementation, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_cls)(config)
    return model.to(device=device, dtype=dtype)


class HFAdapter(nn.Module):
    """Gives a Hugging Face model the bench contract: ``(ids) -> logits`` and ``(ids, labels) -> (logits, loss)``.

    Encoder-decoder models (T5) get the token ids as the decoder's input too when no labels are given (with
    labels they build the decoder input by shifting the labels right, as in training).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        kwargs = {}
        if self.encoder_decoder and labels is None:
            kwargs["decoder_input_ids"] = input_ids
        out = self.model(input_ids=input_ids, labels=labels, **kwargs)
        return out.logits if labels is None else (out.logits, out.loss)


def build_hf(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
             attn_implementation: str = "sdpa", seq_len: int = SEQ_LEN,
             **overrides) -> tuple[nn.Module, Callable[..., tuple]]:
    """Model ``hf:<name>`` wrapped for the bench, and ``make_inputs(batch_size, targets=False) -> tuple``.

    The inputs are token ids (and labels when ``targets``) of length ``seq_len``, drawn from a generator seeded
    by ``seed`` so that every call returns the same values.
    """
    model = HFAdapter(hf_model(name, device, dtype, seed, attn_implementation, **overrides))
    vocab = model.model.config.vocab_size
    device = torch.device(device)

    def make_inputs(batch_size: int = 2, targets: bool = False) -> tuple:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        gen = torch.Generator().manual_seed(seed + 1)
        # ids start at 2 so that no token is the pad id (BERT/T5 treat pad specially in masks and labels)
        ids = torch.randint(2, vocab, (batch_size, seq_len), generator=gen).to(device)
        if not targets:
            return (ids,)
        return (ids, torch.randint(2, vocab, (batch_size, seq_len), generator=gen).to(device))

    return model, make_inputs
