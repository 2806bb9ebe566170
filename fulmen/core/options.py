"""The options of one ``fulmen.jit``: one validated object, handed to every part of the compilation that reads one.

``fulmen.jit(fn, dynamic=False, warm_start=False)`` and ``fulmen.jit(fn, options=JitOptions(dynamic=False))``
build the same object; the jitted function keeps it as ``jfn.options``. An option left unset takes its default
from the environment variable in the table, read when the options are built, so a test run or a deployment can
change a default without editing code (``FULMEN_CHECK_TRACES=1 pytest``):

- ``compile`` (``FULMEN_COMPILE``: async/sync/off): how fused regions compile (``fulmen.executors.inductor_compile``);
- ``check_traces`` (``FULMEN_CHECK_TRACES``, 0/1): run ``check_trace`` after every pipeline step;
- ``replay`` (``FULMEN_REPLAY``, 0/1): copy decompositions recorded earlier while tracing (``fulmen.frontend.replay``);
- ``warm_start`` (``FULMEN_WARM_START``, 0/1): a training program's first call runs on PyTorch autograd
  (``fulmen.frontend.warm_start``);
- ``raise_on_dynamic_failure`` (``FULMEN_RAISE_ON_DYNAMIC_FAILURE``, 0/1): raise when compiling with dynamic sizes
  fails, instead of compiling for the exact sizes;
- ``overlap_communication`` (``FULMEN_OVERLAP_COMMUNICATION``, 0/1): start each collective early and wait for it
  late (``fulmen.transforms.overlap``); off, collectives stay where the program made them.

The background compiler's pacing (``QUIET_SECONDS`` in ``fulmen.executors.inductor_compile``) is shared by every
jitted function of the process, so it is not a per-function option; ``FULMEN_COMPILE_QUIET_SECONDS`` sets it. Its
one worker thread is not an option: Inductor's compilation is not written for two threads at once.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from fulmen.core.steps import check_steps

COMPILE_MODES = ("async", "sync", "off")


def env_flag(name: str, default: bool) -> bool:
    """The boolean environment variable ``name`` ("1"/"true"/"yes" or "0"/"false"/"no"), ``default`` when unset."""
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {name}={text!r} is not a boolean; use 1 or 0")


def env_seconds(name: str, default: float) -> float:
    """The non-negative number of seconds in environment variable ``name``, ``default`` when unset."""
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"environment variable {name}={text!r} is not a number of seconds (>= 0)")
    return value


def _flag(name: str, default: bool):
    return field(default_factory=lambda: env_flag(name, default))


@dataclass(frozen=True)
class JitOptions:
    """What ``fulmen.jit`` was asked for; validated when built (a ``TypeError``/``ValueError`` naming the option)."""

    #: keep exactly the executors given (False: the seeds' ``fulmen.compile`` form)
    add_torch_executor: bool = True
    #: compile for inference even where inputs require grad
    disable_torch_autograd: bool = False
    #: None: a dimension seen with a second size becomes symbolic; True: every dimension from the first call;
    #: False: exact sizes, one compilation per shape
    dynamic: bool | None = None
    #: how fused regions compile; None: the ambient mode (``FULMEN_COMPILE``, default "async")
    compile: str | None = None
    #: replay each compiled program on a CUDA device as CUDA graphs (``fulmen.frontend.cudagraphs``)
    cuda_graphs: bool = False
    #: extra pipeline steps (``fulmen.Step``), run after the executors' own
    steps: tuple = ()
    check_traces: bool = _flag("FULMEN_CHECK_TRACES", False)
    replay: bool = _flag("FULMEN_REPLAY", True)
    warm_start: bool = _flag("FULMEN_WARM_START", True)
    raise_on_dynamic_failure: bool = _flag("FULMEN_RAISE_ON_DYNAMIC_FAILURE", False)
    overlap_communication: bool = _flag("FULMEN_OVERLAP_COMMUNICATION", True)

    def __post_init__(self):
        for name in (
            "add_torch_executor",
            "disable_torch_autograd",
            "cuda_graphs",
            "check_traces",
            "replay",
            "warm_start",
            "raise_on_dynamic_failure",
            "overlap_communication",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"fulmen.jit: {name}= must be True or False, got {value!r}")
        if self.dynamic not in (None, True, False):
            raise TypeError(f"fulmen.jit: dynamic= must be None (automatic), True or False, got {self.dynamic!r}")
        if self.compile not in (None, *COMPILE_MODES):
            raise ValueError(
                f"fulmen.jit: compile= must be one of {', '.join(map(repr, COMPILE_MODES))} (or None for "
                f"the default, FULMEN_COMPILE or 'async'), got {self.compile!r}"
            )
        object.__setattr__(self, "steps", check_steps(self.steps, "fulmen.jit"))

    @classmethod
    def build(cls, options: JitOptions | None = None, **kwargs: Any) -> JitOptions:
        """``options`` (or the defaults) with ``kwargs`` replacing fields; an unknown keyword is a TypeError that
        lists the accepted ones."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(k for k in kwargs if k not in names)
        if unknown:
            raise TypeError(
                f"fulmen.jit got unexpected keyword argument(s) {unknown}; it accepts executors=, "
                f"options= and {', '.join(n + '=' for n in names)}"
            )
        if options is None:
            return cls(**kwargs)
        if not isinstance(options, JitOptions):
            raise TypeError(f"fulmen.jit: options= must be a fulmen.JitOptions, got {type(options).__name__}")
        return dataclasses.replace(options, **kwargs) if kwargs else options
