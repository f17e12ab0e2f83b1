"""The coverage certificate: which uniform decode batches of the serving envelope replay a captured graph.

A uniform decode batch of ``r`` requests has ``r * tokens_per_request`` tokens. It replays the graph of the
smallest capture size that holds it, padding the rest (waste = padded tokens / capture size); a batch above
the largest capture size runs eagerly. The envelope is ``capture.max_requests`` (e.g. ``max_num_seqs``),
capped by ``max_num_batched_tokens`` when the spec declares it. Pure arithmetic: no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from graphbuf.spec.expr import parse_expr
from graphbuf.spec.models import GraphSpec, capture_sizes_of

__all__ = ["Batch", "Coverage", "coverage", "spec_coverage"]


@dataclass(frozen=True)
class Batch:
    """One reachable uniform decode batch and where it runs (``capture_size`` None: eagerly)."""

    requests: int
    tokens: int
    capture_size: int | None

    @property
    def waste(self) -> float:
        """Padded share of the replayed graph's tokens (0 for an exact fit; 0 when eager)."""
        if self.capture_size is None:
            return 0.0
        return (self.capture_size - self.tokens) / self.capture_size


@dataclass(frozen=True)
class Coverage:
    """Every reachable batch of the envelope (``max_requests`` None: the spec declares none)."""

    tokens_per_request: int
    capture_sizes: tuple[int, ...]
    max_requests: int | None
    batches: tuple[Batch, ...]

    @property
    def uncovered(self) -> tuple[Batch, ...]:
        return tuple(b for b in self.batches if b.capture_size is None)

    @property
    def ok(self) -> bool:
        """True when an envelope is declared and every batch in it replays a graph."""
        return self.max_requests is not None and not self.uncovered

    @property
    def max_waste(self) -> float:
        return max((b.waste for b in self.batches), default=0.0)

    def summary(self) -> str:
        """One line: what the capture sizes cover, what runs eagerly."""
        covered = [b for b in self.batches if b.capture_size is not None]
        if self.max_requests is None:
            top = covered[-1].requests if covered else 0
            return (
                f"coverage: no serving envelope declared (capture.max_requests); the capture sizes hold "
                f"uniform batches of 1..{top} requests"
            )
        head = f"coverage: {len(covered)}/{len(self.batches)} batch sizes of 1..{self.max_requests} requests"
        if not self.uncovered:
            return f"{head} replay a graph (max padding waste {self.max_waste:.1%})"
        lo, hi = self.uncovered[0], self.uncovered[-1]
        span = f"{lo.requests}" if lo is hi else f"{lo.requests}–{hi.requests}"
        tokens = f"{lo.tokens}" if lo is hi else f"{lo.tokens}–{hi.tokens}"
        return (
            f"{head} replay a graph; {span} requests ({tokens} tokens) run EAGERLY "
            f"(largest capture size {self.capture_sizes[-1] if self.capture_sizes else 0})"
        )

    def table(self) -> list[tuple[Any, ...]]:
        """Rows ``(requests, tokens, capture size or 'eager', waste)``."""
        return [
            (b.requests, b.tokens, b.capture_size or "eager", f"{b.waste:.1%}" if b.capture_size else "-")
            for b in self.batches
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens_per_request": self.tokens_per_request,
            "capture_sizes": list(self.capture_sizes),
            "max_requests": self.max_requests,
            "ok": self.ok,
            "max_waste": self.max_waste,
            "uncovered_requests": [b.requests for b in self.uncovered],
            "batches": [
                {"requests": b.requests, "tokens": b.tokens, "capture_size": b.capture_size, "waste": b.waste}
                for b in self.batches
            ],
        }


def coverage(
    capture_sizes: Sequence[int],
    tokens_per_request: int,
    max_requests: int | None,
    max_tokens: int | None = None,
) -> Coverage:
    """Where each batch of 1..``max_requests`` requests (at most ``max_tokens`` tokens) runs.

    Without an envelope, the batches listed are those the capture sizes hold."""
    sizes = tuple(sorted(set(capture_sizes)))
    top = max_requests if max_requests is not None else (sizes[-1] // tokens_per_request if sizes else 0)
    if max_tokens is not None:
        top = min(top, max_tokens // tokens_per_request)
    batches = []
    for r in range(1, top + 1):
        tokens = r * tokens_per_request
        i = bisect.bisect_left(sizes, tokens)
        batches.append(Batch(r, tokens, sizes[i] if i < len(sizes) else None))
    return Coverage(tokens_per_request, sizes, max_requests, tuple(batches))


def spec_coverage(spec: GraphSpec, constants: Mapping[str, int | None]) -> Coverage:
    """The coverage of a checked spec with its resolved ``constants``."""
    tpr = parse_expr(spec.capture.tokens_per_request).eval(constants)
    max_requests = None
    if spec.capture.max_requests is not None:
        expr = parse_expr(spec.capture.max_requests)
        if all(constants.get(n) is not None for n in expr.names):
            max_requests = expr.eval(constants)
    return coverage(capture_sizes_of(spec), tpr, max_requests, constants.get("max_num_batched_tokens"))
