"""Large-head attention with the real Ascend kernels, captured in an NPU graph, then replayed after the query,
KV, sequence lengths and block tables were changed in place; compared with CPU FP32 SDPA per visible prefix.

Verify runs ``npu_fusion_attention`` (BNSD) with a boolean mask built from DEVICE sequence lengths; decode
runs the paged ``npu_fused_infer_attention_score`` (BNSD) whose host KV lengths a graph task update refreshes.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import BLOCK, BLOCKS, HEAD_DIM, Q_HEADS, TOL, WIDTH, make_case, sdpa_reference

from graphbuf.adapters.vllm_ascend import kernels
from graphbuf.adapters.vllm_ascend import large_head as lh

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not kernels.npu_available(), reason="needs torch_npu and an NPU"),
]


def _case(seq_lens, q_len, dtype, seed, device="npu"):
    return make_case(seq_lens, q_len, dtype, seed, device)


def _capture(fn):
    torch.npu.synchronize()
    fn()  # warm-up outside the graph
    torch.npu.synchronize()
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        out = fn()
    return out, graph


UPDATES = ((2, [512, 0, 129]), (3, [1, 4, 385]), (4, [200, 77, 512]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["dense", "blockwise", "decode_device_lengths"])
def test_npu_graph_replay_after_in_place_changes(path, dtype):
    q_len = 1 if path.startswith("decode") else 4
    scale = 1.0 / math.sqrt(HEAD_DIM)
    static = _case([300, 5, 0], q_len, dtype, seed=1)

    def run():
        if path == "dense":
            return lh.verify_attention(*static, q_len, scale)
        if path == "blockwise":
            return lh.verify_attention_blockwise(*static, q_len, scale, chunk_blocks=1)
        return lh.decode_attention(*static, scale)  # no host lengths: gather + fusion attention

    out, graph = _capture(run)
    addresses = [t.data_ptr() for t in static] + [out.data_ptr()]
    for seed, lens in UPDATES:
        for dst, src in zip(static, _case(lens, q_len, dtype, seed), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.npu.synchronize()
        assert [t.data_ptr() for t in static] + [out.data_ptr()] == addresses
        torch.testing.assert_close(out.float().cpu(), sdpa_reference(*static, q_len, scale), **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_npu_paged_decode_task_update_with_host_lengths(dtype):
    scale = 1.0 / math.sqrt(HEAD_DIM)
    start = [300, 5, 1]
    query, kc, vc, table, lens = _case(start, 1, dtype, seed=1)
    ids = lh.sanitize_block_table(table, lens, BLOCKS, BLOCK)
    q_bnsd = query.unsqueeze(2).contiguous()
    out = torch.empty_like(q_bnsd)
    lse = torch.empty(1, dtype=dtype, device=q_bnsd.device)
    workspace = kernels.paged_decode_workspace(q_bnsd, kc, vc, ids, start, scale)
    graph = torch.npu.NPUGraph()
    event = torch.npu.ExternalEvent()
    update_stream = torch.npu.Stream()
    torch.npu.synchronize()
    with torch.npu.graph(graph):
        stream = torch.npu.current_stream()
        ids.copy_(lh.sanitize_block_table(table, lens, BLOCKS, BLOCK))  # refreshed in the graph
        event.wait(stream)
        event.reset(stream)
        torch.npu.graph_task_group_begin(stream)
        kernels.paged_decode_bnsd(
            q_bnsd, kc, vc, ids, start, scale, out=out, workspace=workspace, softmax_lse=lse
        )
        handle = torch.npu.graph_task_group_end(stream)

    for seed, new_lens in UPDATES:
        new_lens = [max(n, 1) for n in new_lens]
        fresh = _case(new_lens, 1, dtype, seed)
        for dst, src in zip((query, kc, vc, table, lens), fresh, strict=True):
            dst.copy_(src)
        q_bnsd.copy_(query.unsqueeze(2))
        with torch.npu.stream(update_stream):
            torch.npu.graph_task_update_begin(update_stream, handle)
            kernels.paged_decode_bnsd(
                q_bnsd, kc, vc, ids, new_lens, scale, out=out, workspace=workspace, softmax_lse=lse
            )
            torch.npu.graph_task_update_end(update_stream)
            event.record(update_stream)
        graph.replay()
        torch.npu.synchronize()
        expected = sdpa_reference(query, kc, vc, table, lens, 1, scale)
        torch.testing.assert_close(out.squeeze(2).float().cpu(), expected, **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_npu_decode_entry_with_host_lengths_matches_reference(dtype):
    scale = 1.0 / math.sqrt(HEAD_DIM)
    query, kc, vc, table, lens = _case([300, 5, 0, 512], 1, dtype, seed=7)
    out = lh.decode_attention(query, kc, vc, table, lens, scale, seq_lens_host=[300, 5, 0, 512])
    torch.testing.assert_close(out.float().cpu(), sdpa_reference(query, kc, vc, table, lens, 1, scale), **TOL)


def test_npu_fusion_attention_bnsd_mask_from_device_lengths_matches_software_kernel():
    scale = 1.0 / math.sqrt(HEAD_DIM)
    query, kc, vc, table, lens = _case([300, 130, 4], 4, torch.bfloat16, seed=8)
    ids = lh.sanitize_block_table(table, lens, BLOCKS, BLOCK)
    key, value = lh.gather_kv_bnsd(kc, vc, ids)
    hidden = lh.hidden_mask(lens, 4, 0, WIDTH * BLOCK).unsqueeze(1)
    q_bnsd = query.view(3, 4, Q_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    npu = kernels.masked_attention_bnsd(q_bnsd, key, value, hidden, scale)
    software = torch.ops.graphbuf.masked_attention_bnsd(
        q_bnsd.cpu(), key.cpu(), value.cpu(), hidden.cpu(), scale
    )
    torch.testing.assert_close(npu.float().cpu(), software.float(), **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_npu_paged_decode_through_graphbuf_task(dtype):
    from graphbuf.graphs.graph import Graph

    scale = 1.0 / math.sqrt(HEAD_DIM)
    start = [300, 5, 1]
    query, kc, vc, table, lens = _case(start, 1, dtype, seed=11)
    ids = lh.sanitize_block_table(table, lens, BLOCKS, BLOCK)
    q_bnsd = query.unsqueeze(2).contiguous()
    out = torch.empty_like(q_bnsd)
    lse = torch.empty(1, dtype=dtype, device=q_bnsd.device)
    workspace = kernels.paged_decode_workspace(q_bnsd, kc, vc, ids, start, scale)

    def attend(q, k, v, block_ids, out, workspace, lse, *, seq_lens_host, scale):
        kernels.paged_decode_bnsd(
            q, k, v, block_ids, seq_lens_host, scale, out=out, workspace=workspace, softmax_lse=lse
        )

    graph = Graph("npu")
    with graph.capture():
        ids.copy_(lh.sanitize_block_table(table, lens, BLOCKS, BLOCK))
        q_bnsd.copy_(query.unsqueeze(2))
        task = graph.task(
            "paged_attention",
            attend,
            q_bnsd,
            kc,
            vc,
            ids,
            out,
            workspace,
            lse,
            seq_lens_host=start,
            scale=scale,
        )
    for seed, new_lens in ((12, [512, 1, 129]), (13, [1, 385, 4])):
        for dst, src in zip((query, kc, vc, table, lens), _case(new_lens, 1, dtype, seed), strict=True):
            dst.copy_(src)
        task.update(seq_lens_host=new_lens, scale=scale)
        graph.replay()
        torch.npu.synchronize()
        expected = sdpa_reference(query, kc, vc, table, lens, 1, scale)
        torch.testing.assert_close(out.squeeze(2).float().cpu(), expected, **TOL)
