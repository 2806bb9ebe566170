"""Hugging Face decoders with their KV caches through ``fulmen.jit``: a forward on a default config (which returns a
``DynamicCache``), ``fulmen.jit(model).generate(...)`` and ``model.forward = fulmen.jit(model.forward)``. Tokens must
be eager's exactly (greedy, and sampling under the same seed), and the compilations bounded: the prompt, then one
program with a symbolic cache length for every decode step (its first compilation sees the program rebind the
cache to a longer tensor: fulmen.frontend.jit's _carried_dims).

Tiny random configs, float32, the torch executor. Gradients: the same tolerances as tests/test_hf_models.py
(1e-5 relative, 1e-5 of the largest magnitude absolute), as the same kernels run in possibly another order.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402

import fulmen  # noqa: E402
from fulmen.frontend import module_guard  # noqa: E402

NEW_TOKENS = 8
# the prompt; one program, with the cache length symbolic, for every decode step
COMPILATIONS = 2


pytestmark = pytest.mark.usefixtures("quiet_transformers")


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(config)


def _t5():
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


def _bart():
    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64)
    return transformers.BartForConditionalGeneration(config)


def _mistral(**window):
    # Mistral's default config (sliding_window=4096) makes a DynamicCache of DynamicSlidingWindowLayers, whose
    # cumulative_length is a Python int the cache adds each step's length to: symbolic from the first decode step
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        **window)
    return transformers.MistralForCausalLM(config)


def _gemma2():
    # sliding-window layers (DynamicSlidingWindowLayer) alternate with full-attention ones (DynamicLayer)
    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       max_position_embeddings=64)
    return transformers.Gemma2ForCausalLM(config)


def _prompt(batch: int = 1, seq: int = 6) -> torch.Tensor:
    return torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(1))


def _generate(model, jitted, **options):
    """Eager's tokens and the jitted model's, each under the same seed (min_new_tokens: no early stop at EOS)."""
    options = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, **options}
    ids = _prompt()
    with torch.no_grad():
        torch.manual_seed(2)
        want = model.generate(ids, **options)
        torch.manual_seed(2)
        got = jitted.generate(ids, **options)
    return want, got


def _check_generate(make, compilations: int = COMPILATIONS, **options):
    model = make().eval()
    jitted = fulmen.jit(model, executors=["torch"])
    want, got = _generate(model, jitted, **options)
    assert torch.equal(got, want), (got, want)
    stats = fulmen.compile_stats(jitted)
    assert stats.calls == NEW_TOKENS  # every forward of generate() ran through the wrapper's program
    assert stats.cache_misses == compilations, stats.recompile_reasons
    assert "marked dynamic (state carried between calls)" in stats.recompile_reasons[0]


def test_a_default_config_forward_returns_its_dynamic_cache_and_gradients_match():
    model = _llama()
    reference = copy.deepcopy(model)
    jitted = fulmen.jit(model, executors=["torch"])
    ids = _prompt(batch=2)
    want = reference(input_ids=ids, labels=ids)
    got = jitted(input_ids=ids, labels=ids)
    want.loss.backward()
    got.loss.backward()
    assert list(got.keys()) == list(want.keys())
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5 * want.logits.abs().max().item())
    assert type(got.past_key_values) is transformers.DynamicCache
    assert len(got.past_key_values.layers) == len(want.past_key_values.layers)
    for g, w in zip(got.past_key_values.layers, want.past_key_values.layers):
        assert type(g) is type(w) and list(vars(g)) == list(vars(w)) and g.is_initialized
        for name in ("keys", "values"):
            torch.testing.assert_close(getattr(g, name), getattr(w, name), rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5 * p.grad.abs().max().item(), msg=name)


def test_generate_greedy_with_a_dynamic_cache_compiles_the_prompt_and_one_decode_program():
    _check_generate(_llama, do_sample=False)


def test_generate_through_a_jitted_forward_assigned_to_the_model():
    model = _llama().eval()
    patched = copy.deepcopy(model)
    patched.forward = fulmen.jit(patched.forward, executors=["torch"])
    want, got = _generate(model, patched, do_sample=False)
    assert torch.equal(got, want), (got, want)
    assert fulmen.cache_misses(patched.forward) == COMPILATIONS
    assert fulmen.compile_stats(patched.forward).calls == NEW_TOKENS


def test_generate_with_a_static_cache_writes_it_in_place_with_two_programs():
    model = _llama().eval()
    jitted = fulmen.jit(model, executors=["torch"])
    want, got = _generate(model, jitted, do_sample=False, cache_implementation="static")
    assert torch.equal(got, want), (got, want)
    assert fulmen.cache_misses(jitted) == 2  # the cache's tensors keep their sizes: the prompt, then one decode


@pytest.mark.slow
@pytest.mark.parametrize("make", [_mistral, _gemma2], ids=["mistral", "gemma2"])
def test_generate_with_a_sliding_window_cache_compiles_the_prompt_and_one_decode_program(make):
    _check_generate(make, do_sample=False)


@pytest.mark.slow
def test_generate_past_a_sliding_window_matches_eager_and_recompiles_where_the_window_fills():
    # a window of 8 fills at the third decode step (prompt of 6): the guard on cumulative_length >= sliding_window
    # fails there and the branch taken changes, so the program is compiled again; the tokens stay eager's
    model = _mistral(sliding_window=8).eval()
    jitted = fulmen.jit(model, executors=["torch"])
    want, got = _generate(model, jitted, do_sample=False)
    assert torch.equal(got, want), (got, want)
    reasons = fulmen.compile_stats(jitted).recompile_reasons
    assert any("guards" in r for r in reasons), reasons
    assert fulmen.cache_misses(jitted) <= 4, reasons


@pytest.mark.slow
def test_generate_sampling_gpt2_draws_eagers_tokens():
    _check_generate(_gpt2, do_sample=True, top_k=0)


@pytest.mark.slow
@pytest.mark.parametrize("make", [_t5, _bart], ids=["t5", "bart"])
def test_generate_encoder_decoder_with_an_encoder_decoder_cache(make):
    # the decoder's prompt is its start token: the first decode step has a cache of length 1, which is never made
    # symbolic (sizes 0 and 1 specialize, as in torch), so it has its own program
    _check_generate(make, COMPILATIONS + 1, do_sample=False)


def test_a_cache_passed_back_in_is_updated_in_place_and_gradients_flow_through_both_calls():
    model = _llama()
    reference = copy.deepcopy(model)
    jitted = fulmen.jit(model, executors=["torch"])
    first, second = _prompt(batch=2), _prompt(batch=2, seq=3)
    want_1 = reference(input_ids=first)
    want_2 = reference(input_ids=second, past_key_values=want_1.past_key_values, labels=second)
    got_1 = jitted(input_ids=first)
    got_2 = jitted(input_ids=second, past_key_values=got_1.past_key_values, labels=second)
    assert got_2.past_key_values is got_1.past_key_values  # as eager: the cache passed in, appended to
    for g, w in zip(got_2.past_key_values.layers, want_2.past_key_values.layers):
        assert g.keys.shape[-2] == 9
        torch.testing.assert_close(g.keys, w.keys, rtol=1e-5, atol=1e-5)
    (want_1.logits.sum() * 1e-3 + want_2.loss).backward()
    (got_1.logits.sum() * 1e-3 + got_2.loss).backward()
    torch.testing.assert_close(got_2.loss, want_2.loss, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5 * p.grad.abs().max().item(), msg=name)


def _negated_logits(model):
    """A forward set on the instance, as users patch models: the class's, with the logits negated (so that greedy
    decoding picks other tokens)."""
    forward = type(model).forward.__get__(model)

    @functools.wraps(forward)  # generate() reads the signature
    def negated(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = -out.logits
        return out

    return negated


def test_generate_walks_the_module_tree_only_on_its_first_call(monkeypatch):
    """Routing the model's forward to the program for generate() is a write the module guard owns: later generate()
    calls find the tree unchanged and take no new snapshot."""
    model = _llama().eval()
    jitted = fulmen.jit(model, executors=["torch"])
    walks = []
    watch = module_guard.watch
    monkeypatch.setattr(module_guard, "watch", lambda *a: walks.append(1) or watch(*a))
    for i in range(3):
        want, got = _generate(model, jitted, do_sample=False)
        assert torch.equal(got, want), (got, want)
        if i == 0:
            assert walks, "the first generate() sees the tree"
            walks.clear()
    assert walks == [], "later generate() calls walked the module tree"
    assert "forward" not in vars(model)
    assert fulmen.cache_misses(jitted) == COMPILATIONS


@pytest.mark.parametrize("when", ["before the first generate", "between generates"])
def test_a_forward_set_on_the_model_is_what_jitted_generate_runs(when):
    """Eager generate() calls the instance's own forward where there is one; so does the routed program, wherever
    the write happens, and after ``del model.forward`` the class's again."""
    model = _llama().eval()
    reference = copy.deepcopy(model)
    jitted = fulmen.jit(model, executors=["torch"])
    plain = None
    if when == "between generates":
        plain, got = _generate(reference, jitted, do_sample=False)
        assert torch.equal(got, plain)
    model.forward, reference.forward = _negated_logits(model), _negated_logits(reference)
    want, got = _generate(reference, jitted, do_sample=False)
    assert torch.equal(got, want), (got, want)
    del model.forward, reference.forward
    again, got = _generate(reference, jitted, do_sample=False)
    assert torch.equal(got, again), (got, again)
    assert not torch.equal(want, again), "the user's forward should change the tokens (else this test cannot fail)"
