"""Task binding: Gemma4 large-head decode and verify attention bound to graphbuf buffers by KV group.

Every full-attention layer gets a decode task and a verify task. A task reads its block table as
``views["block_table.<group>"]`` and its lengths as ``views["seq_lens"]``: the same captured tensors for every
layer of the group, so one refresh per replay serves all layers and its cost does not grow with the layer
count.

* Decode (one token per request) is an :data:`~graphbuf.TaskKind.ATTENTION` task whose KV lengths are a
  host list (``seq_lens_kv``), as Ascend's fused infer attention takes ``actual_seq_lengths_kv``. The graph
  bakes the list; :meth:`LargeHeadBinding.host_args` gives the fresh one and the runner re-issues the task
  before replay. On an NPU the task is exactly one ``npu_fused_infer_attention_score.out`` (its buffers
  and the block-table sanitising are ordinary captured kernels around it); on cpu the software kernel reads
  the baked list, so a task that is not re-issued replays stale lengths exactly as the device would, and
  reads only the blocks those lengths need. CUDA graphs cannot re-issue a task, so on cuda decode reads the
  device lengths instead. ``decode_mode="dense"`` keeps the gathered path: a
  :data:`~graphbuf.TaskKind.CUSTOM` task over the whole allocation with device lengths and no host arguments.
* Verify (``q_len = 1 + num_speculative_tokens`` tokens per request) is a
  :data:`~graphbuf.TaskKind.SPEC_VERIFY_ATTENTION` task with no host arguments: the causal mask is built
  on the device from the ``seq_lens`` buffer, whose address never changes. With nothing to re-issue, an NPU
  graph captures it as ordinary kernels (no task group).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graphbuf.buffers.slab import StaticBuffers
from graphbuf.graphs.runner import OVERSIZE, Step
from graphbuf.graphs.tasks import TaskKind

from ..kernels import attention as kernels
from .large_head import (
    DEFAULT_CHUNK_BLOCKS,
    decode_attention,
    decode_into,
    verify_attention,
    verify_attention_blockwise,
)

__all__ = ["Gemma4AttentionTask", "LargeHeadBinding", "decode_task", "verify_task"]

VERIFY_MODES = ("dense", "blockwise")
DECODE_MODES = ("paged", "dense")


def _decode_kernel(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    seq_lens_kv: list[int],
) -> None:
    # Software paged decode with the NPU kernel's contract: KV lengths come from the host list baked at
    # capture, and only the blocks they need are read.
    decode_into(
        query, key_cache, value_cache, block_table, seq_lens, out, seq_lens_kv=seq_lens_kv, scale=scale
    )


def _dense_decode_kernel(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
) -> None:
    # decode_mode "dense": gather the whole allocation, mask with the device lengths; no host arguments.
    out.copy_(decode_attention(query, key_cache, value_cache, block_table, seq_lens, scale))


def _verify_kernel(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    q_len: int,
    scale: float,
    mode: str,
    chunk_blocks: int,
) -> None:
    if mode == "blockwise":
        result = verify_attention_blockwise(
            query, key_cache, value_cache, block_table, seq_lens, q_len, scale, chunk_blocks
        )
    else:
        result = verify_attention(query, key_cache, value_cache, block_table, seq_lens, q_len, scale)
    out.copy_(result)


class LargeHeadBinding:
    """Binds large-head attention of the layers of one KV ``group`` to graphbuf buffers.

    Args:
        group: the KV group whose ``block_table.<group>`` the layers read (``seq_lens`` is shared).
        q_len: verify query length per request (``tokens_per_request``).
        scale: softmax scale, required: the model's own (Gemma4: 1.0, q and k RMS-normed), never a guess
            from the head size (``1/sqrt(512)`` is 22.6× off Gemma4's).
        verify_mode: ``"dense"`` (paged KV gathered to dense BNSD) or ``"blockwise"`` (chunked online softmax,
            workspace bounded by ``chunk_blocks``).
        decode_mode: ``"paged"`` (paged kernel, host KV lengths re-issued before each replay) or ``"dense"``
            (the whole allocation gathered to dense BNSD, device lengths).
    """

    def __init__(
        self,
        *,
        group: str | None = "full",
        q_len: int,
        scale: float,
        verify_mode: str = "dense",
        chunk_blocks: int = DEFAULT_CHUNK_BLOCKS,
        decode_mode: str = "paged",
    ) -> None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
            raise ValueError(f"scale {scale!r}: must be a finite number > 0 (the model's softmax scale)")
        if verify_mode not in VERIFY_MODES:
            raise ValueError(f"verify_mode {verify_mode!r}; allowed: {', '.join(VERIFY_MODES)}")
        if decode_mode not in DECODE_MODES:
            raise ValueError(f"decode_mode {decode_mode!r}; allowed: {', '.join(DECODE_MODES)}")
        self.decode_mode = decode_mode
        self.group = group
        self.q_len = q_len
        self.scale = float(scale)
        self.verify_mode = verify_mode
        self.chunk_blocks = chunk_blocks

    def block_table(self, views: Mapping[str, torch.Tensor]) -> torch.Tensor:
        key = f"block_table.{self.group}" if self.group else "block_table"
        return views[key] if key in views else views["block_table"]

    def decode(
        self,
        step: Step,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """One layer's decode: ``query``/``out`` static ``[>= B, Nq, D]``; returns ``out[:B]``."""
        bt = self.block_table(step.views)
        lens = step.views["seq_lens"]
        b = bt.shape[0]
        if kernels.uses_npu_kernels(query) and self.decode_mode != "dense":
            return self._decode_npu(step, query[:b], key_cache, value_cache, bt, lens, out[:b])
        # Dense, and paged on cuda (a CUDA graph re-issues no task): device lengths, no host arguments.
        if self.decode_mode == "dense" or query.device.type == "cuda":
            kind = TaskKind.CUSTOM if self.decode_mode == "dense" else TaskKind.ATTENTION
            kernel = functools.partial(_dense_decode_kernel, scale=self.scale)
            step.task(kind, kernel, query[:b], key_cache, value_cache, bt, lens, out[:b])
            return out[:b]
        step.task(
            TaskKind.ATTENTION, _decode_kernel, query[:b], key_cache, value_cache, bt, lens, out[:b],
            scale=self.scale, seq_lens_kv=[0] * b,
        )  # fmt: skip
        return out[:b]

    def _decode_npu(
        self,
        step: Step,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """NPU decode: sanitising, buffers and the copy into ``out`` are ordinary captured kernels; the task
        (re-issued with fresh ``seq_lens_kv``) is the one FIA ``.out`` call."""

        def issue(fn: Any, *tensors: torch.Tensor, seq_lens_kv: list[int], scale: float) -> object:
            return step.task(TaskKind.ATTENTION, fn, *tensors, seq_lens_kv=seq_lens_kv, scale=scale)

        b = block_table.shape[0]
        # The lengths here only fix the list's form; step.task takes the step's own ATTENTION host arguments.
        lens = [int(n) for n in step.host_args.get(TaskKind.ATTENTION.value, {}).get("seq_lens_kv", [0] * b)]
        return decode_into(
            query, key_cache, value_cache, block_table, seq_lens, out, seq_lens_kv=lens, scale=self.scale,
            issue=issue,
        )  # fmt: skip
        return out

    def verify(
        self,
        step: Step,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """One layer's MTP verify: ``query``/``out`` static ``[>= B * q_len, Nq, D]``; returns live rows."""
        bt = self.block_table(step.views)
        lens = step.views["seq_lens"]
        rows = bt.shape[0] * self.q_len
        # Its settings are bound into the function, not host arguments: nothing here is re-issued.
        kernel = functools.partial(
            _verify_kernel, q_len=self.q_len, scale=self.scale, mode=self.verify_mode,
            chunk_blocks=self.chunk_blocks,
        )  # fmt: skip
        step.task(
            TaskKind.SPEC_VERIFY_ATTENTION, kernel, query[:rows], key_cache, value_cache, bt, lens, out[:rows]
        )
        return out[:rows]

    @staticmethod
    def host_args(capture_requests: int, seq_lens: Sequence[int] | Any) -> dict[str, dict[str, Any]]:
        """Fresh host arguments for the decode tasks: live KV lengths padded with 0 to the graph's batch."""
        lens = [int(n) for n in seq_lens]
        return {TaskKind.ATTENTION.value: {"seq_lens_kv": lens + [0] * (capture_requests - len(lens))}}


class Gemma4AttentionTask:
    """A drill task: decode or verify attention over ``layers`` full-attention layers of one KV group.

    Geometry is per rank (``num_heads`` query and ``num_kv_heads`` KV heads of ``head_dim``). Each layer owns
    its KV cache as vLLM lays it out, one ``[2, num_blocks, block_size, Nkv, D]`` tensor, ``[0]`` K and
    ``[1]`` V: Gemma4's ``attention_k_eq_v`` global layers share the K projection, but K is normed and
    rotated and V only normed, so the kernels still read two different caches. ``scale`` is the softmax
    scale (Gemma4: 1.0, q and k being RMS-normed; the spec's task options state it). Full-attention layers
    have no sliding window. All layers share the query and the group's buffers. Returns
    ``[rows, layers, Nq, D]``.
    """

    def __init__(
        self,
        name: str,
        *,
        mode: str,
        group: str | None = "full",
        layers: int = 2,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str = "float32",
        scale: float = 1.0,
        verify_mode: str = "dense",
        chunk_blocks: int = DEFAULT_CHUNK_BLOCKS,
        decode_mode: str = "paged",
    ) -> None:
        if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < scale < math.inf):
            raise ValueError(f"scale {scale!r}: must be a finite number > 0")
        self.scale = float(scale)
        if mode not in ("decode", "verify"):
            raise ValueError(f"mode {mode!r}; allowed: decode, verify")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.name, self.mode, self.group, self.layers = name, mode, group, layers
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype = getattr(torch, dtype)
        self.verify_mode, self.chunk_blocks, self.decode_mode = verify_mode, chunk_blocks, decode_mode
        self.output_rows = "requests" if mode == "decode" else "tokens"

    def _shapes(self, p: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(one layer's KV cache shape, the query's shape) under plan ``p``."""
        block_size = int(p.constants["block_size"])
        num_blocks = int(p.constants["num_blocks"])
        tokens = p.capture_sizes[-1]
        max_rows = OVERSIZE * (tokens if self.mode == "verify" else tokens // p.tokens_per_request)
        kv = (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return kv, (max_rows, self.num_heads, self.head_dim)

    def bind_bytes(self, p: Any) -> int:
        """Bytes :meth:`bind` allocates under plan ``p`` (KV caches, query, outputs), before it does."""
        kv, query = self._shapes(p)
        return (self.layers * (math.prod(kv) + math.prod(query)) + math.prod(query)) * self.dtype.itemsize

    def bind(self, buffers: StaticBuffers, generator: torch.Generator) -> None:
        p = buffers.plan
        self.binding = LargeHeadBinding(
            group=self.group, q_len=p.tokens_per_request, scale=self.scale,
            verify_mode=self.verify_mode, chunk_blocks=self.chunk_blocks, decode_mode=self.decode_mode,
        )  # fmt: skip
        self.capture_requests = {s: s // p.tokens_per_request for s in p.capture_sizes}
        dev = buffers.device
        kv_shape, query_shape = self._shapes(p)
        #: One [2, num_blocks, block_size, Nkv, D] tensor per layer, as vLLM allocates it: [0] K, [1] V.
        self.kv_caches = [torch.empty(kv_shape, dtype=self.dtype, device=dev) for _ in range(self.layers)]
        self.key_caches = [kv[0] for kv in self.kv_caches]
        self.value_caches = [kv[1] for kv in self.kv_caches]
        self.query = torch.empty(query_shape, dtype=self.dtype, device=dev)
        self.outs = [torch.zeros_like(self.query) for _ in range(self.layers)]
        for t in (*self.key_caches, *self.value_caches, self.query):
            _fill_randn(t, generator)
        self._changed: list[tuple[torch.Tensor, torch.Tensor]] = []  # (block view, its content at bind)

    def randomize(self, live_requests: int, generator: torch.Generator) -> None:
        """New query values and one new KV block per layer, in place (addresses never change). The block
        the previous call changed is restored first, so the inputs depend only on the bind and on this
        call's generator state: a saved drill batch replays with the KV it failed with."""
        for view, saved in self._changed:
            view.copy_(saved)
        self._changed.clear()
        _fill_randn(self.query, generator)
        for cache in (*self.key_caches, *self.value_caches):
            view = cache[int(torch.randint(0, cache.shape[0], (1,), generator=generator))]
            self._changed.append((view, view.clone()))
            _fill_randn(view, generator)

    def __call__(self, step: Step) -> torch.Tensor:
        run = self.binding.decode if self.mode == "decode" else self.binding.verify
        outs = [
            run(step, self.query, k, v, o) for k, v, o in zip(self.key_caches, self.value_caches, self.outs)
        ]
        return torch.stack(outs, dim=1)

    def host_args(self, size: int, live: int, sources: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        if self.mode != "decode" or self.decode_mode == "dense" or self.query.device.type == "cuda":
            return {}  # verify and dense decode have no host arguments; cuda decode reads device lengths
        requests = self.capture_requests.get(size, live)
        return self.binding.host_args(requests, sources["seq_lens"])


def _fill_randn(t: torch.Tensor, generator: torch.Generator) -> None:
    t.copy_(torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.dtype))


def decode_task(name: str, **options: Any) -> Gemma4AttentionTask:
    """Spec task factory (``graphbuf.adapters.vllm_ascend.bindings.attention_tasks:decode_task``): decode
    attention."""
    return Gemma4AttentionTask(name, mode="decode", **options)


def verify_task(name: str, **options: Any) -> Gemma4AttentionTask:
    """Spec task factory (``graphbuf.adapters.vllm_ascend.bindings.attention_tasks:verify_task``): MTP verify
    attention."""
    return Gemma4AttentionTask(name, mode="verify", **options)
