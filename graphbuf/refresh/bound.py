"""The bound front-end: host buffers given once (vLLM's persistent ``CpuGpuBuffer`` style), refreshed by
live request count.

Binding moves the per-source type work out of the step: each refresh takes the live rows (its spec
``rows`` rule at ``num_reqs``) and live width of every bound source and checks only their values
(:func:`graphbuf.refresh.validate.live_fits`; the source is passed whole, its live region given by rows and
width). Anything unusual, and any value out of bounds, goes through the same validation as a mapping
refresh (:func:`graphbuf.refresh.validate.check_source`), so both give the same errors for the same values.

Invariants:
  * a bound torch tensor keeps its address, shape and strides: all three are compared on every refresh
    (``set_`` rebinds the address; ``resize_`` keeps it and changes the shape) and a change raises
    :class:`AddressChangedError` before anything is read;
  * a bound numpy array is held as given: numpy cannot rebind an array, so nothing is watched; rebinding a
    name in your code to a new array does not change what is bound (bind again);
  * bound memory is read only inside a refresh; writing it from another thread meanwhile is a race.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from graphbuf.errors import AddressChangedError, RefreshError, RowsError
from graphbuf.refresh.layout import NP_OF_TORCH, dtype_name
from graphbuf.refresh.validate import (
    Prepared,
    check_num_reqs,
    check_source,
    check_typed,
    check_widths,
    live_fits,
)

if TYPE_CHECKING:
    from graphbuf.buffers import StaticBuffers

__all__ = ["BoundSources"]

_NO_WIDTHS: dict[str, int] = {}  # never written


class BoundSources:
    """Host sources bound to the buffers of one :class:`StaticBuffers` (made by :meth:`StaticBuffers.bind`).

    Every buffer not declared ``keep: true`` must be bound. A source is a torch CPU tensor (pinned or not)
    or a plain numpy array of a dtype that casts safely to its buffer's, with contiguous elements in its
    last dimension and at least as many rows as the buffer's largest capture holds; it may be wider than
    the buffer's allocation (only the live width given per refresh is read).
    """

    def __init__(self, buffers: StaticBuffers, sources: Any) -> None:
        self.buffers = buffers
        layout = buffers.layout
        self._layout = layout
        label = "bind()"
        if not isinstance(sources, Mapping):
            raise RefreshError(
                f"{label}: sources must be a mapping of buffer name to source, got {type(sources).__name__}"
            )
        entries = []
        watch = []
        for name, src in sources.items():
            slot = layout.slot(label, name)
            if type(src) is torch.Tensor:
                if src.device.type != "cpu":
                    raise layout.fail(
                        RefreshError, name, label,
                        f"source is on {src.device}; bind() takes host memory (a torch cpu tensor or a numpy "
                        "array); pass device tensors to refresh()",
                    )  # fmt: skip
                if (
                    src.dtype not in NP_OF_TORCH
                    or src.layout != torch.strided
                    or src.is_conj()
                    or src.is_neg()
                ):
                    raise layout.fail(
                        RefreshError, name, label,
                        f"a {dtype_name(src.dtype)} {dtype_name(src.layout)} tensor has no numpy view; "
                        "bind a dense tensor of a numpy-compatible dtype or pass it to refresh()",
                    )  # fmt: skip
                arr = src.detach().numpy()
                watch.append((name, src, src.data_ptr(), src.shape, src.stride()))
            elif type(src) is np.ndarray:
                arr = src
            else:
                raise layout.fail(
                    RefreshError, name, label,
                    f"unsupported source type {type(src).__name__}; bind() takes memory that keeps its "
                    "address: torch.Tensor (cpu) or a plain numpy.ndarray",
                )  # fmt: skip
            check_typed(slot, arr, name, label)
            b = slot.plan
            need = max(c[0] for c in slot.capacity.values())
            if arr.ndim == 0 or arr.shape[0] < need:
                raise layout.fail(
                    RowsError, name, label,
                    f"source has {arr.shape[0] if arr.ndim else 0} rows; the largest capture reads up to "
                    f"{need} (rows = {b.rows.text})",
                )  # fmt: skip
            wide = b.ndim == 2
            # Typed once here: a slice of a plain integer array of a fast dtype needs only shape and value
            # checks per refresh (see prepare); every other bound source goes through check_source.
            fast = arr.dtype in slot.fast
            entries.append((slot, arr, name, wide, arr.shape[1] if wide else 0, fast))
        if not layout.required.issubset(sources):
            raise layout.missing_error(label, sources)
        self._entries = tuple(entries)
        # Per capture size, per entry: the live rows and columns the fast path accepts (within the source
        # and the capacity); no entry when some source needs check_source on every refresh.
        self._limits: dict[int, tuple[tuple[int, int], ...]] = {}
        if all(e[5] for e in entries):
            for s in layout.plan.capture_sizes:
                self._limits[s] = tuple(
                    (min(e[1].shape[0], e[0].capacity[s][0]), min(e[4], e[0].capacity[s][1]) if e[3] else 0)
                    for e in entries
                )
        self._watch = tuple(watch)
        self._wide = frozenset(e[2] for e in entries if e[3])
        self.names: tuple[str, ...] = tuple(sources)

    def check_moved(self, label: str) -> None:
        """Raise :class:`AddressChangedError` if a bound tensor changed address, shape or strides."""
        for name, t, ptr, shape, stride in self._watch:
            if t.data_ptr() != ptr or t.shape != shape or t.stride() != stride:
                raise AddressChangedError(
                    f"{label}: bound source {name!r} moved: bound at {ptr:#x} shape {list(shape)} stride "
                    f"{list(stride)}, now {t.data_ptr():#x} shape {list(t.shape)} stride {list(t.stride())}; "
                    "a bound tensor must keep its address and layout (set_ rebinds, resize_ reshapes): bind "
                    "it again"
                )

    def _live(self, size: int, n: int, widths: Any, label: str) -> Iterator[tuple[Any, str, np.ndarray]]:
        """(slot, name, live rows × live width view) of every bound source at ``n`` requests of ``size``
        tokens, after the moved/widths/rows checks; values are not checked here."""
        layout = self._layout
        self.check_moved(label)
        w_of = check_widths(widths, self._wide, label) if widths else _NO_WIDTHS
        for slot, arr, name, wide, width, _ in self._entries:
            table = slot.rows_of_requests
            rows = table[n] if table is not None and n < len(table) else layout.rows_at(slot, size, n)
            if rows > arr.shape[0]:
                raise layout.fail(
                    RowsError, name, label,
                    f"{n} requests need {rows} rows (rows = {slot.plan.rows.text}); the bound source has "
                    f"{arr.shape[0]}",
                )  # fmt: skip
            if wide:
                w = w_of.get(name, width)
                if not 0 <= w <= arr.shape[1]:
                    raise layout.fail(
                        RefreshError,
                        name,
                        label,
                        f"width {w} outside the bound source's 0..{arr.shape[1]} columns",
                    )
                yield slot, name, arr[:rows, :w]
            else:
                yield slot, name, arr[:rows]

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
        self.check_moved(label)
        w_of = check_widths(widths, self._wide, label) if widths else _NO_WIDTHS
        prepared: list[Prepared] = []
        append = prepared.append
        for (slot, arr, name, wide, width, _), (max_rows, max_cols) in zip(self._entries, limits):
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
            if slot.bounded and rows and (w or not wide) and not live_fits(slot, arr, rows, w):
                return None
            append((slot, arr, None, rows, w))  # the whole source: its live region is [:rows, :w]
        return prepared

    def _prepare_checked(
        self, size: int, n: int, widths: Any, label: str, *, strict: bool, device: torch.device
    ) -> list[Prepared]:
        """Every bound source through :func:`check_source`: the general path, and the one that names what
        is wrong."""
        layout = self._layout
        return [
            check_source(layout, name, live, size, label, strict=strict, device=device)
            for _, name, live in self._live(size, n, widths, label)
        ]

    def refresh(self, size: int, num_reqs: int, *, widths: Mapping[str, int] | None = None) -> int:
        """Same as ``buffers.refresh(size, self, num_reqs=num_reqs, widths=widths)``."""
        return self.buffers.refresh(size, self, num_reqs=num_reqs, widths=widths)

    def sources(self, num_reqs: int, widths: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
        """The live rows of every bound source at ``num_reqs`` requests (numpy views, no copy, no value
        checks): what an eager step would read."""
        label = "sources()"
        n = check_num_reqs(num_reqs, None, label)
        size = n * self._layout.tokens_per_request
        return {name: live for _, name, live in self._live(size, n, widths, label)}

    def __repr__(self) -> str:
        return f"BoundSources({', '.join(self.names)})"
