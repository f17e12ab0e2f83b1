"""Per-step reads and workspaces of the large-head attention routes, as host arithmetic (no torch).

One formula serves ``large_head.verify_workspace_bytes`` and the ``graphbuf plan`` cost hooks of
``task_options`` (:func:`decode_costs`, :func:`verify_costs`). Routes and what they read per layer call:

* decode ``paged``: the paged fused-infer kernel reads each request's blocks up to its host KV length
  (``ceil(context / block_size)`` blocks) and materializes only the sanitized block table;
* decode ``dense`` / verify ``dense``: the whole allocation (``W * block_size`` keys per request) gathered to
  dense BNSD K and V, whatever the live context;
* verify ``blockwise``: visits every chunk of the allocation (no data-dependent skip inside a graph), so it
  reads ``W * block_size`` keys too, but materializes one chunk at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from graphbuf.spec.factories import RouteCost

__all__ = [
    "ITEMSIZE",
    "decode_costs",
    "paged_decode_workspace_bytes",
    "verify_costs",
    "verify_workspace_bytes",
]

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_F32 = 4


def verify_workspace_bytes(
    batch: int,
    q_len: int,
    width: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    itemsize: int,
    chunk_blocks: int,
    num_heads: int,
) -> dict[str, int]:
    """Peak intermediate bytes of the gather paths, keyed ``"dense"`` and ``"blockwise"`` (see
    ``large_head.verify_workspace_bytes``, which validates the arguments and calls this)."""
    table = paged_decode_workspace_bytes(batch, width)  # every route sanitizes the table first
    query_side = batch * num_heads * q_len * head_dim
    keys = width * block_size
    dense = (
        table
        + batch * num_kv_heads * keys * 8  # flat row index (shared by K and V)
        + 2 * batch * num_kv_heads * keys * head_dim * itemsize  # gathered K and V, BNSD
        + batch * q_len * keys  # bool mask
        + 2 * query_side * itemsize  # query and output in BNSD
    )
    chunk = min(chunk_blocks, width) * block_size
    cast = 0 if itemsize == _F32 else batch * num_kv_heads * chunk * head_dim * _F32
    blockwise = (
        table
        + batch * num_kv_heads * chunk * 8  # flat row index of one chunk
        + 2 * batch * num_kv_heads * chunk * head_dim * itemsize  # gathered K and V chunk
        + cast  # a float32 copy of one of them
        + batch * num_heads * q_len * chunk * _F32  # scores, turned into probabilities in place
        + batch * q_len * chunk  # bool mask of one chunk
        + query_side * (itemsize + _F32)  # query BNSD and its scaled float32 copy
        + 3 * query_side * _F32  # accumulator, its update and the normalized output
        + 4 * batch * num_heads * q_len * _F32  # running max, sum, new max, rescale
        + query_side * itemsize  # output in the query dtype
    )
    return {"dense": dense, "blockwise": blockwise}


def paged_decode_workspace_bytes(batch: int, width: int) -> int:
    """Bytes the paged decode route materializes besides the kernel: the sanitized block table (an int64
    working copy and the int32 ids), which the gather routes make too."""
    return batch * width * (8 + 4)


def _geometry(options: Any, env: Mapping[str, int | None], context: int | None) -> dict[str, int]:
    block_size = int(env["block_size"] or 0)
    width = int(env.get("max_blocks_per_seq") or -(-int(env["max_model_len"] or 0) // block_size))
    capacity = width * block_size
    live = capacity if context is None else max(0, min(int(context), capacity))
    layers = env.get("num_full_layers") or options.layers
    return {
        "block_size": block_size,
        "width": width,
        "capacity": capacity,
        "context": live,
        "layers": int(layers),
        "requests": int(env["requests"] or 0),
        "tpr": int(env["tokens"] or 0) // max(1, int(env["requests"] or 1)),
        "item": ITEMSIZE[options.dtype],
    }


def _kv_bytes(options: Any, g: Mapping[str, int], keys_per_request: int) -> int:
    """K and V bytes read per step: ``keys_per_request`` keys of every request, every KV head and layer."""
    per_key = 2 * options.num_kv_heads * options.head_dim * g["item"]
    return g["layers"] * g["requests"] * keys_per_request * per_key


def decode_costs(options: Any, env: Mapping[str, int | None], context: int | None) -> list[RouteCost]:
    """Cost hook of ``decode_task``: the ``paged`` and ``dense`` decode routes at one capture size."""
    g = _geometry(options, env, context)
    paged_keys = -(-g["context"] // g["block_size"]) * g["block_size"]
    dense_ws = verify_workspace_bytes(g["requests"], 1, g["width"], g["block_size"], options.num_kv_heads,
                                      options.head_dim, g["item"], 1, options.num_heads)["dense"]  # fmt: skip
    rows = {
        "paged": (_kv_bytes(options, g, paged_keys), paged_decode_workspace_bytes(g["requests"], g["width"])),
        "dense": (_kv_bytes(options, g, g["capacity"]), dense_ws),
    }
    return [
        RouteCost("decode", mode, options.decode_mode == mode, read, ws, g["layers"], g["context"])
        for mode, (read, ws) in rows.items()
    ]


def verify_costs(options: Any, env: Mapping[str, int | None], context: int | None) -> list[RouteCost]:
    """Cost hook of ``verify_task``: the ``blockwise`` and ``dense`` verify routes at one capture size."""
    g = _geometry(options, env, context)
    ws = verify_workspace_bytes(
        g["requests"], g["tpr"], g["width"], g["block_size"], options.num_kv_heads, options.head_dim,
        g["item"], options.chunk_blocks, options.num_heads,
    )  # fmt: skip
    read = _kv_bytes(options, g, g["capacity"])  # both visit the whole allocation
    return [
        RouteCost("verify", mode, options.verify_mode == mode, read, ws[mode], g["layers"], g["context"])
        for mode in ("blockwise", "dense")
    ]
