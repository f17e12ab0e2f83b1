"""Helpers of the ``test_pins_*`` files (issue 24: tests that pin behaviours a mutant changed unseen).

Each pin test names, in its docstring, the source line of ``main`` b2b8a44 it pins and the mutant it kills.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from graphbuf import GraphSpec, StaticBuffers
from graphbuf.buffers import native


@contextlib.contextmanager
def numpy_path() -> Iterator[None]:
    """Within the block, refreshes take the numpy path (``native.KERNEL`` None)."""
    saved = native.KERNEL
    native.KERNEL = None
    try:
        yield
    finally:
        native.KERNEL = saved


@contextlib.contextmanager
def path(kind: str) -> Iterator[None]:
    """``"numpy"``: :func:`numpy_path`; ``"kernel"``: the kernel as built (skip where it is not)."""
    if kind == "numpy":
        with numpy_path():
            yield
        return
    if native.KERNEL is None:
        import pytest

        pytest.skip("the native kernel is not built here")
    yield


def spec(buffers: dict[str, Any], *, sizes: list[int], tpr: int = 1, **constants: Any) -> GraphSpec:
    """A one-group spec of ``buffers`` captured at ``sizes`` (``tpr`` tokens per request)."""
    return GraphSpec.model_validate(
        {
            "version": 1,
            "name": "pins",
            "constants": dict(constants),
            "capture": {"tokens_per_request": tpr, "sizes": sizes},
            "buffers": buffers,
        }
    )


def buffers(bufs: dict[str, Any], *, sizes: list[int], tpr: int = 1, **kw: Any) -> StaticBuffers:
    """:class:`StaticBuffers` of :func:`spec` on the cpu (keywords go to StaticBuffers)."""
    return StaticBuffers(spec(bufs, sizes=sizes, tpr=tpr), **kw)


def contents(sb: StaticBuffers) -> dict[str, bytes]:
    """Every buffer's bytes."""
    return {name: t.numpy().tobytes() for name, t in sb.full.items()}


def tensor(sb: StaticBuffers, name: str) -> torch.Tensor:
    return sb.full[name].clone()
