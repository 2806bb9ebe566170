"""Hugging Face models (tiny configs, random weights, no downloads) through ``fulmen.jit`` and the
``torch.compile`` backend: logits, loss, every parameter's gradient and three AdamW steps match eager.

Pinned to transformers 5.23.0 (the ``test`` extra); skipped when transformers is not installed.

Tolerances: everything is float32. fulmen runs the same torch kernels as eager for these models (the default
executor list is the torch executor), but a decomposed op (e.g. a softmax or layer_norm written as prims, a
matmul whose operands were transposed differently) may sum in another order, which moves results by a few ulps
of the largest value involved. So the absolute tolerance is 1e-5 *scaled by the largest magnitude of the
reference tensor* (so a gradient of size 1e-3 gets 1e-8) with a relative tolerance of 1e-5. The optimizer steps
compare losses to 1e-5 relative: AdamW divides by sqrt(v), which can turn a 1e-9 difference in a tiny gradient
into a full learning-rate step on that weight, so parameters after the steps are not compared element-wise; the
loss, which depends on all of them, is.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import fulmen  # noqa: E402
from fulmen.bench.hf import build_hf, hf_model  # noqa: E402

MODELS = ["gpt2", "llama", "mistral", "qwen2", "bert", "t5", "mixtral", "qwen2_moe"]
BATCH, SEQ = 2, 16


pytestmark = pytest.mark.usefixtures("quiet_transformers")


def _inputs(vocab: int, *, mask: bool = False, seq: int = SEQ) -> dict:
    gen = torch.Generator().manual_seed(1)
    kwargs = {"input_ids": torch.randint(2, vocab, (BATCH, seq), generator=gen),
              "labels": torch.randint(2, vocab, (BATCH, seq), generator=gen)}
    if mask:
        kwargs["attention_mask"] = torch.ones(BATCH, seq, dtype=torch.long)
    return kwargs


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = max(1.0, expected.detach().abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


def _compile(model, path: str):
    if path == "jit":
        return fulmen.jit(model)
    torch._dynamo.reset()
    return torch.compile(model, backend="fulmen")


def _check_training_matches_eager(name: str, path: str, *, mask: bool = False, attn: str = "sdpa") -> None:
    ref = hf_model(name, attn_implementation=attn).train()
    model = hf_model(name, attn_implementation=attn).train()  # same seed: identical weights
    compiled = _compile(model, path)
    kwargs = _inputs(ref.config.vocab_size, mask=mask)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params = dict(model.named_parameters())
    assert params, name
    for step in range(3):
        expected, actual = ref(**kwargs), compiled(**kwargs)
        assert type(actual) is type(expected)
        if step == 0:
            _close(actual.logits, expected.logits, f"{name} logits")
        _close(actual.loss, expected.loss, f"{name} loss at step {step}")
        expected.loss.backward()
        actual.loss.backward()
        if step == 0:
            for pname, p_ref in ref.named_parameters():
                p = params[pname]
                if p_ref.grad is None:
                    assert p.grad is None, f"{name}: {pname} got a gradient eager does not compute"
                    continue
                assert p.grad is not None, f"{name}: {pname} has no gradient"
                _close(p.grad, p_ref.grad, f"{name} grad of {pname}")
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
    if path == "jit":
        assert fulmen.cache_misses(compiled) == 1  # the three steps reuse one compilation


# Dynamo's own capture of a Hugging Face model is most of a backend test (8-20 s on a 2-core CPU, the same with
# backend="eager"); fulmen's part is under a second. The whole file takes about 2 minutes with -n 2.
@pytest.mark.parametrize("name", MODELS)
def test_backend_matches_eager(name):
    _check_training_matches_eager(name, "backend")


@pytest.mark.parametrize("name", MODELS)
def test_jit_matches_eager(name):
    _check_training_matches_eager(name, "jit")


@pytest.mark.parametrize("name", ["llama", "qwen2_moe"])
def test_jit_with_attention_mask_matches_eager(name):
    # With a 2-D mask transformers builds the 4-D mask from it instead of from position ids.
    _check_training_matches_eager(name, "jit", mask=True)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_eager_attention_matches_eager(name):
    _check_training_matches_eager(name, "jit", attn="eager")


def test_new_sequence_length_recompiles_and_stays_correct():
    model = hf_model("gpt2").eval()
    jitted = fulmen.jit(model)
    with torch.no_grad():
        for seq in (16, 24, 16):
            kwargs = _inputs(model.config.vocab_size, seq=seq)
            _close(jitted(**kwargs).logits, model(**kwargs).logits, f"gpt2 logits at sequence length {seq}")
    assert fulmen.cache_misses(jitted) == 2 and fulmen.cache_hits(jitted) == 1
    assert "16" in fulmen.compile_stats(jitted).last_recompile_reason


def test_bench_builder_contract():
    model, make_inputs = build_hf("hf:llama", seq_len=8)
    ids, labels = make_inputs(2, targets=True)
    assert ids.shape == labels.shape == (2, 8)
    assert torch.equal(make_inputs(2)[0], ids)  # seeded: every call returns the same inputs
    logits, loss = fulmen.jit(model)(ids, labels)
    expected_logits, expected_loss = model(ids, labels)
    _close(logits, expected_logits, "bench adapter logits")
    _close(loss, expected_loss, "bench adapter loss")
    with pytest.raises(ValueError, match="unknown Hugging Face model 'hf:nope'"):
        build_hf("hf:nope")
