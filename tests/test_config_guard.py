"""A configuration object changed between calls of a jitted module recompiles, as eager reads the new values.

Library code (a Hugging Face ``forward``) reads ``self.config.pad_token_id``, ``self.config.use_cache`` or
``self.config._attn_implementation`` on every call; fulmen's global guard follows only the user's own code, so
the module's structure snapshot records the plain objects a module holds, by their members
(``fulmen/frontend/module_guard.py``). Tiny random-weight models, ``executors=["torch"]``; outputs are float32
and compared to eager within 1e-5 (the same torch kernels, summed in a possibly different order).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sysconfig

import pytest
import torch

import fulmen

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("quiet_transformers")


def _gpt2_config(**kwargs):
    return transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=32, bos_token_id=1, eos_token_id=2, **kwargs
    )


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def _reason(jitted) -> str:
    return fulmen.compile_stats(jitted).last_recompile_reason or ""


def test_pad_token_id_changed_recompiles(caplog):
    torch.manual_seed(0)
    model = transformers.GPT2ForSequenceClassification(_gpt2_config(num_labels=3, pad_token_id=49)).eval()
    jitted = fulmen.jit(model, executors=["torch"])
    ids = torch.tensor([[5, 6, 7, 3, 3, 3]])  # the classified position is the last one before the first pad
    _close(jitted(ids).logits, model(ids).logits)
    model.config.pad_token_id = 3
    with caplog.at_level(logging.INFO, logger="fulmen"):
        _close(jitted(ids).logits, model(ids).logits)
    assert fulmen.cache_misses(jitted) == 2
    assert "config.pad_token_id" in _reason(jitted)
    assert any("config.pad_token_id" in r.getMessage() for r in caplog.records)


def test_use_cache_and_output_attentions_changed():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_gpt2_config(attn_implementation="eager")).eval()
    jitted = fulmen.jit(model, executors=["torch"])
    ids = torch.randint(3, 50, (1, 6))
    out = jitted(ids)
    assert out.past_key_values is not None and out.attentions is None
    model.config.use_cache = False
    out, ref = jitted(ids), model(ids)
    assert ref.past_key_values is None and out.past_key_values is None
    _close(out.logits, ref.logits)
    model.config.output_attentions = True
    out, ref = jitted(ids), model(ids)
    assert len(out.attentions) == len(ref.attentions) == 1
    _close(out.attentions[0], ref.attentions[0])
    assert fulmen.cache_misses(jitted) == 3


def test_attn_implementation_switch_recompiles_and_switching_back_reuses():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_gpt2_config(attn_implementation="eager", use_cache=False)).eval()
    jitted = fulmen.jit(model, executors=["torch"])
    ids = torch.randint(3, 50, (2, 6))
    _close(jitted(ids).logits, model(ids).logits)
    assert "scaled_dot_product_attention" not in str(fulmen.last_traces(jitted)[0])
    model.set_attn_implementation("sdpa")
    _close(jitted(ids).logits, model(ids).logits)
    assert fulmen.cache_misses(jitted) == 2
    assert "scaled_dot_product_attention" in str(fulmen.last_traces(jitted)[0])
    model.set_attn_implementation("eager")
    _close(jitted(ids).logits, model(ids).logits)
    assert fulmen.cache_misses(jitted) == 2  # the program for "eager" is still cached


def test_unchanged_config_keeps_hitting_the_cache():
    torch.manual_seed(0)
    model = transformers.GPT2ForSequenceClassification(_gpt2_config(num_labels=3, pad_token_id=49)).eval()
    jitted = fulmen.jit(model, executors=["torch"])
    ids = torch.tensor([[5, 6, 7, 3]])
    for _ in range(20):  # past the tree check's switch to its C++ guard tree
        _close(jitted(ids).logits, model(ids).logits)
    model.config.use_cache = model.config.use_cache  # a write of the same value: looked at, not recompiled
    jitted(ids)
    assert (fulmen.cache_misses(jitted), fulmen.cache_hits(jitted)) == (1, 20)


# A module whose forward is library code (its file lies among the installed packages, as transformers' does):
# fulmen's global guard does not follow such code, so only the module's snapshot sees its config change.
_LIBRARY_SOURCE = """
import torch

class ConfiguredBlock(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = torch.nn.functional.dropout(self.proj(x), p=self.config.dropout, training=self.training)
        return y * self.config.sub.scale
"""


def _library_block_class():
    namespace: dict = {}
    filename = os.path.join(sysconfig.get_paths()["purelib"], "fulmen_test_config_block.py")
    exec(compile(_LIBRARY_SOURCE, filename, "exec"), namespace)
    return namespace["ConfiguredBlock"]


@dataclasses.dataclass
class _Sub:
    scale: float = 2.0


@dataclasses.dataclass
class _Config:
    dropout: float = 0.0
    sub: _Sub = dataclasses.field(default_factory=_Sub)


def test_library_forward_reading_config_dropout_and_a_sub_config():
    torch.manual_seed(0)
    config = _Config()
    model = _library_block_class()(config).train()
    jitted = fulmen.jit(model, executors=["torch"])
    x = torch.randn(3, 4)
    _close(jitted(x), model(x))  # p=0: dropout is the identity, so eager and fulmen agree exactly
    config.sub.scale = 3.0
    _close(jitted(x), model(x))
    assert "config.sub.scale" in _reason(jitted)
    config.dropout = 1.0  # p=1 zeroes everything: deterministic, and different from the old program
    assert torch.equal(jitted(x), torch.zeros(3, 4))
    assert "config.dropout" in _reason(jitted)
    config.dropout = 0.0
    config.sub.scale = 2.0  # back to the first values: the program compiled for them is reused
    _close(jitted(x), model(x))
    assert fulmen.cache_misses(jitted) == 3
