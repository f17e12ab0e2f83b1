"""Attention that follows live context, on the real vllm-ascend 0.23.0.post1 module (issue 10, §5).

Routed decode is a paged task per layer and capture size whose host KV lengths the real
``update_graph_params`` (0.23's 7 positional arguments, 0.25.1's keyword form) has re-issued before replay;
verify is blockwise unless the spec's task options say dense. Outputs are compared with the independent
float64 reference of ``test_real_forward`` (bf16: rtol = atol = 0.015). On CPU a captured task is the
software paged decode: ``RoutedDecodes.replay`` runs it as the device's replay would, with the lengths it was
last issued with, so a task that is not re-issued reads stale lengths.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import pytest
import torch
import torch_npu_stub
from real_fixtures import (
    FULL_HEAD,
    FULL_LAYER,
    LEGACY_MECHANISM,
    NUM_HEADS,
    UPDATE_FORMS,
    make_builder,
    make_vllm_config,
    random_batch,
    vllm_capture_sizes,
)
from test_real_forward import (
    MAX_LEN,
    NUM_BLOCKS,
    SLIDING_AFTER_FULL,
    TOL,
    WIDTH,
    _capture_sliding,
    _fia_calls,
    full_graph_capture,
    make_cache,
    make_impl,
    reference,
)
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import get_forward_context, set_forward_context

import graphbuf
import graphbuf.adapters.vllm_ascend.glue.patch as patch
from graphbuf.adapters.vllm_ascend.bindings import large_head
from graphbuf.adapters.vllm_ascend.glue import resolve

av1 = importlib.import_module("vllm_ascend.attention.attention_v1")
acl_graph = importlib.import_module("vllm_ascend.compilation.acl_graph")
FULL = CUDAGraphMode.FULL
SIZE = 16  # decode: 16 one-token requests (a capture size of the 1-token buffers)


def _capture_decode(config: Any, builder: Any, impls: list[Any], caches: list[Any], gen: torch.Generator,
                    live: int) -> tuple[Any, torch.Tensor, list[torch.Tensor], Any]:  # fmt: skip
    """Capture ``impls`` (one per layer) on a routed 1-token batch of ``live`` requests padded to SIZE."""
    batch = random_batch(gen, live=live, q_len=1, num_blocks=NUM_BLOCKS, max_len=MAX_LEN, padded_reqs=SIZE,
                         width=WIDTH)  # fmt: skip
    metadata = builder.build(0, batch.common())
    route = getattr(metadata, patch.ROUTE_ATTR)
    assert (route.q_len, route.size, route.num_reqs) == (1, SIZE, live)
    assert list(route.seq_lens_host) == batch.seq_lens + [0] * (SIZE - live)
    query = torch.randn(SIZE, NUM_HEADS, FULL_HEAD, generator=gen).to(torch.bfloat16)
    outputs = [torch.full_like(query, float("nan")) for _ in impls]
    with full_graph_capture(config, {FULL_LAYER: metadata}, SIZE):
        for impl, cache, out in zip(impls, caches, outputs):
            assert impl.forward_impl(query, None, None, cache, metadata, out) is out
    return batch, query, outputs, route


def _update(config: Any, attn_metadata: dict[str, Any], form: str) -> Any:
    """vLLM's replay step: the real update_graph_params in the 0.23 positional or 0.25.1 keyword form."""
    with set_forward_context(attn_metadata, config, num_tokens=SIZE, cudagraph_runtime_mode=FULL):
        context = get_forward_context()
        update = av1.AscendAttentionBackendImpl.update_graph_params
        stream = torch.npu.Stream()
        if form == "positional-0.23":
            update(stream, context, SIZE, config, config.speculative_config, None, None)
        else:
            update(stream, context, SIZE, config, config.speculative_config, draft_attn_metadatas=None)
    return context


@LEGACY_MECHANISM
@pytest.mark.parametrize("form", UPDATE_FORMS)
def test_paged_decode_host_lengths_are_reissued_by_update_graph_params(patched, form: str) -> None:
    """Two routed layers and one upstream sliding layer captured at SIZE; a new batch is built; the real
    update re-issues the sliding layer's FIA (its own lengths) and graphbuf's two paged tasks (the new host
    lengths); the replayed outputs match the reference of the new batch."""
    config = make_vllm_config(capture_sizes=vllm_capture_sizes(16, 3, 8192, 2))
    params = acl_graph.get_graph_params()
    if params is None:
        acl_graph.set_graph_params(config.compilation_config.cudagraph_capture_sizes)
        params = acl_graph.get_graph_params()
    for table in (params.attn_params, params.handles, params.events):
        table[SIZE].clear()
    gen = torch.Generator().manual_seed(50)
    sliding_builder, _, _ = _capture_sliding(config, SIZE, gen)
    builder = make_builder(config)
    impls = [make_impl(config), make_impl(config)]
    caches = [make_cache(gen), make_cache(gen)]
    first, query, outputs, route = _capture_decode(config, builder, impls, caches, gen, live=11)
    for out, cache, impl in zip(outputs, caches, impls):
        ref = reference(query[:11], cache, first.table, first.seq_lens, 1, impl.scale)
        torch.testing.assert_close(out[:11].double(), ref, **TOL)
        assert not out[11:].any()  # padded requests: zeros
    tasks = route.group.decodes.tasks(SIZE)
    assert [t.owner for t in tasks] == impls and len(params.attn_params[SIZE]) == 1  # not in GraphParams

    # Replay step: same live count, new contexts and tables; the query buffer gets new values in place.
    second = random_batch(gen, live=11, q_len=1, num_blocks=NUM_BLOCKS, max_len=MAX_LEN, padded_reqs=SIZE,
                          width=WIDTH)  # fmt: skip
    metadata = builder.build(0, second.common())
    new_sliding = random_batch(gen, live=4, q_len=4, num_blocks=NUM_BLOCKS, max_len=MAX_LEN, padded_reqs=4,
                               width=WIDTH)  # fmt: skip
    sliding_md = sliding_builder.build(0, new_sliding.common())
    query.copy_(torch.randn(query.shape, generator=gen).to(torch.bfloat16))
    attn_metadata = {FULL_LAYER: metadata, SLIDING_AFTER_FULL: sliding_md}
    torch_npu_stub.CALLS.clear()
    context = _update(config, attn_metadata, form)
    assert context.attn_metadata is attn_metadata
    [upstream] = _fia_calls()  # vllm-ascend re-issued its own (sliding) task only, with its own lengths
    assert list(upstream[2]["actual_seq_lengths_kv"]) == new_sliding.seq_lens
    assert [t.updates for t in tasks] == [1, 1]
    assert all(t.lens == second.seq_lens + [0] * (SIZE - 11) for t in tasks)
    route.group.decodes.replay(SIZE)
    for out, cache, impl in zip(outputs, caches, impls):
        ref = reference(query[:11], cache, second.table, second.seq_lens, 1, impl.scale)
        torch.testing.assert_close(out[:11].double(), ref, **TOL)
        assert not out[11:].any()


def test_a_paged_task_not_reissued_replays_stale_lengths(patched) -> None:
    """Faithful to the device: without the update the task keeps the lengths baked at capture, reading the
    refreshed table and query with them."""
    config = make_vllm_config(capture_sizes=vllm_capture_sizes(16, 3, 8192, 2))
    gen = torch.Generator().manual_seed(51)
    builder, impl, cache = make_builder(config), make_impl(config), make_cache(gen)
    first, query, [out], route = _capture_decode(config, builder, [impl], [cache], gen, live=5)
    second = random_batch(gen, live=5, q_len=1, num_blocks=NUM_BLOCKS, max_len=MAX_LEN, padded_reqs=SIZE,
                          width=WIDTH)  # fmt: skip
    builder.build(0, second.common())  # refreshes graphbuf's table and device lengths, not the task
    route.group.decodes.replay(SIZE)
    stale = reference(query[:5], cache, second.table, first.seq_lens, 1, impl.scale)
    fresh = reference(query[:5], cache, second.table, second.seq_lens, 1, impl.scale)
    torch.testing.assert_close(out[:5].double(), stale, **TOL)
    assert not torch.allclose(out[:5].double(), fresh, **TOL)


class _Spy:
    """Counts calls of one large_head entry point, passing them through."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.calls = 0
        original = getattr(large_head, name)

        def spy(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(large_head, name, spy)


def _spec_with(**options: Any) -> graphbuf.GraphSpec:
    """The shipped spec with task options replaced (decode_mode on the decode task, the rest on verify)."""
    spec = graphbuf.load_spec(resolve.SPEC_NAME)
    tasks = []
    for task in spec.tasks:
        keys = {"decode_mode"} if task.name == "decode" else {"verify_mode", "chunk_blocks"}
        update = {k: v for k, v in options.items() if k in keys}
        tasks.append(task.model_copy(update={"options": {**task.options, **update}}))
    return spec.model_copy(update={"tasks": tasks})


def test_the_shipped_spec_selects_paged_decode_and_blockwise_verify(patched) -> None:
    config = make_vllm_config(capture_sizes=vllm_capture_sizes(16, 3, 8192, 2))
    group = resolve.group_buffers(make_builder(config), kernel_block_size=128)
    assert group is not None
    assert group.modes == resolve.RouteModes(decode="paged", verify="blockwise", chunk_blocks=2)
    assert group.modes == resolve.route_modes(graphbuf.load_spec(resolve.SPEC_NAME))


@pytest.mark.parametrize(
    ("options", "kernel"),
    [
        ({"verify_mode": "blockwise", "chunk_blocks": 3}, "verify_attention_blockwise"),
        ({"verify_mode": "dense"}, "verify_attention"),
        ({"decode_mode": "paged"}, "paged"),
        ({"decode_mode": "dense"}, "decode_attention"),
    ],
)
def test_routed_path_takes_the_route_the_spec_options_select(
    patched, monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], kernel: str
) -> None:
    q_len = 1 if "decode_mode" in options else 4
    modes = resolve.route_modes(_spec_with(**options))
    config = make_vllm_config(capture_sizes=vllm_capture_sizes(16, 3, 8192, 2))
    builder = make_builder(config)
    gen = torch.Generator().manual_seed(52)
    batch = random_batch(gen, live=3, q_len=q_len, num_blocks=NUM_BLOCKS, max_len=MAX_LEN, padded_reqs=4,
                         width=WIDTH)  # fmt: skip
    route = getattr(builder.build(0, batch.common()), patch.ROUTE_ATTR)
    route.group.modes = modes
    if q_len == 4:
        assert modes.verify == options["verify_mode"]
    else:
        assert modes.decode == options["decode_mode"]
    spies = {name: _Spy(monkeypatch, name) for name in
             ("verify_attention_blockwise", "verify_attention", "decode_attention")}  # fmt: skip
    metadata = builder.build(0, batch.common())
    size = getattr(metadata, patch.ROUTE_ATTR).size
    impl, cache = make_impl(config), make_cache(gen)
    query = torch.randn(size, NUM_HEADS, FULL_HEAD, generator=gen).to(torch.bfloat16)
    output = torch.zeros_like(query)
    with full_graph_capture(config, {FULL_LAYER: metadata}, size):
        impl.forward_impl(query, None, None, cache, metadata, output)
    live = 3 * q_len
    ref = reference(query[:live], cache, batch.table, batch.seq_lens, q_len, impl.scale)
    torch.testing.assert_close(output[:live].double(), ref, **TOL)
    captured = route.group.decodes.tasks(size)
    if kernel == "paged":
        assert len(captured) == 1 and spies["decode_attention"].calls == 1  # the task's software kernel
    else:
        assert captured == () and spies[kernel].calls == 1
        assert sum(s.calls for s in spies.values()) == 1
    if kernel == "verify_attention_blockwise":
        assert modes.chunk_blocks == 3


def test_routed_decode_reads_only_live_context(patched) -> None:
    """What ``graphbuf plan`` reports, measured: the paged route gathers the blocks the host lengths need;
    the dense route gathers the whole allocation (max_model_len) whatever the context."""
    counts = {}
    for mode in ("paged", "dense"):
        config = make_vllm_config(capture_sizes=vllm_capture_sizes(16, 3, 8192, 2))
        builder = make_builder(config)
        gen = torch.Generator().manual_seed(53)
        batch = random_batch(gen, live=4, q_len=1, num_blocks=NUM_BLOCKS, max_len=300, padded_reqs=4,
                             width=WIDTH)  # fmt: skip
        metadata = builder.build(0, batch.common())
        route = getattr(metadata, patch.ROUTE_ATTR)
        route.group.modes = dataclasses.replace(route.group.modes, decode=mode)
        impl, cache = make_impl(config), make_cache(gen)
        query = torch.randn(route.size, NUM_HEADS, FULL_HEAD, generator=gen).to(torch.bfloat16)
        with _GatherCount() as gathered, full_graph_capture(config, {FULL_LAYER: metadata}, route.size):
            impl.forward_impl(query, None, None, cache, metadata, torch.zeros_like(query))
        counts[mode] = gathered.elements
    per_block = 4 * cache[0].shape[1] * cache[0].shape[2] * FULL_HEAD * 2  # 4 requests, K and V
    assert counts["dense"] == WIDTH * per_block
    # paged: each request gathers only its own cdiv(seq_len, block) blocks (kernels.paged_decode_software)
    needed = sum(-(-n // 128) for n in batch.seq_lens)
    assert counts["paged"] == needed * per_block // 4 < counts["dense"]


class _GatherCount(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.index_select.default:
            self.elements += out.numel()
        return out


def test_host_lengths_past_the_table_are_refused_before_any_refresh(patched) -> None:
    """A host KV length the captured table cannot hold (a runner whose host copy disagrees with its device
    lengths) would make the paged kernel read past the table: refused, graphbuf's buffers unchanged."""
    config = make_vllm_config(capture_sizes=vllm_capture_sizes(16, 3, 8192, 2))
    builder = make_builder(config)
    gen = torch.Generator().manual_seed(54)
    good = random_batch(gen, live=3, q_len=1, num_blocks=NUM_BLOCKS, max_len=MAX_LEN, padded_reqs=4,
                        width=WIDTH)  # fmt: skip
    route = getattr(builder.build(0, good.common()), patch.ROUTE_ATTR)
    before = (route.block_table.clone(), route.seq_lens.clone())
    bad = random_batch(gen, live=3, q_len=1, num_blocks=NUM_BLOCKS, max_len=MAX_LEN, padded_reqs=4,
                       width=WIDTH)  # fmt: skip
    common = bad.common()
    common._seq_lens_cpu[1] = WIDTH * 128 + 1  # the host copy vllm-ascend's seq_lens_list comes from
    with pytest.raises(graphbuf.RefreshError, match=r"host KV lengths .* must lie in \[0, 5504\]"):
        builder.build(0, common)
    assert torch.equal(route.block_table, before[0]) and torch.equal(route.seq_lens, before[1])
