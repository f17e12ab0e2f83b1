"""The call's arguments, checked once for every entry point, and the mapping front-end: ``{name: source}``,
each source validated on every call."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from graphbuf.buffers.bound import BoundSources
from graphbuf.buffers.layout import Layout
from graphbuf.buffers.validate import Prepared, check_num_reqs, live_requests
from graphbuf.errors import RefreshError

__all__ = ["prepare_mapping", "read_call"]


def read_call(
    owner: object, sources: Any, num_reqs: Any, widths: Any, label: str
) -> dict[str, Any] | BoundSources:
    """``sources`` checked against the call's other arguments: bound sources of ``owner`` (their
    StaticBuffers) need ``num_reqs``; ``widths`` applies to bound sources only. A mapping is read once, into a
    plain dict, so none of its code runs between the check of a value and its write."""
    if type(sources) is not dict:
        if isinstance(sources, BoundSources):
            if sources.buffers is not owner:
                raise RefreshError(f"{label}: these bound sources belong to other StaticBuffers")
            if num_reqs is None:
                raise RefreshError(f"{label}: bound sources carry no row counts; pass num_reqs=")
            return sources
        if not isinstance(sources, Mapping):
            raise RefreshError(
                f"{label}: sources must be a mapping of buffer name to source, or BoundSources from bind(); "
                f"got {type(sources).__name__}"
            )
        if widths is None:
            return dict(sources.items())
    if widths is not None:
        raise RefreshError(
            f"{label}: widths= applies to BoundSources; a mapping's sources carry their widths"
        )
    return sources


def prepare_mapping(
    layout: Layout,
    sources: dict[str, Any],
    size: int,
    num_reqs: Any,
    label: str,
    strict: bool,
    device: torch.device,
    required: frozenset[str] | None = None,
) -> tuple[list[Prepared], int]:
    """Every source of ``sources`` (from :func:`read_call`) validated at ``size`` tokens (a capture size, or
    any count for an eager step: then ``num_reqs`` has no upper limit), and the live count. ``required``: the
    buffers that must be given (default: all but ``keep: true`` ones; a refresh leaves staged buffers out)."""
    if num_reqs is not None:
        num_reqs = check_num_reqs(num_reqs, layout.max_requests.get(size), label, size)
    prepared, agreed = layout.backend.accept_all(layout, sources, size, num_reqs, label, strict, device)
    need = layout.required if required is None else required
    if not need.issubset(sources):
        raise layout.missing_error(label, layout.required.difference(need).union(sources))
    return prepared, num_reqs if agreed else live_requests(layout, prepared, size, num_reqs, label)
