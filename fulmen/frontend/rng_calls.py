"""Calls that set torch's default generator, made by the traced code, run on every call as in eager.

``torch.manual_seed``, ``torch.get_rng_state`` and ``torch.set_rng_state`` take no tensor to dispatch on (and
``manual_seed`` is plain Python), so neither a proxy nor fulmen's torch-function mode sees them: run while
tracing, they would act once, and a cache hit would draw from wherever the generator happens to be. While a thread
traces, the module attributes are wrapped so that the tracing thread's user-level calls record
``prims.manual_seed`` / ``get_rng_state`` / ``set_rng_state`` (other threads, and code running inside a symbol,
reach PyTorch's functions). ``torch.testing``'s ``freeze_rng_state`` and op_db's ``wrapper_set_seed`` are made of
these calls.

Any other change of the CPU generator's state while tracing (``torch.seed()``, ``default_generator.manual_seed``,
a draw into a real tensor) is made once, not on each call: fulmen warns, naming it. (A warning, not an error: another
thread drawing random numbers while this one traces changes the state too, and is no fault of the traced code.)
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.random

from fulmen import prims
from fulmen.core.proxies import _user_location
from fulmen.core.shared_patch import SharedPatch
from fulmen.core.trace import get_tracectx
from fulmen.core.tracer import get_tracer

_ORIGINALS = {name: getattr(torch.random, name) for name in ("manual_seed", "get_rng_state", "set_rng_state")}
#: What each module held while no thread traced, put back by the last trace to end (``torch.manual_seed`` need
#: not be ``torch.random.manual_seed``: importing ``torch._dynamo`` wraps the former).
_saved: dict[tuple[object, str], object] = {}


def _wrap(name: str, record):
    original = _ORIGINALS[name]

    def wrapper(*args, **kwargs):
        if _recording.here and (trc := get_tracectx()) is not None and len(trc.scopes) == 1:
            return record(*args, **kwargs)
        return original(*args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = original.__doc__
    return wrapper


def _manual_seed(seed):
    prims.manual_seed(int(seed))
    return torch.random.default_generator  # what torch.manual_seed returns


def _set_rng_state(new_state):
    prims.set_rng_state(get_tracer().capture(new_state))


_WRAPPERS = {"manual_seed": _wrap("manual_seed", _manual_seed),
             "get_rng_state": _wrap("get_rng_state", lambda: prims.get_rng_state()),
             "set_rng_state": _wrap("set_rng_state", _set_rng_state)}


def _install() -> None:
    for name, wrapper in _WRAPPERS.items():
        for owner in (torch.random, torch):
            _saved[(owner, name)] = getattr(owner, name)
            setattr(owner, name, wrapper)


def _uninstall() -> None:
    for (owner, name), original in _saved.items():
        if getattr(owner, name) is _WRAPPERS[name]:  # else replaced meanwhile: theirs calls ours
            setattr(owner, name, original)
    _saved.clear()


_recording = SharedPatch(_install, _uninstall)


@contextlib.contextmanager
def recording_rng_calls():
    """Record the tracing thread's calls that set the default generator; fail if its state changed otherwise."""
    with _recording.in_this_thread():
        before = _ORIGINALS["get_rng_state"]()
        yield
    if not torch.equal(before, _ORIGINALS["get_rng_state"]()):
        warnings.warn(
            "fulmen.jit: torch's default random generator changed while the function was traced, in a way fulmen "
            "does not record (torch.seed(), torch.default_generator.manual_seed/set_state, random numbers drawn "
            "into a real tensor, or another thread drawing): later calls will not repeat it, so their random numbers "
            "may differ from eager's. Use torch.manual_seed or torch.set_rng_state inside the function (fulmen "
            f"records those), or seed outside it.\n  at {_user_location()}", stacklevel=2)
