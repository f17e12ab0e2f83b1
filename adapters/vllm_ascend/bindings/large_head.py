"""Large-head (Gemma4 full attention, head_dim 512) decode and MTP-verify attention over paged KV.

Contract shared by every function here:

* Caches are one layer's K or V: ``[num_blocks, block_size, Nkv, D]``, last dim contiguous, viewable as rows.
* ``block_table`` is ``[B, W]`` (int32 or int64), ``seq_lens`` ``[B]`` (int32 or int64) on the query's device.
  ``seq_lens[r]`` counts request ``r``'s tokens including the new ones, and must be ``<= W * block_size``.
* Verify queries are ``[B * q_len, Nq, D]`` request-major; query ``i`` of request ``r`` sees keys
  ``0 .. seq_lens[r] - q_len + i`` inclusive. The mask convention is ``key_pos > seq_lens - q_len + q_pos``
  is True = hidden. Decode is the case ``q_len == 1``.
* A query that sees no key (``seq_lens[r] - q_len + i < 0``, e.g. a padding row with ``seq_lens[r] == 0``)
  returns zeros.
* Block ids in columns past a row's needed blocks are ignored whatever they hold: they are masked to 0, then
  every id is clamped into ``[0, num_blocks)`` before any gather, so no read leaves the cache.
* Graph safe: no host read of a tensor value, no shape that depends on one. The gather is sized by the
  allocation (``W * block_size`` keys), not by the batch's longest sequence.

The gather, BNSD layout and mask code below runs on every device; only the attention kernel differs
(:mod:`.kernels`: the NPU kernel on an NPU, its software custom op elsewhere). The blockwise path is plain
tensor ops everywhere (float32 online softmax), so its workspace is bounded by ``chunk_blocks``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..kernels import attention as kernels
from ..spec import costs

__all__ = [
    "DEFAULT_CHUNK_BLOCKS",
    "IssueTask",
    "decode_attention",
    "decode_into",
    "gather_kv_bnsd",
    "hidden_mask",
    "sanitize_block_table",
    "verify_attention",
    "verify_attention_blockwise",
    "verify_workspace_bytes",
]

DEFAULT_CHUNK_BLOCKS = 2
"""Blocks per chunk of the blockwise path: 256 keys at block size 128, which bounds the bf16 workspace of the
Gemma4 verify at 1/8 of the dense gather's (8.07× less at capture size 48)."""

IssueTask = Callable[..., object]
"""How decode issues its one re-issuable kernel call: ``issue(fn, *tensors, **host_args)`` (e.g. ``Step.task``
bound to a task kind)."""

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)


# --- validation ---------------------------------------------------------------------------------------------


def _validate(
    fn: str,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_len: int,
) -> tuple[int, int, int]:
    """Check shapes, dtypes and devices; return (batch, num_heads, num_kv_heads)."""
    if isinstance(q_len, bool) or not isinstance(q_len, int) or q_len < 1:
        raise ValueError(f"{fn}: q_len must be an int >= 1, got {q_len!r}")
    if query.dim() != 3:
        raise ValueError(f"{fn}: query must be [tokens, Nq, D], got shape {tuple(query.shape)}")
    if query.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{fn}: query dtype {query.dtype} not supported; allowed: float32, bfloat16, float16")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4:
            raise ValueError(
                f"{fn}: {name} must be [num_blocks, block_size, Nkv, D], got {tuple(cache.shape)}"
            )
        if cache.dtype != query.dtype:
            raise TypeError(f"{fn}: {name} dtype {cache.dtype} must equal the query dtype {query.dtype}")
        if cache.device != query.device:
            raise ValueError(f"{fn}: {name} is on {cache.device}, query on {query.device}; they must match")
        if not cache.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous (a [2, ...] KV tensor's [0] / [1] slice is)")
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"{fn}: key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must match"
        )
    tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_dim = key_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"{fn}: key_cache head dim {cache_dim} != query head dim {head_dim}")
    if num_blocks < 1 or block_size < 1 or num_kv_heads < 1:
        raise ValueError(
            f"{fn}: key_cache {tuple(key_cache.shape)} must have num_blocks, block_size, Nkv >= 1"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{fn}: query heads Nq={num_heads} must be a multiple of the caches' KV heads Nkv={num_kv_heads}"
        )
    if tokens % q_len != 0:
        raise ValueError(f"{fn}: query has {tokens} tokens, not a multiple of q_len={q_len}")
    batch = tokens // q_len
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"{fn}: block_table must be [B={batch}, W>=1], got {tuple(block_table.shape)}")
    if tuple(seq_lens.shape) != (batch,):
        raise ValueError(f"{fn}: seq_lens must be [B={batch}], got {tuple(seq_lens.shape)}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{fn}: {name} dtype {t.dtype} not supported; allowed: int32, int64")
        if t.device != query.device:
            raise ValueError(f"{fn}: {name} is on {t.device}, query on {query.device}; they must match")
    return batch, num_heads, num_kv_heads


def _check_chunk_blocks(fn: str, chunk_blocks: int) -> None:
    if isinstance(chunk_blocks, bool) or not isinstance(chunk_blocks, int) or chunk_blocks < 1:
        raise ValueError(f"{fn}: chunk_blocks must be an int >= 1, got {chunk_blocks!r}")


# --- shared production code: block ids, gather, mask, layout ------------------------------------------------


def sanitize_block_table(
    block_table: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> torch.Tensor:
    """Block ids safe to gather: ``[B, W]`` int32, every id in ``[0, num_blocks)``.

    Columns at or past ``ceil(seq_lens[r] / block_size)`` become 0 whatever they held (garbage, negative,
    out of range); the rest are clamped into range. Needs no host read.
    """
    width = block_table.shape[1]
    lens = seq_lens.to(torch.int64).clamp(0, width * block_size)
    needed = (lens + (block_size - 1)) // block_size
    columns = torch.arange(width, device=block_table.device, dtype=torch.int64)
    used = columns.unsqueeze(0) < needed.unsqueeze(1)
    ids = torch.where(
        used, block_table.to(torch.int64), torch.zeros((), dtype=torch.int64, device=used.device)
    )
    return ids.clamp(0, num_blocks - 1).to(torch.int32)


def _cache_rows(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(-1, cache.shape[-1])


def _row_index(block_ids: torch.Tensor, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """Flat cache row of each (request, kv head, key position) for ``block_ids`` ``[B, w]``, flattened."""
    device = block_ids.device
    offsets = torch.arange(block_size, device=device, dtype=torch.int64)
    heads = torch.arange(num_kv_heads, device=device, dtype=torch.int64)
    slots = block_ids.to(torch.int64).unsqueeze(-1) * block_size + offsets  # [B, w, bs]
    rows = slots.unsqueeze(1) * num_kv_heads + heads.view(1, -1, 1, 1)  # [B, Nkv, w, bs]
    return rows.reshape(-1)


def gather_kv_bnsd(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the blocks ``block_ids`` ``[B, w]`` (already sanitized) of both caches into dense BNSD
    ``[B, Nkv, w * block_size, D]`` tensors: one index_select per cache, no intermediate copy."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    batch, width = block_ids.shape
    rows = _row_index(block_ids, block_size, num_kv_heads)
    shape = (batch, num_kv_heads, width * block_size, head_dim)
    key = _cache_rows(key_cache).index_select(0, rows).view(shape)
    value = _cache_rows(value_cache).index_select(0, rows).view(shape)
    return key, value


def _last_visible(seq_lens: torch.Tensor, q_len: int) -> torch.Tensor:
    """``[B, q_len]`` int64: index of the last key each query sees (negative: sees none)."""
    q_pos = torch.arange(q_len, device=seq_lens.device, dtype=torch.int64)
    return seq_lens.to(torch.int64).unsqueeze(1) - q_len + q_pos


def hidden_mask(seq_lens: torch.Tensor, q_len: int, key_start: int, key_count: int) -> torch.Tensor:
    """``[B, q_len, key_count]`` bool for keys ``key_start .. key_start + key_count - 1``: True = hidden,
    i.e. ``key_pos > seq_lens - q_len + q_pos``."""
    key_pos = torch.arange(key_start, key_start + key_count, device=seq_lens.device, dtype=torch.int64)
    return key_pos.view(1, 1, -1) > _last_visible(seq_lens, q_len).unsqueeze(-1)


def _query_bnsd(query: torch.Tensor, batch: int, q_len: int) -> torch.Tensor:
    _, num_heads, head_dim = query.shape
    return query.view(batch, q_len, num_heads, head_dim).transpose(1, 2).contiguous()


def _to_tokens(out_bnsd: torch.Tensor, row_valid: torch.Tensor) -> torch.Tensor:
    """BNSD output -> ``[B * q_len, Nq, D]``, zeroing queries that see no key."""
    batch, num_heads, q_len, head_dim = out_bnsd.shape
    out = out_bnsd.masked_fill(~row_valid.view(batch, 1, q_len, 1), 0)
    return out.transpose(1, 2).reshape(batch * q_len, num_heads, head_dim)


# --- dense path ---------------------------------------------------------------------------------------------


def _dense(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_len: int,
    scale: float,
    batch: int,
) -> torch.Tensor:
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    width = block_table.shape[1]
    ids = sanitize_block_table(block_table, seq_lens, num_blocks, block_size)
    key, value = gather_kv_bnsd(key_cache, value_cache, ids)
    hidden = hidden_mask(seq_lens, q_len, 0, width * block_size)
    row_valid = _last_visible(seq_lens, q_len) >= 0
    # A query that sees nothing gets key 0 (a real, clamped block) so the kernel's row stays finite; the row
    # is zeroed afterwards. The NPU kernel leaves fully hidden rows undefined.
    first_key = torch.arange(width * block_size, device=hidden.device) == 0
    hidden = hidden & ~(first_key.view(1, 1, -1) & ~row_valid.unsqueeze(-1))
    out = kernels.masked_attention_bnsd(
        _query_bnsd(query, batch, q_len), key, value, hidden.unsqueeze(1), float(scale)
    )
    return _to_tokens(out, row_valid)


# --- blockwise path -----------------------------------------------------------------------------------------


def _blockwise(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_len: int,
    scale: float,
    batch: int,
    chunk_blocks: int,
) -> torch.Tensor:
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    width = block_table.shape[1]
    ids = sanitize_block_table(block_table, seq_lens, num_blocks, block_size)
    # Query heads kv * group + g share KV head kv: rows of one KV head are (g, q_pos), group-major.
    q = (_query_bnsd(query, batch, q_len).to(torch.float32) * float(scale)).view(
        batch, num_kv_heads, group * q_len, head_dim
    )
    running_max = torch.full(
        (batch, num_kv_heads, group * q_len, 1), float("-inf"), dtype=torch.float32, device=query.device
    )
    running_sum = torch.zeros_like(running_max)
    acc = torch.zeros(
        (batch, num_kv_heads, group * q_len, head_dim), dtype=torch.float32, device=query.device
    )
    zero = torch.zeros((), dtype=torch.float32, device=query.device)
    # Cache rows and the mask of the whole table, built once (int/bool, no K/V); each chunk slices them, so
    # a chunk issues the attention ops only (fewer captured ops per chunk, same values).
    rows = _row_index(ids, block_size, num_kv_heads).view(batch, num_kv_heads, width * block_size)
    hidden_all = hidden_mask(seq_lens, q_len, 0, width * block_size).view(batch, 1, 1, q_len, -1)
    key_rows, value_rows = _cache_rows(key_cache), _cache_rows(value_cache)
    for first in range(0, width, chunk_blocks):
        last = min(width, first + chunk_blocks)
        keys = (last - first) * block_size
        chunk_rows = rows[:, :, first * block_size : last * block_size].reshape(-1)
        shape = (batch, num_kv_heads, keys, head_dim)
        key = key_rows.index_select(0, chunk_rows).view(shape)
        value = value_rows.index_select(0, chunk_rows).view(shape)
        scores = torch.matmul(q, key.to(torch.float32).transpose(-1, -2))
        hidden = hidden_all[..., first * block_size : last * block_size]
        scores.view(batch, num_kv_heads, group, q_len, keys).masked_fill_(hidden, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        # -inf only while a query has seen no key yet; shift by 0 then so exp() gives 0, never NaN.
        shift = torch.where(torch.isfinite(new_max), new_max, zero)
        rescale = torch.exp(running_max - shift)
        probs = scores.sub_(shift).exp_()  # in place: scores are dead once the new max is known
        running_sum.mul_(rescale).add_(probs.sum(dim=-1, keepdim=True))
        acc.mul_(rescale).add_(torch.matmul(probs, value.to(torch.float32)))
        running_max = new_max
    out = torch.where(running_sum > 0, acc / running_sum.clamp_min(torch.finfo(torch.float32).tiny), zero)
    out = out.view(batch, num_heads, q_len, head_dim).to(query.dtype)
    return _to_tokens(out, _last_visible(seq_lens, q_len) >= 0)


# --- public entry points ------------------------------------------------------------------------------------


def verify_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_len: int,
    scale: float,
) -> torch.Tensor:
    """MTP verify attention, dense: gather all ``W * block_size`` keys to BNSD, mask, one kernel call.

    ``query`` ``[B * q_len, Nq, D]`` -> ``[B * q_len, Nq, D]`` in the query dtype; contract: module docstring.
    Workspace grows with ``W``; see :func:`verify_workspace_bytes`.
    """
    batch, _, _ = _validate("verify_attention", query, key_cache, value_cache, block_table, seq_lens, q_len)
    return _dense(query, key_cache, value_cache, block_table, seq_lens, q_len, scale, batch)


def verify_attention_blockwise(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_len: int,
    scale: float,
    chunk_blocks: int = DEFAULT_CHUNK_BLOCKS,
) -> torch.Tensor:
    """MTP verify attention walking the block table ``chunk_blocks`` blocks at a time with a float32 online
    softmax (running max and sum). Same contract and numerics as :func:`verify_attention`; the workspace is
    bounded by the chunk, not by ``W``. Every chunk of the allocation is visited (no data-dependent skip)."""
    fn = "verify_attention_blockwise"
    batch, _, _ = _validate(fn, query, key_cache, value_cache, block_table, seq_lens, q_len)
    _check_chunk_blocks(fn, chunk_blocks)
    return _blockwise(query, key_cache, value_cache, block_table, seq_lens, q_len, scale, batch, chunk_blocks)


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    seq_lens_host: Sequence[int] | None = None,
    chunk_blocks: int | None = None,
    issue: IssueTask | None = None,
) -> torch.Tensor:
    """Single-token decode attention: ``query`` ``[B, Nq, D]`` -> ``[B, Nq, D]``.

    Paths, by device and arguments:

    * NPU, float16/bfloat16, ``seq_lens_host`` given, ``chunk_blocks`` None: the paged fused-infer kernel
      reads the cache through the (sanitized) block table; KV lengths come from ``seq_lens_host``, a host
      sequence of B ints that must equal ``seq_lens``. A captured graph bakes them: re-issue the task with
      fresh lengths. Block-table sanitising, the output buffers and the zeroing of rows that see no key run
      as ordinary kernels around one call ``issue(kernels.paged_decode_out, *tensors, seq_lens_kv=...,
      scale=...)`` (default: a plain call; the binding passes ``Step.task`` so that call, and only it, is the
      captured task group).
    * ``chunk_blocks`` given: the blockwise path of :func:`verify_attention_blockwise` with ``q_len == 1``.
    * Elsewhere, ``seq_lens_host`` given, ``chunk_blocks`` None: the software paged decode with the same
      contract: KV lengths from ``seq_lens_host`` only, gathering only the blocks they need.
    * Otherwise: the dense gather path of :func:`verify_attention` with ``q_len == 1``, device lengths.
    """
    fn = "decode_attention"
    batch, _, _ = _validate(fn, query, key_cache, value_cache, block_table, seq_lens, 1)
    if chunk_blocks is not None:
        _check_chunk_blocks(fn, chunk_blocks)
        return _blockwise(query, key_cache, value_cache, block_table, seq_lens, 1, scale, batch, chunk_blocks)
    if seq_lens_host is not None:
        capacity = block_table.shape[1] * key_cache.shape[1]
        lens = [int(n) for n in seq_lens_host]
        if len(lens) != batch or any(n < 0 or n > capacity for n in lens):
            raise ValueError(
                f"{fn}: seq_lens_host must hold B={batch} ints in [0, W * block_size={capacity}], got {lens}"
            )
        if kernels.uses_npu_kernels(query) and query.dtype != torch.float32:
            return _paged_decode_npu(query, key_cache, value_cache, block_table, seq_lens, lens, scale, issue)
        if not kernels.uses_npu_kernels(query):
            return _paged_decode_software(query, key_cache, value_cache, block_table, lens, scale, batch)
    return _dense(query, key_cache, value_cache, block_table, seq_lens, 1, scale, batch)


def decode_into(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    seq_lens_kv: Sequence[int],
    scale: float,
    issue: IssueTask | None = None,
) -> torch.Tensor:
    """:func:`decode_attention` with host KV lengths ``seq_lens_kv``, written into ``out`` ``[B, Nq, D]``
    (the copy is an ordinary kernel, outside any task group); returns ``out``. The one decode entry point
    of the drill's binding and of the routed vllm-ascend path; ``issue`` as in :func:`decode_attention`."""
    result = decode_attention(
        query, key_cache, value_cache, block_table, seq_lens, scale, seq_lens_host=seq_lens_kv, issue=issue
    )
    if result.data_ptr() != out.data_ptr() or result.numel() != out.numel():  # never copied onto itself
        out.copy_(result.reshape(out.shape))
    return out


def _paged_decode_software(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens_host: list[int],
    scale: float,
    batch: int,
) -> torch.Tensor:
    """The paged kernel's contract in software: KV lengths are the host list only (the device ``seq_lens``
    is not read), and each request gathers only the blocks its own length needs, so a task replayed with
    stale lengths reads stale context exactly as the NPU kernel would."""
    return kernels.paged_decode_software(query, key_cache, value_cache, block_table, seq_lens_host, scale)


def _paged_decode_npu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_host: list[int],
    scale: float,
    issue: IssueTask | None,
) -> torch.Tensor:
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    ids = sanitize_block_table(block_table, seq_lens, num_blocks, block_size)
    q_bnsd = query.unsqueeze(2).contiguous()  # copies only a strided query; outside the task group
    out, workspace, lse = kernels.paged_decode_buffers(q_bnsd, key_cache, value_cache, ids, float(scale))
    run = _call if issue is None else issue
    run(
        kernels.paged_decode_out, q_bnsd, key_cache, value_cache, ids, out, workspace, lse,
        seq_lens_kv=seq_lens_host, scale=float(scale),
    )  # fmt: skip
    return _to_tokens(out, _last_visible(seq_lens, 1) >= 0)


def _call(fn: Callable[..., object], *tensors: torch.Tensor, **host: object) -> object:
    return fn(*tensors, **host)


# --- workspace ----------------------------------------------------------------------------------------------


def verify_workspace_bytes(
    batch: int,
    q_len: int,
    width: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    chunk_blocks: int = DEFAULT_CHUNK_BLOCKS,
    *,
    num_heads: int | None = None,
) -> dict[str, int]:
    """Peak bytes of the intermediate tensors each verify path allocates, keyed ``"dense"`` and
    ``"blockwise"``, counted as if all were live at once (inputs, the returned output and kernel-internal
    scratch excluded; the software kernel's float32 copies are kernel scratch).

    ``num_heads`` (query heads) sizes the query-side terms; it defaults to ``num_kv_heads``. Decode's gather
    paths are the case ``q_len == 1``; the NPU paged decode kernel gathers nothing.
    """
    for name, value in (
        ("batch", batch),
        ("q_len", q_len),
        ("width", width),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("chunk_blocks", chunk_blocks),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"verify_workspace_bytes: {name} must be an int >= 1, got {value!r}")
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"verify_workspace_bytes: dtype {dtype} not supported; allowed: float32, bfloat16, float16"
        )
    heads = num_kv_heads if num_heads is None else num_heads
    if heads < 1 or heads % num_kv_heads != 0:
        raise ValueError(
            f"verify_workspace_bytes: num_heads={heads} must be a positive multiple of {num_kv_heads}"
        )
    item = torch.empty((), dtype=dtype).element_size()
    return costs.verify_workspace_bytes(
        batch, q_len, width, block_size, num_kv_heads, head_dim, item, chunk_blocks, heads
    )
