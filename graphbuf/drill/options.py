"""Options of the drill's own task factory (:class:`graphbuf.drill.session.PagedDecodeAttention`).

Registered through the ``graphbuf.tasks`` entry point in ``pyproject.toml``; imports pydantic only, so
``graphbuf check`` validates them without importing torch or the drill.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from graphbuf.spec.factories import TaskFactory

__all__ = ["PAGED_DECODE", "PagedDecodeOptions"]


class PagedDecodeOptions(BaseModel):
    """Options of ``PagedDecodeAttention``: eager paged decode attention over one KV group."""

    model_config = ConfigDict(extra="forbid", strict=True)

    num_heads: PositiveInt = Field(4, description="Query heads.")
    num_kv_heads: PositiveInt = Field(2, description="KV heads (divides num_heads).")
    head_dim: PositiveInt = Field(64, description="Head dimension.")
    dtype: Literal["float16", "bfloat16", "float32", "float64"] = Field(
        "float32", description="Element type."
    )


PAGED_DECODE = TaskFactory(
    "graphbuf.drill.session:PagedDecodeAttention", PagedDecodeOptions, strategy="graphbuf.testing:paged_kv"
)
