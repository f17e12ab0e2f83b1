"""Host task arguments: captured tasks that can be re-issued with fresh host arguments.

Some kernels take host values, not device tensors: Ascend's ``npu_fused_infer_attention_score`` takes
``actual_seq_lengths`` / ``actual_seq_lengths_kv`` as host integer lists. A captured graph bakes such values
in; they change only when the captured task is re-issued. :meth:`graphbuf.Graph.task` captures ``fn``
as one task and returns a :class:`CapturedTask`, whose :meth:`CapturedTask.update` re-issues it:

- cpu (emulator): the task is a separate group of the recording; ``update`` re-records that group;
- npu: the task is an NPU task group (``graph_task_group_begin/end``) gated by an external event;
  ``update`` re-issues it on a side stream created on the graph's device (``graph_task_update_begin/end``)
  and records the event. ``fn`` must be exactly the op(s) whose host arguments change, in ``.out`` form,
  every output and workspace among ``tensor_args`` and allocated before the task (torch_npu re-issues the
  group's kernels only; anything else in it, or an allocation, runs outside the graph or points at freed
  memory after an update). A task with no host arguments has nothing to re-issue: it is captured as
  ordinary kernels, with no group and no event (``handle`` None), and ``update`` does nothing;
- cuda: CUDA graphs cannot re-issue one captured task; ``update`` raises :class:`CaptureError`.

Kinds are told apart by name (:class:`TaskKind`), never by the number or order of arguments.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any

import torch

from graphbuf.errors import TaskError

__all__ = [
    "CapturedTask",
    "FrozenList",
    "NpuTaskState",
    "TaskKind",
    "freeze_host_args",
    "npu_arm_events",
    "npu_capture_task",
    "npu_update_task",
    "thaw_host_args",
]


class TaskKind(str, Enum):
    """What a captured task is; each kind is re-issued by name, never by argument count.

    ``ATTENTION``: fused infer attention (``npu_fused_infer_attention_score``), host
    ``actual_seq_lengths`` / ``actual_seq_lengths_kv``. ``SLIDING_ATTENTION``: the same kernel on a
    sliding-window layer. ``PAGED_ATTENTION``: paged decode attention. ``MLA_ATTENTION``: multi-head latent
    attention. ``SPEC_VERIFY_ATTENTION``: attention of a speculative-decoding verify step. ``CUSTOM``:
    anything else.
    """

    ATTENTION = "attention"
    SLIDING_ATTENTION = "sliding_attention"
    PAGED_ATTENTION = "paged_attention"
    MLA_ATTENTION = "mla_attention"
    SPEC_VERIFY_ATTENTION = "spec_verify_attention"
    CUSTOM = "custom"

    @classmethod
    def parse(cls, value: TaskKind | str) -> TaskKind:
        """``value`` as a TaskKind; :class:`TaskError` (a ValueError) naming the allowed values otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(repr(k.value) for k in cls)
            raise TaskError(f"unknown task kind {value!r}; allowed: {allowed}") from None

    def __str__(self) -> str:
        return self.value


class FrozenList(tuple):
    """A read-only host list: a tuple that still compares equal to the list it was made from."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list):
            return list(self) == other
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = tuple.__hash__

    def __repr__(self) -> str:
        return repr(list(self))


def _freeze(where: str, value: object) -> object:
    if isinstance(value, torch.Tensor):
        raise TypeError(
            f"host argument {where} is a tensor; host arguments are Python values (int, float, bool, str, "
            "None, lists/tuples of them). Pass device tensors positionally, among tensor_args."
        )
    if value is None or isinstance(value, (str, numbers.Number)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_freeze(f"{where}[{i}]", v) for i, v in enumerate(value)]
        return FrozenList(items) if isinstance(value, (list, FrozenList)) else tuple(items)
    raise TypeError(
        f"host argument {where} has type {type(value).__name__}; allowed: int, float, bool, str, None, "
        "and lists/tuples of them"
    )


def freeze_host_args(host_args: Mapping[str, object]) -> dict[str, object]:
    """A deep, read-only copy of ``host_args`` (lists become :class:`FrozenList`); TypeError for tensors."""
    return {name: _freeze(repr(name), value) for name, value in host_args.items()}


def _thaw(value: object) -> object:
    if isinstance(value, FrozenList):
        return [_thaw(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_thaw(v) for v in value)
    return value


def thaw_host_args(host_args: Mapping[str, object]) -> dict[str, object]:
    """Keyword arguments for the task function: fresh lists where the caller passed lists."""
    return {name: _thaw(value) for name, value in host_args.items()}


def _form(value: object) -> str:
    if value is None:
        return "None"
    if isinstance(value, (list, tuple)):
        return f"a sequence of {len(value)} values"
    return "a scalar"


def _check_update(kind: TaskKind, captured: Mapping[str, object], new: Mapping[str, object]) -> None:
    missing = sorted(set(captured) - set(new))
    unknown = sorted(set(new) - set(captured))
    if missing or unknown:
        raise TaskError(
            f"task {kind.value!r} was captured with host arguments {sorted(captured)}; update() must pass "
            f"exactly those (missing: {missing}, unknown: {unknown})"
        )
    for name, value in new.items():
        old = captured[name]
        if _form(old) != _form(value):
            raise TaskError(
                f"task {kind.value!r}: host argument {name!r} was captured as {_form(old)}, update() gave "
                f"{_form(value)}; its form is fixed by the captured shapes (a list's length is the captured "
                "batch size)"
            )


Reissue = Callable[["CapturedTask", Mapping[str, object]], None]


class CapturedTask:
    """One task captured by :meth:`graphbuf.Graph.task`.

    ``kind``: its :class:`TaskKind`. ``handle``: the device's handle for the task (npu: a
    :class:`NpuTaskState` holding the task-group handle and its external event; cpu: the emulator's group
    id; cuda: None). ``host_args``: the host arguments it runs with now (read-only;
    the captured ones until :meth:`update`). ``tensor_args``: the device tensors it reads and writes; its
    results go into preallocated tensors among them.
    """

    __slots__ = ("_fn", "_handle", "_host_args", "_kind", "_reissue", "_tensor_args", "_updates")

    def __init__(
        self,
        kind: TaskKind,
        fn: Callable[..., object],
        tensor_args: Sequence[torch.Tensor],
        host_args: Mapping[str, object],
        handle: object,
        reissue: Reissue,
    ) -> None:
        self._kind = kind
        self._fn = fn
        self._tensor_args = tuple(tensor_args)
        self._host_args: Mapping[str, object] = MappingProxyType(freeze_host_args(host_args))
        self._handle = handle
        self._reissue = reissue
        self._updates = 0

    @property
    def kind(self) -> TaskKind:
        return self._kind

    @property
    def fn(self) -> Callable[..., object]:
        return self._fn

    @property
    def handle(self) -> object:
        return self._handle

    @property
    def host_args(self) -> Mapping[str, object]:
        return self._host_args

    @property
    def tensor_args(self) -> tuple[torch.Tensor, ...]:
        return self._tensor_args

    @property
    def updates(self) -> int:
        """How many times :meth:`update` has re-issued this task."""
        return self._updates

    def check_update(self, **host_args: object) -> dict[str, object]:
        """What :meth:`update` checks, without re-issuing: ``host_args`` frozen, or :class:`TaskError`."""
        try:
            frozen = freeze_host_args(host_args)
        except TypeError as exc:
            raise TaskError(f"task {self._kind.value!r}: {exc}") from None
        _check_update(self._kind, self._host_args, frozen)
        return frozen

    def update(self, **host_args: object) -> None:
        """Re-issue the task with ``host_args``; later replays use them until the next update.

        The names must be exactly the captured ones, and each value keeps its captured form (None, scalar,
        or a sequence of the same length). Raises :class:`TaskError` (a :class:`CaptureError`) otherwise,
        :class:`CaptureError` on cuda (no task update) and after the graph was reset; TypeError for tensors
        or other non-host values.
        """
        frozen = freeze_host_args(host_args)
        _check_update(self._kind, self._host_args, frozen)
        self._reissue(self, frozen)
        self._host_args = MappingProxyType(frozen)
        self._updates += 1

    def __repr__(self) -> str:
        return (
            f"CapturedTask(kind={self._kind.value!r}, handle={self._handle!r}, "
            f"host_args={dict(self._host_args)!r}, tensor_args={len(self._tensor_args)}, "
            f"updates={self._updates})"
        )


# --------------------------------------------------------------------------------------------------------
# NPU task-group protocol (torch_npu; runs only on an Ascend NPU)
# --------------------------------------------------------------------------------------------------------


@dataclass
class NpuTaskState:
    """The NPU side of one captured task: its task-group handle and the external event gating it.

    ``armed``: the event was recorded for the next replay (by an update or by :func:`npu_arm_events`).
    """

    handle: object
    event: Any
    armed: bool = False


def npu_capture_task(
    fn: Callable[..., object], tensor_args: Sequence[torch.Tensor], host_kwargs: Mapping[str, object]
) -> NpuTaskState:
    """Inside NPU graph capture: issue ``fn`` as a task group that waits on a fresh external event.

    The graph waits on the event (then resets it) before the task at every replay, so the event must be
    recorded before each replay: by :func:`npu_update_task` or :func:`npu_arm_events`.
    """
    npu = torch.npu  # type: ignore[attr-defined]
    stream = npu.current_stream()
    event = npu.ExternalEvent()
    event.wait(stream)
    event.reset(stream)
    npu.graph_task_group_begin(stream)
    try:
        fn(*tensor_args, **host_kwargs)
    finally:
        handle = npu.graph_task_group_end(stream)
    return NpuTaskState(handle=handle, event=event)


def npu_update_task(
    state: NpuTaskState,
    fn: Callable[..., object],
    tensor_args: Sequence[torch.Tensor],
    host_kwargs: Mapping[str, object],
    update_stream: Any,
) -> None:
    """Re-issue a captured task group with new host arguments on ``update_stream``, then record its event.

    The update stream first waits for the current stream, so an update never races a replay still in
    flight (whose reset of the event would swallow this record).
    """
    npu = torch.npu  # type: ignore[attr-defined]
    update_stream.wait_stream(npu.current_stream())
    with npu.stream(update_stream):
        npu.graph_task_update_begin(update_stream, state.handle)
        try:
            fn(*tensor_args, **host_kwargs)
        finally:
            npu.graph_task_update_end(update_stream)
        state.event.record(update_stream)
    state.armed = True


def npu_arm_events(states: Sequence[NpuTaskState], update_stream: Any) -> None:
    """Before a replay: record the event of every task not updated since the last replay (its parameters
    from the last capture or update stay in the graph); then mark all tasks un-armed for the next round."""
    npu = torch.npu  # type: ignore[attr-defined]
    pending = [s for s in states if not s.armed]
    if pending:
        update_stream.wait_stream(npu.current_stream())
        for state in pending:
            state.event.record(update_stream)
    for state in states:
        state.armed = False
