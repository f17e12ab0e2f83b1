"""The only code that writes buffer memory, and the only device code of a refresh.

Per buffer a high-water mark (rows, cols) bounds the cells that may differ from the pad: rows at and past
``rows`` and columns at and past ``cols`` hold the pad in every row. A write of ``n`` live rows × ``w`` live
columns touches the rectangle ``[:max(n, end, rows), :max(w, cols)]`` of that buffer only (``end``: the
last padded row a ``repeat_last`` buffer fills at this capture size; 0 when no live row is there to repeat),
so a refresh costs O(live rows × live width + the cells earlier refreshes dirtied), never O(capacity).

:meth:`Committer.apply` writes one refresh: the full sources, then the staged cells. On the cpu they go into
the slab in place. Uploaded (every accelerator; a cpu slab on request) they go into one of ``depth`` host
upload copies; with the native packer every rectangle of 4-byte elements up to :data:`PACK_MAX` bytes and the
staged cells travel in one packed upload placed by one ``scatter_`` of the slab's int32 words, anything
else in one copy each, device-resident sources copied on the device last. An event after the uploads fences
each upload copy, so ``depth`` must be at least the number of refreshes in flight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from graphbuf.buffers.layout import Layout, ResolvedBuffer
from graphbuf.buffers.validate import Prepared

__all__ = ["PACK_MAX", "Cells", "Committer", "RefreshStats", "place_device_source", "rectangle", "write_live"]

#: Bytes up to which a rectangle a refresh touches goes into the packed upload (its word indices cost twice
#: its 4-byte words); a larger one is uploaded on its own.
PACK_MAX = 1 << 16
_PACK_WORDS = PACK_MAX // 4


class RefreshStats(NamedTuple):
    """Byte accounting of the refreshes of one :class:`graphbuf.StaticBuffers` (a snapshot; immutable).

    ``last_bytes``: bytes the last refresh wrote into the slab (in place) or uploaded, summed over the
    rectangle it touched in each buffer; ``total_bytes``: the sum over all ``refreshes``.
    """

    refreshes: int = 0
    last_bytes: int = 0
    total_bytes: int = 0


class Cells(NamedTuple):
    """One staged buffer's checked commit: its changed and entering cells (flat indices, or one slice of
    them, and their values), then rows ``live..shown`` cleared over ``cols`` columns; the marks it leaves
    are (``live``, ``colmark``)."""

    slot: ResolvedBuffer
    idx: np.ndarray | slice
    vals: np.ndarray
    live: int
    shown: int
    cols: int
    colmark: int


_INT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_new_tuple = tuple.__new__
_NO_CELLS: tuple[list[Any], list[Any], list[int]] = ([], [], [])  # no staged cells to pack


def write_live(
    t: np.ndarray,
    src: np.ndarray | None,
    slot: ResolvedBuffer,
    n: int,
    w: int,
    end: int,
    rows: int,
    cols: int,
) -> tuple[int, int]:
    """THE live-row write: ``src[:n, :w]`` into ``t[:n, :w]``; every other cell of ``t[:R, :C]`` (``R =
    max(n, end, rows)``, ``C = max(w, cols)``) to the pad, or rows ``n..end`` to the last live row under
    ``repeat_last``. ``rows``/``cols`` is ``t``'s high-water mark; return the new one. ``src`` None: the live
    cells are written elsewhere (a device source); the rest still is. (The native kernel's ``write`` is
    this function in C; ``tests/unit/buffers/test_native.py`` holds the two to the same bytes.)"""
    if t.ndim == 1:
        if src is not None:
            t[:n] = src[:n]
        top = n
        if slot.repeat_last and n and end > n:
            t[n:end] = t[n - 1]
            top = end
        if rows > top:
            t[top:rows] = slot.pad
        return top, 0
    c = w if w > cols else cols
    if src is not None:
        t[:n, :w] = src[:n, :w]
    if c > w and n:
        t[:n, w:c] = slot.pad
    top = n
    if slot.repeat_last and n and end > n:
        t[n:end, :c] = t[n - 1, :c]
        top = end
    if rows > top:
        t[top:rows, :c] = slot.pad
    return top, (w if top else 0)


class Committer:
    """Writes validated sources into one slab, tracking each buffer's high-water mark and the bytes moved.

    ``copies``: None writes a cpu slab in place; N >= 1 assembles in N host upload copies (pinned off
    the cpu) and uploads from them (the default on accelerators is 2).
    """

    def __init__(
        self,
        layout: Layout,
        slab: torch.Tensor,
        full: Mapping[str, torch.Tensor],
        *,
        copies: int | None,
        dirty: bool,
    ) -> None:
        self.layout = layout
        self.device = slab.device
        self.uploads = copies is not None
        self._full = tuple(full[s.name] for s in layout.order)
        shapes = [s.plan.shape for s in layout.order]
        # High-water marks by slot index: the pad fill leaves every buffer clean (poison: all dirty). The C
        # staged commit edits these lists in place: they are never rebound.
        self.rows = [sh[0] if dirty else 0 for sh in shapes]
        self.cols = [(sh[1] if len(sh) > 1 else 0) if dirty else 0 for sh in shapes]
        self._pin = slab.device.type != "cpu"  # pinned host memory is what makes an upload asynchronous
        self._copy_views: list[tuple[torch.Tensor, ...]] = []
        views = [self._full]
        if self.uploads:
            images = [
                torch.empty(slab.numel(), dtype=torch.uint8, pin_memory=self._pin) for _ in range(copies)
            ]
            self._images = [img.numpy() for img in images]
            self._copy_views = views = [
                tuple(img[s.plan.offset : s.plan.offset + s.plan.nbytes].view(t.dtype).view(t.shape)
                      for t, s in zip(self._full, layout.order))
                for img in images
            ]  # fmt: skip
        self.targets = [[_np_view(t, s) for t, s in zip(v, layout.order)] for v in views]
        # What the backend's write reads besides the targets: pad bytes by slot index, and per capture size
        # the last row a repeat_last buffer fills (0 for the others).
        self.pads = tuple(s.pad.tobytes() for s in layout.order)
        self.ends = {
            size: tuple(s.capacity[size][0] if s.repeat_last else 0 for s in layout.order)
            for size in layout.plan.capture_sizes
        }
        # Sources may be views of the slab itself; each is read before any buffer it lies in is written.
        self.host_slab = slab.numpy() if not self.uploads else None  # in place: host sources
        self._slab_storage = slab.untyped_storage().data_ptr()  # uploaded: device sources
        self.depth = len(self.targets)  # host upload copies (1 when writing a cpu slab in place)
        self._events: list[Any] = [None] * self.depth
        self._staged_kernel: Any = layout.backend.staged  # writes the cells C's staged check passed
        # Uploaded with the native packer: per upload copy an arena (behind the same event) for the packed
        # upload, and per slot how its rectangles pack as 4-byte words: (word start, words per column, row
        # stride in words), or None (narrower elements, a buffer not 4-byte aligned, no packer).
        self._packer = layout.backend.packer if self.uploads else None
        self._arenas: list[_Arena | None] = [None] * self.depth
        self.words_of = tuple(
            (s.plan.offset // 4, s.itemsize // 4, (s.plan.shape[1] if s.ndim == 2 else 1) * (s.itemsize // 4))
            if self._packer is not None and s.itemsize % 4 == 0 and s.plan.offset % 4 == 0
            else None
            for s in layout.order
        )
        self._cell_arenas: list[torch.Tensor | None] = [None] * self.depth  # cells not packed
        # The slab as integers of each element size: what an upload's indexed writes place values in.
        self._slab_as = {isz: slab[: slab.numel() // isz * isz].view(t) for isz, t in _TORCH_OF_SIZE.items()}
        self.turn = 0  # the upload copy the next refresh assembles in
        self._refreshes = 0
        self._last = 0
        self._total = 0

    @property
    def stats(self) -> RefreshStats:
        return _new_tuple(RefreshStats, (self._refreshes, self._last, self._total))  # type: ignore[no-any-return]

    def mark(self, index: int) -> tuple[int, int]:
        """The high-water mark (rows, cols) of the buffer at slot ``index``."""
        return self.rows[index], self.cols[index]

    def flat(self, index: int) -> np.ndarray:
        """The buffer at slot ``index`` as a flat numpy view of a cpu slab written in place."""
        return self.targets[0][index].reshape(-1)

    def apply(
        self,
        size: int,
        sources: Sequence[Prepared],
        cells: Sequence[Cells] = (),
        native: tuple[list[Any], list[Any], list[int]] | None = None,
        n: int = 0,
    ) -> bool:
        """Write one refresh, every value checked (this never raises on a value): the full ``sources`` at
        ``size`` tokens, then the staged cells (a source viewing a staged buffer is read before that buffer
        is written): ``cells`` checked in Python, or ``native`` (cores, in-place targets, word bases) checked
        by the C staged commit at ``n`` live requests, which writes or packs them. False when C could not
        pack its cells (none written): the caller then writes them with :meth:`write_cells`."""
        k = self.turn
        if self._events[k] is not None:
            self._events[k].synchronize()  # the upload that last read this upload copy has finished
        if self.uploads:
            moved, extra = self._upload(k, sources, size, native, n)
        else:
            moved = self.layout.backend.write(self, 0, sources, size)
            extra = 0
            if native is not None:  # C writes the cells its check passed
                extra = self._staged_kernel.commit(native[0], n, self.rows, self.cols, native[1], True)
        self._refreshes += 1
        self._last = moved + extra if extra > 0 else moved  # extra < 0: C could not pack its cells
        self._total += self._last
        if extra < 0:
            return False
        if cells:
            self.write_cells(cells)
        return True

    def write_cells(self, cells: Sequence[Cells]) -> None:
        """Write checked staged ``cells`` (in place, or one upload scattered per element size), set their
        marks and count their bytes in the last refresh."""
        moved = self._upload_cells(cells) if self.uploads else 0
        for slot, idx, vals, live, shown, cols, colmark in cells:
            if not self.uploads:
                t = self.targets[0][slot.index]
                if vals.size:
                    t.reshape(-1)[idx] = vals
                if shown > live:
                    (t[live:shown, :cols] if t.ndim == 2 else t[live:shown])[...] = slot.pad
                moved += (vals.size + max(shown - live, 0) * (cols if t.ndim == 2 else 1)) * slot.itemsize
            self.rows[slot.index], self.cols[slot.index] = live, colmark
        self._last += moved
        self._total += moved

    def _upload_cells(self, cells: Sequence[Cells]) -> int:
        """Every cell, cleared ones included, in one host arena (per element size: slab element indices,
        then values), one upload, then one indexed write of the slab per element size."""
        groups: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        for c in cells:
            groups.setdefault(c.slot.itemsize, []).append(_cell_writes(c))
        parts = []  # (element size, index offset, count, value offset, its (indices, values) pairs)
        total = 0
        for isz, pairs in groups.items():
            count = sum(i.size for i, _ in pairs)
            if count:
                parts.append((isz, total, count, total + 8 * count, pairs))
                total = (total + (8 + isz) * count + 7) & ~7
        if not parts:
            return 0
        k = self.turn
        if self._events[k] is not None:
            self._events[k].synchronize()  # the upload that last read this turn's arena has finished
        arena = self._cell_arenas[k]
        if arena is None or arena.numel() < total:
            arena = self._cell_arenas[k] = torch.empty(
                2 * max(total, 4096), dtype=torch.uint8, pin_memory=self._pin
            )
        host = arena.numpy()
        for isz, at_i, count, at_v, pairs in parts:
            np.concatenate([i for i, _ in pairs], out=host[at_i : at_i + 8 * count].view(np.int64))
            np.concatenate([v for _, v in pairs], out=host[at_v : at_v + isz * count].view(_INT_OF_SIZE[isz]))
        dev = arena[:total].to(self.device, non_blocking=True) if self._pin else arena[:total]
        for isz, at_i, count, at_v, _ in parts:
            target = self._slab_as[isz]
            target[dev[at_i : at_i + 8 * count].view(torch.int64)] = dev[at_v : at_v + isz * count].view(
                target.dtype
            )
        self._fence(k)
        return sum(isz * count for isz, _, count, _, _ in parts)

    def _upload(
        self, k: int, prepared: Sequence[Prepared], size: int, native: Any, n: int
    ) -> tuple[int, int]:
        """:meth:`apply`'s uploaded write: the sources into upload copy ``k``; with the packer, the rectangles
        they touched (the backend's ``write_words`` gives them with the write) and the staged cells in one
        packed upload placed by :meth:`_Arena.place`; the rest by :meth:`_copy`. Returns the sources' bytes
        and the staged bytes (-1: not packed)."""
        rows, cols = self.rows, self.cols
        moved, rects, rect_words, rest = self.layout.backend.write_words(self, k, prepared, size, _PACK_WORDS)
        if rest:  # device sources in the slab cloned before the placement writes it
            rest = [(self._own(p), end, r, c) for p, end, r, c in rest]
        staged = 0
        if self._packer is not None:
            cores, _, bases = native or _NO_CELLS
            arena = self._arenas[k] or self._arena(k, 0)
            got = self._packer.pack(rects, self._images[k], cores, n, rows, cols, bases, arena.host)
            while type(got) is not tuple:  # nothing packed: pack again
                if got is None:  # a core C cannot read: the rectangles alone, its cells left to the caller
                    cores, bases, staged = [], [], -1
                else:  # -words: more than the arena holds
                    arena = self._arena(k, -got)
                got = self._packer.pack(rects, self._images[k], cores, n, rows, cols, bases, arena.host)
            pairs, b, runs = got
            run_words = sum(w for _, w in runs) if runs else 0
            if pairs or runs:
                arena.place(self._slab_as[4], pairs, b, runs, run_words)
            if native and staged == 0:
                staged = 4 * (pairs + run_words - rect_words)
        if rest:
            self._copy(k, rest)
        else:
            self._fence(k)
        return moved, staged

    def _own(self, p: Prepared) -> Prepared:
        """``p`` with its device source cloned when it lies in the slab's own storage: an upload before its
        copy could change it."""
        dev = p[2]
        if dev is None or dev.untyped_storage().data_ptr() != self._slab_storage:
            return p
        return (p[0], p[1], dev.clone(), p[3], p[4])  # type: ignore[return-value]

    def _arena(self, k: int, words: int) -> _Arena:
        """Upload copy ``k``'s word arena (read behind the same event), with room for ``words``."""
        arena = self._arenas[k]
        if arena is None or arena.cap < words:
            arena = _Arena(max(words, 1 << 12), self._pin, self.device)
            self._arenas[k] = arena
        return arena

    def _copy(self, k: int, touched: list[tuple[Prepared, int, int, int]]) -> None:
        """Each rectangle of ``touched`` uploaded on its own, then each device-resident source's live cells
        and repeated rows; the event that fences upload copy ``k``."""
        copy = self._copy_views[k]
        for (slot, _, dev, n, w), end, r, c in touched:
            dst, src = self._full[slot.index], copy[slot.index]
            wide = dst.dim() == 2
            if r and c:
                (dst[:r, :c] if wide else dst[:r]).copy_(src[:r, :c] if wide else src[:r], non_blocking=True)
            if dev is not None:
                place_device_source(dst, slot, dev, n, w, end, c)
        self._fence(k)

    def _fence(self, k: int) -> None:
        """The event that fences upload copy ``k`` (none on a cpu slab: its uploads are done when they
        return); the next refresh assembles in the next copy."""
        if self._pin:
            event = getattr(torch, self.device.type).Event()
            event.record()
            self._events[k] = event
        self.turn = (k + 1) % self.depth


class _Arena:
    """A packed upload's memory: host bytes (pinned off the cpu) with room for ``cap`` pairs (a power of two)
    and ``cap`` run words and, off the cpu, as many device bytes. The packer pads the pairs to one of a few
    buckets ``b`` (``gb_pack``), so the views an upload of each bucket uses are made once per arena."""

    def __init__(self, words: int, pin: bool, device: torch.device) -> None:
        self.cap = 1 << max(words - 1, 63).bit_length()
        self._host_t = torch.empty(16 * self.cap, dtype=torch.uint8, pin_memory=pin)
        self.host = self._host_t.numpy()
        self._dev_t = torch.empty(16 * self.cap, dtype=torch.uint8, device=device) if pin else None
        on = self._dev_t if self._dev_t is not None else self._host_t
        self._w64, self._w32 = on.view(torch.int64), on.view(torch.int32)
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}

    def place(
        self, words: torch.Tensor, pairs: int, b: int, runs: list[tuple[int, int]], run_words: int
    ) -> None:
        """Upload what the packer wrote (off the cpu: one copy), then place it in ``words`` (the slab as int32
        words): ``pairs`` (indices, words) padded to ``b`` by one ``scatter_``, each of the ``runs``
        (``run_words`` words in all, from word ``3 b`` of the arena) by one copy."""
        views = self._views.get(b)
        if views is None:  # bucket b's word indices and words
            views = (self._w64[:b], self._w32[2 * b : 3 * b])
            if self._dev_t is not None:  # and the host and device bytes of its upload
                views += (self._host_t[: 12 * b], self._dev_t[: 12 * b])
            self._views[b] = views
        if self._dev_t is not None:
            if runs:
                end = 12 * b + 4 * run_words
                self._dev_t[:end].copy_(self._host_t[:end], non_blocking=True)
            else:
                views[3].copy_(views[2], non_blocking=True)
        if pairs:
            words.scatter_(0, views[0], views[1])
        if runs:
            at = 3 * b
            for dst, n in runs:
                words[dst : dst + n].copy_(self._w32[at : at + n])
                at += n


def place_device_source(
    dst: torch.Tensor, slot: ResolvedBuffer, dev: torch.Tensor, n: int, w: int, end: int, c: int
) -> None:
    """A device-resident source's live cells into ``dst`` (on its device), then, ``repeat_last``, rows
    ``n..end`` (2-D: their first ``c`` columns) as its last live row."""
    wide = dst.dim() == 2
    (dst[:n, :w] if wide else dst[:n]).copy_(dev, non_blocking=True)
    if slot.repeat_last and n and end > n:
        tail = dst[n:end, :c] if wide else dst[n:end]
        tail.copy_((dst[n - 1 : n, :c] if wide else dst[n - 1 : n]).expand_as(tail))


def rectangle(slot: ResolvedBuffer, n: int, w: int, end: int, rows: int, cols: int) -> tuple[int, int]:
    """(rows, cols) of the rectangle a write of ``n`` × ``w`` touches under marks ``rows``/``cols`` (cols 1
    for a 1-D buffer); the native write counts the same."""
    return max(n, end if n else 0, rows), (max(w, cols) if slot.ndim == 2 else 1)


def _cell_writes(c: Cells) -> tuple[np.ndarray, np.ndarray]:
    """A staged buffer's cells as (slab element indices, values as unsigned ints of their size), the rows
    it clears included."""
    slot, idx, vals, live, shown, cols, _ = c
    isz, base = slot.itemsize, slot.plan.offset // slot.itemsize
    if type(idx) is slice:
        idx = np.arange(idx.start, idx.stop)
    if shown > live:
        w = slot.plan.shape[1] if slot.ndim == 2 else 1
        cleared = (np.arange(live, shown)[:, None] * w + np.arange(cols if slot.ndim == 2 else 1)).ravel()
        idx = np.concatenate((idx, cleared))
        vals = np.concatenate((vals, np.full(cleared.size, slot.pad, slot.np_dtype)))
    return idx + base, vals.view(_INT_OF_SIZE[isz])


def _np_view(t: torch.Tensor, slot: ResolvedBuffer) -> np.ndarray:
    """A numpy view of host tensor ``t`` in the slot's numpy element type (int16 bits for bfloat16)."""
    return (t.view(torch.int16) if slot.bf16 else t).numpy()
