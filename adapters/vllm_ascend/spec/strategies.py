"""Batch relations of the adapter's drill tasks (``decode_task``, ``verify_task``): what vLLM's attention
metadata guarantees and a spec cannot state.

Registered as :attr:`graphbuf.spec.factories.TaskFactory.strategy` of both tasks; :mod:`graphbuf.testing` and
``graphbuf drill`` draw their batches through it. Needs Hypothesis (the ``test`` extra); the plugin and the
patch never import this module.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from graphbuf.planning.planner import Plan
from graphbuf.testing import as_source, paged_kv

__all__ = ["vllm_decode_batch"]


def vllm_decode_batch(p: Plan, size: int, live: int) -> st.SearchStrategy[dict[str, Any]]:
    """A uniform decode batch as vLLM's model runner builds it for ``live`` requests of ``q_len =
    tokens_per_request`` tokens each: ``seq_lens`` and one ``block_table.<group>`` per KV group (block
    tables wide enough for ``cdiv(seq_len, block_size)``, see :func:`graphbuf.testing.paged_kv`),
    ``query_start_loc = [0, q_len, 2 q_len, ...]`` and ``slot_mapping.<group>``: the cache slot of each new
    token, the last ``q_len`` positions of its request, through its group's block table."""
    return paged_kv(p, size, live).map(lambda src: _with_offsets(p, live, src))


def _with_offsets(p: Plan, live: int, src: dict[str, Any]) -> dict[str, Any]:
    out = dict(src)
    tpr = p.tokens_per_request
    bs = int(p.constants.get("block_size") or 16)
    if "query_start_loc" in p.names:
        out["query_start_loc"] = as_source(p["query_start_loc"], np.arange(live + 1) * tpr)
    if "seq_lens" not in src:
        return out
    lens = np.asarray(src["seq_lens"], dtype=np.int64)
    tables = {p[name].group: np.asarray(src[name]) for name in src if p[name].spec_name == "block_table"}
    if not tables:
        return out
    req = np.repeat(np.arange(live), tpr)
    pos = np.repeat(lens - tpr, tpr) + np.tile(np.arange(tpr), live)
    for b in p.buffers:
        if b.spec_name != "slot_mapping":
            continue
        table = tables.get(b.group, next(iter(tables.values())))
        slots = np.where(pos >= 0, table[req, np.maximum(pos, 0) // bs].astype(np.int64) * bs + pos % bs, -1)
        out[b.name] = as_source(b, slots)
    return out
