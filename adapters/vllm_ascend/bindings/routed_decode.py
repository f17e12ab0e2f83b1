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

Under vllm-ascend's UpdatableGraph mechanism (0.30+) ``run`` is given ``register`` (upstream's
``register_task`` with graphbuf's provider for the layer, ``routing.DecodeParamProvider``): the task is
captured through it, as one keyword call ``operation(tensors=..., seq_lens_kv=..., scale=...)`` (the NPU
kernel's task group, or the whole software decode), and upstream re-issues it after resolving the provider;
graphbuf never re-issues it itself, it records the lengths upstream re-issues
(:meth:`RoutedDecodes.record_issued`). Upstream keeps only weak references to a task's tensors, so the
:class:`DecodeTask` holds every one of them strongly for as long as the capture is kept, and a tensor whose
storage owns no memory (a weak reference) is refused at capture (``LivenessError``).

Per replay accounting (both mechanisms): :meth:`RoutedDecodes.expect` is called when a step is planned at a
size holding graphbuf tasks, :meth:`RoutedDecodes.ran_in_python` when that step's forward ran (capture or
eager: no replay), :meth:`RoutedDecodes.saw_update` for every update delivered. A step that expected a
replay and saw no update raises ``UpstreamError`` naming the mechanism and the layers at the next
:meth:`RoutedDecodes.expect` (once ``budget`` planned steps wait: 1, or ``1 + k`` for a drafter that builds
its k steps before one replay), instead of waiting on an event nobody records.
Two threads updating one group's tasks at once get ``ConcurrentUseError``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphbuf.errors import AddressChangedError, ConcurrentUseError, LivenessError
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


Register = Callable[[Callable[..., Any], dict[str, Any], int], None]
"""Upstream's ``register_task`` with graphbuf's provider for the layer at ``index`` among the size's tasks:
``register(operation, kwargs, index)``."""


def run_task(fn: Callable[..., Any], *, tensors: tuple[torch.Tensor, ...], seq_lens_kv: list[int],
             scale: float) -> None:  # fmt: skip
    """A task in keyword form (upstream calls ``operation(**kwargs)``): ``fn(*tensors, seq_lens_kv=...,
    scale=...)``."""
    fn(*tensors, seq_lens_kv=seq_lens_kv, scale=scale)


def _check_strong(label: str, tensors: Sequence[torch.Tensor], trusted: set[int]) -> None:
    """LivenessError when a task tensor is a weak reference: its storage owns no memory (``resizable()``
    False, as a ``from_blob`` alias such as ``weak_ref_tensor`` makes). ``trusted``: storage addresses
    known to be owned (the KV caches, graphbuf's slab, whose numpy views also make it non-resizable)."""
    for i, t in enumerate(tensors):
        storage = t.untyped_storage()
        if storage.data_ptr() not in trusted and not storage.resizable():
            raise LivenessError(
                f"{label}: task tensor {i} (shape {list(t.shape)}, at {t.data_ptr():#x}) is a weak "
                "reference: its storage owns no memory, so the graph would read freed memory once the owner "
                "drops it (vllm-ascend #16794, error 507011). Hand the capture a tensor that owns its memory."
            )


def _stream_capturing() -> bool:
    npu = getattr(torch, "npu", None)
    probe = getattr(npu, "is_current_stream_capturing", None)
    return bool(probe()) if callable(probe) else False


def _issued_by_upstream(task: CapturedTask, host: Any) -> None:
    """A task registered with upstream's UpdatableGraph is re-issued on the device by upstream
    (``_updatable_graph_replay``, with what graphbuf's provider resolved): graphbuf only records the host
    arguments (:meth:`RoutedDecodes.record_issued`)."""


class RoutedDecodes:
    """The captured paged-decode tasks of one routed KV group, by capture size and layer."""

    def __init__(self, owned: Sequence[torch.Tensor] = ()) -> None:
        """``owned``: tensors whose memory the group owns for the graph's life (graphbuf's slab)."""
        self._owned = tuple(owned)
        self._tasks: dict[int, dict[int, DecodeTask]] = {}
        self._watches: dict[int, Watch] = {}
        self._stream: Any = None
        self._busy = threading.Lock()
        self._pending: list[tuple[int, str]] = []  # (size, mechanism) of planned replays not yet updated
        self._seen = 0
        self._recorded_step = 0

    @contextlib.contextmanager
    def exclusive(self, what: str) -> Iterator[None]:
        """One updater at a time: ConcurrentUseError when another thread is inside (sglang-omni #2160)."""
        if not self._busy.acquire(blocking=False):
            raise ConcurrentUseError(
                f"routed decode: {what} while another thread updates the same graph's tasks; one graph is "
                "updated by one thread at a time (serialize the replays or give each thread its own graphs)"
            )
        try:
            yield
        finally:
            self._busy.release()

    def expect(self, size: int, mechanism: str, budget: int = 1) -> None:
        """A step was planned at ``size``; a replay will run its tasks if ``size`` holds any. :meth:`verify`
        first: ``budget`` planned steps may wait for one update (1; ``1 + k`` where a drafter builds each of
        its k steps before one replay and one update), one more raises."""
        self.verify(budget)
        if self.tasks(size):
            self._pending.append((size, mechanism))
        self._seen = 0

    def ran_in_python(self) -> None:
        """The planned step's forward ran (capture or eager): no replay, nothing to update."""
        if self._pending:
            self._pending.pop()

    def saw_update(self, count: int = 1) -> None:
        """``count`` updates were delivered: every planned step waiting for one has it."""
        self._seen += count
        self._pending.clear()

    @property
    def updates_seen(self) -> int:
        """Updates delivered since the step planned last."""
        return self._seen

    def verify(self, budget: int = 1) -> None:
        """UpstreamError when ``budget`` planned steps that replay graphbuf tasks saw no update."""
        if len(self._pending) < budget:
            return
        pending, self._pending = self._pending, []
        size, mechanism = pending[0]
        labels = "; ".join(t.label for t in self.tasks(size))
        hook = {
            "update_graph_params": "AscendAttentionBackendImpl.update_graph_params (graphbuf's wrapper) was "
            "not called before the replay",
            "UpdatableGraph": "ACLGraphWrapper._updatable_graph_replay did not resolve graphbuf's providers "
            "(is the wrapper's attn_backend set, so use_updatable_graph holds?)",
        }.get(mechanism, "no update arrived")
        raise upstream.UpstreamError(
            f"routed decode at capture size {size}: {len(pending)} replay(s) ran graphbuf's tasks ({labels}) "
            f"but saw 0 task updates under the {mechanism} mechanism: {hook}. On a device that replay waits "
            "forever on the tasks' ExternalEvent (or replays stale KV lengths); graphbuf stops here instead"
        )

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
        register: Register | None = None,
        name: str | None = None,
    ) -> torch.Tensor:
        """Decode ``query`` ``[B, Nq, D]`` into ``out`` ``[B, Nq, D]`` with KV lengths ``seq_lens_host`` (B
        host ints equal to the live part of ``seq_lens``). ``capturing``: register the call as ``owner``'s
        task at ``size`` (replacing an earlier capture of the same layer and size); ``register``: capture it
        through upstream's ``register_task`` (UpdatableGraph) instead of graphbuf's own task group; ``name``:
        the KV group's layer names in errors. Returns ``out``.

        RuntimeError when an NPU graph capture is underway on the current stream but ``capturing`` is
        False: the kernel would bake the host lengths into a graph with no task to re-issue them.
        """
        lens = [int(n) for n in seq_lens_host]
        scale = float(scale)
        layers = self._tasks.setdefault(size, {}) if capturing else {}
        order = list(layers).index(id(owner)) if id(owner) in layers else len(layers)
        group = f" of KV group [{name}]" if name else ""
        label = f"routed decode layer #{order} ({type(owner).__name__}){group} at capture size {size}"
        caches = (key_cache, value_cache)
        issued: list[tuple[Callable[..., Any], tuple[torch.Tensor, ...], NpuTaskState | None]] = []

        def issue(
            fn: Callable[..., Any], *tensors: torch.Tensor, seq_lens_kv: list[int], scale: float
        ) -> None:
            body = functools.partial(fn, scale=scale)
            host = {"seq_lens_kv": list(seq_lens_kv)}
            if capturing and register is not None:
                trusted = {t.untyped_storage().data_ptr() for t in (*caches, *self._owned)}
                _check_strong(label, tensors, trusted)
                register(functools.partial(run_task, fn), {"tensors": tensors, **host, "scale": scale}, order)
                issued.append((body, tensors, None))
                return
            if capturing:
                issued.append((body, tensors, npu_capture_task(body, tensors, host)))
                return
            if _stream_capturing():
                raise RuntimeError(
                    f"routed paged decode at capture size {size}: an NPU graph capture is underway but "
                    "vllm-ascend's forward context does not say capturing, so no task would be registered "
                    "and nothing could ever re-issue the host KV lengths baked into the graph; "
                    "capture through vllm-ascend's ACLGraphWrapper (or use decode_mode: dense)"
                )
            body(*tensors, **host)

        software = not kernels.uses_npu_kernels(query)
        tensors = (query, key_cache, value_cache, block_table, seq_lens, out)
        if capturing and register is not None and software:
            issue(large_head.decode_into, *tensors, seq_lens_kv=lens, scale=scale)  # registered whole
        else:
            large_head.decode_into(*tensors, seq_lens_kv=lens, scale=scale, issue=issue)
        if not capturing:
            return out
        if issued:
            ((fn, tensors, state),) = issued
            if software and register is not None:
                fn = functools.partial(large_head.decode_into, scale=scale)
        elif software:
            fn = functools.partial(large_head.decode_into, scale=scale)
            state = None
        else:
            return out  # an NPU float32 query decodes with device lengths: nothing to re-issue
        reissue = self._reissue if register is None else _issued_by_upstream
        task = CapturedTask(TaskKind.PAGED_ATTENTION, fn, tensors, {"seq_lens_kv": list(lens)}, state,
                            reissue)  # fmt: skip
        layers[id(owner)] = DecodeTask(owner, label, task, caches)
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
                software = len(args) == len(_SOFTWARE_ARGS) and t.npu is None
                names = _SOFTWARE_ARGS if software else [f"kernel arg {i}" for i in range(len(args))]
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

    def record_issued(self, size: int, seq_lens_host: Sequence[int], step: int) -> None:
        """UpdatableGraph: the host lengths upstream re-issues the tasks at ``size`` with for planned step
        ``step`` (once per step), so each task's ``lens`` and :meth:`replay` follow them."""
        if step != self._recorded_step:
            self.update(size, seq_lens_host)
            self._recorded_step = step

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
