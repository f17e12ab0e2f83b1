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

_KERNEL_CALLS = ("fit", "accept", "accept_all", "write")


def _kernel_used(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the native kernel ran inside numpy_path(): these buffers were built outside it")


@contextlib.contextmanager
def numpy_path() -> Iterator[None]:
    """Within the block, buffers built take the numpy backend (it is chosen when ``StaticBuffers`` is built:
    ``native.KERNEL`` None), and the kernel's functions raise: buffers built with the kernel cannot pass a
    numpy-backend check silently."""
    saved = native.KERNEL
    native.KERNEL = None
    real = {name: getattr(saved, name) for name in _KERNEL_CALLS if hasattr(saved, name)}
    for name in real:
        setattr(saved, name, _kernel_used)
    try:
        yield
    finally:
        for name, f in real.items():
            setattr(saved, name, f)
        native.KERNEL = saved


def twins(*args: Any, **kwargs: Any) -> tuple[StaticBuffers, StaticBuffers]:
    """``StaticBuffers(*args, **kwargs)`` twice: with the native kernel (as built) and on the numpy path."""
    nat = StaticBuffers(*args, **kwargs)
    with numpy_path():
        ref = StaticBuffers(*args, **kwargs)
    return nat, ref


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
