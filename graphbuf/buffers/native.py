"""The C kernel: :data:`KERNEL` is ``graphbuf.buffers._native`` (``_native.c``, ``_staged.c``), or None when
the install had no C compiler or ``GRAPHBUF_NATIVE=0`` was set before import. Only
:func:`graphbuf.buffers.backend.chosen` reads it."""

from __future__ import annotations

import contextlib
import os
from types import ModuleType

__all__ = ["KERNEL"]

KERNEL: ModuleType | None = None
if os.environ.get("GRAPHBUF_NATIVE", "1") != "0":
    with contextlib.suppress(ImportError):
        from graphbuf.buffers import _native as KERNEL
