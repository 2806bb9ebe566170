"""Hugging Face model families with their shipped defaults, shrunk only in size, for the family matrix.

Unlike ``fulmen.bench.hf`` (which turns the key/value cache off and pins the attention implementation so the
bench measures training), every family here keeps what its config class ships: ``use_cache``, the default
attention implementation, biases, activations, tied embeddings, rotary settings. Only sizes change: 2 layers,
hidden 32-64, 2-4 heads, vocabulary 256, images 32x32, a few mel bins. Weights are random (seeded); nothing is
downloaded. Dropout is turned off by ``model.eval()`` (the models are compared number for number with eager)::

    family = FAMILIES["llama"]
    model = family.build()                   # eval mode, seeded weights
    kwargs = family.inputs(model.config)     # input_ids / pixel_values / input_features and labels
    out = model(**kwargs)                    # a ModelOutput with .loss
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["BATCH", "FAMILIES", "SEQ", "Family"]

BATCH, SEQ, VOCAB, IMAGE = 2, 16, 256, 32

# The decoder sizes most families share: 2 layers, hidden 64, 4 query heads over 2 key/value heads.
_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
# Token ids of the tiny vocabulary: the defaults (e.g. Phi-3's pad id 32000) lie outside it.
_IDS = dict(pad_token_id=0, bos_token_id=0, eos_token_id=1)


def _tokens(config, gen: torch.Generator, vocab: int | None = None) -> dict:
    vocab = vocab or config.vocab_size
    # ids start at 2, so that no token is a pad id (masks and label handling treat pad specially)
    return {"input_ids": torch.randint(2, vocab, (BATCH, SEQ), generator=gen),
            "labels": torch.randint(2, vocab, (BATCH, SEQ), generator=gen)}


def _image(config, gen: torch.Generator) -> dict:
    return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen),
            "labels": torch.randint(0, config.num_labels, (BATCH,), generator=gen)}


def _audio(config, gen: torch.Generator) -> dict:
    frames = 2 * config.max_source_positions  # Whisper's encoder insists on exactly this many frames
    return {"input_features": torch.randn(BATCH, config.num_mel_bins, frames, generator=gen),
            "labels": torch.randint(2, config.vocab_size, (BATCH, SEQ), generator=gen)}


def _text_and_image(config, gen: torch.Generator) -> dict:
    ids = torch.randint(3, config.text_config.vocab_size, (BATCH, SEQ), generator=gen)
    ids[:, -1] = config.text_config.eos_token_id  # CLIP pools the text at its end-of-sequence token
    return {"input_ids": ids, "pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen),
            "return_loss": True}


@dataclass(frozen=True)
class Family:
    """One model family: its config and model classes, the size fields that shrink it, and its inputs."""

    name: str
    config_cls: str
    model_cls: str
    sizes: dict = field(default_factory=dict)
    make_inputs: Callable = _tokens

    def config(self, **overrides):
        """The shipped config with the sizes shrunk; ``overrides`` (e.g. ``use_cache=False``) replace fields."""
        import transformers

        return getattr(transformers, self.config_cls)(**{**self.sizes, **overrides})

    def build(self, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
        """The model in eval mode with weights drawn from ``seed`` (the global RNG is left alone)."""
        import transformers

        config = self.config(**overrides)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = getattr(transformers, self.model_cls)(config)
        return model.to(dtype=dtype).eval()

    def inputs(self, config, seed: int = 1) -> dict:
        """Keyword arguments for ``model(**kwargs)``, the same on every call for the same seed."""
        return self.make_inputs(config, torch.Generator().manual_seed(seed))


def _families(*families: Family) -> dict[str, Family]:
    return {f.name: f for f in families}


FAMILIES: dict[str, Family] = _families(
    Family("gpt2", "GPT2Config", "GPT2LMHeadModel",
           dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=1)),
    Family("llama", "LlamaConfig", "LlamaForCausalLM", {**_DECODER, **_IDS}),
    Family("mistral", "MistralConfig", "MistralForCausalLM", {**_DECODER, **_IDS}),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", {**_DECODER, **_IDS}),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {**_DECODER, **_IDS, "head_dim": 16}),
    Family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
           {**_DECODER, **_IDS, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32}),
    # MLA gives keys as many heads as queries (the shipped config says so: 128 and 128); fewer key/value heads
    # make transformers repeat the keys when it builds a mask (as it does under a compiler) and the shapes clash.
    Family("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
           {**_DECODER, **_IDS, "num_key_value_heads": 4, "moe_intermediate_size": 32, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
            "kv_lora_rank": 16, "q_lora_rank": 32,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}),
    Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM", {**_DECODER, **_IDS, "head_dim": 16}),
    Family("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", {**_DECODER, **_IDS, "head_dim": 16}),
    Family("phi3", "Phi3Config", "Phi3ForCausalLM", {**_DECODER, **_IDS}),
    Family("falcon", "FalconConfig", "FalconForCausalLM",
           dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB, **_IDS)),
    Family("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM",
           dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=VOCAB, max_position_embeddings=64, **_IDS)),
    Family("opt", "OPTConfig", "OPTForCausalLM",
           dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                max_position_embeddings=64, word_embed_proj_dim=64, pad_token_id=1, bos_token_id=0,
                eos_token_id=1)),
    Family("bloom", "BloomConfig", "BloomForCausalLM",
           dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB, **_IDS)),
    Family("bert", "BertConfig", "BertForMaskedLM",
           dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)),
    Family("roberta", "RobertaConfig", "RobertaForMaskedLM",
           dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=VOCAB, max_position_embeddings=66, pad_token_id=1, bos_token_id=0, eos_token_id=1)),
    Family("deberta_v2", "DebertaV2Config", "DebertaV2ForMaskedLM",
           dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)),
    Family("t5", "T5Config", "T5ForConditionalGeneration",
           dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=VOCAB,
                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
    Family("bart", "BartConfig", "BartForConditionalGeneration",
           dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=VOCAB,
                max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                decoder_start_token_id=2, forced_eos_token_id=2)),
    Family("whisper", "WhisperConfig", "WhisperForConditionalGeneration",
           dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=VOCAB,
                num_mel_bins=16, max_source_positions=16, max_target_positions=32, pad_token_id=1,
                bos_token_id=0, eos_token_id=1, decoder_start_token_id=0, suppress_tokens=[],
                begin_suppress_tokens=[]), _audio),
    Family("vit", "ViTConfig", "ViTForImageClassification",
           dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                image_size=IMAGE, patch_size=8), _image),
    Family("clip", "CLIPConfig", "CLIPModel",
           dict(text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=32, pad_token_id=1,
                                 bos_token_id=0, eos_token_id=2),
                vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, image_size=IMAGE, patch_size=8),
                projection_dim=32), _text_and_image),
    Family("convnext", "ConvNextConfig", "ConvNextForImageClassification",
           dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=IMAGE, patch_size=4), _image),
    Family("mamba", "MambaConfig", "MambaForCausalLM",
           dict(hidden_size=64, state_size=8, num_hidden_layers=2, vocab_size=VOCAB, **_IDS)),
)
