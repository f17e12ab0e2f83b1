"""The C kernel: :data:`KERNEL` is ``graphbuf.buffers._native`` (``_native.c``, ``_staged.c``), or None when
the install had no C compiler or ``GRAPHBUF_NATIVE=0`` was set before import. Only
:func:`graphbuf.buffers.backend.chosen` reads it."""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["KERNEL"]


def _load() -> ModuleType | None:
    if os.environ.get("GRAPHBUF_NATIVE", "1") == "0":
        return None
    try:
        from graphbuf.buffers import _native
    except ImportError:
        return None
    return _native


KERNEL = _load()
