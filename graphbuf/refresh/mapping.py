"""The mapping front-end: a refresh from ``{buffer name: source}``, each source validated on every call."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from graphbuf.errors import RefreshError
from graphbuf.refresh.layout import Layout
from graphbuf.refresh.validate import Prepared, check_num_reqs, check_source, live_requests

__all__ = ["prepare_mapping"]


def prepare_mapping(
    layout: Layout,
    sources: Any,
    size: int,
    num_reqs: Any,
    label: str,
    *,
    strict: bool,
    device: torch.device,
    omit: frozenset[str] = frozenset(),
) -> tuple[list[Prepared], int]:
    """Validate every source of ``sources`` at ``size`` tokens; return them prepared and the live count.

    ``size`` is a capture size, or (eager) any token count; then ``num_reqs`` has no upper limit.
    ``omit``: buffers that may be left out (staged buffers, committed from their host state).
    """
    if not isinstance(sources, Mapping):
        raise RefreshError(
            f"{label}: sources must be a mapping of buffer name to source, or BoundSources from bind(); "
            f"got {type(sources).__name__}"
        )
    if num_reqs is not None:
        num_reqs = check_num_reqs(num_reqs, layout.max_requests.get(size), label, size)
    prepared = [
        check_source(layout, name, src, size, label, strict=strict, device=device)
        for name, src in sources.items()
    ]
    if (len(prepared) < len(layout.required) or not layout.required.issubset(sources.keys())) and (
        not omit or not layout.required.issubset(omit.union(sources.keys()))
    ):
        raise layout.missing_error(label, sources.keys())
    return prepared, live_requests(layout, prepared, size, num_reqs, label)
