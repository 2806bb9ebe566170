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


class Device(str):
    """An immutable device: ``Device("cuda")`` is ``"cuda:0"``, with ``devicetype``, ``type`` and ``index``.

    It is a ``str`` so that user code passing ``tensor.device`` to a torch factory while tracing
    (``torch.arange(n, device=x.device)``) works: torch accepts device strings everywhere.
    """

    def __new__(cls, spec: str | torch.device | Device = "cpu", index: int | None = None):
        if isinstance(spec, Device) and index is None:
            return spec
        tdev = torch.device(str(spec)) if index is None else torch.device(str(spec), index)
        if tdev.type not in _BY_STRING:
            raise ValueError(f"Unsupported device type {tdev.type!r}; fulmen supports {sorted(_BY_STRING)}")
        devicetype = _BY_STRING[tdev.type]
        index = tdev.index
        if devicetype is DeviceType.CUDA and index is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        text = devicetype.value if devicetype in (DeviceType.CPU, DeviceType.META) else f"{devicetype.value}:{index}"
        obj = super().__new__(cls, text)
        obj.__dict__.update(devicetype=devicetype, index=index, _torch=torch.device(text))
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
            return self._torch == other
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

    __hash__ = str.__hash__


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
