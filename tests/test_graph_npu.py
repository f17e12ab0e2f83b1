"""Graph("npu"): torch.npu.NPUGraph and NPU task groups. Skipped without torch_npu and an Ascend NPU."""

from __future__ import annotations

import importlib

import pytest
import torch

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


def _fia_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    shape = (1, 32, 1, 128)
    return tuple(torch.randn(shape, dtype=torch.float16, device="npu") for _ in range(3))  # type: ignore[return-value]


def _fia_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    import torch_npu

    out = torch_npu.npu_fused_infer_attention_score(
        q,
        k,
        v,
        num_heads=32,
        input_layout="BNSD",
        scale=1 / 0.0078125,
        pre_tokens=65535,
        next_tokens=65535,
        softmax_lse_flag=False,
        actual_seq_lengths=lens,
    )[0]
    torch.npu.synchronize()
    return out.cpu()


def _capture_fia(g: Graph, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]):
    import torch_npu

    def fia(q, k, v, workspace, out, lse, *, actual_seq_lengths):  # type: ignore[no-untyped-def]
        torch_npu.npu_fused_infer_attention_score.out(
            q,
            k,
            v,
            workspace=workspace,
            num_heads=32,
            input_layout="BNSD",
            scale=1 / 0.0078125,
            pre_tokens=65535,
            next_tokens=65535,
            softmax_lse_flag=False,
            actual_seq_lengths=actual_seq_lengths,
            out=[out, lse],
        )

    with torch.no_grad(), g.capture():
        workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
            q,
            k,
            v,
            num_heads=32,
            input_layout="BNSD",
            scale=1 / 0.0078125,
            pre_tokens=65535,
            next_tokens=65535,
            softmax_lse_flag=False,
            actual_seq_lengths=lens,
        )
        out = torch.empty_like(q)
        lse = torch.empty(1, dtype=torch.float16, device="npu")
        task = g.task("attention", fia, q, k, v, workspace, out, lse, actual_seq_lengths=lens)
    return task, out


@needs_npu
def test_task_group_replays_baked_host_args() -> None:
    q, k, v = _fia_inputs()
    g = Graph("npu")
    task, out = _capture_fia(g, q, k, v, [29])
    assert task.handle is not None
    g.replay()  # no update: the event is recorded by replay itself, the captured [29] is used
    torch.npu.synchronize()
    assert torch.equal(out.cpu(), _fia_eager(q, k, v, [29]))


@needs_npu
def test_task_group_update_reissues_with_new_host_args() -> None:
    q, k, v = _fia_inputs()
    g = Graph("npu")
    task, out = _capture_fia(g, q, k, v, [29])
    task.update(actual_seq_lengths=[100])
    g.replay()
    torch.npu.synchronize()
    assert torch.equal(out.cpu(), _fia_eager(q, k, v, [100]))
    g.replay()  # the update persists; replay records the event again
    torch.npu.synchronize()
    assert torch.equal(out.cpu(), _fia_eager(q, k, v, [100]))
