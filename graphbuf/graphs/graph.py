"""The public :class:`Graph`: capture once, replay many times, on cpu (emulator), cuda or npu.

``Graph("cuda")`` wraps ``torch.cuda.CUDAGraph`` (captured through ``torch.cuda.graph``); ``Graph("npu")``
wraps ``torch.npu.NPUGraph`` (torch_npu is imported lazily); ``Graph("cpu")`` is graphbuf's emulator
(:mod:`graphbuf.graphs.emulator`). On every device the capture runs under guards that raise
:class:`~graphbuf.errors.CaptureError` for host read-back and data-dependent output shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from typing import Any

import torch

from graphbuf.devices import resolve_device
from graphbuf.errors import CaptureError, GraphbufError, TaskError
from graphbuf.graphs.emulator import Emulator
from graphbuf.graphs.guards import capture_guards, poison
from graphbuf.graphs.tasks import (
    CapturedTask,
    NpuTaskState,
    TaskKind,
    freeze_host_args,
    npu_arm_events,
    npu_capture_task,
    npu_update_task,
    thaw_host_args,
)
from graphbuf.graphs.watch import Checked, Watch

__all__ = ["Graph"]


class _CpuPool:
    """Opaque memory-pool token of the cpu emulator (the emulator keeps its tensors itself)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<graphbuf cpu pool>"


class _CpuBackend:
    def __init__(self) -> None:
        self.emulator = Emulator()
        self.pool_token = _CpuPool()

    @property
    def captured(self) -> bool:
        return self.emulator.captured

    @contextmanager
    def capture(self, pool: object, stream: object, dry: bool = False) -> Iterator[None]:
        with self.emulator.capture(dry=dry):
            yield

    def replay(self, tasks: Sequence[CapturedTask], checked: Checked | None) -> None:
        self.emulator.replay(checked)  # it passes the live inputs to its replay function

    @property
    def watch(self) -> Watch:
        return self.emulator.watch

    def name_inputs(self, names: Mapping[str, torch.Tensor]) -> None:
        self.emulator.name_inputs(names)

    def pool(self) -> object:
        return self.pool_token

    def reset(self) -> None:
        self.emulator.reset()

    def capture_task(
        self, kind: TaskKind, fn: Callable[..., object], tensor_args: tuple[torch.Tensor, ...], host: dict
    ) -> object:
        group = self.emulator.begin_group(kind.value)
        try:
            fn(*tensor_args, **thaw_host_args(host))
        finally:
            self.emulator.end_group(group)
        return group

    def update_task(self, task: CapturedTask, host: Mapping[str, object]) -> None:
        kwargs = thaw_host_args(host)
        self.emulator.rerecord_group(task.handle, lambda: task.fn(*task.tensor_args, **kwargs))  # type: ignore[arg-type]

    def updating(self) -> AbstractContextManager[None]:
        return self.emulator.updating()


class _DeviceBackend:
    """cuda and npu: a torch device graph (CUDAGraph / NPUGraph) captured through ``<module>.graph``."""

    def __init__(self, kind: str, index: int | None) -> None:
        self.kind = kind
        self.index = index
        self.module: Any = torch.cuda if kind == "cuda" else torch.npu  # type: ignore[attr-defined]
        self.graph: Any = None
        self.pool_handle: object = None
        self.update_stream: Any = None
        self.captured_on: int | None = None
        self.watch = Watch()

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _new_graph(self) -> Any:
        return torch.cuda.CUDAGraph() if self.kind == "cuda" else self.module.NPUGraph()

    @contextmanager
    def capture(self, pool: object, stream: object, dry: bool = False) -> Iterator[None]:
        if pool is None:
            pool = self.pool_handle
        graph = self._new_graph()
        self.captured_on = self.module.current_device() if self.index is None else self.index
        with self.module.device(self.index) if self.index is not None else nullcontext():
            current = self.module.current_stream()
            ctx = self.module.graph(graph, pool=pool, stream=stream)
            ctx.__enter__()
            try:
                with capture_guards(strict_cpu=False) as guard:
                    yield
            except BaseException as exc:
                # Ending a broken capture may fail too; the user's error is the one to see.
                with suppress(Exception):
                    ctx.__exit__(type(exc), exc, exc.__traceback__)
                with suppress(Exception):
                    graph.reset()
                if self.module.current_stream() != current:  # the capture stream must not stay current
                    self.module.set_stream(current)
                raise
            ctx.__exit__(None, None, None)
            # Only memory the capture allocated: a view of a tensor from before capture that is still alive
            # (a task's argument, a reshaped cache) aliases the caller's data, which a device capture leaves
            # as it was.
            before = {t.untyped_storage().data_ptr() for t in guard.inputs}
            poison(
                t
                for ref in guard.produced
                if (t := ref()) is not None and t.untyped_storage().data_ptr() not in before
            )
        self.graph = graph
        self.watch = Watch(
            (f"capture input #{k} ({str(t.dtype).removeprefix('torch.')} {list(t.shape)})", t)
            for k, t in enumerate(guard.inputs)
        )

    def name_inputs(self, names: Mapping[str, torch.Tensor]) -> None:
        self.watch = self.watch.named(names)

    def replay(self, tasks: Sequence[CapturedTask], checked: Checked | None) -> None:
        if checked is None or checked.watch is not self.watch:
            self.watch.check("replay")
        if self.kind == "npu":
            states = [t.handle for t in tasks if isinstance(t.handle, NpuTaskState)]
            with self._on_device():
                if states:
                    npu_arm_events(states, self._update_stream())
                self.graph.replay()
            return
        self.graph.replay()

    def pool(self) -> object:
        if self.graph is not None:
            return self.graph.pool()
        if self.pool_handle is None:
            self.pool_handle = self.module.graph_pool_handle()
        return self.pool_handle

    def reset(self) -> None:
        if self.graph is not None:
            self.graph.reset()
            self.graph = None
        self.watch = Watch()

    def _on_device(self) -> Any:
        """Context making this graph's device current (streams and events must belong to it): ``npu:N``'s,
        or for a bare ``npu`` the device that was current at capture."""
        index = self.index if self.index is not None else self.captured_on
        return self.module.device(index) if index is not None else nullcontext()

    def _update_stream(self) -> Any:
        """The side stream task updates run on, created on this graph's device (the one its events are on)."""
        if self.update_stream is None:
            with self._on_device():
                self.update_stream = self.module.Stream()
        return self.update_stream

    def capture_task(
        self, kind: TaskKind, fn: Callable[..., object], tensor_args: tuple[torch.Tensor, ...], host: dict
    ) -> object:
        if self.kind == "npu":
            if not host:  # nothing to re-issue: ordinary captured kernels, no task group
                fn(*tensor_args)
                return None
            return npu_capture_task(fn, tensor_args, thaw_host_args(host))
        if host:
            raise CaptureError(
                f"task {kind.value!r}: host arguments {sorted(host)} cannot be captured on cuda: a CUDA "
                "graph cannot re-issue one captured task, so they would stay baked in while run() passes "
                "new ones. Pass per-replay values as device tensors among tensor_args (refreshed in place)."
            )
        fn(*tensor_args)
        return None

    def update_task(self, task: CapturedTask, host: Mapping[str, object]) -> None:
        if self.kind == "cuda":
            raise CaptureError(
                f"task {task.kind.value!r}: a CUDA graph cannot re-issue one captured task with new host "
                "arguments; its host values stay baked in. Pass values that change per replay as device "
                "tensors (refreshed in place before replay) or capture one graph per value."
            )
        if task.handle is None:  # captured without host arguments: nothing baked, nothing to re-issue
            return
        with self._on_device():
            npu_update_task(
                task.handle, task.fn, task.tensor_args, thaw_host_args(host), self._update_stream()
            )  # type: ignore[arg-type]

    def updating(self) -> AbstractContextManager[None]:
        return nullcontext()  # each task update goes to the device as it comes


def _shown(args: Mapping[str, Any], limit: int = 200) -> str:
    text = repr(dict(args))
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


class Graph:
    """A device graph: ``with g.capture(): ...`` records once, ``g.replay()`` re-runs the recording.

    Mirrors ``torch.cuda.CUDAGraph`` + ``torch.cuda.graph``. Invariants: ``captured`` is true only after a
    capture completed and until :meth:`reset`; a capture that raises leaves the graph un-captured and
    re-capturable, with no guard mode left installed and the stream that was current before capture current
    again, and the exception propagates. During capture, host read-back, host data and data-dependent shapes
    raise :class:`CaptureError`. Every tensor from before capture that the captured work uses (and every task
    tensor argument) is held weakly and checked before each replay: freed → :class:`LivenessError`,
    rebound / resized / restrided / re-typed → :class:`AddressChangedError`.

    Raises :class:`UnknownDeviceError` for a device name other than cpu, cuda[:N], npu[:N] and
    :class:`DeviceUnavailableError` for a device (or device index) this machine lacks.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        dev = resolve_device(device, f"Graph({str(device)!r})")
        kind, index = dev.type, dev.index
        self._kind = kind
        self._index = index
        self._backend: _CpuBackend | _DeviceBackend = (
            _CpuBackend() if kind == "cpu" else _DeviceBackend(kind, index)
        )
        self._tasks: list[CapturedTask] = []
        self._capturing = False

    @property
    def device(self) -> torch.device:
        """The device this graph records for."""
        return torch.device(self._kind, self._index) if self._index is not None else torch.device(self._kind)

    @property
    def captured(self) -> bool:
        """True once a capture has completed, until :meth:`reset`."""
        return self._backend.captured

    @property
    def capturing(self) -> bool:
        """True inside :meth:`capture`."""
        return self._capturing

    @property
    def emulator(self) -> Emulator | None:
        """The cpu emulator behind a ``Graph("cpu")``; None on cuda and npu."""
        return self._backend.emulator if isinstance(self._backend, _CpuBackend) else None

    @property
    def tasks(self) -> tuple[CapturedTask, ...]:
        """The tasks captured by :meth:`task` in the current capture, in capture order."""
        return tuple(self._tasks)

    def check_reissue(self, host_args: Mapping[str, Mapping[str, Any]]) -> None:
        """Everything :meth:`reissue` would reject, raised before anything is re-issued: per captured task
        whose kind has entries in ``host_args``, names it was not captured with, a value of another form, a
        non-host value (:class:`~graphbuf.errors.TaskError`)."""
        for task in self._tasks:
            fresh = host_args.get(str(task.kind))
            if fresh:
                task.check_update(**{**task.host_args, **fresh})

    def reissue(self, host_args: Mapping[str, Mapping[str, Any]]) -> int:
        """The per-step form of :meth:`update_tasks`: update every captured task whose kind has entries in
        ``host_args`` (``kind -> {name: value}``, possibly a subset of its names) that differ from the values
        it holds, merged over them; tasks of other kinds, or with nothing new, are not re-issued. Returns the
        number of tasks re-issued.

        All or nothing: a task whose own function rejects its new arguments raises
        :class:`~graphbuf.errors.TaskError` naming the task and the arguments, after the tasks re-issued
        before it got their previous arguments back."""
        held = self.held_args()
        count = 0
        with self._backend.updating():  # the cpu emulator compiles the updated recording once
            for i, task in enumerate(self._tasks):
                fresh = host_args.get(str(task.kind))
                if not fresh:
                    continue
                merged = {**task.host_args, **fresh}
                if merged == dict(task.host_args):
                    continue
                try:
                    task.update(**merged)
                except Exception as exc:
                    if count:
                        self.restore_args(held)
                    if isinstance(exc, GraphbufError):
                        raise
                    raise TaskError(
                        f"task {task.kind.value!r} #{i}: re-issue with host arguments {_shown(fresh)} failed "
                        f"in the task's own function: {type(exc).__name__}: {exc}. Nothing was re-issued; "
                        "pass host arguments that function takes."
                    ) from exc
                count += 1
        return count

    def held_args(self) -> tuple[Mapping[str, object], ...]:
        """The host arguments each captured task holds now, in capture order (for :meth:`restore_args`)."""
        return tuple(task.host_args for task in self._tasks)

    def restore_args(self, held: Sequence[Mapping[str, object]]) -> int:
        """Re-issue every task whose host arguments are no longer the ones in ``held`` (what
        :meth:`held_args` returned) with those; returns how many were re-issued."""
        count = 0
        with self._backend.updating():
            for task, args in zip(self._tasks, held, strict=True):
                if task.host_args is not args:
                    task.update(**thaw_host_args(args))
                    count += 1
        return count

    @contextmanager
    def capture(self, *, pool: object = None, stream: object = None, dry: bool = False) -> Iterator[Graph]:
        """Record the body. ``pool``: a handle from another graph's :meth:`pool` to share its memory pool;
        ``stream``: the capture stream (cuda/npu; both ignored on cpu). ``dry`` (cpu): record without
        computing, as a device captures (functional ops shaped by their meta kernels, writes to earlier
        tensors skipped); an op the uncomputed values make fail raises, and a capture without ``dry`` then
        computes. Raises :class:`CaptureError` if already captured (call :meth:`reset` first) or already
        capturing."""
        if self._capturing:
            raise CaptureError("capture() is already active on this graph")
        if self.captured:
            raise CaptureError("this graph already holds a capture; call reset() before capturing again")
        self._invalidate_tasks()
        self._capturing = True
        try:
            with self._backend.capture(pool, stream, dry):
                yield self
        except BaseException:
            self._invalidate_tasks()
            raise
        finally:
            self._capturing = False
        names = {
            f"task {task.kind.value!r} #{i} tensor_args[{j}]": t
            for i, task in enumerate(self._tasks)
            for j, t in enumerate(task.tensor_args)
        }
        if names:
            self._backend.name_inputs(names)

    @property
    def watched(self) -> tuple[str, ...]:
        """Labels of the tensors :meth:`check_inputs` and :meth:`replay` check, in check order."""
        return self._backend.watch.labels

    def name_inputs(self, names: Mapping[str, torch.Tensor]) -> None:
        """After capture: call each tensor of ``names`` (``label -> tensor``) by its label in liveness and
        address errors, and watch it before every replay even if the captured work does not use it."""
        if not self.captured:
            raise CaptureError("name_inputs() before a completed capture()")
        self._backend.name_inputs(names)

    def check_inputs(self) -> Checked:
        """Check, in one pass, that every tensor the capture uses and does not own (and every tensor given
        to :meth:`name_inputs`) is alive and has its captured address, shape, stride and dtype. Raises
        :class:`~graphbuf.errors.LivenessError` or :class:`~graphbuf.errors.AddressChangedError` naming the
        tensor; returns the checked tensors. :meth:`replay` runs the same check unless given this result."""
        if not self.captured:
            raise CaptureError("check_inputs() before a completed capture()")
        return self._backend.watch.check("before replay")

    def replay(self, *, checked: Checked | None = None) -> None:
        """Run the captured work once, after checking every watched tensor (see :meth:`check_inputs`).

        ``checked``: the result of a :meth:`check_inputs` call made just before, when nothing since could
        have moved or freed a tensor (in-place writes cannot); the check is then not repeated. It is ignored
        (the check runs) if a task update has rebuilt the recording since."""
        if self._capturing:
            raise CaptureError("replay() inside this graph's own capture()")
        if not self.captured:
            raise CaptureError("replay() before a completed capture()")
        self._backend.replay(self._tasks, checked)

    def pool(self) -> object:
        """A memory-pool handle to pass as ``capture(pool=...)`` of another graph.

        cuda/npu: ``graph.pool()`` once captured; before capture, a fresh ``graph_pool_handle()`` that this
        graph then captures into too. cpu: an opaque token."""
        return self._backend.pool()

    def reset(self) -> None:
        """Drop the recording and its tasks; the graph can capture again."""
        if self._capturing:
            raise CaptureError("reset() inside capture(); leave the capture block first")
        self._invalidate_tasks()
        self._backend.reset()

    def task(
        self, kind: TaskKind | str, fn: Callable[..., object], *tensor_args: torch.Tensor, **host_args: object
    ) -> CapturedTask:
        """Inside :meth:`capture`: run ``fn(*tensor_args, **host_args)`` as one re-issuable task.

        ``fn`` must write its results into preallocated tensors among ``tensor_args`` (like NPU ``out=``);
        on npu it must be only the re-issued op (see :mod:`graphbuf.graphs.tasks`);
        ``host_args`` are host values (ints, floats, lists of them) baked in until
        :meth:`CapturedTask.update`. Raises :class:`CaptureError` outside capture, :class:`TaskError` (a
        ValueError) for an unknown kind, TypeError for a non-tensor ``tensor_args`` entry or a tensor among
        ``host_args``.
        """
        task_kind = TaskKind.parse(kind)
        if not self._capturing:
            raise CaptureError(f"Graph.task({task_kind.value!r}, ...) is only valid inside capture()")
        for i, t in enumerate(tensor_args):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"task {task_kind.value!r}: tensor_args[{i}] is {type(t).__name__}, not a tensor; "
                    "pass host values as keyword arguments"
                )
        frozen = freeze_host_args(host_args)
        handle = self._backend.capture_task(task_kind, fn, tensor_args, frozen)
        task = CapturedTask(task_kind, fn, tensor_args, frozen, handle, self._reissue)
        self._tasks.append(task)
        return task

    def update_tasks(self, kind: TaskKind | str, **host_args: object) -> int:
        """``update(**host_args)`` on every captured task of ``kind`` (e.g. all attention layers); returns how
        many were updated."""
        task_kind = TaskKind.parse(kind)
        matching = [t for t in self._tasks if t.kind is task_kind]
        with self._backend.updating():
            for t in matching:
                t.update(**host_args)
        return len(matching)

    def _reissue(self, task: CapturedTask, host: Mapping[str, object]) -> None:
        if not any(t is task for t in self._tasks):
            raise CaptureError(
                f"task {task.kind.value!r} belongs to a capture this graph no longer holds "
                "(reset or re-captured)"
            )
        if self._capturing:
            raise CaptureError("a task can be updated only after capture() has ended")
        self._backend.update_task(task, host)

    def _invalidate_tasks(self) -> None:
        self._tasks = []

    def __repr__(self) -> str:
        state = "capturing" if self._capturing else ("captured" if self.captured else "empty")
        return f"Graph(device={str(self.device)!r}, {state}, tasks={len(self._tasks)})"
