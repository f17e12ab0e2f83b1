"""Large-head attention with the real Ascend kernels, captured in an NPU graph, then replayed after the query,
KV, sequence lengths and block tables were changed in place; compared with CPU FP32 SDPA per visible prefix.

Verify runs ``npu_fusion_attention_v3`` (BNSD) with a boolean mask built from DEVICE sequence lengths; decode
runs the paged ``npu_fused_infer_attention_score.out`` (BNSD), the one op of a task group whose host KV
lengths a graph task update refreshes, with distinct lengths >= 100 so an update that does not reach the
device fails.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import BLOCK, BLOCKS, HEAD_DIM, Q_HEADS, TOL, WIDTH, make_case, sdpa_reference

from graphbuf.adapters.vllm_ascend.bindings import large_head as lh
from graphbuf.adapters.vllm_ascend.kernels import attention as kernels

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
        return lh.decode_attention(*static, scale)  # no host lengths: gather + fusion attention v3

    out, graph = _capture(run)
    addresses = [t.data_ptr() for t in static] + [out.data_ptr()]
    for seed, lens in UPDATES:
        for dst, src in zip(static, _case(lens, q_len, dtype, seed), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.npu.synchronize()
        assert [t.data_ptr() for t in static] + [out.data_ptr()] == addresses
        torch.testing.assert_close(out.float().cpu(), sdpa_reference(*static, q_len, scale), **TOL)


def _distinct_lengths(batch: int, seed: int) -> list[int]:
    """``batch`` distinct KV lengths, each >= 100 and within the block table."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(WIDTH * BLOCK - 100, generator=g)[:batch] + 100).tolist()


def _capture_binding_decode(static, lengths):
    from graphbuf.adapters.vllm_ascend.bindings.attention_tasks import LargeHeadBinding
    from graphbuf.graphs.graph import Graph
    from graphbuf.graphs.runner import Step

    query, kc, vc, table, lens = static
    out = torch.zeros_like(query)
    binding = LargeHeadBinding(group=None, q_len=1, scale=1.0 / math.sqrt(HEAD_DIM))
    step_host = {"attention": {"seq_lens_kv": list(lengths)}}
    graph = Graph("npu")
    views = {"block_table": table, "seq_lens": lens}
    with torch.no_grad(), graph.capture():
        binding.decode(Step(len(lengths), views, graph, step_host, 0), query, kc, vc, out)
    return graph, out, binding.scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_npu_binding_decode_update_moves_output_at_distinct_lengths(dtype):
    """The binding's decode task (one FIA .out per group, workspace for the longest KV length): captured at
    one set of distinct lengths >= 100, updated to another; both checked against the reference."""
    first, second = _distinct_lengths(4, 1), _distinct_lengths(4, 2)
    static = _case(first, 1, dtype, seed=21)
    graph, out, scale = _capture_binding_decode(static, first)
    graph.replay()
    torch.npu.synchronize()
    at_first = out.float().cpu()
    torch.testing.assert_close(at_first, sdpa_reference(*static, 1, scale), **TOL)
    for dst, src in zip(static, _case(second, 1, dtype, seed=21), strict=True):  # same query and caches
        dst.copy_(src)
    assert graph.update_tasks("attention", seq_lens_kv=second, scale=scale) == 1
    graph.replay()
    torch.npu.synchronize()
    torch.testing.assert_close(out.float().cpu(), sdpa_reference(*static, 1, scale), **TOL)
    assert not torch.allclose(out.float().cpu(), at_first, **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_npu_binding_decode_update_replay_loop_without_host_sync(dtype):
    """Back-to-back update -> replay, no host sync inside the loop, each step compared with eager decode."""
    steps = 8
    lengths = [_distinct_lengths(3, 30 + k) for k in range(steps)]
    cases = [_case(n, 1, dtype, seed=40 + k) for k, n in enumerate(lengths)]  # on the device before the loop
    static = [t.clone() for t in cases[0]]
    graph, out, scale = _capture_binding_decode(static, lengths[0])
    torch.npu.synchronize()
    graphed, eager = [], []
    for case, lens in zip(cases, lengths, strict=True):
        for dst, src in zip(static, case, strict=True):
            dst.copy_(src)
        graph.update_tasks("attention", seq_lens_kv=lens, scale=scale)
        graph.replay()
        graphed.append(out.clone())
        eager.append(lh.decode_attention(*static, scale, seq_lens_host=lens))
    torch.npu.synchronize()
    for k, (got, want) in enumerate(zip(graphed, eager, strict=True)):
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), **TOL, msg=f"step {k}")
        reference = sdpa_reference(*cases[k], 1, scale)
        torch.testing.assert_close(got.float().cpu(), reference, **TOL, msg=f"step {k}")


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
