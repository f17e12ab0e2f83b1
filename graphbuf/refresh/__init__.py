"""Refresh: write live sources into captured buffers, validated first, at a cost that follows the live work.

Modules, top-down:
  * :mod:`~graphbuf.refresh.layout`: every buffer resolved once (dtype, pad, capacity per size, bounds);
  * :mod:`~graphbuf.refresh.native`: the optional C kernel of the value check (validate) and the live-row
    write (commit), with numpy as the reference and the fallback;
  * :mod:`~graphbuf.refresh.validate`: pure validation of one source (and of ``num_reqs``/``widths``);
  * :mod:`~graphbuf.refresh.commit`: staging and commit, the only code that writes buffers or the device;
  * :mod:`~graphbuf.refresh.mapping` and :mod:`~graphbuf.refresh.bound`: the two front-ends, peers;
  * :mod:`~graphbuf.refresh.eager`: fresh padded inputs for steps above the largest capture size;
  * :mod:`~graphbuf.refresh.staged`: staged writes, committed by checking and writing only changed cells.

:class:`graphbuf.StaticBuffers` composes them; a refresh validates every source before any write, so one
that raises changes no byte.
"""

from __future__ import annotations

from graphbuf.refresh.bound import BoundSources
from graphbuf.refresh.commit import Committer, RefreshStats, write_live
from graphbuf.refresh.eager import build_eager
from graphbuf.refresh.layout import Layout, where
from graphbuf.refresh.mapping import prepare_mapping
from graphbuf.refresh.staged import StagedBuffer, StagingArea
from graphbuf.refresh.validate import Source, check_num_reqs, count_of

__all__ = [
    "BoundSources",
    "Committer",
    "Layout",
    "RefreshStats",
    "Source",
    "StagedBuffer",
    "StagingArea",
    "build_eager",
    "check_num_reqs",
    "count_of",
    "prepare_mapping",
    "where",
    "write_live",
]
