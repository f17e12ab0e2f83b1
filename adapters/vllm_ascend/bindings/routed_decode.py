"""Routed paged decode: one captured task per layer and capture size, re-issued with fresh host KV lengths.

The paged kernel takes each request's KV length as a host list (``actual_seq_lengths_kv``): a captured graph
bakes it, and only a task update changes it, as vllm-ascend does for its own fused-attention layers. This
module keeps graphbuf's tasks apart from vllm-ascend's ``GraphParams`` (whose update loop unpacks its own
parameter tuples by position): :class:`RoutedDecodes` holds one routed KV group's tasks by capture size, and
``routing.update_routed`` re-issues them from ``update_graph_params`` before each replay.

Each task is a graphbuf :class:`~graphbuf.graphs.tasks.CapturedTask` of kind ``PAGED_ATTENTION`` (one task
protocol with ``Graph.task``): :meth:`RoutedDecodes.update` re-issues only the tasks whose host lengths
changed, as ``Graph.reissue`` does. Before that, :meth:`RoutedDecodes.check` runs the watch check of the
size: every tensor the tasks use (query, KV caches, graphbuf's block table and KV lengths, output, the NPU
kernel's workspace and buffers) alive and at its captured address, shape and stride, and each layer's current
KV cache (``impl.key_cache`` / ``value_cache``, what vllm-ascend hands its own kernels) still the captured
one; otherwise :class:`~graphbuf.errors.AddressChangedError` / :class:`~graphbuf.errors.LivenessError`
naming the layer and the tensor, raised before any byte of the step is written (``routing.plan_route``
checks before refreshing graphbuf's buffers, ``routing.update_routed`` before re-issuing).

Every call goes through ``large_head.decode_into(..., seq_lens_kv=, issue=)``, the entry point the
drill's binding uses too, so the routed and the bound decode are one code path:

* NPU (float16/bfloat16): ``large_head.decode_attention`` sanitizes the block table, allocates the
  kernel's buffers (``kernels.paged_decode_buffers``) and zeroes rows that see no key as ordinary
  kernels, around one call ``issue(kernels.paged_decode_out, ...)``. Under capture that call, and only
  it, is the task group (``graphbuf.graphs.tasks.npu_capture_task``: an external event gates it at
  replay); the result is copied into the layer's output outside the group. An update re-issues it
  (``npu_update_task``).
* Elsewhere: the software paged decode, which reads only the host lengths it was last issued with.
  Capture runs it once; :meth:`RoutedDecodes.update` re-issues it with new lengths;
  :meth:`RoutedDecodes.replay` runs the tasks of a size as the device's graph replay would, so a task that
  is not re-issued replays stale lengths.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphbuf.errors import AddressChangedError, LivenessError
from graphbuf.graphs.tasks import (
    CapturedTask,
    NpuTaskState,
    TaskKind,
    npu_arm_events,
    npu_capture_task,
    npu_update_task,
)
from graphbuf.graphs.watch import Watch

from ..glue import upstream
from ..kernels import attention as kernels
from . import large_head

__all__ = ["DecodeTask", "RoutedDecodes"]

_SOFTWARE_ARGS = ("query", "key_cache", "value_cache", "block_table", "seq_lens", "output")
"""Names of a software task's tensor arguments (``large_head.decode_into``'s order)."""
_IMPL = "AscendAttentionBackendImpl instance fields"


@dataclass
class DecodeTask:
    """One layer's captured paged decode: a graphbuf ``CapturedTask`` (kind ``PAGED_ATTENTION``, host
    argument ``seq_lens_kv``) with the layer that owns it.

    ``owner``: the layer (kept alive so its identity keys the task); ``label``: how errors name the layer;
    ``task``: the captured task, whose ``handle`` is the NPU task group (``fn`` is then
    ``kernels.paged_decode_out``) or None for the software task (``fn`` decodes into the layer's output);
    ``caches``: the KV cache tensors the capture read.
    """

    owner: Any
    label: str
    task: CapturedTask
    caches: tuple[torch.Tensor, torch.Tensor] = field(repr=False, default=None)  # type: ignore[assignment]

    @property
    def lens(self) -> list[int]:
        """The host KV lengths the task runs with now."""
        return list(self.task.host_args["seq_lens_kv"])  # type: ignore[call-overload]

    @property
    def npu(self) -> NpuTaskState | None:
        handle = self.task.handle
        return handle if isinstance(handle, NpuTaskState) else None

    @property
    def updates(self) -> int:
        """How many times the task was re-issued."""
        return self.task.updates

    def run(self) -> None:
        """Run the task with its current host lengths (the software task; what a replay computes)."""
        self.task.fn(*self.task.tensor_args, **dict(self.task.host_args))


def _stream_capturing() -> bool:
    npu = getattr(torch, "npu", None)
    probe = getattr(npu, "is_current_stream_capturing", None)
    return bool(probe()) if callable(probe) else False


class RoutedDecodes:
    """The captured paged-decode tasks of one routed KV group, by capture size and layer."""

    def __init__(self) -> None:
        self._tasks: dict[int, dict[int, DecodeTask]] = {}
        self._watches: dict[int, Watch] = {}
        self._stream: Any = None

    def tasks(self, size: int) -> tuple[DecodeTask, ...]:
        """The tasks captured at ``size``, in capture order."""
        return tuple(self._tasks.get(size, {}).values())

    def run(
        self,
        owner: Any,
        size: int,
        capturing: bool,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_host: Sequence[int],
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Decode ``query`` ``[B, Nq, D]`` into ``out`` ``[B, Nq, D]`` with KV lengths ``seq_lens_host`` (B
        host ints equal to the live part of ``seq_lens``). ``capturing``: register the call as ``owner``'s
        task at ``size`` (replacing an earlier capture of the same layer and size). Returns ``out``.

        RuntimeError when an NPU graph capture is underway on the current stream but ``capturing`` is
        False: the kernel would bake the host lengths into a graph with no task to re-issue them.
        """
        lens = [int(n) for n in seq_lens_host]
        scale = float(scale)
        issued: list[tuple[Callable[..., Any], tuple[torch.Tensor, ...], NpuTaskState]] = []

        def issue(
            fn: Callable[..., Any], *tensors: torch.Tensor, seq_lens_kv: list[int], scale: float
        ) -> None:
            body = functools.partial(fn, scale=scale)
            host = {"seq_lens_kv": list(seq_lens_kv)}
            if capturing:
                issued.append((body, tensors, npu_capture_task(body, tensors, host)))
                return
            if _stream_capturing():
                raise RuntimeError(
                    f"routed paged decode at capture size {size}: an NPU graph capture is underway but "
                    "vllm-ascend's forward context does not say capturing, so no task would be registered "
                    "and update_graph_params could never re-issue the host KV lengths baked into the graph; "
                    "capture through vllm-ascend's ACLGraphWrapper (or use decode_mode: dense)"
                )
            body(*tensors, **host)

        large_head.decode_into(query, key_cache, value_cache, block_table, seq_lens, out, seq_lens_kv=lens,
                               scale=scale, issue=issue)  # fmt: skip
        if not capturing:
            return out
        if issued:
            ((fn, tensors, state),) = issued
            host_lens = list(lens)
        elif not kernels.uses_npu_kernels(query):
            fn = functools.partial(large_head.decode_into, scale=scale)
            tensors = (query, key_cache, value_cache, block_table, seq_lens, out)
            state, host_lens = None, lens
        else:
            return out  # an NPU float32 query decodes with device lengths: nothing to re-issue
        layers = self._tasks.setdefault(size, {})
        order = list(layers).index(id(owner)) if id(owner) in layers else len(layers)
        label = f"routed decode layer #{order} ({type(owner).__name__}) at capture size {size}"
        task = CapturedTask(TaskKind.PAGED_ATTENTION, fn, tensors, {"seq_lens_kv": host_lens}, state,
                            self._reissue)  # fmt: skip
        layers[id(owner)] = DecodeTask(owner, label, task, (key_cache, value_cache))
        self._watches.pop(size, None)  # rebuilt from the tasks at the next check
        return out

    def _reissue(self, task: CapturedTask, host: Any) -> None:
        if isinstance(task.handle, NpuTaskState):
            npu_update_task(task.handle, task.fn, task.tensor_args, dict(host), self._stream)

    def watch(self, size: int) -> Watch:
        """The watch of ``size``: every tensor argument of every task, named ``<layer>: <tensor>``."""
        if size not in self._watches:
            entries: list[tuple[str, torch.Tensor]] = []
            for t in self.tasks(size):
                args = t.task.tensor_args
                names = _SOFTWARE_ARGS if t.npu is None else [f"kernel arg {i}" for i in range(len(args))]
                entries += [(f"{t.label}: {n}", a) for n, a in zip(names, args, strict=True)]
                entries += [(f"{t.label}: key_cache", t.caches[0]), (f"{t.label}: value_cache", t.caches[1])]
            self._watches[size] = Watch(entries)
        return self._watches[size]

    def check(self, size: int) -> None:
        """The watch check of ``size`` (module docstring): AddressChangedError / LivenessError naming the
        layer and the tensor. Nothing to check at a size with no tasks."""
        tasks = self.tasks(size)
        if not tasks:
            return
        where = f"routed decode replay at capture size {size}"
        for t in tasks:
            for name, captured in zip(("key_cache", "value_cache"), t.caches, strict=True):
                now = upstream.read(t.owner, name, _IMPL)
                if now is None:
                    raise LivenessError(
                        f"{where}: {t.label}: {name} was released by the layer (it is None now); the graph "
                        f"still reads the captured one at {captured.data_ptr():#x}. Capture again."
                    )
                if now is not captured and (now.data_ptr(), now.shape, now.stride()) != (
                    captured.data_ptr(),
                    captured.shape,
                    captured.stride(),
                ):
                    raise AddressChangedError(
                        f"{where}: {t.label}: {name} moved: captured at {captured.data_ptr():#x} shape "
                        f"{list(captured.shape)}, the layer's is now at {now.data_ptr():#x} shape "
                        f"{list(now.shape)}; the graph still reads the captured address. Capture again."
                    )
        self.watch(size).check(where)

    def update(self, size: int, seq_lens_host: Sequence[int], update_stream: Any = None) -> int:
        """Re-issue every task captured at ``size`` whose lengths differ from ``seq_lens_host``: one host
        length per row of the capture size (live lengths, then 0 for padded requests); a task captured over a
        row prefix takes the prefix's lengths. Tasks with unchanged lengths are not re-issued (their captured
        parameters stay in the graph; :meth:`arm` records their events). Returns the number re-issued.

        ValueError, before any task is re-issued, when the list is shorter than a task's captured batch.
        """
        lens = [int(n) for n in seq_lens_host]
        tasks = self.tasks(size)
        for t in tasks:
            if len(lens) < len(t.lens):
                raise ValueError(
                    f"routed decode at capture size {size}: {len(lens)} KV lengths for a captured batch of "
                    f"{len(t.lens)} requests"
                )
        self._stream = update_stream
        count = 0
        try:
            for t in tasks:
                fresh = lens[: len(t.lens)]
                if fresh != t.lens:
                    t.task.update(seq_lens_kv=fresh)
                    count += 1
        finally:
            self._stream = None
        return count

    def arm(self, size: int, update_stream: Any) -> None:
        """NPU: record the event of every task at ``size`` not updated since the last replay (the graph
        waits on it at every replay)."""
        states = [t.npu for t in self.tasks(size) if t.npu is not None]
        if states:
            npu_arm_events(states, update_stream)  # type: ignore[arg-type]

    def replay(self, size: int) -> None:
        """Run the software tasks of ``size`` with the lengths they were last issued with, as the device's
        graph replay runs them (NPU tasks run inside the device graph; nothing to do here)."""
        for t in self.tasks(size):
            if t.npu is None:
                t.run()
