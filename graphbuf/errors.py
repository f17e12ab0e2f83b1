"""Every error graphbuf raises. Messages say what was wrong, where, and what is allowed."""

from __future__ import annotations

__all__ = [
    "AddressChangedError",
    "CaptureError",
    "DeviceUnavailableError",
    "GraphbufError",
    "PlanTooLargeError",
    "RefreshError",
    "RowsError",
    "SpecError",
    "WidthError",
]


class GraphbufError(Exception):
    """Base class of all graphbuf errors."""


class SpecError(GraphbufError, ValueError):
    """An invalid spec: the message names the file, the field path and what is allowed."""


class PlanTooLargeError(SpecError):
    """The planned slab would exceed the byte limit; raised before anything is allocated."""


class RefreshError(GraphbufError, ValueError):
    """A refresh source was rejected; no byte of any buffer was changed."""


class RowsError(RefreshError):
    """A source has more live rows than the capture size holds."""


class WidthError(RefreshError):
    """A source is wider than the buffer's allocation and the buffer says ``overflow: reject``."""


class CaptureError(GraphbufError, RuntimeError):
    """Something inside graph capture that a device graph cannot record (host read-back, dynamic shape)."""


class AddressChangedError(GraphbufError, RuntimeError):
    """A captured buffer no longer lives at the address the graph baked in."""


class DeviceUnavailableError(GraphbufError, RuntimeError):
    """The requested device (cuda, npu) or its runtime (torch_npu) is not available here."""
