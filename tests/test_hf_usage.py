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

import fulmen  # noqa: F401  (registers the "fulmen" backend)


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
    # eager draws a new mask when it recomputes; fulmen's backward would use the forward's
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
