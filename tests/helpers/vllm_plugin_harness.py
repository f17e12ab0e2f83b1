"""The fake vllm-ascend tree, its fixtures and helpers shared by the adapter's patch, routing and plugin
tests (tests/unit/adapters/test_{patch,routing,plugin}.py): the real vllm-ascend cannot be imported on a
CPU machine, so ``fake_vllm_ascend/`` beside this file mirrors its names and signatures (0.23 - 0.26)."""

from __future__ import annotations

import enum
import importlib
import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import npu_contract_standin as standin
import pytest
import torch

import graphbuf.adapters.vllm_ascend.bindings.routed_decode as routed_decode
import graphbuf.adapters.vllm_ascend.glue.activation as activation
import graphbuf.adapters.vllm_ascend.glue.patch as patch
import graphbuf.adapters.vllm_ascend.glue.plugin as plugin
from graphbuf.adapters.vllm_ascend.kernels import attention as attention_kernels

FAKE_ROOT = Path(__file__).resolve().parent / "fake_vllm_ascend"
FAKE_VLLM_MODULES = {
    "vllm.forward_context": "fake_vllm.forward_context",
    "vllm.config": "fake_vllm.config",
    "vllm.v1.kv_cache_interface": "fake_vllm.kv_cache_interface",
}
"""The vLLM modules of the upstream surface, faked (the real vLLM 0.32 here lacks its import chain)."""
ADAPTER_DIR = Path(plugin.__file__).resolve().parent
LARGE_HEAD_MODULE = f"{routed_decode.__package__}.large_head"
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


def purge_fake_modules() -> None:
    for name in list(sys.modules):
        if name == "vllm_ascend" or name.startswith("vllm_ascend."):
            del sys.modules[name]


@pytest.fixture
def fake_tree(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The fake vllm_ascend importable, nothing patched before or after, no vLLM forward context.

    The fake mirrors vllm-ascend's module, class and method names because the real package cannot be
    imported without torch_npu (and an NPU)."""
    patch.unpatch()
    purge_fake_modules()
    monkeypatch.syspath_prepend(str(FAKE_ROOT))
    for name, fake in FAKE_VLLM_MODULES.items():
        module = importlib.import_module(fake)
        if fake == "fake_vllm.forward_context":
            monkeypatch.setattr(module, "CONTEXT", module.ForwardContext())
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(patch, "_inactive", None)
    yield
    patch.unpatch()
    purge_fake_modules()


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
        seen = record_seen(block_table, seq_lens, scale=scale, query=query, seq_lens_host=seq_lens_host)
        calls.append(("decode", seen))
        return torch.ones_like(query)

    def verify_attention(query, key_cache, value_cache, block_table, seq_lens, q_len, scale):  # type: ignore[no-untyped-def]
        calls.append(("verify", record_seen(block_table, seq_lens, q_len=q_len, scale=scale, mode="dense")))
        return torch.ones_like(query)

    def verify_attention_blockwise(query, key_cache, value_cache, block_table, seq_lens, q_len, scale,  # type: ignore[no-untyped-def]
                                   chunk_blocks=2):  # fmt: skip
        seen = record_seen(
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
    monkeypatch.setattr(sys.modules[routed_decode.__package__], "large_head", module, raising=False)
    # The routed paged decode tasks call large_head through their own module.
    monkeypatch.setattr(routed_decode, "large_head", module)
    return SimpleNamespace(calls=calls, module=module)


# ------------------------------------------------------------------------------------------ helpers


def record_seen(block_table: torch.Tensor, seq_lens: torch.Tensor, **kwargs: Any) -> dict[str, Any]:
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


UPDATABLE_DIR = FAKE_ROOT / "updatable"
LAYERS = ("model.layers.5.self_attn.attn", "model.layers.11.self_attn.attn")
HEAD = 512
DTYPE = torch.bfloat16
SIZE = 4  # the capture size (tokens = requests: decode)


# ------------------------------------------------- UpdatableGraph fakes, the NPU stand-in, a routed model


@pytest.fixture
def npu_standin(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The stand-in as torch_npu / torch.npu; graphbuf's NPU kernels selected; replays queued as a device
    queues them (UpdatableGraph replays, then updates)."""
    standin.install(devices=1)
    attention_kernels.npu_runtime.cache_clear()
    monkeypatch.setattr(attention_kernels, "uses_npu_kernels", lambda tensor: True)
    standin.STATE.queued_replays = True
    try:
        yield standin.STATE
    finally:
        standin.uninstall()
        attention_kernels.npu_runtime.cache_clear()


def _extra_context(monkeypatch: pytest.MonkeyPatch) -> Any:
    extra = importlib.import_module("vllm_ascend.ascend_forward_context")
    monkeypatch.setattr(type(extra._EXTRA_CTX), "extra_attrs", ("capturing", "is_draft_model"))
    monkeypatch.setattr(extra._EXTRA_CTX, "is_draft_model", False, raising=False)
    return extra._EXTRA_CTX


def add_updatable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake 0.30+ modules (``fake_vllm_ascend/updatable/``) on the fake vllm_ascend's path."""
    package = importlib.import_module("vllm_ascend")
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(UPDATABLE_DIR)])
    _extra_context(monkeypatch)


@pytest.fixture
def upd_tree(fake_tree: Any, npu_standin: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The fake tree with the UpdatableGraph modules, patched; the modules as a namespace."""
    add_updatable(monkeypatch)
    monkeypatch.delenv(activation.OWNER_ENV, raising=False)
    av1 = importlib.import_module("vllm_ascend.attention.attention_v1")
    assert patch.install() == "applied"
    av1.CALLS.clear()
    return SimpleNamespace(
        av1=av1,
        graph_module=importlib.import_module("vllm_ascend.compilation.updatable_graph"),
        acl=importlib.import_module("vllm_ascend.compilation.acl_graph"),
        extra=importlib.import_module("vllm_ascend.ascend_forward_context")._EXTRA_CTX,
        context=sys.modules["vllm.forward_context"].CONTEXT,
    )


@pytest.fixture
def legacy_tree(fake_tree: Any, npu_standin: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The fake tree as vllm-ascend up to 0.29 (no UpdatableGraph module), patched."""
    monkeypatch.delenv(activation.OWNER_ENV, raising=False)
    av1 = importlib.import_module("vllm_ascend.attention.attention_v1")
    assert patch.install() == "applied"
    av1.CALLS.clear()
    return SimpleNamespace(av1=av1, context=sys.modules["vllm.forward_context"].CONTEXT)


# ------------------------------------------------------------------------------------------ a model


class RoutedModel:
    """Two routed layers of one KV group, driven as vllm-ascend drives them: build, forward (capture), and
    per step build + replay through the mechanism under test."""

    def __init__(self, tree: Any, seed: int = 0) -> None:
        self.tree, self.av1 = tree, tree.av1
        self.builder = make_builder(self.av1)
        self.builder.layer_names = list(LAYERS)  # one KV group, both layers
        self.runner = Runner()
        g = torch.Generator().manual_seed(seed)
        self.impls = [make_impl(self.av1) for _ in LAYERS]
        shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD)
        self.caches = [(torch.randn(shape, generator=g).to(DTYPE), torch.randn(shape, generator=g).to(DTYPE))
                       for _ in LAYERS]  # fmt: skip
        self.query = torch.randn(SIZE, NUM_HEADS, HEAD, generator=g).to(DTYPE)
        self.outputs = [torch.zeros(SIZE, NUM_HEADS, HEAD, dtype=DTYPE) for _ in LAYERS]
        self.graph: Any = None
        self.lens: list[int] = []

    def build(self, lens: list[int], table: list[list[int]] | None = None, padded_rows: Any = None) -> Any:
        """A decode batch of ``len(lens)`` live requests padded to SIZE; the runner's padded rows hold
        ``padded_rows`` (garbage a runner may leave there) when given."""
        live = len(lens)
        common = self.runner.common(self.av1, [1] * live, "DecodeOnly", padded_reqs=SIZE)
        common.num_input_tokens = SIZE
        self.runner.seq_lens[:live] = torch.tensor(lens, dtype=torch.int32)
        rows = table or [[(r + c) % NUM_BLOCKS for c in range(WIDTH)] for r in range(live)]
        self.runner.block_table[:live] = torch.tensor(rows, dtype=torch.int32)
        if padded_rows is not None:
            self.runner.seq_lens[live:SIZE] = padded_rows
        self.lens, self.table = list(lens), [list(r) for r in rows]
        metadata = self.builder.build(0, common)
        self.tree.context.attn_metadata = dict.fromkeys(LAYERS, metadata)
        return metadata

    def forward(self, metadata: Any) -> None:
        for impl, cache, out in zip(self.impls, self.caches, self.outputs, strict=True):
            impl.forward_impl(self.query, None, None, cache, metadata, out)

    def capture(self, metadata: Any, graph: Any) -> None:
        set_capturing(True)
        try:
            with torch.no_grad(), torch.npu.graph(graph):
                self.forward(metadata)
        finally:
            set_capturing(False)
        self.graph = graph

    def reference(self, layer: int) -> torch.Tensor:
        """Paged decode of the live requests read from the runner's own table and lengths; pads give 0."""
        kc, vc = self.caches[layer]
        out = torch.zeros(SIZE, NUM_HEADS, HEAD)
        for b, n in enumerate(self.lens):
            ids = torch.tensor(self.table[b])
            k = kc[ids].reshape(-1, NUM_KV_HEADS, HEAD)[:n].float()
            v = vc[ids].reshape(-1, NUM_KV_HEADS, HEAD)[:n].float()
            q = self.query[b].float()  # [Nq, D]; one KV head
            p = torch.softmax(q @ k[:, 0].T * 0.125, dim=-1)
            out[b] = p @ v[:, 0]
        return out
