"""Layouts fulmen believes against eager's, over PyTorch's op_db on CPU: every sample input of an op transposed,
channels_last and sliced (a storage offset and gaps), the op traced by fulmen.jit reading ``stride()`` and
``is_contiguous()`` (for every memory format of its rank) of each result inside the traced function, compared with
eager's results. A later ``view``, ``reshape`` or branch on those answers depends on them.

Strides of size-1 dims, and of results with fewer than two elements, are never observable through these reads'
decisions and are not compared (eager's own are arbitrary there)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

import fulmen
from fulmen.testing import clone_args

#: op_db entries whose layout fulmen cannot match, with the reason (full_name -> why)
KNOWN: dict[str, str] = {
    # (none: CPU convolutions of a channels_last input take the layout of the backend PyTorch picks for the call,
    # oneDNN or not, from the real kernel run on zeros at compile time, and recompile when the flags it reads change)
}


def _variants(x) -> dict[str, torch.Tensor]:
    """``x`` with the same values laid out otherwise: transposed, channels_last (3d), sliced with gaps and offset."""
    if not isinstance(x, torch.Tensor) or x.layout != torch.strided or x.ndim < 1 or x.numel() < 2:
        return {}
    out = {}
    if x.ndim >= 2:
        out["transposed"] = x.mT.contiguous().mT
    if x.ndim in (4, 5):
        out["channels_last"] = x.contiguous(
            memory_format=torch.channels_last if x.ndim == 4 else torch.channels_last_3d
        )
    sliced = torch.empty(*x.shape[:-1], 2 * x.shape[-1] + 1, dtype=x.dtype)[..., 1::2]
    out["sliced"] = sliced.copy_(x)
    return out


def _facts(out) -> list[tuple]:
    """(significant strides, is_contiguous for each memory format of its rank) of each strided result."""
    facts = []
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel() > 1:
            formats = {4: (torch.channels_last,), 5: (torch.channels_last_3d,)}.get(t.ndim, ())
            strides = tuple(s for s, n in zip(t.stride(), t.shape) if n > 1)
            facts.append((strides, t.is_contiguous(), *(t.is_contiguous(memory_format=f) for f in formats)))
    return facts


def layout_difference(fn, args: tuple, kwargs: dict) -> str | None:
    """What fulmen believes (or returns) of the results of ``fn(*args, **kwargs)`` where it differs from eager's;
    None where they agree or eager raises."""
    try:
        torch.manual_seed(0)
        want = _facts(fn(*clone_args(args), **clone_args(kwargs)))
    except Exception:
        return None

    def probe(*a, **k):
        out = fn(*a, **k)
        return out, _facts(out)

    try:
        torch.manual_seed(0)
        out, believed = fulmen.jit(probe, executors=["torch"])(*clone_args(args), **clone_args(kwargs))
    except Exception as e:
        return f"raised {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    if believed != want:
        return f"believed {believed}, eager {want}"
    if _facts(out) != want:
        return f"returned {_facts(out)}, eager {want}"
    return None


def sweep(ops, max_samples: int) -> dict[str, list[str]]:
    """Layout differences per op_db op (full_name -> descriptions): an error only counts where the same sample
    with its contiguous input runs."""
    found = {}
    warnings.filterwarnings("ignore")
    for op in ops:
        try:
            samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))[:max_samples]
        except Exception:
            continue
        for sample in samples:
            for name, x in _variants(sample.input).items():
                diff = layout_difference(op.op, (x, *sample.args), sample.kwargs)
                if (
                    diff
                    and diff.startswith("raised")
                    and layout_difference(op.op, (sample.input, *sample.args), sample.kwargs)
                ):
                    continue  # fails whatever the layout: not a layout question
                if diff:
                    found.setdefault(op.full_name, []).append(f"{name} {tuple(x.shape)}: {diff}")
    return found


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


_W = torch.randn(4, 3, 3, 3, generator=_gen(0))
_M = torch.rand(2, 3, 4, 5, generator=_gen(1)) > 0.5
#: ops whose layout rule was wrong once (the kernels' own rules, fake kernels per device, views of opaque ops), and
#: some whose rule held (layer_norm, sort, instance_norm, circular pad), as controls
_CASES = {
    "rrelu_eval": lambda x: F.rrelu(x, training=False),
    "logsigmoid": F.logsigmoid,
    "batch_norm": lambda x: F.batch_norm(x, None, None, training=True),
    "batch_norm_running": lambda x: F.batch_norm(x, torch.zeros(3), torch.ones(3), training=True),
    "batch_norm_eval": lambda x: F.batch_norm(x, torch.zeros(3), torch.ones(3), training=False),
    "native_batch_norm": lambda x: torch.native_batch_norm(x, None, None, None, None, True, 0.1, 1e-5),
    "instance_norm": F.instance_norm,
    "masked_fill": lambda x: x.masked_fill(_M, 1.0),
    "conv2d": lambda x: F.conv2d(x, _W),
    "group_norm": lambda x: F.group_norm(x, 3),
    "channel_shuffle": lambda x: F.channel_shuffle(torch.cat([x, x], 1), 2),
    # the output size given: the default (4x4 for a 5-wide input) holds no index of the last column, and eager raises
    "max_unpool2d": lambda x: F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2, output_size=x.shape[-2:]),
    "dropout_backward": lambda x: torch.ops.aten.native_dropout_backward(x, _M, 2.0),
    "dropout3d": lambda x: F.dropout3d(x, 0.5),
    "linalg_diagonal": torch.linalg.diagonal,
    "hsplit": lambda x: torch.hsplit(x, [1]),  # at an index: 3 channels do not split in 2 equal parts
    "layer_norm": lambda x: F.layer_norm(x, (5,)),
    # it writes its running statistics, so it runs on copies of them: its result still takes the kernel's layout
    "batch_norm_with_update": lambda x: torch.ops.aten._batch_norm_with_update(
        x, torch.ones(3), torch.zeros(3), torch.zeros(3), torch.ones(3), 0.1, 1e-5
    )[0],
    "sort": lambda x: torch.sort(x, 1),
    "pad_reflect_3d": lambda x: F.pad(x, (1, 1, 1, 1, 1, 1), mode="reflect"),  # (C, D, H, W): unbatched 3-d
    "pad_replicate": lambda x: F.pad(x, (1, 2, 1, 0), mode="replicate"),
    "pad_circular": lambda x: F.pad(x, (1, 1, 1, 1), mode="circular"),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_layouts_of_ops_on_rearranged_inputs_are_eagers(case):
    x = torch.randn(2, 3, 4, 5, generator=_gen(2))
    for v in _variants(x).values():
        _CASES[case](v)  # eager runs each case (layout_difference finds nothing to compare where eager raises)
    found = {name: layout_difference(_CASES[case], (v,), {}) for name, v in _variants(x).items()}
    assert not any(found.values()), found


@pytest.mark.slow
def test_layouts_of_every_op_db_op_on_rearranged_inputs_are_eagers():
    op_db = pytest.importorskip("torch.testing._internal.common_methods_invocations").op_db
    ops = [op for op in op_db if torch.float32 in op.supported_dtypes("cpu") and op.full_name not in KNOWN]
    found = sweep(ops, max_samples=2)
    assert not found, "\n".join(f"{k} ({len(v)}): {v[0]}" for k, v in sorted(found.items()))
