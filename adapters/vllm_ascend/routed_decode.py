"""Routed paged decode: one captured task per layer and capture size, re-issued with fresh host KV lengths.

The paged kernel takes each request's KV length as a host list (``actual_seq_lengths_kv``): a captured graph
bakes it, and only a task update changes it, as vllm-ascend does for its own fused-attention layers. This
module keeps graphbuf's tasks apart from vllm-ascend's ``GraphParams`` (whose update loop unpacks its own
parameter tuples by position): :class:`RoutedDecodes` holds one routed KV group's tasks by capture size, and
``routing.update_routed`` re-issues them from ``update_graph_params`` before each replay.

* NPU (float16/bfloat16): the block table is sanitized outside the task; the task group is exactly one
  fused-infer ``.out`` call writing into the layer's output, with workspace and softmax LSE allocated before
  the group and kept alive by the task (``graphbuf.graphs.tasks.npu_capture_task`` /
  ``npu_update_task``: an external event gates the group at replay; the update records it).
* Elsewhere: the software paged decode (``large_head.decode_attention`` with ``seq_lens_host``), which
  reads only the host lengths it was last issued with. Capture runs it once; :meth:`RoutedDecodes.update`
  re-issues it with new lengths; :meth:`RoutedDecodes.replay` runs the tasks of a size as the device's graph
  replay would, so a task that is not re-issued replays stale lengths.
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
    """One layer's captured paged decode: ``fn(*tensor_args, seq_lens_host=lens)`` writes ``out``.

    ``owner``: the layer (kept alive so its identity keys the task); ``npu``: the NPU task group, or None
    for the software task; ``updates``: how many times it was re-issued.
    """

    owner: Any
    fn: Callable[..., Any]
    tensor_args: tuple[torch.Tensor, ...]
    lens: list[int]
    out: torch.Tensor
    npu: NpuTaskState | None = None
    updates: int = 0

    def run(self) -> None:
        """Run the task with its current host lengths (the software task; what a replay computes)."""
        self.fn(*self.tensor_args, seq_lens_host=list(self.lens))


def _software_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    seq_lens_host: list[int],
    scale: float,
) -> None:
    result = large_head.decode_attention(
        query, key_cache, value_cache, block_table, seq_lens, scale, seq_lens_host=seq_lens_host
    )
    if result.data_ptr() != out.data_ptr() or result.numel() != out.numel():  # never copied onto itself
        out.copy_(result.reshape(out.shape))


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
        task at ``size`` (replacing an earlier capture of the same layer and size). Returns ``out``."""
        lens = [int(n) for n in seq_lens_host]
        if kernels.uses_npu_kernels(query) and query.dtype != torch.float32:
            return self._run_npu(owner, size, capturing, query, key_cache, value_cache, block_table,
                                 seq_lens, lens, scale, out)  # fmt: skip
        fn = functools.partial(_software_decode, scale=float(scale))
        task = DecodeTask(owner, fn, (query, key_cache, value_cache, block_table, seq_lens, out), lens, out)
        task.run()
        if capturing:
            self._tasks.setdefault(size, {})[id(owner)] = task
        return out

    def _run_npu(
        self,
        owner: Any,
        size: int,
        capturing: bool,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        lens: list[int],
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
        # Sanitized outside the task group: the group holds exactly the one kernel call.
        ids = large_head.sanitize_block_table(block_table, seq_lens, num_blocks, block_size)
        query4, out4 = query.unsqueeze(2), out.unsqueeze(2)  # BNSD views, no copy
        workspace = kernels.paged_decode_workspace(query4, key_cache, value_cache, ids, lens, scale)
        lse = torch.empty(1, dtype=query.dtype, device=query.device)
        fn = functools.partial(
            kernels.paged_decode_bnsd, scale=float(scale), out=out4, workspace=workspace, softmax_lse=lse
        )
        tensor_args = (query4, key_cache, value_cache, ids)
        if capturing:
            state = npu_capture_task(fn, tensor_args, {"seq_lens_host": lens})
            task = DecodeTask(owner, fn, tensor_args, lens, out, npu=state)
            self._tasks.setdefault(size, {})[id(owner)] = task
        else:
            fn(*tensor_args, seq_lens_host=lens)
        valid = (seq_lens.to(torch.int64) > 0).view(-1, 1, 1)
        out.masked_fill_(~valid, 0)  # a 0-length (padding) row gives zeros; outside the task group
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
            batch = int(task.out.shape[0])
            if len(lens) < batch:
                raise ValueError(
                    f"routed decode at capture size {size}: {len(lens)} KV lengths for a captured batch of "
                    f"{batch} requests"
                )
        for task in tasks:
            fresh = lens[: int(task.out.shape[0])]
            if task.npu is not None:
                npu_update_task(task.npu, task.fn, task.tensor_args, {"seq_lens_host": fresh}, update_stream)
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
