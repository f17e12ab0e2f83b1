"""A rule-enforcing ``torch_npu`` stand-in for CI: graphbuf's NPU code paths run on CPU tensors against it.

Unlike the harness stub (``tests/integration/real_vllm_ascend/torch_npu_stub.py``, which accepts everything),
this
stand-in computes what the ops it stands for compute and refuses what torch_npu 2.10.0.post4 / 2.14.0
document as not allowed, or what would fail or corrupt memory on a 910B. Each refusal is a
:class:`ContractError` naming the rule:

* ``not-graph-capable``: ops torch_npu documents as unsupported in graph mode / aclgraph refuse to run on a
  capturing stream (``npu_fusion_attention``); so does FIA's allocating form, whose internal workspace is
  sized for the captured KV lengths (a task update to longer lengths would overrun it).
* ``task-group``: a task group records its contents. Inside it only torch_npu ops may run (any aten op there
  is a kernel the update would re-run outside the graph's pool, or an allocation); every allocation inside a
  group or an update is counted in :data:`STATE` ``.group_allocations`` and refused. An update must re-issue
  the same ops, in order, with the same tensor arguments (address, shape, stride, dtype); only host arguments
  may change.
* ``update-stream``: ``graph_task_update_begin`` refuses the capture stream (and any stream while a capture
  runs on it), and a stream of another device than the task's.
* ``device``: events and streams carry a device; ``event.wait/reset/record(stream)`` needs the same device.
* ``workspace``: FIA ``.out`` needs a workspace at least as large as ``_get_max_workspace`` gives for the KV
  lengths it runs with (the stand-in's model: grows with the longest KV length), and an lse tensor.
* ``event``: a replay waits on every external event the capture waited on; one never recorded since the last
  replay would block the device forever, so replay refuses. With :data:`STATE` ``.queued_replays`` True
  (the device's own order: a replay is queued, its waits block it until the events are recorded, which is
  how UpdatableGraph's "replay, then update on the update stream" works), ``replay`` queues the graph
  behind its unrecorded events, ``ExternalEvent.record`` runs it once every event it waits on is recorded,
  and any host synchronization (``torch.npu.synchronize``, ``Stream.synchronize``, :func:`synchronize`), a
  capture or another replay while it is still blocked refuses: there the device would hang.

Tensors stay on the CPU; "npu" is a device *name* (PrivateUse1 renamed, irreversible in a process) so
``torch.device("npu:1")`` parses. The NPU code paths are selected by ``kernels.uses_npu_kernels``, which the
test fixture points at this stand-in. Graph replay re-runs the recorded aten ops and torch_npu calls in
capture order, task groups with the host arguments of their last update.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = ["STATE", "ContractError", "install", "uninstall"]


class ContractError(RuntimeError):
    """A torch_npu graph rule was broken; the message starts with the rule's name in brackets."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"[{rule}] {message}")
        self.rule = rule


# --------------------------------------------------------------------------------------------------------
# devices, streams, events
# --------------------------------------------------------------------------------------------------------

_ids = itertools.count(1)


class Stream:
    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = torch.device("npu", _index(device))
        self.id = next(_ids)

    def wait_stream(self, other: Stream) -> None:
        STATE.log.append(("wait_stream", self.id, other.id))

    def synchronize(self) -> None:
        synchronize()

    def __repr__(self) -> str:
        return f"<standin Stream {self.id} on {self.device}>"


def synchronize(device: Any = None) -> None:
    """A host wait for the device: refuses while a queued replay waits on an event nobody recorded."""
    blocked = STATE.blocked
    if blocked is not None:
        STATE.blocked = None
        raise ContractError(
            "event",
            f"host synchronization while a replay waits on {len(_unrecorded(blocked))} external event(s) "
            "nobody recorded: the device would hang here",
        )


def _index(device: Any) -> int:
    if device is None:
        return STATE.device
    if isinstance(device, int):
        return device
    dev = torch.device(device) if isinstance(device, str) else device
    return dev.index if dev.index is not None else STATE.device


class ExternalEvent:
    def __init__(self) -> None:
        self.device = torch.device("npu", STATE.device)
        self.recorded = False

    def _same_device(self, what: str, stream: Stream) -> None:
        if stream.device != self.device:
            raise ContractError(
                "device", f"ExternalEvent of {self.device}: {what} on a stream of {stream.device}"
            )

    def wait(self, stream: Stream) -> None:
        self._same_device("wait", stream)
        graph = STATE.capturing_graph(stream)
        if graph is not None:
            graph.entries.append(("wait", self))

    def reset(self, stream: Stream) -> None:
        self._same_device("reset", stream)

    def record(self, stream: Stream) -> None:
        self._same_device("record", stream)
        if STATE.update is not None and STATE.update.stream is stream:
            raise ContractError("event", "event recorded before graph_task_update_end on its stream")
        self.recorded = True
        blocked = STATE.blocked
        if blocked is not None and not _unrecorded(blocked):
            STATE.blocked = None
            blocked._run()


@contextlib.contextmanager
def device(index: Any) -> Iterator[None]:
    before = STATE.device
    STATE.device = _index(index)
    try:
        yield
    finally:
        STATE.device = before


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    if s is None:
        yield
        return
    before_device, before = STATE.device, STATE.current.get(s.device.index)
    STATE.device = s.device.index
    STATE.current[s.device.index] = s
    try:
        yield
    finally:
        STATE.current[s.device.index] = before  # type: ignore[assignment]
        STATE.device = before_device


def current_stream(device: Any = None) -> Stream:
    idx = _index(device)
    s = STATE.current.get(idx)
    if s is None:
        s = STATE.current[idx] = Stream(idx)
    return s


def set_stream(s: Stream) -> None:
    STATE.current[s.device.index] = s


# --------------------------------------------------------------------------------------------------------
# task groups and graphs
# --------------------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One torch_npu op call: its implementation, name and arguments (the latest ones after an update)."""

    name: str
    impl: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class Group:
    stream: Stream
    graph: NPUGraph
    calls: list[Call] = field(default_factory=list)


@dataclass
class Update:
    stream: Stream
    group: Group
    calls: list[Call] = field(default_factory=list)


def _geometry(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _tensor_slots(call: Call) -> list[tuple[str, Any]]:
    slots: list[tuple[str, Any]] = []
    for i, a in enumerate(call.args):
        slots.append((f"args[{i}]", a))
    for k, v in call.kwargs.items():
        slots.append((k, v))
    out = []
    for name, v in slots:
        if isinstance(v, torch.Tensor):
            out.append((name, _geometry(v)))
        elif isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            out.append((name, [_geometry(x) if isinstance(x, torch.Tensor) else x for x in v]))
    return out


def graph_task_group_begin(s: Stream) -> None:
    graph = STATE.capturing_graph(s)
    if graph is None:
        raise ContractError("task-group", "graph_task_group_begin on a stream that is not capturing")
    if STATE.group is not None:
        raise ContractError("task-group", "graph_task_group_begin inside an open task group")
    STATE.group = Group(s, graph)


def graph_task_group_end(s: Stream) -> Group:
    group = STATE.group
    if group is None or group.stream is not s:
        raise ContractError("task-group", "graph_task_group_end without a task group open on this stream")
    STATE.group = None
    group.graph.entries.append(("group", group))
    STATE.groups.append(group)
    return group


def graph_task_update_begin(s: Stream, handle: Group) -> None:
    if STATE.capture is not None and STATE.capture.stream is s:
        raise ContractError("update-stream", "graph_task_update_begin on the capture stream")
    if s.device != handle.stream.device:
        raise ContractError(
            "update-stream", f"task captured on {handle.stream.device}, updated on a stream of {s.device}"
        )
    if STATE.update is not None:
        raise ContractError("task-group", "graph_task_update_begin inside an open update")
    if current_stream(s.device.index) is not s:
        raise ContractError("update-stream", "the update stream must be current while the update runs")
    STATE.update = Update(s, handle)
    STATE.guard.__enter__()


def graph_task_update_end(s: Stream) -> None:
    update = STATE.update
    if update is None or update.stream is not s:
        raise ContractError("task-group", "graph_task_update_end without an update open on this stream")
    STATE.guard.__exit__(None, None, None)
    STATE.update = None
    captured, issued = update.group.calls, update.calls
    names = ([c.name for c in captured], [c.name for c in issued])
    if names[0] != names[1]:
        raise ContractError("task-group", f"update re-issued {names[1]}, the group holds {names[0]}")
    for old, new in zip(captured, issued, strict=True):
        if _tensor_slots(old) != _tensor_slots(new):
            raise ContractError(
                "task-group", f"update re-issued {new.name} with other tensor arguments than captured"
            )
    for old, new in zip(captured, issued, strict=True):
        old.args, old.kwargs = new.args, new.kwargs
    STATE.updates += 1


def _is_view(func: Any) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _mutates(func: Any) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


class _Recorder(TorchDispatchMode):
    """Active while capturing: records each aten op for replay, refuses aten ops inside a task group."""

    def __init__(self, graph: NPUGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if STATE.internal:
            return func(*args, **kwargs)
        if STATE.group is not None and not _is_view(func):
            if not _mutates(func):
                STATE.group_allocations += 1
            raise ContractError(
                "task-group",
                f"{func} inside a task group: a group holds only the re-issued op; an update would re-run "
                "this kernel on the update stream"
                + ("" if _mutates(func) else " and allocate its result outside the graph's pool"),
            )
        result = func(*args, **kwargs)
        if not _is_view(func):
            self.graph.entries.append(("aten", func, args, kwargs, result))
        return result


class _UpdateGuard(TorchDispatchMode):
    """Active during a task update: any aten op there runs outside the graph."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if STATE.internal or _is_view(func):
            return func(*args, **kwargs)
        if not _mutates(func):
            STATE.group_allocations += 1
        raise ContractError(
            "task-group", f"{func} inside a task update: only the group's ops may be re-issued"
        )


class NPUGraph:
    def __init__(self) -> None:
        self.entries: list[tuple[Any, ...]] = []
        self.stream: Stream | None = None
        self.recorder: _Recorder | None = None
        self.replays = 0

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if STATE.blocked is not None:
            synchronize()
        s = current_stream()
        if STATE.capture is not None:
            raise ContractError("capture", "a capture is already underway")
        self.stream, STATE.capture = s, self
        self.recorder = _Recorder(self)
        self.recorder.__enter__()

    def capture_end(self) -> None:
        assert self.recorder is not None
        self.recorder.__exit__(None, None, None)
        STATE.capture = None
        if STATE.group is not None:
            STATE.group = None
            raise ContractError("task-group", "capture ended with a task group open")

    def replay(self) -> None:
        if STATE.blocked is not None:
            synchronize()  # a replay queued behind a blocked one never starts either
        if _unrecorded(self):
            if STATE.queued_replays:
                STATE.blocked = self
                return
            raise ContractError(
                "event", "replay waits on an external event nobody recorded: the device would block"
            )
        self._run()

    def _run(self) -> None:
        for entry in self.entries:
            if entry[0] == "wait":
                entry[1].recorded = False
        with _internal():
            for entry in self.entries:
                if entry[0] == "aten":
                    _, func, args, kwargs, result = entry
                    fresh = func(*args, **kwargs)
                    if not _mutates(func):
                        for old, new in zip(_flat(result), _flat(fresh), strict=True):
                            old.copy_(new)
                elif entry[0] == "npu":
                    _replay_call(entry[1])
                elif entry[0] == "group":
                    for call in entry[1].calls:
                        _replay_call(call)
        self.replays += 1

    def reset(self) -> None:
        self.entries = []

    def pool(self) -> tuple[str, int]:
        return ("pool", id(self))


def _unrecorded(graph: NPUGraph) -> list[ExternalEvent]:
    return [e[1] for e in graph.entries if e[0] == "wait" and not e[1].recorded]


def _flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    return []


def _replay_call(call: Call) -> None:
    result = call.impl(*call.args, **call.kwargs)
    recorded = call.kwargs.get("__result__")
    if recorded is not None:
        for old, new in zip(_flat(recorded), _flat(result), strict=True):
            old.copy_(new)


class graph:  # torch_npu's name
    default_capture_stream: Stream | None = None

    def __init__(self, npu_graph: NPUGraph, pool: Any = None, stream: Stream | None = None, **_: Any) -> None:
        if graph.default_capture_stream is None:
            graph.default_capture_stream = Stream(0)
        self.capture_stream = stream if stream is not None else Stream(STATE.device)
        self.npu_graph = npu_graph
        self.ctx = globals()["stream"](self.capture_stream)

    def __enter__(self) -> None:
        self.ctx.__enter__()
        self.npu_graph.capture_begin()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.npu_graph.capture_end()
        finally:
            self.ctx.__exit__(*exc)


@contextlib.contextmanager
def _internal() -> Iterator[None]:
    before = STATE.internal
    STATE.internal = True
    try:
        # The stand-in's own compute and checks are not the captured program: no mode sees them.
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            yield
    finally:
        STATE.internal = before


# --------------------------------------------------------------------------------------------------------
# ops
# --------------------------------------------------------------------------------------------------------


def _capturing() -> NPUGraph | None:
    return STATE.capturing_graph(current_stream())


def _issue(name: str, impl: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, functional: bool) -> Any:
    """Run a torch_npu op: inside an update it is recorded for comparison, inside a group or capture it is
    recorded for replay; functional ops allocate their results (counted and refused inside a group)."""
    if STATE.update is not None and current_stream() is STATE.update.stream:
        STATE.update.calls.append(Call(name, impl, args, dict(kwargs)))
        if functional:
            STATE.group_allocations += 1
            raise ContractError("task-group", f"{name} allocates its outputs inside a task update")
        return None  # an update patches the captured task; it runs at the next replay
    graph_ = _capturing()
    if STATE.group is not None and graph_ is not None:
        if functional:
            STATE.group_allocations += 1
            raise ContractError("task-group", f"{name} allocates its outputs inside a task group")
        with _internal():
            impl(*args, **kwargs)
        STATE.group.calls.append(Call(name, impl, args, dict(kwargs)))
        return kwargs.get("out")
    with _internal():
        result = impl(*args, **kwargs)
    if graph_ is not None:
        graph_.entries.append(("npu", Call(name, impl, args, {**kwargs, "__result__": result})))
    return result


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None, scale: float):
    """float32 attention over BNSD with GQA; hidden True = masked; a row with no visible key gives zeros."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.matmul(probs, vf).to(q.dtype)


def _strip(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k != "__result__"}


def _fusion_attention_impl(query, key, value, head_num, input_layout, **kwargs):  # type: ignore[no-untyped-def]
    kwargs = _strip(kwargs)
    if input_layout != "BNSD":
        raise ContractError("stand-in", f"only BNSD is modelled, got {input_layout!r}")
    if head_num != query.shape[1]:
        raise ContractError("shape", f"head_num {head_num} != query heads {query.shape[1]}")
    mask = kwargs.get("atten_mask")
    out = _attention(query, key, value, mask, float(kwargs.get("scale", 1.0)))
    stats = torch.zeros(query.shape[0], query.shape[1], query.shape[2], 8, dtype=torch.float32)
    seed = torch.zeros(1, dtype=torch.int64)
    return out, stats, stats.clone(), torch.zeros(0, dtype=query.dtype), seed, seed.clone()


def npu_fusion_attention(query, key, value, head_num, input_layout, **kwargs):  # type: ignore[no-untyped-def]
    if _capturing() is not None:
        raise ContractError(
            "not-graph-capable",
            "npu_fusion_attention is documented unsupported in graph mode and aclgraph (its sync=False path "
            "waits on an event a capture cannot join); use npu_fusion_attention_v3",
        )
    return (*_fusion_attention_impl(query, key, value, head_num, input_layout, **kwargs)[:6], 0)


def npu_fusion_attention_v3(query, key, value, head_num, input_layout, **kwargs):  # type: ignore[no-untyped-def]
    return _issue(
        "npu_fusion_attention_v3",
        _fusion_attention_impl,
        (query, key, value, head_num, input_layout),
        kwargs,
        functional=False,  # allocates from the capture's pool like any captured kernel (not in a group)
    )


def _workspace_elems(query: torch.Tensor, lengths: Sequence[int] | None) -> int:
    """The stand-in's workspace model: grows with the longest KV length (bytes)."""
    longest = max([int(n) for n in lengths or [0]] + [0])
    return 4096 + query.shape[0] * query.shape[1] * 16 * longest


def _fia_check(query, key, value, kwargs):  # type: ignore[no-untyped-def]
    if kwargs.get("input_layout") != "BNSD":
        raise ContractError("stand-in", "only BNSD paged FIA is modelled")
    batch = query.shape[0]
    lengths = kwargs.get("actual_seq_lengths_kv")
    table = kwargs.get("block_table")
    if lengths is None or table is None:
        raise ContractError("stand-in", "only paged FIA with actual_seq_lengths_kv is modelled")
    if len(lengths) != batch:
        raise ContractError("561002", f"size of actualSeqLengthsKv ({len(lengths)}) != batchSize ({batch})")
    if table.dim() != 2 or table.shape[0] != batch:
        raise ContractError(
            "561002", f"block table shape should be [B={batch}, >= n], got {tuple(table.shape)}"
        )
    if query.shape[2] == 1 and query.shape[3] > 512:
        raise ContractError("561002", "one-token query needs D <= 512")
    block_size = int(kwargs.get("block_size", 0))
    if key.dim() != 3 or key.shape[1] != block_size:
        raise ContractError("stand-in", f"paged key must be [blocks, block_size={block_size}, Nkv*D]")
    if any(int(n) < 0 or int(n) > table.shape[1] * block_size for n in lengths):
        raise ContractError("561002", f"actual_seq_lengths_kv {list(lengths)} beyond the block table")


def _fia_compute(query, key, value, out, kwargs):  # type: ignore[no-untyped-def]
    lengths = [int(n) for n in kwargs["actual_seq_lengths_kv"]]
    table = kwargs["block_table"]
    block_size = int(kwargs["block_size"])
    num_kv = int(kwargs["num_key_value_heads"])
    head_dim = query.shape[3]
    num_blocks = key.shape[0]
    for b, n in enumerate(lengths):
        if n == 0:
            out[b].zero_()
            continue
        needed = -(-n // block_size)
        ids = table[b, :needed].to(torch.int64)
        if bool((ids < 0).any()) or bool((ids >= num_blocks).any()):
            raise ContractError("address", f"block id out of range in row {b}: {ids.tolist()}")
        k = key[ids].reshape(needed * block_size, num_kv, head_dim)[:n].permute(1, 0, 2).unsqueeze(0)
        v = value[ids].reshape(needed * block_size, num_kv, head_dim)[:n].permute(1, 0, 2).unsqueeze(0)
        out[b].copy_(_attention(query[b : b + 1], k, v, None, float(kwargs.get("scale", 1.0)))[0])


def _nbytes(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.numel() * t.element_size()


def _fia_out_impl(query, key, value, **kwargs):  # type: ignore[no-untyped-def]
    kwargs = _strip(kwargs)
    out = kwargs.get("out")
    if not isinstance(out, (list, tuple)) or len(out) != 2:
        raise ContractError("stand-in", "npu_fused_infer_attention_score.out needs out=[attention_out, lse]")
    _fia_check(query, key, value, kwargs)
    workspace = kwargs.get("workspace")
    needed = _workspace_elems(query, kwargs["actual_seq_lengths_kv"])
    if workspace is None or _nbytes(workspace) < needed:
        raise ContractError(
            "workspace",
            f"FIA .out with KV lengths {list(kwargs['actual_seq_lengths_kv'])} needs a workspace of "
            f">= {needed} bytes, got {_nbytes(workspace)}",
        )
    if out[0].shape != query.shape or out[0].dtype != query.dtype:
        raise ContractError("shape", f"attention_out {tuple(out[0].shape)} must be {tuple(query.shape)}")
    _fia_compute(query, key, value, out[0], kwargs)
    return out


def _fia_impl(query, key, value, **kwargs):  # type: ignore[no-untyped-def]
    kwargs = _strip(kwargs)
    _fia_check(query, key, value, kwargs)
    out = torch.empty_like(query)
    _fia_compute(query, key, value, out, kwargs)
    return out, torch.zeros(0, dtype=torch.float32)


class _FusedInferAttention:
    def __call__(self, query, key, value, **kwargs):  # type: ignore[no-untyped-def]
        if _capturing() is not None or STATE.update is not None:
            raise ContractError(
                "not-graph-capable",
                "allocating npu_fused_infer_attention_score under capture: its internal workspace is sized "
                "for the captured KV lengths; capture .out with a workspace from _get_max_workspace",
            )
        return _fia_impl(query, key, value, **kwargs)

    def out(self, query, key, value, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("workspace") is None and (_capturing() is not None or STATE.update is not None):
            STATE.group_allocations += int(STATE.group is not None or STATE.update is not None)
            raise ContractError(
                "workspace",
                "npu_fused_infer_attention_score.out without workspace allocates one inside the task",
            )
        return _issue(
            "npu_fused_infer_attention_score.out",
            _fia_out_impl,
            (query, key, value),
            kwargs,
            functional=False,
        )


def _npu_fused_infer_attention_score_get_max_workspace(query, key, value, **kwargs):  # type: ignore[no-untyped-def]
    return torch.empty(_workspace_elems(query, kwargs.get("actual_seq_lengths_kv")), dtype=torch.uint8)


def _npu_fused_infer_attention_score_infer_output(query, value, **kwargs):  # type: ignore[no-untyped-def]
    return torch.empty_like(query), torch.empty(
        0 if not kwargs.get("softmax_lse_flag") else 1, dtype=torch.float32
    )


# --------------------------------------------------------------------------------------------------------
# state and installation
# --------------------------------------------------------------------------------------------------------


class _State:
    def __init__(self) -> None:
        self.reset(2)

    def reset(self, devices: int) -> None:
        self.devices = devices
        self.device = 0
        self.current: dict[int, Stream] = {}
        self.capture: NPUGraph | None = None
        self.group: Group | None = None
        self.update: Update | None = None
        self.groups: list[Group] = []
        self.group_allocations = 0
        self.updates = 0
        self.internal = False
        self.guard = _UpdateGuard()
        self.log: list[tuple[Any, ...]] = []
        self.queued_replays = False
        self.blocked: NPUGraph | None = None

    def capturing_graph(self, s: Stream) -> NPUGraph | None:
        capture = self.capture
        return capture if capture is not None and capture.stream is s else None


STATE = _State()


def _module() -> tuple[types.ModuleType, types.ModuleType]:
    npu = types.ModuleType("torch_npu.npu")
    for name in (
        "Stream", "ExternalEvent", "NPUGraph", "graph", "device", "stream", "current_stream", "set_stream",
        "graph_task_group_begin", "graph_task_group_end", "graph_task_update_begin", "graph_task_update_end",
    ):  # fmt: skip
        setattr(npu, name, globals()[name])
    npu.is_available = lambda: True
    npu._is_in_bad_fork = lambda: False
    npu.manual_seed_all = lambda seed: None
    npu.device_count = lambda: STATE.devices
    npu.current_device = lambda: STATE.device
    npu.synchronize = synchronize
    npu.empty_cache = lambda: None
    npu.graph_pool_handle = lambda: ("pool", next(_ids))
    npu.is_current_stream_capturing = lambda: _capturing() is not None
    tnpu = types.ModuleType("torch_npu")
    tnpu.npu = npu
    tnpu.__standin__ = True
    tnpu.npu_fusion_attention = npu_fusion_attention
    tnpu.npu_fusion_attention_v3 = npu_fusion_attention_v3
    tnpu.npu_fused_infer_attention_score = _FusedInferAttention()
    tnpu._npu_fused_infer_attention_score_get_max_workspace = (
        _npu_fused_infer_attention_score_get_max_workspace
    )
    tnpu._npu_fused_infer_attention_score_infer_output = _npu_fused_infer_attention_score_infer_output
    return tnpu, npu


def install(devices: int = 2) -> types.ModuleType:
    """Put the stand-in in ``sys.modules['torch_npu']`` and ``torch.npu``, with ``devices`` NPUs."""
    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")
    STATE.reset(devices)
    tnpu, npu = _module()
    sys.modules["torch_npu"] = tnpu
    sys.modules["torch_npu.npu"] = npu
    torch.npu = npu  # type: ignore[attr-defined]
    return tnpu


def uninstall() -> None:
    """Remove the stand-in. The PrivateUse1 rename cannot be undone in a process and torch (dynamo) then
    expects a ``torch.npu`` module, so an inert one stays: no torch_npu import, no device."""
    sys.modules.pop("torch_npu", None)
    sys.modules.pop("torch_npu.npu", None)
    inert = types.ModuleType("graphbuf_tests.inert_npu")
    inert.is_available = lambda: False
    inert.device_count = lambda: 0
    inert._is_in_bad_fork = lambda: False  # torch.manual_seed seeds every renamed backend's module
    inert.manual_seed_all = lambda seed: None
    torch.npu = inert  # type: ignore[attr-defined]
    STATE.reset(2)
