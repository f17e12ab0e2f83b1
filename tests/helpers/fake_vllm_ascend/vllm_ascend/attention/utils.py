"""Fake of vllm_ascend.attention.utils: ``AscendCommonAttentionMetadata``'s fields graphbuf reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class AscendCommonAttentionMetadata:
    query_start_loc_cpu: Any
    seq_lens: Any
    block_table_tensor: Any
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    causal: bool = True
    attn_state: Any = None
    num_input_tokens: int = 0
