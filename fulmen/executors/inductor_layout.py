"""A compiled region returns its outputs in the layouts its operations give them when run one by one.

The operations after a region (and a backward region running unfused while its own kernel compiles) were traced
for the layouts the region's operations produce in eager PyTorch, and some rely on them: ``native_layer_norm``'s
backward reads its saved mean and rstd as contiguous, and reads garbage from a transposed one. Inductor picks
its own layouts for the outputs of a graph that are not marked user-visible (channels-last after a convolution,
the order of a reduction's loop), so a region's kernel could return the same values in other strides than the
unfused region: gradients changed when a kernel swapped in.

``keep_output_strides`` marks every output of a region's graph user-visible, so that Inductor keeps the strides
the traced graph gives them (fake tensors run through PyTorch's decompositions, which keep eager's strides).
``with_eager_strides`` checks the compiled graph's output strides against those and copies any output that
differs (a graph from Inductor's on-disk cache compiled without the marks) into the traced layout. With
``CHECK_LAYOUTS`` (tests/test_soundness_fused.py sets it) the target is the layouts of the region's unfused
callable run on fake tensors -- the program itself, at the cost of one more fake run per compilation -- and a
traced layout that differs from it is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger("fulmen.inductor")

#: Compare each compiled region's output layouts with its unfused callable's (one fake run per compilation).
CHECK_LAYOUTS = False


def keep_output_strides(gm: torch.fx.GraphModule) -> None:
    """Tell Inductor that every output of ``gm`` is visible to the program, so it keeps the traced strides."""
    out = gm.graph.find_nodes(op="output")[0]
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else out.args
    out.meta["user_visible_output_idxs"] = [i for i, v in enumerate(values) if isinstance(v, torch.fx.Node)]


def eager_output_layouts(fn: Callable, example: Sequence[torch.Tensor]) -> list[tuple[tuple, tuple] | None]:
    """``(shape, stride)`` of ``fn``'s tensor outputs for inputs laid out like ``example``, as eager PyTorch makes
    them (``None`` for other outputs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        outs = fn(*[mode.from_tensor(a) for a in example])
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return [(tuple(o.shape), tuple(o.stride())) if isinstance(o, torch.Tensor) else None for o in outs]


def _as_ints(stride) -> tuple[int, ...] | None:
    """A compiled graph's recorded stride (ints, or their expressions as strings); None where one is symbolic."""
    if stride is None:
        return None
    try:
        return tuple(int(s) for s in stride)
    except (TypeError, ValueError):
        return None


def _same_layout(shape: Sequence[int], a: Sequence[int], b: Sequence[int]) -> bool:
    # the stride of a dimension of size 1 never moves to another element
    return len(a) == len(b) and all(x == y for n, x, y in zip(shape, a, b) if n != 1)


def _dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` and ``stride`` covers its memory once (no element repeated)."""
    expected = 1
    for n, s in sorted(((n, s) for n, s in zip(shape, stride) if n != 1), key=lambda d: d[1]):
        if s != expected:
            return False
        expected *= n
    return True


class _Restrided:
    """A compiled region whose listed outputs are copied into the layouts the unfused region gives them."""

    __slots__ = ("__wrapped__", "fixes")

    def __init__(self, call: Callable, fixes: list[tuple[int, tuple[int, ...]]]):
        self.__wrapped__ = call
        self.fixes = fixes

    def __call__(self, args: list) -> list:
        outs = list(self.__wrapped__(args))
        for i, stride in self.fixes:
            o = outs[i]
            outs[i] = torch.empty_strided(o.shape, stride, dtype=o.dtype, device=o.device).copy_(o)
        return outs


def _traced_layouts(gm: torch.fx.GraphModule) -> list[tuple[tuple, tuple] | None]:
    out = gm.graph.find_nodes(op="output")[0]
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else out.args
    layouts = []
    for v in values:
        val = v.meta.get("val") if isinstance(v, torch.fx.Node) else None
        layouts.append((tuple(val.shape), tuple(val.stride())) if isinstance(val, torch.Tensor) else None)
    return layouts


def with_eager_strides(call: Callable, compiled, gm: torch.fx.GraphModule, fn: Callable,
                       example: Sequence[torch.Tensor]) -> Callable:
    """``call`` (``compiled``, Inductor's compilation of ``gm``, the trace of ``fn``), or a wrapper that returns each
    output in the layout ``fn`` gives it."""
    got = getattr(compiled, "output_strides", None)
    if not got:
        return call
    want = _traced_layouts(gm)
    if CHECK_LAYOUTS:
        eager = eager_output_layouts(fn, example)
        if _layouts_key(eager) != _layouts_key(want):
            log.warning("fulmen: Inductor's decompositions change the output strides of a region: %s, its operations "
                        "give %s", want, eager)
        want = eager
    fixes = []
    for i, (w, g) in enumerate(zip(want, got)):
        g = _as_ints(g)
        if w is None or g is None:
            continue
        shape, stride = w
        if not _same_layout(shape, stride, g) and _dense(shape, stride):
            fixes.append((i, stride))
    if not fixes:
        return call
    log.debug("fulmen: Inductor returns outputs %s of a region in other strides than its operations do; they are "
              "copied into those", [i for i, _ in fixes])
    return _Restrided(call, fixes)


def _layouts_key(layouts) -> list:
    return [None if x is None else tuple(s for n, s in zip(*x) if n != 1) for x in layouts]
