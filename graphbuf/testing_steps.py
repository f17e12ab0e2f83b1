"""Step sequences of a paged-KV decode server, as Hypothesis strategies, and the writes each step makes.

A :class:`Step` is what happens to a decode batch between two refreshes: some requests finish (the batch
condenses: the last rows move into the holes), some join (a prompt already in the KV cache), every live
request grows by 1 … k+1 tokens (k speculative tokens accepted, plus one), crossing block boundaries as it
goes, and some rows may swap (a reorder). :class:`DecodeBatch` plays steps on a host model of the batch
and says what each one writes in the vocabulary of :meth:`graphbuf.StaticBuffers.stage` (``move_row``,
``set_row``, ``scatter``, ``swap_rows``, ``set``); :func:`stage_writes` stages them and
:meth:`DecodeBatch.sources` gives the same state as full-refresh sources. Strategies: :func:`steps` (a whole
sequence) and :func:`next_step` (one step from a batch's current state, for state machines)::

    from graphbuf.testing import DecodeBatch, stage_writes, steps

    names = {"slots": SLOTS, "offsets": OFFSETS}  # the spec's slot-mapping and query-offset buffers

    @given(steps(buffers, **names))
    def test_staged(seq):
        batch = DecodeBatch(buffers, **names)
        for step in seq:
            stage_writes(buffers, batch.advance(step))
            buffers.refresh(batch.size_for(), batch.sources(full_only=True), num_reqs=batch.live)

Block ids come from a free list (freed when a request finishes; reused, shared, when it runs dry). The
geometry comes from the plan: requests per step (the largest capture size), tokens per request (k + 1),
``block_size``, the longest sequence (``seq_lens``' ``max`` or the table width × block size).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from graphbuf.buffers.layout import NP_OF_TORCH
from graphbuf.errors import RefreshError
from graphbuf.planning.planner import Plan

__all__ = ["DecodeBatch", "Step", "Write", "next_step", "stage_sources", "stage_writes", "steps"]

#: One staged write: (buffer name, method of :class:`graphbuf.buffers.staged.StagedBuffer`, arguments).
Write = tuple[str, str, tuple[Any, ...]]


@dataclass(frozen=True)
class Step:
    """One decode step. ``finish``: rows (before condensing) whose requests end; ``join``: the KV lengths
    of requests that join (appended after the live rows); ``grow``: per live row after the joins, the
    tokens it gains (1 … k+1); ``swap``: row pairs that trade places last."""

    finish: tuple[int, ...] = ()
    join: tuple[int, ...] = ()
    grow: tuple[int, ...] = ()
    swap: tuple[tuple[int, int], ...] = ()


def _plan(buffers: Any) -> Plan:
    return buffers if isinstance(buffers, Plan) else buffers.plan


class DecodeBatch:
    """A decode batch on the host: per live row its sequence length and block ids.

    Names are spec names (per-group buffers get the same writes in every group); buffers the plan lacks
    are skipped. ``slots`` (KV slot per query token) and ``offsets`` (cumulative query offsets, padded
    ``repeat_last``, never staged: :meth:`sources` gives them) have no default: the spec names them.
    """

    def __init__(
        self,
        buffers: Any,
        *,
        block_table: str = "block_table",
        seq_lens: str = "seq_lens",
        slots: str | None = None,
        offsets: str | None = None,
        block_size: str = "block_size",
    ) -> None:
        p = _plan(buffers)
        self.plan = p
        self.tpr = p.tokens_per_request
        self.max_requests = p.capture_sizes[-1] // self.tpr
        self.tables = tuple(b.name for b in p.buffers if b.spec_name == block_table)
        self.slots = tuple(b.name for b in p.buffers if b.spec_name == slots)
        self.lens_name = seq_lens if seq_lens in p.names else None
        self.qsl = offsets if offsets in p.names else None
        self.block_size = int(p.constants.get(block_size) or 16)
        self._dtype = {b.name: NP_OF_TORCH[b.dtype] for b in p.buffers if b.dtype in NP_OF_TORCH}
        width = min((p[t].shape[1] for t in self.tables), default=1 << 20)
        self.width = width
        longest = width * self.block_size
        if self.lens_name is not None and p[self.lens_name].max is not None:
            longest = min(longest, int(p[self.lens_name].max))
        self.max_len = longest
        top = p[self.tables[0]].max if self.tables else None
        self.num_blocks = int(top) + 1 if top is not None else max(64, width)
        self._free: list[int] = []  # freed ids, reused first
        self._fresh = 0  # ids below this were handed out
        self._next = 0
        self.lens: list[int] = []
        self.blocks: list[list[int]] = []

    @property
    def live(self) -> int:
        """Live requests."""
        return len(self.lens)

    def __repr__(self) -> str:
        return f"DecodeBatch(live={self.live}, lens={self.lens}, blocks={self.blocks})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """Hypothesis prints a failing example with this."""
        printer.text(repr(self))

    def size_for(self, live: int | None = None) -> int:
        """The smallest capture size that holds ``live`` (default: the live) requests."""
        n = self.live if live is None else live
        return next(s for s in self.plan.capture_sizes if s >= n * self.tpr)

    def _block(self) -> int:
        if self._free:
            return self._free.pop()
        if self._fresh < self.num_blocks:
            self._fresh += 1
            return self._fresh - 1
        self._next = (self._next + 1) % self.num_blocks  # dry: reuse (requests share blocks)
        return self._next

    def advance(self, step: Step) -> list[Write]:
        """Play ``step``; return the staged writes that bring the buffers from the last state to this one."""
        out: list[Write] = []
        tables = self.tables
        # Finish, then condense: each hole below the new count takes the last live row (vLLM's condense).
        gone = set(step.finish)
        for r in gone:
            self._free.extend(self.blocks[r])
        n = self.live - len(gone)
        tail = [r for r in range(self.live - 1, n - 1, -1) if r not in gone]
        order = list(range(n))  # the old row each new row holds
        for hole in sorted(r for r in gone if r < n):
            src = tail.pop(0)
            order[hole] = src
            for t in tables:
                out.append((t, "move_row", (src, hole)))
        lens = [self.lens[r] for r in order]
        blocks = [self.blocks[r] for r in order]
        # Join.
        for length in step.join:
            row = len(lens)
            ids = [self._block() for _ in range(-(-length // self.block_size))]
            lens.append(length)
            blocks.append(ids)
            for t in tables:
                out.append((t, "set_row", (row, np.array(ids, dtype=self._dtype[t]))))
        # Grow: new blocks where a boundary is crossed, one scatter per table.
        rows, cols, vals = [], [], []
        for r, g in enumerate(step.grow[: len(lens)]):
            lens[r] += g
            need = -(-lens[r] // self.block_size)
            while len(blocks[r]) < need:
                rows.append(r)
                cols.append(len(blocks[r]))
                b = self._block()
                vals.append(b)
                blocks[r].append(b)
        if rows:
            for t in tables:
                out.append(
                    (t, "scatter", (np.array(rows), np.array(vals, dtype=self._dtype[t]), np.array(cols)))
                )
        for a, b in step.swap:
            if a < len(lens) and b < len(lens) and a != b:
                lens[a], lens[b] = lens[b], lens[a]
                blocks[a], blocks[b] = blocks[b], blocks[a]
                for t in tables:
                    out.append((t, "swap_rows", (a, b)))
        self.lens, self.blocks = lens, blocks
        if self.lens_name is not None:
            out.append((self.lens_name, "set", (0, np.array(lens, dtype=self._dtype[self.lens_name]))))
        if self.slots:
            mapping = self.slot_map()
            for s in self.slots:
                out.append((s, "set", (0, mapping.astype(self._dtype[s], copy=False))))
        return out

    def slot_map(self) -> np.ndarray:
        """Per query token (k + 1 per request, the last positions of each sequence) its KV cache slot."""
        tpr, bs = self.tpr, self.block_size
        out = np.empty(self.live * tpr, dtype=np.int64)
        for r, (n, ids) in enumerate(zip(self.lens, self.blocks)):
            for j, pos in enumerate(range(n - tpr, n)):
                out[r * tpr + j] = ids[pos // bs] * bs + pos % bs if pos >= 0 else -1
        return out

    def sources(self, *, full_only: bool = False) -> dict[str, np.ndarray]:
        """The current state as full-refresh sources (``full_only``: only what is never staged)."""
        n, tpr = self.live, self.tpr
        out: dict[str, np.ndarray] = {}
        if not full_only:
            for t in self.tables:
                w = self.plan[t].shape[1]
                table = np.zeros((n, w), dtype=NP_OF_TORCH[self.plan[t].dtype])
                for r, ids in enumerate(self.blocks):
                    table[r, : len(ids)] = ids
                out[t] = table
            if self.lens_name is not None:
                out[self.lens_name] = np.array(self.lens, dtype=self._dtype[self.lens_name])
            mapping = self.slot_map()
            for s in self.slots:
                out[s] = mapping.astype(self._dtype[s], copy=False)
        if self.qsl is not None:
            out[self.qsl] = np.arange(0, (n + 1) * tpr, tpr, dtype=self._dtype[self.qsl])[: n + 1]
        return out


@st.composite
def next_step(draw: Any, batch: DecodeBatch, *, max_join: int | None = None) -> Step:
    """One valid next step of ``batch``: requests that would outgrow the longest sequence finish."""
    tpr, n = batch.tpr, batch.live
    must = [r for r, ln in enumerate(batch.lens) if ln + tpr > batch.max_len]
    may = [r for r in range(n) if r not in must]
    finish = must + (draw(st.lists(st.sampled_from(may), unique=True, max_size=len(may))) if may else [])
    room = batch.max_requests - (n - len(finish))
    cap = room if max_join is None else min(room, max_join)
    hi = max(tpr - 1, batch.max_len - tpr)
    join = draw(st.lists(st.integers(tpr - 1, hi), max_size=max(0, cap)))
    live = n - len(finish) + len(join)
    grow = draw(st.lists(st.integers(1, tpr), min_size=live, max_size=live))
    swap = draw(st.lists(st.tuples(st.integers(0, max(0, live - 1)), st.integers(0, max(0, live - 1))),
                         max_size=2 if live > 1 else 0))  # fmt: skip
    return Step(tuple(sorted(finish)), tuple(join), tuple(grow), tuple(swap))


def steps(
    buffers: Any, *, min_steps: int = 1, max_steps: int = 12, **names: str
) -> SearchStrategy[list[Step]]:
    """Step sequences for ``buffers`` (a :class:`graphbuf.StaticBuffers` or its plan); ``names`` as
    :class:`DecodeBatch` takes them."""
    p = _plan(buffers)

    @st.composite
    def draw_steps(draw: Any) -> list[Step]:
        batch = DecodeBatch(p, **names)
        out = []
        for _ in range(draw(st.integers(min_steps, max_steps))):
            step = draw(next_step(batch))
            batch.advance(step)
            out.append(step)
        return out

    return draw_steps()


def stage_writes(buffers: Any, writes: Iterable[Write]) -> None:
    """Stage ``writes`` on ``buffers`` (:meth:`graphbuf.StaticBuffers.stage`)."""
    handles: dict[str, Any] = {}
    for name, op, args in writes:
        h = handles.get(name)
        if h is None:
            h = handles[name] = buffers.stage(name)
        getattr(h, op)(*args)


def stage_sources(buffers: Any, sources: Mapping[str, Any]) -> dict[str, Any]:
    """Stage every source whose buffer takes staged writes as row writes (``set_row`` per live row of a
    2-D buffer, one ``set`` of a 1-D one) and return the sources left for the refresh: a refresh then
    writes what a full refresh of ``sources`` would."""
    rest: dict[str, Any] = {}
    for name, src in sources.items():
        try:
            h = buffers.stage(name)
        except RefreshError:  # not a buffer that takes staged writes (repeat_last, bfloat16, ...)
            rest[name] = src
            continue
        arr = np.asarray(src.cpu() if hasattr(src, "cpu") else src)
        if arr.ndim == 2:
            for r in range(arr.shape[0]):
                h.set_row(r, arr[r])
        else:
            h.set(0, arr)
    return rest
