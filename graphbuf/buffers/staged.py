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

Uploads. On a cpu slab written in place the cells are copied from the host states into the slab. Uploaded
(every accelerator; a cpu slab with ``upload_copies=N``) the cells of all staged buffers of a refresh go
into the refresh's one packed upload (native host state), or into one host arena (element indices, then
values) uploaded in one non-blocking copy and scattered with one indexed write per element size (1, 2, 4
or 8 bytes), not one per buffer (Python host state). The ``depth`` arenas take turns behind an event, as
the upload copies of a full refresh do.

Two host states, one behaviour. The host state's kind is chosen once, when the buffers are built. With
the native kernel (``graphbuf/buffers/_staged.c``, :data:`graphbuf.buffers.native.KERNEL`) a host state,
its changed cells and its writes live in C, and :meth:`graphbuf.StaticBuffers.stage` hands it out as it is
(``_native.Staged``, registered as a :class:`StagedBuffer`: no Python frame per write). A write whose
arguments are already plain (int rows and columns inside the allocation; values an exact
``numpy.ndarray``, contiguous, 1-D, of the buffer's element type, or a list of ints that fit it) runs
without a Python check; any other goes through the same Python checks (:class:`_Checks`) first. On a cpu
slab written in place the commit is two native calls, in the Python commit's order: every staged check
before the refresh writes anything (a value that fails sends the refresh to the Python commit, which names
it), every staged write after its full sources (a staged buffer is never a full source of the same
refresh, so no source changes between its check and its write). Without the kernel (no C compiler,
``GRAPHBUF_NATIVE=0``) the Python host state (:class:`StagedBuffer` itself) does the same in numpy. Both
write the same bytes and raise the same errors (``test_staged_native.py``, the state machine of
``test_staged_state_machine.py`` and the differential fuzzer ``tests/integration/fuzz_staged.py``).

Ownership. A write copies its indices and values at the call (the C scatter before its check), checks the
copy and writes it: a caller that reuses or changes its arrays afterwards, or passes views of the host
state itself, changes nothing it did not ask for. :attr:`StagedBuffer.host` and
:attr:`StagedBuffer.lengths` are views that cannot be made writable.

Limits: buffers padded ``repeat_last``, ``bfloat16`` buffers and buffers whose width differs between
capture sizes take full refreshes only (:meth:`StagedWrites.buffer` says so).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from graphbuf.buffers.commit import Committer
from graphbuf.buffers.layout import Layout, ResolvedBuffer
from graphbuf.buffers.validate import Prepared, check_row, check_values
from graphbuf.errors import RefreshError, RowsError, WidthError
from graphbuf.exclusive import Exclusive

if TYPE_CHECKING:
    from graphbuf.buffers.backend import Backend

__all__ = ["StagedBuffer", "StagedWrites"]

_INT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_EMPTY = np.zeros(0, dtype=np.int64)
_FEW = 8  # up to this many runs are expanded one arange each


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
    columns inside the allocation; values and indices fresh contiguous 1-D arrays owned here), or the error
    naming what is wrong. Both host states use them: the Python one on every write, the native one
    (``graphbuf.buffers._native.Staged``) on any argument it does not take as it is."""

    def __init__(
        self, slot: ResolvedBuffer, host: np.ndarray, lens: np.ndarray | None, guard: Exclusive
    ) -> None:
        self.slot = slot
        self.name = slot.name
        self.state = host  # the host state: the whole allocation, numpy element type of the slot
        self.flat = host.reshape(-1)
        self.lens = lens  # 2-D: per row, the columns that may differ from the pad (the rest is pad)
        self.rows = host.shape[0]
        self.wide = host.ndim == 2
        self.width = host.shape[1] if self.wide else 1
        self.guard = guard
        self._host_ro = _read_only(host)
        self._lens_ro = _read_only(lens) if lens is not None else None

    def host_view(self) -> np.ndarray:
        """:attr:`StagedBuffer.host` of both host states: a new read-only view of the host state."""
        return self._host_ro.view()

    def lengths_view(self) -> np.ndarray:
        """:attr:`StagedBuffer.lengths` of both host states; a 1-D buffer has none."""
        if self._lens_ro is None:
            raise RefreshError(f"lengths: buffer {self.name!r} is 1-D; it has no row lengths")
        return self._lens_ro.view()

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
        r, lo, hi = self._indices(rows, "rows", RowsError)
        arr = self._values(values, "scatter")
        if arr.shape[0] != r.shape[0]:
            raise RefreshError(
                f"scatter(): buffer {self.name!r}: {r.shape[0]} rows but {arr.shape[0]} values"
            )
        if not r.shape[0]:
            return None, None, None
        if lo < 0 or hi >= self.rows:
            raise RowsError(
                f"scatter(): buffer {self.name!r}: row {lo if lo < 0 else hi} outside the captured "
                f"allocation of {self.rows} rows"
            )
        if not self.wide:
            if cols is not None:
                raise WidthError(f"scatter(): buffer {self.name!r} is 1-D; cols must be None")
            return r.astype(np.int64), arr, None
        if cols is None:
            raise RefreshError(f"scatter(): buffer {self.name!r} is 2-D; pass cols=")
        c, clo, chi = self._indices(cols, "cols", WidthError)
        if c.shape[0] != r.shape[0]:
            raise RefreshError(f"scatter(): buffer {self.name!r}: {r.shape[0]} rows but {c.shape[0]} cols")
        if clo < 0 or chi >= self.width:
            raise WidthError(
                f"scatter(): buffer {self.name!r}: column {clo if clo < 0 else chi} outside the captured "
                f"allocation of {self.width} columns"
            )
        return r.astype(np.int64), arr, c.astype(np.int64)

    def _indices(self, x: Any, what: str, err: type[RefreshError]) -> tuple[np.ndarray, int, int]:
        """Scatter's ``rows`` or ``cols`` under :meth:`_row`'s integer rule (ints and numpy integers; no
        bool, float or str): a fresh flat array of the given integers, and their least and greatest value
        as given (never wrapped). Empty: (array, 0, -1)."""
        tp = type(x)
        if tp is torch.Tensor and x.device.type == "cpu" and x.layout == torch.strided:
            x = x.detach().cpu().resolve_neg().resolve_conj().numpy()
            tp = np.ndarray
        if tp is np.ndarray:
            if x.dtype.kind not in "iu":
                raise err(f"scatter(): buffer {self.name!r}: {what} of dtype {x.dtype}; allowed: integers")
            flat = np.array(x, order="C").reshape(-1)  # a copy: the caller may reuse its array
            if not flat.size:
                return flat, 0, -1
            return flat, int(flat.min()), int(flat.max())
        if tp is list or tp is tuple:
            for i, v in enumerate(x):
                if type(v) is not int and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
                    raise err(f"scatter(): buffer {self.name!r}: {what}[{i}] = {v!r} is not an integer")
            ints = [int(v) for v in x]
            if not ints:
                return np.zeros(0, dtype=np.int64), 0, -1
            lo, hi = min(ints), max(ints)
            if lo < -(2**63) or hi >= 2**63:  # outside int64: no array holds them; the range check names them
                return np.zeros(len(ints), dtype=np.int64), lo, hi
            return np.array(ints, dtype=np.int64), lo, hi
        if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
            v = int(x)
            return np.array([v if -(2**63) <= v < 2**63 else 0], dtype=np.int64), v, v
        raise err(
            f"scatter(): buffer {self.name!r}: {what} of type {type(x).__name__}; allowed: a list or array "
            "of integers, or one int"
        )

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
        """``values`` as a fresh contiguous 1-D array of the buffer's dtype: a refresh's value rule
        (:func:`~graphbuf.buffers.validate.check_row`)."""
        return check_row(self.slot, values, self.name, f"{op}()")


class StagedBuffer(_Checks, metaclass=abc.ABCMeta):
    """Staged writes to one buffer (from :meth:`graphbuf.StaticBuffers.stage`). Rows and columns index the
    buffer's whole allocation; one outside it raises :class:`RowsError`/:class:`WidthError` here, at stage
    time. Values are checked for a safe cast here (a refresh's rule) and against ``min``/``max`` (and NaN)
    when a refresh commits them. Every write copies its indices and values at the call: nothing the caller
    does to them afterwards reaches the host state. A 1-D buffer's "row" is one element: :meth:`set`
    writes a run of elements from ``row``.

    This class is the Python host state (its writes in numpy, its changed cells as flat element indices);
    with the native kernel :meth:`graphbuf.StaticBuffers.stage` returns the native host state
    (``graphbuf.buffers._native.Staged``, registered as a StagedBuffer): the same methods, bytes and errors,
    the checks of arguments it does not take as they are made by this class's own :class:`_Checks`.
    """

    def __init__(
        self,
        slot: ResolvedBuffer,
        host: np.ndarray,
        lens: np.ndarray | None,
        colmax: int,
        top: int,
        guard: Exclusive,
    ) -> None:
        super().__init__(slot, host, lens, guard)
        self.runs: list[tuple[int, int]] = []  # changed [start, stop) ranges of flat indices
        self.cells: list[np.ndarray] = []  # changed flat indices, scattered
        self.colmax = colmax  # bound of every row's lens (the column high-water mark a commit leaves)
        self.top = top  # rows at and past top hold the pad

    @property
    def host(self) -> np.ndarray:
        """The host state (a read-only view that cannot be made writable; bfloat16 is refused, so values
        are in the buffer's dtype); a new view each time, so reshaping one in place changes no other."""
        return self.host_view()

    @property
    def lengths(self) -> np.ndarray:
        """2-D: per row, the columns that may hold values (read-only as :attr:`host`; the writes keep it)."""
        return self.lengths_view()

    @property
    def pending(self) -> bool:
        """True while staged writes wait for a refresh to commit them."""
        return bool(self.runs or self.cells)

    def single(self) -> tuple[int, int] | None:
        return self.runs[0] if len(self.runs) == 1 and not self.cells else None

    def clear(self) -> None:
        self.runs.clear()
        self.cells.clear()

    @property
    def nchanged(self) -> int:
        return sum(b - a for a, b in self.runs if b > a) + sum(c.size for c in self.cells)

    def changed_into(self, out: np.ndarray) -> None:
        """Every changed flat index (a cell staged twice appears twice) into ``out`` (the native host
        state's interface)."""
        out[:] = self._changed()

    def _changed(self) -> np.ndarray:
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
        """2-D: ``values`` into row ``row`` from column ``col``. 1-D: into elements ``row``, ``row+1``, ..."""
        with self.guard.hold("set()"):
            self._set(*self._normalize("set", row, values, col))

    def append(self, row: Any, values: Any) -> None:
        """2-D: ``values`` into row ``row`` after its last value (:attr:`lengths`)."""
        with self.guard.hold("append()"):
            r, arr = self._normalize("append", row, values)
            self._set(r, arr, int(self.lens[r]))  # type: ignore[index]

    def _set(self, r: int, arr: np.ndarray, c: int) -> None:
        k = arr.shape[0]
        if self.wide:
            self.state[r, c : c + k] = arr
            if c + k > self.lens[r]:  # type: ignore[index]
                self.lens[r] = c + k  # type: ignore[index]
                if c + k > self.colmax:
                    self.colmax = c + k
            start = r * self.width + c
            self.runs.append((start, start + k))
            if r >= self.top:
                self.top = r + 1
        else:
            self.state[r : r + k] = arr
            self.runs.append((r, r + k))
            if r + k > self.top:
                self.top = r + k

    def set_row(self, row: Any, values: Any) -> None:
        """Row ``row`` becomes ``values``, the rest of the row the pad (1-D: one element)."""
        with self.guard.hold("set_row()"):
            r, arr = self._normalize("set_row", row, values)
            k = arr.shape[0]
            if not self.wide:
                self.state[r] = arr[0]
                self.runs.append((r, r + 1))
            else:
                lens = self.lens
                old = int(lens[r])  # type: ignore[index]
                self.state[r, :k] = arr
                if old > k:
                    self.state[r, k:old] = self.slot.pad
                lens[r] = k  # type: ignore[index]
                if k > self.colmax:
                    self.colmax = k
                start = r * self.width
                self.runs.append((start, start + max(k, old)))
            if r >= self.top:
                self.top = r + 1

    def clear_row(self, row: Any) -> None:
        """Row ``row`` becomes the pad."""
        with self.guard.hold("clear_row()"):
            (r,) = self._normalize("clear_row", row)
            if self.wide:
                old = int(self.lens[r])  # type: ignore[index]
                if old:
                    self.state[r, :old] = self.slot.pad
                    self.lens[r] = 0  # type: ignore[index]
                    self.runs.append((r * self.width, r * self.width + old))
            else:
                self.state[r] = self.slot.pad
                self.runs.append((r, r + 1))

    def move_row(self, src: Any, dst: Any) -> None:
        """Row ``dst`` becomes a copy of row ``src`` (``src`` keeps its values), as vLLM's ``move_row``."""
        with self.guard.hold("move_row()"):
            s, d = self._normalize("move_row", src, dst)
            if s == d:
                return
            if self.wide:
                lens = self.lens
                k, old = int(lens[s]), int(lens[d])  # type: ignore[index]
                self.state[d, :k] = self.state[s, :k]
                if old > k:
                    self.state[d, k:old] = self.slot.pad
                lens[d] = k  # type: ignore[index]
                self.runs.append((d * self.width, d * self.width + max(k, old)))
            else:
                self.state[d] = self.state[s]
                self.runs.append((d, d + 1))
            if d >= self.top:
                self.top = d + 1

    def swap_rows(self, a: Any, b: Any) -> None:
        """Rows ``a`` and ``b`` trade values."""
        with self.guard.hold("swap_rows()"):
            i, j = self._normalize("swap_rows", a, b)
            if i == j:
                return
            if self.wide:
                lens = self.lens
                k = int(max(lens[i], lens[j]))  # type: ignore[index]
                self.state[[i, j], :k] = self.state[[j, i], :k]
                lens[i], lens[j] = lens[j], lens[i]  # type: ignore[index]
                w = self.width
                self.runs.append((i * w, i * w + k))
                self.runs.append((j * w, j * w + k))
            else:
                self.state[[i, j]] = self.state[[j, i]]
                self.runs.append((i, i + 1))
                self.runs.append((j, j + 1))
            self.top = max(self.top, i + 1, j + 1)

    def scatter(self, rows: Any, values: Any, cols: Any = None) -> None:
        """Many cells at once: cell ``(rows[i], cols[i])`` (1-D: element ``rows[i]``) becomes ``values[i]``.
        With repeated cells the last value wins. The batched form of :meth:`set` and :meth:`append`. Rows
        and columns follow :meth:`set`'s integer rule (no bool, float or str)."""
        with self.guard.hold("scatter()"):
            r, arr, c = self._normalize("scatter", rows, values, cols)
            if r is None:
                return
            hi = int(r.max())
            if self.wide:
                self.state[r, c] = arr
                np.maximum.at(self.lens, r, c + 1)
                chi = int(c.max())
                if chi + 1 > self.colmax:
                    self.colmax = chi + 1
                self.cells.append(r * self.width + c)
            else:
                self.state[r] = arr
                self.cells.append(r)
            if hi >= self.top:
                self.top = hi + 1


def changed_cells(core: Any) -> np.ndarray:
    """Every uncommitted changed flat index of a staged buffer (a cell staged twice appears twice)."""
    out = np.empty(core.nchanged, dtype=np.int64)
    core.changed_into(out)
    return out


def _read_only(arr: np.ndarray) -> np.ndarray:
    """A view of ``arr`` that cannot be made writable (its base is a read-only buffer, so numpy refuses
    to set ``writeable``); it follows ``arr``'s values."""
    return np.asarray(memoryview(arr).toreadonly())


# One staged buffer's commit, checked and not yet written: (checks, host state, live rows, changed and
# entering flat indices (or one slice of them), their values, first and last cleared row, cleared columns,
# column mark).
_CellWrite = tuple["_Checks", StagedBuffer, int, np.ndarray | slice, np.ndarray, int, int, int, int]


class StagedWrites:
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
        self._handles: dict[str, StagedBuffer] = {}  # the handles: the host states themselves
        self._checks: dict[str, _Checks] = {}  # their checks (a Python host state is its own)
        self.names: frozenset[str] = frozenset()
        #: The buffers a refresh must be given: the required ones not staged.
        self.required: frozenset[str] = layout.required
        self._staged = committer.uploads
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
        self._bases: list[int] = []  # staged: each core's buffer offset in 4-byte slab words
        self._kernel = staged_kernel = layout.backend.staged  # the host state's kind: the backend's
        if staged_kernel is not None:
            StagedBuffer.register(staged_kernel.Staged)  # the native host state is a StagedBuffer

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
        colmax = cols if slot.ndim == 2 else 0
        kernel = self._kernel
        if kernel is None:
            h: Any = StagedBuffer(slot, host, lens, colmax, rows, self.guard)
            checks: _Checks = h
        else:
            checks = _Checks(slot, host, lens, self.guard)
            table = slot.rows_of_requests
            h = kernel.Staged(
                host, lens, slot.pad.tobytes(), slot.lo, slot.hi, table, slot.index, self.guard.lock, colmax,
                rows, checks, np.ndarray,
            )  # fmt: skip
        if not self._staged:
            self._targets[name] = t.numpy().reshape(-1)
        self._handles[name] = h
        self._checks[name] = checks
        self.names = frozenset(self._handles)
        self.required = self.layout.required.difference(self.names)
        if kernel is not None and not self._staged:
            self._cores = list(self._handles.values())
            self._core_targets = [self._targets[name] for name in self._handles]
            self._native = kernel
        elif kernel is not None:  # staged: packed as 4-byte slab words, when every staged buffer is
            words = all(
                c.slot.itemsize % 4 == 0 and c.slot.plan.offset % 4 == 0 for c in self._checks.values()
            )
            self._cores = list(self._handles.values())
            self._core_targets = [None] * len(self._cores)  # type: ignore[list-item]
            self._bases = [c.slot.plan.offset // 4 for c in self._checks.values()]
            self._native = kernel if words else None
        return h

    def host_sources(self, names: Iterable[str], size: int, n: int) -> dict[str, np.ndarray]:
        """Copies of the host states of staged buffers ``names`` for a step of ``n`` requests at ``size``
        tokens (an eager step reads them; nothing is committed). A step needing more rows than the
        allocation holds gets them all, and its check names the shortfall."""
        out = {}
        for name in names:
            c = self._checks[name]
            live = c.rows if c.slot.rows_of_requests is None else self.layout.rows_at(c.slot, size, n)
            out[name] = c.state[:live].copy()
        return out

    def commit(self, prepared: list[Prepared], size: int, n: int, label: str) -> None:
        """A refresh's writes at ``size`` tokens and ``n`` live requests, in the one order: every staged
        value checked (nothing written if one fails), then the full sources ``prepared`` (checked already),
        then the staged cells. The staged cells' check and write run in C when every host state is native
        and no staged buffer is given whole (packed into the refresh's one upload when uploaded); otherwise
        through :meth:`check` and :meth:`write`, which name any error."""
        committer = self._commit
        if not self._handles:
            committer.write(prepared, size)
            return
        kernel = self._native
        if kernel is not None:
            rows, cols = committer.marks
            handles = self._handles
            given = False
            for p in prepared:
                if p[0].name in handles:
                    given = True
                    break
            if not given and kernel.commit(self._cores, n, rows, cols, self._core_targets, False) is True:
                if not self._staged:  # in place: the full sources, then the staged cells
                    committer.write(prepared, size)
                    moved = kernel.commit(self._cores, n, rows, cols, self._core_targets, True)
                    if moved:
                        committer.count(moved)
                    return
                moved = committer.write(prepared, size, (self._cores, n, self._bases))
                if moved > 0:
                    committer.count(moved)
                elif moved < 0:  # not packed: the Python commit (its checks pass: they ran in C)
                    self.write(self.check(prepared, size, n, label), prepared)
                return
        cells = self.check(prepared, size, n, label)
        committer.write(prepared, size)
        self.write(cells, prepared)

    def check(self, prepared: Sequence[Prepared], size: int, n: int, label: str) -> list[_CellWrite]:
        """Check every staged buffer left out of ``prepared`` for a commit of ``n`` requests at ``size``;
        writes nothing. A buffer in ``prepared`` with uncommitted staged writes is an error."""
        handles = self._handles
        given = None
        if len(prepared):
            given = {p.slot.name for p in prepared}
            for name in given.intersection(handles):
                if handles[name].pending:
                    raise self.layout.fail(
                        RefreshError, name, label,
                        "has staged writes; pass it whole or leave it out (its staged writes are then "
                        "committed), not both",
                    )  # fmt: skip
        cells = []
        layout = self.layout
        for name, h in handles.items():
            if given is not None and name in given:
                continue
            m, core = self._checks[name], h
            slot = m.slot
            table = slot.rows_of_requests
            live = table[n] if table is not None and n < len(table) else layout.rows_at(slot, size, n)
            shown, cols = self._commit.mark(slot.index)  # rows [:shown] hold host[:shown]; the rest pad
            if not core.pending and live == shown:
                continue
            w = m.width
            keep = min(live, shown)
            idx: np.ndarray | slice
            one = core.single() if live <= shown else None
            if one is not None:  # one run, no row enters: a slice
                a, b = one
                idx = slice(a, max(a, min(b, keep * w)))
            else:
                idx = changed_cells(core) if core.pending else _EMPTY
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
            if vals.size and (slot.bounded or slot.kind == "f") and not _fits(layout.backend, slot, vals):
                region = m.state[:live]
                check_values(layout, slot, region, name, label)  # raises with a full refresh's message
            colmark = (core.colmax if m.wide else 0) if live else 0
            cells.append((m, core, live, idx, vals, live, shown if shown > live else live, cols, colmark))
        return cells

    def write(self, cells: list[_CellWrite], prepared: Sequence[Prepared]) -> None:
        """Write checked ``cells`` (cpu: in place; staged: one packed upload) and take the host state of
        every staged buffer given whole in ``prepared``. Adds the bytes to the refresh's stats."""
        moved = 0
        if cells:
            moved = self._write_in_place(cells) if not self._staged else self._upload(cells)
            commit = self._commit
            for m, core, live, *_, colmark in cells:
                core.clear()
                commit.set_mark(m.slot.index, live, colmark)
        if len(prepared) and self._handles:
            for p in prepared:
                m = self._handles.get(p.slot.name)
                if m is not None:
                    self._absorb(m, p)
        if moved:
            self._commit.count(moved)

    def _write_in_place(self, cells: list[_CellWrite]) -> int:
        moved = 0
        for m, _, _, idx, vals, c0, c1, ccols, _ in cells:
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

    def _upload(self, cells: list[_CellWrite]) -> int:
        """Every plan's cells, cleared cells included, in one packed host arena and one upload, then one
        indexed write per element size."""
        groups: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        moved = 0
        for m, _, _, idx, vals, c0, c1, ccols, _ in cells:
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
        arena = self._arena(turn, total)
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
        self._fence(turn)
        return moved

    def _arena(self, turn: int, nbytes: int) -> torch.Tensor:
        """Host arena ``turn`` of the ring, at least ``nbytes`` long, once the upload that last read it
        finished."""
        if self._events[turn] is not None:
            self._events[turn].synchronize()
            self._events[turn] = None
        arena = self._arenas[turn]
        if arena is None or arena.numel() < nbytes:
            arena = torch.empty(max(nbytes, 4096) * 2, dtype=torch.uint8, pin_memory=self._pin)
            self._arenas[turn] = arena
        return arena

    def _fence(self, turn: int) -> None:
        """After an upload from arena ``turn``: its event (off the cpu), and the next arena's turn."""
        device = self._slab.device
        if device.type != "cpu":
            event = getattr(torch, device.type).Event()
            event.record()
            self._events[turn] = event
        self._turn = (turn + 1) % len(self._arenas)

    def _absorb(self, h: StagedBuffer, p: Prepared) -> None:
        """A refresh gave ``h``'s buffer whole: its live values become the host state, other rows pad."""
        slot, src, dev, n, w = p
        if src is None:
            src = dev.detach().cpu().numpy() if dev is not None else None
        m, core = self._checks[h.name], h
        pad = slot.pad
        top = core.top
        if top > n:
            m.state[n:top] = pad
        if m.wide:
            if src is not None:
                m.state[:n, :w] = src[:n, :w]
            if core.colmax > w:
                m.state[:n, w : core.colmax] = pad
            m.lens[:n] = w  # type: ignore[index]
            m.lens[n : max(n, top)] = 0  # type: ignore[index]
            core.colmax = w if n else 0
        elif src is not None:
            m.state[:n] = src[:n]
        core.top = n
        core.clear()


def _fits(backend: Backend, slot: ResolvedBuffer, vals: np.ndarray) -> bool:
    """The staged values lie within ``min``/``max`` (and hold no NaN): one pass, kernel or numpy."""
    if slot.kind == "f":
        if np.isnan(vals).any():
            return False
        return (slot.lo is None or vals.min() >= slot.lo) and (slot.hi is None or vals.max() <= slot.hi)
    return backend.fits(slot, vals, vals.shape[0], 0)
