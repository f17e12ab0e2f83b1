"""The update mechanism, the hang case and the bug record against the real vllm-ascend modules (issue 31 §1,
§2, §5), on every tree the harness runs: 0.23.0.post1 and main 182b75ea (legacy: ``update_graph_params``) and
the UpdatableGraph reconstruction (standing for 0.30+; its runner is still 182b75ea's, so capture and replay
go through the real ``ACLGraphWrapper`` / ``UpdatableGraph`` directly, wired as the 0.30+ runner wires them).

The stub's graphs keep ExternalEvent semantics (``torch_npu_stub.DeviceHang`` at a synchronization when a
replay's waits were never released), so "before" (what a user saw: a device waiting forever) and "after"
(graphbuf's ``UpstreamError`` at the next step, naming the mechanism and the layer) are both observable.
"""

from __future__ import annotations

import gc
import importlib
import weakref
from typing import Any

import pytest
import torch
import torch_npu_stub
from real_fixtures import (
    FULL_LAYER,
    KERNEL_BLOCK,
    SLIDING_LAYER,
    RunnerBatch,
    gemma4_specs,
    make_builder,
    make_vllm_config,
    vllm_capture_sizes,
)
from test_real_replay import (
    MAX_MODEL_LEN,
    SLIDING_AFTER_FULL,
    UPDATABLE,
    TwoLayerModel,
    _batch,
    _graph_params,
    _step_context,
    _wrapper,
)

import graphbuf.adapters.vllm_ascend.glue.activation as activation
import graphbuf.adapters.vllm_ascend.glue.patch as patch
import graphbuf.adapters.vllm_ascend.glue.resolve as resolve
import graphbuf.adapters.vllm_ascend.glue.routing as routing
import graphbuf.adapters.vllm_ascend.glue.upstream as upstream

av1 = importlib.import_module("vllm_ascend.attention.attention_v1")
acl_graph = importlib.import_module("vllm_ascend.compilation.acl_graph")
ascend_config = importlib.import_module("vllm_ascend.ascend_config")
MECHANISM = upstream.Mechanism.UPDATABLE if UPDATABLE else upstream.Mechanism.LEGACY
ONLY_UPDATABLE = pytest.mark.skipif(not UPDATABLE, reason="the tree has no UpdatableGraph (legacy mechanism)")
SIZES = [1, 2, 4, 8]


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU platform has no graph pool; an NPU platform hands the wrapper one."""
    platform = importlib.import_module("vllm.platforms").current_platform
    monkeypatch.setattr(type(platform), "_global_graph_pool", object(), raising=False)


def _captured(seed: int, wire: bool = True) -> tuple[Any, Any, Any, Any, Any]:
    """A two-layer model captured at every size of SIZES through the real wrapper; ``wire``: the wrapper gets
    the Ascend backend and an update stream (the 0.30+ runner's wiring), else none (the reconstruction's)."""
    config = make_vllm_config(capture_sizes=SIZES, num_spec=0, max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    ascend_config.init_ascend_config(config)
    _graph_params(SIZES)
    gen = torch.Generator().manual_seed(seed)
    specs = gemma4_specs()
    builders = (make_builder(config, specs[FULL_LAYER]),
                make_builder(config, specs[SLIDING_LAYER], SLIDING_AFTER_FULL))  # fmt: skip
    model = TwoLayerModel(config, SIZES[-1], gen)
    wrapper = _wrapper(config, model, torch.npu.Stream())
    if not wire and UPDATABLE:
        wrapper.set_attn_backend(None)  # what the reconstruction's runner leaves: use_updatable_graph False
    for size in reversed(SIZES):
        metadata = _metadata(builders, gen, size, size)
        with _step_context(config, metadata, size, capturing=True):
            wrapper(size)
    return config, gen, builders, model, wrapper


def _metadata(builders: Any, gen: torch.Generator, live: int, size: int) -> dict[str, Any]:
    full, sliding = builders
    return {FULL_LAYER: full.build(0, _batch(gen, live, 1, size).common()),
            SLIDING_AFTER_FULL: sliding.build(0, _batch(gen, size, 1, size).common())}  # fmt: skip


# --------------------------------------------------------------------------------- §1 the mechanism


def test_the_update_mechanism_is_read_from_this_trees_surface(patched: Any) -> None:
    mechanism, evidence = upstream.detect_mechanism()
    assert mechanism is MECHANISM, evidence
    assert upstream.first_miss(av1, mechanism) is None
    decided = activation.current()
    assert decided is not None and decided.mechanism is mechanism
    assert f"update mechanism {mechanism.value}" in decided.describe()
    wrapped = set(av1.AscendAttentionBackendImpl.__dict__[patch._ORIGINALS_ATTR])
    if UPDATABLE:
        assert wrapped == {"forward_impl"}  # update_graph_params is upstream's own, never called
        with pytest.raises(NotImplementedError):
            av1.AscendAttentionBackendImpl.update_graph_params(None, None, 1, None)
        assert upstream.upstream_large_head(av1) is None and decided.owner == "graphbuf"
    else:
        assert wrapped == {"forward_impl", "update_graph_params"}


@ONLY_UPDATABLE
def test_routed_decode_is_registered_through_upstreams_register_task(patched: Any, pool: None) -> None:
    """Every captured graph holds graphbuf's task for the routed layer under one provider, equal by value,
    beside upstream's own FIA task of the sliding layer; upstream's replay resolves graphbuf's provider."""
    config, gen, builders, _, wrapper = _captured(11)
    for entry in wrapper.concrete_aclgraph_entries.values():
        graph = entry.aclgraph
        ours = [t for t in graph.tasks if isinstance(t.provider, routing.DecodeParamProvider)]
        assert [t.provider for t in ours] == [routing.DecodeParamProvider((FULL_LAYER,), 0)]
        assert graph.provider_sizes[routing.DecodeParamProvider((FULL_LAYER,), 0)] == 1
        assert any(type(t.provider).__name__ == "FIAParamProvider" for t in graph.tasks)
    metadata = _metadata(builders, gen, 3, 4)
    route = routing.route_of(metadata[FULL_LAYER])
    assert route.staged is not None  # the provider refreshes from these at the replay
    with _step_context(config, metadata, 4, capturing=False):
        wrapper(4)
    torch.npu.synchronize()  # every wait released by upstream's update
    assert route.seq_lens.tolist()[:3] == list(route.seq_lens_host[:3]) and route.seq_lens.tolist()[3] == 0
    assert [t.lens for t in route.group.decodes.tasks(4)] == [list(route.seq_lens_host)]
    assert route.group.decodes.updates_seen == 1


# --------------------------------------------------------------------------------- §2 the hang case


def test_a_replay_without_its_update_raises_at_the_next_step_instead_of_hanging(
    patched: Any, pool: None
) -> None:
    """Before: the replay's task waits on an ExternalEvent nobody records (the stub: DeviceHang at the next
    synchronization; a device: zero throughput). After: graphbuf's next build raises UpstreamError naming
    the mechanism and the layer. Legacy: the runner skipped update_graph_params. UpdatableGraph: the
    reconstruction's wiring (no attn_backend on the wrapper), so upstream never resolves the providers."""
    config, gen, builders, _, wrapper = _captured(12, wire=False)
    metadata = _metadata(builders, gen, 5, 8)
    with _step_context(config, metadata, 8, capturing=False):
        if UPDATABLE:
            wrapper(8)  # FULL replay without _updatable_graph_replay
        else:
            [entry] = [
                e for e in wrapper.concrete_aclgraph_entries.values() if e.batch_descriptor.num_tokens == 8
            ]
            entry.aclgraph.replay()  # update_graph_params not called before it
    with pytest.raises(upstream.UpstreamError) as caught:
        _metadata(builders, gen, 5, 8)
    message = str(caught.value)
    assert f"under the {MECHANISM.value} mechanism" in message
    assert "layer #0 (AscendAttentionBackendImpl)" in message
    assert not UPDATABLE or f"of KV group [{FULL_LAYER}]" in message
    with pytest.raises(torch_npu_stub.DeviceHang):
        torch.npu.synchronize()


# --------------------------------------------------------------------------------- §5 the bug record


def _route(builder: Any, batch: RunnerBatch) -> routing.Route:
    route = routing.route_of(builder.build(0, batch.common()))
    assert route is not None and route.q_len is not None
    route.apply()  # under UpdatableGraph what the provider does at the replay
    return route


def test_vllm_ascend_16980_draft_and_target_groups_read_their_own_block_tables(patched: Any) -> None:
    config = make_vllm_config(capture_sizes=SIZES, num_spec=0, max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    spec = gemma4_specs()[FULL_LAYER]
    target, draft = (
        make_builder(config, spec),
        make_builder(config, spec, "model.mtp.layers.0.self_attn.attn"),
    )
    tables = [torch.arange(3 * 8, dtype=torch.int32).reshape(3, 8) % 20 + base for base in (0, 50)]
    routes = [_route(b, RunnerBatch([300, 200, 100], t, 1, 4, 4)) for b, t in zip((target, draft), tables)]
    assert routes[0].group is not routes[1].group
    for route, table in zip(routes, tables, strict=True):
        assert torch.equal(route.block_table[:3, : table.shape[1]], table)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_vllm_ascend_15461_padded_mtp_requests_leave_no_stale_row_or_length(patched: Any, k: int) -> None:
    q = 1 + k
    config = make_vllm_config(capture_sizes=[q * r for r in (1, 2, 4, 8)], num_spec=k, max_num_seqs=8,
                              max_model_len=MAX_MODEL_LEN)  # fmt: skip
    builder = make_builder(config)
    table = torch.arange(4 * 8, dtype=torch.int32).reshape(4, 8)
    full = _route(builder, RunnerBatch([500, 400, 300, 200], table, q, 4, 4 * q))
    padded = _route(builder, RunnerBatch([90, 80], table[:2], q, 4, 4 * q))
    assert full.seq_lens.data_ptr() == padded.seq_lens.data_ptr() and padded.size == 4 * q
    assert padded.seq_lens.tolist() == [90, 80, 0, 0] and padded.seq_lens_host == (90, 80, 0, 0)
    assert not padded.block_table[2:].any()


def test_vllm_ascend_12840_13779_a_padded_requests_kv_length_is_never_negative(patched: Any) -> None:
    config = make_vllm_config(capture_sizes=SIZES, num_spec=0, max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    builder = make_builder(config)
    batch = RunnerBatch([130, 7], torch.zeros(2, 8, dtype=torch.int32), 1, 4, 4)
    common = batch.common()
    for name in ("seq_lens", "seq_lens_cpu", "_seq_lens_cpu"):
        tensor = getattr(common, name, None)
        if isinstance(tensor, torch.Tensor):
            tensor[2:] = -2  # what a runner's stale padding can hold
    route = routing.route_of(builder.build(0, common))
    route.apply()
    assert route.seq_lens.tolist() == [130, 7, 0, 0] and route.seq_lens_host == (130, 7, 0, 0)


def test_vllm_ascend_14024_capacity_covers_vllms_largest_capture_size(patched: Any) -> None:
    """vLLM's default capture sizes for max_num_seqs 16, k = 3 reach 16 x 4 x 2 tokens; graphbuf routes up to
    max_num_seqs x (1 + k) = 64 tokens with 16 rows, and its activation check holds for the config."""
    sizes = vllm_capture_sizes(16, 3, 8192, 2)
    config = make_vllm_config(capture_sizes=sizes, num_spec=3, max_num_seqs=16, max_model_len=MAX_MODEL_LEN)
    group = resolve.group_buffers(make_builder(config), "cpu", kernel_block_size=KERNEL_BLOCK)
    assert max(group.capture_sizes) == 64 and all(s > 64 for s in group.not_routed)
    rows = {name: int(group.buffers.view(64)[name].shape[0]) for name in resolve.ROUTED_BUFFERS}
    assert rows == dict.fromkeys(resolve.ROUTED_BUFFERS, 16)
    group.check_capacity(16, 8192)


@ONLY_UPDATABLE
def test_vllm_ascend_16794_graphbufs_task_tensors_outlive_the_capture(patched: Any, pool: None) -> None:
    """Upstream keeps weak references to a task's kwargs (and turns its capture resources weak at
    capture_end): graphbuf's own task keeps every tensor its captured task reads alive."""
    _, gen, builders, _, _ = _captured(13)
    route = routing.route_of(_metadata(builders, gen, 2, 2)[FULL_LAYER])
    refs = [weakref.ref(t) for task in route.group.decodes.tasks(2) for t in task.task.tensor_args]
    assert refs
    del route
    gc.collect()
    assert all(r() is not None for r in refs)
