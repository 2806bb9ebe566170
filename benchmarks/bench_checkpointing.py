"""Activation checkpointing: the bytes a GPT's training step keeps for its backward, with and without
``torch.utils.checkpoint`` around each block, eager vs fulmen.jit.

Saved bytes are the distinct storages kept for the backward, less the parameters and the input (the caller keeps
those alive anyway). Eager's are counted with ``torch.autograd.graph.saved_tensors_hooks`` (a checkpointed region's
own hooks take its tensors, so what it drops is not counted); fulmen's are the tensors its autograd nodes hold.
The script also checks that the loss and the gradients agree with eager's.

    python benchmarks/bench_checkpointing.py                    # gpt-small, batch 4, sequence 128
    python benchmarks/bench_checkpointing.py --model gpt-tiny --batch 2 --seq 16
    python benchmarks/bench_checkpointing.py --dropout 0.1         # dropout masks: drawn again in the backward
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from torch import nn

import fulmen
from fulmen.bench.memory import saved_tensors
from fulmen.bench.models import CONFIGS, GPT, checkpoint_blocks


def build(name: str, mode: str, dropout: float) -> GPT:
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CONFIGS[name], dropout=dropout))
    return model if mode == "none" else checkpoint_blocks(model, use_reentrant=mode == "reentrant")


def _storages(tensors, skip: set[int]) -> int:
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in sizes.items() if ptr not in skip)


def eager_saved(model: nn.Module, idx, targets) -> tuple[int, torch.Tensor]:
    packed: list[torch.Tensor] = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, targets)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {idx.untyped_storage().data_ptr()}
    return _storages(packed, skip), loss


def fulmen_saved(loss: torch.Tensor, skip: set[int]) -> int:
    return _storages(saved_tensors(loss), skip)


def measure(name: str, mode: str, batch: int, seq: int, executors, dropout: float) -> dict:
    config = CONFIGS[name]
    torch.manual_seed(1)
    idx = torch.randint(0, config.vocab_size, (batch, seq))
    targets = torch.randint(0, config.vocab_size, (batch, seq))
    eager = build(name, mode, dropout)
    torch.manual_seed(2)  # the same dropout masks for eager and fulmen
    eager_bytes, eager_loss = eager_saved(eager, idx, targets)
    eager_loss.backward()
    model = build(name, mode, dropout)
    jitted = fulmen.jit(model, executors=executors)
    jitted(idx, targets)[1].backward()  # the first call may run on PyTorch autograd; measure the compiled program
    model.zero_grad()
    torch.manual_seed(2)
    _, loss = jitted(idx, targets)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {idx.untyped_storage().data_ptr()}
    ours = fulmen_saved(loss, skip)
    loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    worst = max((p.grad - e.grad).abs().max().item() for p, e in zip(model.parameters(), eager.parameters()))
    return {"mode": mode, "eager_bytes": eager_bytes, "fulmen_bytes": ours, "max_grad_diff": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small", choices=[k for k in CONFIGS if k.startswith("gpt")])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--executors", default="torch", help="'torch' or 'default' (with Inductor fusion)")
    parser.add_argument("--dropout", type=float, default=0.0, help="the GPT's dropout probability")
    args = parser.parse_args()
    executors = ["torch"] if args.executors == "torch" else None
    print(f"{args.model}, batch {args.batch}, sequence {args.seq}, dropout {args.dropout}, executors {args.executors}")
    print(f"{'checkpointing':>14} {'eager MiB':>10} {'fulmen MiB':>11} {'max |grad diff|':>16}")
    for mode in ("none", "non-reentrant", "reentrant"):
        r = measure(args.model, mode, args.batch, args.seq, executors, args.dropout)
        eager_mib, fulmen_mib = r["eager_bytes"] / 2**20, r["fulmen_bytes"] / 2**20
        print(f"{mode:>14} {eager_mib:10.2f} {fulmen_mib:11.2f} {r['max_grad_diff']:16.2e}")


if __name__ == "__main__":
    main()
