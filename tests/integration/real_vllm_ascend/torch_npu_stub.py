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
* ``torch.Tensor.pin_memory`` replaced by identity (pinning needs an accelerator runtime on CPU torch);
* ``torch.npu.NPUGraph`` and ``torch.npu.graph``: a graph records nothing and its ``replay`` computes
  nothing (what a replay computes on CPU is the test's to emulate), but it keeps ExternalEvent semantics:
  every ``ExternalEvent`` waited on while the graph captures is a wait the replay performs. A replay consumes
  one record of each such event (made before it, as the legacy ``update_graph_params`` does, or after it, as
  ``UpdatableGraph.update`` does); a wait left unmatched by the next synchronization point (a stream or
  device ``synchronize``, or the graph's next replay) is where a device blocks forever, so it raises
  :class:`DeviceHang` naming the graph and how many waits were never released;
* ``torch_npu._C._weak_ref_tensor``: identity (a CPU tensor cannot be referenced without owning it).

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

__all__ = ["CALLS", "RESULTS", "DeviceHang", "NPUGraph", "RecordedOp", "forget_graphs", "install"]

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
            native = _Anything("torch_npu._C")
            native.__path__ = []
            native._weak_ref_tensor = lambda tensor: tensor
            module._C = sys.modules["torch_npu._C"] = native
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
        _synchronize()

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _Event()


class DeviceHang(RuntimeError):
    """A replayed graph waits on an ExternalEvent nobody recorded: on a device the stream blocks forever."""


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.records = 0  # records not yet consumed by a replay's wait
        self.blocked = 0  # replay waits not yet released by a record

    def record(self, stream: Any = None) -> None:
        CALLS.append(("Event.record", (), {}))
        if self.blocked:
            self.blocked -= 1
        else:
            self.records += 1

    def wait(self, stream: Any = None) -> None:
        CALLS.append(("Event.wait", (), {}))
        if _capturing:
            _capturing[-1].waits.append(self)

    def reset(self, stream: Any = None) -> None:
        CALLS.append(("Event.reset", (), {}))

    def synchronize(self) -> None:
        pass


_capturing: list[NPUGraph] = []
_replayed: list[NPUGraph] = []


class NPUGraph:
    """``torch.npu.NPUGraph`` on CPU: capture and replay compute nothing; ExternalEvent waits are kept (see
    the module docstring). ``replays`` counts replays."""

    def __init__(self) -> None:
        self.waits: list[_Event] = []
        self.replays = 0

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        CALLS.append(("NPUGraph.capture_begin", (), {}))
        _capturing.append(self)

    def capture_end(self) -> None:
        CALLS.append(("NPUGraph.capture_end", (), {}))
        _capturing.remove(self)

    def replay(self) -> None:
        CALLS.append(("NPUGraph.replay", (), {}))
        self.check_released()
        for event in self.waits:
            if event.records:
                event.records -= 1
            else:
                event.blocked += 1
        self.replays += 1
        if self not in _replayed:
            _replayed.append(self)

    def check_released(self) -> None:
        """DeviceHang if a wait of this graph's last replay was never released by a record."""
        stuck = sum(e.blocked for e in self.waits)
        if stuck:
            raise DeviceHang(
                f"replay {self.replays} of a graph waits on {stuck} of its {len(self.waits)} captured "
                "ExternalEvent(s) that nothing recorded: on a device this stream blocks forever (the task "
                "update that records them did not run for this replay)"
            )

    def reset(self) -> None:
        self.waits.clear()

    def pool(self) -> tuple[int, int]:
        return (0, id(self))


class _GraphContext:
    """``torch.npu.graph(npu_graph, pool=..., stream=...)``: capture_begin on entry, capture_end on exit."""

    def __init__(self, npu_graph: NPUGraph, pool: Any = None, stream: Any = None, **_: Any) -> None:
        self.graph = npu_graph

    def __enter__(self) -> NPUGraph:
        self.graph.capture_begin()
        return self.graph

    def __exit__(self, *exc: Any) -> None:
        self.graph.capture_end()


def forget_graphs() -> None:
    """Drop every graph's capture and replay state (between tests)."""
    _capturing.clear()
    _replayed.clear()


def _synchronize(*args: Any, **kwargs: Any) -> None:
    """A synchronization point: every replayed graph's waits must have been released by now."""
    for graph in _replayed:
        graph.check_released()


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
    npu.synchronize = _synchronize
    npu.NPUGraph = NPUGraph
    npu.graph = _GraphContext
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
