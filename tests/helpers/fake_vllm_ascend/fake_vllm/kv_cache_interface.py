"""Fake of ``vllm.v1.kv_cache_interface``: the KV spec fields graphbuf reads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    sliding_window: int | None = None
