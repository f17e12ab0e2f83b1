"""``graphbuf sizes``: the fewest capture sizes that cover the serving envelope within a padding-waste bound.

Every size is a multiple of ``tokens_per_request``; the largest is the envelope's top batch. Chosen greedily
from the top (optimal for covering 1..R with intervals): a size ``S`` holds every batch of at least
``S * (1 - max_waste)`` tokens, and the next size down is the largest batch it leaves out. With a graph budget
the waste bound is the smallest one that fits the budget. :func:`write_sizes` edits a spec file's
``capture.sizes`` in place: the new list replaces exactly the old value's text (located with ruamel.yaml's
composer), so comments, key order and every other byte stay as they were.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from graphbuf.coverage import Coverage, coverage
from graphbuf.errors import SpecError
from graphbuf.spec import MAX_CAPTURE_SIZES

__all__ = ["Proposal", "propose_sizes", "render_proposal", "write_sizes"]


@dataclass(frozen=True)
class Proposal:
    """Proposed capture sizes (ascending) and the coverage they give."""

    sizes: tuple[int, ...]
    max_waste: float
    coverage: Coverage


def _greedy(top: int, tpr: int, waste: Fraction) -> list[int]:
    sizes: list[int] = []
    r = top
    while r >= 1:
        size = r * tpr
        sizes.append(size)
        lowest = max(1, math.ceil(size * (1 - waste) / tpr))  # fewest requests this size still holds
        r = min(r, lowest) - 1
    return sizes[::-1]


def propose_sizes(
    tokens_per_request: int,
    max_requests: int,
    *,
    max_waste_pct: float | None = None,
    max_graphs: int | None = None,
    max_tokens: int | None = None,
) -> Proposal:
    """The fewest sizes covering 1..``max_requests`` requests (≤ ``max_tokens`` tokens) with padding waste at
    most ``max_waste_pct`` percent, in at most ``max_graphs`` graphs. Default: 10 % waste. Raise SpecError
    when the two bounds cannot both hold."""
    if max_waste_pct is not None and not 0 <= max_waste_pct < 100:
        raise SpecError(f"--max-waste {max_waste_pct}: must be in [0, 100)")
    if max_graphs is not None and not 1 <= max_graphs <= MAX_CAPTURE_SIZES:
        raise SpecError(f"--max-graphs {max_graphs}: must be in 1..{MAX_CAPTURE_SIZES}")
    top = max_requests if max_tokens is None else min(max_requests, max_tokens // tokens_per_request)
    if top < 1:
        raise SpecError(f"the envelope holds no batch: {max_requests} requests, max {max_tokens} tokens")
    if max_graphs is None:
        waste = Fraction(str(10 if max_waste_pct is None else max_waste_pct)) / 100
        sizes = _greedy(top, tokens_per_request, waste)
    else:
        lo, hi = Fraction(0), Fraction(1)  # hi always fits: one graph holds everything
        if len(_greedy(top, tokens_per_request, lo)) <= max_graphs:
            hi = lo
        for _ in range(60):
            if hi - lo < Fraction(1, 10**9):
                break
            mid = (lo + hi) / 2
            if len(_greedy(top, tokens_per_request, mid)) <= max_graphs:
                hi = mid
            else:
                lo = mid
        sizes = _greedy(top, tokens_per_request, hi)
        if max_waste_pct is not None:
            needed = _greedy(top, tokens_per_request, Fraction(str(max_waste_pct)) / 100)
            if len(needed) > max_graphs:
                raise SpecError(
                    f"--max-waste {max_waste_pct} needs {len(needed)} graphs, above --max-graphs "
                    f"{max_graphs}; "
                    f"{max_graphs} graphs need --max-waste {float(hi) * 100:.2f}"
                )
            sizes = needed
    if len(sizes) > MAX_CAPTURE_SIZES:
        raise SpecError(f"{len(sizes)} capture sizes needed; at most {MAX_CAPTURE_SIZES}: allow more waste")
    cov = coverage(sizes, tokens_per_request, max_requests, max_tokens)
    return Proposal(tuple(sizes), cov.max_waste, cov)


def render_proposal(p: Proposal) -> str:
    """The proposal as a YAML fragment (with its coverage as comments)."""
    return "\n".join(
        [
            f"# {len(p.sizes)} capture sizes; max padding waste {p.max_waste:.1%}",
            f"# {p.coverage.summary()}",
            "capture:",
            f"  sizes: [{', '.join(map(str, p.sizes))}]",
        ]
    )


def _end(node: object) -> int:
    """Where a node's own text ends: a block collection's end mark lies past the comments after it, so use its
    last child's end instead."""
    values = getattr(node, "value", None)
    if isinstance(values, list) and values and not getattr(node, "flow_style", False):
        last = values[-1]
        return _end(last[1] if isinstance(last, tuple) else last)
    return node.end_mark.index  # type: ignore[attr-defined]


def write_sizes(path: Path, sizes: tuple[int, ...], source: str | None = None) -> str:
    """Replace the text of ``capture.sizes`` in the YAML file ``path`` with ``[s1, s2, ...]``; every other
    byte stays. Returns the new text."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError
    from ruamel.yaml.nodes import CollectionNode, MappingNode

    where = source or str(path)
    text = path.read_text(encoding="utf-8")
    try:
        root = YAML().compose(text)
    except YAMLError as exc:
        raise SpecError(f"{where}: invalid YAML: {exc}") from None

    def child(node: object, key: str, path_: str) -> tuple[Any, Any]:
        if not isinstance(node, MappingNode):
            raise SpecError(f"{where}: {path_}: expected a mapping to edit")
        for k, v in node.value:
            if getattr(k, "value", None) == key:
                return k, v
        raise SpecError(f"{where}: {path_}.{key}: not found")

    key, node = child(child(root, "capture", "(top level)")[1], "sizes", "capture")
    flow = f"[{', '.join(map(str, sizes))}]"
    start, end = node.start_mark.index, _end(node)
    if isinstance(node, CollectionNode) and not node.flow_style:
        # A block value starts on a later line; the flow list goes after the key's colon instead, and the
        # comments between the two stay (a block item's indentation would not hold a flow list).
        colon = text.index(":", key.end_mark.index)
        between = text[colon + 1 : start].split("\n")
        kept = between[0] + "".join("\n" + line for line in between[1:-1])
        new = text[: colon + 1] + " " + flow + kept + text[end:]
    else:
        new = text[:start] + flow + text[end:]
    path.write_text(new, encoding="utf-8")
    return new
