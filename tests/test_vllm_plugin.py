"""Tests of graphbuf's vLLM general plugin and its patch of vllm-ascend's attention classes.

The real vllm-ascend cannot be imported here: ``vllm_ascend.attention.attention_v1`` imports torch_npu at
module level and needs an Ascend NPU. The patch tests therefore put ``tests/fake_vllm_ascend`` first on
``sys.path``: it mirrors vllm-ascend's package, class and method names and signatures (0.23 - 0.26) exactly,
because the patch finds its targets by those names. Routing tests replace graphbuf's ``large_head`` kernels
with recording stubs; the numeric tests run the real kernels (CPU software path) against a naive
reference, and one captures the routed forward in graphbuf's CPU graph emulator and replays it after
rebuilding the metadata.

The discovery tests run ``vllm.plugins.load_general_plugins()`` in subprocesses, because vLLM loads general
plugins once per process; they need vllm importable and graphbuf pip-installed (its entry point).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import graphbuf.adapters.vllm_ascend.patch as patch
import graphbuf.adapters.vllm_ascend.plugin as plugin
import graphbuf.adapters.vllm_ascend.resolve as resolve
import graphbuf.adapters.vllm_ascend.routed_decode as routed_decode
import graphbuf.adapters.vllm_ascend.routing as routing
import graphbuf.adapters.vllm_ascend.upstream as upstream
from graphbuf.errors import AddressChangedError, GraphbufError, WidthError
from graphbuf.graphs.graph import Graph

FAKE_ROOT = Path(__file__).resolve().parent / "fake_vllm_ascend"
FAKE_VLLM_MODULES = {
    "vllm.forward_context": "fake_vllm.forward_context",
    "vllm.config": "fake_vllm.config",
    "vllm.v1.kv_cache_interface": "fake_vllm.kv_cache_interface",
}
"""The vLLM modules of the upstream surface, faked (the real vLLM 0.32 here lacks its import chain)."""
ADAPTER_DIR = Path(plugin.__file__).resolve().parent
LARGE_HEAD_MODULE = f"{plugin.__package__}.large_head"
NUM_HEADS, NUM_KV_HEADS, BLOCK_SIZE, NUM_BLOCKS, WIDTH = 2, 1, 4, 6, 3
MAX_MODEL_LEN = WIDTH * BLOCK_SIZE  # so graphbuf's block table is WIDTH columns wide, like the runner's
MAX_NUM_SEQS = 16


class CUDAGraphMode(enum.Enum):
    """Same member names as vLLM's ``vllm.config.compilation.CUDAGraphMode``."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (2, 0)
    FULL_AND_PIECEWISE = (2, 1)


# ----------------------------------------------------------------------------------------- fixtures


def _purge_fake_modules() -> None:
    for name in list(sys.modules):
        if name == "vllm_ascend" or name.startswith("vllm_ascend."):
            del sys.modules[name]


@pytest.fixture
def fake_tree(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The fake vllm_ascend importable, nothing patched before or after, no vLLM forward context.

    The fake mirrors vllm-ascend's module, class and method names because the real package cannot be
    imported without torch_npu (and an NPU)."""
    patch.unpatch()
    _purge_fake_modules()
    monkeypatch.syspath_prepend(str(FAKE_ROOT))
    for name, fake in FAKE_VLLM_MODULES.items():
        module = importlib.import_module(fake)
        if fake == "fake_vllm.forward_context":
            monkeypatch.setattr(module, "CONTEXT", module.ForwardContext())
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(patch, "_inactive", None)
    yield
    patch.unpatch()
    _purge_fake_modules()


@pytest.fixture
def av1(fake_tree: Any) -> Any:
    """The fake attention_v1 module, patched, with an empty call log."""
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    assert patch.install() == "applied"
    module.CALLS.clear()
    return module


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Recording stand-ins for graphbuf's large_head kernels (returning 1.0 everywhere)."""
    calls: list[tuple[str, dict[str, Any]]] = []
    module = types.ModuleType(LARGE_HEAD_MODULE)

    def decode_attention(query, key_cache, value_cache, block_table, seq_lens, scale, *, seq_lens_host=None):  # type: ignore[no-untyped-def]
        seen = _seen(block_table, seq_lens, scale=scale, query=query, seq_lens_host=seq_lens_host)
        calls.append(("decode", seen))
        return torch.ones_like(query)

    def verify_attention(query, key_cache, value_cache, block_table, seq_lens, q_len, scale):  # type: ignore[no-untyped-def]
        calls.append(("verify", _seen(block_table, seq_lens, q_len=q_len, scale=scale, mode="dense")))
        return torch.ones_like(query)

    def verify_attention_blockwise(query, key_cache, value_cache, block_table, seq_lens, q_len, scale,  # type: ignore[no-untyped-def]
                                   chunk_blocks=2):  # fmt: skip
        seen = _seen(
            block_table, seq_lens, q_len=q_len, scale=scale, mode="blockwise", chunk_blocks=chunk_blocks
        )
        calls.append(("verify", seen))
        return torch.ones_like(query)

    def decode_into(query, key_cache, value_cache, block_table, seq_lens, out, *, seq_lens_kv, scale,  # type: ignore[no-untyped-def]
                    issue=None):  # fmt: skip
        result = module.decode_attention(query, key_cache, value_cache, block_table, seq_lens, scale,  # type: ignore[attr-defined]
                                         seq_lens_host=seq_lens_kv)  # fmt: skip
        if result.data_ptr() != out.data_ptr():  # as the real one: never copied onto itself
            out.copy_(result.reshape(out.shape))
        return out

    module.DEFAULT_CHUNK_BLOCKS = 2  # type: ignore[attr-defined]
    module.decode_attention = decode_attention  # type: ignore[attr-defined]
    module.decode_into = decode_into  # type: ignore[attr-defined]
    module.verify_attention = verify_attention  # type: ignore[attr-defined]
    module.verify_attention_blockwise = verify_attention_blockwise  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, LARGE_HEAD_MODULE, module)
    monkeypatch.setattr(sys.modules[plugin.__package__], "large_head", module, raising=False)
    # The routed paged decode tasks call large_head through their own module.
    monkeypatch.setattr(routed_decode, "large_head", module)
    return SimpleNamespace(calls=calls, module=module)


# ------------------------------------------------------------------------------------------ helpers


def _seen(block_table: torch.Tensor, seq_lens: torch.Tensor, **kwargs: Any) -> dict[str, Any]:
    """What a kernel was handed: the tensors and their values at call time (a later build rewrites them)."""
    return dict(
        block_table=block_table,
        seq_lens=seq_lens,
        table_values=block_table.tolist(),
        lens_values=seq_lens.tolist(),
        **kwargs,
    )


def set_capturing(flag: bool) -> None:
    importlib.import_module("vllm_ascend.ascend_forward_context")._EXTRA_CTX.capturing = flag


def make_builder(
    av1: Any,
    *,
    head_size: int = 512,
    mode: CUDAGraphMode = CUDAGraphMode.FULL_DECODE_ONLY,
    spec_tokens: int = 0,
    cls: Any = None,
    capture_sizes: Any = "default",
    max_num_seqs: int = MAX_NUM_SEQS,
) -> Any:
    """A builder with the vLLM config fields graphbuf reads. Default capture sizes: 1, 2, 4, 8 and 16
    requests of ``1 + spec_tokens`` tokens (vLLM rounds FULL_DECODE_ONLY sizes to that multiple)."""
    if capture_sizes == "default":
        capture_sizes = [(1 + spec_tokens) * r for r in (1, 2, 4, 8, 16)]
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_mode=mode, cudagraph_capture_sizes=capture_sizes),
        speculative_config=SimpleNamespace(num_speculative_tokens=spec_tokens) if spec_tokens else None,
        quant_config=None,
        model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048),
        parallel_config=SimpleNamespace(tensor_parallel_size=2),
    )
    spec = SimpleNamespace(
        head_size=head_size, num_kv_heads=NUM_KV_HEADS, sliding_window=None, block_size=BLOCK_SIZE
    )
    return (cls or av1.AscendAttentionMetadataBuilder)(spec, ["model.layers.5.self_attn.attn"], config, "cpu")


class Runner:
    """Persistent device-side buffers like vLLM's model runner: each batch gets row-prefix views."""

    def __init__(self, max_reqs: int = 16, width: int = WIDTH) -> None:
        self.seq_lens = torch.zeros(max_reqs, dtype=torch.int32)
        self.block_table = torch.zeros(max_reqs, width, dtype=torch.int32)

    def common(self, av1: Any, q_lens: list[int], state: str, padded_reqs: int | None = None) -> Any:
        """Common metadata of a batch with ``len(q_lens)`` live requests (``num_reqs``); the tensors are
        views of ``padded_reqs`` rows, and rows past the live ones hold whatever the runner left there."""
        reqs = padded_reqs or len(q_lens)
        width = self.block_table.shape[1]
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        starts += [starts[-1]] * (reqs - len(q_lens))
        self.seq_lens[:reqs] = torch.arange(reqs, dtype=torch.int32) + 5
        self.block_table[:reqs] = torch.arange(reqs * width, dtype=torch.int32).reshape(reqs, width)
        return SimpleNamespace(
            query_start_loc_cpu=torch.tensor(starts, dtype=torch.int32),
            seq_lens=self.seq_lens[:reqs],
            block_table_tensor=self.block_table[:reqs],
            num_reqs=len(q_lens),
            num_actual_tokens=sum(q_lens),
            max_query_len=max(q_lens),
            causal=True,
            attn_state=getattr(av1.AscendAttentionState, state),
            num_input_tokens=0,  # upstream's default: the unpadded count is the replayed one
        )


def make_impl(av1: Any, head_size: int = 512, **kwargs: Any) -> Any:
    return av1.AscendAttentionBackendImpl(
        num_heads=NUM_HEADS, head_size=head_size, scale=0.125, num_kv_heads=NUM_KV_HEADS, **kwargs
    )


def kv_cache(head_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, head_size)
    return torch.zeros(shape), torch.zeros(shape)


def run_layer(av1: Any, impl: Any, metadata: Any, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    query = torch.randn(num_tokens, NUM_HEADS, impl.head_size)
    output = torch.zeros_like(query)
    result = impl.forward_impl(query, None, None, kv_cache(impl.head_size), metadata, output)
    return output, result


def original_calls(av1: Any, name: str) -> list[Any]:
    return [detail for call, detail in av1.CALLS if call == name]


# ------------------------------------------------------------------------------ module import hygiene


STDLIB_ONLY = ("plugin.py", "patch.py", "routing.py", "upstream.py")
"""Adapter modules loaded by the plugin in every vLLM process: the standard library, each other and
``graphbuf.errors`` (itself standard-library only) only."""


@pytest.mark.parametrize("filename", STDLIB_ONLY)
def test_module_imports_only_the_standard_library(filename: str) -> None:
    tree = ast.parse((ADAPTER_DIR / filename).read_text())
    imported = set()
    for node in tree.body:  # module level only: imports inside functions are lazy by design
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                sibling = f"{(node.module or '').split('.')[0]}.py"
                names = [sibling] if node.module else [f"{a.name}.py" for a in node.names]
                assert all(n in STDLIB_ONLY for n in names), f"{filename}: relative import of {names}"
                continue
            if node.module != "graphbuf.errors":
                imported.add((node.module or "").split(".")[0])
    non_stdlib = sorted(
        name for name in imported if name not in sys.stdlib_module_names and name != "__future__"
    )
    assert non_stdlib == [], f"{filename} imports {non_stdlib} at module import time"


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


# ---------------------------------------------------------------------------- graph task updates


def test_update_graph_params_skips_routed_groups(av1: Any) -> None:
    runner = Runner()
    routed = make_builder(av1).build(0, runner.common(av1, [1, 1], "DecodeOnly"))
    sliding = make_builder(av1, head_size=256).build(0, runner.common(av1, [1, 1], "DecodeOnly"))
    context = SimpleNamespace(
        attn_metadata={"layers.0.attn": sliding, "layers.5.attn": routed, "layers.6.attn": sliding},
        capturing=False,
    )
    drafts = [{"mtp.0.attn": routed, "mtp.1.attn": sliding}]
    av1.AscendAttentionBackendImpl.update_graph_params(
        "stream", context, 2, "cfg", None, draft_attn_metadatas=drafts
    )

    [call] = original_calls(av1, "update_graph_params")
    assert call["keys"] == ["layers.0.attn", "layers.6.attn"]
    assert call["drafts"] == [["mtp.1.attn"]]
    assert call["num_tokens"] == 2
    assert call["forward_context"].capturing is False  # every other attribute is the real context's
    assert list(context.attn_metadata) == ["layers.0.attn", "layers.5.attn", "layers.6.attn"]  # untouched


def test_update_graph_params_without_routed_groups_passes_arguments_through(av1: Any) -> None:
    sliding = make_builder(av1, head_size=256).build(0, Runner().common(av1, [1, 1], "DecodeOnly"))
    context = SimpleNamespace(attn_metadata={"layers.0.attn": sliding})
    impl = make_impl(av1, head_size=256)
    impl.update_graph_params("stream", context, 2, "cfg")  # a staticmethod is callable on instances too
    [call] = original_calls(av1, "update_graph_params")
    assert call["forward_context"] is context
    assert call["drafts"] is None


# ------------------------------------------------------------------------- idempotence, reversal


def test_double_patch_wraps_once_and_keeps_metadata(fake_tree: Any) -> None:
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    impl_cls, builder_cls = module.AscendAttentionBackendImpl, module.AscendAttentionMetadataBuilder
    original_forward = impl_cls.__dict__["forward_impl"]
    original_update = impl_cls.__dict__["update_graph_params"]
    original_build = builder_cls.__dict__["build"]

    assert patch.install() == "applied"
    assert patch.install() == "already applied"
    assert patch.apply(module) is False

    wrapped = impl_cls.__dict__["forward_impl"]
    assert wrapped is not original_forward
    assert wrapped.__wrapped__ is original_forward  # one layer of wrapping, not two
    assert (wrapped.__name__, wrapped.__qualname__, wrapped.__doc__) == (
        original_forward.__name__,
        original_forward.__qualname__,
        original_forward.__doc__,
    )
    update = impl_cls.__dict__["update_graph_params"]
    assert isinstance(update, staticmethod)
    assert update.__func__.__wrapped__ is original_update.__func__
    assert update.__func__.__name__ == "update_graph_params"
    assert builder_cls.__dict__["build"].__wrapped__ is original_build
    assert patch.is_patched(module)


def test_unpatch_restores_the_original_methods(fake_tree: Any) -> None:
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    impl_cls, builder_cls = module.AscendAttentionBackendImpl, module.AscendAttentionMetadataBuilder
    before = (
        impl_cls.__dict__["forward_impl"],
        impl_cls.__dict__["update_graph_params"],
        builder_cls.__dict__["build"],
    )
    patch.install()
    assert patch.unpatch() is True
    after = (
        impl_cls.__dict__["forward_impl"],
        impl_cls.__dict__["update_graph_params"],
        builder_cls.__dict__["build"],
    )
    assert all(a is b for a, b in zip(before, after, strict=True))
    assert not patch.is_patched(module)
    assert "_graphbuf_originals" not in impl_cls.__dict__
    assert patch.unpatch() is False


def test_patch_is_deferred_until_the_attention_module_is_imported(fake_tree: Any) -> None:
    assert "vllm_ascend.attention.attention_v1" not in sys.modules
    assert patch.install() == "deferred"
    assert patch.install() == "deferred"
    hooks = [finder for finder in sys.meta_path if isinstance(finder, patch._PatchOnImport)]
    assert len(hooks) == 1
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    assert patch.is_patched(module)
    assert patch.install() == "already applied"
    patch.unpatch()
    assert not any(isinstance(finder, patch._PatchOnImport) for finder in sys.meta_path)
    assert not patch.is_patched(module)


def test_unexpected_layout_is_refused_and_nothing_changes(fake_tree: Any) -> None:
    module = types.ModuleType("vllm_ascend.attention.attention_v1")

    class AscendAttentionBackendImpl:
        def forward_impl(self, query, attn_metadata):  # type: ignore[no-untyped-def]
            return None

    class AscendAttentionMetadataBuilder:
        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):  # type: ignore[no-untyped-def]
            return None

    module.AscendAttentionBackendImpl = AscendAttentionBackendImpl  # type: ignore[attr-defined]
    module.AscendAttentionMetadataBuilder = AscendAttentionMetadataBuilder  # type: ignore[attr-defined]
    build = AscendAttentionMetadataBuilder.__dict__["build"]
    with pytest.raises(
        upstream.UpstreamError,
        match=r"AscendAttentionBackendImpl.forward_impl takes \(self, query, attn_metadata\), graphbuf "
        r"reads \(self, query, key, value, kv_cache, attn_metadata, output\)\. Nothing was patched",
    ) as raised:
        patch.apply(module)
    assert isinstance(raised.value, GraphbufError)
    assert AscendAttentionMetadataBuilder.__dict__["build"] is build
    assert not patch.is_patched(module)


# ------------------------------------------------------------------------------ plugin activation


def test_activate_patches_with_fake_tree_and_npu(fake_tree: Any) -> None:
    decision = plugin.activate(npu_available=True)
    assert decision == "active: vllm-ascend 0.23.0; attention patch deferred"
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    assert patch.is_patched(module)
    assert (
        plugin.activate(npu_available=True) == "active: vllm-ascend 0.23.0; attention patch already applied"
    )


def test_activate_without_npu_changes_nothing(fake_tree: Any) -> None:
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    decision = plugin.activate(npu_available=False)
    assert decision.startswith("inactive: no NPU available")
    assert not patch.is_patched(module)


def test_activation_ignores_the_version_string_and_logs_it(
    fake_tree: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A git checkout of main reports 0.19.1rc2.dev...: the surface decides, the version is only logged."""
    package = importlib.import_module("vllm_ascend")
    monkeypatch.setattr(package, "__version__", "0.19.1rc2.dev1637+g182b75ea8")
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    decision = plugin.activate(npu_available=True)
    assert decision == "active: vllm-ascend 0.19.1rc2.dev1637+g182b75ea8; attention patch applied"
    assert patch.is_patched(module)


def _drop_update(m: Any) -> None:
    delattr(m.AscendAttentionBackendImpl, "update_graph_params")


def _drop_metadata_fields(m: Any) -> None:
    delattr(m.AscendMetadata, "__dataclass_fields__")


def _drop_fence(m: Any) -> None:
    delattr(m, "record_attention_compute_start")


def _unknown_update_form(m: Any) -> None:
    m.AscendAttentionBackendImpl.update_graph_params = staticmethod(
        lambda update_stream, forward_context, num_tokens: None
    )


@pytest.mark.parametrize(
    ("break_it", "named"),
    [
        (_drop_update, "AscendAttentionBackendImpl.update_graph_params is missing or not a staticmethod"),
        (_drop_metadata_fields, "AscendMetadata has no field attn_state"),
        (_drop_fence, "has no function record_attention_compute_start"),
        (_unknown_update_form,
         "takes (update_stream, forward_context, num_tokens), which is none of the forms graphbuf knows"),
    ],
    ids=["update_graph_params", "metadata-fields", "fence", "update-form"],
)
def test_a_surface_miss_leaves_the_plugin_inactive_with_one_line_naming_it(
    fake_tree: Any, caplog: pytest.LogCaptureFixture, break_it: Any, named: str
) -> None:
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    break_it(module)  # the fixture purges the fake modules afterwards
    with caplog.at_level(logging.DEBUG, logger=plugin.__package__):
        decision = plugin.activate(npu_available=True)
    assert decision.startswith("inactive: vllm-ascend 0.23.0: ") and named in decision
    [line] = caplog.records
    assert line.levelno == logging.WARNING and named in line.getMessage()
    assert not patch.is_patched(module)


def test_a_surface_miss_found_by_the_import_hook_makes_the_plugin_inactive(
    fake_tree: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(plugin, "_decision", None)
    monkeypatch.setattr(plugin, "activate", lambda: "active: vllm-ascend 0.23.0; attention patch deferred")
    plugin.register()
    extra = importlib.import_module("vllm_ascend.ascend_forward_context")
    monkeypatch.setattr(type(extra._EXTRA_CTX), "extra_attrs", ())
    assert patch.install() == "deferred"
    with caplog.at_level(logging.WARNING):
        module = importlib.import_module("vllm_ascend.attention.attention_v1")
    assert not patch.is_patched(module)
    [line] = [r for r in caplog.records if r.name == patch.__name__]
    assert "_EXTRA_CTX does not list 'capturing'" in line.getMessage()
    assert plugin.decision().startswith("inactive: ") and "capturing" in plugin.decision()


def test_an_import_hook_failure_that_is_not_a_surface_miss_is_raised(
    fake_tree: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(module: Any) -> None:
        raise RuntimeError("patch broke")

    monkeypatch.setattr(patch, "apply", broken)
    assert patch.install() == "deferred"
    with pytest.raises(RuntimeError, match="patch broke"):
        importlib.import_module("vllm_ascend.attention.attention_v1")


def test_every_surface_entry_holds_on_the_fake_tree(fake_tree: Any) -> None:
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    assert upstream.first_miss(module) is None
    assert len(upstream.SURFACE) >= 15


def test_a_run_time_miss_raises_naming_the_entry(av1: Any, kernels: Any) -> None:
    """A field the activation check saw but a metadata object lacks at run time is never defaulted."""
    runner = Runner()
    common = runner.common(av1, [1, 1], "DecodeOnly")
    del common.num_input_tokens
    with pytest.raises(upstream.UpstreamError, match=r"no 'num_input_tokens' .*AscendCommonAttention"):
        make_builder(av1).build(0, common)


def test_capturing_raises_on_a_broken_forward_context_instead_of_saying_false(
    av1: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = importlib.import_module("vllm_ascend.ascend_forward_context")

    class Broken:
        @property
        def capturing(self) -> bool:
            raise AttributeError("capturing is not extra forward context attribute")

    monkeypatch.setattr(extra, "_EXTRA_CTX", Broken())
    with pytest.raises(AttributeError, match="capturing"):
        upstream.capturing()
    sys.modules["vllm.forward_context"].CONTEXT = None
    assert upstream.capturing() is False  # outside a forward context: not capturing, nothing read


def test_update_graph_params_raises_on_a_form_it_does_not_know(av1: Any) -> None:
    """The 0.23 7-positional call against a 6-parameter (0.25.1+/main) method: refused, nothing called."""
    context = SimpleNamespace(attn_metadata={})
    with pytest.raises(upstream.UpstreamError, match=r"7 positional arguments .*graphbuf knows the forms"):
        av1.AscendAttentionBackendImpl.update_graph_params("stream", context, 2, "cfg", None, None, None)
    with pytest.raises(upstream.UpstreamError, match=r"num_dcp_pcp_tokens"):
        av1.AscendAttentionBackendImpl.update_graph_params("stream", context, 2, "cfg", num_dcp_pcp_tokens=0)
    assert original_calls(av1, "update_graph_params") == []


def test_metadata_answering_the_route_attribute_is_not_routed(av1: Any) -> None:
    """vllm-ascend's own tests fill attn_metadata with MagicMock()s: they answer every attribute, but only
    graphbuf's ``Route`` marks a routed layer, so upstream's update loop still sees every layer."""
    from unittest.mock import MagicMock

    mocks = {"layers.0.attn": MagicMock(), "layers.1.attn": MagicMock()}
    assert all(routing.route_of(m) is None for m in mocks.values())
    assert routing.without_routed(mocks) is mocks
    context = SimpleNamespace(attn_metadata=mocks)
    av1.AscendAttentionBackendImpl.update_graph_params("stream", context, 2, "cfg", None)
    [call] = original_calls(av1, "update_graph_params")
    assert call["keys"] == ["layers.0.attn", "layers.1.attn"] and call["forward_context"] is context


def test_disable_variable_wins(fake_tree: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.DISABLE_ENV, "1")
    assert plugin.activate(npu_available=True).startswith(f"disabled by {plugin.DISABLE_ENV}=1")
    assert "vllm_ascend.attention.attention_v1" not in sys.modules
    assert not any(isinstance(finder, patch._PatchOnImport) for finder in sys.meta_path)


def test_register_decides_once_and_logs_one_debug_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(plugin, "_decision", None)
    calls: list[None] = []
    monkeypatch.setattr(plugin, "activate", lambda: calls.append(None) or "inactive: stubbed")
    with caplog.at_level(logging.DEBUG, logger=plugin.__name__):
        plugin.register()
        plugin.register()
    assert calls == [None]
    assert plugin.decision() == "inactive: stubbed"
    assert [r.getMessage() for r in caplog.records] == ["graphbuf vllm-ascend plugin: inactive: stubbed"]


def test_register_never_raises(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(plugin, "_decision", None)

    def broken() -> str:
        raise AttributeError("torch_npu is half installed")

    monkeypatch.setattr(plugin, "activate", broken)
    with caplog.at_level(logging.DEBUG, logger=plugin.__name__):
        plugin.register()
    assert plugin.decision() == "failed: AttributeError('torch_npu is half installed')"
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.DEBUG]


def test_activate_on_this_cpu_machine_does_not_touch_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(plugin.DISABLE_ENV, raising=False)
    if importlib.util.find_spec("vllm_ascend") is not None:
        pytest.skip("a vllm_ascend is importable in this environment")
    had_torch_npu = "torch_npu" in sys.modules
    assert plugin.activate() == "inactive: vllm_ascend is not importable; nothing patched"
    assert ("torch_npu" in sys.modules) == had_torch_npu


# ---------------------------------------------------------------------- real discovery through vLLM

DISCOVERY_SCRIPT = r"""
import json, logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="LOG|%(name)s|%(levelname)s|%(message)s")
try:
    import vllm.plugins
except Exception as exc:
    print("NO_VLLM", repr(exc))
    raise SystemExit(0)
vllm.plugins.load_general_plugins()
vllm.plugins.load_general_plugins()
from graphbuf.adapters.vllm_ascend import plugin
first = plugin.decision()
plugin.register()
print("RESULT " + json.dumps({
    "decision": first,
    "after_second_register": plugin.decision(),
    "torch_npu": "torch_npu" in sys.modules,
    "attention_v1": "vllm_ascend.attention.attention_v1" in sys.modules,
}))
"""

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def run_discovery(tmp_path: Path, **env_overrides: str) -> tuple[dict[str, Any], list[str]]:
    names = {ep.name for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    if plugin.ENTRY_POINT_NAME not in names:
        pytest.fail(
            f"entry point {plugin.ENTRY_POINT_NAME} is not installed; run `pip install --no-deps -e .` "
            "in the repository root"
        )
    env = {k: v for k, v in os.environ.items() if k not in (plugin.DISABLE_ENV, "VLLM_PLUGINS")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_PLUGINS=plugin.ENTRY_POINT_NAME, **env_overrides)
    proc = subprocess.run(
        [sys.executable, "-c", DISCOVERY_SCRIPT],
        cwd=tmp_path,  # not the checkout: graphbuf must come from the installed distribution
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if "NO_VLLM" in proc.stdout:
        pytest.skip(f"vllm is not importable: {proc.stdout.strip()}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [result_line] = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    decision_lines = [
        line
        for line in proc.stdout.splitlines()
        if line.startswith(f"LOG|{plugin.__name__}|DEBUG|graphbuf vllm-ascend plugin:")
    ]
    return json.loads(result_line.removeprefix("RESULT ")), decision_lines


@pytest.mark.vllm
@needs_vllm
def test_vllm_discovers_and_runs_the_entry_point_once(tmp_path: Path) -> None:
    result, lines = run_discovery(tmp_path)
    assert result["decision"] is not None, "load_general_plugins() did not run graphbuf's register()"
    assert result["decision"].startswith("inactive:")
    assert result["after_second_register"] == result["decision"]
    assert len(lines) == 1 and result["decision"] in lines[0]
    assert result["torch_npu"] is False
    assert result["attention_v1"] is False


@pytest.mark.vllm
@needs_vllm
def test_vllm_discovery_with_fake_vllm_ascend_but_no_npu_stays_inert(tmp_path: Path) -> None:
    pythonpath = os.pathsep.join(filter(None, [str(FAKE_ROOT), os.environ.get("PYTHONPATH")]))
    result, lines = run_discovery(tmp_path, PYTHONPATH=pythonpath)
    assert result["decision"].startswith("inactive: no NPU available")
    assert len(lines) == 1
    if importlib.util.find_spec("torch_npu") is None:
        assert result["torch_npu"] is False
    assert result["attention_v1"] is False


@pytest.mark.vllm
@needs_vllm
def test_vllm_discovery_respects_the_disable_variable(tmp_path: Path) -> None:
    result, lines = run_discovery(tmp_path, **{plugin.DISABLE_ENV: "1"})
    assert result["decision"].startswith(f"disabled by {plugin.DISABLE_ENV}=1")
    assert len(lines) == 1 and f"disabled by {plugin.DISABLE_ENV}=1" in lines[0]
    assert result["torch_npu"] is False


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
