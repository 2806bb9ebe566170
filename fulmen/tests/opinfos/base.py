"""OpInfo, SampleInput and DecorateInfo: the pieces of the OpInfo database."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.testing import make_tensor  # noqa: F401  (re-exported for sample generators)

from fulmen.core import dtypes


class SampleInput:
    """Arguments for one call of an operation."""

    def __init__(self, *args, **kwargs):
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"[SampleInput args={self.args} kwargs={self.kwargs}]"

    def __str__(self) -> str:
        return repr(self)


@dataclass
class DecorateInfo:
    """Apply ``decorator`` (``pytest.mark.xfail``, ``pytest.mark.skip``) to one generated test.

    ``test_name`` names the test function; ``dtypes`` / ``devicetypes`` / ``executors`` narrow it.
    Every directive must say why in ``reason``.
    """

    decorator: Any
    test_name: str
    dtypes: Sequence[torch.dtype] | None = None
    devicetypes: Sequence[str] | None = None
    executors: Sequence[str] | None = None
    reason: str = ""

    def applies(self, test_name: str, dtype: torch.dtype | None, devicetype: str | None,
                executor: str | None = None) -> bool:
        if test_name != self.test_name:
            return False
        if self.dtypes is not None and dtype not in self.dtypes:
            return False
        if self.devicetypes is not None and devicetype not in self.devicetypes:
            return False
        return not (self.executors is not None and executor not in self.executors)


_registry: list[OpInfo] = []


@dataclass
class OpInfo:
    """What the test suite knows about one operation.

    ``op`` is the torch-language symbol (or a function calling torch); ``torch_reference`` the eager
    function to compare with. ``sample_input_generator(op, device, dtype, requires_grad)`` yields
    ``SampleInput``; ``error_input_generator(op, device)`` yields ``(SampleInput, exception type, regex)``.
    """

    op: Callable
    name: str | None = None
    sample_input_generator: Callable[..., Iterator[SampleInput]] | None = None
    error_input_generator: Callable[..., Iterator[tuple]] | None = None
    torch_reference: Callable | None = None
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64, torch.bfloat16, torch.int64)
    # where torch's CUDA kernels support fewer dtypes than its CPU ones (cuBLAS has no int64 matmul)
    cuda_dtypes: Sequence[torch.dtype] | None = None
    supports_grad: bool = True
    grad_dtypes: Sequence[torch.dtype] = (torch.float64,)
    domain: tuple[float | None, float | None] = (None, None)
    test_directives: Sequence[DecorateInfo] = field(default_factory=tuple)
    is_random: bool = False
    # torch guarantees these output strides (e.g. contiguous results); checked by the meta test
    check_strides: bool = False
    tolerance: dict[torch.dtype, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self):
        if self.name is None:
            self.name = getattr(self.op, "name", None) or getattr(self.op, "__name__", "op")
        _registry.append(self)

    def sample_inputs(self, device: str, dtype: torch.dtype, requires_grad: bool = False) -> Iterator[SampleInput]:
        return self.sample_input_generator(self, device=device, dtype=dtype, requires_grad=requires_grad)

    def error_inputs(self, device: str) -> Iterator[tuple]:
        if self.error_input_generator is None:
            return iter(())
        return self.error_input_generator(self, device=device)

    def supports_dtype(self, dtype: torch.dtype, devicetype: str = "cpu") -> bool:
        if devicetype == "cuda" and self.cuda_dtypes is not None:
            return dtype in self.cuda_dtypes
        return dtype in self.dtypes

    def directives_for(self, test_name: str, dtype=None, devicetype=None, executor=None) -> list[DecorateInfo]:
        return [d for d in self.test_directives if d.applies(test_name, dtype, devicetype, executor)]

    def tolerances(self, dtype: torch.dtype) -> tuple[float, float] | None:
        return self.tolerance.get(dtype)


def all_opinfos() -> list[OpInfo]:
    return list(_registry)


float_dtypes = dtypes.float_dtypes
