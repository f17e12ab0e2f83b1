"""The native backend, when it was built: one extension, ``graphbuf.buffers._native``, from ``_native.c``
and ``_staged.c``.

:data:`KERNEL` is the compiled module, or None: the install had no C compiler, or ``GRAPHBUF_NATIVE=0``
was set before import. Either way a refresh writes the same bytes and raises the same errors; the kernel
only turns the per-source checks and the live-row write into one C call each instead of several Python and
numpy calls. Its functions:

* ``fit(arr, rows, width, lo, hi)``: True/False when the values of the live region lie within
  ``lo..hi``; None when it does not check that dtype (floats: NaN) — the numpy check decides then;
* ``accept(arr, ndim, cap_rows, cap_cols, lo, hi)``: ``(rows, width)`` of a whole integer source that
  needs no more checks (layout, capacity, values); None otherwise — the general path then accepts it,
  clips it or names what is wrong;
* ``write(targets, items, ends, pads, rows_of, cols_of)``: :func:`graphbuf.buffers.commit.write_live`
  for every item, resolved and range-checked before the first byte is written; None, with nothing
  written, when an item needs a cast it does not do, a source is misaligned, or a source shares bytes
  with a buffer the write touches (the numpy write handles those).

The same module's staged half (:data:`STAGED`; ``_staged.c``) holds a staged buffer's host state and changed
cells in C: its write methods take plain arguments without a Python check, ``commit`` checks and writes a
refresh's staged cells, and ``pack`` packs a refresh's writes for one upload (see the header of
``_staged.c``). The Python host state writes the same bytes and raises the same errors.
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["KERNEL", "STAGED"]


def _load() -> tuple[ModuleType | None, ModuleType | None]:
    if os.environ.get("GRAPHBUF_NATIVE", "1") == "0":
        return None, None
    try:
        from graphbuf.buffers import _native
    except ImportError:
        return None, None
    return _native, _native


#: The compiled backend as the refresh kernel (:data:`KERNEL`) and as the staged writes' host state and
#: packer (:data:`STAGED`: ``Staged``, ``commit``, ``pack``): the same module, or None (the numpy path;
#: the Python host state of :mod:`graphbuf.buffers.staged`). :class:`graphbuf.StaticBuffers` reads both
#: once, when it is built (its backend: ``layout.kernel``, its committer's packer and its staging area's
#: host-state kind); nothing else reads them.
KERNEL, STAGED = _load()
