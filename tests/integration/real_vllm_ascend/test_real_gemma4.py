"""Gemma4 routing on the real modules, with a Gemma4 ``hf_config`` on the model config (issue 23, §3).

vllm-ascend (0.23.0.post1 and main 182b75ea) turns on layer-aware FIA graph replay for Gemma4
(``needs_layer_aware_fia_graph_replay``: each captured FIA task keeps its layer name, and the update loop
resolves the metadata by that name). Main also captures a 512-dim decode without MTP as paged attention in
the graph (``PagedAttentionGraphParam``, updated per layer). graphbuf's routing, stated and tested here:

* a full layer (head_size 512, no sliding window) under FULL_DECODE_ONLY runs graphbuf's kernels at capture
  (decode: one paged task per layer and size; MTP verify: blockwise, device lengths) and graphbuf's task
  update at replay; upstream captures no task for it, so main's ``PagedAttentionGraphParam`` path is never
  taken for a routed layer;
* a sliding layer runs vllm-ascend's FIA at capture and its layer-aware update at replay, with the routed
  layers' metadata hidden from ``update_graph_params``.

Without graphbuf's patch, main takes the paged-attention path for the same full layer (reached here too).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch_npu_stub
from real_fixtures import (
    FULL_HEAD,
    FULL_LAYER,
    LEGACY_MECHANISM,
    NUM_HEADS,
    SLIDING_HEAD,
    SLIDING_KV_HEADS,
    SLIDING_LAYER,
    UPSTREAM,
    gemma4_specs,
    make_builder,
    make_vllm_config,
    random_batch,
)
from test_real_forward import (
    MAX_LEN,
    NUM_BLOCKS,
    SLIDING_AFTER_FULL,
    WIDTH,
    _fia_calls,
    full_graph_capture,
    make_cache,
    make_impl,
)
from vllm.config import set_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import get_forward_context, set_forward_context

import graphbuf.adapters.vllm_ascend.glue.patch as patch
from graphbuf.adapters.vllm_ascend.glue import routing, upstream

av1 = importlib.import_module("vllm_ascend.attention.attention_v1")
utils = importlib.import_module("vllm_ascend.attention.utils")
ascend_config = importlib.import_module("vllm_ascend.ascend_config")
acl_graph = importlib.import_module("vllm_ascend.compilation.acl_graph")
SIZE = 16
GEMMA4 = SimpleNamespace(model_type="gemma4")


@pytest.fixture
def gemma4() -> Any:
    """Clears vllm-ascend's cached model-type decision around the test (it is an lru_cache)."""
    utils.needs_layer_aware_fia_graph_replay.cache_clear()
    yield
    utils.needs_layer_aware_fia_graph_replay.cache_clear()


def _config(num_spec: int) -> Any:
    q = 1 + num_spec
    config = make_vllm_config(capture_sizes=[q * r for r in (1, 2, 4)] + [SIZE], num_spec=num_spec,
                              hf_config=GEMMA4)  # fmt: skip
    if acl_graph.get_graph_params() is None:
        acl_graph.set_graph_params(config.compilation_config.cudagraph_capture_sizes)
    params = acl_graph.get_graph_params()
    for table in (params.attn_params, params.handles, params.events):
        table.setdefault(SIZE, []).clear()
    params.workspaces.pop(SIZE, None)
    ascend_config.init_ascend_config(config)  # the paged-attention shape list upstream's decode path reads
    return config


def _layer(name: str) -> Any:
    """What ``AscendAttentionBackendImpl.forward`` reads of vLLM's Attention layer."""
    return SimpleNamespace(layer_name=name, _k_scale_float=1.0, _v_scale_float=1.0)


def _capture(config: Any, spec: Any, layer: str, head: int, kv_heads: int, window: int | None, q_len: int,
             gen: torch.Generator) -> tuple[Any, Any]:  # fmt: skip
    """Build a uniform batch at SIZE tokens and capture one layer through ``forward`` (which records the
    layer name the layer-aware replay keys on); returns (builder, metadata)."""
    builder = make_builder(config, spec, layer)
    with set_current_vllm_config(config):
        impl = make_impl(config, head, kv_heads, window)
    batch = random_batch(gen, live=SIZE // q_len, q_len=q_len, num_blocks=NUM_BLOCKS, max_len=MAX_LEN,
                         padded_reqs=SIZE // q_len, width=WIDTH)  # fmt: skip
    metadata = builder.build(0, batch.common())
    query = torch.randn(SIZE, NUM_HEADS, head, generator=gen).to(torch.bfloat16)
    output = torch.zeros_like(query)
    with full_graph_capture(config, {layer: metadata}, SIZE):
        impl.forward(_layer(layer), query, None, None, make_cache(gen, kv_heads, head), metadata, output)
    return builder, metadata


def _step(config: Any, builders: dict[str, Any], q_len: int, gen: torch.Generator) -> tuple[dict, dict]:
    batches = {name: random_batch(gen, live=SIZE // q_len, q_len=q_len, num_blocks=NUM_BLOCKS,
                                  max_len=MAX_LEN, padded_reqs=SIZE // q_len, width=WIDTH)
               for name in builders}  # fmt: skip
    metadata = {name: builders[name].build(0, batches[name].common()) for name in builders}
    torch_npu_stub.CALLS.clear()
    with set_forward_context(metadata, config, num_tokens=SIZE, cudagraph_runtime_mode=CUDAGraphMode.FULL):
        av1.AscendAttentionBackendImpl.update_graph_params(
            torch.npu.Stream(), get_forward_context(), SIZE, config, config.speculative_config,
            draft_attn_metadatas=None,
        )  # fmt: skip
    return batches, metadata


def test_a_gemma4_hf_config_turns_on_layer_aware_replay(gemma4: Any) -> None:
    config = _config(0)
    with set_current_vllm_config(config):
        assert utils.needs_layer_aware_fia_graph_replay() is True
        impl = make_impl(config, SLIDING_HEAD, SLIDING_KV_HEADS, 1024)
    assert impl._use_layer_aware_fia_graph_replay is True
    assert upstream.first_miss(av1) is None  # the whole surface holds on this upstream


@LEGACY_MECHANISM
@pytest.mark.parametrize("num_spec", [0, 3], ids=["decode", "mtp-verify"])
def test_gemma4_full_layers_run_graphbuf_and_sliding_layers_upstream_layer_aware(
    patched: Any, gemma4: Any, num_spec: int
) -> None:
    config = _config(num_spec)
    q_len = 1 + num_spec
    params = acl_graph.get_graph_params()
    gen = torch.Generator().manual_seed(70 + num_spec)
    specs = gemma4_specs()
    full_builder, full_md = _capture(config, specs[FULL_LAYER], FULL_LAYER, FULL_HEAD, 2, None, q_len, gen)
    route = routing.route_of(full_md)
    assert route is not None and (route.q_len, route.size) == (q_len, SIZE)
    assert params.attn_params[SIZE] == []  # the routed full layer captured no upstream task
    tasks = route.group.decodes.tasks(SIZE)
    assert len(tasks) == (1 if q_len == 1 else 0)  # decode: a paged task; verify: device lengths
    sliding_builder, sliding_md = _capture(config, specs[SLIDING_LAYER], SLIDING_AFTER_FULL, SLIDING_HEAD,
                                           SLIDING_KV_HEADS, 1024, q_len, gen)  # fmt: skip
    assert routing.route_of(sliding_md) is None
    [param] = params.attn_params[SIZE]
    assert type(param).__name__ != "PagedAttentionGraphParam"  # the sliding layer is FIA
    handle = params.handles[SIZE][0]
    # Replay step: fresh batches for both layers; upstream re-issues the sliding task by its layer name,
    # graphbuf re-issues its own task with the full layer's lengths.
    batches, _ = _step(config, {FULL_LAYER: full_builder, SLIDING_AFTER_FULL: sliding_builder}, q_len, gen)
    begins = [c for c in torch_npu_stub.CALLS if c[0] == "graph_task_update_begin"]
    assert [c[1][0] for c in begins] == [handle]
    [(_, _, kwargs)] = _fia_calls()
    assert list(kwargs["actual_seq_lengths_kv"]) == batches[SLIDING_AFTER_FULL].seq_lens
    if tasks:
        assert tasks[0].lens == batches[FULL_LAYER].seq_lens and tasks[0].updates == 1


@pytest.mark.skipif(UPSTREAM != "main", reason="PagedAttentionGraphParam (#11536) exists only on main")
def test_without_graphbuf_main_captures_the_full_decode_layer_as_paged_attention(gemma4: Any) -> None:
    """What graphbuf replaces on main: unpatched, the 512-dim decode without MTP is a paged-attention task
    keyed by its layer name, updated per layer from that layer's metadata."""
    patch.unpatch()
    config = _config(0)
    params = acl_graph.get_graph_params()
    gen = torch.Generator().manual_seed(90)
    builder, _ = _capture(config, gemma4_specs()[FULL_LAYER], FULL_LAYER, FULL_HEAD, 2, None, 1, gen)
    [param] = params.attn_params[SIZE]
    assert isinstance(param, utils.PagedAttentionGraphParam) and param.layer_name == FULL_LAYER
    _, metadata = _step(config, {FULL_LAYER: builder}, 1, gen)
    [(_, _, kwargs)] = [c for c in torch_npu_stub.CALLS if c[0] == "_npu_paged_attention"]
    assert kwargs["block_table"] is metadata[FULL_LAYER].block_tables
