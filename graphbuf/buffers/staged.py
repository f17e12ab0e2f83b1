"""Staged writes: say what changed in a buffer's host state; the next refresh checks and uploads only that.

The write API mirrors what servers do to persistent metadata (vLLM's ``BlockTable``): set or append values
in a row from a column, set a whole row, move or swap rows (batch condensing), clear a row, and scatter many
cells at once. :meth:`graphbuf.StaticBuffers.stage` returns a :class:`StagedBuffer` per buffer.

Model. A staged buffer has a *host state*: an array of the buffer's whole allocation (its shape at the
largest capture size), all pad until its first staged write, when it takes the buffer's current contents
(a one-time read). Staged writes change the host state at once and are recorded as changed cells. The next
``refresh(size, sources, num_reqs=n)`` that leaves the buffer out of ``sources`` commits it: afterwards the
buffer holds exactly what a full refresh with source ``host[:rows]`` (``rows``: the spec's rows at ``n``
requests) would write. A buffer given whole in a refresh takes that source as its host state (rows past
the live rows become pad); giving it whole while it has uncommitted staged writes is an error.

Cost. A commit reads and writes only the changed cells of live rows, the whole used width of rows that
enter the live range (``n`` grew), and the cells the high-water marks say must be cleared (``n`` shrank).
Only those values are checked, with the rules of a full refresh; on a failure the live region goes through
:func:`graphbuf.buffers.validate.check_values`, so the error type and message are a full refresh's.

Rejected commits. Staged values are checked when a refresh commits them, every check before any write: a
refresh that raises changes no byte of the buffers, and its staged writes stay staged (the host state keeps
them); stage new values over the rejected cells and refresh again.

Uploads. On a cpu slab written in place the cells are copied from the host states into the slab. Staged
(every accelerator; a cpu slab with ``staging=N``) the cells of all staged buffers of a refresh are packed
into one host arena (element indices, then values), uploaded in one non-blocking copy and scattered with
one indexed write per element size (1, 2, 4 or 8 bytes), not one per buffer. The ``depth`` arenas take
turns behind an event, as the staging copies of a full refresh do.

Two host states, one behaviour. With the native kernel (``graphbuf/buffers/_staged.c``,
:data:`graphbuf.buffers.native.STAGED`) a host state, its changed cells and its write methods live in C:
a write whose arguments are already plain (int rows and columns inside the allocation; values a contiguous
1-D array of the buffer's element type, or a list of ints that fit it) runs without a Python frame; any
other goes through the same Python checks (:class:`_Checks`) first. On a cpu slab written in place the
whole commit is one native call made before the refresh writes its full sources: every staged check, then
every staged write (it steps aside, writing nothing, when a value fails, so that the Python commit names
the error, or when a full source lies inside the slab, where the staged writes would change it after its
check). Without the kernel (no C compiler, ``GRAPHBUF_NATIVE=0``) the Python host state does the same in
numpy. Both write the same bytes and raise the same errors (``tests/unit/buffers/test_staged_native.py``,
and the state machine of ``test_staged_state_machine.py`` on both).

Limits: buffers padded ``repeat_last``, ``bfloat16`` buffers and buffers whose width differs between
capture sizes take full refreshes only (:meth:`StagingArea.buffer` says so).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch

from graphbuf.buffers import native
from graphbuf.buffers.commit import Committer
from graphbuf.buffers.layout import NP_OF_TORCH, Layout, Slot, dtype_name
from graphbuf.buffers.validate import Prepared, check_typed, check_values, live_fits
from graphbuf.errors import RefreshError, RowsError, WidthError
from graphbuf.exclusive import Exclusive

__all__ = ["StagedBuffer", "StagingArea"]

_INT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_EMPTY = np.zeros(0, dtype=np.int64)
_FEW = 8  # up to this many runs are expanded one arange each
_OPS = ("set", "append", "set_row", "clear_row", "move_row", "swap_rows", "scatter")


def _expand(runs: np.ndarray) -> np.ndarray:
    """Flat indices of ``runs`` (an n × 2 array of [start, stop) ranges), vectorized (a few runs: one
    ``arange`` each, cheaper than the cumulative sums)."""
    if runs.shape[0] <= _FEW:
        parts = [np.arange(a, b, dtype=np.int64) for a, b in runs.tolist() if b > a]
        if not parts:
            return _EMPTY
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
    starts, lengths = runs[:, 0], runs[:, 1] - runs[:, 0]
    keep = lengths > 0
    if not keep.all():
        starts, lengths = starts[keep], lengths[keep]
    total = int(lengths.sum())
    if not total:
        return _EMPTY
    ends = np.cumsum(lengths)
    base = np.repeat(starts - (ends - lengths), lengths)
    return base + np.arange(total, dtype=np.int64)


class _Checks:
    """The stage-time checks of one staged buffer: every write's arguments in plain form (int rows and
    columns inside the allocation, values a contiguous 1-D array of the buffer's element type), or the
    error naming what is wrong. Both host-state kinds use them: the Python one on every write, the native
    one (``graphbuf.buffers._staged``) on any argument it does not take as it is."""

    slot: Slot
    host: np.ndarray
    lens: np.ndarray | None
    rows: int
    width: int
    wide: bool
    guard: Exclusive

    def _init_shape(self, slot: Slot, host: np.ndarray, lens: np.ndarray | None, guard: Exclusive) -> None:
        self.slot = slot
        self.host = host  # the whole allocation, numpy element type of the slot
        self.flat = host.reshape(-1)
        self.lens = lens  # 2-D: per row, the columns that may differ from the pad (the rest is pad)
        self.rows = host.shape[0]
        self.wide = host.ndim == 2
        self.width = host.shape[1] if self.wide else 1
        self.guard = guard

    @property
    def name(self) -> str:
        return self.slot.name

    def _busy(self, op: str) -> None:
        raise self.guard.busy(f"{op}()")

    def _normalize(self, op: str, *args: Any) -> tuple[Any, ...]:
        """``op``'s arguments in plain form, or the error (at stage time) that names what is wrong."""
        if op == "set":
            row, values, col = args
            arr = self._values(values, "set")
            k = arr.shape[0]
            if self.wide:
                r = self._row(row, "set")
                return r, arr, self._col(col, k, "set")
            if col != 0 or isinstance(col, bool):
                raise WidthError(f"set(): buffer {self.name!r}: 1-D buffer; col must be 0, got {col!r}")
            r = self._row(row, "set")
            if r + k > self.rows:
                raise RowsError(
                    f"set(): buffer {self.name!r}: rows {r}..{r + k - 1} reach outside the captured "
                    f"allocation of {self.rows} rows"
                )
            return r, arr, 0
        if op == "append":
            row, values = args
            if self.lens is None:
                raise RefreshError(f"append(): buffer {self.name!r} is 1-D; use set(row, values)")
            r = self._row(row, "append")
            arr = self._values(values, "set")
            self._col(int(self.lens[r]), arr.shape[0], "set")
            return r, arr
        if op == "set_row":
            row, values = args
            r = self._row(row, "set_row")
            arr = self._values(values, "set_row")
            k = arr.shape[0]
            if not self.wide and k != 1:
                raise RefreshError(f"set_row(): buffer {self.name!r} is 1-D; a row is one value, got {k}")
            if self.wide:
                self._col(0, k, "set_row")
            return r, arr
        if op in ("clear_row", "move_row", "swap_rows"):
            return tuple(self._row(a, op) for a in args)
        if op == "scatter":
            return self._scatter_args(*args)
        raise ValueError(f"_normalize: unknown op {op!r}")

    def _scatter_args(self, rows: Any, values: Any, cols: Any) -> tuple[Any, ...]:
        r = np.ascontiguousarray(np.asarray(rows, dtype=np.int64).reshape(-1))
        arr = self._values(values, "scatter")
        if arr.shape[0] != r.shape[0]:
            raise RefreshError(
                f"scatter(): buffer {self.name!r}: {r.shape[0]} rows but {arr.shape[0]} values"
            )
        if not r.shape[0]:
            return None, None, None
        lo, hi = int(r.min()), int(r.max())
        if lo < 0 or hi >= self.rows:
            bad = lo if lo < 0 else hi
            raise RowsError(
                f"scatter(): buffer {self.name!r}: row {bad} outside the captured allocation of "
                f"{self.rows} rows"
            )
        if not self.wide:
            if cols is not None:
                raise WidthError(f"scatter(): buffer {self.name!r} is 1-D; cols must be None")
            return r, arr, None
        if cols is None:
            raise RefreshError(f"scatter(): buffer {self.name!r} is 2-D; pass cols=")
        c = np.ascontiguousarray(np.asarray(cols, dtype=np.int64).reshape(-1))
        if c.shape[0] != r.shape[0]:
            raise RefreshError(f"scatter(): buffer {self.name!r}: {r.shape[0]} rows but {c.shape[0]} cols")
        clo, chi = int(c.min()), int(c.max())
        if clo < 0 or chi >= self.width:
            bad = clo if clo < 0 else chi
            raise WidthError(
                f"scatter(): buffer {self.name!r}: column {bad} outside the captured allocation of "
                f"{self.width} columns"
            )
        return r, arr, c

    def _row(self, row: Any, op: str) -> int:
        if type(row) is not int:
            if isinstance(row, bool) or not isinstance(row, (int, np.integer)):
                raise RowsError(f"{op}(): buffer {self.name!r}: row {row!r} is not an integer")
            row = int(row)
        if not 0 <= row < self.rows:
            raise RowsError(
                f"{op}(): buffer {self.name!r}: row {row} outside the captured allocation of {self.rows} rows"
            )
        return row

    def _col(self, col: Any, k: int, op: str) -> int:
        if type(col) is not int:
            if isinstance(col, bool) or not isinstance(col, (int, np.integer)):
                raise WidthError(f"{op}(): buffer {self.name!r}: column {col!r} is not an integer")
            col = int(col)
        if col < 0 or col + k > self.width:
            raise WidthError(
                f"{op}(): buffer {self.name!r}: columns {col}..{col + k - 1} reach outside the captured "
                f"allocation of {self.width} columns"
            )
        return col

    def _values(self, values: Any, op: str) -> np.ndarray:
        """``values`` as a contiguous 1-D array of the buffer's dtype, holding them exactly (the cast rules
        of a full refresh)."""
        slot = self.slot
        tp = type(values)
        listed = False
        if tp is np.ndarray:
            arr = values
        elif tp is torch.Tensor or isinstance(values, torch.Tensor):
            if values.device.type != "cpu" or values.dtype not in NP_OF_TORCH:
                raise RefreshError(
                    f"{op}(): buffer {self.name!r}: a {dtype_name(values.dtype)} tensor on {values.device}; "
                    "staged values are host numbers (a cpu tensor of a numpy dtype, an array or a list)"
                )
            arr = values.detach().numpy()
        else:
            arr = np.asarray(values)
            listed = True
        if arr.ndim != 1:
            arr = arr.reshape(-1) if arr.ndim == 0 else arr
            if arr.ndim != 1:
                raise RefreshError(
                    f"{op}(): buffer {self.name!r}: values of shape {list(arr.shape)}; pass one row (1-D)"
                )
        want = slot.np_dtype
        if arr.dtype == want or not arr.size:
            return np.ascontiguousarray(arr, dtype=want)
        if listed and arr.dtype.kind in "iu" and slot.kind in "iu":
            info = np.iinfo(want)
            amin, amax = int(arr.min()), int(arr.max())
            if amin < info.min or amax > info.max:
                raise RefreshError(
                    f"{op}(): buffer {self.name!r}: values {amin}..{amax} do not fit "
                    f"{dtype_name(slot.plan.dtype)} ({info.min}..{info.max})"
                )
            return arr.astype(want)
        if listed and arr.dtype.kind in "iuf" and slot.kind == "f":
            out = arr.astype(want)
            if not np.array_equal(np.isfinite(out), np.isfinite(arr)):
                raise RefreshError(
                    f"{op}(): buffer {self.name!r}: values do not fit {dtype_name(slot.plan.dtype)}"
                )
            return out
        shaped = arr.reshape(1, -1) if slot.ndim == 2 else arr
        check_typed(slot, np.ascontiguousarray(shaped), self.name, f"{op}()")  # raises a refresh's message
        return np.ascontiguousarray(arr, dtype=want)


class _PyMirror(_Checks):
    """One staged buffer's host state and its uncommitted changes (flat element indices), in Python: the
    path without the native kernel, the same writes as :class:`_NativeMirror`'s."""

    def __init__(
        self, slot: Slot, host: np.ndarray, lens: np.ndarray | None, colmax: int, top: int, guard: Exclusive
    ) -> None:
        self._init_shape(slot, host, lens, guard)
        self.runs: list[tuple[int, int]] = []  # changed [start, stop) ranges of flat indices
        self.cells: list[np.ndarray] = []  # changed flat indices, scattered
        self.colmax = colmax  # bound of every row's lens (the column high-water mark a commit leaves)
        self.top = top  # rows at and past top hold the pad

    @property
    def pending(self) -> bool:
        return bool(self.runs or self.cells)

    def single(self) -> tuple[int, int] | None:
        return self.runs[0] if len(self.runs) == 1 and not self.cells else None

    def clear(self) -> None:
        self.runs.clear()
        self.cells.clear()

    def changed(self) -> np.ndarray:
        """Every changed flat index (a cell staged twice appears twice), as one int64 array."""
        runs, cells = self.runs, self.cells
        parts = list(cells)
        if runs:
            if len(runs) <= _FEW:
                parts.extend(np.arange(a, b, dtype=np.int64) for a, b in runs)
            else:
                parts.append(_expand(np.array(runs, dtype=np.int64)))
        if not parts:
            return _EMPTY
        # A cell staged twice is written (and counted) twice: deduplicating costs more than the write.
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def set(self, row: Any, values: Any, col: Any = 0) -> None:
        with self.guard.hold("set()"):
            self._set(*self._normalize("set", row, values, col))

    def append(self, row: Any, values: Any) -> None:
        with self.guard.hold("append()"):
            r, arr = self._normalize("append", row, values)
            self._set(r, arr, int(self.lens[r]))  # type: ignore[index]

    def _set(self, r: int, arr: np.ndarray, c: int) -> None:
        k = arr.shape[0]
        if self.wide:
            self.host[r, c : c + k] = arr
            if c + k > self.lens[r]:  # type: ignore[index]
                self.lens[r] = c + k  # type: ignore[index]
                if c + k > self.colmax:
                    self.colmax = c + k
            start = r * self.width + c
            self.runs.append((start, start + k))
            if r >= self.top:
                self.top = r + 1
        else:
            self.host[r : r + k] = arr
            self.runs.append((r, r + k))
            if r + k > self.top:
                self.top = r + k

    def set_row(self, row: Any, values: Any) -> None:
        with self.guard.hold("set_row()"):
            r, arr = self._normalize("set_row", row, values)
            k = arr.shape[0]
            if not self.wide:
                self.host[r] = arr[0]
                self.runs.append((r, r + 1))
            else:
                lens = self.lens
                old = int(lens[r])  # type: ignore[index]
                self.host[r, :k] = arr
                if old > k:
                    self.host[r, k:old] = self.slot.pad
                lens[r] = k  # type: ignore[index]
                if k > self.colmax:
                    self.colmax = k
                start = r * self.width
                self.runs.append((start, start + max(k, old)))
            if r >= self.top:
                self.top = r + 1

    def clear_row(self, row: Any) -> None:
        with self.guard.hold("clear_row()"):
            (r,) = self._normalize("clear_row", row)
            if self.wide:
                old = int(self.lens[r])  # type: ignore[index]
                if old:
                    self.host[r, :old] = self.slot.pad
                    self.lens[r] = 0  # type: ignore[index]
                    self.runs.append((r * self.width, r * self.width + old))
            else:
                self.host[r] = self.slot.pad
                self.runs.append((r, r + 1))

    def move_row(self, src: Any, dst: Any) -> None:
        with self.guard.hold("move_row()"):
            s, d = self._normalize("move_row", src, dst)
            if s == d:
                return
            if self.wide:
                lens = self.lens
                k, old = int(lens[s]), int(lens[d])  # type: ignore[index]
                self.host[d, :k] = self.host[s, :k]
                if old > k:
                    self.host[d, k:old] = self.slot.pad
                lens[d] = k  # type: ignore[index]
                self.runs.append((d * self.width, d * self.width + max(k, old)))
            else:
                self.host[d] = self.host[s]
                self.runs.append((d, d + 1))
            if d >= self.top:
                self.top = d + 1

    def swap_rows(self, a: Any, b: Any) -> None:
        with self.guard.hold("swap_rows()"):
            i, j = self._normalize("swap_rows", a, b)
            if i == j:
                return
            if self.wide:
                lens = self.lens
                k = int(max(lens[i], lens[j]))  # type: ignore[index]
                self.host[[i, j], :k] = self.host[[j, i], :k]
                lens[i], lens[j] = lens[j], lens[i]  # type: ignore[index]
                w = self.width
                self.runs.append((i * w, i * w + k))
                self.runs.append((j * w, j * w + k))
            else:
                self.host[[i, j]] = self.host[[j, i]]
                self.runs.append((i, i + 1))
                self.runs.append((j, j + 1))
            self.top = max(self.top, i + 1, j + 1)

    def scatter(self, rows: Any, values: Any, cols: Any = None) -> None:
        with self.guard.hold("scatter()"):
            r, arr, c = self._normalize("scatter", rows, values, cols)
            if r is None:
                return
            hi = int(r.max())
            if self.wide:
                self.host[r, c] = arr
                np.maximum.at(self.lens, r, c + 1)
                chi = int(c.max())
                if chi + 1 > self.colmax:
                    self.colmax = chi + 1
                self.cells.append(r * self.width + c)
            else:
                self.host[r] = arr
                self.cells.append(r)
            if hi >= self.top:
                self.top = hi + 1


@functools.cache
def _native_mirror(kernel: ModuleType) -> type:
    """:class:`_Checks` over ``kernel.Staged`` (``graphbuf.buffers._staged``): the host state in C."""

    class _NativeMirror(kernel.Staged, _Checks):  # type: ignore[misc, name-defined]
        """One staged buffer's host state: the writes and the changed cells in C, the checks in Python."""

        def __init__(
            self,
            slot: Slot,
            host: np.ndarray,
            lens: np.ndarray | None,
            colmax: int,
            top: int,
            guard: Exclusive,
        ) -> None:
            self._init_shape(slot, host, lens, guard)
            pad = slot.pad.tobytes()
            table = slot.rows_of_requests
            super().__init__(host, lens, pad, slot.lo, slot.hi, table, slot.index, guard.lock, colmax, top)

        def changed(self) -> np.ndarray:
            """Every changed flat index (a cell staged twice appears twice), as one int64 array."""
            out = np.empty(self.nchanged, dtype=np.int64)
            self.changed_into(out)
            return out

    return _NativeMirror


class StagedBuffer:
    """Staged writes to one buffer (from :meth:`graphbuf.StaticBuffers.stage`). Rows and columns index the
    buffer's whole allocation; one outside it raises :class:`RowsError`/:class:`WidthError` here, at stage
    time. Values are checked for a safe cast here and against ``min``/``max`` (and NaN) when a refresh
    commits them. A 1-D buffer's "row" is one element: :meth:`set` writes a run of elements from ``row``.
    """

    def __init__(self, mirror: Any) -> None:
        self._m = mirror
        self.name = mirror.slot.name
        # The write methods are the host state's own (native ones without a Python frame); the methods
        # below document them and stand in for them on a class-level lookup.
        for op in _OPS:
            setattr(self, op, getattr(mirror, op))

    @property
    def host(self) -> np.ndarray:
        """The host state (read-only view; bfloat16 is refused, so values are in the buffer's dtype)."""
        v = self._m.host.view()
        v.flags.writeable = False
        return v

    @property
    def lengths(self) -> np.ndarray:
        """2-D: per row, the columns that may hold values (read-only; set/append/set_row keep it)."""
        if self._m.lens is None:
            raise RefreshError(f"lengths: buffer {self.name!r} is 1-D; it has no row lengths")
        v = self._m.lens.view()
        v.flags.writeable = False
        return v

    @property
    def pending(self) -> bool:
        """True while staged writes wait for a refresh to commit them."""
        return self._m.pending

    def set(self, row: int, values: Any, col: int = 0) -> None:
        """2-D: ``values`` into row ``row`` from column ``col``. 1-D: into elements ``row``, ``row+1``, ..."""
        self._m.set(row, values, col)

    def append(self, row: int, values: Any) -> None:
        """2-D: ``values`` into row ``row`` after its last value (:attr:`lengths`)."""
        self._m.append(row, values)

    def set_row(self, row: int, values: Any) -> None:
        """Row ``row`` becomes ``values``, the rest of the row the pad (1-D: one element)."""
        self._m.set_row(row, values)

    def clear_row(self, row: int) -> None:
        """Row ``row`` becomes the pad."""
        self._m.clear_row(row)

    def move_row(self, src: int, dst: int) -> None:
        """Row ``dst`` becomes a copy of row ``src`` (``src`` keeps its values), as vLLM's ``move_row``."""
        self._m.move_row(src, dst)

    def swap_rows(self, a: int, b: int) -> None:
        """Rows ``a`` and ``b`` trade values."""
        self._m.swap_rows(a, b)

    def scatter(self, rows: Any, values: Any, cols: Any = None) -> None:
        """Many cells at once: cell ``(rows[i], cols[i])`` (1-D: element ``rows[i]``) becomes ``values[i]``.
        With repeated cells the last value wins. The batched form of :meth:`set` and :meth:`append`."""
        self._m.scatter(rows, values, cols)

    def __repr__(self) -> str:
        return f"StagedBuffer({self.name!r}, pending={self.pending})"


# One staged buffer's commit, checked and not yet written: (mirror, live rows, changed and entering flat
# indices (or one slice of them), their values, first and last cleared row, cleared columns, column mark).
_Plan = tuple[Any, int, np.ndarray | slice, np.ndarray, int, int, int, int]


class StagingArea:
    """The staged buffers of one slab: their host states, the check of a commit and its upload."""

    def __init__(
        self,
        layout: Layout,
        committer: Committer,
        full: Mapping[str, torch.Tensor],
        slab: torch.Tensor,
        guard: Exclusive,
    ) -> None:
        self.layout = layout
        self.guard = guard
        self._commit = committer
        self._full = full
        self._slab = slab
        self._mirrors: dict[str, Any] = {}  # _PyMirror or _NativeMirror
        self._handles: dict[str, StagedBuffer] = {}
        self.names: frozenset[str] = frozenset()
        #: The buffers a refresh must be given: the required ones not staged.
        self.required: frozenset[str] = layout.required
        self._staged = committer.staged
        self._targets: dict[str, np.ndarray] = {}  # in place: flat numpy views of the slab
        # Staged: per element size a view of the whole slab, and a ring of host arenas behind events.
        self._slab_of: dict[int, torch.Tensor] = {}
        depth = committer.depth if self._staged else 1
        self._arenas: list[torch.Tensor | None] = [None] * depth
        self._events: list[Any] = [None] * depth
        self._turn = 0
        self._pin = slab.device.type != "cpu"
        # The native commit (in place, every host state native): the host states and their targets.
        self._cores: list[Any] = []
        self._core_targets: list[np.ndarray] = []
        self._native: ModuleType | None = None
        self._slab_range = (slab.data_ptr(), slab.data_ptr() + slab.numel())

    def buffer(self, name: Any) -> StagedBuffer:
        """The staged-write handle of buffer ``name`` (made on first use: its host state then takes the
        buffer's current contents)."""
        h = self._handles.get(name) if isinstance(name, str) else None
        if h is not None:
            return h
        label = "stage()"
        slot = self.layout.slot(label, name)
        why = None
        if slot.repeat_last:
            why = "is padded repeat_last"
        elif slot.bf16:
            why = "is bfloat16"
        elif slot.ndim == 2 and len({c[1] for c in slot.capacity.values()}) > 1:
            why = "has a width that differs between capture sizes"
        if why is not None:
            raise self.layout.fail(
                RefreshError, name, label, f"{why}; staged writes do not apply, refresh it whole"
            )
        rows, cols = self._commit.mark(slot.index)
        t = self._full[name]
        host = t.detach().cpu().numpy().copy()  # one read of the current contents
        lens = None
        if slot.ndim == 2:
            lens = np.zeros(host.shape[0], dtype=np.int64)
            lens[:rows] = cols
        kernel = native.STAGED
        kind = _native_mirror(kernel) if kernel is not None else _PyMirror
        m = kind(slot, host, lens, cols if slot.ndim == 2 else 0, rows, self.guard)
        if not self._staged:
            self._targets[name] = t.numpy().reshape(-1)
        self._mirrors[name] = m
        self.names = frozenset(self._mirrors)
        self.required = self.layout.required.difference(self.names)
        mirrors = list(self._mirrors.values())
        native_all = kernel is not None and all(type(x) is kind for x in mirrors)
        if native_all and not self._staged:
            self._cores = mirrors
            self._core_targets = [self._targets[x.slot.name] for x in mirrors]
            self._native = kernel
        else:
            self._native = None
        h = StagedBuffer(m)
        self._handles[name] = h
        return h

    def host_sources(self, names: Iterable[str], size: int, n: int) -> dict[str, np.ndarray]:
        """Copies of the host states of staged buffers ``names`` for a step of ``n`` requests at ``size``
        tokens (an eager step reads them; nothing is committed). A step needing more rows than the
        allocation holds gets them all, and its check names the shortfall."""
        out = {}
        for name in names:
            m = self._mirrors[name]
            live = m.rows if m.slot.rows_of_requests is None else self.layout.rows_at(m.slot, size, n)
            out[name] = m.host[:live].copy()
        return out

    def commit_native(self, prepared: list[Prepared], n: int) -> int | None:
        """The whole staged commit of ``n`` requests in one native call, made *before* the refresh writes
        ``prepared`` (its full sources, all checked): every staged check, then every staged write in
        place; the bytes written, or None with nothing written (no native commit here, a buffer given whole
        is staged, a value fails or a source lies in the slab): then :meth:`prepare` and :meth:`apply`."""
        kernel = self._native
        if kernel is None:
            return None
        mirrors = self._mirrors
        for p in prepared:
            if p.slot.name in mirrors:
                return None
        rows, cols = self._commit.marks
        moved = kernel.commit(self._cores, n, rows, cols, self._core_targets, prepared, *self._slab_range)
        return moved if type(moved) is int else None

    def prepare(self, prepared: Sequence[Prepared], size: int, n: int, label: str) -> list[_Plan]:
        """Check every staged buffer left out of ``prepared`` for a commit of ``n`` requests at ``size``;
        writes nothing. A buffer in ``prepared`` with uncommitted staged writes is an error."""
        mirrors = self._mirrors
        given = None
        if len(prepared):
            given = {p.slot.name for p in prepared}
            for name in given.intersection(mirrors):
                if mirrors[name].pending:
                    raise self.layout.fail(
                        RefreshError, name, label,
                        "has staged writes; pass it whole or leave it out (its staged writes are then "
                        "committed), not both",
                    )  # fmt: skip
        plans = []
        layout = self.layout
        for name, m in mirrors.items():
            if given is not None and name in given:
                continue
            slot = m.slot
            table = slot.rows_of_requests
            live = table[n] if table is not None and n < len(table) else layout.rows_at(slot, size, n)
            shown, cols = self._commit.mark(slot.index)  # rows [:shown] hold host[:shown]; the rest pad
            if not m.pending and live == shown:
                continue
            w = m.width
            keep = min(live, shown)
            idx: np.ndarray | slice
            one = m.single() if live <= shown else None
            if one is not None:  # one run, no row enters: a slice
                a, b = one
                idx = slice(a, max(a, min(b, keep * w)))
            else:
                idx = m.changed() if m.pending else _EMPTY
                if idx.size and (keep < m.rows):
                    idx = idx[idx < keep * w]
                if live > shown:  # rows entering the live range: their used width
                    if m.wide:
                        r = np.arange(shown, live, dtype=np.int64)
                        ent = _expand(np.stack((r * w, r * w + m.lens[shown:live]), axis=1))
                    else:
                        ent = np.arange(shown, live, dtype=np.int64)
                    idx = np.concatenate((idx, ent)) if idx.size else ent
            vals = m.flat[idx]
            if vals.size and (slot.bounded or slot.kind == "f") and not _fits(slot, vals):
                region = m.host[:live]
                check_values(layout, slot, region, name, label)  # raises with a full refresh's message
            colmark = (m.colmax if m.wide else 0) if live else 0
            plans.append((m, live, idx, vals, live, shown if shown > live else live, cols, colmark))
        return plans

    def apply(self, plans: list[_Plan], prepared: Sequence[Prepared]) -> None:
        """Write checked ``plans`` (cpu: in place; staged: one packed upload) and take the host state of
        every staged buffer given whole in ``prepared``. Adds the bytes to the refresh's stats."""
        moved = 0
        if plans:
            moved = self._write_in_place(plans) if not self._staged else self._upload(plans)
            commit = self._commit
            for m, live, *_, colmark in plans:
                m.clear()
                commit.set_mark(m.slot.index, live, colmark)
        if len(prepared) and self._mirrors:
            for p in prepared:
                m = self._mirrors.get(p.slot.name)
                if m is not None:
                    self._absorb(m, p)
        if moved:
            self._commit.count(moved)

    def _write_in_place(self, plans: list[_Plan]) -> int:
        moved = 0
        for m, _, idx, vals, c0, c1, ccols, _ in plans:
            t = self._targets[m.slot.name]
            isz = m.slot.itemsize
            if vals.size:
                t[idx] = vals
                moved += vals.size * isz
            if c1 > c0:
                if m.wide:
                    t.reshape(m.rows, m.width)[c0:c1, :ccols] = m.slot.pad
                    moved += (c1 - c0) * ccols * isz
                else:
                    t[c0:c1] = m.slot.pad
                    moved += (c1 - c0) * isz
        return moved

    def _upload(self, plans: list[_Plan]) -> int:
        """Every plan's cells, cleared cells included, in one packed host arena and one upload, then one
        indexed write per element size."""
        groups: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        moved = 0
        for m, _, idx, vals, c0, c1, ccols, _ in plans:
            slot = m.slot
            isz = slot.itemsize
            base = slot.plan.offset // isz
            bits = _INT_OF_SIZE[isz]
            ix, vx = groups.setdefault(isz, ([], []))
            if vals.size:
                if type(idx) is slice:
                    idx = np.arange(idx.start, idx.stop, dtype=np.int64)
                ix.append(idx + base)
                vx.append(vals.view(bits))
            if c1 > c0:
                w = m.width
                if m.wide:
                    cells = (np.arange(c0, c1, dtype=np.int64)[:, None] * w + np.arange(ccols)).reshape(-1)
                else:
                    cells = np.arange(c0, c1, dtype=np.int64)
                if cells.size:
                    ix.append(cells + base)
                    vx.append(np.full(cells.size, slot.pad, dtype=slot.np_dtype).view(bits))
        layout = []  # (size, index offset, count, value offset)
        total = 0
        for isz, (ix, vx) in groups.items():
            if not ix:
                continue
            i = ix[0] if len(ix) == 1 else np.concatenate(ix)
            v = vx[0] if len(vx) == 1 else np.concatenate(vx)
            k = i.size
            at_i = total
            at_v = at_i + 8 * k
            total = (at_v + isz * k + 7) & ~7
            layout.append((isz, at_i, k, at_v, i, v))
            moved += isz * k
        if not layout:
            return 0
        turn = self._turn
        if self._events[turn] is not None:
            self._events[turn].synchronize()  # the upload that last read this arena has finished
        arena = self._arenas[turn]
        if arena is None or arena.numel() < total:
            arena = torch.empty(max(total, 4096) * 2, dtype=torch.uint8, pin_memory=self._pin)
            self._arenas[turn] = arena
        host = arena.numpy()
        for isz, at_i, k, at_v, i, v in layout:
            host[at_i : at_i + 8 * k].view(np.int64)[:] = i
            host[at_v : at_v + isz * k].view(v.dtype)[:] = v
        dev = arena[:total].to(self._slab.device, non_blocking=True) if self._pin else arena[:total]
        for isz, at_i, k, at_v, _, _ in layout:
            target = self._slab_of.get(isz)
            if target is None:
                n = self._slab.numel() // isz * isz
                target = self._slab[:n].view(_TORCH_OF_SIZE[isz])
                self._slab_of[isz] = target
            target[dev[at_i : at_i + 8 * k].view(torch.int64)] = dev[at_v : at_v + isz * k].view(target.dtype)
        device = self._slab.device
        if device.type != "cpu":
            event = getattr(torch, device.type).Event()
            event.record()
            self._events[turn] = event
        self._turn = (turn + 1) % len(self._arenas)
        return moved

    def _absorb(self, m: Any, p: Prepared) -> None:
        """A refresh gave ``m``'s buffer whole: its live values become the host state, other rows pad."""
        slot, src, dev, n, w = p
        if src is None:
            src = dev.detach().cpu().numpy() if dev is not None else None
        pad = slot.pad
        if m.top > n:
            m.host[n : m.top] = pad
        if m.wide:
            if src is not None:
                m.host[:n, :w] = src[:n, :w]
            if m.colmax > w:
                m.host[:n, w : m.colmax] = pad
            m.lens[:n] = w
            m.lens[n : max(n, m.top)] = 0
            m.colmax = w if n else 0
        elif src is not None:
            m.host[:n] = src[:n]
        m.top = n
        m.clear()


def _fits(slot: Slot, vals: np.ndarray) -> bool:
    """The staged values lie within ``min``/``max`` (and hold no NaN): one pass, kernel or numpy."""
    if slot.kind == "f":
        if np.isnan(vals).any():
            return False
        return (slot.lo is None or vals.min() >= slot.lo) and (slot.hi is None or vals.max() <= slot.hi)
    return live_fits(slot, vals, vals.shape[0], 0)
