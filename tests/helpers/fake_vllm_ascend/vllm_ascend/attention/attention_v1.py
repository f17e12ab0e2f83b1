"""Fake of ``vllm_ascend.attention.attention_v1`` (vllm-ascend 0.23 - 0.26 names and signatures).

The real 0.23.0.post1 module is driven by ``tests/integration/real_vllm_ascend/`` (build, forward_impl under
a FULL
capture and eagerly, update_graph_params in both call forms). This fake stays only for what the real module
cannot reach on a CPU machine:

* the plugin's own checks in the main test process (``tests/unit/adapters/glue/test_plugin.py``: surface
  misses, the deferred import hook, unpatch) and vLLM 0.32's plugin discovery in subprocesses, where the
  real package must not be on ``sys.path`` (its pair is vLLM 0.23, not 0.32);
* versions other than 0.23 (0.24 - 0.26 signatures), and the PCP/DCP builder subclasses, whose real
  modules need distributed groups;
* counting which path ran: every original method appends ``(name, details)`` to ``CALLS``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum
from typing import Any

CALLS: list[tuple[str, Any]] = []

ORIGINAL_OUTPUT_VALUE = -7.0
"""What the original ``forward_impl`` writes into ``output`` (so tests can see which path ran)."""


def record_attention_compute_start() -> None:
    CALLS.append(("record_attention_compute_start", None))


class AscendAttentionBackend:
    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return []  # none listed: the runner's table is in the manager block size


class AscendAttentionState(Enum):
    PrefillNoCache = 0
    PrefillCacheHit = 1
    DecodeOnly = 2
    ChunkedPrefill = 3
    SpecDecoding = 4


@dataclass
class AscendMetadata:
    attn_state: AscendAttentionState = AscendAttentionState.ChunkedPrefill
    num_actual_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefills: int = 0
    num_decodes: int = 0
    seq_lens: Any = None
    seq_lens_list: list[int] | None = None
    max_query_len: int | None = None
    block_tables: Any = None
    causal: bool = True


class AscendAttentionMetadataBuilder:
    reorder_batch_threshold: int = 1

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.compilation_config = vllm_config.compilation_config
        self.device = device
        self.speculative_config = vllm_config.speculative_config
        self.decode_threshold = 1
        if self.speculative_config:
            self.decode_threshold += self.speculative_config.num_speculative_tokens

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: Any,
        fast_build: bool = False,
    ) -> AscendMetadata:
        CALLS.append(("build", type(self).__name__))
        cm = common_attn_metadata
        starts = cm.query_start_loc_cpu.tolist()
        query_lens = [b - a for a, b in itertools.pairwise(starts)]
        num_prefills = sum(1 for q in query_lens if q > self.decode_threshold)
        return AscendMetadata(
            attn_state=cm.attn_state,
            num_actual_tokens=cm.num_actual_tokens,
            num_prefills=num_prefills,
            num_decodes=len(query_lens) - num_prefills,
            seq_lens=cm.seq_lens.cpu(),
            seq_lens_list=cm.seq_lens.cpu().tolist(),
            max_query_len=cm.max_query_len,
            # Upstream may pad with torch.cat, so its block_tables need not keep the runner's address.
            block_tables=cm.block_table_tensor.clone(),
            causal=cm.causal,
        )


class AscendAttentionPCPMetadataBuilder(AscendAttentionMetadataBuilder):
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: Any,
        fast_build: bool = False,
    ) -> AscendMetadata:
        CALLS.append(("pcp_build", None))
        return super().build(common_prefix_len, common_attn_metadata, fast_build)


class AscendAttentionBackendImpl:
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = "decoder",
        kv_sharing_target_layer_name: str | None = None,
        sinks: Any = None,
        **kwargs: Any,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.alibi_slopes = alibi_slopes
        self.sliding_window = sliding_window
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        self.key_cache = None
        self.value_cache = None

    @staticmethod
    def update_graph_params(
        update_stream: Any,
        forward_context: Any,
        num_tokens: int,
        vllm_config: Any,
        speculative_config: Any = None,
        draft_attn_metadatas: Any = None,
    ) -> None:
        """Re-issues the captured attention tasks of every layer in ``forward_context.attn_metadata``."""
        drafts = None
        if draft_attn_metadatas is not None:
            drafts = [list(step) for step in draft_attn_metadatas]
        CALLS.append(
            (
                "update_graph_params",
                {
                    "forward_context": forward_context,
                    "keys": list(forward_context.attn_metadata),
                    "num_tokens": num_tokens,
                    "drafts": drafts,
                },
            )
        )

    def forward_impl(
        self,
        query: Any,
        key: Any,
        value: Any,
        kv_cache: Any,
        attn_metadata: AscendMetadata,
        output: Any,
    ) -> Any:
        """Runs vllm-ascend's own attention for one layer."""
        CALLS.append(("forward_impl", self.head_size))
        output.fill_(ORIGINAL_OUTPUT_VALUE)
        return output
