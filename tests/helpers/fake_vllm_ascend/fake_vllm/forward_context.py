"""Fake of ``vllm.forward_context``: one settable context (``CONTEXT``), available by default."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ForwardContext:
    attn_metadata: Any = field(default_factory=dict)
    cudagraph_runtime_mode: Any = None


CONTEXT: ForwardContext | None = ForwardContext()


def is_forward_context_available() -> bool:
    return CONTEXT is not None


def get_forward_context() -> ForwardContext:
    assert CONTEXT is not None, "no forward context"
    return CONTEXT
