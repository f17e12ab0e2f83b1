"""Fixtures and builders of the real-module tests: vLLM configs, KV specs, runner-shaped batches.

Every object the tests hand to vllm-ascend is vLLM's or vllm-ascend's own class (``VllmConfig``,
``CompilationConfig``, ``FullAttentionSpec``, ``AscendCommonAttentionMetadata``, the real builder and impl),
except ``model_config`` and ``speculative_config``: building those needs a model's Hugging Face config,
which cannot be downloaded here, so they are namespaces with the fields the attention code reads.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import graphbuf.adapters.vllm_ascend.glue.patch as patch

av1 = importlib.import_module("vllm_ascend.attention.attention_v1")

from vllm.config import (  # noqa: E402
    CompilationConfig,
    DeviceConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.v1.core.kv_cache_utils import unify_kv_cache_spec_page_size  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from vllm_ascend.attention.attention_v1 import AscendAttentionState  # noqa: E402
from vllm_ascend.attention.utils import AscendCommonAttentionMetadata  # noqa: E402

UPSTREAM = os.environ.get("GRAPHBUF_REAL_UPSTREAM", "0.23")
"""The upstream this run is against: ``0.23`` (0.23.0.post1 + vLLM 0.23.0), ``main`` (182b75ea + 0.27.1) or
``updatable`` (the UpdatableGraph reconstruction + vLLM 0.28.0)."""
UPDATABLE = importlib.util.find_spec("vllm_ascend.compilation.updatable_graph") is not None
"""The tree updates FULL-graph attention tasks through UpdatableGraph (the graph owns them: 0.30+); else the
runner calls ``update_graph_params`` (the legacy mechanism)."""

LEGACY_MECHANISM = pytest.mark.skipif(
    UPDATABLE,
    reason="drives update_graph_params, the legacy update mechanism; under UpdatableGraph the runner never "
    "calls it (it raises NotImplementedError) and the same contract is tested through ACLGraphWrapper "
    "capture and replay (test_real_replay)",
)
"""For tests of the legacy mechanism itself; each has its UpdatableGraph counterpart in test_real_replay."""
ONLY_023_UPDATE_FORM = pytest.mark.skipif(
    UPSTREAM != "0.23",
    reason="the 7-positional update_graph_params form (num_dcp_pcp_tokens) exists only on 0.23/0.24 "
    "(vllm-ascend #12592); on main the wrapper refuses it (test_real_forward::"
    "test_the_removed_positional_update_form_raises_on_main)",
)
UPDATE_FORMS = [pytest.param("positional-0.23", marks=ONLY_023_UPDATE_FORM), "keyword-0.25.1"]
"""The ``update_graph_params`` call forms the real-module tests drive."""

KERNEL_BLOCK = 128
"""vllm-ascend's kernel block size: the runner's block table counts blocks of this many tokens."""

# Gemma4-31B per rank at TP=2 (public config): sliding 16 KV heads x 256, full 4 KV heads x 512.
TP = 2
SLIDING_KV_HEADS, SLIDING_HEAD = 16 // TP, 256
FULL_KV_HEADS, FULL_HEAD = 4 // TP, 512
NUM_HEADS = 32 // TP
FULL_LAYER = "model.layers.5.self_attn.attn"
SLIDING_LAYER = "model.layers.0.self_attn.attn"


def vllm_capture_sizes(max_num_seqs: int, num_spec: int, max_num_batched_tokens: int, tp: int) -> list[int]:
    """The capture sizes vLLM computes by default (``VllmConfig._set_cudagraph_sizes`` followed by
    ``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode``), run on a config namespace because a
    full ``VllmConfig`` needs a model. The namespace carries what both vLLMs read: 0.23.0 reads
    ``speculative_config.num_speculative_tokens``, 0.27.1 the ``VllmConfig.num_speculative_tokens``
    property (given here as a plain field)."""
    cc = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY)
    holder = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False),
        compilation_config=cc,
        speculative_config=SimpleNamespace(num_speculative_tokens=num_spec) if num_spec else None,
        num_speculative_tokens=num_spec,
        scheduler_config=SimpleNamespace(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        performance_mode="balanced",
    )
    VllmConfig._set_cudagraph_sizes(holder)
    cc.adjust_cudagraph_sizes_for_spec_decode(1 + num_spec, tp)
    return list(cc.cudagraph_capture_sizes)


def gemma4_specs() -> dict[str, Any]:
    """The two layer kinds of Gemma4 at TP=2, kernel block 128, after vLLM's page-size unification."""
    specs = {
        SLIDING_LAYER: SlidingWindowSpec(
            block_size=KERNEL_BLOCK, num_kv_heads=SLIDING_KV_HEADS, head_size=SLIDING_HEAD,
            dtype=torch.bfloat16, sliding_window=1024,
        ),
        FULL_LAYER: FullAttentionSpec(
            block_size=KERNEL_BLOCK, num_kv_heads=FULL_KV_HEADS, head_size=FULL_HEAD, dtype=torch.bfloat16
        ),
    }  # fmt: skip
    return unify_kv_cache_spec_page_size(specs)


def make_vllm_config(
    *,
    capture_sizes: list[int],
    num_spec: int = 3,
    max_num_seqs: int = 16,
    max_model_len: int = 5500,
    max_num_batched_tokens: int = 8192,
    graph_mode: CUDAGraphMode = CUDAGraphMode.FULL_DECODE_ONLY,
    hf_config: Any = None,
) -> VllmConfig:
    """A ``VllmConfig`` with the given envelope; ``hf_config`` (e.g. a Gemma4 namespace with ``model_type``)
    goes on ``model_config`` when given, which turns on vllm-ascend's model-type branches."""
    cc = CompilationConfig(cudagraph_mode=graph_mode)
    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, is_encoder_decoder=False,
        ),
        compilation_config=cc,
        parallel_config=ParallelConfig(tensor_parallel_size=1),
    )  # fmt: skip
    cc.cudagraph_mode = graph_mode  # VllmConfig without a model config resets it to NONE
    cc.cudagraph_capture_sizes = sorted(capture_sizes)
    cc.max_cudagraph_capture_size = max(capture_sizes)
    config.parallel_config.tensor_parallel_size = TP
    object.__setattr__(
        config, "model_config",
        SimpleNamespace(max_model_len=max_model_len, runner_type="generate", enforce_eager=False,
                        dtype=torch.bfloat16, is_encoder_decoder=False, hf_text_config=SimpleNamespace(),
                        **({} if hf_config is None else {"hf_config": hf_config})),
    )  # fmt: skip
    speculative = (
        SimpleNamespace(num_speculative_tokens=num_spec, parallel_drafting=False, method="mtp")
        if num_spec
        else None
    )
    object.__setattr__(config, "speculative_config", speculative)
    return config


def make_builder(config: VllmConfig, spec: Any = None, layer: str = FULL_LAYER) -> Any:
    spec = gemma4_specs()[FULL_LAYER] if spec is None else spec
    return av1.AscendAttentionMetadataBuilder(spec, [layer], config, torch.device("cpu"))


@dataclass
class RunnerBatch:
    """A uniform decode batch as vllm-ascend's model runner hands it to ``build``.

    ``seq_lens`` are the live requests' KV lengths; ``table`` their block ids in kernel blocks.
    ``num_reqs_padded`` / ``num_tokens_padded``: the runner's padded request and token counts (DP padding or
    padding to the next capture size); pad rows get query length ``q_len``, seq_len 0 and block row 0.
    """

    seq_lens: list[int]
    table: torch.Tensor
    q_len: int
    num_reqs_padded: int
    num_tokens_padded: int
    max_reqs: int = 64

    def common(self, table_width: int | None = None) -> Any:
        live = len(self.seq_lens)
        padded = self.num_reqs_padded
        width = table_width or self.table.shape[1]
        table = torch.zeros((self.max_reqs, width), dtype=torch.int32)
        table[:live, : self.table.shape[1]] = self.table
        seq = torch.zeros(self.max_reqs, dtype=torch.int32)
        seq[:live] = torch.tensor(self.seq_lens, dtype=torch.int32)
        qsl = torch.arange(self.max_reqs + 1, dtype=torch.int32) * self.q_len
        slots = torch.full((self.max_reqs * self.q_len,), -1, dtype=torch.int64)
        state = AscendAttentionState.SpecDecoding if self.q_len > 1 else AscendAttentionState.DecodeOnly
        return AscendCommonAttentionMetadata(
            query_start_loc=qsl[: padded + 1], query_start_loc_cpu=qsl[: padded + 1].clone(),
            seq_lens=seq[:padded], num_reqs=padded, num_actual_tokens=live * self.q_len,
            max_query_len=self.q_len, max_seq_len=max(self.seq_lens), block_table_tensor=table[:padded],
            slot_mapping=slots[: self.num_tokens_padded], _seq_lens_cpu=seq[:padded].clone(),
            seq_lens_cpu=seq[:padded].clone(), attn_state=state, num_input_tokens=self.num_tokens_padded,
            decode_token_per_req=self.q_len,
        )  # fmt: skip


def random_batch(
    gen: torch.Generator, live: int, q_len: int, num_blocks: int, max_len: int, padded_reqs: int, width: int
) -> RunnerBatch:
    seq_lens = torch.randint(q_len, max_len + 1, (live,), generator=gen).tolist()
    table = torch.randint(0, num_blocks, (live, width), generator=gen, dtype=torch.int32)  # garbage tail
    for r, n in enumerate(seq_lens):
        need = -(-n // KERNEL_BLOCK)
        table[r, :need] = torch.randperm(num_blocks, generator=gen)[:need].to(torch.int32)
    return RunnerBatch(seq_lens, table, q_len, padded_reqs, padded_reqs * q_len)


@pytest.fixture
def patched() -> Iterator[Any]:
    """vllm-ascend's real attention module, patched by graphbuf for the test, unpatched after."""
    patch.unpatch()
    assert patch.apply(av1) is True
    yield av1
    patch.unpatch()


@pytest.fixture(autouse=True)
def reconstruction_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reconstruction's ``attention_v1`` (daa64412) reads
    ``HardwareCapability.CHUNKED_PREFILL_PHASE_SPLIT``
    on every eager FIA call; 182b75ea's ``device/hardware_profile.py`` under it has no such member, so
    upstream's own eager path raises AttributeError there. Where the member is missing, the module's name is
    given one more capability that no hardware profile lists (``supports`` is then False, as on A2)."""
    capability = getattr(av1, "HardwareCapability", None)
    if capability is None or hasattr(capability, "CHUNKED_PREFILL_PHASE_SPLIT"):
        return
    members = {m.name: m for m in capability}
    monkeypatch.setattr(
        av1, "HardwareCapability", SimpleNamespace(**members, CHUNKED_PREFILL_PHASE_SPLIT=object())
    )


@pytest.fixture(autouse=True)
def clear_stub_calls() -> None:
    """Every test starts with no recorded stub calls and no graph state (autouse through the conftest's
    star import, so its name has no leading underscore)."""
    import torch_npu_stub

    torch_npu_stub.CALLS.clear()
    torch_npu_stub.RESULTS.clear()
    torch_npu_stub.forget_graphs()
