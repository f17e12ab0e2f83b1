"""graphbuf: declarative, address-stable capture/replay buffers for CUDA and Ascend NPU graphs.

The data path, top-down: spec (:mod:`graphbuf.spec`) → plan (:mod:`graphbuf.planning`) → buffers
and their refresh (:mod:`graphbuf.buffers`)
→ graph (:mod:`graphbuf.graphs.graph`) → runner (:mod:`graphbuf.graphs.runner`).

Importing ``graphbuf`` itself imports only the standard library; each public name loads its module on first
use, so light entry points (the vLLM plugin) stay light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AddressChangedError": "graphbuf.errors",
    "ArgumentError": "graphbuf.errors",
    "BatchFileError": "graphbuf.errors",
    "TaskError": "graphbuf.errors",
    "CaptureError": "graphbuf.errors",
    "ConcurrentUseError": "graphbuf.errors",
    "LivenessError": "graphbuf.errors",
    "UnknownDeviceError": "graphbuf.errors",
    "DeviceUnavailableError": "graphbuf.errors",
    "GraphbufError": "graphbuf.errors",
    "PlanTooLargeError": "graphbuf.errors",
    "RefreshError": "graphbuf.errors",
    "ReplayError": "graphbuf.errors",
    "RowsError": "graphbuf.errors",
    "SpecError": "graphbuf.errors",
    "UsageError": "graphbuf.errors",
    "WidthError": "graphbuf.errors",
    "GraphSpec": "graphbuf.spec.models",
    "load_spec": "graphbuf.spec.models",
    "BufferPlan": "graphbuf.planning.planner",
    "Plan": "graphbuf.planning.planner",
    "plan": "graphbuf.planning.planner",
    "StaticBuffers": "graphbuf.buffers.slab",
    "BoundSources": "graphbuf.buffers",
    "Graph": "graphbuf.graphs.graph",
    "CapturedTask": "graphbuf.graphs.tasks",
    "TaskKind": "graphbuf.graphs.tasks",
    "GraphRunner": "graphbuf.graphs.runner",
    "RunnerStats": "graphbuf.graphs.runner",
    "Durations": "graphbuf.graphs.runner",
    "EAGER_CAPTURE_FAILED": "graphbuf.graphs.runner",
    "EAGER_REFUSED": "graphbuf.graphs.runner",
    "EAGER_TOO_LARGE": "graphbuf.graphs.runner",
    "RefreshStats": "graphbuf.buffers",
    "Step": "graphbuf.graphs.runner",
}

__all__ = [
    "EAGER_CAPTURE_FAILED",
    "EAGER_REFUSED",
    "EAGER_TOO_LARGE",
    "AddressChangedError",
    "ArgumentError",
    "BatchFileError",
    "BoundSources",
    "BufferPlan",
    "CaptureError",
    "CapturedTask",
    "ConcurrentUseError",
    "DeviceUnavailableError",
    "Durations",
    "Graph",
    "GraphRunner",
    "GraphSpec",
    "GraphbufError",
    "LivenessError",
    "Plan",
    "PlanTooLargeError",
    "RefreshError",
    "RefreshStats",
    "ReplayError",
    "RowsError",
    "RunnerStats",
    "SpecError",
    "StaticBuffers",
    "Step",
    "TaskError",
    "TaskKind",
    "UnknownDeviceError",
    "UsageError",
    "WidthError",
    "load_spec",
    "plan",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'graphbuf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from graphbuf.buffers import BoundSources, RefreshStats
    from graphbuf.buffers.slab import StaticBuffers
    from graphbuf.errors import (
        AddressChangedError,
        ArgumentError,
        BatchFileError,
        CaptureError,
        ConcurrentUseError,
        DeviceUnavailableError,
        GraphbufError,
        LivenessError,
        PlanTooLargeError,
        RefreshError,
        ReplayError,
        RowsError,
        SpecError,
        TaskError,
        UnknownDeviceError,
        UsageError,
        WidthError,
    )
    from graphbuf.graphs.graph import Graph
    from graphbuf.graphs.runner import (
        EAGER_CAPTURE_FAILED,
        EAGER_REFUSED,
        EAGER_TOO_LARGE,
        Durations,
        GraphRunner,
        RunnerStats,
        Step,
    )
    from graphbuf.graphs.tasks import CapturedTask, TaskKind
    from graphbuf.planning.planner import BufferPlan, Plan, plan
    from graphbuf.spec.models import GraphSpec, load_spec
