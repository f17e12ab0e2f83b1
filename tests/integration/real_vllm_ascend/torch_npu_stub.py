"""graphbuf's own stand-in for ``torch_npu`` so that vllm-ascend's Python package imports on a CPU machine.

Nothing here computes on an NPU. The stub provides:

* a ``torch_npu`` module whose every ``npu_*`` / ``_npu_*`` attribute is a :class:`RecordedOp`: calling it
  (or its ``.out`` form) appends ``(name, args, kwargs)`` to :data:`CALLS` and returns None, so a test can
  see which kernel upstream's path launched and with which host arguments;
* any ``torch_npu.<submodule>`` (``npu``, ``_inductor``, ``profiler``, ``op_plugin.atb._atb_ops``, ...) as
  an empty module that answers every attribute lookup, created on import;
* ``torch.npu``: streams and events that do nothing, ``ExternalEvent``, the graph task-group and
  task-update calls (recorded in :data:`CALLS`, task-group handles are increasing ints), device queries
  that report one device;
* ``torch.Tensor.pin_memory`` replaced by identity (pinning needs an accelerator runtime on CPU torch).

:func:`install` puts all of it in place; it is idempotent. It must run before anything imports vllm_ascend.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import itertools
import sys
import types
from typing import Any

import torch

__all__ = ["CALLS", "RESULTS", "RecordedOp", "install"]

CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
"""Every recorded op and graph call since the last ``CALLS.clear()``."""

RESULTS: dict[str, Any] = {}
"""Op name -> callable ``(*args, **kwargs) -> result`` for ops whose caller uses the result (default None)."""

_handles = itertools.count(1)


class RecordedOp:
    """A ``torch_npu`` op that records its calls; ``op.out(...)`` records as ``<name>.out``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        CALLS.append((self.name, args, kwargs))
        result = RESULTS.get(self.name)
        return None if result is None else result(*args, **kwargs)

    def __getattr__(self, attr: str) -> RecordedOp:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return RecordedOp(f"{self.name}.{attr}")


class _Anything(types.ModuleType):
    """A module that answers every attribute: ops for ``npu_*`` names, empty classes otherwise."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr.startswith(("npu_", "_npu_")):
            value: Any = RecordedOp(attr)
        else:
            value = _AnyClass(attr, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, attr, value)
        return value


class _AnyClass(type):
    """Metaclass of placeholder classes: a class attribute that does not exist is another placeholder."""

    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr.startswith(("npu_", "_npu_")):
            return RecordedOp(attr)
        value = _AnyClass(attr, (), {"__init__": lambda self, *a, **k: None})
        setattr(cls, attr, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates any ``torch_npu.*`` submodule on import."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname == "torch_npu" or fullname.startswith("torch_npu."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _Anything(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == "torch_npu":
            module.__version__ = "2.10.0.post4"
            module.float = torch.float
        parent, _, child = module.__name__.rpartition(".")
        if parent and parent in sys.modules:
            setattr(sys.modules[parent], child, module)


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _Event()


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        CALLS.append(("Event.record", (), {}))

    def wait(self, stream: Any = None) -> None:
        CALLS.append(("Event.wait", (), {}))

    def reset(self, stream: Any = None) -> None:
        CALLS.append(("Event.reset", (), {}))

    def synchronize(self) -> None:
        pass


def _task_group_end(stream: Any = None) -> int:
    handle = next(_handles)
    CALLS.append(("graph_task_group_end", (handle,), {}))
    return handle


def _npu_namespace() -> types.ModuleType:
    npu = _Anything("torch.npu")
    npu.Stream = _Stream
    npu.Event = _Event
    npu.ExternalEvent = _Event
    npu.current_stream = lambda *a, **k: _Stream()
    npu.default_stream = lambda *a, **k: _Stream()
    npu.stream = lambda *a, **k: contextlib.nullcontext()
    npu.set_stream = lambda *a, **k: None
    npu.device = lambda *a, **k: contextlib.nullcontext()
    npu.current_device = lambda: 0
    npu.set_device = lambda *a, **k: None
    npu.device_count = lambda: 1
    npu.is_available = lambda: True
    npu.synchronize = lambda *a, **k: None
    npu.empty_cache = lambda: None
    npu.is_current_stream_capturing = lambda: False
    npu.mem_get_info = lambda *a, **k: (64 << 30, 64 << 30)
    npu.graph_task_group_begin = lambda stream=None: CALLS.append(("graph_task_group_begin", (), {}))
    npu.graph_task_group_end = _task_group_end
    npu.graph_task_update_begin = lambda stream, handle: CALLS.append(
        ("graph_task_update_begin", (handle,), {})
    )
    npu.graph_task_update_end = lambda stream=None: CALLS.append(("graph_task_update_end", (), {}))
    return npu


def install() -> None:
    """Make ``import torch_npu`` and ``torch.npu`` work on CPU (see the module docstring). Idempotent."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    if not isinstance(getattr(torch, "npu", None), _Anything):
        torch.npu = _npu_namespace()
        sys.modules["torch.npu"] = torch.npu
    torch.Tensor.pin_memory = lambda self, *a, **k: self
