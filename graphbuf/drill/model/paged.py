"""The tiny Gemma4's target step and its assistant's draft step over paged KV, inputs from graphbuf buffers.

:class:`PagedGemma4` is the callable the verify and decode runners capture: embedding → every decoder layer →
final norm → (logits soft-capped, hidden state), all through transformers' own modules. Only the attention
kernel is replaced, through transformers' ``AttentionInterface``: the new tokens' K and V are written to the
layer's paged cache at ``slot_mapping.<group>`` (-1: the trash block, never read), then

* full (global) layers: :class:`LargeHeadBinding` over ``block_table.full`` (kernel blocks) and ``seq_lens``,
  the binding the vllm-ascend adapter routes Gemma4's 512-dim layers to: its verify call for ``1 + k`` tokens
  per request, its paged decode for one (KV lengths as host task arguments, re-issued before each replay);
* sliding layers: :func:`windowed_paged_attention` over ``block_table.sliding``.

:class:`PagedAssistant` is the draft step: transformers' ``Gemma4AssistantForCausalLM`` modules
(``pre_projection`` of the target's embedding ++ the target's hidden state, query-only layers, norm,
``lm_head``, ``post_projection``); each of its layers reads the target's cache of the target's last layer of
its type through its own group's block table and the step's ``seq_lens``. Prefills (one request, the whole
prompt) run the target step eagerly with the full layers' verify call at ``q_len`` = the prompt length.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from graphbuf.adapters.vllm_ascend.bindings import large_head
from graphbuf.adapters.vllm_ascend.bindings.attention_tasks import LargeHeadBinding
from graphbuf.graphs.runner import Step

__all__ = ["ATTENTION_NAME", "FAULTS", "PagedAssistant", "PagedGemma4", "windowed_paged_attention"]

#: The name the paged steps register their attention under in transformers' ``AttentionInterface``.
ATTENTION_NAME = "graphbuf_paged"

#: Planted bugs the drill's own tests inject (``faults=``); each must make the drill fail.
FAULTS = ("scale", "stale_seq_len", "pad_not_cleared", "short_block_table", "draft_group0_table")


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
    at ``q - window`` is hidden). Only the ``cdiv(q_len + window - 1, block_size) + 1`` table columns that can
    hold such keys are read (columns before them may hold the null block). A query that sees no key (a padded
    request) gives zeros. Returns ``[T, Nq, D]`` in the query dtype.
    """
    tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    batch, width = block_table.shape
    dev = query.device
    steps = torch.arange(q_len, device=dev, dtype=torch.int64)
    rows = (query_start_loc[:batch].to(torch.int64).unsqueeze(1) + steps).clamp(0, tokens - 1)  # [B, q]
    rep = num_heads // num_kv_heads
    q = query.index_select(0, rows.reshape(-1)).view(batch, q_len, num_kv_heads, rep, head_dim).float()
    lens = seq_lens.to(torch.int64)
    span = min(width, -(-(q_len + window - 1) // block_size) + 1)  # columns a window of q_len queries touches
    first = ((lens - q_len - window + 1).clamp(min=0) // block_size).clamp(max=width - span)  # [B]
    cols = first.unsqueeze(1) + torch.arange(span, device=dev, dtype=torch.int64)  # [B, span]
    ids = block_table.to(torch.int64).gather(1, cols).clamp(0, num_blocks - 1)
    keys = span * block_size
    k = key_cache[ids].reshape(batch, keys, num_kv_heads, head_dim).float()
    v = value_cache[ids].reshape(batch, keys, num_kv_heads, head_dim).float()
    # Products summed elementwise, not by a matmul: BLAS picks its blocking by the batch (a batch of one
    # rounds otherwise), and a request's result must not depend on the rows beside it.
    q = q.permute(0, 2, 3, 1, 4).unsqueeze(-2)  # [B, Nkv, rep, q, 1, D]
    k = k.permute(0, 2, 1, 3).reshape(batch, num_kv_heads, 1, 1, keys, head_dim)
    v = v.permute(0, 2, 1, 3).reshape(batch, num_kv_heads, 1, 1, keys, head_dim)
    scores = (q * k).sum(-1) * float(scale)  # [B, Nkv, rep, q, K]
    last = lens.unsqueeze(1) - q_len + steps  # [B, q]
    pos = (first * block_size).view(-1, 1, 1) + torch.arange(keys, device=dev, dtype=torch.int64).view(
        1, 1, -1
    )
    visible = (pos <= last.unsqueeze(-1)) & (pos > last.unsqueeze(-1) - window)  # [B, q, K]
    scores = scores.masked_fill(~visible.view(batch, 1, 1, q_len, keys), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = (probs.unsqueeze(-1) * v).sum(-2).permute(0, 3, 1, 2, 4).to(query.dtype)  # [B, q, Nkv, rep, D]
    result = torch.zeros_like(query)
    return result.index_copy(0, rows.reshape(-1), out.reshape(batch * q_len, num_heads, head_dim))


def _paged_attention_interface(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    scaling: float | None = None, graphbuf_paged: _Context | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    if graphbuf_paged is None:
        raise RuntimeError(f"attention {ATTENTION_NAME!r} runs only inside graphbuf's model drill steps")
    return graphbuf_paged.attend(module, query, key, value), None


@contextlib.contextmanager
def _paged(config: Any) -> Iterator[None]:
    """transformers' attention switched to :data:`ATTENTION_NAME` on ``config`` for one step."""
    before = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = before


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _paged_attention_interface)


def _heads(query: torch.Tensor) -> torch.Tensor:
    """transformers' ``[1, H, T, D]`` → ``[T, H, D]``."""
    return query[0].transpose(0, 1).contiguous()


@dataclass
class _Context:
    """One step's attention: the target's (writes K/V, then attends) or the assistant's (reads only)."""

    step: Step
    q_len: int
    target: PagedGemma4
    draft: PagedAssistant | None = None

    def attend(
        self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        views, target = self.step.views, self.target
        group = "sliding" if module.is_sliding else "full"
        q = _heads(query)
        if self.draft is None:
            layer = module.layer_idx
            target.write_kv(layer, views[f"slot_mapping.{group}"], _heads(key), _heads(value))
        else:
            layer = target.last_layer[group]
            if "draft_group0_table" in self.draft.faults:
                group = "sliding"  # planted: every draft layer bound to group 0's block table
        key_cache, value_cache = target.caches[layer]
        table, seq_lens = views[f"block_table.{group}"], views["seq_lens"]
        if module.is_sliding:
            out = windowed_paged_attention(
                q, key_cache, value_cache, table, seq_lens, views["query_start_loc"], self.q_len,
                module.scaling, module.sliding_window,
            )  # fmt: skip
        elif self.draft is not None:
            out = large_head.verify_attention_blockwise(
                q, key_cache, value_cache, table, seq_lens, 1, target.scale, target.chunk_blocks
            )
        else:
            out = target.full_attention(self.step, layer, q, key_cache, value_cache, self.q_len)
        return out.unsqueeze(0)


class PagedGemma4:
    """The tiny Gemma4's step over paged KV: ``__call__(step) -> (logits [T, vocab] float32, hidden [T, H])``.

    One K and one V cache per layer, ``[num_blocks + 1, block_size, Nkv, D]`` in the model dtype
    (``block_size`` the kernel block; full layers: ``num_global_key_value_heads`` heads of
    ``global_head_dim``, separate K and V as vLLM keeps them for ``attention_k_eq_v``); the extra block takes
    the writes of slot -1.
    ``q_len``: the verify step's tokens per request; ``max_rows``: the most tokens a decode step holds.
    ``faults``: planted bugs (:data:`FAULTS`) for the drill's own tests.
    """

    def __init__(
        self, model: Any, *, num_blocks: int, block_size: int, q_len: int, max_rows: int,
        chunk_blocks: int = large_head.DEFAULT_CHUNK_BLOCKS, faults: frozenset[str] = frozenset(),
    ) -> None:  # fmt: skip
        _register()
        self.model = model
        self.faults = faults
        self.chunk_blocks = chunk_blocks
        self.trash_slot = num_blocks * block_size
        cfg = model.config
        param = next(model.parameters())
        layers = [layer.self_attn for layer in model.model.layers]
        self.scale = float(layers[-1].scaling)
        if "scale" in faults:
            self.scale = layers[-1].head_dim ** -0.5  # planted: the habit 1/sqrt(d), not Gemma4's 1.0
        self.verify = LargeHeadBinding(
            group="full", q_len=q_len, scale=self.scale, verify_mode="blockwise", chunk_blocks=chunk_blocks
        )
        self.decode = LargeHeadBinding(group="full", q_len=1, scale=self.scale)
        self.kv: list[torch.Tensor] = []
        self.outs: dict[int, torch.Tensor] = {}
        for attn in layers:
            num_kv_heads = cfg.num_attention_heads // attn.num_key_value_groups
            shape = (num_blocks + 1, block_size, num_kv_heads, attn.head_dim)
            self.kv.append(torch.zeros((2, *shape), dtype=param.dtype, device=param.device))
            if not attn.is_sliding:
                out = (max_rows, cfg.num_attention_heads, attn.head_dim)
                self.outs[attn.layer_idx] = torch.zeros(out, dtype=param.dtype, device=param.device)
        self.caches = [(kv[0], kv[1]) for kv in self.kv]
        kinds = list(cfg.layer_types)
        self.last_layer = {
            "sliding": len(kinds) - 1 - kinds[::-1].index("sliding_attention"),
            "full": len(kinds) - 1 - kinds[::-1].index("full_attention"),
        }

    def write_kv(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """The new tokens' K and V into ``layer``'s cache at ``slots`` (-1: the trash block)."""
        key_cache, value_cache = self.caches[layer]
        slots = torch.where(slots < 0, torch.full_like(slots, self.trash_slot), slots)
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(key_cache.dtype))
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(value_cache.dtype))

    def full_attention(
        self, step: Step, layer: int, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        q_len: int,
    ) -> torch.Tensor:  # fmt: skip
        """A full layer through the binding: decode (``q_len`` 1), verify (``1 + k``), else a prefill."""
        if q_len == self.verify.q_len:
            return self.verify.verify(step, q, key_cache, value_cache, self.outs[layer])
        if q_len == 1:
            return self.decode.decode(step, q, key_cache, value_cache, self.outs[layer])
        views = step.views
        return large_head.verify_attention_blockwise(
            q, key_cache, value_cache, views["block_table.full"], views["seq_lens"], q_len, self.scale,
            self.chunk_blocks,
        )  # fmt: skip

    def __call__(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        views = step.views
        ids, positions = views["input_ids"], views["positions"]
        q_len = ids.shape[0] // views["seq_lens"].shape[0]
        text = self.model.model
        ctx = _Context(step, q_len, self)
        with torch.no_grad(), _paged(self.model.config):
            hidden = text.embed_tokens(ids.unsqueeze(0))
            hidden = _layers(text, hidden, positions.unsqueeze(0), ctx, {})
            hidden = text.norm(hidden)
            logits = self.model.lm_head(hidden)[0]
            cap = self.model.config.final_logit_softcapping
            if cap is not None:
                logits = torch.tanh(logits / cap) * cap
        return logits.float(), hidden[0]


def _layers(text: Any, hidden: torch.Tensor, position_ids: torch.Tensor, ctx: _Context, shared: dict) -> Any:
    """transformers' decoder layers of ``text`` (a ``Gemma4TextModel``), attention through ``ctx``."""
    rope = {kind: text.rotary_emb(hidden, position_ids, kind) for kind in sorted(text.unique_layer_types)}
    for i, layer in enumerate(text.layers):
        hidden = layer(
            hidden, None, shared_kv_states=shared, position_embeddings=rope[text.config.layer_types[i]],
            attention_mask=None, position_ids=position_ids, past_key_values=None, graphbuf_paged=ctx,
        )  # fmt: skip
    return hidden


class PagedAssistant:
    """The assistant's draft step: ``__call__(step) -> (logits [T, vocab] float32, hidden [T, H_target])``.

    One token per request: ``input_ids`` the token to draft from, ``positions`` the request's last target
    position (constant over a step's drafts), ``seq_lens`` the target's KV length; the target's hidden state
    comes from :attr:`hidden_in` (``[max_rows, H_target]``, written before each run; its address never
    changes). Reads the target's caches only.
    """

    def __init__(
        self, assistant: Any, target: PagedGemma4, *, max_rows: int, faults: frozenset[str] = frozenset()
    ) -> None:
        _register()
        self.assistant = assistant
        self.target = target
        self.faults = faults
        param = next(assistant.parameters())
        self.hidden_in = torch.zeros(
            (max_rows, assistant.backbone_hidden_size), dtype=param.dtype, device=param.device
        )
        # transformers' shared-KV layers look their K/V up by layer type; the paged attention reads caches.
        empty = torch.zeros(0, dtype=param.dtype, device=param.device)
        self._shared = {kind: (empty, empty) for kind in ("sliding_attention", "full_attention")}

    def __call__(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        views = step.views
        ids, positions = views["input_ids"], views["positions"]
        model, text = self.assistant, self.assistant.model
        ctx = _Context(step, 1, self.target, self)
        with torch.no_grad(), _paged(text.config):
            embedding = self.target.model.model.embed_tokens(ids.unsqueeze(0))
            joined = torch.cat([embedding, self.hidden_in[: ids.shape[0]].unsqueeze(0)], dim=-1)
            hidden = model.pre_projection(joined)
            hidden = text.norm(_layers(text, hidden, positions.unsqueeze(0), ctx, self._shared))
            logits = model.lm_head(hidden)[0]
            backbone = model.post_projection(hidden)[0]
        return logits.float(), backbone
