"""Refresh: write live sources into captured buffers, every source validated before any byte is written (a
refresh that raises changes no byte), at a cost that follows the live work.

Modules: ``layout`` (every buffer resolved once), ``validate`` (pure checks), ``mapping`` (with
:func:`read_call`, the checks every entry point shares) and ``bound`` (the front-ends), ``staged`` (staged
writes), ``backend`` (numpy or the C kernel of ``native``, chosen once), ``commit`` (the only code that writes
buffers), ``eager`` (inputs above the largest capture size); ``slab``: :class:`graphbuf.StaticBuffers`."""

from __future__ import annotations

from graphbuf.buffers.bound import BoundSources
from graphbuf.buffers.commit import RefreshStats
from graphbuf.buffers.mapping import read_call
from graphbuf.buffers.staged import StagedBuffer
from graphbuf.buffers.validate import Source, check_num_reqs, requests_hint

__all__ = [
    "BoundSources",
    "RefreshStats",
    "Source",
    "StagedBuffer",
    "check_num_reqs",
    "read_call",
    "requests_hint",
]
