"""Every error graphbuf raises. Messages say what was wrong, where, and what is allowed."""

from __future__ import annotations

__all__ = [
    "AddressChangedError",
    "ArgumentError",
    "BatchFileError",
    "CaptureError",
    "ConcurrentUseError",
    "DeviceUnavailableError",
    "GraphbufError",
    "LivenessError",
    "PlanTooLargeError",
    "RefreshError",
    "ReplayError",
    "RowsError",
    "SpecError",
    "TaskError",
    "UnknownDeviceError",
    "UsageError",
    "WidthError",
]


class GraphbufError(Exception):
    """Base class of all graphbuf errors."""


class SpecError(GraphbufError, ValueError):
    """An invalid spec: the message names the file, the field path and what is allowed."""


class UsageError(GraphbufError, ValueError):
    """A command or call used wrongly, not a spec problem: an argument out of range, a missing file or
    optional dependency, an unusable input file (the CLI prints ``graphbuf: usage error: ...``, exit 2)."""


class BatchFileError(UsageError):
    """A saved drill batch (``graphbuf drill --replay FILE``) that cannot be replayed: missing, malformed,
    out of bounds, or with overrides the spec refuses; the message names the file and the field."""


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


class ReplayError(GraphbufError, RuntimeError):
    """An op of a graph failed at replay on the cpu emulator (which runs the recorded ops for real; a device
    would fault or assert there): the message names the op, and the size when a runner replayed it."""


class AddressChangedError(GraphbufError, RuntimeError):
    """A captured buffer no longer lives at the address the graph baked in."""


class DeviceUnavailableError(GraphbufError, RuntimeError):
    """The requested device (cuda, npu) or its runtime (torch_npu) is not available here."""


class UnknownDeviceError(GraphbufError, ValueError):
    """A device name that is neither ``cpu``, ``cuda[:N]`` nor ``npu[:N]``."""


class LivenessError(GraphbufError, RuntimeError):
    """A tensor a captured graph reads or writes was freed; replaying would read released memory."""


class ConcurrentUseError(GraphbufError, RuntimeError):
    """Two threads used one object that serves one caller at a time (``StaticBuffers``, ``BoundSources``,
    ``GraphRunner``); use one per thread or serialize the calls."""


class TaskError(CaptureError, ValueError):
    """A task kind that does not exist, or host task arguments a captured task does not take (unknown
    names, a changed form, a non-host value); raised before anything is written or re-issued."""


class ArgumentError(GraphbufError, TypeError):
    """A public call got an argument of a type it does not take; the message names it and what is allowed."""
