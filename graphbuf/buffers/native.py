"""The C kernel, when it was built: one extension, ``graphbuf.buffers._native``, from ``_native.c`` (the value
check and the live-row write) and ``_staged.c`` (the staged host state, its commit and the upload packer).

:data:`KERNEL` is that module, or None: the install had no C compiler, or ``GRAPHBUF_NATIVE=0`` was set
before import. Only :func:`graphbuf.buffers.backend.chosen` reads it, when buffers are built.
"""

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
