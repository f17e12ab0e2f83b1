"""A replay sequence through vllm-ascend's own ``ACLGraphWrapper`` on every tree (issue 31, §4).

Two attention layers run as a model's forward runs them: the routed full layer (head 512, graphbuf's) and a
sliding layer (vllm-ascend's FIA, with its own task update). The wrapper captures a FULL graph at every
capture size vLLM derives for the configuration (``graphbuf.planning.vllm_coverage``, checked against vLLM's
own code in ``test_real_build``), largest first as vLLM does, then replays live batches that grow, shrink and
pad (to the next capture size, and by DP padding past it) through the update mechanism the tree has:

* legacy (0.23.0.post1, main 182b75ea): the wrapper replays, then the runner's ``update_graph_params``
  re-issues the tasks and records their events;
* UpdatableGraph (the reconstruction, standing for 0.30+): the wrapper is given the Ascend backend and an
  update stream (what the 0.30+ runner does; the reconstruction's runner is still 182b75ea's) and its
  ``_updatable_graph_replay`` resolves every registered task's provider after the replay.

The stub's graph keeps ExternalEvent semantics, so a captured task whose update did not run for a replay
is a ``DeviceHang`` at the next synchronization, not a silent wait. A CPU replay computes nothing: the
routed layer's output is what its captured kernels compute from graphbuf's persistent buffers and the host
arguments last issued to its tasks (``RoutedDecodes.replay`` for the paged decode tasks; the blockwise
verify, which reads device lengths only, is run again over the same buffers). Each replay's output is
compared with the independent float64 reference of the live requests; padded rows must be zeros; the
sliding layer's re-issued FIA must carry that step's own KV lengths.
"""

from __future__ import annotations

import importlib
import importlib.util
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch_npu_stub
from real_fixtures import (
    FULL_HEAD,
    FULL_KV_HEADS,
    FULL_LAYER,
    KERNEL_BLOCK,
    NUM_HEADS,
    SLIDING_HEAD,
    SLIDING_KV_HEADS,
    SLIDING_LAYER,
    gemma4_specs,
    make_builder,
    make_vllm_config,
    random_batch,
)
from test_real_forward import SLIDING_AFTER_FULL, TOL, _fia_calls, make_impl, reference
from vllm.config import set_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import BatchDescriptor, set_forward_context

import graphbuf.adapters.vllm_ascend.glue.patch as patch
from graphbuf.planning.vllm_coverage import VllmServing, certify

av1 = importlib.import_module("vllm_ascend.attention.attention_v1")
acl_graph = importlib.import_module("vllm_ascend.compilation.acl_graph")
extra_ctx = importlib.import_module("vllm_ascend.ascend_forward_context")._EXTRA_CTX
ascend_config = importlib.import_module("vllm_ascend.ascend_config")
attention_utils = importlib.import_module("vllm_ascend.attention.utils")
GEMMA4 = SimpleNamespace(model_type="gemma4")
"""A Gemma4 ``hf_config``: turns on vllm-ascend's layer-aware FIA replay (tasks keyed by layer name)."""
UPDATABLE = importlib.util.find_spec("vllm_ascend.compilation.updatable_graph") is not None
"""The tree updates FULL-graph tasks through UpdatableGraph (else through ``update_graph_params``)."""
FULL = CUDAGraphMode.FULL
NUM_BLOCKS = 24  # per layer: kept small, the reference reads the whole cache in float64 on every replay
MAX_LEN = 600  # longest live context drawn (5 kernel blocks)
MAX_MODEL_LEN = 1000
WIDTH = -(-MAX_MODEL_LEN // KERNEL_BLOCK)  # the runner's table width in kernel blocks (8)

DECODE_STEPS = [(1, 0), (2, 0), (3, 0), (5, 0), (8, 0), (6, 0), (4, 1), (2, 0), (1, 2), (7, 0), (8, 0),
                (3, 0), (5, 0), (2, 1), (6, 0), (1, 0), (4, 0), (8, 0), (7, 0), (3, 1), (2, 0), (5, 0),
                (6, 0), (1, 0)]  # fmt: skip
VERIFY_STEPS = [(1, 0), (2, 0), (3, 0), (4, 0), (2, 1), (1, 0), (3, 0), (4, 0), (1, 2), (2, 0), (4, 0),
                (3, 0), (1, 0), (2, 0), (3, 1), (4, 0), (2, 0), (1, 1), (3, 0), (4, 0), (1, 0)]  # fmt: skip
"""``(live requests, extra capture sizes of DP padding)``: 0 pads to the smallest capture size holding the
batch; n pads n sizes further (another DP rank's batch was larger)."""


def _cache(gen: torch.Generator, kv_heads: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, KERNEL_BLOCK, kv_heads, head)
    return (
        torch.randn(shape, generator=gen).to(torch.bfloat16),
        torch.randn(shape, generator=gen).to(torch.bfloat16),
    )


def _layer(name: str) -> Any:
    """What ``AscendAttentionBackendImpl.forward`` reads of vLLM's Attention layer."""
    return SimpleNamespace(layer_name=name, _k_scale_float=1.0, _v_scale_float=1.0)


class TwoLayerModel:
    """The runnable the wrapper captures: the full and the sliding layer on persistent query and output
    buffers (the runner's), reading their metadata from the forward context by layer name."""

    def __init__(self, config: Any, max_tokens: int, gen: torch.Generator) -> None:
        self.full = make_impl(config)
        self.sliding = make_impl(config, SLIDING_HEAD, SLIDING_KV_HEADS, 1024)
        self.full_cache = _cache(gen, FULL_KV_HEADS, FULL_HEAD)
        self.sliding_cache = _cache(gen, SLIDING_KV_HEADS, SLIDING_HEAD)
        self.sliding.key_cache, self.sliding.value_cache = self.sliding_cache
        bf16 = torch.bfloat16
        self.query = torch.zeros(max_tokens, NUM_HEADS, FULL_HEAD, dtype=bf16)
        self.out = torch.zeros(max_tokens, NUM_HEADS, FULL_HEAD, dtype=bf16)
        self.sliding_query = torch.zeros(max_tokens, NUM_HEADS, SLIDING_HEAD, dtype=bf16)
        self.sliding_out = torch.zeros(max_tokens, NUM_HEADS, SLIDING_HEAD, dtype=bf16)

    def __call__(self, num_tokens: int) -> torch.Tensor:
        metadata = importlib.import_module("vllm.forward_context").get_forward_context().attn_metadata
        self.routed_forward(num_tokens, metadata[FULL_LAYER])
        self.sliding.forward(_layer(SLIDING_AFTER_FULL), self.sliding_query[:num_tokens], None, None,
                             self.sliding_cache, metadata[SLIDING_AFTER_FULL],
                             self.sliding_out[:num_tokens])  # fmt: skip
        return self.out[:num_tokens]

    def routed_forward(self, num_tokens: int, metadata: Any) -> None:
        self.full.forward(_layer(FULL_LAYER), self.query[:num_tokens], None, None, self.full_cache, metadata,
                          self.out[:num_tokens])  # fmt: skip


@contextmanager
def _step_context(config: Any, metadata: dict[str, Any], size: int, capturing: bool):
    """The forward context of a FULL decode step at ``size`` tokens (vllm-ascend's ``capturing`` set while
    the runner captures)."""
    with set_forward_context(metadata, config, num_tokens=size, cudagraph_runtime_mode=FULL,
                             batch_descriptor=BatchDescriptor(num_tokens=size)):  # fmt: skip
        extra_ctx.capturing = capturing
        try:
            yield
        finally:
            extra_ctx.capturing = False


def _wrapper(config: Any, model: TwoLayerModel, stream: Any) -> Any:
    wrapper = acl_graph.ACLGraphWrapper(model, config, FULL)
    if UPDATABLE:  # the 0.30+ runner's wiring; the reconstruction's 182b75ea runner never does it
        wrapper.set_attn_backend(av1.AscendAttentionBackend)
        wrapper.set_update_stream(stream)
    return wrapper


def _graph_params(sizes: list[int]) -> None:
    if acl_graph.get_graph_params() is None:
        acl_graph.set_graph_params(sizes)
    params = acl_graph.get_graph_params()
    for size in sizes:
        for table in (params.attn_params, params.handles, params.events):
            table.setdefault(size, []).clear()
        params.workspaces.pop(size, None)


@pytest.fixture
def graph_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU platform has no graph pool; an NPU platform hands the wrapper one."""
    platform = importlib.import_module("vllm.platforms").current_platform
    monkeypatch.setattr(type(platform), "_global_graph_pool", object(), raising=False)


def _batch(gen: torch.Generator, live: int, q_len: int, size: int) -> Any:
    return random_batch(gen, live=live, q_len=q_len, num_blocks=NUM_BLOCKS, max_len=MAX_LEN,
                        padded_reqs=size // q_len, width=WIDTH)  # fmt: skip


def _replay_step(config: Any, wrapper: Any, metadata: dict[str, Any], size: int) -> None:
    """One replay as the tree's runner does it, then a synchronization (where a missing update hangs)."""
    stream = wrapper.update_stream if UPDATABLE else torch.npu.Stream()
    with _step_context(config, metadata, size, capturing=False):
        wrapper(size)
        if not UPDATABLE:
            context = importlib.import_module("vllm.forward_context").get_forward_context()
            av1.AscendAttentionBackendImpl.update_graph_params(
                stream, context, size, config, config.speculative_config, draft_attn_metadatas=None
            )
    torch.npu.synchronize()


def _emulate_routed_replay(model: TwoLayerModel, route: Any, metadata: Any, size: int, config: Any) -> None:
    """What the device computes for the routed layer in this replay: its paged decode tasks with the host
    arguments last issued to them; a verify (device lengths, no task) over graphbuf's refreshed buffers."""
    tasks = route.group.decodes.tasks(size)
    if tasks:
        route.group.decodes.replay(size)
        return
    with _step_context(config, {FULL_LAYER: metadata}, size, capturing=True):
        model.routed_forward(size, metadata)


@pytest.fixture
def layer_aware_cache() -> Any:
    """vllm-ascend caches its Gemma4 decision (an lru_cache): cleared around the test."""
    attention_utils.needs_layer_aware_fia_graph_replay.cache_clear()
    yield
    attention_utils.needs_layer_aware_fia_graph_replay.cache_clear()


def _run_sequence(
    q_len: int, max_num_seqs: int, steps: list[tuple[int, int]], seed: int, hf_config: Any = None
) -> dict[str, Any]:
    num_spec = q_len - 1
    serving = VllmServing(max_num_seqs, num_spec, max_num_batched_tokens=8192)
    cert = certify(serving)
    assert cert.ok, cert.render()
    sizes = list(cert.capture_sizes)
    config = make_vllm_config(
        capture_sizes=sizes, num_spec=num_spec, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
        hf_config=hf_config,
    )  # fmt: skip
    ascend_config.init_ascend_config(config)  # what upstream's decode path and task update read
    _graph_params(sizes)
    gen = torch.Generator().manual_seed(seed)
    specs = gemma4_specs()
    full_builder = make_builder(config, specs[FULL_LAYER])
    sliding_builder = make_builder(config, specs[SLIDING_LAYER], SLIDING_AFTER_FULL)
    with set_current_vllm_config(config):  # what the impls read of it (the Gemma4 layer-aware decision)
        model = TwoLayerModel(config, sizes[-1], gen)
    if hf_config is not None:
        assert model.sliding._use_layer_aware_fia_graph_replay is True
    wrapper = _wrapper(config, model, torch.npu.Stream())
    addresses = {}
    for size in reversed(sizes):  # vLLM captures the largest size first
        full, sliding = (_batch(gen, size // q_len, q_len, size) for _ in range(2))
        metadata = {FULL_LAYER: full_builder.build(0, full.common()),
                    SLIDING_AFTER_FULL: sliding_builder.build(0, sliding.common())}  # fmt: skip
        route = getattr(metadata[FULL_LAYER], patch.ROUTE_ATTR)
        assert route is not None and route.size == size, (size, route)
        addresses[size] = (route.block_table.data_ptr(), route.seq_lens.data_ptr())
        with _step_context(config, metadata, size, capturing=True):
            wrapper(size)
    checked = []
    for i, (live, extra) in enumerate(steps):
        own = cert.coverage.batches[live - 1].capture_size
        size = sizes[min(sizes.index(own) + extra, len(sizes) - 1)]
        batch, sliding = _batch(gen, live, q_len, size), _batch(gen, size // q_len, q_len, size)
        metadata = {FULL_LAYER: full_builder.build(0, batch.common()),
                    SLIDING_AFTER_FULL: sliding_builder.build(0, sliding.common())}  # fmt: skip
        route = getattr(metadata[FULL_LAYER], patch.ROUTE_ATTR)
        assert (route.size, route.num_reqs) == (size, live)
        assert (route.block_table.data_ptr(), route.seq_lens.data_ptr()) == addresses[size]
        model.query[:size].copy_(torch.randn(size, NUM_HEADS, FULL_HEAD, generator=gen).to(torch.bfloat16))
        model.out.fill_(float("nan"))
        torch_npu_stub.CALLS.clear()
        _replay_step(config, wrapper, metadata, size)
        reissued = _fia_calls()
        assert [list(c[2]["actual_seq_lengths_kv"]) for c in reissued] == [sliding.seq_lens], f"step {i}"
        _emulate_routed_replay(model, route, metadata[FULL_LAYER], size, config)
        tokens = live * q_len
        ref = reference(model.query[:tokens], model.full_cache, batch.table, batch.seq_lens, q_len,
                        model.full.scale)  # fmt: skip
        torch.testing.assert_close(model.out[:tokens].double(), ref, **TOL, msg=f"step {i} ({live}, {size})")
        assert not model.out[tokens:size].any(), f"step {i}: padded rows are not zeros"
        checked.append((live, size))
    return {"sizes": sizes, "checked": checked}


def test_decode_replay_sequence_matches_the_reference(patched: Any, graph_pool: None) -> None:
    """One-token decode, max_num_seqs 8: capture sizes 1, 2, 4, 8; 24 replays of 1..8 live requests."""
    got = _run_sequence(1, 8, DECODE_STEPS, seed=200)
    assert got["sizes"] == [1, 2, 4, 8]
    assert len(got["checked"]) >= 20 and {size for _, size in got["checked"]} == {1, 2, 4, 8}
    assert any(live < size for live, size in got["checked"])  # padded replays happened


def test_gemma4_layer_aware_decode_replay_sequence(
    patched: Any, graph_pool: None, layer_aware_cache: Any
) -> None:
    """The decode sequence with a Gemma4 ``hf_config``: vllm-ascend re-issues its sliding-layer FIA by layer
    name (legacy: layer-aware ``update_graph_params``; UpdatableGraph: its providers key by layer name)."""
    # Layer-aware capture keeps the largest FIA workspace per size, so it compares their sizes: the stub's
    # workspace query returns a tensor (one byte per query element) instead of None.
    torch_npu_stub.RESULTS["_npu_fused_infer_attention_score_get_max_workspace"] = lambda **kw: torch.empty(
        kw["query"].numel(), dtype=torch.uint8
    )
    got = _run_sequence(1, 8, DECODE_STEPS, seed=203, hf_config=GEMMA4)
    assert len(got["checked"]) >= 20 and {size for _, size in got["checked"]} == {1, 2, 4, 8}


def test_mtp_verify_replay_sequence_matches_the_reference(patched: Any, graph_pool: None) -> None:
    """MTP verify (3 speculative tokens), max_num_seqs 4: capture sizes 4, 8, 16; 21 replays."""
    got = _run_sequence(4, 4, VERIFY_STEPS, seed=201)
    assert got["sizes"] == [4, 8, 16]
    assert len(got["checked"]) >= 20 and {size for _, size in got["checked"]} == {4, 8, 16}
    assert any(live * 4 < size for live, size in got["checked"])


def test_a_replay_whose_update_never_runs_hangs_loudly(patched: Any, graph_pool: None) -> None:
    """The stub's ExternalEvent semantics on this tree's own capture: a replay without the task update that
    records the events is a DeviceHang at the next synchronization, never a silent success."""
    config = make_vllm_config(
        capture_sizes=[1, 2, 4, 8], num_spec=0, max_num_seqs=8, max_model_len=MAX_MODEL_LEN
    )
    ascend_config.init_ascend_config(config)
    _graph_params([1, 2, 4, 8])
    gen = torch.Generator().manual_seed(202)
    specs = gemma4_specs()
    full_builder = make_builder(config, specs[FULL_LAYER])
    sliding_builder = make_builder(config, specs[SLIDING_LAYER], SLIDING_AFTER_FULL)
    model = TwoLayerModel(config, 8, gen)
    wrapper = _wrapper(config, model, torch.npu.Stream())
    metadata = {FULL_LAYER: full_builder.build(0, _batch(gen, 8, 1, 8).common()),
                SLIDING_AFTER_FULL: sliding_builder.build(0, _batch(gen, 8, 1, 8).common())}  # fmt: skip
    with _step_context(config, metadata, 8, capturing=True):
        wrapper(8)
    [graph] = [e.aclgraph for e in wrapper.concrete_aclgraph_entries.values()]
    assert graph.waits, "the capture waited on no ExternalEvent: nothing here could hang"
    with _step_context(config, metadata, 8, capturing=False):
        graph.replay()  # a replay whose update never comes (the runner's update skipped)
    with pytest.raises(torch_npu_stub.DeviceHang, match="blocks forever"):
        torch.npu.synchronize()
