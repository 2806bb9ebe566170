"""Devices as fulmen carries them: canonical ``torch.device`` objects, and ``Device``, the executor authors' view.

Everything fulmen holds (a proxy's ``device``, a creation op's ``device=`` argument, a cache key) is a real
``torch.device``, so user code traced by fulmen sees exactly eager's type and value (``isinstance(d, torch.device)``,
``d == torch.device("cpu")``, a dict keyed by devices, pickling, C++ APIs). ``to_device`` makes the canonical one: a
CUDA device always has its index (a tensor's device always has one), and each device is one shared object.

``Device`` (a ``str`` with ``devicetype``, ``type`` and ``index``) is the form the extension API of Thunder's seeds
reads: an executor's checker sees ``a.device.devicetype == DeviceType.CPU`` (``fulmen.core.proxies.device_view``).
"""

from __future__ import annotations

from enum import Enum

import torch


class DeviceType(Enum):
    CPU = "cpu"
    CUDA = "cuda"
    META = "meta"
    MPS = "mps"
    XPU = "xpu"


_BY_STRING = {d.value: d for d in DeviceType}

#: str / torch.device / int / Device -> the canonical torch.device (a str and a torch.device never compare equal)
_canonical: dict = {}


def to_device(x: str | int | torch.device | Device | None) -> torch.device | None:
    """The canonical ``torch.device`` for a device spec (``"cuda"`` is ``cuda:<current>``), or None for None."""
    if x is None:
        return None
    try:
        return _canonical[x]
    except KeyError:
        pass
    except TypeError:  # unhashable: torch.device raises its own error below
        pass
    tdev = torch.device(x) if not isinstance(x, Device) else x.torch_device
    if tdev.type not in _BY_STRING:
        raise ValueError(f"Unsupported device type {tdev.type!r}; fulmen supports {sorted(_BY_STRING)}")
    if tdev.index is None and tdev.type == "cuda":
        # the current device can change between calls: an index-less spec is resolved each time, never cached
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    if tdev.index is not None and tdev.type in ("cpu", "meta"):
        tdev = torch.device(tdev.type)  # as a tensor's device: torch.empty(2, device="cpu:0").device is cpu
    return _canonical.setdefault(x, _canonical.setdefault(tdev, tdev))


#: kept for the call sites that say what they need: the same canonical torch.device
to_torch_device = to_device


def devicetype(x: str | torch.device | Device) -> DeviceType:
    """The ``DeviceType`` of a device."""
    return _BY_STRING[to_device(x).type]


class Device(str):
    """An immutable device: ``Device("cuda")`` is ``"cuda:0"``, with ``devicetype``, ``type`` and ``index``.

    Thunder's extension API reads it (``a.device.devicetype`` in an executor's checker). It is a ``str`` and
    compares equal to the ``torch.device`` it names; fulmen itself carries ``torch.device`` (``to_device``).
    """

    def __new__(cls, spec: str | torch.device | Device = "cpu", index: int | None = None):
        if isinstance(spec, Device) and index is None:
            return spec
        tdev = to_device(spec if index is None else torch.device(str(spec), index))
        obj = super().__new__(cls, str(tdev))
        obj.__dict__.update(devicetype=_BY_STRING[tdev.type], index=tdev.index, torch_device=tdev)
        return obj

    def __setattr__(self, name, value):
        raise AttributeError("Device is immutable")

    @property
    def type(self) -> str:
        return self.devicetype.value

    def __str__(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return f'devices.Device("{str.__str__(self)}")'

    def __eq__(self, other) -> bool:
        if isinstance(other, torch.device):
            return self.torch_device == other
        if isinstance(other, str):
            if str.__eq__(self, other):
                return True
            try:
                return str.__eq__(self, str(to_device(other)))
            except (RuntimeError, ValueError):
                return False
        return NotImplemented

    def __ne__(self, other) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __reduce__(self):
        return (Device, (str.__str__(self),))

    __hash__ = str.__hash__


_views: dict = {}


def device_view(d: torch.device) -> Device:
    """The ``Device`` naming the canonical device ``d`` (one shared object per device)."""
    view = _views.get(d)
    if view is None:
        view = _views[d] = Device(d)
    return view


cpu = to_device("cpu")
