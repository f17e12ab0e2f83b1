"""Kernel boundary of the large-head attention path.

Which op runs where (torch_npu 2.10.0.post4 / 2.14.0; every op captured into an NPU graph is one torch_npu
documents as graph-capable):

=====================================  =====================================  ==============================
caller                                 NPU op                                 elsewhere
=====================================  =====================================  ==============================
verify, decode with device lengths     ``npu_fusion_attention_v3`` (BNSD,     ``graphbuf::masked_attention_
(dense gather path; routed attention)  B1SS bool mask, sparse_mode 0):        bnsd`` (software custom op)
                                       ordinary captured kernel
blockwise verify / decode              none: plain tensor ops                 the same tensor ops
decode with host KV lengths            ``npu_fused_infer_attention_score      :func:`paged_decode_software`
(:func:`paged_decode_bnsd`, the        .out`` (BNSD query, paged KV): the     (each request its own blocks,
decode task)                           only op of its task group              lengths from the host list)
=====================================  =====================================  ==============================

Not used anywhere: ``npu_fusion_attention`` (documented unsupported in graph mode and aclgraph; with
``sync=False`` a capture cannot join the stream it waits on) and FIA's allocating form (its workspace is
allocated per call for that call's KV lengths; torch_npu's own graph handler swaps it for ``.out`` with a
workspace from ``_npu_fused_infer_attention_score_get_max_workspace``, as graphbuf does).

``masked_attention_bnsd(query, key, value, hidden_mask, scale)``
    Dense attention in BNSD layout with an explicit boolean mask. ``query`` is ``[B, Nq, S, D]``, ``key``
    and ``value`` are ``[B, Nkv, L, D]`` with ``Nq % Nkv == 0`` (query head ``h`` reads KV head
    ``h // (Nq // Nkv)``), ``hidden_mask`` is ``[B, 1, S, L]`` bool where True hides the key from the query.
    Returns ``[B, Nq, S, D]`` in the query dtype. The software op accumulates in float32 and returns zeros
    for a query whose keys are all hidden (callers never rely on that: the NPU kernel leaves such rows
    undefined).

``paged_decode_bnsd(query, key_cache, value_cache, block_table, seq_lens_host, ...)``
    Single-token paged decode with KV lengths given as a HOST list (a captured task bakes them; only a task
    update changes them). In a graph the task group holds exactly :func:`paged_decode_out`, with output,
    softmax lse and workspace from :func:`paged_decode_buffers` allocated before the group (so from the
    graph's pool), the workspace sized for the longest KV length the block table allows. NPU only.

torch_npu is imported lazily and only once; a missing or broken install (ImportError, OSError, RuntimeError)
means "no NPU" and never an import error of this module.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType

import torch

from graphbuf.errors import DeviceUnavailableError

__all__ = [
    "masked_attention_bnsd",
    "npu_available",
    "npu_runtime",
    "paged_decode_bnsd",
    "paged_decode_buffers",
    "paged_decode_out",
    "paged_decode_software",
    "uses_npu_kernels",
]

_MAX_TOKENS = 2147483647  # "no sparsity window" value of the NPU kernels' pre/next token limits


@functools.cache
def npu_runtime() -> ModuleType | None:
    """torch_npu if it imports here, else None. Imported once; failures are remembered, never raised."""
    try:
        import torch_npu  # type: ignore[import-not-found]
    except (ImportError, OSError, RuntimeError):
        return None
    return torch_npu


def npu_available() -> bool:
    """True when torch_npu imports and reports at least one NPU."""
    if npu_runtime() is None:
        return False
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available() and npu.device_count() > 0)
    except (RuntimeError, OSError):
        return False


def uses_npu_kernels(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` lives on an NPU, so the NPU kernels (not the software ops) run on it."""
    return tensor.device.type == "npu"


def _require_npu(what: str) -> ModuleType:
    runtime = npu_runtime()
    if runtime is None:
        raise DeviceUnavailableError(f"{what} needs torch_npu, which does not import here")
    return runtime


# --- software stand-in for npu_fusion_attention (BNSD, boolean mask) ----------------------------------------


def _masked_attention_software(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, hidden_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    batch, num_heads, q_len, head_dim = query.shape
    num_kv_heads, kv_len = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    # Query heads h = kv * group + g share KV head kv: fold the group into the query axis, no K/V repeat.
    q = query.to(torch.float32).reshape(batch, num_kv_heads, group * q_len, head_dim)
    scores = torch.matmul(q, key.to(torch.float32).transpose(-1, -2)) * scale
    scores = scores.view(batch, num_kv_heads, group, q_len, kv_len)
    scores = scores.masked_fill(hidden_mask.view(batch, 1, 1, q_len, kv_len), float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs.view(batch, num_kv_heads, group * q_len, kv_len), value.to(torch.float32))
    out = out.view(batch, num_kv_heads, group, q_len, head_dim)
    out = torch.where(
        denom > 0, out / denom.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(out)
    )
    return out.reshape(batch, num_heads, q_len, head_dim).to(query.dtype)


def _ensure_software_op() -> None:
    """Register ``graphbuf::masked_attention_bnsd`` once per process; a re-import reuses it."""
    try:
        torch.ops.graphbuf.masked_attention_bnsd  # noqa: B018 - attribute lookup is the existence test
        return
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op("graphbuf::masked_attention_bnsd", mutates_args=())
    def masked_attention_bnsd_op(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, hidden_mask: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return _masked_attention_software(query, key, value, hidden_mask, scale)

    @masked_attention_bnsd_op.register_fake
    def _(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, hidden_mask: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return torch.empty_like(query)


_ensure_software_op()


def _check_bnsd(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, hidden_mask: torch.Tensor
) -> tuple[int, int]:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            "masked_attention_bnsd: query, key and value must be 4-D BNSD tensors, got "
            f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    batch, num_heads, q_len, head_dim = query.shape
    if key.shape != value.shape or key.shape[0] != batch or key.shape[3] != head_dim:
        raise ValueError(
            f"masked_attention_bnsd: key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
            f"[B={batch}, Nkv, L, D={head_dim}]"
        )
    num_kv_heads = key.shape[1]
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"masked_attention_bnsd: query heads ({num_heads}) must be a multiple of key heads "
            f"({num_kv_heads})"
        )
    expected_mask = (batch, 1, q_len, key.shape[2])
    if tuple(hidden_mask.shape) != expected_mask or hidden_mask.dtype != torch.bool:
        raise ValueError(
            f"masked_attention_bnsd: hidden_mask must be bool {expected_mask}, got "
            f"{hidden_mask.dtype} {tuple(hidden_mask.shape)}"
        )
    return num_heads, num_kv_heads


def masked_attention_bnsd(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, hidden_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense BNSD attention with a boolean mask (True = hidden); see the module docstring for the contract.

    Every query row must see at least one key: the NPU kernel leaves fully hidden rows undefined.
    """
    num_heads, _ = _check_bnsd(query, key, value, hidden_mask)
    if uses_npu_kernels(query):
        torch_npu = _require_npu("masked_attention_bnsd on an NPU tensor")
        return torch_npu.npu_fusion_attention_v3(
            query,
            key,
            value,
            num_heads,
            "BNSD",
            atten_mask=hidden_mask,
            scale=float(scale),
            keep_prob=1.0,
            pre_tockens=_MAX_TOKENS,
            next_tockens=_MAX_TOKENS,
            sparse_mode=0,
        )[0]
    return torch.ops.graphbuf.masked_attention_bnsd(query, key, value, hidden_mask, float(scale))


# --- software paged decode (host KV lengths): the NPU paged kernel's contract off an NPU ----------------


def paged_decode_software(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens_host: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Single-token paged decode in software: ``query`` ``[B, Nq, D]``, caches ``[num_blocks, block_size,
    Nkv, D]``, ``block_table`` ``[B, W]``, ``seq_lens_host`` B host ints in ``[0, W * block_size]`` (not
    checked here). Returns ``[B, Nq, D]`` in the query dtype.

    As the NPU kernel: request ``r`` reads only its first ``ceil(n_r / block_size)`` blocks (ids clamped
    into range) and exactly its ``n_r`` keys, the lengths coming from the host list only (a graph bakes
    them); a request with ``n_r == 0`` reads nothing and gets zeros. float32 accumulation, as
    :func:`masked_attention_bnsd`'s software op. Each request is one gather and two matmuls over its own
    keys, so the work is the sum of the lengths, not the batch times the longest.
    """
    batch, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    out = torch.zeros((batch, num_heads, head_dim), dtype=query.dtype, device=query.device)
    for r, n in enumerate(int(n) for n in seq_lens_host):
        if n <= 0:
            continue
        ids = block_table[r, : -(-n // block_size)].to(torch.int64).clamp(0, num_blocks - 1)
        # [n, Nkv, D] -> [Nkv, n, D]: a strided view the matmuls read directly (no copy of the keys)
        key = key_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:n].to(torch.float32)
        value = value_cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:n].to(torch.float32)
        q = query[r].to(torch.float32).view(num_kv_heads, group, head_dim)  # heads kv * group + g
        scores = torch.matmul(q, key.permute(1, 2, 0)) * scale  # [Nkv, group, n]
        probs = torch.softmax(scores, dim=-1)
        out[r] = torch.matmul(probs, value.transpose(0, 1)).view(num_heads, head_dim).to(query.dtype)
    return out


# --- NPU paged decode (fused infer attention, BNSD, host KV lengths) ----------------------------------------


def _paged_decode_kwargs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens_host: Sequence[int],
    scale: float,
) -> dict[str, object]:
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    return {
        "query": query,
        # The kernel reads paged KV as [num_blocks, block_size, Nkv * D]; a view, never a copy.
        "key": key_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
        "value": value_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
        "block_table": block_table,
        "actual_seq_lengths_kv": [int(n) for n in seq_lens_host],
        "num_heads": int(query.shape[1]),
        "num_key_value_heads": int(num_kv_heads),
        "scale": float(scale),
        "input_layout": "BNSD",
        "block_size": int(block_size),
        "sparse_mode": 0,
    }


def paged_decode_buffers(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, workspace, softmax_lse)`` for :func:`paged_decode_out` over these shapes: output and lse by
    the op's own shape rule, the workspace sized for every request at the longest KV length the block table
    allows (``W * block_size``), so any later update fits. Allocate them before the task group (inside a
    capture they come from the graph's pool) and keep them alive as long as the graph."""
    torch_npu = _require_npu("paged_decode_buffers")
    longest = [int(block_table.shape[1]) * int(key_cache.shape[1])] * int(query.shape[0])
    kwargs = _paged_decode_kwargs(query, key_cache, value_cache, block_table, longest, scale)
    workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(**kwargs)
    out, softmax_lse = torch_npu._npu_fused_infer_attention_score_infer_output(
        kwargs["query"],
        kwargs["value"],
        input_layout="BNSD",
        block_table=block_table,
        num_heads=kwargs["num_heads"],
        num_key_value_heads=kwargs["num_key_value_heads"],
        softmax_lse_flag=False,
    )
    return out, workspace, softmax_lse


def paged_decode_out(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    workspace: torch.Tensor,
    softmax_lse: torch.Tensor,
    *,
    seq_lens_kv: Sequence[int],
    scale: float,
) -> None:
    """The task body: exactly one ``npu_fused_infer_attention_score.out`` writing ``out``; nothing else runs,
    nothing is allocated. Argument order is the task's (tensors, then host ``seq_lens_kv`` and ``scale``), so
    ``Graph.task(kind, paged_decode_out, *tensors, seq_lens_kv=..., scale=...)`` captures it and
    ``update(seq_lens_kv=...)`` re-issues it."""
    torch_npu = _require_npu("paged_decode_out")
    kwargs = _paged_decode_kwargs(query, key_cache, value_cache, block_table, seq_lens_kv, scale)
    torch_npu.npu_fused_infer_attention_score.out(workspace=workspace, out=[out, softmax_lse], **kwargs)


def paged_decode_bnsd(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens_host: Sequence[int],
    scale: float,
    *,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    softmax_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """NPU paged decode: ``query`` ``[B, Nq, 1, D]``, caches ``[num_blocks, block_size, Nkv, D]``,
    ``block_table`` ``[B, W]`` int32 (ids must be in range: the kernel does not check them),
    ``seq_lens_host`` B host ints. Returns ``[B, Nq, 1, D]``.

    Without ``out`` the three buffers come from :func:`paged_decode_buffers` (an eager convenience). With
    ``out``, ``workspace`` and ``softmax_lse`` are required: ValueError otherwise (the op would silently
    allocate them inside the task, memory a task update then points at after it was freed).
    """
    if out is None:
        if workspace is not None or softmax_lse is not None:
            raise ValueError("paged_decode_bnsd: workspace / softmax_lse given without out; pass all three")
        out, workspace, softmax_lse = paged_decode_buffers(query, key_cache, value_cache, block_table, scale)
    elif workspace is None or softmax_lse is None:
        missing = [n for n, t in (("workspace", workspace), ("softmax_lse", softmax_lse)) if t is None]
        raise ValueError(
            f"paged_decode_bnsd: out= given without {' and '.join(missing)}; the .out form needs all of out, "
            "workspace and softmax_lse preallocated (paged_decode_buffers), never allocated inside the call"
        )
    paged_decode_out(
        query, key_cache, value_cache, block_table, out, workspace, softmax_lse,
        seq_lens_kv=seq_lens_host, scale=scale,
    )  # fmt: skip
    return out
