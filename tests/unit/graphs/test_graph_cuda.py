"""Graph("cuda"): torch.cuda.CUDAGraph behind the graphbuf facade. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from graphbuf.errors import CaptureError
from graphbuf.graphs.graph import Graph

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _no_modes_left() -> bool:
    return not _get_current_function_mode_stack() and not _get_current_dispatch_mode_stack()


def test_capture_replay_sees_inplace_input_update() -> None:
    x = torch.arange(8.0, device="cuda")
    g = Graph("cuda")
    with g.capture():
        y = x * 2 + 1
    ptr = y.data_ptr()
    x.copy_(torch.full((8,), 3.0, device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert g.captured and y.data_ptr() == ptr
    assert torch.equal(y, torch.full((8,), 7.0, device="cuda"))


def test_pool_shared_between_graphs_of_different_sizes() -> None:
    xb, xs = torch.randn(4096, device="cuda"), torch.randn(64, device="cuda")
    big, small = Graph("cuda"), Graph("cuda")
    with big.capture():
        yb = torch.relu(xb) * 2
    with small.capture(pool=big.pool()):
        ys = torch.relu(xs) * 2
    xb.copy_(torch.randn(4096, device="cuda"))
    xs.copy_(torch.randn(64, device="cuda"))
    big.replay()
    small.replay()
    torch.cuda.synchronize()
    assert torch.allclose(yb, torch.relu(xb) * 2)
    assert torch.allclose(ys, torch.relu(xs) * 2)


def test_pool_handle_before_capture_is_shared() -> None:
    first, second = Graph("cuda"), Graph("cuda")
    handle = first.pool()  # taken before capture: first captures into it too
    x = torch.ones(16, device="cuda")
    with first.capture():
        a = x + 1
    with second.capture(pool=handle):
        b = x + 2
    first.replay()
    second.replay()
    torch.cuda.synchronize()
    assert torch.equal(a + 1, b)


def test_host_read_raises_and_graph_can_capture_again() -> None:
    x = torch.ones(4, device="cuda")
    g = Graph("cuda")
    with pytest.raises(CaptureError, match="item"), g.capture():
        x.sum().item()
    assert not g.captured and _no_modes_left()
    with pytest.raises(CaptureError), g.capture():
        x.cpu()
    with pytest.raises(CaptureError, match="nonzero"), g.capture():
        torch.nonzero(x)
    with g.capture():
        y = x + 1
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full((4,), 2.0, device="cuda"))


def test_task_with_host_args_is_refused_at_capture() -> None:
    """A CUDA graph cannot re-issue one task with new host arguments: refused at capture, not at run()."""
    x = torch.arange(12.0, device="cuda").reshape(3, 4)
    out = torch.zeros(3, device="cuda")

    def row_sums(x: torch.Tensor, out: torch.Tensor, *, seq_lens: list[int]) -> None:
        for i, n in enumerate(seq_lens):
            out[i] = x[i, :n].sum()

    g = Graph("cuda")
    match = r"host arguments \['seq_lens'\] cannot be captured on cuda"
    with pytest.raises(CaptureError, match=match), g.capture():
        g.task("attention", row_sums, x, out, seq_lens=[1, 2, 3])
    assert not g.captured and torch.cuda.current_stream() == torch.cuda.default_stream()
    with g.capture():  # without host arguments a task captures
        g.task("custom", lambda a, b: b.copy_(a.sum(1)), x, out)
    g.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [6.0, 22.0, 38.0]
