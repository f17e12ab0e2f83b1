"""Options of the adapter's task factories (``binding.decode_task``, ``binding.verify_task``).

Registered through the ``graphbuf.tasks`` entry points in ``pyproject.toml``. This module imports pydantic
(and the pure-arithmetic ``costs``) only, so ``graphbuf check`` and ``graphbuf plan`` validate a spec's task
options and report its routes' costs without importing torch or the binding. The same options choose the
routes of the drill's tasks and of the vllm-ascend patch (``resolve.route_modes``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from graphbuf.spec.factories import TaskFactory

from .costs import decode_costs, verify_costs

__all__ = ["DECODE_TASK", "VERIFY_TASK", "DecodeTaskOptions", "VerifyTaskOptions"]


class _AttentionOptions(BaseModel):
    """Options every large-head attention task takes."""

    model_config = ConfigDict(extra="forbid", strict=True)

    layers: PositiveInt = Field(2, description="Layers the task binds, each with its own KV cache.")
    num_heads: PositiveInt = Field(description="Query heads per rank.")
    num_kv_heads: PositiveInt = Field(description="KV heads per rank (divides num_heads).")
    head_dim: PositiveInt = Field(description="Head dimension.")
    dtype: Literal["float16", "bfloat16", "float32"] = Field("float32", description="Query and KV dtype.")
    scale: float = Field(
        gt=0,
        allow_inf_nan=False,
        description="Softmax scale, from the model definition (Gemma4: 1.0, its q and k are RMS-normed and "
        "query_pre_attn_scalar is unused; not head_dim ** -0.5).",
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> _AttentionOptions:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads} (per rank)"
            )
        return self


class DecodeTaskOptions(_AttentionOptions):
    """Options of ``decode_task``: large-head decode attention over ``layers`` full-attention layers."""

    decode_mode: Literal["paged", "dense"] = Field(
        "paged",
        description="Decode route: the paged kernel with host KV lengths re-issued before each replay "
        "(reads only the live context), or the whole allocation gathered to dense BNSD.",
    )


class VerifyTaskOptions(_AttentionOptions):
    """Options of ``verify_task``: MTP verify attention, blockwise or dense."""

    verify_mode: Literal["dense", "blockwise"] = Field(
        "blockwise",
        description="Verify route: chunked online softmax (workspace bounded by chunk_blocks) or the whole "
        "allocation gathered to dense BNSD.",
    )
    chunk_blocks: PositiveInt = Field(2, description="KV blocks per chunk of the blockwise verify.")


#: The batch relation both tasks need (see :mod:`graphbuf.testing`).
BATCH_STRATEGY = "graphbuf.adapters.vllm_ascend.spec.strategies:vllm_decode_batch"
DECODE_TASK = TaskFactory(
    "graphbuf.adapters.vllm_ascend.bindings.attention_tasks:decode_task",
    DecodeTaskOptions,
    decode_costs,
    BATCH_STRATEGY,
)
VERIFY_TASK = TaskFactory(
    "graphbuf.adapters.vllm_ascend.bindings.attention_tasks:verify_task",
    VerifyTaskOptions,
    verify_costs,
    BATCH_STRATEGY,
)
