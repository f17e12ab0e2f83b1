"""Refresh: write live sources into captured buffers, every source validated before any byte is written (a
refresh that raises changes no byte), at a cost that follows the live work.

Modules: ``layout`` (every buffer resolved once), ``validate`` (pure checks), ``mapping`` (with
:func:`read_call`, the checks every entry point shares) and ``bound`` (the front-ends), ``staged`` (staged
writes), ``backend`` (numpy or the C kernel of ``native``, chosen once), ``commit`` (the only code that writes
buffers), ``eager`` (inputs above the largest capture size); ``slab``: :class:`graphbuf.StaticBuffers`."""

from __future__ import annotations

from graphbuf.buffers.backend import chosen
from graphbuf.buffers.bound import BoundSources
from graphbuf.buffers.commit import Committer, RefreshStats
from graphbuf.buffers.eager import build_eager
from graphbuf.buffers.layout import Layout, where
from graphbuf.buffers.mapping import prepare_mapping, read_call
from graphbuf.buffers.staged import StagedBuffer, StagedWrites
from graphbuf.buffers.validate import Prepared, Source, check_num_reqs, count_of, requests_hint

__all__ = [
    "BoundSources",
    "Committer",
    "Layout",
    "Prepared",
    "RefreshStats",
    "Source",
    "StagedBuffer",
    "StagedWrites",
    "build_eager",
    "check_num_reqs",
    "chosen",
    "count_of",
    "prepare_mapping",
    "read_call",
    "requests_hint",
    "where",
]
