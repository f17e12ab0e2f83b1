"""Graph("npu"): torch.npu.NPUGraph and NPU task groups. Skipped without torch_npu and an Ascend NPU.

The task tests use graphbuf's paged decode (one FIA ``.out`` per task group) with distinct KV lengths >= 100,
checked against an independent reference at the captured and the updated lengths, so a task update that does
not reach the device fails them."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from attention_cases import BLOCK, BLOCKS, HEAD_DIM, TOL, WIDTH, make_case, sdpa_reference

from graphbuf.errors import DeviceUnavailableError
from graphbuf.graphs.graph import Graph


def _npu_ready() -> bool:
    try:
        importlib.import_module("torch_npu")
    except (ImportError, OSError, RuntimeError):
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


NPU = _npu_ready()
needs_npu = pytest.mark.skipif(not NPU, reason="needs torch_npu and an Ascend NPU")
pytestmark = pytest.mark.npu
SCALE = 1.0 / math.sqrt(HEAD_DIM)


@pytest.mark.skipif(NPU, reason="checks the error raised without an NPU")
def test_npu_unavailable_raises_clear_error() -> None:
    with pytest.raises(DeviceUnavailableError, match=r"torch_npu|NPU"):
        Graph("npu")


@needs_npu
def test_capture_replay_sees_inplace_input_update() -> None:
    x = torch.arange(8.0, device="npu")
    g = Graph("npu")
    with g.capture():
        y = x * 2 + 1
    x.copy_(torch.full((8,), 3.0, device="npu"))
    g.replay()
    torch.npu.synchronize()
    assert torch.equal(y.cpu(), torch.full((8,), 7.0))


def _distinct_lengths(batch: int, seed: int) -> list[int]:
    """``batch`` distinct KV lengths, each >= 100 and within the block table."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(WIDTH * BLOCK - 100, generator=g)[:batch] + 100).tolist()


def _capture_paged_decode(g: Graph, static, lengths: list[int]):
    """One task of exactly one FIA .out over ``static`` (block table already sanitized), its buffers
    allocated in the capture before the group."""
    from graphbuf.adapters.vllm_ascend.kernels import attention as kernels

    query, kc, vc, table, _ = static
    q = query.unsqueeze(2)
    with torch.no_grad(), g.capture():
        out, workspace, lse = kernels.paged_decode_buffers(q, kc, vc, table, SCALE)
        task = g.task(
            "paged_attention", kernels.paged_decode_out, q, kc, vc, table, out, workspace, lse,
            seq_lens_kv=lengths, scale=SCALE,
        )  # fmt: skip
    return task, out


def _sanitized_case(lengths: list[int], seed: int, device: str = "npu"):
    from graphbuf.adapters.vllm_ascend.bindings import large_head as lh

    static = make_case(lengths, 1, torch.bfloat16, seed, device)
    static[3] = lh.sanitize_block_table(static[3], static[4], BLOCKS, BLOCK)
    return static


def _reference(static) -> torch.Tensor:
    return sdpa_reference(*static, 1, SCALE)


@needs_npu
def test_task_replays_baked_lengths_until_updated_and_the_output_moves() -> None:
    first, second = _distinct_lengths(4, 1), _distinct_lengths(4, 2)
    static = _sanitized_case(first, 3)
    g = Graph("npu")
    task, out = _capture_paged_decode(g, static, first)
    assert task.handle is not None
    g.replay()  # no update: the captured lengths
    torch.npu.synchronize()
    at_first = out.squeeze(2).float().cpu()
    torch.testing.assert_close(at_first, _reference(static), **TOL)
    # Same query and caches (same seed), new lengths and table rows: only the update can move the output.
    for dst, src in zip(static, _sanitized_case(second, 3), strict=True):
        dst.copy_(src)
    task.update(seq_lens_kv=second, scale=SCALE)
    g.replay()
    torch.npu.synchronize()
    torch.testing.assert_close(out.squeeze(2).float().cpu(), _reference(static), **TOL)
    assert not torch.allclose(out.squeeze(2).float().cpu(), at_first, **TOL)
    g.replay()  # the update persists; replay records the event again
    torch.npu.synchronize()
    torch.testing.assert_close(out.squeeze(2).float().cpu(), _reference(static), **TOL)


@needs_npu
def test_update_replay_loop_without_host_sync_matches_eager_every_step() -> None:
    from graphbuf.adapters.vllm_ascend.kernels import attention as kernels

    steps = 8
    lengths = [_distinct_lengths(4, 10 + k) for k in range(steps)]
    cases = [_sanitized_case(n, 20 + k) for k, n in enumerate(lengths)]  # on the device before the loop
    static = [t.clone() for t in cases[0]]
    g = Graph("npu")
    task, out = _capture_paged_decode(g, static, lengths[0])
    torch.npu.synchronize()
    graphed, eager = [], []
    for case, lens in zip(cases, lengths, strict=True):  # no host sync inside the loop
        for dst, src in zip(static, case, strict=True):
            dst.copy_(src)
        task.update(seq_lens_kv=lens, scale=SCALE)
        g.replay()
        graphed.append(out.clone())
        q = static[0].unsqueeze(2)
        eager.append(kernels.paged_decode_bnsd(q, static[1], static[2], static[3], lens, SCALE).clone())
    torch.npu.synchronize()
    for k, (got, want) in enumerate(zip(graphed, eager, strict=True)):
        torch.testing.assert_close(got.cpu(), want.cpu(), **TOL, msg=f"step {k}")
        torch.testing.assert_close(got.squeeze(2).float().cpu(), _reference(cases[k]), **TOL, msg=f"step {k}")


@pytest.mark.skipif(not NPU or torch.npu.device_count() < 2, reason="needs two NPUs")
def test_update_on_a_graph_of_another_device_than_the_current() -> None:
    first, second = _distinct_lengths(2, 5), _distinct_lengths(2, 6)
    static = _sanitized_case(first, 7, device="npu:1")
    g = Graph("npu:1")  # the current device stays npu:0
    task, out = _capture_paged_decode(g, static, first)
    for dst, src in zip(static, _sanitized_case(second, 7, device="npu:1"), strict=True):
        dst.copy_(src)
    task.update(seq_lens_kv=second, scale=SCALE)
    g.replay()
    torch.npu.synchronize("npu:1")
    torch.testing.assert_close(out.squeeze(2).float().cpu(), _reference(static), **TOL)
