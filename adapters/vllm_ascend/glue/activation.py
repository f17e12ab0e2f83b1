"""What the patch decided when it was applied, once per process, and the one INFO line that says so.

:class:`Activation` holds the update mechanism (``upstream.detect_mechanism``), whether upstream routes
512-dim decode itself (``upstream.upstream_large_head``) and which of the two owns those layers
(:func:`large_head_owner`). ``patch.apply`` sets it (:func:`set_current`) before it changes anything and
``patch.unpatch`` clears it; the routing policy reads it (:func:`current`).

:func:`announce` logs the activation line through vLLM's logger (``vllm.logger.init_logger``, a logger under
``vllm.`` so vLLM's handler and ``VLLM_LOGGING_LEVEL`` apply; INFO is shown by default), once per process.
This module imports only the standard library and ``upstream`` at import time.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from .upstream import Mechanism, UpstreamError

__all__ = [
    "LOGGER_NAME",
    "OWNERS",
    "OWNER_ENV",
    "Activation",
    "announce",
    "clear",
    "current",
    "large_head_owner",
    "set_current",
]

OWNER_ENV = "GRAPHBUF_LARGE_HEAD_OWNER"
"""Who routes the 512-dim full-attention layers: ``graphbuf`` or ``upstream``. Unset: ``upstream`` when the
running vllm-ascend has its own large-head route (its ``FIABnsdLargeHeadParamProvider``), else
``graphbuf``. So graphbuf never takes a layer upstream handles unless asked to. ``upstream`` with no
upstream large-head route leaves those layers on vllm-ascend's generic path (graphbuf routes nothing)."""

OWNERS = ("graphbuf", "upstream")

LOGGER_NAME = "vllm.plugins.graphbuf_vllm_ascend"
"""The activation line's logger: under ``vllm.``, so vLLM's logging configuration shows it."""


@dataclass(frozen=True)
class Activation:
    """The patch's decision: ``mechanism`` and its ``evidence`` (what of the surface decided it),
    ``upstream_large_head`` (what of upstream's own large-head route exists, or None), ``owner`` of the
    large-head layers (``"graphbuf"`` or ``"upstream"``) and why (``owner_reason``)."""

    mechanism: Mechanism
    evidence: str
    upstream_large_head: str | None
    owner: str
    owner_reason: str

    @property
    def graphbuf_routes(self) -> bool:
        """graphbuf takes the large-head layers (rule 1 of ``routing.py`` still decides which)."""
        return self.owner == "graphbuf"

    def describe(self) -> str:
        """The mechanism, the routed layers and their owner, in one sentence."""
        how = {
            Mechanism.LEGACY: "graphbuf re-issues its tasks from update_graph_params",
            Mechanism.UPDATABLE: "graphbuf's tasks are registered with the graph through register_task",
        }[self.mechanism]
        layers = "512-dim full-attention layers without sliding window under FULL_DECODE_ONLY"
        if self.graphbuf_routes:
            routes = f"graphbuf routes the {layers}; upstream owns every other layer"
        else:
            routes = f"graphbuf routes no layer; upstream owns every layer, the {layers} included"
        return (
            f"update mechanism {self.mechanism.value} ({self.evidence}; {how}); {routes} "
            f"(large-head owner {self.owner}: {self.owner_reason})"
        )


def large_head_owner(
    upstream_large_head: str | None, environ: Mapping[str, str] = os.environ
) -> tuple[str, str]:
    """``(owner, reason)`` from ``OWNER_ENV`` and upstream's large-head route (module docstring of
    ``OWNER_ENV``). :class:`UpstreamError` naming the variable for a value other than ``OWNERS``."""
    raw = environ.get(OWNER_ENV, "")
    value = raw.strip().lower()
    if value and value not in OWNERS:
        raise UpstreamError(f"{OWNER_ENV}={raw!r} is not one of {', '.join(OWNERS)}; nothing was patched")
    seen = (
        f"upstream has {upstream_large_head}" if upstream_large_head else "upstream has no large-head route"
    )
    if value:
        return value, f"{OWNER_ENV}={value}; {seen}"
    if upstream_large_head:
        return "upstream", f"{seen}; {OWNER_ENV} unset (set it to graphbuf to route them with graphbuf)"
    return "graphbuf", f"{seen}; {OWNER_ENV} unset"


_lock = threading.Lock()
_current: Activation | None = None
_announced = False


def set_current(activation: Activation) -> None:
    """Record the patch's decision (``patch.apply``)."""
    global _current
    _current = activation


def clear() -> None:
    """Forget the decision (``patch.unpatch``)."""
    global _current
    _current = None


def current() -> Activation | None:
    """The patch's decision, or None when the patch is not applied."""
    return _current


def announce(line: str) -> bool:
    """Log ``line`` at INFO through vLLM's logger, the first time in the process; True if it logged."""
    global _announced
    with _lock:
        if _announced:
            return False
        _announced = True
    _logger().info("graphbuf vllm-ascend plugin: %s", line)
    return True


def _logger() -> logging.Logger:
    try:
        from vllm.logger import init_logger  # lazily: importing this module stays standard-library only
    except Exception:  # vLLM absent or broken: the standard logger under the same name
        return logging.getLogger(LOGGER_NAME)
    return init_logger(LOGGER_NAME)
