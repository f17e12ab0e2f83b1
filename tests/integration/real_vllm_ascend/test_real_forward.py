"""The real ``AscendAttentionBackendImpl.forward_impl`` and ``update_graph_params``, patched (issue 10, §1).

Routed outputs are compared with an independent float64 reference over the paged cache (bf16 tolerance
rtol = atol = 0.015). Under a FULL-graph capture forward context the routed layer runs graphbuf's kernels and
registers no fused-attention task; eagerly it runs vllm-ascend's own path (the stub records the kernel).
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch_npu_stub
from real_fixtures import (
    FULL_HEAD,
    FULL_KV_HEADS,
    FULL_LAYER,
    KERNEL_BLOCK,
    LEGACY_MECHANISM,
    NUM_HEADS,
    SLIDING_HEAD,
    SLIDING_KV_HEADS,
    SLIDING_LAYER,
    UPDATE_FORMS,
    UPSTREAM,
    gemma4_specs,
    make_builder,
    make_vllm_config,
    random_batch,
    vllm_capture_sizes,
)
from vllm.config import set_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import set_forward_context

import graphbuf.adapters.vllm_ascend.glue.patch as patch
from graphbuf.adapters.vllm_ascend.glue import upstream

av1 = importlib.import_module("vllm_ascend.attention.attention_v1")
acl_graph = importlib.import_module("vllm_ascend.compilation.acl_graph")
FULL = CUDAGraphMode.FULL

Q_LEN = 4
NUM_BLOCKS = 96
MAX_LEN = 2000
WIDTH = -(-5500 // KERNEL_BLOCK)
TOL = {"rtol": 0.015, "atol": 0.015}
SLIDING_AFTER_FULL = SLIDING_LAYER.replace("layers.0.", "layers.6.")
"""A sliding layer after full layer 5 (vllm-ascend orders layer names by index: the full layer is first)."""


def make_impl(
    config: Any, head: int = FULL_HEAD, kv_heads: int = FULL_KV_HEADS, window: int | None = None
) -> Any:
    with set_current_vllm_config(config):
        return av1.AscendAttentionBackendImpl(
            num_heads=NUM_HEADS, head_size=head, scale=head**-0.5, num_kv_heads=kv_heads, alibi_slopes=None,
            sliding_window=window, kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder",
            kv_sharing_target_layer_name=None,
        )  # fmt: skip


def make_cache(gen: torch.Generator, kv_heads: int = FULL_KV_HEADS, head: int = FULL_HEAD) -> tuple[Any, Any]:
    shape = (NUM_BLOCKS, KERNEL_BLOCK, kv_heads, head)
    return tuple(torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(2))  # type: ignore[return-value]


def reference(query: torch.Tensor, cache: tuple[Any, Any], table: torch.Tensor, seq_lens: list[int],
              q_len: int, scale: float) -> torch.Tensor:  # fmt: skip
    """Causal attention of each live request over its paged KV, token by token in float64."""
    key_cache, value_cache = (c.double() for c in cache)
    out = torch.zeros(len(seq_lens) * q_len, query.shape[1], query.shape[2], dtype=torch.float64)
    for r, n in enumerate(seq_lens):
        blocks = table[r, : -(-n // KERNEL_BLOCK)].long()
        k = key_cache[blocks].reshape(-1, *key_cache.shape[2:])[:n]
        v = value_cache[blocks].reshape(-1, *value_cache.shape[2:])[:n]
        rep = query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        for i in range(q_len):
            visible = n - q_len + i + 1
            q = query[r * q_len + i].double()
            s = torch.einsum("hd,khd->hk", q, k[:visible]) * scale
            out[r * q_len + i] = torch.einsum("hk,khd->hd", torch.softmax(s, -1), v[:visible])
    return out


@contextmanager
def full_graph_capture(config: Any, metadata: dict[str, Any], num_tokens: int):
    """vLLM's forward context of a FULL cudagraph capture, with vllm-ascend's ``capturing`` extra set."""
    with set_forward_context(metadata, config, num_tokens=num_tokens, cudagraph_runtime_mode=FULL):
        extra = importlib.import_module("vllm_ascend.ascend_forward_context")._EXTRA_CTX
        extra.capturing = True
        yield


def _fia_calls() -> list[tuple[str, tuple, dict]]:
    return [c for c in torch_npu_stub.CALLS if "attention" in c[0] and not c[0].endswith("get_workspace")]


@pytest.mark.parametrize("q_len", [Q_LEN, 1])
def test_routed_forward_under_full_graph_capture_matches_reference(patched, q_len: int) -> None:
    config = make_vllm_config(capture_sizes=vllm_capture_sizes(16, 3, 8192, 2))
    builder = make_builder(config)
    gen = torch.Generator().manual_seed(10 + q_len)
    cache = make_cache(gen)
    impl = make_impl(config)
    sizes_seen = []
    for live, padded in ((3, 4), (2, 4)):  # DP padding; the second batch reuses the captured addresses
        batch = random_batch(gen, live=live, q_len=q_len, num_blocks=NUM_BLOCKS, max_len=MAX_LEN,
                             padded_reqs=padded, width=WIDTH)  # fmt: skip
        metadata = builder.build(0, batch.common())
        route = getattr(metadata, patch.ROUTE_ATTR)
        assert route.q_len == q_len and route.num_reqs == live
        sizes_seen.append((route.size, route.block_table.data_ptr(), route.seq_lens.data_ptr()))
        size = route.size
        query = torch.randn(size, NUM_HEADS, FULL_HEAD, generator=gen).to(torch.bfloat16)
        output = torch.full((size, NUM_HEADS, FULL_HEAD), float("nan"), dtype=torch.bfloat16)
        torch_npu_stub.CALLS.clear()
        with full_graph_capture(config, {FULL_LAYER: metadata}, size):
            result = impl.forward_impl(query, None, None, cache, metadata, output)
        assert result is output and _fia_calls() == []  # graphbuf's kernels, no fused-attention task
        ref = reference(query, cache, batch.table, batch.seq_lens, q_len, impl.scale)
        torch.testing.assert_close(output[: live * q_len].double(), ref, **TOL)
        assert not output[live * q_len :].any()  # padded requests: zeros
    assert sizes_seen[0] == sizes_seen[1]  # same capture size, same addresses


def test_eager_forward_keeps_vllm_ascends_path(patched) -> None:
    config = make_vllm_config(capture_sizes=vllm_capture_sizes(16, 3, 8192, 2))
    builder = make_builder(config)
    gen = torch.Generator().manual_seed(20)
    batch = random_batch(gen, live=3, q_len=Q_LEN, num_blocks=NUM_BLOCKS, max_len=MAX_LEN, padded_reqs=3,
                         width=WIDTH)  # fmt: skip
    metadata = builder.build(0, batch.common())
    assert getattr(metadata, patch.ROUTE_ATTR).q_len == Q_LEN
    impl = make_impl(config)
    query = torch.randn(12, NUM_HEADS, FULL_HEAD, generator=gen).to(torch.bfloat16)
    output = torch.zeros(12, NUM_HEADS, FULL_HEAD, dtype=torch.bfloat16)
    torch_npu_stub.CALLS.clear()
    marker = 3.0  # what the stubbed upstream kernel "computes"
    torch_npu_stub.RESULTS["npu_fusion_attention"] = lambda *a, **k: (torch.full_like(k["query"], marker),)
    with set_forward_context({FULL_LAYER: metadata}, config, num_tokens=12,
                             cudagraph_runtime_mode=CUDAGraphMode.NONE):  # fmt: skip
        impl.forward_impl(query, None, None, make_cache(gen), metadata, output)
    calls = _fia_calls()
    assert calls, "eager forward did not reach vllm-ascend's fused-attention path"
    assert calls[0][2]["query"].shape[0] == 12
    assert torch.all(output == marker)  # upstream's kernel result, not graphbuf's


def _capture_sliding(config: Any, size: int, gen: torch.Generator) -> tuple[Any, Any, Any]:
    """Capture the sliding layer on vllm-ascend's own path at ``size``: it registers its FIA task."""
    spec = gemma4_specs()[SLIDING_LAYER]
    builder = make_builder(config, spec, SLIDING_AFTER_FULL)
    impl = make_impl(config, SLIDING_HEAD, SLIDING_KV_HEADS, 1024)
    batch = random_batch(gen, live=size // Q_LEN, q_len=Q_LEN, num_blocks=NUM_BLOCKS, max_len=MAX_LEN,
                         padded_reqs=size // Q_LEN, width=WIDTH)  # fmt: skip
    metadata = builder.build(0, batch.common())
    assert getattr(metadata, patch.ROUTE_ATTR, None) is None  # sliding group: never routed
    query = torch.randn(size, NUM_HEADS, SLIDING_HEAD, generator=gen).to(torch.bfloat16)
    output = torch.zeros(size, NUM_HEADS, SLIDING_HEAD, dtype=torch.bfloat16)
    cache = make_cache(gen, SLIDING_KV_HEADS, SLIDING_HEAD)
    impl.key_cache, impl.value_cache = cache  # as AscendAttentionBackendImpl.forward binds them
    with full_graph_capture(config, {SLIDING_AFTER_FULL: metadata}, size):
        impl.forward_impl(query, None, None, cache, metadata, output)
    return builder, impl, metadata


@LEGACY_MECHANISM
@pytest.mark.parametrize("form", UPDATE_FORMS)
def test_update_graph_params_pairs_only_upstream_layers(patched, form: str) -> None:
    """Capture one routed (full, 512) and one upstream (sliding) layer at size 16, then run the real task
    update: the routed layer's metadata is hidden, so vllm-ascend pairs the sliding layer with its task."""
    size = 16
    config = make_vllm_config(capture_sizes=vllm_capture_sizes(16, 3, 8192, 2))
    if acl_graph.get_graph_params() is None:
        acl_graph.set_graph_params(config.compilation_config.cudagraph_capture_sizes)
    params = acl_graph.get_graph_params()
    for table in (params.attn_params, params.handles, params.events):
        table[size].clear()
    gen = torch.Generator().manual_seed(30)
    torch_npu_stub.CALLS.clear()
    sliding_builder, _, _ = _capture_sliding(config, size, gen)
    assert len(params.attn_params[size]) == 1 and len(params.handles[size]) == 1
    handle = params.handles[size][0]
    # The routed layer captured at the same size adds no task.
    full_builder = make_builder(config)
    batch = random_batch(gen, live=4, q_len=Q_LEN, num_blocks=NUM_BLOCKS, max_len=MAX_LEN, padded_reqs=4,
                         width=WIDTH)  # fmt: skip
    full_md = full_builder.build(0, batch.common())
    query = torch.randn(size, NUM_HEADS, FULL_HEAD, generator=gen).to(torch.bfloat16)
    with full_graph_capture(config, {FULL_LAYER: full_md}, size):
        make_impl(config).forward_impl(query, None, None, make_cache(gen), full_md,
                                       torch.zeros_like(query))  # fmt: skip
    assert len(params.attn_params[size]) == 1
    # Replay step: fresh metadata for both groups, the routed layer first (as a dict of layer names).
    new_sliding = random_batch(gen, live=4, q_len=Q_LEN, num_blocks=NUM_BLOCKS, max_len=MAX_LEN,
                               padded_reqs=4, width=WIDTH)  # fmt: skip
    sliding_md = sliding_builder.build(0, new_sliding.common())
    full_md = full_builder.build(0, batch.common())
    attn_metadata = {FULL_LAYER: full_md, SLIDING_AFTER_FULL: sliding_md}
    torch_npu_stub.CALLS.clear()
    with set_forward_context(attn_metadata, config, num_tokens=size, cudagraph_runtime_mode=FULL):
        context = importlib.import_module("vllm.forward_context").get_forward_context()
        stream = torch.npu.Stream()
        update = av1.AscendAttentionBackendImpl.update_graph_params
        if form == "positional-0.23":
            update(stream, context, size, config, config.speculative_config, None, None)
        else:
            update(stream, context, size, config, config.speculative_config, draft_attn_metadatas=None)
    assert context.attn_metadata is attn_metadata  # the real context is left as it was
    begins = [c for c in torch_npu_stub.CALLS if c[0] == "graph_task_update_begin"]
    assert [c[1][0] for c in begins] == [handle]
    reissued = _fia_calls()
    assert len(reissued) == 1
    _, _, kwargs = reissued[0]
    lengths = kwargs.get("actual_seq_lengths_kv")
    assert list(lengths) == new_sliding.seq_lens  # the sliding layer's own fresh KV lengths


@pytest.mark.skipif(UPSTREAM != "main", reason="main (and 0.25.1+) removed num_dcp_pcp_tokens (#12592)")
def test_the_removed_positional_update_form_raises_on_main(patched) -> None:
    """0.23's 7-positional call against main's 6-parameter ``update_graph_params``: the wrapper refuses it
    (naming the forms it knows) instead of calling through with routed metadata visible."""
    config = make_vllm_config(capture_sizes=[4, 8, 16])
    with set_forward_context({}, config, num_tokens=16, cudagraph_runtime_mode=FULL):
        context = importlib.import_module("vllm.forward_context").get_forward_context()
        update = av1.AscendAttentionBackendImpl.update_graph_params
        with pytest.raises(upstream.UpstreamError, match=r"7 positional arguments .*knows the forms"):
            update(torch.npu.Stream(), context, 16, config, config.speculative_config, None, None)
