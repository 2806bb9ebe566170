"""Torch's process-wide flags that user code reads in Python while it is traced.

``if torch.are_deterministic_algorithms_enabled(): ...`` or ``torch.backends.cudnn.deterministic`` read while
tracing picks one branch, which the compiled program keeps; eager reads the flag again at every call. Grad mode,
inference mode, autocast, the default dtype and device are part of every call's key (``cache.global_state_key``).
The flags below are not: each costs a read per call, and few programs read them. So the guard on globals
(``global_guard``) checks a flag only for programs whose code names it: ``flags_named(names)`` gives those whose
names all appear among the global and attribute names of a code object the guard visits
(``torch.backends.cudnn.deterministic`` names ``cudnn`` and ``deterministic``).

The same holds for other process state code reads: the thread counts (``torch.get_num_threads()`` reads the
program's count, ``inductor_compile.program_threads``, since fulmen lowers it while its compiler works),
``torch.initial_seed()``, ``torch.cuda.is_available()``, the sdpa backend switches, whether (and as which rank of how
many) the process is in a ``torch.distributed`` group, and the environment
(``os.environ[...]``, ``os.environ.get``, ``os.getenv``): a program naming ``environ`` or ``getenv`` is checked against
the whole environment, one dictionary comparison, since the key it reads may be computed.

Not covered: a flag read through an alias of its reader (``from torch import are_deterministic_algorithms_enabled
as det``), or read by library code (its globals are not followed).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from fulmen.executors.inductor_compile import program_threads


def _cudnn(name: str) -> Callable[[], Any]:
    return lambda: getattr(torch.backends.cudnn, name)


def _distributed(name: str) -> Callable[[], Any]:
    # get_rank and get_world_size raise before init_process_group: read as None then
    def read():
        dist = torch.distributed
        if not dist.is_available() or not dist.is_initialized():
            return False if name == "is_initialized" else None
        return getattr(dist, name)()

    return read


def _cuda_matmul(name: str) -> Callable[[], Any]:
    return lambda: getattr(torch.backends.cuda.matmul, name)


#: (the names code reading the flag uses, how the flag reads in the guard's messages, its reader)
FLAGS: tuple[tuple[frozenset[str], str, Callable[[], Any]], ...] = tuple(
    (frozenset(names.split()), where, reader)
    for names, where, reader in (
        (
            "are_deterministic_algorithms_enabled",
            "torch.are_deterministic_algorithms_enabled()",
            torch.are_deterministic_algorithms_enabled,
        ),
        (
            "is_deterministic_algorithms_warn_only_enabled",
            "torch.is_deterministic_algorithms_warn_only_enabled()",
            torch.is_deterministic_algorithms_warn_only_enabled,
        ),
        ("get_deterministic_debug_mode", "torch.get_deterministic_debug_mode()", torch.get_deterministic_debug_mode),
        ("get_float32_matmul_precision", "torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision),
        ("get_fastpath_enabled", "torch.backends.mha.get_fastpath_enabled()", torch.backends.mha.get_fastpath_enabled),
        ("is_anomaly_enabled", "torch.is_anomaly_enabled()", torch.is_anomaly_enabled),
        ("is_anomaly_check_nan_enabled", "torch.is_anomaly_check_nan_enabled()", torch.is_anomaly_check_nan_enabled),
        ("get_num_threads", "torch.get_num_threads()", program_threads),
        ("get_num_interop_threads", "torch.get_num_interop_threads()", torch.get_num_interop_threads),
        ("initial_seed", "torch.initial_seed()", torch.initial_seed),
        ("cuda is_available", "torch.cuda.is_available()", torch.cuda.is_available),
        ("flash_sdp_enabled", "torch.backends.cuda.flash_sdp_enabled()", torch.backends.cuda.flash_sdp_enabled),
        (
            "mem_efficient_sdp_enabled",
            "torch.backends.cuda.mem_efficient_sdp_enabled()",
            torch.backends.cuda.mem_efficient_sdp_enabled,
        ),
        ("math_sdp_enabled", "torch.backends.cuda.math_sdp_enabled()", torch.backends.cuda.math_sdp_enabled),
        ("cudnn_sdp_enabled", "torch.backends.cuda.cudnn_sdp_enabled()", torch.backends.cuda.cudnn_sdp_enabled),
        ("is_initialized", "torch.distributed.is_initialized()", _distributed("is_initialized")),
        ("get_world_size", "torch.distributed.get_world_size()", _distributed("get_world_size")),
        ("get_rank", "torch.distributed.get_rank()", _distributed("get_rank")),
        ("cudnn deterministic", "torch.backends.cudnn.deterministic", _cudnn("deterministic")),
        ("cudnn benchmark", "torch.backends.cudnn.benchmark", _cudnn("benchmark")),
        ("cudnn enabled", "torch.backends.cudnn.enabled", _cudnn("enabled")),
        ("cudnn allow_tf32", "torch.backends.cudnn.allow_tf32", _cudnn("allow_tf32")),
        ("mkldnn enabled", "torch.backends.mkldnn.enabled", lambda: torch.backends.mkldnn.enabled),
        ("opt_einsum enabled", "torch.backends.opt_einsum.enabled", lambda: torch.backends.opt_einsum.enabled),
        ("matmul allow_tf32", "torch.backends.cuda.matmul.allow_tf32", _cuda_matmul("allow_tf32")),
        (
            "matmul allow_fp16_reduced_precision_reduction",
            "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
            _cuda_matmul("allow_fp16_reduced_precision_reduction"),
        ),
        (
            "matmul allow_bf16_reduced_precision_reduction",
            "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
            _cuda_matmul("allow_bf16_reduced_precision_reduction"),
        ),
    )
)


#: the names code reading the environment uses (``os.environ``, ``from os import getenv``)
ENVIRONMENT_NAMES = frozenset(("environ", "getenv", "putenv", "unsetenv"))


def environment() -> dict:
    """The process environment as ``os.environ`` holds it (its encoded keys and values): the live dictionary, which
    one ``==`` compares with a copy at C speed."""
    return os.environ._data


def environment_change(traced: dict, now: dict) -> str:
    """Which variables differ between two ``environment()`` dictionaries, for a recompilation's reason."""
    changed = sorted(k for k in traced.keys() | now.keys() if traced.get(k) != now.get(k))

    def text(v: Any) -> str:
        return "unset" if v is None else repr(os.fsdecode(v) if isinstance(v, bytes) else v)

    shown = ", ".join(f"{os.fsdecode(k) if isinstance(k, bytes) else k} {text(traced.get(k))} -> {text(now.get(k))}"
                      for k in changed[:3])
    return f"os.environ changed ({shown}{', ...' if len(changed) > 3 else ''})"


def flags_named(names: frozenset[str]) -> list[tuple[str, Callable[[], Any]]]:
    """The flags (how each reads, its reader) that code using the global and attribute ``names`` may read."""
    return [(where, reader) for needed, where, reader in FLAGS if needed <= names]
