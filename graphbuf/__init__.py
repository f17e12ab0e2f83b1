"""graphbuf: declarative, address-stable capture/replay buffers for CUDA and Ascend NPU graphs.

The data path, top-down: spec (:mod:`graphbuf.spec`) → plan (:mod:`graphbuf.plan`) → buffers
(:mod:`graphbuf.buffers`) → refresh (:mod:`graphbuf.refresh`) → graph (:mod:`graphbuf.graph`) → runner
(:mod:`graphbuf.runner`).
"""

from graphbuf.buffers import StaticBuffers
from graphbuf.errors import (
    AddressChangedError,
    CaptureError,
    DeviceUnavailableError,
    GraphbufError,
    PlanTooLargeError,
    RefreshError,
    RowsError,
    SpecError,
    WidthError,
)
from graphbuf.plan import BufferPlan, Plan, plan
from graphbuf.spec import GraphSpec, load_spec

__version__ = "0.1.0"

__all__ = [
    "AddressChangedError",
    "BufferPlan",
    "CaptureError",
    "DeviceUnavailableError",
    "GraphSpec",
    "GraphbufError",
    "Plan",
    "PlanTooLargeError",
    "RefreshError",
    "RowsError",
    "SpecError",
    "StaticBuffers",
    "WidthError",
    "load_spec",
    "plan",
]
