"""The traced output's own containers, rebuilt on every call from what the generated code returns.

Generated code returns plain tuples, lists and dicts. Where the traced function returned other containers that
``torch.utils._pytree`` knows (a Hugging Face ``ModelOutput``, a namedtuple, a registered dataclass), every call
builds them again from the program's values. ``rebuilder(output)`` walks the traced output's tree once and returns
one function per container, each taking the matching part of the generated value apart one level and calling the
container's own ``unflatten`` on the rebuilt parts: what ``tree_unflatten(tree_flatten(value)[0], spec)`` computes,
without walking the tree and looking up its types on every call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["rebuilder"]


def rebuilder(output: Any) -> Callable[[Any], Any]:
    """The function that turns the generated code's value for ``output`` (a traced output) into ``output``'s
    containers."""
    build = _node(pytree.tree_flatten(output)[1])
    return build if build is not None else _same


def _same(value: Any) -> Any:
    return value


def _node(spec: pytree.TreeSpec) -> Callable[[Any], Any] | None:
    """The builder of one node of the traced output's tree; None for a leaf (its value is taken as it is)."""
    if spec.is_leaf():
        return None
    if spec.type is torch.Size:  # torch's pytree unflattens a Size into a plain tuple; eager returned a Size
        return torch.Size
    children = [_node(child) for child in spec.children()]
    unflatten, context, n = pytree.SUPPORTED_NODES[spec.type].unflatten_fn, spec.context, len(children)

    def build(value: Any) -> Any:
        parts = _parts(value)
        if len(parts) != n:
            raise ValueError(
                f"fulmen: the program returned {len(parts)} values where its traced output's "
                f"{spec.type.__name__} holds {n}; please report this"
            )
        return unflatten([v if b is None else b(v) for b, v in zip(children, parts)], context)

    return build


def _parts(value: Any) -> list[Any]:
    """The children of one node of the generated value, in ``tree_flatten``'s order."""
    t = type(value)
    if t is tuple or t is list:
        return value
    if t is dict:
        return list(value.values())
    node = pytree.SUPPORTED_NODES.get(pytree._get_node_type(value))
    return node.flatten_fn(value)[0] if node is not None else []
