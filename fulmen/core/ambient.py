"""The ambient PyTorch settings a program was traced under that compiling it reads again: the default dtype and
the default device.

A trace records ``torch.ones(4)`` or an integer division as operations whose outputs have the dtype and device
the defaults gave while tracing. The code generated for them is not always that explicit: a fused region's Python
calls ``torch.ones(4)`` as the user wrote it, Inductor traces that Python again with make_fx, and its lowering
resolves an unspecified dtype (a factory, ``int / int``) from the default of the moment. Compilation that runs
later than tracing -- a region's kernel on the background compiler, the backward compiled when it first runs,
the forward and backward of a program whose first call ran on PyTorch autograd -- must see what the trace saw.
``Ambient.capture()`` records the settings; ``applied()`` re-establishes them for a block, scoped.

The default device is per thread (``torch.set_default_device``, ``with torch.device(...)``): it is applied with a
device context, for the calling thread only. The default dtype is one setting for the whole process: applying
another one changes it for every thread for the duration of the block. So fulmen applies it only on the thread
that runs the program, holding ``DTYPE_LOCK``; the background compiler never sets it: it compiles a kernel only
while the process's default already is the kernel's (``matches``), holding the same lock, and leaves the others
for a later call to hand back (``fulmen.executors.inductor_compile``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

#: Held while fulmen compiles under, or switches, the process-wide default dtype.
DTYPE_LOCK = threading.RLock()


class Ambient:
    """The default dtype and default device of one moment (``capture()``)."""

    __slots__ = ("dtype", "device")

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype = dtype
        self.device = device

    @classmethod
    def capture(cls) -> Ambient:
        return cls(torch.get_default_dtype(), torch.get_default_device())

    def key(self) -> tuple:
        return (self.dtype, str(self.device))

    def matches(self) -> bool:
        """Whether the process's default dtype is this one (the device is the calling thread's to apply)."""
        return torch.get_default_dtype() is self.dtype

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """These settings for the calling thread, for the block; the previous ones after it."""
        with contextlib.ExitStack() as stack:
            if torch.get_default_device() != self.device:
                stack.enter_context(torch.device(self.device))
            if torch.get_default_dtype() is not self.dtype:
                stack.enter_context(DTYPE_LOCK)
                stack.callback(torch.set_default_dtype, torch.get_default_dtype())
                torch.set_default_dtype(self.dtype)
            yield

    def __repr__(self) -> str:
        return f"Ambient(default dtype {self.dtype}, default device {self.device})"
