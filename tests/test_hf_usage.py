"""Hugging Face models used as users use them beyond a default forward: gradient checkpointing, attention
implementations, padding, generate options, resized or retyped weights, frozen parts, task heads. Each case is
compared with eager PyTorch over several calls (outputs, losses, gradients, tokens; random numbers under the same
seed, which the torch executor draws as eager does).

The small cases rebuild what the models do in a few lines (fast enough for the default run); the whole models run
under ``@pytest.mark.slow``. Tolerances: float32 through the torch executor runs eager's kernels, possibly in
another order, so values agree to 1e-5 relative (of the largest magnitude, for gradients summed over a batch).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fulmen


def _close(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()), msg=msg)


def _grads_close(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        assert (q.grad is None) == (p.grad is None), name
        if p.grad is not None:
            _close(q.grad, p.grad, msg=name)


# ---------------------------------------------------------------------------------------------------------
# gradient checkpointing through the Dynamo backend (what model.gradient_checkpointing_enable() does)


class _CheckpointedDropout(nn.Module):
    """A layer checkpointed as transformers' gradient checkpointing does it, with dropout inside."""

    def __init__(self, preserve_rng_state: bool = True):
        super().__init__()
        self.linear, self.dropout, self.preserve_rng_state = nn.Linear(8, 8), nn.Dropout(0.5), preserve_rng_state

    def block(self, x):
        return self.dropout(self.linear(x)).sin()

    def forward(self, x):
        y = checkpoint(self.block, x, use_reentrant=False, preserve_rng_state=self.preserve_rng_state)
        return y.square().sum()


def test_backend_checkpointed_dropout_recomputes_the_forwards_mask():
    # Dynamo hands the region over as tag_activation_checkpoint, whose PyTorch implementation passes
    # preserve_rng_state=False whatever the user asked: fulmen used to refuse every such region with dropout.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _CheckpointedDropout().train()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="fulmen", options={"executors": ["torch"]})
    x = torch.randn(4, 8)
    for seed in range(2):
        model.zero_grad(), reference.zero_grad()
        torch.manual_seed(seed)
        want = reference(x)
        want.backward()
        torch.manual_seed(seed)
        got = compiled(x)
        got.backward()
        _close(got, want)
        _grads_close(model, reference)


def test_backend_checkpoint_without_preserved_rng_state_around_dropout_is_refused():
    # eager draws a new mask when it recomputes; fulmen's backward would use the forward's (refused before the
    # change above too, as every checkpointed region with dropout was: this guards that the user's False still is)
    torch._dynamo.reset()
    compiled = torch.compile(
        _CheckpointedDropout(preserve_rng_state=False).train(), backend="fulmen", options={"executors": ["torch"]}
    )
    with pytest.raises(NotImplementedError, match="preserve_rng_state=True"):
        compiled(torch.randn(4, 8))


# ---------------------------------------------------------------------------------------------------------
# whole Hugging Face models (slow)


def _gpt2(**overrides):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=128,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **overrides,
    )
    return transformers.GPT2LMHeadModel(config)


def _ids(batch: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(1))


def _train_steps(model: nn.Module, call, steps: int = 2, **inputs) -> None:
    """``steps`` training calls of the model and of ``call`` (compiled from a copy made before the first), each
    under the same seed: losses, logits and every parameter's gradient must be eager's."""
    reference = copy.deepcopy(model)
    compiled = call(model)
    for step in range(steps):
        reference.zero_grad(set_to_none=True), model.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        want = reference(**inputs)
        want.loss.backward()
        torch.manual_seed(step)
        got = compiled(**inputs)
        got.loss.backward()
        _close(got.loss, want.loss)
        _close(got.logits, want.logits)
        _grads_close(model, reference)


@pytest.mark.slow
@pytest.mark.usefixtures("quiet_transformers")
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gpt2_gradient_checkpointing_with_dropout_through_the_backend(use_reentrant):
    torch._dynamo.reset()
    model = _gpt2()  # dropout 0.1 in attention, residuals and embeddings
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    ids = _ids()
    _train_steps(
        model.train(),
        lambda m: torch.compile(m, backend="fulmen", options={"executors": ["torch"]}),
        input_ids=ids,
        labels=ids,
    )


# ---------------------------------------------------------------------------------------------------------
# a module attribute assigned the tensor it already holds (Hugging Face's longrope rotary embedding)


class _MovesItsTable(nn.Module):
    """``self.table = self.table.to(x.device)``: ``to`` returns its input, so eager leaves the attribute as it was."""

    def __init__(self):
        super().__init__()
        self.table = torch.linspace(0.5, 2.0, 4)

    def forward(self, x):
        table = self.table.to(x.device)
        self.table = table
        return x * table


def test_an_attribute_assigned_the_tensor_it_holds_is_not_state_carried_between_calls():
    model = _MovesItsTable()
    table = model.table
    jitted = fulmen.jit(model, executors=["torch"])
    for rows in (2, 3, 5):  # the second size recompiles with a symbolic size: traced again
        x = torch.randn(rows, 4)
        _close(jitted(x), x * table)
        assert model.table is table


def test_an_attribute_replaced_by_a_new_tensor_it_was_computed_from_is_still_refused():
    # a guard (refused before the change too): only an attribute given back the very tensor it held is let through
    class Doubles(_MovesItsTable):
        def forward(self, x):
            self.table = self.table * 2  # state carried between calls: eager doubles it on every call
            return x * self.table

    with pytest.raises(NotImplementedError, match="register_buffer"):
        fulmen.jit(Doubles(), executors=["torch"])(torch.randn(2, 4))


@pytest.mark.slow
@pytest.mark.usefixtures("quiet_transformers")
def test_phi3_longrope_lengths_across_the_original_context_match_eager():
    # longrope picks its long or short frequencies by the sequence length and reassigns its long table each call
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Phi3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        original_max_position_embeddings=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0, 3.0, 4.0, 5.0]},
    )
    model = transformers.Phi3ForCausalLM(config)
    reference = copy.deepcopy(model)
    jitted = fulmen.jit(model, executors=["torch"])
    ids = _ids(seq=20)
    for length in (6, 12, 20, 6):
        x = ids[:, :length]
        reference.zero_grad(set_to_none=True), model.zero_grad(set_to_none=True)
        want, got = reference(input_ids=x, labels=x), jitted(input_ids=x, labels=x)
        want.loss.backward(), got.loss.backward()
        _close(got.logits, want.logits)
        _grads_close(model, reference)
