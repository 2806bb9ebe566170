"""Gradients of the collectives (``fulmen.torch.collectives``), as PyTorch's functional collectives define them.

An all-reduce's gradient is the all-reduce of the cotangents (each rank's output depends on every rank's input);
all-gather and reduce-scatter are each other's adjoints. Each rule starts the backward collective and waits for
it, so the overlap scheduler (``fulmen.transforms.overlap``) moves the two apart in the backward trace as well.
Only the reductions that are linear have a gradient (``sum``, ``avg``); the others are refused when a gradient
is needed. c10d's in-place collectives never reach these rules: eager autograd does not see them, and fulmen
records them outside autograd too.
"""

from __future__ import annotations

from fulmen.core.utils import check
from fulmen.torch import collectives as c
from fulmen.transforms.linearize import RuleArgs, builtin_rule, get_grad, needs_grad, put_grad

_LINEAR = ("sum", "avg")


def _check_linear(op: str, name: str) -> None:
    check(
        op in _LINEAR,
        lambda: (
            f"{name} with reduce op {op!r} has no gradient (only {list(_LINEAR)} do): the "
            "result does not depend linearly on the inputs. Detach its input, or reduce with 'sum'."
        ),
        NotImplementedError,
    )


@builtin_rule(c.all_reduce.id)
def _all_reduce_rule(p: RuleArgs):
    x, op, group = p[0], p[1], p[2]
    out = c.all_reduce(x, op, group)
    if needs_grad(x):
        _check_linear(op, "all_reduce")
        put_grad(x, c.wait_tensor(c.all_reduce(get_grad(out), op, group)))
    return out


@builtin_rule(c.all_gather_into_tensor.id)
def _all_gather_rule(p: RuleArgs):
    x, size, group = p[0], p[1], p[2]
    out = c.all_gather_into_tensor(x, size, group)
    if needs_grad(x):
        put_grad(x, c.wait_tensor(c.reduce_scatter_tensor(get_grad(out), "sum", size, group)))
    return out


@builtin_rule(c.reduce_scatter_tensor.id)
def _reduce_scatter_rule(p: RuleArgs, sym=c.reduce_scatter_tensor):
    x, op, size, group = p[0], p[1], p[2], p[3]
    out = sym(x, op, size, group)
    if needs_grad(x):
        _check_linear(op, "reduce_scatter_tensor")
        g = c.wait_tensor(c.all_gather_into_tensor(get_grad(out), size, group))
        put_grad(x, g / size if op == "avg" else g)
    return out


@builtin_rule(c.wait_tensor.id)
def _wait_rule(p: RuleArgs):
    out = c.wait_tensor(p[0])
    if needs_grad(p[0]):
        put_grad(p[0], get_grad(out))
    return out


@builtin_rule(c.param_all_gather.id)
def _param_all_gather_rule(p: RuleArgs):
    """FSDP2's gradient reduction (its default for float32/bfloat16 gradients): each rank's shard of the full
    gradient averaged over the ranks, the mean of the data-parallel replicas' gradients."""
    x, size, group = p[0], p[1], p[2]
    out = c.param_all_gather(x, size, group)
    if needs_grad(x):
        put_grad(x, c.wait_tensor(c.param_reduce_scatter(get_grad(out), "avg", size, group)))
    return out


@builtin_rule(c.param_reduce_scatter.id)
def _param_reduce_scatter_rule(p: RuleArgs):
    """As ``reduce_scatter_tensor``'s (FSDP2's gradient reduce-scatter, differentiated again)."""
    return _reduce_scatter_rule(p, c.param_reduce_scatter)


@builtin_rule(c.param_wait.id)
def _param_wait_rule(p: RuleArgs):
    out = c.param_wait(p[0])
    if needs_grad(p[0]):
        put_grad(p[0], get_grad(out))
    return out
