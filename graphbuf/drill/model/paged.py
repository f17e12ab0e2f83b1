"""One target-model step of the tiny Gemma4 over paged KV, reading every input from graphbuf buffers.

:class:`PagedGemma4` is the callable ``GraphRunner`` captures: embedding → every decoder layer → final norm →
logits (soft-capped), all through transformers' own modules (``embed_tokens``, ``rotary_emb``, each
``Gemma4TextDecoderLayer`` with its projections, q/k/v norms, RoPE and MLP, ``norm``, ``lm_head``). Only
the attention kernel is replaced, through transformers' ``AttentionInterface``: the new tokens' K and V are
written to the layer's paged cache at ``slot_mapping.<group>`` (-1: not written), then

* full (global) layers: ``large_head.verify_attention_blockwise``, the call the vllm-ascend patch's routed
  ``forward_impl`` makes for an MTP verify batch, with the layer's own ``scaling`` (1.0 for Gemma4);
* sliding layers: :func:`windowed_paged_attention`, software paged attention with the sliding window.

Every step is uniform: ``seq_lens`` rows (requests) × ``q_len`` tokens (``1 + num_speculative_tokens`` in a
decode step, the prompt length in a one-request prefill).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from graphbuf.adapters.vllm_ascend.bindings import large_head
from graphbuf.graphs.runner import Step

__all__ = ["ATTENTION_NAME", "FAULTS", "PagedGemma4", "windowed_paged_attention"]

#: The name :class:`PagedGemma4` registers its attention under in transformers' ``AttentionInterface``.
ATTENTION_NAME = "graphbuf_paged"

#: Planted bugs the drill's own tests inject (``faults=``); each must make the drill fail.
FAULTS = ("scale", "stale_seq_len", "pad_not_cleared", "short_block_table")


def windowed_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    q_len: int,
    scale: float,
    window: int,
) -> torch.Tensor:
    """Sliding-window attention over paged KV, graph-safe (no host reads, shapes from the buffers only).

    ``query`` ``[T, Nq, D]``; caches ``[num_blocks, block_size, Nkv, D]``; ``block_table`` ``[B, W]``;
    ``seq_lens`` ``[B]`` (new tokens included); ``query_start_loc`` ``[B + 1]`` (request r's queries are rows
    ``query_start_loc[r] ..`` of ``query``, ``q_len`` each). Query i of request r sees keys ``p`` with
    ``last - window < p <= last``, ``last = seq_lens[r] - q_len + i`` (transformers' sliding mask: the key
    at ``q - window`` is hidden). A query that sees no key (a padded request) gives zeros. Returns
    ``[T, Nq, D]`` in the query dtype.
    """
    tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    batch, width = block_table.shape
    dev = query.device
    steps = torch.arange(q_len, device=dev, dtype=torch.int64)
    rows = (query_start_loc[:batch].to(torch.int64).unsqueeze(1) + steps).clamp(0, tokens - 1)  # [B, q]
    q = query.index_select(0, rows.reshape(-1)).view(batch, q_len, num_heads, head_dim).float()
    ids = block_table.to(torch.int64).clamp(0, num_blocks - 1)
    keys = width * block_size
    k = key_cache[ids].reshape(batch, keys, num_kv_heads, head_dim).float()
    v = value_cache[ids].reshape(batch, keys, num_kv_heads, head_dim).float()
    rep = num_heads // num_kv_heads
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * float(scale)
    last = seq_lens.to(torch.int64).unsqueeze(1) - q_len + steps  # [B, q]
    pos = torch.arange(keys, device=dev, dtype=torch.int64).view(1, 1, -1)
    visible = (pos <= last.unsqueeze(-1)) & (pos > last.unsqueeze(-1) - window)  # [B, q, K]
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).to(query.dtype)
    result = torch.zeros_like(query)
    return result.index_copy(0, rows.reshape(-1), out.reshape(batch * q_len, num_heads, head_dim))


def _paged_attention_interface(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    scaling: float | None = None, graphbuf_paged: _StepContext | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    if graphbuf_paged is None:
        raise RuntimeError(f"attention {ATTENTION_NAME!r} runs only inside graphbuf's model drill step")
    return graphbuf_paged.attend(module, query, key, value, scaling), None


@dataclass
class _StepContext:
    owner: PagedGemma4
    views: Mapping[str, torch.Tensor]
    q_len: int

    def attend(
        self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
    ) -> torch.Tensor:
        """transformers' ``[1, H, T, D]`` q/k/v (after projections, norms, RoPE) → ``[1, T, H, D]``."""
        owner, views = self.owner, self.views
        group = "sliding" if module.is_sliding else "full"
        q = query[0].transpose(0, 1).contiguous()
        k = key[0].transpose(0, 1)
        v = value[0].transpose(0, 1)
        key_cache, value_cache = owner.caches[module.layer_idx]
        slots = views[f"slot_mapping.{group}"]
        slots = torch.where(slots < 0, torch.full_like(slots, owner.trash_slot), slots)
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(key_cache.dtype))
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(value_cache.dtype))
        block_table, seq_lens = views[f"block_table.{group}"], views["seq_lens"]
        scale = module.scaling if scaling is None else scaling
        if module.is_sliding:
            out = windowed_paged_attention(
                q, key_cache, value_cache, block_table, seq_lens, views["query_start_loc"], self.q_len,
                scale, module.sliding_window,
            )  # fmt: skip
        else:
            if "scale" in owner.faults:
                scale = module.head_dim**-0.5  # planted: the habit 1/sqrt(d), not Gemma4's 1.0
            out = large_head.verify_attention_blockwise(
                q, key_cache, value_cache, block_table, seq_lens, self.q_len, scale, owner.chunk_blocks
            )
        return out.unsqueeze(0)


class PagedGemma4:
    """The tiny Gemma4's step over paged KV: ``__call__(step) -> logits [T, vocab]`` (float32).

    One K and one V cache per layer, ``[num_blocks + 1, block_size, Nkv, D]`` in the model dtype (full layers:
    ``num_global_key_value_heads`` heads of ``global_head_dim``, separate K and V as vLLM keeps them for
    ``attention_k_eq_v``); the extra block takes the writes of slot -1. ``faults``: planted bugs (see
    :data:`FAULTS`) for the drill's own tests.
    """

    def __init__(
        self,
        model: Any,
        *,
        num_blocks: int,
        block_size: int,
        chunk_blocks: int = large_head.DEFAULT_CHUNK_BLOCKS,
        faults: frozenset[str] = frozenset(),
    ) -> None:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, _paged_attention_interface)
        self.model = model
        self.faults = faults
        self.chunk_blocks = chunk_blocks
        self.trash_slot = num_blocks * block_size
        cfg = model.config
        param = next(model.parameters())
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in model.model.layers:
            attn = layer.self_attn
            num_kv_heads = cfg.num_attention_heads // attn.num_key_value_groups
            shape = (num_blocks + 1, block_size, num_kv_heads, attn.head_dim)
            kv = torch.zeros((2, *shape), dtype=param.dtype, device=param.device)
            self.caches.append((kv[0], kv[1]))

    @contextlib.contextmanager
    def _paged(self) -> Iterator[None]:
        cfg = self.model.config
        before = cfg._attn_implementation
        cfg._attn_implementation = ATTENTION_NAME
        try:
            yield
        finally:
            cfg._attn_implementation = before

    def __call__(self, step: Step) -> torch.Tensor:
        views = step.views
        ids, positions = views["input_ids"], views["positions"]
        q_len = ids.shape[0] // views["seq_lens"].shape[0]
        text = self.model.model
        ctx = _StepContext(self, views, q_len)
        with torch.no_grad(), self._paged():
            hidden = text.embed_tokens(ids.unsqueeze(0))
            position_ids = positions.unsqueeze(0)
            rope = {
                kind: text.rotary_emb(hidden, position_ids, kind) for kind in sorted(text.unique_layer_types)
            }
            for i, layer in enumerate(text.layers):
                hidden = layer(
                    hidden, None, shared_kv_states={}, position_embeddings=rope[text.config.layer_types[i]],
                    attention_mask=None, position_ids=position_ids, past_key_values=None, graphbuf_paged=ctx,
                )  # fmt: skip
            hidden = text.norm(hidden)
            logits = self.model.lm_head(hidden)[0]
            cap = self.model.config.final_logit_softcapping
            if cap is not None:
                logits = torch.tanh(logits / cap) * cap
        return logits.float()
