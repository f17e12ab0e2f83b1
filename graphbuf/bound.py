"""Bound sources: host buffers given once, refreshed by live request count.

vLLM keeps each step's host-side metadata in persistent CPU buffers (``CpuGpuBuffer``: block tables,
sequence lengths, query offsets, slot mappings) and fills their first rows every step. Binding those
buffers once moves the per-source work of :meth:`StaticBuffers.refresh` (type and layout checks, torch to
numpy conversion) out of the step: a refresh then copies live rows only. Each buffer's live rows follow from
its spec ``rows`` rule at the live request count; a 2-D buffer takes a live width per refresh (its bound
columns past that width are stale and are padded).

Invariants:
  * a bound source is host memory that keeps its address. A torch source's address is compared on every
    refresh: one rebound elsewhere (``set_``) raises :class:`AddressChangedError` before anything is read
    (torch refuses to resize a tensor once it has a numpy view);
  * every refresh validates values exactly as :meth:`StaticBuffers.refresh` does, and one that raises
    changes no byte of any buffer;
  * bound memory is read only inside :meth:`BoundSources.refresh`; writing it from another thread at the
    same time is a race, as with any source.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from graphbuf.errors import AddressChangedError, RefreshError, RowsError, WidthError
from graphbuf.refresh import _NP_OF_TORCH

if TYPE_CHECKING:
    from graphbuf.buffers import StaticBuffers
    from graphbuf.refresh import _Prepared, _Slot

__all__ = ["BoundSources"]

_NO_WIDTHS: dict[str, int] = {}  # never written
# One bound source: (slot, numpy view, fast path, name, 2-D, default width, views by (image, rows, width)).
_Entry = tuple["_Slot", np.ndarray, bool, str, bool, int, dict[tuple[int, int, int], Any]]


class BoundSources:
    """Host sources bound to the buffers of one :class:`StaticBuffers` (made by :meth:`StaticBuffers.bind`).

    Every buffer not declared ``keep: true`` must be bound. A source is a torch CPU tensor (pinned or not)
    or a numpy array of a dtype that casts safely to its buffer's, with contiguous elements in its last
    dimension and at least as many rows as the buffer's largest capture holds; it may be wider than the
    buffer's allocation (only the live width given per refresh is read).
    """

    def __init__(self, buffers: StaticBuffers, sources: Mapping[str, torch.Tensor | np.ndarray]) -> None:
        self.buffers = buffers
        r = buffers._refresher
        self._r = r
        p = buffers.plan
        tpr = p.tokens_per_request
        self._max_requests = {s: s // tpr for s in p.capture_sizes}
        entries: list[_Entry] = []
        watch: list[tuple[str, torch.Tensor, int]] = []
        for name, src in sources.items():
            slot = r._slot("bind()", name)
            if isinstance(src, torch.Tensor):
                if src.device.type != "cpu":
                    raise r._fail(
                        RefreshError, name, "bind()",
                        f"source is on {src.device}; bind() takes host memory (a torch cpu tensor or a numpy "
                        "array); pass device tensors to refresh()",
                    )  # fmt: skip
                if src.dtype not in _NP_OF_TORCH:
                    raise r._fail(
                        RefreshError, name, "bind()",
                        f"dtype {str(src.dtype).removeprefix('torch.')} has no numpy view; bind a source of "
                        "a numpy-compatible dtype or pass it to refresh()",
                    )  # fmt: skip
                arr = src.detach().numpy()
                watch.append((name, src, src.data_ptr()))
            elif isinstance(src, np.ndarray):
                arr = src
            else:
                raise r._fail(
                    RefreshError, name, "bind()",
                    f"unsupported source type {type(src).__name__}; bind() takes memory that keeps its "
                    "address: torch.Tensor (cpu) or numpy.ndarray",
                )  # fmt: skip
            r._check_typed(slot, arr, name, "bind()")
            b = slot.plan
            need = max(slot.capacity[s][0] for s in p.capture_sizes)
            if slot.rows_of_requests is not None:
                need = slot.rows_of_requests[max(self._max_requests.values())]
            if arr.shape[0] < need:
                raise r._fail(
                    RowsError, name, "bind()",
                    f"source has {arr.shape[0]} rows; the largest capture reads up to {need} "
                    f"(rows = {b.rows.text})",
                )  # fmt: skip
            wide = b.ndim == 2
            width = arr.shape[1] if wide else 0
            entries.append((slot, arr, arr.dtype in slot.fast, name, wide, width, {}))
        if not r._required.issubset(sources):
            raise r._missing_error("bind()", sources)
        self._entries = tuple(entries)
        self._watch = tuple(watch)
        self._wide = frozenset(e[3] for e in entries if e[4])
        self._spans = r.spans_of(frozenset(sources))
        self.names: tuple[str, ...] = tuple(sources)

    def _rows(self, slot: _Slot, size: int, n: int) -> int:
        table = slot.rows_of_requests
        return slot.capacity[size][0] if table is None else table[n]

    def _check_call(self, size: int, n: Any, widths: Mapping[str, Any] | None) -> tuple[int, dict[str, int]]:
        """Validate ``size``, ``n``, the bound addresses and ``widths``; return ``n`` and widths as ints."""
        cap = self._max_requests.get(size)
        if cap is None:
            raise self._r._size_error(size)
        if type(n) is not int or not 0 <= n <= cap:
            count = _count(n)
            if count is None or not 0 <= count <= cap:
                raise RowsError(
                    f"refresh(size={size}): num_reqs={n!r}, but capture size {size} holds 0..{cap} "
                    "requests"
                )
            n = count
        self._check_moved(size)
        return n, self._check_widths(widths, size) if widths else _NO_WIDTHS

    def _check_moved(self, where: int | str) -> None:
        """``where``: the capture size being refreshed, or the name of the call (formatted on error only)."""
        for name, t, ptr in self._watch:
            if t.data_ptr() != ptr:
                raise AddressChangedError(
                    f"{self._r._where(where)}: bound source {name!r} moved from {ptr:#x} to "
                    f"{t.data_ptr():#x}; a bound tensor must keep its address (set_ rebound it): "
                    "bind it again"
                )

    def _check_widths(self, widths: Mapping[str, Any], where: int | str) -> dict[str, int]:
        out = {}
        for name, w in widths.items():
            if name not in self._wide:
                wide = ", ".join(sorted(self._wide)) or "none"
                raise RefreshError(
                    f"{self._r._where(where)}: widths[{name!r}]: not a bound 2-D buffer; allowed: {wide}"
                )
            try:
                out[name] = operator.index(w)
            except TypeError:
                raise RefreshError(
                    f"{self._r._where(where)}: widths[{name!r}]: {w!r} is not an integer"
                ) from None
        return out

    def _width(self, e: _Entry, size: int, widths: dict[str, int]) -> int:
        """The live width of 2-D entry ``e`` at ``size``: checked, and cut to the captured allocation under
        ``overflow: truncate``."""
        slot, name = e[0], e[3]
        w = self._source_width(e, widths, size)
        cap_cols = slot.capacity[size][1]
        if w > cap_cols:
            if slot.plan.overflow == "reject":
                raise self._r._fail(
                    WidthError, name, size,
                    f"width {w} is above the captured allocation of {cap_cols} columns "
                    f"(cols = {slot.plan.cols.text}); overflow: reject",  # type: ignore[union-attr]
                )  # fmt: skip
            w = cap_cols
        return w

    def _source_width(self, e: _Entry, widths: dict[str, int], where: int | str) -> int:
        _, arr, _, name, _, w, _ = e
        w = widths.get(name, w)
        if not 0 <= w <= arr.shape[1]:
            raise self._r._fail(
                RefreshError, name, where, f"width {w} outside the bound source's 0..{arr.shape[1]} columns"
            )
        return w

    def sources(self, num_reqs: int, widths: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
        """The live rows of every bound source at ``num_reqs`` requests (numpy views, no copy).

        A mapping :meth:`StaticBuffers.refresh` takes, and what an eager step reads; ``num_reqs`` may
        exceed the largest capture size's as long as the bound sources hold the rows.
        """
        where = "sources()"
        count = _count(num_reqs)
        if count is None or count < 0:
            raise RowsError(f"{where}: num_reqs={num_reqs!r}; allowed: an integer >= 0")
        num_reqs = count
        self._check_moved(where)
        w_of = self._check_widths(widths, where) if widths else _NO_WIDTHS
        p = self.buffers.plan
        env = {**p.constants, "requests": num_reqs, "tokens": num_reqs * p.tokens_per_request}
        out = {}
        for e in self._entries:
            slot, arr, _, name, wide, _, _ = e
            b = slot.plan
            rows = b.shape[0] if slot.rows_of_requests is None else b.rows.eval(env)
            if rows > arr.shape[0]:
                raise self._r._fail(
                    RowsError, name, where,
                    f"{num_reqs} requests need {rows} rows (rows = {b.rows.text}); the bound source has "
                    f"{arr.shape[0]}",
                )  # fmt: skip
            out[name] = arr[:rows, : self._source_width(e, w_of, where)] if wide else arr[:rows]
        return out

    def refresh(self, size: int, num_reqs: int, *, widths: Mapping[str, int] | None = None) -> int:
        """Write the live rows of every bound source into the buffers captured at ``size``; return
        ``num_reqs``.

        Each buffer copies the rows its ``rows`` rule gives at ``num_reqs``; a 2-D buffer copies
        ``widths[name]`` columns (default: the bound source's width) and pads the rest, as
        :meth:`StaticBuffers.refresh` does for a source of that shape. On any error no byte changes.
        """
        if torch._C._autograd._profiler_enabled():
            with torch.profiler.record_function("graphbuf.refresh"):
                return self._refresh(size, num_reqs, widths)
        return self._refresh(size, num_reqs, widths)

    def _refresh(self, size: int, n: int, widths: Mapping[str, int] | None) -> int:
        n, w_of = self._check_call(size, n, widths)
        r = self._r
        k = r._begin()
        for e in self._entries:
            slot, arr, fast, name, wide, w, views = e
            table = slot.rows_of_requests
            rows = slot.capacity[size][0] if table is None else table[n]
            if wide:
                w = w_of.get(name, w)
                if not 0 <= w <= slot.capacity[size][1] or w > arr.shape[1]:
                    w = self._width(e, size, w_of)  # raises, or truncates under overflow: truncate
            if fast:
                # Views of the image and the source per (image, rows, width), made once: assigning
                # between ready views costs less than half of slicing both sides every step.
                key = (k, rows, w)
                v = views.get(key)
                if v is None:
                    v = views[key] = self._views(slot, arr, k, rows, w)
                target, live, tail, last = v
                target[...] = live
                if tail is not None:
                    tail[...] = last
            else:  # float, bfloat16 and keep buffers: the general path checks NaN and writes keep pads
                r._place(r._prepare(name, arr[:rows, :w] if wide else arr[:rows], size, False), k)
        if not r._image_in_bounds(k):
            r._raise_bounds(self._prepared(size, n, w_of), size, k)
        r._commit(k, self._spans)
        return n

    @staticmethod
    def _views(
        slot: _Slot, arr: np.ndarray, k: int, rows: int, w: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        t = slot.targets[k]
        if t.ndim == 2:
            target, live = t[:rows, :w], arr[:rows, :w]
        else:
            target, live = t[:rows], arr[:rows]
        if slot.repeat_last and rows and rows < t.shape[0]:
            return target, live, t[rows:], t[rows - 1 : rows]  # a view: t[rows - 1] of 1-D is a copy
        return target, live, None, None

    def _prepared(self, size: int, n: int, w_of: dict[str, int]) -> list[_Prepared]:
        out: list[_Prepared] = []
        for e in self._entries:
            rows = self._rows(e[0], size, n)
            w = self._width(e, size, w_of) if e[4] else 0
            out.append((e[0], e[1][:rows, :w] if e[4] else e[1][:rows], None, rows, w))
        return out

    def __repr__(self) -> str:
        return f"BoundSources({', '.join(self.names)})"


def _count(n: Any) -> int | None:
    """``n`` as an int if it is an integer (numpy integers included, bool not), else None."""
    if isinstance(n, bool):
        return None
    try:
        return operator.index(n)
    except TypeError:
        return None
