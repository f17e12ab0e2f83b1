"""The real ``AscendAttentionMetadataBuilder.build``, patched: padded batches, kernel block sizes, vLLM's
capture sizes (issue 10, sections 2-4)."""

from __future__ import annotations

import importlib
import logging
from types import SimpleNamespace

import pytest
import torch
from real_fixtures import (
    FULL_LAYER,
    KERNEL_BLOCK,
    RunnerBatch,
    gemma4_specs,
    make_builder,
    make_vllm_config,
    random_batch,
    vllm_capture_sizes,
)
from vllm.config import CompilationConfig, VllmConfig
from vllm.config.compilation import CUDAGraphMode

import graphbuf.adapters.vllm_ascend.glue.patch as patch
from graphbuf.errors import SpecError
from graphbuf.planning.vllm_coverage import VllmServing, certify, derive_capture_sizes

Q_LEN = 4  # 1 + num_speculative_tokens (MTP 3)
WIDTH = -(-5500 // KERNEL_BLOCK)  # the runner's table width in kernel blocks (43)


def _route(metadata):
    return getattr(metadata, patch.ROUTE_ATTR, None)


def _assert_rows(route, batch: RunnerBatch) -> None:
    live = len(batch.seq_lens)
    assert route.num_reqs == live
    width = batch.table.shape[1]
    assert torch.equal(route.block_table[:live, :width], batch.table)
    assert torch.equal(route.seq_lens[:live], torch.tensor(batch.seq_lens, dtype=torch.int32))
    assert not route.block_table[live:].any() and not route.seq_lens[live:].any()  # padded requests: pads


def test_dp_padded_batch_routes_on_the_padded_size(patched) -> None:
    """DP padding: 3 live MTP requests (12 tokens) padded by the runner to 4 requests / 16 tokens."""
    config = make_vllm_config(capture_sizes=vllm_capture_sizes(16, 3, 8192, 2))
    builder = make_builder(config)
    gen = torch.Generator().manual_seed(0)
    batch = random_batch(gen, live=3, q_len=Q_LEN, num_blocks=400, max_len=5500, padded_reqs=4, width=WIDTH)
    route = _route(builder.build(0, batch.common()))
    assert route is not None and route.q_len == Q_LEN and route.size == 16
    assert route.block_table.shape[0] == 4 and route.seq_lens.shape[0] == 4
    _assert_rows(route, batch)


def test_runner_padding_to_the_next_capture_size(patched) -> None:
    """5 live requests (20 tokens) replayed in the 24-token graph: the route keys on 24, not 20."""
    config = make_vllm_config(capture_sizes=[4, 8, 16, 24, 32])
    builder = make_builder(config)
    gen = torch.Generator().manual_seed(1)
    batch = random_batch(gen, live=5, q_len=Q_LEN, num_blocks=400, max_len=5500, padded_reqs=6, width=WIDTH)
    route = _route(builder.build(0, batch.common()))
    assert route is not None and route.size == 24 and route.seq_lens.shape[0] == 6
    _assert_rows(route, batch)
    # A smaller batch next step reuses the same addresses of its own size and clears the stale rows.
    small = random_batch(gen, live=1, q_len=Q_LEN, num_blocks=400, max_len=5500, padded_reqs=1, width=WIDTH)
    route4 = _route(builder.build(0, small.common()))
    assert route4.size == 4
    _assert_rows(route4, small)


def test_manager_block_256_over_kernel_block_128() -> None:
    """vLLM's page-size unification gives Gemma4's 512-head group block 256 at TP=2; the runner's table
    stays in 128-token kernel blocks and graphbuf's captured table follows it."""
    spec = gemma4_specs()[FULL_LAYER]
    assert spec.block_size == 256  # vLLM's own unify_kv_cache_spec_page_size on the TP=2 geometry


def test_routed_table_follows_the_kernel_block_size(patched) -> None:
    spec = gemma4_specs()[FULL_LAYER]
    config = make_vllm_config(capture_sizes=vllm_capture_sizes(16, 3, 8192, 2))
    builder = make_builder(config, spec)
    gen = torch.Generator().manual_seed(2)
    batch = random_batch(gen, live=2, q_len=Q_LEN, num_blocks=400, max_len=5500, padded_reqs=2, width=WIDTH)
    route = _route(builder.build(0, batch.common()))
    assert route is not None and route.block_table.shape[1] == WIDTH  # 43 kernel blocks, not 22 of 256
    _assert_rows(route, batch)


def test_vllm_default_capture_sizes_start_and_oversize_batches_keep_upstream(patched, caplog) -> None:
    """vLLM's default list reaches max_num_seqs * (1 + k) * 2 = 128 tokens: beyond the spec's envelope
    (64 tokens = 16 requests) nothing is routed and one log line names the sizes; the rest route."""
    sizes = vllm_capture_sizes(16, 3, 8192, 2)
    assert sizes[-1] == 128
    config = make_vllm_config(capture_sizes=sizes)
    builder = make_builder(config)
    gen = torch.Generator().manual_seed(3)
    with caplog.at_level(logging.INFO, logger="graphbuf"):
        batch = random_batch(gen, live=16, q_len=Q_LEN, num_blocks=400, max_len=5500, padded_reqs=16,
                             width=WIDTH)  # fmt: skip
        route = _route(builder.build(0, batch.common()))
        assert route is not None and route.size == 64
        big = RunnerBatch([100] * 16, torch.zeros((16, 1), dtype=torch.int32), Q_LEN, 18, 72, max_reqs=64)
        assert _route(builder.build(0, big.common())) is None  # 72 > envelope: upstream's path
    lines = [r.getMessage() for r in caplog.records if "not routed" in r.getMessage()]
    assert len(lines) == 1 and "72" in lines[0] and "128" in lines[0], lines


def test_one_token_decode_in_mtp_group_and_mixed_batches(patched) -> None:
    config = make_vllm_config(capture_sizes=vllm_capture_sizes(16, 3, 8192, 2))
    builder = make_builder(config)
    gen = torch.Generator().manual_seed(4)
    one = random_batch(gen, live=3, q_len=1, num_blocks=400, max_len=5500, padded_reqs=4, width=WIDTH)
    route = _route(builder.build(0, one.common()))
    assert route is not None and route.q_len == 1 and route.size == 4
    _assert_rows(route, one)


def _upstream_capture_sizes(seqs: int, k: int, tokens: int, sizes: tuple[int, ...] | None) -> list[int] | str:
    """What this tree's vllm-ascend and vLLM make of the configuration: the platform's
    ``apply_config_platform_defaults`` (the Ascend ceiling), vLLM's ``VllmConfig._set_cudagraph_sizes`` and
    ``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode``; ``"refused"`` where vLLM raises."""
    platform = importlib.import_module("vllm_ascend.platform").NPUPlatform
    cc = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY)
    cc.cudagraph_capture_sizes = None if sizes is None else list(sizes)
    holder = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False), compilation_config=cc,
        speculative_config=SimpleNamespace(num_speculative_tokens=k) if k else None, num_speculative_tokens=k,
        uniform_decode_query_len=1 + k,
        scheduler_config=SimpleNamespace(max_num_seqs=seqs, max_num_batched_tokens=tokens),
        parallel_config=SimpleNamespace(tensor_parallel_size=1), performance_mode="balanced",
    )  # fmt: skip
    platform.apply_config_platform_defaults(holder)
    try:
        VllmConfig._set_cudagraph_sizes(holder)
        cc.adjust_cudagraph_sizes_for_spec_decode(1 + k, 1)
    except ValueError:
        return "refused"
    return list(cc.cudagraph_capture_sizes)


CONFIGS = [
    (seqs, k, 8192, None) for seqs in (1, 2, 4, 8, 13, 16, 33, 64, 100, 128, 129, 256) for k in (0, 1, 2, 3)
]
CONFIGS += [(16, 3, 40, None), (13, 3, 8192, (4, 8, 16, 32, 50)), (13, 3, 8192, (4, 8, 52)), (8, 0, 6, None)]


@pytest.mark.parametrize(("seqs", "k", "tokens", "sizes"), CONFIGS)
def test_the_certificate_derives_capture_sizes_as_this_upstream_does(seqs, k, tokens, sizes) -> None:
    """graphbuf.planning.vllm_coverage against vLLM's and vllm-ascend's own config code on this tree."""
    serving = VllmServing(seqs, k, capture_sizes=sizes, max_num_batched_tokens=tokens)
    expected = _upstream_capture_sizes(seqs, k, tokens, sizes)
    if expected == "refused":
        with pytest.raises(SpecError):
            derive_capture_sizes(serving)
    else:
        assert list(derive_capture_sizes(serving)[0]) == expected


def test_the_off_grid_top_batch_is_eager_on_this_upstream_and_the_fix_covers_it() -> None:
    """vllm-ascend #16049/#16623 on this tree: max_num_seqs 13 with MTP 3 leaves 13 requests eager."""
    sizes = _upstream_capture_sizes(13, 3, 8192, None)
    assert isinstance(sizes, list) and sizes[-1] == 48 < 13 * 4
    cert = certify(VllmServing(13, 3, max_num_batched_tokens=8192))
    assert cert.eager_requests == (13,) and cert.fix is not None
    fixed = _upstream_capture_sizes(13, 3, 8192, cert.fix)
    assert fixed == list(cert.fix) and certify(VllmServing(13, 3, capture_sizes=tuple(fixed))).ok


def test_an_eager_decode_batch_is_one_warning_when_a_group_is_first_routed(patched, caplog) -> None:
    """At activation on a running configuration (the first routed build of a KV group), the adapter certifies
    the configuration: with this tree's own sizes for max_num_seqs 13 and MTP 3, one warning names the
    eager batch and the sizes that cover it; later builds and groups add nothing."""
    sizes = _upstream_capture_sizes(13, 3, 8192, None)
    config = make_vllm_config(capture_sizes=sizes, num_spec=3, max_num_seqs=13)
    gen = torch.Generator().manual_seed(7)
    with caplog.at_level(logging.WARNING, logger="graphbuf"):
        for _ in range(2):
            builder = make_builder(config)
            batch = random_batch(gen, live=3, q_len=Q_LEN, num_blocks=400, max_len=5500, padded_reqs=4,
                                 width=WIDTH)  # fmt: skip
            assert _route(builder.build(0, batch.common())) is not None
    lines = [r.getMessage() for r in caplog.records if "EAGERLY" in r.getMessage()]
    fix = certify(VllmServing(13, 3, max_num_batched_tokens=8192)).fix
    assert len(lines) == 1 and "13 requests (52 tokens" in lines[0], lines
    assert f"cudagraph_capture_sizes={list(fix)}" in lines[0]
