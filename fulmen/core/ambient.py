"""The ambient PyTorch settings a program was traced under that compiling it reads again: the default dtype and
the default device, and two process-wide switches Inductor's lowering reads (deterministic algorithms, which
choose deterministic fallbacks for scatters; float32 matmul precision, which lets matmul templates use TF32).

A trace records ``torch.ones(4)`` or an integer division as operations whose outputs have the dtype and device
the defaults gave while tracing. The code generated for them is not always that explicit: a fused region's Python
calls ``torch.ones(4)`` as the user wrote it, Inductor traces that Python again with make_fx, and its lowering
resolves an unspecified dtype (a factory, ``int / int``) from the default of the moment. Compilation that runs
later than tracing -- a region's kernel on the background compiler, the backward compiled when it first runs,
the forward and backward of a program whose first call ran on PyTorch autograd -- must see what the trace saw.
``Ambient.capture()`` records the settings; ``applied()`` re-establishes them for a block, scoped.

The default device is per thread (``torch.set_default_device``, ``with torch.device(...)``): it is applied with a
device context, for the calling thread only. The others are one setting for the whole process: applying another
value changes it for every thread for the duration of the block. So fulmen applies them only on the thread that
runs the program; the background compiler never sets them: it compiles a kernel only while the process's
settings already are the kernel's (``matches``), and leaves the others for a later call to hand back
(``fulmen.executors.inductor_compile``). Every switch ``applied`` makes moves ``switches()``, so a compilation
that ran while fulmen switched the settings and back on another thread is seen and done again. (No lock is held
across a compilation: compilations take the compiler's import lock, which a thread building a program holds.)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_switch_lock = threading.Lock()
_switches = 0


def switches() -> int:
    """How many times ``applied`` switched a process-wide setting (or switched it back) so far."""
    return _switches


def _switched() -> None:
    global _switches
    with _switch_lock:
        _switches += 1


def _deterministic() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _set_deterministic(mode: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])


class Ambient:
    """The default dtype and device, deterministic algorithms and float32 matmul precision of one moment
    (``capture()``)."""

    __slots__ = ("dtype", "device", "deterministic", "matmul_precision")

    def __init__(self, dtype: torch.dtype, device: torch.device, deterministic: tuple[bool, bool] = (False, False),
                 matmul_precision: str = "highest"):
        self.dtype = dtype
        self.device = device
        self.deterministic = deterministic
        self.matmul_precision = matmul_precision

    @classmethod
    def capture(cls) -> Ambient:
        return cls(torch.get_default_dtype(), torch.get_default_device(), _deterministic(),
                   torch.get_float32_matmul_precision())

    def key(self) -> tuple:
        return (self.dtype, str(self.device), self.deterministic, self.matmul_precision)

    def _process_wide(self) -> list[tuple]:
        """(current, wanted, setter) for each process-wide setting."""
        return [(torch.get_default_dtype(), self.dtype, torch.set_default_dtype),
                (_deterministic(), self.deterministic, _set_deterministic),
                (torch.get_float32_matmul_precision(), self.matmul_precision, torch.set_float32_matmul_precision)]

    def matches(self) -> bool:
        """Whether the process-wide settings are these (the device is the calling thread's to apply)."""
        return all(current == wanted for current, wanted, _ in self._process_wide())

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """These settings for the calling thread, for the block; the previous ones after it."""
        with contextlib.ExitStack() as stack:
            if torch.get_default_device() != self.device:
                stack.enter_context(torch.device(self.device))
            changes = [(current, wanted, set_) for current, wanted, set_ in self._process_wide() if current != wanted]
            for current, wanted, set_ in changes:
                stack.callback(_switched)  # after the setting is back (callbacks run last in, first out)
                stack.callback(set_, current)
                _switched()
                set_(wanted)
            yield

    def __repr__(self) -> str:
        return (f"Ambient(default dtype {self.dtype}, default device {self.device}, deterministic "
                f"{self.deterministic}, float32 matmul precision {self.matmul_precision!r})")
