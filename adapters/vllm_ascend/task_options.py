"""Options of the adapter's drill task factories (``binding.decode_task``, ``binding.verify_task``).

Registered through the ``graphbuf.tasks`` entry points in ``pyproject.toml``. This module imports pydantic
only, so ``graphbuf check`` validates a spec's task options without importing torch or the binding.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from graphbuf.factories import TaskFactory

__all__ = ["DECODE_TASK", "VERIFY_TASK", "DecodeTaskOptions", "VerifyTaskOptions"]


class DecodeTaskOptions(BaseModel):
    """Options of ``decode_task``: large-head decode attention over ``layers`` full-attention layers."""

    model_config = ConfigDict(extra="forbid", strict=True)

    layers: PositiveInt = Field(2, description="Layers the task binds, each with its own KV cache.")
    num_heads: PositiveInt = Field(description="Query heads per rank.")
    num_kv_heads: PositiveInt = Field(description="KV heads per rank (divides num_heads).")
    head_dim: PositiveInt = Field(description="Head dimension.")
    dtype: Literal["float16", "bfloat16", "float32"] = Field("float32", description="Query and KV dtype.")


class VerifyTaskOptions(DecodeTaskOptions):
    """Options of ``verify_task``: MTP verify attention, dense or blockwise."""

    verify_mode: Literal["dense", "blockwise"] = Field("dense", description="Dense BNSD gather or chunked.")
    chunk_blocks: PositiveInt = Field(2, description="KV blocks per chunk of the blockwise verify.")


#: The batch relation both tasks need (see :mod:`graphbuf.testing`).
BATCH_STRATEGY = "graphbuf.adapters.vllm_ascend.strategies:vllm_decode_batch"
DECODE_TASK = TaskFactory(
    "graphbuf.adapters.vllm_ascend.binding:decode_task", DecodeTaskOptions, strategy=BATCH_STRATEGY
)
VERIFY_TASK = TaskFactory(
    "graphbuf.adapters.vllm_ascend.binding:verify_task", VerifyTaskOptions, strategy=BATCH_STRATEGY
)
