"""Kernel boundary of the large-head attention path.

Two kernels stand behind this module, each with one contract on every device:

``masked_attention_bnsd(query, key, value, hidden_mask, scale)``
    Dense attention in BNSD layout with an explicit boolean mask. ``query`` is ``[B, Nq, S, D]``, ``key``
    and ``value`` are ``[B, Nkv, L, D]`` with ``Nq % Nkv == 0`` (query head ``h`` reads KV head
    ``h // (Nq // Nkv)``), ``hidden_mask`` is ``[B, 1, S, L]`` bool where True hides the key from the query.
    Returns ``[B, Nq, S, D]`` in the query dtype. On an NPU this is ``torch_npu.npu_fusion_attention``
    (BNSD, ``atten_mask`` B1SS, ``sparse_mode=0``); elsewhere it is the software op
    ``graphbuf::masked_attention_bnsd``, which accumulates in float32 and returns zeros for a query whose
    keys are all hidden (callers never rely on that: the NPU kernel leaves such rows undefined).

``paged_decode_bnsd(query, key_cache, value_cache, block_table, seq_lens_host, ...)``
    Single-token paged decode: ``torch_npu.npu_fused_infer_attention_score`` with ``input_layout="BNSD"``,
    a block table and KV lengths given as a HOST list (the kernel bakes them into a captured task; only a task
    update changes them). NPU only; the software path of the callers gathers and masks instead.

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
    "paged_decode_workspace",
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
        return torch_npu.npu_fusion_attention(
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
    ``seq_lens_host`` B host ints.

    Returns ``[B, Nq, 1, D]``. With ``out`` the kernel writes into ``out`` (the form a graph task update
    re-issues with fresh ``seq_lens_host``); a captured task keeps the addresses of ``out``, ``workspace``
    (from :func:`paged_decode_workspace`) and ``softmax_lse`` (1 element of the query dtype), so pass all
    three and keep them alive as long as the graph.
    """
    torch_npu = _require_npu("paged_decode_bnsd")
    kwargs = _paged_decode_kwargs(query, key_cache, value_cache, block_table, seq_lens_host, scale)
    if out is None:
        return torch_npu.npu_fused_infer_attention_score(**kwargs)[0]
    if workspace is None:
        workspace = paged_decode_workspace(query, key_cache, value_cache, block_table, seq_lens_host, scale)
    if softmax_lse is None:
        softmax_lse = torch.empty(1, dtype=query.dtype, device=query.device)
    torch_npu.npu_fused_infer_attention_score.out(workspace=workspace, out=[out, softmax_lse], **kwargs)
    return out


def paged_decode_workspace(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens_host: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """The kernel's maximal workspace for these shapes (allocate once before capture, keep it alive)."""
    torch_npu = _require_npu("paged_decode_workspace")
    kwargs = _paged_decode_kwargs(query, key_cache, value_cache, block_table, seq_lens_host, scale)
    return torch_npu._npu_fused_infer_attention_score_get_max_workspace(**kwargs)
