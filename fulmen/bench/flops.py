"""Model FLOPs of a training step and model FLOPs utilization (MFU), as the PaLM paper and nanoGPT count them.

A training step of a decoder over ``T``-token sequences costs, per token,

    6 * N + 12 * L * H * Q * T

FLOPs: ``6 N`` for the forward (2 N) and backward (4 N) multiply-adds of every weight matrix that multiplies
activations, and ``12 L H Q T`` for attention's two matrix products (scores and weighted values) in ``L`` layers
of ``H`` query heads of size ``Q``, forward and backward. ``N`` counts each parameter once: a tied embedding
counts as the output projection it also is, and an embedding that is only looked up (LLaMA's untied input
embedding, GPT-2's position embedding) is left out, since a lookup does no arithmetic. Causal masking is not
discounted (the convention of both sources), and recomputation (activation checkpointing) is not counted: these
are *model* FLOPs, the same for every backend, so MFU ranks backends as their step times do. A forward alone
(inference) costs a third: ``2 N + 4 L H Q T`` per token.

MFU = model FLOPs per step / (step time x the device's peak), against the dense bfloat16 peak of the card
(``PEAK_BF16_DENSE_FLOPS``) whatever precision the step ran in; no peak, no MFU (CPUs, unknown cards).
"""

from __future__ import annotations

import torch
from torch import nn

#: Dense (not 2:4 sparse) bfloat16 tensor-core peak in FLOP/s, from NVIDIA's data sheets, matched against
#: ``torch.cuda.get_device_name()`` in this order (so that "H100 PCIe" is not taken for the SXM part).
PEAK_BF16_DENSE_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0e12),
    ("H100 NVL", 835.0e12),
    ("H100", 989.4e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200", 989.4e12),  # the H100's compute with more and faster memory
    ("A100", 312.0e12),
)


def peak_flops(device_name: str | None) -> float | None:
    """The dense bfloat16 peak of the card named ``device_name`` (FLOP/s), or None when unknown (a CPU)."""
    if not device_name:
        return None
    lowered = device_name.lower()
    return next((peak for key, peak in PEAK_BF16_DENSE_FLOPS if key.lower() in lowered), None)


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def matmul_parameters(model: nn.Module) -> int:
    """Parameters that multiply activations: all of them, each once, less embeddings that are only looked up."""
    multiplied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    looked_up = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} - multiplied
    return sum(p.numel() for p in model.parameters() if id(p) not in looked_up)


def _attention_shape(model: nn.Module) -> tuple[int, int, int] | None:
    """(layers, query heads, head size) of the built-in GPT and LLaMA models; None for others."""
    config = getattr(model, "config", None)
    if config is None or not all(hasattr(config, k) for k in ("n_layer", "n_head", "n_embd")):
        return None
    return config.n_layer, config.n_head, config.n_embd // config.n_head


def flops_per_token(model: nn.Module, seq_len: int, train: bool = True) -> float:
    """``6 N + 12 L H Q T`` (training) or a third of it (a forward alone) for ``model`` on ``seq_len`` tokens."""
    shape = _attention_shape(model)
    attention = 12 * shape[0] * shape[1] * shape[2] * seq_len if shape else 0
    total = 6 * matmul_parameters(model) + attention
    return float(total if train else total / 3)


def mfu(step_flops: float | None, step_s: float | None, peak: float | None) -> float | None:
    """Model FLOPs utilization, a fraction of ``peak``; None when any figure is missing."""
    if not step_flops or not step_s or not peak:
        return None
    return step_flops / (step_s * peak)
