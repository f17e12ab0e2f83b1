"""``graphbuf sizes``: the fewest capture sizes that cover the serving envelope within a padding-waste bound.

Every size is a multiple of ``tokens_per_request``; the largest is the envelope's top batch. Chosen greedily
from the top (optimal for covering 1..R with intervals): a size ``S`` holds every batch of at least
``S * (1 - max_waste)`` tokens, and the next size down is the largest batch it leaves out. With a graph budget
the waste bound is the smallest one that fits the budget. :func:`write_sizes` edits a spec file's
``capture.sizes`` in place: the new list replaces exactly the old value's text (located from PyYAML's parse
events), so comments, line endings, a BOM, anchors, tags and every other byte stay as they were.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from graphbuf.errors import SpecError, UsageError
from graphbuf.planning.coverage import Coverage, coverage
from graphbuf.spec.models import MAX_CAPTURE_SIZES, GraphSpec, parse_yaml

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
    force: bool = False,
) -> Proposal:
    """The fewest sizes covering 1..``max_requests`` requests (≤ ``max_tokens`` tokens) with padding waste at
    most ``max_waste_pct`` percent (default 10). With ``max_graphs``: at most that many graphs, at the least
    waste they allow. When the two bounds cannot both hold, a UsageError says so (the arguments conflict, not
    the spec), unless ``force``: then the ``max_graphs`` sizes with the least waste they allow, above the
    bound. An argument out of range is a UsageError too."""
    if max_waste_pct is not None and not 0 <= max_waste_pct < 100:
        raise UsageError(f"--max-waste {max_waste_pct}: must be in [0, 100)")
    if max_graphs is not None and not 1 <= max_graphs <= MAX_CAPTURE_SIZES:
        raise UsageError(f"--max-graphs {max_graphs}: must be in 1..{MAX_CAPTURE_SIZES}")
    top = max_requests if max_tokens is None else min(max_requests, max_tokens // tokens_per_request)
    if top < 1:
        raise SpecError(f"the envelope holds no batch: {max_requests} requests, max {max_tokens} tokens")
    pct = 10 if max_waste_pct is None else max_waste_pct
    waste = Fraction(str(pct)) / 100
    sizes = _greedy(top, tokens_per_request, waste)
    if max_graphs is not None:
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
        if len(sizes) > max_graphs and not force:
            bound = f"--max-waste {pct:g}" + (" (the default)" if max_waste_pct is None else "")
            raise UsageError(
                f"{bound} needs {len(sizes)} graphs, above --max-graphs {max_graphs}; "
                f"{max_graphs} graphs need --max-waste {float(hi) * 100:.2f}: allow more graphs or more "
                "waste, or pass --force to accept it"
            )
        if len(sizes) > max_graphs or max_waste_pct is None:
            sizes = _greedy(top, tokens_per_request, hi)
    if len(sizes) > MAX_CAPTURE_SIZES:
        raise UsageError(f"{len(sizes)} capture sizes needed; at most {MAX_CAPTURE_SIZES}: allow more waste")
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


_SEQ_TAG = "tag:yaml.org,2002:seq"
_LINE_BREAK = re.compile(r"\r\n|\r|\n")
_COMMENT = re.compile(r"(?:^|(?<=[ \t\r\n]))#[^\r\n]*")


def _skip(events: list[Any], i: int) -> int:
    """The index after the node that starts at ``events[i]``."""
    depth = 0
    while True:
        kind = type(events[i]).__name__
        depth += kind in ("SequenceStartEvent", "MappingStartEvent")
        depth -= kind in ("SequenceEndEvent", "MappingEndEvent")
        i += 1
        if depth == 0:
            return i


def _value_of(events: list[Any], i: int, key: str, where: str, path: str) -> int:
    """The index of ``key``'s value event in the mapping that starts at ``events[i]``."""
    if type(events[i]).__name__ != "MappingStartEvent":
        raise SpecError(f"{where}: {path}: expected a mapping to edit")
    i += 1
    merged = False
    while type(events[i]).__name__ != "MappingEndEvent":
        k = events[i]
        value = _skip(events, i)
        if type(k).__name__ == "ScalarEvent" and k.value == key:
            return value
        merged = merged or (type(k).__name__ == "ScalarEvent" and k.value == "<<")
        i = _skip(events, value)
    below = f"{path}.{key}" if path != "(top level)" else key
    if merged:
        raise SpecError(f"{where}: {below}: comes from a merge key (<<); edit it where it is defined")
    raise SpecError(f"{where}: {below}: not found")


@dataclass(frozen=True)
class _Edit:
    start: int  # the replaced text: ``text[start:end]``
    end: int
    block: bool  # a block collection (rewritten as a block list at its indentation)
    comments: tuple[str, ...]  # comments inside the replaced text, kept on lines of their own


def _locate(text: str, where: str) -> _Edit:
    """Where ``capture.sizes``'s value is in ``text`` (its anchor and tag, or an alias's target, excluded).

    ``text`` has no BOM: libyaml's marks count characters after one, the pure-Python parser's count it."""
    import yaml

    try:
        events = list(yaml.parse(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
    except yaml.YAMLError as exc:
        raise SpecError(f"{where}: invalid YAML: {getattr(exc, 'problem', None) or exc}") from None
    root = next((i for i, e in enumerate(events) if type(e).__name__ == "DocumentStartEvent"), None)
    if root is None or root + 1 >= len(events):
        raise SpecError(f"{where}: (top level): expected a mapping to edit")
    capture = _value_of(events, root + 1, "capture", where, "(top level)")
    if type(events[capture]).__name__ == "AliasEvent":
        raise SpecError(
            f"{where}: capture: is an alias (*{events[capture].anchor}); edit it where it is defined"
        )
    v = _value_of(events, capture, "sizes", where, "capture")
    node, kind = events[v], type(events[v]).__name__
    if kind == "AliasEvent":  # `sizes: *S`: the alias is replaced, the anchored value stays
        return _Edit(node.start_mark.index, node.end_mark.index, False, ())
    if kind not in ("SequenceStartEvent", "MappingStartEvent"):
        raise SpecError(f"{where}: capture.sizes: expected a list or a range to replace")
    if node.tag is not None and node.tag != _SEQ_TAG:
        raise SpecError(
            f"{where}: capture.sizes: carries the tag {node.tag!r}; a list of sizes needs !!seq or no tag: "
            "remove the tag first"
        )
    end = _skip(events, v) - 1
    children = events[v + 1 : end]
    if any(type(c).__name__ not in ("ScalarEvent", "AliasEvent") for c in children):
        raise SpecError(f"{where}: capture.sizes: holds a nested collection; expected a list or a range")
    inner = {c.anchor for c in children if type(c).__name__ == "ScalarEvent" and c.anchor}
    used = [e for e in events[end:] if type(e).__name__ == "AliasEvent" and e.anchor in inner]
    if used:
        raise SpecError(
            f"{where}: capture.sizes: its item anchor &{used[0].anchor} is used at line "
            f"{used[0].start_mark.line + 1}; replacing the items would drop it: give that use its own value"
        )
    if node.flow_style:
        start, stop = node.end_mark.index - 1, events[end].end_mark.index  # from "[" or "{" to its closer
        block = False
    elif kind == "SequenceStartEvent":
        start = text.rindex("-", 0, children[0].start_mark.index)  # the first item's "-" indicator
        stop, block = children[-1].end_mark.index, True
    else:
        start, stop, block = children[0].start_mark.index, children[-1].end_mark.index, True
    if text[start] not in "[{" and not block:
        raise SpecError(f"{where}: capture.sizes: cannot find where its value starts")
    line_start = max(text.rfind("\n", 0, start), text.rfind("\r", 0, start)) + 1
    if block and text[line_start:start].strip(" "):
        raise SpecError(f"{where}: capture.sizes: its block value does not start its own line")
    trailing = re.compile(r"[ \t]+#[^\r\n]*").match(text, stop) if block else None
    if trailing:  # the last item's own comment goes with the items it described
        stop = trailing.end()
    gaps = [start, *(i for c in children for i in (c.start_mark.index, c.end_mark.index)), stop]
    comments = tuple(m.group() for a, b in zip(gaps[::2], gaps[1::2]) for m in _COMMENT.finditer(text, a, b))
    return _Edit(start, stop, block, comments)


def write_sizes(
    path: Path, sizes: tuple[int, ...], source: str | None = None, *, allow_factories: Iterable[str] = ()
) -> str:
    """Replace the value of ``capture.sizes`` in the YAML file ``path`` with ``sizes``; every other byte
    (line endings, a BOM, anchors, aliases, tags, comments) stays. Returns the new text.

    A flow value or an alias (``sizes: *S``: the anchored value stays) becomes ``[s1, s2, ...]``; a block
    value becomes a block list at its own indentation. Comments inside the old value are kept, each on a
    line of its own above the new items. The new text must load as a spec and differ from the old one in
    ``capture.sizes`` only (e.g. not through an anchor used elsewhere); otherwise, or when it cannot be
    written, a SpecError says why and the file is left byte for byte as it was. The file is replaced
    atomically (a temporary file renamed over it, with its permissions)."""
    where = source or str(path)
    target = Path(path).resolve()
    try:
        raw = target.read_bytes()
    except OSError as exc:
        raise SpecError(f"{where}: cannot read: {exc.strerror}") from None
    bom = b"\xef\xbb\xbf" if raw.startswith(b"\xef\xbb\xbf") else b""
    try:
        text = raw[len(bom) :].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{where}: not UTF-8 text (byte {exc.start}): a spec is a UTF-8 YAML file") from None
    edit = _locate(text, where)
    found = _LINE_BREAK.search(text)
    nl = found.group() if found else "\n"
    line_start = max(text.rfind("\n", 0, edit.start), text.rfind("\r", 0, edit.start)) + 1
    if edit.block:
        indent = text[line_start : edit.start]
        value = (nl + indent).join([*edit.comments, *(f"- {n}" for n in sizes)])
    else:
        flow = ", ".join(map(str, sizes))
        if edit.comments:
            indent = re.match(r"[ \t]*", text[line_start:]).group() + "  "  # type: ignore[union-attr]
            flow = "".join(nl + indent + c for c in edit.comments) + nl + indent + flow
        value = f"[{flow}]"
    new = text[: edit.start] + value + text[edit.end :]
    _check_rewrite(text, new, sizes, where, allow_factories)
    _replace_file(target, bom + new.encode("utf-8"), where)
    return new


def _check_rewrite(
    old: str, new: str, sizes: tuple[int, ...], where: str, allow_factories: Iterable[str]
) -> None:
    """Raise SpecError unless ``new`` loads as a spec: ``old``'s data with capture.sizes = ``sizes``."""
    try:
        data = parse_yaml(new, where)
        GraphSpec.model_validate(data, source=where, allow_factories=allow_factories)
    except SpecError as exc:
        raise SpecError(
            f"{where}: capture.sizes: the rewritten spec would not load (file unchanged):\n{exc}"
        ) from None
    expected = parse_yaml(old, where)
    expected["capture"] = {**expected["capture"], "sizes": list(sizes)}
    if repr(data) != repr(expected):
        raise SpecError(
            f"{where}: capture.sizes: replacing its text would change more than capture.sizes (an anchor on "
            "it or inside it is used elsewhere); file unchanged: give sizes its own value first"
        )


def _replace_file(path: Path, data: bytes, where: str) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it over ``path`` (mode kept)."""
    if not os.access(path, os.W_OK):  # a rename would replace a file its owner made read-only
        raise SpecError(f"{where}: cannot write: permission denied; the file is unchanged")
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise SpecError(f"{where}: cannot write: {exc.strerror or exc}; the file is unchanged") from None
