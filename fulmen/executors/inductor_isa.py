"""Inductor's vector-instruction probes, remembered across processes.

Before its first CPU compilation in a process, Inductor decides which vector instructions its C++ kernels may use:
for each candidate (AVX-512 with bfloat16, with VNNI, ...) it builds a small probe library (kept in its cache
directory, so built once) and then loads it in a child Python process (``VecISA._probe_load``), once per
process: a Python start-up for each probe, about a second in all with a warm cache. Inside
``remembered_probe_loads()`` a probe library that loaded before, unchanged since (same path, size and
modification time; its path holds a digest of its code, flags and compiler), counts as loading again without the
child process. Whether the CPU has the instructions is still asked every time (Inductor checks that before it
probes); a probe that failed is never remembered. A wrong memory could only make a later build or load of a
region's kernels fail, which keeps the region on the torch executor (logged).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

log = logging.getLogger("fulmen.inductor")

_FILE = "fulmen_isa_probes.json"


def _memory_path() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), _FILE)


def _signature(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            known = json.load(f)
        return known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: str, known: dict) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(known, f)
        os.replace(tmp, path)
    except OSError as e:  # the next process probes again
        log.info("fulmen: could not remember Inductor's vector-instruction probes (%s)", e)


@contextlib.contextmanager
def remembered_probe_loads():
    """Inside the block, Inductor's probe libraries that loaded in an earlier process count as loading (see the
    module's doc). Scoped to the block, in which fulmen settles Inductor's choice of vector instructions."""
    try:
        from torch._inductor.cpu_vec_isa import VecISA
    except ImportError:
        yield
        return
    original = getattr(VecISA, "_probe_load", None)
    if original is None:  # another torch: its probes run as they are
        yield
        return
    memory = _memory_path()
    known = _read(memory)

    def probe_load(self, output_path: str) -> bool:
        signature = _signature(output_path)
        if signature is not None and known.get(output_path) == signature:
            return True
        loaded = original(self, output_path)
        if loaded and signature is not None:
            known[output_path] = signature
            _write(memory, known)
        return loaded

    VecISA._probe_load = probe_load
    try:
        yield
    finally:
        VecISA._probe_load = original
