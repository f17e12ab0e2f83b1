"""Large-head attention captured in a CUDA graph with the software kernel, then replayed after the query, KV,
sequence lengths and block tables were changed in place; compared with CPU FP32 SDPA per visible prefix."""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import BLOCK, HEAD_DIM, KV_HEADS, Q_HEADS, TOL, WIDTH, make_case, sdpa_reference

from graphbuf.adapters.vllm_ascend.bindings import large_head as lh

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _case(seq_lens, q_len, dtype, seed, device="cuda"):
    return make_case(seq_lens, q_len, dtype, seed, device)


def _capture(fn):
    """Warm ``fn`` up on a side stream, then capture it with graphbuf's Graph("cuda") (or, without
    graphbuf.graphs.graph, torch.cuda.CUDAGraph); return (out, replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        from graphbuf.graphs.graph import Graph
    except ImportError:
        Graph = None
    if Graph is not None:
        graph = Graph("cuda")
        with graph.capture():
            out = fn()
        return out, graph.replay
    raw = torch.cuda.CUDAGraph()
    with torch.cuda.graph(raw):
        out = fn()
    return out, raw.replay


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("path", ["dense", "blockwise", "decode"])
def test_cuda_graph_replay_after_in_place_changes(path, dtype):
    q_len = 1 if path == "decode" else 4
    scale = 1.0 / math.sqrt(HEAD_DIM)
    static = _case([300, 5, 0], q_len, dtype, seed=1)

    def run():
        if path == "decode":
            return lh.decode_attention(*static, scale)
        if path == "dense":
            return lh.verify_attention(*static, q_len, scale)
        return lh.verify_attention_blockwise(*static, q_len, scale, chunk_blocks=1)

    out, replay = _capture(run)
    addresses = [t.data_ptr() for t in static] + [out.data_ptr()]
    for seed, lens in ((2, [512, 0, 129]), (3, [1, 4, 385]), (4, [0, 0, 0]), (5, [200, 77, 512])):
        for dst, src in zip(static, _case(lens, q_len, dtype, seed), strict=True):
            dst.copy_(src)
        replay()
        torch.cuda.synchronize()
        assert [t.data_ptr() for t in static] + [out.data_ptr()] == addresses
        expected = sdpa_reference(*static, q_len, scale)
        torch.testing.assert_close(out.float().cpu(), expected, **TOL)


def test_cuda_blockwise_peak_memory_within_estimate():
    batch, q_len, chunk = 3, 4, 1
    static = _case([512, 129, 0], q_len, torch.bfloat16, seed=6)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    lh.verify_attention_blockwise(*static, q_len, scale, chunk_blocks=chunk)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = lh.verify_attention_blockwise(*static, q_len, scale, chunk_blocks=chunk)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
    estimate = lh.verify_workspace_bytes(
        batch, q_len, WIDTH, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16, chunk, num_heads=Q_HEADS
    )
    assert peak <= estimate["blockwise"] * 1.25 + (1 << 20)
    assert estimate["blockwise"] < estimate["dense"]
