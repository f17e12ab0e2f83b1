"""Refresh: write live sources into captured buffers, validated first, at a cost that follows the live work.

Modules, top-down:
  * :mod:`~graphbuf.buffers.layout`: every buffer resolved once (dtype, pad, capacity per size, bounds);
  * :mod:`~graphbuf.buffers.native`: the optional C kernel of the value check (validate) and the live-row
    write (commit), with numpy as the reference and the fallback;
  * :mod:`~graphbuf.buffers.validate`: pure validation of one source (and of ``num_reqs``/``widths``);
  * :mod:`~graphbuf.buffers.commit`: staging and commit, the only code that writes buffers or the device;
  * :mod:`~graphbuf.buffers.bound` and :mod:`~graphbuf.buffers.mapping`: the two front-ends (mapping also
    holds :func:`read_call`, the checks of a call's arguments every entry point shares);
  * :mod:`~graphbuf.buffers.eager`: fresh padded inputs for steps above the largest capture size;
  * :mod:`~graphbuf.buffers.staged`: staged writes, committed by checking and writing only changed cells.

:meth:`graphbuf.StaticBuffers.refresh` is the one entry point that composes them (prepare, then commit); a
refresh validates every source before any write, so one that raises changes no byte.
"""

from __future__ import annotations

from graphbuf.buffers.backend import Backend, NativeBackend, chosen
from graphbuf.buffers.bound import BoundSources
from graphbuf.buffers.commit import Committer, RefreshStats, write_live
from graphbuf.buffers.eager import build_eager
from graphbuf.buffers.layout import Layout, where
from graphbuf.buffers.mapping import prepare_mapping, read_call
from graphbuf.buffers.staged import StagedBuffer, StagedWrites
from graphbuf.buffers.validate import Prepared, Source, check_num_reqs, count_of, requests_hint

__all__ = [
    "Backend",
    "BoundSources",
    "Committer",
    "Layout",
    "NativeBackend",
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
    "write_live",
]
