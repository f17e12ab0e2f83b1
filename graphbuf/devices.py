"""Device names: which ones graphbuf knows, and whether this machine has them.

One rule for every object that takes a device (``StaticBuffers``, ``Graph``): a name other than ``cpu``,
``cuda[:N]`` or ``npu[:N]`` is :class:`UnknownDeviceError`; a device or index this machine lacks is
:class:`DeviceUnavailableError`. ``torch_npu`` is imported only for an ``npu`` name, and every way its import
fails on a machine without Ascend CANN (ImportError, OSError, RuntimeError) is caught.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from graphbuf.errors import DeviceUnavailableError, UnknownDeviceError

__all__ = ["DEVICE_TYPES", "resolve_device"]

DEVICE_TYPES = ("cpu", "cuda", "npu")
_ALLOWED = "cpu, cuda[:N], npu[:N]"


def _parse(device: Any, who: str) -> tuple[str, int | None]:
    if isinstance(device, torch.device):
        return device.type, device.index
    if isinstance(device, str):
        kind, sep, idx = device.strip().partition(":")
        if kind in DEVICE_TYPES and (not sep or idx.isdigit()):
            return kind, int(idx) if sep else None
    raise UnknownDeviceError(f"{who}: unknown device {device!r}; allowed: {_ALLOWED}")


def resolve_device(device: Any, who: str) -> torch.device:
    """``device`` as a ``torch.device`` this machine has, with its index (``"cuda"``: the current device, so
    that it compares equal to the device of the tensors made on it); ``who`` (e.g. ``"Graph('npu:1')"``)
    starts every error message."""
    kind, index = _parse(device, who)
    if kind not in DEVICE_TYPES:
        raise UnknownDeviceError(f"{who}: unknown device {device!r}; allowed: {_ALLOWED}")
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "npu":  # torch knows the name "npu" only once torch_npu is imported
        try:
            importlib.import_module("torch_npu")
        except (ImportError, OSError, RuntimeError) as exc:
            raise DeviceUnavailableError(
                f"{who} needs torch_npu and an Ascend NPU; importing torch_npu failed: {exc!r}"
            ) from None
    mod = getattr(torch, kind, None)
    count = mod.device_count() if mod is not None and mod.is_available() else 0
    if count == 0 or (index is not None and index >= count):
        raise DeviceUnavailableError(f"{who}: this machine has {count} {kind.upper()} device(s)")
    return torch.device(kind, index if index is not None else mod.current_device())
