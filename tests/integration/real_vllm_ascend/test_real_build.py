"""The real ``AscendAttentionMetadataBuilder.build``, patched: padded batches, kernel block sizes, vLLM's
capture sizes (issue 10, sections 2-4)."""

from __future__ import annotations

import logging

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

import graphbuf.adapters.vllm_ascend.glue.patch as patch

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
