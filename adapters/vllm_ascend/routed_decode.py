"""Routed paged decode: one captured task per layer and capture size, re-issued with fresh host KV lengths.

The paged kernel takes each request's KV length as a host list (``actual_seq_lengths_kv``): a captured graph
bakes it, and only a task update changes it, as vllm-ascend does for its own fused-attention layers. This
module keeps graphbuf's tasks apart from vllm-ascend's ``GraphParams`` (whose update loop unpacks its own
parameter tuples by position): :class:`RoutedDecodes` holds one routed KV group's tasks by capture size, and
``routing.update_routed`` re-issues them from ``update_graph_params`` before each replay.

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
from dataclasses import dataclass
from typing import Any

import torch

from graphbuf.graphs.tasks import NpuTaskState, npu_arm_events, npu_capture_task, npu_update_task

from . import kernels, large_head

__all__ = ["DecodeTask", "RoutedDecodes"]


@dataclass
class DecodeTask:
    """One layer's captured paged decode: ``fn(*tensor_args, seq_lens_kv=lens)``.

    ``owner``: the layer (kept alive so its identity keys the task); ``npu``: the NPU task group (``fn`` is
    then ``kernels.paged_decode_out``), or None for the software task (``fn`` decodes into the layer's
    output); ``updates``: how many times it was re-issued.
    """

    owner: Any
    fn: Callable[..., Any]
    tensor_args: tuple[torch.Tensor, ...]
    lens: list[int]
    npu: NpuTaskState | None = None
    updates: int = 0

    def run(self) -> None:
        """Run the task with its current host lengths (the software task; what a replay computes)."""
        self.fn(*self.tensor_args, seq_lens_kv=list(self.lens))


def _stream_capturing() -> bool:
    npu = getattr(torch, "npu", None)
    probe = getattr(npu, "is_current_stream_capturing", None)
    return bool(probe()) if callable(probe) else False


class RoutedDecodes:
    """The captured paged-decode tasks of one routed KV group, by capture size and layer."""

    def __init__(self) -> None:
        self._tasks: dict[int, dict[int, DecodeTask]] = {}

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
        issued: list[DecodeTask] = []

        def issue(
            fn: Callable[..., Any], *tensors: torch.Tensor, seq_lens_kv: list[int], scale: float
        ) -> None:
            body = functools.partial(fn, scale=scale)
            host = {"seq_lens_kv": list(seq_lens_kv)}
            if capturing:
                state = npu_capture_task(body, tensors, host)
                issued.append(DecodeTask(owner, body, tensors, list(seq_lens_kv), npu=state))
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
            (task,) = issued
        elif not kernels.uses_npu_kernels(query):
            fn = functools.partial(large_head.decode_into, scale=scale)
            task = DecodeTask(owner, fn, (query, key_cache, value_cache, block_table, seq_lens, out), lens)
        else:
            return out  # an NPU float32 query decodes with device lengths: nothing to re-issue
        self._tasks.setdefault(size, {})[id(owner)] = task
        return out

    def update(self, size: int, seq_lens_host: Sequence[int], update_stream: Any = None) -> int:
        """Re-issue every task captured at ``size`` with ``seq_lens_host``: one host length per row of the
        capture size (live lengths, then 0 for padded requests); a task captured over a row prefix takes the
        prefix's lengths. Returns the number of tasks re-issued.

        ValueError, before any task is re-issued, when the list is shorter than a task's captured batch.
        """
        lens = [int(n) for n in seq_lens_host]
        tasks = self.tasks(size)
        for task in tasks:
            if len(lens) < len(task.lens):
                raise ValueError(
                    f"routed decode at capture size {size}: {len(lens)} KV lengths for a captured batch of "
                    f"{len(task.lens)} requests"
                )
        for task in tasks:
            fresh = lens[: len(task.lens)]
            if task.npu is not None:
                npu_update_task(task.npu, task.fn, task.tensor_args, {"seq_lens_kv": fresh}, update_stream)
            task.lens = fresh
            task.updates += 1
        return len(tasks)

    def arm(self, size: int, update_stream: Any) -> None:
        """NPU: record the event of every task at ``size`` not updated since the last replay (the graph
        waits on it at every replay)."""
        states = [t.npu for t in self.tasks(size) if t.npu is not None]
        if states:
            npu_arm_events(states, update_stream)

    def replay(self, size: int) -> None:
        """Run the software tasks of ``size`` with the lengths they were last issued with, as the device's
        graph replay runs them (NPU tasks run inside the device graph; nothing to do here)."""
        for task in self.tasks(size):
            if task.npu is None:
                task.run()
