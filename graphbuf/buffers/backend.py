"""The backend that checks and writes a refresh: numpy (:class:`Backend`, the reference) or the C kernel
(:class:`NativeBackend`), chosen once by :func:`chosen` when :class:`graphbuf.StaticBuffers` is built. Both
give the same bytes and errors: each native method runs C and, where C declines, the numpy method it
overrides; callers never ask which backend they have.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch

from graphbuf.buffers import native
from graphbuf.buffers.commit import Committer, rectangle, write_live
from graphbuf.buffers.layout import Layout, ResolvedBuffer
from graphbuf.buffers.validate import Prepared, accept_typed, check_source, live_region, prepared

__all__ = ["Backend", "NativeBackend", "chosen"]


class Backend:
    """numpy: the reference for every check and write; no packer, Python host states."""

    packer: ModuleType | None = None  # packs a refresh's writes as slab words for one upload
    staged: ModuleType | None = None  # the native host state and its commit

    def fits(self, slot: ResolvedBuffer, arr: np.ndarray, rows: int, width: int) -> bool:
        """The values of the non-empty live region ``arr[:rows, :width]`` (1-D: ``arr[:rows]``) hold no NaN
        and lie within the slot's ``min``/``max``; False otherwise (the general path then names the value)."""
        if arr.shape[0] != rows or (arr.ndim == 2 and arr.shape[1] != width):
            arr = live_region(arr, rows, width)
        if arr.dtype.kind == "f" and np.isnan(arr).any():
            return False
        return bool((slot.lo is None or arr.min() >= slot.lo) and (slot.hi is None or arr.max() <= slot.hi))

    def accept(
        self,
        layout: Layout,
        slot: ResolvedBuffer,
        name: str,
        host: np.ndarray,
        size: int,
        label: str,
        strict: bool,
    ) -> Prepared:
        """A host source of a dtype the slot casts safely without a value check, validated."""
        return accept_typed(layout, slot, name, host, size, label, strict)

    def accept_all(
        self,
        layout: Layout,
        sources: dict[str, Any],
        size: int,
        num_reqs: int | None,
        label: str,
        strict: bool,
        device: torch.device,
    ) -> tuple[list[Prepared], bool]:
        """Every source of a mapping validated, in its order, and whether their rows were checked against
        ``num_reqs`` already (then it is the live count)."""
        plain = [type(src) is np.ndarray or type(src) is torch.Tensor for src in sources.values()]
        out = [check_source(layout, name, src, size, label, strict, device) for name, src in sources.items()]
        if not all(plain):  # converting a list (numpy reads the objects in it) or a subclass may run code
            # that changes a source checked before it: check the plain arrays and tensors again after it
            out = [
                check_source(layout, name, src, size, label, strict, device) if again else p
                for p, again, (name, src) in zip(out, plain, sources.items())
            ]
        return out, False

    def write(self, commit: Committer, k: int, items: Sequence[Prepared], size: int) -> int:
        """:func:`write_live` for every item at capture ``size`` into upload copy ``k`` of ``commit`` (its
        slab, written in place), its marks updated; return the bytes touched. A source inside a slab written
        in place (a view of a buffer) is copied first: an earlier write in this refresh could change it after
        it was checked."""
        targets, ends, rows_of, cols_of = commit.targets[k], commit.ends[size], commit.rows, commit.cols
        if commit.host_slab is not None:
            items = [_detached(p, commit.host_slab) for p in items]
        moved = 0
        for slot, host, _, n, w in items:
            i = slot.index
            rows, cols, end = rows_of[i], cols_of[i], ends[i]
            rows_of[i], cols_of[i] = write_live(targets[i], host, slot, n, w, end, rows, cols)
            r, c = rectangle(slot, n, w, end, rows, cols)
            moved += r * c * slot.itemsize
        return moved

    def write_words(
        self, commit: Committer, k: int, items: Sequence[Prepared], size: int, limit: int
    ) -> tuple[Any, ...]:
        """:meth:`write` into an upload copy, and the rectangles it touched, from the marks before it: those
        of slots packed as 4-byte words (``commit.words_of[i]``: word start, words per element, row stride)
        up to ``limit`` words as (word start, rows, row words, row stride), their words, and the rest as
        (prepared, end, rows, cols) (larger ones; a device source's live cells, copied on the device after
        the placement)."""
        ends, words_of = commit.ends[size], commit.words_of
        rects, rest = [], []
        rect_words = 0
        for p in items:
            slot, _, dev, n, w = p
            i = slot.index
            end = ends[i]
            r, c = rectangle(slot, n, w, end, commit.rows[i], commit.cols[i])
            of = words_of[i]
            if of is not None and r and c and r * c * of[1] <= limit:
                rects.append((of[0], r, c * of[1], of[2]))
                rect_words += r * c * of[1]
                if dev is not None:
                    rest.append((p, end, 0, c))
            else:
                rest.append((p, end, r, c))
        return Backend.write(self, commit, k, items, size), rects, rect_words, rest


class NativeBackend(Backend):
    """The C kernel (``graphbuf.buffers._native``), numpy where it declines."""

    def __init__(self, kernel: ModuleType) -> None:
        self._kernel = kernel
        self.packer = kernel
        self.staged = kernel

    def fits(self, slot: ResolvedBuffer, arr: np.ndarray, rows: int, width: int) -> bool:
        got = self._kernel.fit(arr, rows, width, slot.lo, slot.hi)  # None: a dtype it does not check (floats)
        return super().fits(slot, arr, rows, width) if got is None else got  # type: ignore[no-any-return]

    def accept(
        self,
        layout: Layout,
        slot: ResolvedBuffer,
        name: str,
        host: np.ndarray,
        size: int,
        label: str,
        strict: bool,
    ) -> Prepared:
        cap = slot.capacity.get(size)
        if cap is not None:  # None from C: the general path accepts it, clips it or names what is wrong
            got = self._kernel.accept(host, slot.ndim, cap[0], cap[1], slot.lo, slot.hi)
            if got is not None:
                return prepared(slot, host, None, got[0], got[1])
        return super().accept(layout, slot, name, host, size, label, strict)

    def accept_all(
        self,
        layout: Layout,
        sources: dict[str, Any],
        size: int,
        num_reqs: int | None,
        label: str,
        strict: bool,
        device: torch.device,
    ) -> tuple[list[Prepared], bool]:
        got = self._kernel.accept_all(sources, layout.slots, size, num_reqs, Prepared, np.ndarray)
        if got is None:  # a source needs the general path
            return super().accept_all(layout, sources, size, num_reqs, label, strict, device)
        return got, num_reqs is not None  # C took only rows that agree with num_reqs

    def write(self, commit: Committer, k: int, items: Sequence[Prepared], size: int) -> int:
        got = self._kernel.write(
            commit.targets[k], items, commit.ends[size], commit.pads, commit.rows, commit.cols
        )
        if got is None:  # a cast, a misaligned source or an overlap: nothing written
            return super().write(commit, k, items, size)
        return got  # type: ignore[no-any-return]

    def write_words(
        self, commit: Committer, k: int, items: Sequence[Prepared], size: int, limit: int
    ) -> tuple[Any, ...]:
        ends = commit.ends[size]
        got = self._kernel.write(
            commit.targets[k], items, ends, commit.pads, commit.rows, commit.cols, commit.words_of, limit
        )
        if got is None:  # a cast, a misaligned source or an overlap: nothing written
            return super().write_words(commit, k, items, size, limit)
        return got  # type: ignore[no-any-return]


def _detached(p: Prepared, slab: np.ndarray) -> Prepared:
    """``p`` with its live host values copied out when they may lie inside ``slab``."""
    slot, host, dev, n, w = p
    if host is None or not np.may_share_memory(host, slab):
        return p
    return prepared(slot, live_region(host, n, w).copy(), dev, n, w)


def chosen() -> Backend:
    """The backend of buffers built now: native where the kernel was built (:data:`native.KERNEL`), else
    numpy (no C compiler, or ``GRAPHBUF_NATIVE=0``)."""
    return NativeBackend(native.KERNEL) if native.KERNEL is not None else Backend()
