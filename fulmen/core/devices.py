"""Devices as traces see them: ``Device("cuda:0")`` with a ``devicetype`` and an ``index``."""

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


class Device:
    """An immutable, hashable device; ``str(Device("cuda"))`` is ``"cuda:0"`` as in trace comments."""

    __slots__ = ("devicetype", "index", "_str", "_torch")

    def __init__(self, spec: str | torch.device | Device = "cpu", index: int | None = None):
        if isinstance(spec, Device):
            devicetype, index = spec.devicetype, spec.index
        else:
            tdev = torch.device(spec) if index is None else torch.device(spec, index)
            if tdev.type not in _BY_STRING:
                raise ValueError(f"Unsupported device type {tdev.type!r}; fulmen supports {sorted(_BY_STRING)}")
            devicetype = _BY_STRING[tdev.type]
            index = tdev.index
            if devicetype is DeviceType.CUDA and index is None:
                index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        object.__setattr__(self, "devicetype", devicetype)
        object.__setattr__(self, "index", index)
        text = devicetype.value if devicetype in (DeviceType.CPU, DeviceType.META) else f"{devicetype.value}:{index}"
        object.__setattr__(self, "_str", text)
        object.__setattr__(self, "_torch", torch.device(text))

    def __setattr__(self, name, value):
        raise AttributeError("Device is immutable")

    @property
    def type(self) -> str:
        return self.devicetype.value

    def __str__(self) -> str:
        return self._str

    def __repr__(self) -> str:
        return f'devices.Device("{self._str}")'

    def __eq__(self, other) -> bool:
        if isinstance(other, Device):
            return self._str == other._str
        if isinstance(other, (str, torch.device)):
            try:
                return self._str == Device(other)._str
            except (RuntimeError, ValueError):
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._str)


cpu = Device("cpu")
_cache: dict = {}


def to_device(x: str | torch.device | Device | None) -> Device | None:
    if x is None or isinstance(x, Device):
        return x
    key = (type(x), str(x))
    dev = _cache.get(key)
    if dev is None:
        dev = _cache[key] = Device(x)
    return dev


def to_torch_device(x: str | torch.device | Device | None) -> torch.device | None:
    if x is None:
        return None
    if isinstance(x, Device):
        return x._torch
    return torch.device(x)
