""":data:`KERNEL`: the C kernel ``graphbuf.buffers._native`` (``_native.c``, ``_staged.c``), or None without a
C compiler or with ``GRAPHBUF_NATIVE=0`` set at import; :func:`graphbuf.buffers.backend.chosen` reads it."""

from __future__ import annotations

import contextlib
import os
from types import ModuleType

__all__ = ["KERNEL"]

KERNEL: ModuleType | None = None
if os.environ.get("GRAPHBUF_NATIVE", "1") != "0":
    with contextlib.suppress(ImportError):
        from graphbuf.buffers import _native as KERNEL
