"""The patched ``forward_impl`` and ``build`` (routing.py, resolve.py, routed_decode.py) on the fake
tree: which batches go to graphbuf's kernels, graphbuf's own buffers refreshed, cleared and watched before
any refresh, and the output written once."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import logging
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm_plugin_harness import (
    BLOCK_SIZE,
    LARGE_HEAD_MODULE,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    NUM_BLOCKS,
    NUM_HEADS,
    NUM_KV_HEADS,
    WIDTH,
    CUDAGraphMode,
    Runner,
    kv_cache,
    make_builder,
    make_impl,
    original_calls,
    run_layer,
    set_capturing,
)

import graphbuf.adapters.vllm_ascend.glue.patch as patch
import graphbuf.adapters.vllm_ascend.glue.resolve as resolve
import graphbuf.adapters.vllm_ascend.glue.routing as routing
from graphbuf.errors import AddressChangedError, WidthError
from graphbuf.graphs.graph import Graph

# ----------------------------------------------------------------------------------------- routing


def test_head512_decode_under_full_decode_only_goes_to_graphbuf_decode(av1: Any, kernels: Any) -> None:
    runner = Runner()
    builder = make_builder(av1)
    metadata = builder.build(0, runner.common(av1, [1, 1, 1], "DecodeOnly", padded_reqs=4))
    route = getattr(metadata, patch.ROUTE_ATTR)
    assert route.q_len == 1
    set_capturing(True)
    output, result = run_layer(av1, make_impl(av1), metadata, num_tokens=4)

    assert result is output
    assert torch.equal(output, torch.ones_like(output))
    assert original_calls(av1, "forward_impl") == []
    assert original_calls(av1, "record_attention_compute_start") == [None]
    [(kind, args)] = kernels.calls
    assert kind == "decode"
    assert args["scale"] == 0.125
    # graphbuf's captured buffers at capture size 4 (the padded batch), not the runner's tensors.
    views = resolve.group_buffers(builder).buffers.view(4)
    assert args["block_table"].data_ptr() == views["block_table.full"].data_ptr()
    assert args["seq_lens"].data_ptr() == views["seq_lens"].data_ptr()
    assert args["block_table"].data_ptr() != runner.block_table.data_ptr()
    assert args["block_table"].shape == (4, WIDTH)
    assert (route.size, route.num_reqs) == (4, 3)
    # Three live requests; the padded fourth row is cleared, whatever the runner holds there.
    assert args["lens_values"] == [5, 6, 7, 0]
    assert args["table_values"] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 0, 0]]


@pytest.mark.parametrize("state", ["SpecDecoding", "ChunkedPrefill"])
def test_head512_mtp_verify_goes_to_graphbuf_verify(av1: Any, kernels: Any, state: str) -> None:
    # ChunkedPrefill: the label vllm-ascend gives its non-MLA MTP capture dummy runs (uniform, no prefill).
    runner = Runner()
    builder = make_builder(av1, spec_tokens=2)
    metadata = builder.build(0, runner.common(av1, [3, 3], state))
    set_capturing(True)
    output, _ = run_layer(av1, make_impl(av1), metadata, num_tokens=6)

    assert original_calls(av1, "forward_impl") == []
    [(kind, args)] = kernels.calls
    assert (kind, args["q_len"]) == ("verify", 3)
    assert args["block_table"].shape == (2, WIDTH)
    assert args["lens_values"] == [5, 6]
    views = resolve.group_buffers(builder).buffers.view(6)
    assert args["seq_lens"].data_ptr() == views["seq_lens"].data_ptr()
    assert torch.equal(output, torch.ones_like(output))


def test_runtime_full_mode_also_routes(av1: Any, kernels: Any) -> None:
    sys.modules["vllm.forward_context"].CONTEXT.cudagraph_runtime_mode = CUDAGraphMode.FULL
    metadata = make_builder(av1).build(0, Runner().common(av1, [1, 1], "DecodeOnly"))
    run_layer(av1, make_impl(av1), metadata, num_tokens=2)
    assert [kind for kind, _ in kernels.calls] == ["decode"]


def test_head256_calls_the_original(av1: Any, kernels: Any) -> None:
    metadata = make_builder(av1, head_size=256).build(0, Runner().common(av1, [1, 1], "DecodeOnly"))
    assert getattr(metadata, patch.ROUTE_ATTR, None) is None
    set_capturing(True)
    output, _ = run_layer(av1, make_impl(av1, head_size=256), metadata, num_tokens=2)
    assert original_calls(av1, "forward_impl") == [256]
    assert kernels.calls == []
    assert torch.all(output == av1.ORIGINAL_OUTPUT_VALUE)


@pytest.mark.parametrize(
    "mode",
    [CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE],
)
def test_other_graph_modes_call_the_original(av1: Any, kernels: Any, mode: CUDAGraphMode) -> None:
    metadata = make_builder(av1, mode=mode).build(0, Runner().common(av1, [1, 1], "DecodeOnly"))
    assert getattr(metadata, patch.ROUTE_ATTR, None) is None
    set_capturing(True)
    run_layer(av1, make_impl(av1), metadata, num_tokens=2)
    assert original_calls(av1, "forward_impl") == [512]
    assert kernels.calls == []


@pytest.mark.parametrize(
    ("q_lens", "state"),
    [
        ([7, 1], "ChunkedPrefill"),  # a prefill request in the batch
        ([5], "PrefillNoCache"),
        ([3, 2], "SpecDecoding"),  # not uniform
        ([2, 2], "SpecDecoding"),  # query length neither 1 nor 1 + num_speculative_tokens
    ],
)
def test_prefill_and_non_uniform_batches_call_the_original(
    av1: Any, kernels: Any, q_lens: list[int], state: str
) -> None:
    metadata = make_builder(av1, spec_tokens=2).build(0, Runner().common(av1, q_lens, state))
    assert getattr(metadata, patch.ROUTE_ATTR).q_len is None  # the group is routed, this batch is not
    run_layer(av1, make_impl(av1), metadata, num_tokens=sum(q_lens))
    assert original_calls(av1, "forward_impl") == [512]
    assert kernels.calls == []
    # Inside a full graph too: the batch is not routed, so the replay update keeps it and upstream runs it.
    set_capturing(True)
    run_layer(av1, make_impl(av1), metadata, num_tokens=sum(q_lens))
    assert original_calls(av1, "forward_impl") == [512, 512]
    assert kernels.calls == []


def test_eager_decode_outside_a_full_graph_calls_the_original(av1: Any, kernels: Any) -> None:
    metadata = make_builder(av1).build(0, Runner().common(av1, [1, 1], "DecodeOnly"))
    assert getattr(metadata, patch.ROUTE_ATTR) is not None
    set_capturing(False)
    run_layer(av1, make_impl(av1), metadata, num_tokens=2)
    assert original_calls(av1, "forward_impl") == [512]
    assert kernels.calls == []


def test_builder_subclasses_are_never_routed(av1: Any) -> None:
    builder = make_builder(av1, cls=av1.AscendAttentionPCPMetadataBuilder)
    metadata = builder.build(0, Runner().common(av1, [1, 1], "DecodeOnly"))
    assert original_calls(av1, "pcp_build") == [None]
    assert getattr(metadata, patch.ROUTE_ATTR, None) is None


def test_routed_layer_that_graphbuf_cannot_run_falls_back_with_a_reason(
    av1: Any, kernels: Any, caplog: pytest.LogCaptureFixture
) -> None:
    builder = make_builder(av1)
    metadata = builder.build(0, Runner().common(av1, [1, 1], "DecodeOnly"))
    set_capturing(True)
    with caplog.at_level(logging.WARNING, logger="graphbuf"):
        run_layer(av1, make_impl(av1, sliding_window=1024), metadata, num_tokens=2)
    assert kernels.calls == [] and original_calls(av1, "forward_impl") == [512]
    assert any("capture size 2 keeps vllm-ascend's path" in r.getMessage() and "sliding_window is set"
               in r.getMessage() for r in caplog.records)  # fmt: skip
    # The size stays on upstream's path for every later batch: capture and replay agree.
    again = builder.build(0, Runner().common(av1, [1, 1], "DecodeOnly"))
    route = getattr(again, patch.ROUTE_ATTR)
    assert route.q_len is None and "sliding_window is set" in route.reason
    forward_context = SimpleNamespace(attn_metadata={"layer": again})
    assert routing.without_routed(forward_context.attn_metadata) is forward_context.attn_metadata
    # More query tokens than the route's rows: the same fallback, for that size.
    builder = make_builder(av1)
    metadata = builder.build(0, Runner().common(av1, [1, 1], "DecodeOnly"))
    run_layer(av1, make_impl(av1), metadata, num_tokens=3)
    assert kernels.calls == [] and original_calls(av1, "forward_impl") == [512, 512]
    assert (
        "block_table at capture size 2 has 2 rows, the batch needs 3"
        in resolve.group_buffers(builder).fallbacks[2]
    )


def reference_attention(
    query: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    table: torch.Tensor,
    seq_lens: list[int],
    q_len: int,
    scale: float,
) -> torch.Tensor:
    """Naive paged attention: query i of request r sees key positions 0 .. seq_lens[r] - q_len + i."""
    key_cache, value_cache = caches
    group = NUM_HEADS // NUM_KV_HEADS
    out = torch.zeros_like(query)
    for r, seq_len in enumerate(seq_lens):
        pos = torch.arange(seq_len)
        blocks = table[r, pos // BLOCK_SIZE].long()
        keys, values = key_cache[blocks, pos % BLOCK_SIZE], value_cache[blocks, pos % BLOCK_SIZE]
        for i in range(q_len):
            visible = seq_len - q_len + i + 1
            for h in range(NUM_HEADS):
                q = query[r * q_len + i, h]
                k, v = keys[:visible, h // group], values[:visible, h // group]
                out[r * q_len + i, h] = torch.softmax((k @ q) * scale, dim=0) @ v
    return out


@pytest.mark.parametrize(
    ("q_lens", "state", "spec_tokens"), [([1, 1], "DecodeOnly", 0), ([3, 3], "SpecDecoding", 2)]
)
def test_routed_call_through_real_large_head_matches_reference(
    av1: Any, q_lens: list[int], state: str, spec_tokens: int
) -> None:
    try:
        importlib.import_module(LARGE_HEAD_MODULE)
    except ImportError as exc:
        pytest.skip(f"graphbuf's large_head is not importable yet: {exc!r}")
    torch.manual_seed(0)
    runner = Runner()
    common = runner.common(av1, q_lens, state)
    runner.block_table[:2] = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    runner.seq_lens[:2] = torch.tensor([7, 10], dtype=torch.int32)
    metadata = make_builder(av1, spec_tokens=spec_tokens).build(0, common)
    caches = (
        torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 512),
        torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 512),
    )
    query = torch.randn(sum(q_lens), NUM_HEADS, 512)
    output = torch.zeros_like(query)
    set_capturing(True)
    make_impl(av1).forward_impl(query, None, None, caches, metadata, output)

    assert original_calls(av1, "forward_impl") == []
    expected = reference_attention(query, caches, runner.block_table[:2], [7, 10], q_lens[0], 0.125)
    torch.testing.assert_close(output, expected, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- graphbuf's own buffers


def routed_batch(
    av1: Any, builder: Any, runner: Runner, tables: list[list[int]], lens: list[int], q_len: int, state: str
) -> Any:
    """Build a batch of ``len(lens)`` live requests padded to 4 rows; the runner's rows past the live ones
    hold stale values of earlier requests (nonzero), as a runner's persistent tensors do."""
    live = len(lens)
    common = runner.common(av1, [q_len] * live, state, padded_reqs=4)
    runner.block_table[:live] = torch.tensor(tables, dtype=torch.int32)
    runner.seq_lens[:live] = torch.tensor(lens, dtype=torch.int32)
    runner.block_table[live:] = 5
    runner.seq_lens[live:] = MAX_MODEL_LEN
    return builder.build(0, common)


@pytest.mark.parametrize(("q_len", "state"), [(1, "DecodeOnly"), (3, "SpecDecoding")])
def test_captured_forward_replays_refreshed_graphbuf_buffers(av1: Any, q_len: int, state: str) -> None:
    """Capture the routed forward in graphbuf's CPU graph emulator, then, as vLLM does on each replay,
    build the metadata again with new runner data and replay: the graph reads the new values because the
    Route's views keep their addresses; live rows match the naive reference, padded rows are zeros."""
    torch.manual_seed(1)
    builder = make_builder(av1, spec_tokens=q_len - 1)
    runner, impl = Runner(), make_impl(av1)
    size = 4 * q_len  # 3 or 4 live requests -> the capture size of 4 requests
    caches = (
        torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 512),
        torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 512),
    )
    query = torch.randn(size, NUM_HEADS, 512)
    output = torch.zeros_like(query)

    batches = [
        ([[4, 1, 0], [2, 5, 3], [0, 0, 0]], [7, 10, 2]),  # captured
        ([[1, 2, 3], [5, 4, 0], [3, 3, 3]], [12, 5, 9]),  # replayed: same size, new data
        ([[0, 5, 1], [2, 2, 2], [4, 0, 0], [3, 1, 5]], [9, 6, 3, 11]),  # a fourth live request
    ]
    metadata = routed_batch(av1, builder, runner, *batches[0], q_len, state)
    captured = getattr(metadata, patch.ROUTE_ATTR)
    assert captured.size == size
    # The emulator records device-length kernels only: decode takes its dense route here (the paged route's
    # host lengths are re-issued by update_graph_params: test_paged_decode_* below).
    captured.group.modes = dataclasses.replace(captured.group.modes, decode="dense")
    graph = Graph("cpu")
    set_capturing(True)
    with graph.capture():
        impl.forward_impl(query, None, None, caches, metadata, output)
    set_capturing(False)

    for i, (tables, lens) in enumerate(batches):
        if i:
            query.copy_(torch.randn_like(query))
            route = getattr(routed_batch(av1, builder, runner, tables, lens, q_len, state), patch.ROUTE_ATTR)
            assert (route.size, route.num_reqs) == (size, len(lens))
            assert route.block_table.data_ptr() == captured.block_table.data_ptr()
            assert route.seq_lens.data_ptr() == captured.seq_lens.data_ptr()
        graph.replay()
        live = len(lens) * q_len
        table = torch.tensor(tables, dtype=torch.int32)
        expected = reference_attention(query[:live], caches, table, lens, q_len, 0.125)
        torch.testing.assert_close(output[:live], expected, rtol=1e-4, atol=1e-4)
        assert torch.all(output[live:] == 0)  # padded rows: seq_len 0 gives zeros
    assert original_calls(av1, "forward_impl") == []


def test_views_keep_their_start_address_across_sizes(av1: Any, kernels: Any) -> None:
    builder, runner, impl = make_builder(av1), Runner(), make_impl(av1)
    set_capturing(True)
    pointers = []
    for live, size in ((1, 1), (3, 4), (5, 8), (3, 4)):
        metadata = builder.build(0, runner.common(av1, [1] * live, "DecodeOnly", padded_reqs=size))
        route = getattr(metadata, patch.ROUTE_ATTR)
        assert route.size == size and route.block_table.shape == (size, WIDTH)
        run_layer(av1, impl, metadata, num_tokens=size)
        args = kernels.calls[-1][1]
        pointers.append((args["block_table"].data_ptr(), args["seq_lens"].data_ptr()))
    assert len(set(pointers)) == 1


def test_padded_rows_are_cleared_in_the_graphbuf_views(av1: Any, kernels: Any) -> None:
    builder, runner = make_builder(av1), Runner()
    metadata = routed_batch(av1, builder, runner, [[1, 2, 3], [4, 5, 0]], [9, 4], 1, "DecodeOnly")
    route = getattr(metadata, patch.ROUTE_ATTR)
    assert (route.size, route.num_reqs) == (2, 2)
    # A smaller batch next: its padded rows must not keep the previous batch's values.
    common = runner.common(av1, [1], "DecodeOnly", padded_reqs=2)
    runner.block_table[1:] = 5  # stale rows the runner did not clear
    runner.seq_lens[1:] = 11
    route = getattr(builder.build(0, common), patch.ROUTE_ATTR)
    assert (route.size, route.num_reqs) == (1, 1)
    full = resolve.group_buffers(builder).buffers.full
    assert full["seq_lens"].tolist() == [5] + [0] * (MAX_NUM_SEQS - 1)
    assert full["block_table.full"][0].tolist() == [0, 1, 2]
    assert torch.all(full["block_table.full"][1:] == 0)
    set_capturing(True)
    run_layer(av1, make_impl(av1), builder.build(0, runner.common(av1, [1, 1, 1], "DecodeOnly", 4)), 4)
    assert kernels.calls[-1][1]["lens_values"] == [5, 6, 7, 0]
    assert kernels.calls[-1][1]["table_values"][3] == [0, 0, 0]


def test_too_wide_runner_block_table_raises_and_leaves_the_slab_unchanged(av1: Any) -> None:
    builder = make_builder(av1)
    builder.build(0, Runner().common(av1, [1, 1], "DecodeOnly"))
    slab = resolve.group_buffers(builder).buffers.slab
    before = slab.clone()
    wide = Runner(width=WIDTH + 1)
    with pytest.raises(WidthError, match=r"'block_table\.full'.*4 wide.*3 columns"):
        builder.build(0, wide.common(av1, [1, 1, 1], "DecodeOnly", padded_reqs=4))
    assert torch.equal(slab, before)


def test_capture_sizes_and_constants_come_from_the_vllm_config(av1: Any) -> None:
    builder = make_builder(av1, spec_tokens=2, capture_sizes=[12, 3, 6])
    runner = Runner()
    route = getattr(builder.build(0, runner.common(av1, [3, 3, 3], "SpecDecoding")), patch.ROUTE_ATTR)
    buffers = resolve.group_buffers(builder)
    assert buffers.capture_sizes == (3, 6, 12)
    assert buffers.tokens_per_request == 3
    assert buffers.buffers.names == ("block_table.full", "seq_lens")
    assert (route.q_len, route.size, route.block_table.shape) == (3, 12, (4, WIDTH))
    constants = buffers.buffers.plan.constants
    assert {k: constants[k] for k in ("max_model_len", "block_size", "max_num_seqs", "tp_size")} == {
        "max_model_len": MAX_MODEL_LEN,
        "block_size": BLOCK_SIZE,
        "max_num_seqs": MAX_NUM_SEQS,
        "tp_size": 2,
    }
    assert (constants["num_speculative_tokens"], constants["max_blocks_per_seq"]) == (2, WIDTH)
    # Above the largest capture size a batch is never graph-captured: no route, nothing refreshed.
    before = buffers.buffers.slab.clone()
    metadata = builder.build(0, runner.common(av1, [3] * 5, "SpecDecoding"))
    assert getattr(metadata, patch.ROUTE_ATTR, None) is None
    assert torch.equal(buffers.buffers.slab, before)
    assert resolve.group_buffers(builder) is buffers  # one StaticBuffers per builder


@pytest.mark.parametrize(
    ("capture_sizes", "max_num_seqs", "routed", "not_routed"),
    [
        ([3, 6, 24], 4, (3, 6), (24,)),  # 24 tokens = 8 requests > max_num_seqs
        ([3, 4, 6], 16, (3, 6), (4,)),  # 4 is not a multiple of 1 + num_speculative_tokens
    ],
)
def test_capture_sizes_beyond_the_envelope_are_left_to_upstream(
    av1: Any, capture_sizes: Any, max_num_seqs: int, routed: tuple[int, ...], not_routed: tuple[int, ...],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    builder = make_builder(av1, spec_tokens=2, capture_sizes=capture_sizes, max_num_seqs=max_num_seqs)
    with caplog.at_level(logging.INFO, logger="graphbuf"):
        metadata = builder.build(0, Runner().common(av1, [3, 3], "SpecDecoding"))
    assert getattr(metadata, patch.ROUTE_ATTR).size == 6
    buffers = resolve.group_buffers(builder)
    assert (buffers.capture_sizes, buffers.not_routed) == (routed, not_routed)
    lines = [r.getMessage() for r in caplog.records if "not routed" in r.getMessage()]
    assert len(lines) == 1 and all(str(s) in lines[0] for s in not_routed)


def test_a_config_the_spec_cannot_plan_keeps_upstream_with_a_warning(
    av1: Any, caplog: pytest.LogCaptureFixture
) -> None:
    builder = make_builder(av1, spec_tokens=2, capture_sizes=None)
    with caplog.at_level(logging.WARNING, logger="graphbuf"):
        metadata = builder.build(0, Runner().common(av1, [3, 3], "SpecDecoding"))
    assert getattr(metadata, patch.ROUTE_ATTR, None) is None
    assert any("compilation_config.cudagraph_capture_sizes is None" in r.getMessage() for r in caplog.records)


def test_decode_length_batch_under_mtp_routes_through_one_token_buffers(av1: Any, kernels: Any) -> None:
    """With 2 speculative tokens the group's verify buffers hold 3-token requests; a 1-token decode batch
    (an MTP drafter step, say) gets buffers planned for 1-token requests at the capture sizes that fit."""
    builder = make_builder(av1, spec_tokens=2)  # capture sizes 3, 6, 12, 24, 48 tokens
    metadata = builder.build(0, Runner().common(av1, [1, 1], "DecodeOnly"))
    route = getattr(metadata, patch.ROUTE_ATTR)
    assert (route.q_len, route.size, route.num_reqs) == (1, 3, 2)
    one_token = resolve.group_buffers(builder, q_len=1)
    assert one_token.tokens_per_request == 1
    assert one_token.capture_sizes == tuple(s for s in (3, 6, 12, 24, 48) if s <= MAX_NUM_SEQS)
    assert route.block_table.data_ptr() == one_token.buffers.view(3)["block_table.full"].data_ptr()
    assert resolve.group_buffers(builder).tokens_per_request == 3  # the verify buffers are separate
    set_capturing(True)
    run_layer(av1, make_impl(av1), metadata, num_tokens=3)
    name, seen = kernels.calls[-1]
    assert name == "decode" and seen["lens_values"][2] == 0  # the padded request is cleared


def test_decode_length_batch_with_no_fitting_size_keeps_upstream(av1: Any, kernels: Any) -> None:
    # Capture sizes 3 and 6 tokens hold 1-token batches of 3 and 6 requests: above max_num_seqs = 2.
    builder = make_builder(av1, spec_tokens=2, capture_sizes=[3, 6], max_num_seqs=2)
    metadata = builder.build(0, Runner().common(av1, [1, 1], "DecodeOnly"))
    route = getattr(metadata, patch.ROUTE_ATTR)
    assert route.q_len is None and route.block_table is None
    assert resolve.group_buffers(builder, q_len=1) is None
    run_layer(av1, make_impl(av1), metadata, num_tokens=2)  # eager: the original path
    assert original_calls(av1, "forward_impl") == [512]
    assert "no routed capture size holds 2 tokens of 1-token requests" in route.reason
    set_capturing(True)
    run_layer(av1, make_impl(av1), metadata, num_tokens=2)  # under a full graph: upstream's path too
    assert original_calls(av1, "forward_impl") == [512, 512]
    assert kernels.calls == []


# --------------------------------------------------------------------------------- output handling


def _spy_copy(tensor: torch.Tensor) -> list[Any]:
    calls: list[Any] = []
    real_copy = tensor.copy_

    def copy_(src: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(src)
        return real_copy(src, *args, **kwargs)

    tensor.copy_ = copy_  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("alias", ["same_object", "view_of_output"])
def test_output_is_never_copied_onto_itself(av1: Any, kernels: Any, alias: str) -> None:
    metadata = make_builder(av1).build(0, Runner().common(av1, [1, 1], "DecodeOnly"))
    set_capturing(True)
    query = torch.randn(2, NUM_HEADS, 512)
    output = torch.zeros_like(query)
    copies = _spy_copy(output)

    def decode_in_place(query, key_cache, value_cache, block_table, seq_lens, scale, **kwargs):  # type: ignore[no-untyped-def]
        output.fill_(3.0)
        return output if alias == "same_object" else output.view(2, NUM_HEADS * 512)

    kernels.module.decode_attention = decode_in_place
    result = make_impl(av1).forward_impl(query, None, None, kv_cache(), metadata, output)
    assert result is output
    assert copies == []
    assert torch.all(output == 3.0)


def test_separate_result_is_copied_into_output_once(av1: Any, kernels: Any) -> None:
    metadata = make_builder(av1).build(0, Runner().common(av1, [1, 1], "DecodeOnly"))
    set_capturing(True)
    query = torch.randn(2, NUM_HEADS, 512)
    output = torch.zeros_like(query)
    copies = _spy_copy(output)
    result = make_impl(av1).forward_impl(query, None, None, kv_cache(), metadata, output)
    assert result is output
    assert len(copies) == 1 and copies[0].data_ptr() != output.data_ptr()
    assert torch.equal(output, torch.ones_like(output))


# ------------------------------------------------------------------------- watch check before replay


def test_a_moved_kv_cache_is_refused_by_the_next_build_before_any_refresh(av1: Any, kernels: Any) -> None:
    """Routed paged decode captured at size 2; the layer's KV cache then replaced: the next build of that
    size raises AddressChangedError naming the layer and key_cache, and graphbuf's buffers keep the
    captured step's values (nothing written)."""
    builder, runner, impl = make_builder(av1), Runner(), make_impl(av1)
    metadata = builder.build(0, runner.common(av1, [1, 1], "DecodeOnly"))
    set_capturing(True)
    run_layer(av1, impl, metadata, num_tokens=2)
    set_capturing(False)
    route = getattr(metadata, patch.ROUTE_ATTR)
    assert len(route.group.decodes.tasks(2)) == 1
    before = route.block_table.clone(), route.seq_lens.clone()
    impl.key_cache = impl.key_cache.clone()  # vLLM re-allocated this layer's cache
    common = runner.common(av1, [1, 1], "DecodeOnly")
    runner.block_table.add_(1)
    runner.seq_lens.add_(3)
    with pytest.raises(AddressChangedError, match=r"size 2: routed decode layer #0 .*key_cache moved"):
        builder.build(0, common)
    assert torch.equal(route.block_table, before[0]) and torch.equal(route.seq_lens, before[1])


def test_a_new_config_or_builder_at_a_freed_ones_address_still_gets_its_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The once-per-object log lines key on id(): the registries hold the objects, so a freed config's or
    builder's address taken by a new one cannot hide the new one's line (found flaky in CI: CPython reuses a
    freed object's memory at once for the next of its size)."""
    monkeypatch.setattr(resolve, "_logged", {})
    monkeypatch.setattr(routing, "_owners_logged", {})
    decided = SimpleNamespace(owner="graphbuf", owner_reason="test", mechanism=resolve.Mechanism.LEGACY)
    buffers = SimpleNamespace(tokens_per_request=4, not_routed=(128,), capture_sizes=(8, 16))
    with caplog.at_level(logging.INFO, logger="graphbuf"):
        for _ in range(50):  # each builder and config freed before the next is made
            builder = SimpleNamespace(vllm_config=SimpleNamespace(), layer_names=["layer"])
            resolve._log_not_routed(builder, buffers)
            routing._log_owner(builder, decided)  # type: ignore[arg-type]
            del builder
    messages = [r.getMessage() for r in caplog.records]
    assert sum("not routed" in m for m in messages) == 50
    assert sum("large-head layers" in m for m in messages) == 50
