"""The bound front-end: host buffers given once (vLLM's ``CpuGpuBuffer`` style), refreshed by live request
count: each source's live rows (its ``rows`` rule at ``num_reqs``) and live width, checked as
:func:`graphbuf.buffers.validate.check_source` checks a mapping's source (same errors for the same values).

Invariants:
  * a bound torch tensor keeps its address, shape and strides, a bound numpy array its shape and strides
    (``set_``, ``resize_``, ``ndarray.resize`` and ``.shape =`` change them): every refresh compares them and
    raises :class:`AddressChangedError` before anything is read. A numpy array is read through itself, so a
    resize back to the bound shape reads its current memory; rebinding a name in your code binds nothing;
  * bound memory is read only inside a refresh; writing it from another thread meanwhile is a race.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    live_region,
    prepared,
)
from graphbuf.errors import AddressChangedError, RefreshError, RowsError

__all__ = ["BoundSources"]

#: A bound source as each refresh reads it: (slot, numpy array, name, its rows, its columns or None if 1-D).
_Entry = tuple[ResolvedBuffer, np.ndarray, str, int, int | None]


class BoundSources:
    """Host sources bound to the buffers of one :class:`StaticBuffers` (made by :meth:`StaticBuffers.bind`).

    Every buffer not declared ``keep: true`` must be bound. A source is a torch CPU tensor (pinned or not)
    or a plain numpy array of a dtype that casts safely to its buffer's, with contiguous elements in its
    last dimension and at least as many rows as the buffer's largest capture holds; it may be wider than
    the buffer's allocation (only the live width given per refresh is read). ``buffers``: the
    StaticBuffers they were bound to (only those refresh them).
    """

    def __init__(self, buffers: Any, layout: Layout, sources: Any) -> None:
        self.buffers, self._layout = buffers, layout
        if not isinstance(sources, Mapping):
            msg = f"bind(): sources must be a mapping of buffer name to source, got {type(sources).__name__}"
            raise RefreshError(msg)
        items = list(sources.items())  # read once
        self._entries: list[_Entry] = []
        self._tensors: list[Any] = []  # what check_moved watches: a tensor's own numpy view never changes
        self._arrays: list[Any] = []
        for name, src in items:
            slot, arr = _bound_array(layout, name, src)
            if type(src) is torch.Tensor:
                self._tensors.append((name, src, src.data_ptr(), src.shape, src.stride()))
            else:
                self._arrays.append((name, arr, arr.shape, arr.strides))
            width = arr.shape[1] if slot.ndim == 2 else None
            self._entries.append((slot, arr, name, arr.shape[0], width))
        self.names: tuple[str, ...] = tuple(name for name, _ in items)
        if not layout.required.issubset(self.names):
            raise layout.missing_error("bind()", self.names)
        self._wide = frozenset(e[2] for e in self._entries if e[4] is not None)

    def check_moved(self, label: str) -> None:
        """Raise :class:`AddressChangedError` if a bound source changed (the module's first invariant)."""
        for name, t, ptr, shape, stride in self._tensors:
            if t.data_ptr() != ptr or t.shape != shape or t.stride() != stride:
                raise AddressChangedError(
                    f"{label}: bound source {name!r} moved: bound at {ptr:#x} shape {list(shape)} stride "
                    f"{list(stride)}, now {t.data_ptr():#x} shape {list(t.shape)} stride {list(t.stride())}; "
                    "a bound tensor must keep its address and layout (set_ rebinds, resize_ reshapes): bind "
                    "it again"
                )
        for name, arr, shape, strides in self._arrays:
            if arr.shape != shape or arr.strides != strides:
                raise AddressChangedError(
                    f"{label}: bound source {name!r} changed in place: bound with shape {list(shape)} "
                    f"strides {list(strides)}, now shape {list(arr.shape)} strides {list(arr.strides)}; a "
                    "bound numpy array must keep its shape (ndarray.resize and .shape= change it): bind it "
                    "again"
                )

    def prepare(
        self, size: int, num_reqs: Any, widths: Any, label: str, *, strict: bool, device: torch.device | None
    ) -> tuple[list[Prepared], int]:
        """Validate the live rows and widths of every bound source at ``size`` tokens (a capture size, or
        any count for an eager step), and their values unless ``device`` is None (:meth:`sources`: each
        source passed whole); return them prepared and the live request count."""
        layout = self._layout
        n = check_num_reqs(num_reqs, layout.max_requests.get(size), label, size)
        self.check_moved(label)
        w_of = check_widths(widths, self._wide, label) if widths else {}
        fits = layout.backend.fits
        out: list[Prepared] = []
        for slot, arr, name, held, width in self._entries:
            table = slot.rows_of_requests  # layout.rows_at's rule, its table read inline
            rows = table[n] if table is not None and n < len(table) else layout.rows_at(slot, size, n)
            if rows > held:
                rule = slot.plan.rows.text
                msg = f"{n} requests need {rows} rows (rows = {rule}); the bound source has {held}"
                raise layout.fail(RowsError, name, label, msg)
            w = 0 if width is None else w_of.get(name, width) if w_of else width
            if w_of and not 0 <= w <= (width or 0):
                msg = f"width {w} outside the bound source's 0..{width} columns"
                raise layout.fail(RefreshError, name, label, msg)
            if device is not None:  # (None: sources(), values unchecked)
                cap = slot.capacity.get(size)  # None at an eager size
                plain = cap is not None and rows <= cap[0] and w <= cap[1] and arr.dtype in slot.fast
                if plain and slot.bounded and rows and (w or width is None):
                    plain = fits(slot, arr, rows, w)
                if not plain:  # check_source names what is wrong, or cuts the width, as for a mapping
                    live = live_region(arr, rows, w)
                    out.append(check_source(layout, name, live, size, label, strict, device))
                    continue
            out.append(prepared(slot, arr, None, rows, w))  # the whole source, its live region [:rows, :w]
        return out, n

    def refresh(self, size: int, num_reqs: int, *, widths: Mapping[str, int] | None = None) -> int:
        """Shorthand for ``buffers.refresh(size, self, num_reqs=num_reqs, widths=widths)``."""
        return self.buffers.refresh(size, self, num_reqs=num_reqs, widths=widths)  # type: ignore[no-any-return]

    def sources(self, num_reqs: int, widths: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
        """The live rows of every bound source at ``num_reqs`` requests (numpy views, no copy, no value
        checks): what an eager step would read."""
        n = check_num_reqs(num_reqs, None, "sources()")
        size = n * self._layout.tokens_per_request
        live, _ = self.prepare(size, n, widths, "sources()", strict=False, device=None)
        return {s.name: live_region(a, rows, w) for s, a, _, rows, w in live}

    def __repr__(self) -> str:
        return f"BoundSources({', '.join(self.names)})"


def _bound_array(layout: Layout, name: Any, src: Any) -> tuple[ResolvedBuffer, np.ndarray]:
    """``src`` as the numpy array refreshes read, after bind's checks (type, dtype, layout, rows)."""
    label = "bind()"
    slot = layout.slot(label, name)
    arr = src
    if type(src) is not np.ndarray:
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
        arr = src.detach().numpy()
    check_typed(slot, arr, name, label)
    need = max(c[0] for c in slot.capacity.values())
    if arr.shape[0] < need:  # check_typed refused a 0-d source
        raise layout.fail(
            RowsError, name, label,
            f"source has {arr.shape[0]} rows; the largest capture reads up to {need} (rows = "
            f"{slot.plan.rows.text})",
        )  # fmt: skip
    return slot, arr
