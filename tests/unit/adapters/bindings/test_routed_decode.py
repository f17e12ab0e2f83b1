"""Routed paged decode tasks (``routed_decode.RoutedDecodes``) on CPU, and their NPU task protocol.

CPU: the software task reads only the host lengths it was last issued with; ``update`` re-issues them and
``replay`` runs the tasks as a device replay would. NPU protocol order (no NPU here): ``torch.npu`` and the
kernel entry points ``kernels.paged_decode_buffers`` / ``kernels.paged_decode_out`` are replaced by
recorders, and ``kernels.uses_npu_kernels`` says yes, so the NPU branch runs on CPU tensors: the captured
task group must hold exactly the one ``paged_decode_out`` call (sanitising and buffers before it, the
copy-out after it), and an update must re-issue that call with the fresh lengths inside
``graph_task_update_begin/end`` on the update stream, then record the task's event. The same path against
the rule-enforcing torch_npu stand-in: ``tests/unit/graphs/test_npu_contract.py`` (routed protocol tests).
"""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from graphbuf.adapters.vllm_ascend.bindings import large_head, routed_decode
from graphbuf.adapters.vllm_ascend.kernels import attention as kernels
from graphbuf.errors import AddressChangedError, LivenessError
from graphbuf.graphs.tasks import TaskKind

BS, KV, NQ, D, BLOCKS = 16, 2, 4, 64, 12


def _case(lens: list[int], seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    kc, vc = (torch.randn(BLOCKS, BS, KV, D, generator=gen) for _ in range(2))
    table = torch.stack([torch.randperm(BLOCKS, generator=gen)[:4] for _ in lens]).to(torch.int32)
    query = torch.randn(len(lens), NQ, D, generator=gen)
    return query, kc, vc, table, torch.tensor(lens, dtype=torch.int32)


def _reference(query, kc, vc, table, lens):  # type: ignore[no-untyped-def]
    out = torch.zeros_like(query)
    for r, n in enumerate(lens):
        if n == 0:
            continue
        pos = torch.arange(n)
        blocks = table[r, pos // BS].long()
        k = kc[blocks, pos % BS].repeat_interleave(NQ // KV, 1)
        v = vc[blocks, pos % BS].repeat_interleave(NQ // KV, 1)
        p = torch.softmax(torch.einsum("hd,khd->hk", query[r], k) * D**-0.5, -1)
        out[r] = torch.einsum("hk,khd->hd", p, v)
    return out


def test_software_task_is_reissued_and_replayed_with_its_host_lengths() -> None:
    decodes = routed_decode.RoutedDecodes()
    query, kc, vc, table, lens = _case([20, 5, 0])
    out = torch.full_like(query, float("nan"))
    owner = object()
    decodes.run(owner, 3, True, query, kc, vc, table, lens, [20, 5, 0], D**-0.5, out)
    torch.testing.assert_close(out, _reference(query, kc, vc, table, [20, 5, 0]))
    [task] = decodes.tasks(3)
    assert task.owner is owner and task.lens == [20, 5, 0] and task.npu is None
    # A new batch in the same buffers: replay without update keeps the baked lengths.
    query.copy_(torch.randn_like(query))
    decodes.replay(3)
    torch.testing.assert_close(out, _reference(query, kc, vc, table, [20, 5, 0]))
    assert decodes.update(3, [64, 1, 33]) == 1 and task.updates == 1
    decodes.replay(3)
    torch.testing.assert_close(out, _reference(query, kc, vc, table, [64, 1, 33]))
    with pytest.raises(ValueError, match="3 requests"):
        decodes.update(3, [1, 2])
    assert task.lens == [64, 1, 33] and task.updates == 1  # nothing re-issued
    # A task captured over a row prefix of its size takes the prefix's lengths.
    prefix_out = torch.zeros_like(query[:2])
    decodes.run("prefix", 3, True, query[:2], kc, vc, table[:2], lens[:2], [3, 4], D**-0.5, prefix_out)
    assert decodes.update(3, [9, 10, 11]) == 2
    assert [t.lens for t in decodes.tasks(3)] == [[9, 10, 11], [9, 10]]
    decodes.replay(3)
    torch.testing.assert_close(prefix_out, _reference(query[:2], kc, vc, table[:2], [9, 10]))
    # Capturing the same layer at the same size again replaces its task; another size is separate.
    decodes.run(owner, 3, True, query, kc, vc, table, lens, [1, 1, 1], D**-0.5, out)
    assert len(decodes.tasks(3)) == 2 and decodes.tasks(3)[0].lens == [1, 1, 1]
    assert decodes.tasks(4) == () and decodes.update(4, [1]) == 0
    # Not capturing: one eager call, nothing registered.
    decodes.run(object(), 5, False, query, kc, vc, table, lens, [2, 2, 2], D**-0.5, out)
    assert decodes.tasks(5) == ()


class _NpuRecorder:
    """``torch.npu`` and the fused-infer kernel as recorders: every call lands in ``log`` in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self.handles = 0
        log = self.log

        class Event:
            def wait(self, stream: Any) -> None:
                log.append(("event.wait", stream))

            def reset(self, stream: Any) -> None:
                log.append(("event.reset", stream))

            def record(self, stream: Any) -> None:
                log.append(("event.record", stream))

        class Stream:
            def __init__(self, name: str) -> None:
                self.name = name

            def wait_stream(self, other: Any) -> None:
                log.append(("stream.wait_stream", self.name))

            def __repr__(self) -> str:
                return self.name

        def group_end(stream: Any) -> int:
            self.handles += 1
            log.append(("group_end", self.handles))
            return self.handles

        @contextlib.contextmanager
        def stream_ctx(stream: Any):  # type: ignore[no-untyped-def]
            log.append(("stream.enter", stream))
            yield

        self.main, self.side = Stream("main"), Stream("side")
        self.npu = SimpleNamespace(
            ExternalEvent=Event,
            current_stream=lambda: self.main,
            stream=stream_ctx,
            graph_task_group_begin=lambda stream: log.append(("group_begin", stream)),
            graph_task_group_end=group_end,
            graph_task_update_begin=lambda stream, handle: log.append(("update_begin", handle)),
            graph_task_update_end=lambda stream: log.append(("update_end", stream)),
        )

    def paged_decode_out(self, query, key_cache, value_cache, block_table, out, workspace, softmax_lse, *,  # type: ignore[no-untyped-def]
                         seq_lens_kv, scale):  # fmt: skip
        self.log.append(("fia.out", list(seq_lens_kv)))
        assert query.dim() == 4 and out.dim() == 4 and query.shape[2] == 1
        assert block_table.dtype == torch.int32
        assert int(block_table.min()) >= 0 and int(block_table.max()) < key_cache.shape[0]  # sanitized
        assert (out, workspace, softmax_lse) == self.buffers  # the buffers made before the group

    def paged_decode_buffers(self, query, key_cache, value_cache, block_table, scale):  # type: ignore[no-untyped-def]
        self.log.append(("buffers", None))
        self.buffers = (torch.full_like(query, 5.0), torch.empty(8), torch.empty(0))
        return self.buffers


def test_npu_task_group_holds_one_kernel_call_and_updates_reissue_it(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _NpuRecorder()
    monkeypatch.setattr(torch, "npu", rec.npu, raising=False)
    monkeypatch.setattr(kernels, "uses_npu_kernels", lambda tensor: True)
    monkeypatch.setattr(kernels, "paged_decode_out", rec.paged_decode_out)
    monkeypatch.setattr(kernels, "paged_decode_buffers", rec.paged_decode_buffers)
    sanitized: list[int] = []
    real_sanitize = large_head.sanitize_block_table

    def sanitize(*args: Any) -> torch.Tensor:
        sanitized.append(len(rec.log))
        return real_sanitize(*args)

    monkeypatch.setattr(large_head, "sanitize_block_table", sanitize)
    query, kc, vc, table, lens = _case([20, 5, 0])
    table[2] = -7  # garbage in a padding row: sanitized to block 0 before the task
    query = query.to(torch.bfloat16)
    kc, vc = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    out = torch.full_like(query, float("nan"))
    decodes = routed_decode.RoutedDecodes()
    decodes.run("layer", 3, True, query, kc, vc, table, lens, [20, 5, 0], 0.125, out)

    names = [name for name, _ in rec.log]
    begin, end = names.index("group_begin"), names.index("group_end")
    assert names[begin + 1 : end] == ["fia.out"]  # exactly one kernel call inside the group
    assert sanitized and sanitized[0] <= begin and names.index("buffers") < begin
    assert names[:begin][-2:] == ["event.wait", "event.reset"]
    assert rec.log[begin + 1] == ("fia.out", [20, 5, 0])
    # Copied out after the group (the recorder's kernel leaves its output at 5.0); the 0-length row zeroed.
    assert not out[2].any() and out[:2].eq(5.0).all()
    [task] = decodes.tasks(3)
    handle = task.npu.handle

    rec.log.clear()
    assert decodes.update(3, [40, 0, 7], rec.side) == 1
    decodes.arm(3, rec.side)  # the update armed the event: nothing more to record
    assert rec.log == [
        ("stream.wait_stream", "side"),
        ("stream.enter", rec.side),
        ("update_begin", handle),
        ("fia.out", [40, 0, 7]),
        ("update_end", rec.side),
        ("event.record", rec.side),
    ]
    rec.log.clear()
    decodes.arm(3, rec.side)  # a step without an update: the event is still recorded before replay
    assert [name for name, _ in rec.log] == ["stream.wait_stream", "event.record"]
    decodes.replay(3)  # device tasks replay inside the device graph: nothing runs here
    assert [name for name, _ in rec.log] == ["stream.wait_stream", "event.record"]


class _Layer:
    """What the watch check reads of a routed layer: vllm-ascend's ``key_cache`` / ``value_cache``."""

    def __init__(self, kc: torch.Tensor, vc: torch.Tensor) -> None:
        self.key_cache, self.value_cache = kc, vc


def _captured(lens: list[int]) -> tuple[routed_decode.RoutedDecodes, _Layer, tuple[torch.Tensor, ...]]:
    decodes = routed_decode.RoutedDecodes()
    query, kc, vc, table, seq = _case(lens)
    layer = _Layer(kc, vc)
    out = torch.zeros_like(query)
    decodes.run(layer, 3, True, query, kc, vc, table, seq, lens, D**-0.5, out)
    return decodes, layer, (query, kc, vc, table, seq, out)


def test_routed_tasks_are_graphbuf_captured_tasks_reissued_only_when_changed() -> None:
    decodes, _, _ = _captured([20, 5, 0])
    [task] = decodes.tasks(3)
    assert task.task.kind is TaskKind.PAGED_ATTENTION and task.task.host_args["seq_lens_kv"] == [20, 5, 0]
    assert decodes.update(3, [20, 5, 0]) == 0 and task.updates == 0  # unchanged: not re-issued
    assert decodes.update(3, [21, 5, 0]) == 1 and task.updates == 1


def test_watch_check_names_the_layer_and_tensor_before_the_update() -> None:
    decodes, layer, (_, kc, vc, _, _, out) = _captured([20, 5, 0])
    decodes.check(3)  # nothing moved
    labels = decodes.watch(3).labels
    assert len(labels) == 8 and labels[1].endswith("_Layer) at capture size 3: key_cache")
    # The layer's KV cache replaced by a new allocation (vLLM re-initialising caches): refused.
    layer.key_cache = kc.clone()
    with pytest.raises(AddressChangedError, match=r"routed decode layer #0 \(_Layer\) .*: key_cache moved"):
        decodes.check(3)
    layer.key_cache = kc
    layer.value_cache = None
    with pytest.raises(LivenessError, match=r"layer #0 .*value_cache was released"):
        decodes.check(3)
    layer.value_cache = vc
    # A captured tensor rebound in place (set_) or resized: the watch names it.
    out.set_(torch.zeros_like(out))
    with pytest.raises(AddressChangedError, match=r"layer #0 .*: output moved"):
        decodes.check(3)
    assert decodes.tasks(3)[0].updates == 0


def test_watch_check_cost_per_routed_layer() -> None:
    """Figures only (no timing assertion): the per-step check at Gemma4-31B's 10 full layers."""
    decodes = routed_decode.RoutedDecodes()
    query, kc, vc, table, seq = _case([20, 5, 0])
    layers = [_Layer(kc, vc) for _ in range(10)]
    for layer in layers:
        decodes.run(layer, 3, True, query, kc, vc, table, seq, [20, 5, 0], D**-0.5, torch.zeros_like(query))
    decodes.check(3)
    reps = 200
    start = time.perf_counter()
    for _ in range(reps):
        decodes.check(3)
    check_us = (time.perf_counter() - start) / reps * 1e6
    start = time.perf_counter()
    for i in range(reps):
        decodes.update(3, [20 + i % 2, 5, 0])
    update_us = (time.perf_counter() - start) / reps * 1e6
    print(
        f"watch check: {check_us:.1f} us per step, {check_us / 10:.2f} us per routed layer; "
        f"software update: {update_us:.1f} us per step"
    )
