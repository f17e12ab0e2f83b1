"""Hypothesis strategies for any graphbuf spec: live batches a refresh accepts, batches it must reject, specs.

Hypothesis is a dependency of graphbuf (the drill draws its batches with it); ``import graphbuf`` alone
never imports it, and importing this module where it is missing raises ImportError saying how to install
it. A user's own property test::

    from hypothesis import given
    from graphbuf import StaticBuffers
    from graphbuf.testing import batches

    buffers = StaticBuffers("gemma4-31b-it-mtp", overrides={"num_blocks": 64})

    @given(batches(buffers))
    def test_my_backend(batch):
        buffers.refresh(*batch, **batch.kwargs)  # kwargs: num_reqs, where the sources cannot tell it
        ...  # run the backend on buffers.view(batch.size), compare with a reference

Rows follow the spec's rules, widths stay within the captured allocation and values within ``min``/``max``.
Relations the spec cannot state (e.g. a block table wide enough for each ``seq_len``) come from the spec's
tasks: a registered task factory names a *relation* (:attr:`graphbuf.spec.factories.TaskFactory.strategy`), a
function ``relation(plan, size, live) -> SearchStrategy[dict[str, source]]`` whose sources replace the
generic ones for the buffers it returns. :func:`paged_kv` is one, for paged-KV block tables.
"""

from __future__ import annotations

try:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st
    from hypothesis.strategies import SearchStrategy
except ImportError as exc:  # pragma: no cover - exercised in a subprocess without Hypothesis
    raise ImportError(
        "graphbuf.testing needs Hypothesis, a dependency of graphbuf; reinstall graphbuf with its "
        "dependencies, from the graphbuf clone: pip install -c constraints.txt -e ."
    ) from exc

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from graphbuf.errors import RefreshError, RowsError, UsageError, WidthError
from graphbuf.planning.planner import BufferPlan, Plan
from graphbuf.spec.factories import task_strategy
from graphbuf.spec.models import DTYPES, GraphSpec
from graphbuf.testing_steps import DecodeBatch, Step, next_step, stage_sources, stage_writes, steps  # noqa: F401

__all__ = [
    "PROFILES",
    "Batch",
    "Rejected",
    "Relation",
    "as_source",
    "batches",
    "bounds",
    "examples",
    "paged_kv",
    "register_profiles",
    "sample",
    "sources",
    "specs",
    "task_relations",
]

#: A task's strategy for relations between buffers: ``relation(plan, size, live)`` draws sources (name →
#: array) for ``live`` requests at ``size`` tokens; they replace the generic draws of those buffers.
Relation = Callable[[Plan, int, int], SearchStrategy[dict[str, Any]]]

T = TypeVar("T")

#: Most live requests a strategy draws sources for (eager steps above the largest capture size included).
_MAX_LIVE = 1 << 20

# ----------------------------------------------------------------------------------------------------------
# Profiles

#: Hypothesis profiles: ``ci`` is derandomized with Hypothesis' default example count (each test's own
#: count, see :func:`examples`); ``deep`` is random with ten times the examples.
PROFILES: dict[str, dict[str, Any]] = {
    "ci": {"derandomize": True, "max_examples": 100, "deadline": None, "print_blob": True},
    "deep": {"derandomize": False, "max_examples": 1000, "deadline": None, "print_blob": True},
}
_BASE_EXAMPLES = PROFILES["ci"]["max_examples"]


def register_profiles() -> None:
    """Register :data:`PROFILES` with Hypothesis (select one with ``pytest --hypothesis-profile=NAME``)."""
    for name, values in PROFILES.items():
        settings.register_profile(name, **values)


def examples(n: int) -> int:
    """``n`` examples under the ``ci`` profile, scaled by the loaded profile (``deep``: ``10 * n``)."""
    _count("examples", "n", n, 1)
    return max(1, n * settings.default.max_examples // _BASE_EXAMPLES)


def _count(call: str, name: str, value: Any, lo: int, hi: int | None = None) -> int:
    """``value`` if it is an int (a bool is not) in ``lo..hi``; else a UsageError naming ``call(name=)``."""
    if type(value) is not int and not isinstance(value, np.integer):
        raise UsageError(f"{call}({name}={_show(value)}): expected an integer, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        allowed = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise UsageError(f"{call}({name}={_show(value)}): must be {allowed}")
    return int(value)


def _show(value: Any) -> str:
    text = (
        repr(value)
        if not isinstance(value, int) or abs(value) < 10**30
        else f"<{value.bit_length()}-bit int>"
    )
    return text if len(text) <= 60 else text[:60] + "..."


def sample(strategy: SearchStrategy[T], *, seed: int = 0, count: int = 1) -> list[T]:
    """``count`` values drawn from ``strategy``, the same for the same ``seed`` (outside any test).

    Hypothesis' first example is its simplest; it is skipped, so the values are ordinary random draws."""

    if not isinstance(strategy, SearchStrategy):
        raise UsageError(f"sample(strategy={_show(strategy)}): expected a Hypothesis SearchStrategy")
    _count("sample", "count", count, 0, 1 << 20)
    if count == 0:
        return []
    out: list[T] = []

    @settings(
        max_examples=count + 1, database=None, derandomize=False, deadline=None, phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @hypothesis_seed(seed)
    @given(strategy)
    def collect(value: T) -> None:
        out.append(value)

    collect()
    return out[1:] if len(out) > count else out


# ----------------------------------------------------------------------------------------------------------
# Batches


@dataclass(frozen=True)
class Batch:
    """A live batch: ``refresh(*batch, **batch.kwargs)`` accepts it as drawn and returns ``num_reqs``.

    Unpacks as the pair ``(size, sources)``. ``kwargs`` is ``{"num_reqs": num_reqs}`` when the sources cannot
    tell the live request count (no buffer's rows carry it: ``needs_num_reqs``), else empty, so
    ``refresh(size, sources)`` alone accepts it."""

    size: int
    sources: dict[str, Any]
    num_reqs: int
    needs_num_reqs: bool = False

    def __iter__(self) -> Iterator[Any]:
        return iter((self.size, self.sources))

    @property
    def kwargs(self) -> dict[str, int]:
        """The keyword arguments a refresh needs besides ``(size, sources)``."""
        return {"num_reqs": self.num_reqs} if self.needs_num_reqs else {}

    def __repr__(self) -> str:
        return f"Batch(size={self.size}, num_reqs={self.num_reqs}, sources={show_sources(self.sources)})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """Hypothesis prints a failing example with this (not the expression that built it)."""
        printer.text(repr(self))


@dataclass(frozen=True)
class Rejected:
    """A batch ``refresh(*rejected, **rejected.kwargs)`` must reject with exactly ``error`` (``reason`` says
    why); unpacks and carries ``kwargs`` as :class:`Batch` does."""

    size: int
    sources: dict[str, Any]
    num_reqs: int
    error: type[RefreshError]
    reason: str = field(default="")
    needs_num_reqs: bool = False

    def __iter__(self) -> Iterator[Any]:
        return iter((self.size, self.sources))

    @property
    def kwargs(self) -> dict[str, int]:
        """The keyword arguments the refresh takes besides ``(size, sources)``."""
        return {"num_reqs": self.num_reqs} if self.needs_num_reqs else {}

    def __repr__(self) -> str:
        return (
            f"Rejected(size={self.size}, num_reqs={self.num_reqs}, error={self.error.__name__}, "
            f"reason={self.reason!r}, sources={show_sources(self.sources)})"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


def show_sources(sources: Mapping[str, Any]) -> str:
    """``sources`` as a readable dict: each array or tensor as its nested list of values, with its dtype
    unless it is int64, float64 or bool."""
    parts = []
    for name, src in sources.items():
        values = src.tolist() if hasattr(src, "tolist") else src
        dtype = str(getattr(src, "dtype", "")).removeprefix("torch.")
        shown = f"{values!r}" if dtype in ("", "int64", "float64", "bool") else f"{values!r} ({dtype})"
        parts.append(f"{name!r}: {shown}")
    return "{" + ", ".join(parts) + "}"


def _plan(buffers: Any, call: str) -> Plan:
    p = getattr(buffers, "plan", buffers)
    if not isinstance(p, Plan):
        raise UsageError(
            f"{call}(buffers=...): expected StaticBuffers or a Plan, got {type(buffers).__name__}"
        )
    return p


def _relations(
    relations: Any, spec: GraphSpec, allow_factories: Iterable[str], call: str
) -> tuple[Relation, ...]:
    if relations is None:
        return task_relations(spec, allow_factories)
    if isinstance(relations, (str, bytes)) or not isinstance(relations, Iterable):
        raise UsageError(f"{call}(relations={_show(relations)}): expected a sequence of relation callables")
    rels = tuple(relations)
    bad = [r for r in rels if not callable(r)]
    if bad:
        raise UsageError(
            f"{call}(relations=...): {_show(bad[0])} is not callable (relation(plan, size, live))"
        )
    return rels


def task_relations(spec: GraphSpec, allow_factories: Iterable[str] = ()) -> tuple[Relation, ...]:
    """The relations the spec's tasks supply (see :mod:`graphbuf.spec.factories`), each once, in task
    order."""
    if not isinstance(spec, GraphSpec):
        raise UsageError(f"task_relations(spec=...): expected a GraphSpec, got {type(spec).__name__}")
    found: list[Relation] = []
    for t in spec.tasks:
        rel = task_strategy(t.factory, allow_factories)
        if rel is not None and rel not in found:
            found.append(rel)
    return tuple(found)


def batches(
    buffers: Any,
    size: int | None = None,
    *,
    relations: Sequence[Relation] | None = None,
    rejected: bool = False,
    allow_factories: Iterable[str] = (),
) -> SearchStrategy[Batch] | SearchStrategy[Rejected]:
    """Live batches for ``buffers`` (a :class:`~graphbuf.StaticBuffers` or a :class:`~graphbuf.Plan`).

    Each is a :class:`Batch` at a capture size (``size``, or any) with 1 .. the size's requests. With
    ``rejected=True``, :class:`Rejected` batches instead: a valid batch with one field out of bounds
    (``RefreshError``), one 2-D source too wide for an ``overflow: reject`` buffer (``WidthError``), or one
    source with more rows than the size holds (``RowsError``). ``relations``: default, those of the spec's
    tasks (:func:`task_relations`).
    """
    p = _plan(buffers, "batches")
    if size is not None and (type(size) is not int or size not in p.capture_sizes):
        sizes = ", ".join(map(str, p.capture_sizes))
        raise UsageError(
            f"batches(size={_show(size)}): not a capture size of {p.spec.name!r}; sizes: {sizes}"
        )
    if type(rejected) is not bool:
        raise UsageError(f"batches(rejected={_show(rejected)}): expected True or False")
    rels = _relations(relations, p.spec, allow_factories, "batches")
    tpr = p.tokens_per_request
    chosen = st.just(size) if size is not None else st.sampled_from(p.capture_sizes)

    needs = not any(b.rows.names & {"tokens", "requests"} for b in p.buffers)

    def at(s: int) -> SearchStrategy[Batch]:
        return st.integers(1, max(1, s // tpr)).flatmap(
            lambda live: sources(p, live, size=s, relations=rels).map(lambda src: Batch(s, src, live, needs))
        )

    valid = chosen.flatmap(at)
    return valid.flatmap(lambda b: _rejections(p, b)) if rejected else valid


def sources(
    buffers: Any,
    live: int,
    *,
    size: int | None = None,
    relations: Sequence[Relation] | None = None,
    allow_factories: Iterable[str] = (),
) -> SearchStrategy[dict[str, Any]]:
    """Sources for ``live`` requests refreshed at ``size`` tokens (default: the smallest capture size holding
    them, else ``live * tokens_per_request`` as an eager step): relations first (default: the spec's tasks'),
    every other buffer from the spec's rules; ``keep`` buffers are sometimes left out, but never all of them,
    nor every buffer whose rows carry the live count."""
    p = _plan(buffers, "sources")
    tpr = p.tokens_per_request
    live = _count("sources", "live", live, 0, _MAX_LIVE)
    if size is None:
        size = next((s for s in p.capture_sizes if s >= live * tpr), live * tpr)
    elif _count("sources", "size", size, 1) < live * tpr:
        raise UsageError(f"sources(size={size}): holds {size // tpr} requests, fewer than live={live}")
    rels = _relations(relations, p.spec, allow_factories, "sources")
    return _sources(p, size, live, rels)


@st.composite
def _sources(draw: Any, p: Plan, size: int, live: int, rels: tuple[Relation, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rel in rels:
        out.update(draw(rel(p, size, live)))
    env = {**p.constants, "requests": live, "tokens": live * p.tokens_per_request}
    left_out = {b.name for b in p.buffers if b.name not in out and b.keep and not draw(st.booleans())}
    # Never leave out every source that carries the live count (a refresh would need num_reqs=), nor all.
    carriers = [b.name for b in p.buffers if b.rows.names & {"tokens", "requests"}]
    if carriers and all(n in left_out for n in carriers):
        left_out.discard(carriers[0])
    if left_out.issuperset(b.name for b in p.buffers):
        left_out.discard(p.buffers[0].name)
    for b in p.buffers:
        if b.name in out or b.name in left_out:
            continue
        rows = b.rows.eval(env)
        if b.cols is None:
            shape: tuple[int, ...] = (rows,)
        else:
            shape = (rows, draw(st.integers(0, p.shape_at(b, size)[1])))
        out[b.name] = _values(draw, b, shape)
    return {b.name: out[b.name] for b in p.buffers if b.name in out}


def bounds(b: BufferPlan) -> tuple[int, int]:
    """The value range drawn for ``b``: its ``min``/``max``, else ±100 around them, within its dtype."""
    _buffer_plan("bounds", b)
    kind = DTYPES[b.dtype_name][0]
    if kind == "b":
        return 0, 1
    if kind == "f":
        tmin, tmax = -(2**15), 2**15
    else:
        info = np.iinfo(np.dtype(b.dtype_name))
        tmin, tmax = int(info.min), int(info.max)
    lo = b.min if b.min is not None else max(tmin, (b.max if b.max is not None else 100) - 200)
    hi = b.max if b.max is not None else min(tmax, max(lo, 0) + 100)
    return max(lo, tmin), min(hi, tmax)


def _values(draw: Any, b: BufferPlan, shape: tuple[int, ...]) -> Any:
    lo, hi = bounds(b)
    mode = draw(st.sampled_from(("low", "random", "high")))  # shrinks to the lowest allowed values
    if mode == "random":
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        values = rng.integers(lo, hi, size=shape, endpoint=True)
    else:
        values = np.full(shape, lo if mode == "low" else hi)
    return as_source(b, values)


def as_source(b: BufferPlan, values: Any) -> Any:
    """``values`` in the source type a refresh takes for ``b`` (bfloat16: a torch tensor)."""
    _buffer_plan("as_source", b)
    try:
        if b.dtype_name == "bfloat16":
            import torch

            return torch.as_tensor(np.asarray(values, dtype=np.float32)).to(torch.bfloat16)
        return np.ascontiguousarray(np.asarray(values).astype(b.dtype_name))
    except (TypeError, ValueError, OverflowError) as exc:
        raise UsageError(
            f"as_source({b.name}): cannot convert {_show(values)} to {b.dtype_name}: {exc}"
        ) from None


def _buffer_plan(call: str, b: Any) -> None:
    if not isinstance(b, BufferPlan):
        raise UsageError(f"{call}(b=...): expected a BufferPlan (plan[name]), got {type(b).__name__}")


def _rejections(p: Plan, base: Batch) -> SearchStrategy[Rejected]:
    """One mutation of ``base`` that a refresh must reject, labelled with its error."""
    options: list[SearchStrategy[Rejected]] = [
        st.sampled_from(sorted(base.sources)).flatmap(lambda n: _too_many_rows(p, base, n))
    ]
    wide = [n for n in base.sources if p[n].cols is not None and p[n].overflow == "reject"]
    if wide:
        options.append(st.sampled_from(wide).flatmap(lambda n: _too_wide(p, base, n)))
    bounded = [
        (n, which)
        for n in base.sources
        for which in ("min", "max")
        if _outside(p[n], which) is not None and np.asarray(_host(base.sources[n])).size
    ]
    if bounded:
        options.append(st.sampled_from(bounded).flatmap(lambda nw: _out_of_bounds(p, base, *nw)))
    return st.one_of(options)


def _host(src: Any) -> np.ndarray:
    return src.float().numpy() if hasattr(src, "numpy") and not isinstance(src, np.ndarray) else src


def _too_many_rows(p: Plan, base: Batch, name: str) -> SearchStrategy[Rejected]:
    b = p[name]
    held = p.shape_at(b, base.size)[0]

    def build(extra: int) -> Rejected:
        src = np.asarray(_host(base.sources[name]))
        shape = (held + extra, *src.shape[1:])
        srcs = dict(base.sources, **{name: as_source(b, np.full(shape, bounds(b)[0]))})
        why = f"{name}: {shape[0]} rows, capture size {base.size} holds {held}"
        return Rejected(base.size, srcs, base.num_reqs, RowsError, why, base.needs_num_reqs)

    return st.integers(1, 3).map(build)


def _too_wide(p: Plan, base: Batch, name: str) -> SearchStrategy[Rejected]:
    b = p[name]
    cap = p.shape_at(b, base.size)[1]

    def build(extra: int) -> Rejected:
        rows = np.asarray(_host(base.sources[name])).shape[0]
        srcs = dict(base.sources, **{name: as_source(b, np.full((rows, cap + extra), bounds(b)[0]))})
        why = f"{name}: {cap + extra} columns, the allocation holds {cap} (overflow: reject)"
        return Rejected(base.size, srcs, base.num_reqs, WidthError, why, base.needs_num_reqs)

    return st.integers(1, 3).map(build)


def _outside(b: BufferPlan, which: str) -> int | float | None:
    """A value just outside ``b``'s ``which`` bound that its dtype still holds (None if there is none)."""
    limit = b.min if which == "min" else b.max
    if limit is None:
        return None
    kind, _ = DTYPES[b.dtype_name]
    step = -1 if which == "min" else 1
    if kind == "f":
        return float(limit) + step * (abs(limit) / 2 + 1)
    if kind == "b":
        return None
    value = limit + step
    info = np.iinfo(np.dtype(b.dtype_name))
    return value if info.min <= value <= info.max else None


def _out_of_bounds(p: Plan, base: Batch, name: str, which: str) -> SearchStrategy[Rejected]:
    b = p[name]
    values = np.array(_host(base.sources[name]), dtype=np.float64 if DTYPES[b.dtype_name][0] == "f" else None)
    bad = _outside(b, which)

    def build(index: int) -> Rejected:
        flat = values.copy().reshape(-1)
        flat[index] = bad
        srcs = dict(base.sources, **{name: as_source(b, flat.reshape(values.shape))})
        why = f"{name}: value {bad} is outside {which} {getattr(b, which)}"
        return Rejected(base.size, srcs, base.num_reqs, RefreshError, why, base.needs_num_reqs)

    return st.integers(0, values.size - 1).map(build)


# ----------------------------------------------------------------------------------------------------------
# A relation for paged KV


def paged_kv(
    p: Plan,
    size: int,
    live: int,
    *,
    block_table: str = "block_table",
    seq_lens: str = "seq_lens",
    block_size: str = "block_size",
) -> SearchStrategy[dict[str, Any]]:
    """Paged-KV sources: ``seq_lens`` (at least the tokens per request, at most its ``max`` and what the
    table addresses) and, per group, a ``block_table`` whose row ``r`` starts with ``cdiv(seq_lens[r],
    block_size)`` distinct block ids (where the id range allows), in range garbage after them, and is as
    wide as the longest row needs up to the allocation. Buffers the plan lacks are left out."""
    if not isinstance(p, Plan):
        raise UsageError(f"paged_kv(p=...): expected a Plan, got {type(p).__name__}")
    _count("paged_kv", "size", size, 1)
    _count("paged_kv", "live", live, 0, _MAX_LIVE)
    tables = [b for b in p.buffers if b.spec_name == block_table]
    if seq_lens not in p.names or not tables:
        return st.just({})
    bs = int(p.constants.get(block_size) or 16)
    lens_plan = p[seq_lens]
    cap_w = min(p.shape_at(b, size)[1] for b in tables)
    lo = max(lens_plan.min or 0, p.tokens_per_request)
    hi = min(cap_w * bs, lens_plan.max if lens_plan.max is not None else cap_w * bs)
    lo = min(lo, hi)
    ids_lo = tables[0].min if tables[0].min is not None else 0
    ids_hi = tables[0].max
    if ids_hi is None:
        ids_hi = int(p.constants.get("num_blocks") or cap_w * max(1, live)) - 1

    @st.composite
    def draw_kv(draw: Any) -> dict[str, Any]:
        lens = np.array(draw(st.lists(st.integers(lo, hi), min_size=live, max_size=live)), dtype=np.int64)
        need = -(-int(lens.max(initial=0)) // bs)
        width = draw(st.integers(need, max(need, cap_w)))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        out: dict[str, Any] = {seq_lens: as_source(lens_plan, lens)}
        for b in tables:
            table = rng.integers(ids_lo, ids_hi, size=(live, width), endpoint=True)
            for r in range(live):
                n = -(-int(lens[r]) // bs)
                if ids_hi - ids_lo + 1 >= n:
                    table[r, :n] = ids_lo + rng.permutation(ids_hi - ids_lo + 1)[:n]
            out[b.name] = as_source(b, table)
        return out

    return draw_kv()


# ----------------------------------------------------------------------------------------------------------
# Specs

_NAMES = ("table", "lens", "positions", "offsets", "slots", "mask", "scale")
_ROWS = ("requests", "tokens", "requests + 1", "2")
_COLS = (None, "max_blocks", "1", "requests")
_DTYPE_NAMES = tuple(DTYPES)


@st.composite
def _buffer(draw: Any) -> dict[str, Any]:
    dtype = draw(st.sampled_from(_DTYPE_NAMES))
    kind = DTYPES[dtype][0]
    doc: dict[str, Any] = {"dtype": dtype, "rows": draw(st.sampled_from(_ROWS))}
    cols = draw(st.sampled_from(_COLS))
    if cols is not None:
        doc["cols"] = cols
    if draw(st.booleans()):
        doc["per_group"] = True
    if kind == "b":
        doc["pad"] = draw(st.booleans())
        return doc
    lo_type = 0 if kind == "u" else -8
    pad = draw(st.one_of(st.integers(lo_type, 8), st.just("repeat_last")))
    doc["pad"] = pad
    value = 0 if pad == "repeat_last" else pad
    if draw(st.booleans()):
        doc["min"] = draw(st.integers(lo_type, value))
    if draw(st.booleans()):
        doc["max"] = draw(st.integers(value, 100))
    if doc.get("cols") is not None and draw(st.booleans()):
        doc["overflow"] = "truncate"
    if draw(st.booleans()):
        doc["keep"] = True
    return doc


@st.composite
def _spec(draw: Any) -> dict[str, Any]:
    tpr = draw(st.integers(1, 4))
    requests = draw(st.lists(st.integers(1, 8), min_size=1, max_size=4, unique=True))
    block_size = draw(st.sampled_from((16, 1, 8, 128)))
    max_model_len = draw(st.integers(1, 512))
    names = draw(st.lists(st.sampled_from(_NAMES), min_size=1, max_size=4, unique=True))
    groups = draw(
        st.lists(st.sampled_from(("default", "full", "sliding")), min_size=1, max_size=2, unique=True)
    )
    return {
        "version": 1,
        "name": draw(st.sampled_from(("generated", "small", "paged"))),
        "constants": {
            "max_num_seqs": max(requests),
            "block_size": block_size,
            "max_model_len": max_model_len,
            "max_blocks": "cdiv(max_model_len, block_size)",
        },
        "capture": {"tokens_per_request": tpr, "sizes": sorted(r * tpr for r in requests)},
        "groups": groups,
        "buffers": {n: draw(_buffer()) for n in names},
    }


def specs() -> SearchStrategy[dict[str, Any]]:
    """Valid spec documents (mappings that :meth:`graphbuf.GraphSpec.model_validate` accepts and plan),
    shrinking toward one buffer, one capture size and one token per request."""
    return _spec()
