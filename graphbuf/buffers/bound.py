"""The bound front-end: host buffers given once (vLLM's persistent ``CpuGpuBuffer`` style), refreshed by
live request count.

Binding moves the per-source type work out of the step: each refresh takes the live rows (its spec
``rows`` rule at ``num_reqs``) and live width of every bound source and checks only their values
(:func:`graphbuf.buffers.validate.live_fits`; the source is passed whole, its live region given by rows and
width). Anything unusual, and any value out of bounds, goes through the same validation as a mapping
refresh (:func:`graphbuf.buffers.validate.check_source`), so both give the same errors for the same values.

Invariants:
  * a bound torch tensor keeps its address, shape and strides: all three are compared on every refresh
    (``set_`` rebinds the address; ``resize_`` keeps it and changes the shape) and a change raises
    :class:`AddressChangedError` before anything is read;
  * a bound numpy array keeps its shape and strides: both are compared on every refresh
    (``arr.resize(..., refcheck=False)`` and ``arr.shape = ...`` change them in place) and a change raises
    :class:`AddressChangedError` before anything is read. Its data is read through the array itself, so
    a resize that ends at the bound shape reads the array's current memory. Rebinding a name in your code
    to a new array does not change what is bound (bind again);
  * bound memory is read only inside a refresh; writing it from another thread meanwhile is a race.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from graphbuf.buffers.layout import NP_OF_TORCH, Layout, ResolvedBuffer, dtype_name
from graphbuf.buffers.validate import (
    Prepared,
    check_num_reqs,
    check_source,
    check_typed,
    check_widths,
)
from graphbuf.errors import AddressChangedError, RefreshError, RowsError

__all__ = ["BoundSources", "Entry"]

_new_tuple = tuple.__new__  # builds a Prepared without its constructor's argument binding (hot loop)

_NO_WIDTHS: dict[str, int] = {}  # never written


@dataclass(slots=True, frozen=True)
class Entry:
    """One bound source, resolved at bind: what each refresh reads of it."""

    slot: ResolvedBuffer
    arr: np.ndarray  # the source as numpy (a torch tensor's view); its live region is [:rows, :width]
    name: str
    wide: bool  # a 2-D buffer
    width: int  # the source's columns (0 for 1-D): the live width when widths= does not name it
    fast: bool  # typed at bind: a plain integer array of a dtype the fast path takes
    shape: tuple[int, ...]  # arr's shape and strides at bind
    strides: tuple[int, ...]
    watched: bool  # a numpy array the caller holds: shape and strides compared on every refresh (a torch
    # tensor's view is covered by the tensor's own watch: address, shape, strides)

    def unpacked(
        self,
    ) -> tuple[ResolvedBuffer, np.ndarray, str, bool, int, bool, tuple[int, ...], tuple[int, ...]]:
        """``(slot, arr, name, wide, width, watched, shape, strides)``: the form the per-refresh loop
        unpacks by name (measured: six attribute reads per source cost ~1 µs per 6-source refresh)."""
        return (self.slot, self.arr, self.name, self.wide, self.width, self.watched, self.shape, self.strides)


class BoundSources:
    """Host sources bound to the buffers of one :class:`StaticBuffers` (made by :meth:`StaticBuffers.bind`).

    Every buffer not declared ``keep: true`` must be bound. A source is a torch CPU tensor (pinned or not)
    or a plain numpy array of a dtype that casts safely to its buffer's, with contiguous elements in its
    last dimension and at least as many rows as the buffer's largest capture holds; it may be wider than
    the buffer's allocation (only the live width given per refresh is read). ``buffers``: the
    StaticBuffers they were bound to (only those refresh them).
    """

    def __init__(self, buffers: Any, layout: Layout, sources: Any) -> None:
        self.buffers = buffers
        self._layout = layout
        label = "bind()"
        if not isinstance(sources, Mapping):
            raise RefreshError(
                f"{label}: sources must be a mapping of buffer name to source, got {type(sources).__name__}"
            )
        items = list(sources.items())  # read once
        entries = []
        watch = []
        for name, src in items:
            arr = self._host_array(layout, name, src, label)
            if type(src) is torch.Tensor:
                watch.append((name, src, src.data_ptr(), src.shape, src.stride()))
            entries.append(self._entry(layout, name, arr, label, type(src) is np.ndarray))
        names = [name for name, _ in items]
        if not layout.required.issubset(names):
            raise layout.missing_error(label, names)
        self._entries = tuple(entries)
        self._unpacked = tuple(e.unpacked() for e in entries)
        # Per capture size, per entry: the live rows and columns the fast path accepts (within the source
        # and the capacity); no entry when some source needs check_source on every refresh.
        self._limits: dict[int, tuple[tuple[int, int], ...]] = {}
        if all(e.fast for e in entries):
            for s in layout.plan.capture_sizes:
                caps = [e.slot.capacity[s] for e in entries]
                self._limits[s] = tuple(
                    (min(e.shape[0], c[0]), min(e.width, c[1]) if e.wide else 0)
                    for e, c in zip(entries, caps)
                )
        self._watch = tuple(watch)
        self._wide = frozenset(e.name for e in entries if e.wide)
        self.names: tuple[str, ...] = tuple(names)

    @staticmethod
    def _host_array(layout: Layout, name: Any, src: Any, label: str) -> np.ndarray:
        layout.slot(label, name)
        if type(src) is np.ndarray:
            return src
        if type(src) is not torch.Tensor:
            raise layout.fail(
                RefreshError, name, label,
                f"unsupported source type {type(src).__name__}; bind() takes memory that keeps its "
                "address: torch.Tensor (cpu) or a plain numpy.ndarray",
            )  # fmt: skip
        if src.device.type != "cpu":
            raise layout.fail(
                RefreshError, name, label,
                f"source is on {src.device}; bind() takes host memory (a torch cpu tensor or a numpy "
                "array); pass device tensors to refresh()",
            )  # fmt: skip
        if src.dtype not in NP_OF_TORCH or src.layout != torch.strided or src.is_conj() or src.is_neg():
            raise layout.fail(
                RefreshError, name, label,
                f"a {dtype_name(src.dtype)} {dtype_name(src.layout)} tensor has no numpy view; "
                "bind a dense tensor of a numpy-compatible dtype or pass it to refresh()",
            )  # fmt: skip
        return src.detach().numpy()

    @staticmethod
    def _entry(layout: Layout, name: str, arr: np.ndarray, label: str, watched: bool) -> Entry:
        slot = layout.slot(label, name)
        check_typed(slot, arr, name, label)
        need = max(c[0] for c in slot.capacity.values())
        if arr.ndim == 0 or arr.shape[0] < need:
            raise layout.fail(
                RowsError, name, label,
                f"source has {arr.shape[0] if arr.ndim else 0} rows; the largest capture reads up to "
                f"{need} (rows = {slot.plan.rows.text})",
            )  # fmt: skip
        wide = slot.plan.ndim == 2
        # Typed once here: a slice of a plain integer array of a fast dtype needs only shape and value
        # checks per refresh (see prepare); every other bound source goes through check_source.
        width = arr.shape[1] if wide else 0
        return Entry(slot, arr, name, wide, width, arr.dtype in slot.fast, arr.shape, arr.strides, watched)

    def check_moved(self, label: str) -> None:
        """Raise :class:`AddressChangedError` if a bound tensor changed address, shape or strides, or a bound
        numpy array its shape or strides."""
        self._check_tensors(label)
        for e in self._entries:
            arr = e.arr
            if e.watched and (arr.shape != e.shape or arr.strides != e.strides):
                raise AddressChangedError(
                    f"{label}: bound source {e.name!r} changed in place: bound with shape {list(e.shape)} "
                    f"strides {list(e.strides)}, now shape {list(arr.shape)} strides {list(arr.strides)}; a "
                    "bound numpy array must keep its shape (ndarray.resize and .shape= change it): bind it "
                    "again"
                )

    def _check_tensors(self, label: str) -> None:
        for name, t, ptr, shape, stride in self._watch:
            if t.data_ptr() != ptr or t.shape != shape or t.stride() != stride:
                raise AddressChangedError(
                    f"{label}: bound source {name!r} moved: bound at {ptr:#x} shape {list(shape)} stride "
                    f"{list(stride)}, now {t.data_ptr():#x} shape {list(t.shape)} stride {list(t.stride())}; "
                    "a bound tensor must keep its address and layout (set_ rebinds, resize_ reshapes): bind "
                    "it again"
                )

    def _live(self, size: int, n: int, widths: Any, label: str) -> Iterator[tuple[str, np.ndarray]]:
        """(name, live rows × live width view) of every bound source at ``n`` requests of ``size`` tokens,
        after the moved/widths/rows checks; values are not checked here."""
        layout = self._layout
        self.check_moved(label)
        w_of = check_widths(widths, self._wide, label) if widths else _NO_WIDTHS
        for e in self._entries:
            slot, arr, name = e.slot, e.arr, e.name
            table = slot.rows_of_requests
            rows = table[n] if table is not None and n < len(table) else layout.rows_at(slot, size, n)
            if rows > arr.shape[0]:
                raise layout.fail(
                    RowsError, name, label,
                    f"{n} requests need {rows} rows (rows = {slot.plan.rows.text}); the bound source has "
                    f"{arr.shape[0]}",
                )  # fmt: skip
            if e.wide:
                w = w_of.get(name, e.width)
                if not 0 <= w <= arr.shape[1]:
                    raise layout.fail(
                        RefreshError, name, label,
                        f"width {w} outside the bound source's 0..{arr.shape[1]} columns",
                    )  # fmt: skip
                yield name, arr[:rows, :w]
            else:
                yield name, arr[:rows]

    def prepare(
        self, size: int, num_reqs: Any, widths: Any, label: str, *, strict: bool, device: torch.device
    ) -> tuple[list[Prepared], int]:
        """Validate the live rows and widths of every bound source at ``size`` tokens (a capture size, or
        any count for an eager step); return them prepared and the live request count."""
        n = check_num_reqs(num_reqs, self._layout.max_requests.get(size, None), label, size)
        limits = self._limits.get(size)
        if limits is not None:  # every source typed at bind, a capture size: the fast path may apply
            prepared = self._prepare_fast(limits, n, widths, label)
            if prepared is not None:
                return prepared, n
        return self._prepare_checked(size, n, widths, label, strict=strict, device=device), n

    def _prepare_fast(
        self, limits: tuple[tuple[int, int], ...], n: int, widths: Any, label: str
    ) -> list[Prepared] | None:
        """The common refresh: every live slice within its source and capacity (``limits``: per entry the
        smaller of the two, rows and columns) and its values within bounds. None if anything is not, for
        :meth:`_prepare_checked` to raise or handle (overflow) exactly as a mapping refresh would."""
        if self._watch:
            self._check_tensors(label)
        w_of = check_widths(widths, self._wide, label) if widths else _NO_WIDTHS
        prepared: list[Prepared] = []
        append = prepared.append
        fits = self._layout.backend.fits
        for (slot, arr, name, wide, width, watched, shape, strides), (max_rows, max_cols) in zip(
            self._unpacked, limits
        ):
            if watched and (arr.shape != shape or arr.strides != strides):
                return None  # changed in place: check_moved names it
            table = slot.rows_of_requests
            rows = table[n] if table is not None else max_rows  # n is within the table at capture sizes
            if rows > max_rows:
                return None
            if wide:
                w = w_of.get(name, width) if w_of else width
                if not 0 <= w <= max_cols:
                    return None
            else:
                w = 0
            if slot.bounded and rows and (w or not wide) and not fits(slot, arr, rows, w):
                return None
            # the whole source: its live region is [:rows, :w]
            append(_new_tuple(Prepared, (slot, arr, None, rows, w)))
        return prepared

    def _prepare_checked(
        self, size: int, n: int, widths: Any, label: str, *, strict: bool, device: torch.device
    ) -> list[Prepared]:
        """Every bound source through :func:`check_source`: the general path, and the one that names what
        is wrong."""
        layout = self._layout
        return [
            check_source(layout, name, live, size, label, strict=strict, device=device)
            for name, live in self._live(size, n, widths, label)
        ]

    def refresh(self, size: int, num_reqs: int, *, widths: Mapping[str, int] | None = None) -> int:
        """Shorthand for ``buffers.refresh(size, self, num_reqs=num_reqs, widths=widths)`` (the one refresh;
        nothing else happens here)."""
        return self.buffers.refresh(size, self, num_reqs=num_reqs, widths=widths)  # type: ignore[no-any-return]

    def sources(self, num_reqs: int, widths: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
        """The live rows of every bound source at ``num_reqs`` requests (numpy views, no copy, no value
        checks): what an eager step would read."""
        label = "sources()"
        n = check_num_reqs(num_reqs, None, label)
        size = n * self._layout.tokens_per_request
        return dict(self._live(size, n, widths, label))

    def __repr__(self) -> str:
        return f"BoundSources({', '.join(self.names)})"
