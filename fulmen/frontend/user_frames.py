"""Which torch calls made while tracing are the user's program, and which are fulmen's own work.

A torch call without a proxy argument is recorded into the trace when the user's code makes it (``torch.rand(3)``
runs on every call), and runs at once when fulmen's code makes it (building metadata, checking a value). The call
stack says which: the first frame outside torch's own files is either the user's or fulmen's. Torch's own code
between the traced function and the call (``fulmen.jit(optimizer.step)``, a torch module's forward) is the user's:
the walk stops at the frame of fulmen that called the traced code (``user_entry``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from fulmen.core.proxies import is_library_file

_FULMEN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# fulmen's own layers; code elsewhere in the package (fulmen/bench models, examples) counts as user code
_INTERNAL = tuple(
    os.path.join(_FULMEN_DIR, d) for d in ("core", "torch", "prims", "clang.py", "transforms", "executors", "frontend")
)
#: the code of fulmen's functions that call the traced program's code
_USER_ENTRIES: set = set()


def user_entry(fn: Callable) -> Callable:
    """Mark ``fn`` as a function of fulmen that calls the traced code, or makes the traced program's calls itself (an
    FX graph run node by node): torch calls beneath it are the user's, recorded and run on every call."""
    _USER_ENTRIES.add(fn.__code__)
    return fn


def called_by_fulmen() -> bool:
    """Whether the torch call being intercepted (by the caller of this function) comes from fulmen's own code
    rather than the user's."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code in _USER_ENTRIES:
            return False
        filename = code.co_filename
        if not is_library_file(filename) or filename.startswith(_FULMEN_DIR):
            return filename.startswith(_INTERNAL)
        frame = frame.f_back
    return False


@user_entry
def run_user_code(fn: Callable, *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` for fulmen code that calls the code a trace records (a jitted module's forward)."""
    return fn(*args, **kwargs)
