"""A change to another library (PyTorch, sympy) that is in place only while some thread needs it.

``SharedPatch(install, uninstall)`` is a context manager: the first thread to enter calls ``install()``, the last to
leave calls ``uninstall()``; nested and concurrent entries share one installation. Threads that are not inside see
the change too while it is in place, so what is installed must act only for the threads that asked for it (a
wrapper that checks a thread-local and otherwise calls the original) or be harmless to the others. This is how
fulmen keeps ``import fulmen`` and a finished call from changing anything in torch (tests/test_torch_untouched.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class SharedPatch:
    """``with patch:`` keeps the change in place (see the module docstring); ``patch.active`` says whether it is.
    ``with patch.in_this_thread():`` also marks the calling thread as one the change is for (``patch.here``)."""

    def __init__(self, install: Callable[[], None], uninstall: Callable[[], None]):
        self._install = install
        self._uninstall = uninstall
        self._lock = threading.Lock()
        self._users = 0
        self._threads = threading.local()  # .depth: how many in_this_thread() blocks this thread is inside

    @property
    def active(self) -> bool:
        return self._users > 0

    @property
    def here(self) -> bool:
        """Whether the calling thread is inside ``in_this_thread()``: what the installed wrappers act for."""
        return getattr(self._threads, "depth", 0) > 0

    @contextlib.contextmanager
    def in_this_thread(self) -> Iterator[None]:
        with self:
            self._threads.depth = getattr(self._threads, "depth", 0) + 1
            try:
                yield
            finally:
                self._threads.depth -= 1

    def __enter__(self) -> SharedPatch:
        with self._lock:
            if self._users == 0:
                self._install()
            self._users += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._uninstall()
