"""Fake ``vllm_ascend.utils`` (vllm-ascend 0.30+): ``use_updatable_graph`` and ``weak_ref_tensors``.

``weak_ref_tensor`` makes what torch_npu's ``_weak_ref_tensor`` makes on a device: a tensor over the same
memory whose storage owns nothing (``resizable()`` False), so it keeps nothing alive.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch


def use_updatable_graph(attn_backend: Any) -> bool:
    from vllm_ascend.attention.attention_v1 import AscendAttentionBackend

    return attn_backend is not None and issubclass(attn_backend, AscendAttentionBackend)


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return tensor
    raw = (ctypes.c_byte * storage.nbytes()).from_address(storage.data_ptr())
    base = torch.frombuffer(raw, dtype=torch.uint8).view(tensor.dtype)
    return base.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def weak_ref_tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return weak_ref_tensor(value)
    if isinstance(value, (list, tuple)):
        return type(value)(weak_ref_tensors(v) for v in value)
    if isinstance(value, dict):
        return {k: weak_ref_tensors(v) for k, v in value.items()}
    return value
