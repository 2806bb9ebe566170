"""Why a call's cache key differs from the last compilation's, in words: the recompile reasons of the statistics
and the logs, and the argument whose changing value counts towards ``RECOMPILE_LIMIT``."""

from __future__ import annotations

from fulmen.frontend.cache import describe_key_part, holds_objects, is_same_key, key_difference, tensor_keys
from fulmen.frontend.tracing import _arg_names


def describe_key_change(old, new, names: list[str] = ()) -> str:
    if old is None:
        return "a first call"
    (old_args, old_state), (new_args, new_state) = old, new
    if old_state != new_state:
        parts = [
            "grad mode",
            "inference mode",
            "default dtype",
            "CPU autocast",
            "CUDA autocast",
            "CPU autocast dtype",
            "CUDA autocast dtype",
            "default device",
        ]
        changed = [n for n, a, b in zip(parts, old_state, new_state) if a != b]
        return "a change of " + ", ".join(changed)
    if len(old_args) != len(new_args):
        return f"a different number of arguments ({len(old_args)} -> {len(new_args)})"
    for i, (a, b) in enumerate(zip(old_args, new_args)):
        if a != b:
            keywords = type(a) is tuple and a[:1] == ("kwargs",)
            if (
                keywords
                and type(b) is tuple
                and b[:1] == ("kwargs",)
                and [k for k, _ in a[1:]] == [k for k, _ in b[1:]]
            ):
                name, x, y = next((k, x, y) for (k, x), (_, y) in zip(a[1:], b[1:]) if x != y)
                where, x, y = key_difference(x, y, name)
                return f"keyword argument {where} changed from {describe_key_part(x)} to {describe_key_part(y)}"
            if keywords and type(b) is tuple and b[:1] == ("kwargs",):
                return f"keyword arguments changed from {[k for k, _ in a[1:]]} to {[k for k, _ in b[1:]]}"
            name = f" ({names[i]})" if i < len(names) and not keywords else ""
            if not keywords and holds_objects((a, b)):
                where, x, y = key_difference(a, b)
                return f"argument {i}{name}{where} changed from {describe_key_part(x)} to {describe_key_part(y)}"
            return f"argument {i}{name} changed from {short(a)} to {short(b)}"
    return "a changed argument"


def changed_value(old_args: tuple, new_args: tuple) -> int | str | None:
    """The first argument (position, or keyword) whose key differs between two call keys, when what differs is a
    non-tensor value (the tensors in it are described alike); None otherwise."""
    if len(old_args) != len(new_args):
        return None
    for i, (a, b) in enumerate(zip(old_args, new_args)):
        if a == b:
            continue
        if type(a) is tuple and a[:1] == ("kwargs",) and type(b) is tuple and b[:1] == ("kwargs",):
            if len(a) != len(b):
                return None
            for (name, x), (other, y) in zip(a[1:], b[1:]):
                if name != other:
                    return None
                if x != y:
                    return name if tensor_keys(x) == tensor_keys(y) else None
            return None
        return i if tensor_keys(a) == tensor_keys(b) else None
    return None


def argument_name(fn, args: tuple, kwargs: dict, changed: int | str) -> str:
    """``'scale' (argument 1)``: the parameter's name when the signature says it."""
    if isinstance(changed, str):
        return repr(changed)
    names = _arg_names(fn, args, kwargs)
    return f"{names[changed]!r} (argument {changed})" if changed < len(names) else f"{changed}"


def short(k) -> str:
    text = describe_key_part(k) if is_same_key(k) else repr(k)
    return text if len(text) < 120 else text[:117] + "..."
