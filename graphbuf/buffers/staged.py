"""Staged writes: say what changed in a buffer's host state; the next refresh checks and writes only that.

A staged buffer's *host state* (:meth:`graphbuf.StaticBuffers.stage`) is its whole allocation, taken from
the buffer at the first ``stage()``; writes change it at once and record the changed cells. A
``refresh(size, sources, num_reqs=n)`` that leaves it out of ``sources`` commits it after them as a full
refresh with source ``host[:rows]`` (the spec's rows at ``n``) would, checking (a full refresh's rules and
messages) and writing only the changed cells of live rows, the used width of rows entering the live range
and the cells the high-water marks clear; a commit that raises writes nothing and its writes stay staged.
A buffer given whole takes that source as its host state (an error with uncommitted writes). Buffers that
are ``repeat_last``, ``bfloat16`` or of a width that differs between capture sizes are refreshed whole.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from graphbuf.buffers.commit import Cells, Committer, write_live
from graphbuf.buffers.layout import Layout, ResolvedBuffer
from graphbuf.buffers.validate import Prepared, check_row, check_values, live_region
from graphbuf.errors import RefreshError, RowsError, WidthError
from graphbuf.exclusive import Exclusive

__all__ = ["StagedBuffer", "StagedWrites"]

_Error = type[RefreshError]  # RowsError for rows, WidthError for columns
_BOTH = "has staged writes; pass it whole or leave it out (its staged writes are then committed), not both"


def _expand(runs: Sequence[tuple[int, int]] | np.ndarray) -> np.ndarray:
    """Flat indices of ``runs``, [start, stop) pairs, in order (up to 8: one ``arange`` each, cheaper)."""
    if len(runs) <= 8:
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in runs] or [np.zeros(0, np.int64)])
    runs = np.asarray(runs, dtype=np.int64)
    starts, lengths = runs[:, 0], runs[:, 1] - runs[:, 0]  # an empty run repeats nothing
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(int(ends[-1]), dtype=np.int64)


def _is_int(x: Any) -> bool:
    """The integer rule of rows and columns: ints and numpy integers, not bool (nor float or str)."""
    return type(x) is int or (isinstance(x, (int, np.integer)) and not isinstance(x, bool))


class _Checks:
    """One staged buffer's stage-time checks: a write's arguments in plain form (int rows and columns inside
    the allocation; values and indices fresh 1-D arrays owned here) or the error naming what is wrong; run by
    the Python host state on every write, by ``_native.Staged`` on what it does not take as it is."""

    def __init__(self, slot: ResolvedBuffer, host: np.ndarray, guard: Exclusive, top: int, cols: int) -> None:
        self.slot, self.name, self.guard = slot, slot.name, guard
        self.state, self.flat = host, host.reshape(-1)  # the host state: the whole allocation
        self.rows, self.wide = host.shape[0], host.ndim == 2
        self.width = host.shape[1] if self.wide else 1
        # 2-D: per row, the columns that may differ from the pad (the rest is pad)
        self.lens = np.where(np.arange(self.rows) < top, np.int64(cols), 0) if self.wide else None

    def host_view(self) -> np.ndarray:
        """The host state, read-only (its base cannot be made writable; bfloat16 is refused, so values are
        in the buffer's dtype); a new view each time, so reshaping one in place changes no other."""
        return np.asarray(memoryview(self.state).toreadonly())

    def lengths_view(self) -> np.ndarray:
        """2-D: per row, the columns that may hold values (read-only as :attr:`host`; the writes keep it)."""
        if self.lens is None:
            raise RefreshError(f"lengths: buffer {self.name!r} is 1-D; it has no row lengths")
        return np.asarray(memoryview(self.lens).toreadonly())

    def _busy(self, op: str) -> None:
        raise self.guard.busy(f"{op}()")

    def _normalize(self, op: str, *args: Any) -> tuple[Any, ...]:
        """``op``'s arguments in plain form, or the error (at stage time) that names what is wrong."""
        if op == "scatter":
            return self._scatter_args(*args)
        if op in ("clear_row", "move_row", "swap_rows"):
            return tuple(self._row(a, op) for a in args)
        if op == "set":
            row, values, col = args
            arr = check_row(self.slot, values, self.name, "set()")
            if not self.wide and (col != 0 or isinstance(col, bool)):
                raise WidthError(f"set(): buffer {self.name!r}: 1-D buffer; col must be 0, got {col!r}")
            r = self._row(row, "set")
            if self.wide:
                return r, arr, self._run("set", col, arr.shape[0], self.width, "column", WidthError)
            return self._run("set", r, arr.shape[0], self.rows, "row", RowsError), arr, 0
        if op == "append" and self.lens is None:
            raise RefreshError(f"append(): buffer {self.name!r} is 1-D; use set(row, values)")
        r = self._row(args[0], op)
        arr = check_row(self.slot, args[1], self.name, "set()" if op == "append" else "set_row()")
        if op == "append":
            self._run("set", int(self.lens[r]), arr.shape[0], self.width, "column", WidthError)  # type: ignore[index]
        elif self.wide:
            self._run("set_row", 0, arr.shape[0], self.width, "column", WidthError)
        elif arr.shape[0] != 1:
            raise RefreshError(f"set_row(): buffer {self.name!r} is 1-D; a row is one value, got {len(arr)}")
        return r, arr

    def _scatter_args(self, rows: Any, values: Any, cols: Any) -> tuple[Any, ...]:
        r, lo, hi = self._indices(rows, "rows", RowsError)
        arr = check_row(self.slot, values, self.name, "scatter()")
        if len(arr) != len(r):
            raise RefreshError(f"scatter(): buffer {self.name!r}: {len(r)} rows but {len(arr)} values")
        if not len(r):
            return None, None, None
        self._within("scatter", lo, hi, self.rows, "row", RowsError)
        if not self.wide:
            if cols is not None:
                raise WidthError(f"scatter(): buffer {self.name!r} is 1-D; cols must be None")
            return r.astype(np.int64), arr, None
        if cols is None:
            raise RefreshError(f"scatter(): buffer {self.name!r} is 2-D; pass cols=")
        c, clo, chi = self._indices(cols, "cols", WidthError)
        if len(c) != len(r):
            raise RefreshError(f"scatter(): buffer {self.name!r}: {len(r)} rows but {len(c)} cols")
        self._within("scatter", clo, chi, self.width, "column", WidthError)
        return r.astype(np.int64), arr, c.astype(np.int64)

    def _row(self, row: Any, op: str) -> int:
        return self._run(op, row, None, self.rows, "row", RowsError)

    def _within(self, op: str, lo: int, hi: int, cap: int, what: str, err: _Error, run: bool = False) -> None:
        """Rows or columns ``lo``..``hi`` inside the allocation's ``cap`` (``run``: named as one run)."""
        if lo < 0 or hi >= cap:
            at = f"s {lo}..{hi} reach" if run else f" {lo if lo < 0 else hi}"
            raise err(
                f"{op}(): buffer {self.name!r}: {what}{at} outside the captured allocation of {cap} {what}s"
            )

    def _run(self, op: str, start: Any, k: int | None, cap: int, what: str, err: _Error) -> int:
        """``start`` as an int: the first of ``k`` rows or columns (None: one index) inside ``cap``."""
        if not _is_int(start):
            raise err(f"{op}(): buffer {self.name!r}: {what} {start!r} is not an integer")
        s = int(start)
        self._within(op, s, s if k is None else s + k - 1, cap, what, err, run=k is not None)
        return s

    def _indices(self, x: Any, what: str, err: _Error) -> tuple[np.ndarray, int, int]:
        """Scatter's ``rows`` or ``cols`` under :func:`_is_int`'s rule: a fresh flat array of the given
        integers, and their least and greatest value as given (never wrapped). Empty: (array, 0, -1)."""
        if type(x) is torch.Tensor and x.device.type == "cpu" and x.layout == torch.strided:
            x = x.detach().resolve_neg().resolve_conj().numpy()
        if _is_int(x):
            x = [x]
        if type(x) is list or type(x) is tuple:
            for i, v in enumerate(x):
                if not _is_int(v):
                    raise err(f"scatter(): buffer {self.name!r}: {what}[{i}] = {v!r} is not an integer")
            ints = [int(v) for v in x]
            if ints and not -(2**63) <= min(ints) <= max(ints) < 2**63:  # past int64: no array holds them,
                return np.zeros(len(ints), np.int64), min(ints), max(ints)  # the range check names them
            x = np.array(ints, dtype=np.int64)
        if type(x) is np.ndarray:
            if x.dtype.kind not in "iu":
                raise err(f"scatter(): buffer {self.name!r}: {what} of dtype {x.dtype}; allowed: integers")
            flat = np.array(x, order="C").reshape(-1)  # a copy: the caller may reuse its array
            return (flat, int(flat.min()), int(flat.max())) if flat.size else (flat, 0, -1)
        raise err(
            f"scatter(): buffer {self.name!r}: {what} of type {type(x).__name__}; allowed: a list or array "
            "of integers, or one int"
        )


class StagedBuffer(_Checks, metaclass=abc.ABCMeta):
    """Staged writes to one buffer (from :meth:`graphbuf.StaticBuffers.stage`). Rows and columns index the
    buffer's whole allocation; one outside it raises :class:`RowsError`/:class:`WidthError` here, at stage
    time. Values are checked for a safe cast here (a refresh's rule) and against ``min``/``max`` (and NaN)
    when a refresh commits them. Every write copies its indices and values at the call: nothing the caller
    does to them afterwards reaches the host state. A 1-D buffer's "row" is one element: :meth:`set`
    writes a run of elements from ``row``. This class is the Python host state; with the native kernel
    ``stage()`` returns ``graphbuf.buffers._native.Staged`` (a registered StagedBuffer): the same methods,
    bytes and errors."""

    host = property(_Checks.host_view)
    lengths = property(_Checks.lengths_view)

    def __init__(self, slot: ResolvedBuffer, host: np.ndarray, guard: Exclusive, top: int, cols: int) -> None:
        super().__init__(slot, host, guard, top, cols)
        self.runs: list[tuple[int, int]] = []  # changed [start, stop) ranges of flat indices
        self.cells: list[np.ndarray] = []  # changed flat indices, scattered
        self.colmax = cols if self.wide else 0  # bound of every row's lens (the column mark a commit leaves)
        self.top = top  # rows at and past top hold the pad

    @property
    def pending(self) -> bool:
        """True while staged writes wait for a refresh to commit them."""
        return bool(self.runs or self.cells)

    def single(self) -> tuple[int, int] | None:
        return self.runs[0] if len(self.runs) == 1 and not self.cells else None

    def clear(self) -> None:
        self.runs, self.cells = [], []

    @property
    def nchanged(self) -> int:
        return sum(b - a for a, b in self.runs) + sum(c.size for c in self.cells)

    def changed_into(self, out: np.ndarray) -> None:
        """Every changed flat index into ``out``; a cell staged twice appears twice (cheaper than dedup)."""
        out[:] = np.concatenate([*self.cells, _expand(self.runs)])

    def set(self, row: Any, values: Any, col: Any = 0) -> None:
        """2-D: ``values`` into row ``row`` from column ``col``. 1-D: into elements ``row``, ``row+1``, ..."""
        with self.guard.hold("set()"):
            self._set(*self._normalize("set", row, values, col))

    def append(self, row: Any, values: Any) -> None:
        """2-D: ``values`` into row ``row`` after its last value (:attr:`lengths`)."""
        with self.guard.hold("append()"):
            r, arr = self._normalize("append", row, values)
            self._set(r, arr, int(self.lens[r]))  # type: ignore[index]

    def _set(self, r: int, arr: np.ndarray, c: int, grow: bool = True) -> None:
        """``arr`` into row ``r`` from column ``c`` (1-D: elements from ``r``); ``grow``: raise ``top``."""
        k = arr.shape[0]
        start = r * self.width + c
        self.flat[start : start + k] = arr
        self.runs.append((start, start + k))
        if self.wide and c + k > self.lens[r]:  # type: ignore[index]
            self.lens[r] = c + k  # type: ignore[index]
            self.colmax = max(self.colmax, c + k)
        if grow:
            self.top = max(self.top, r + (1 if self.wide else k))

    def _put_row(self, r: int, arr: np.ndarray, grow: bool = True) -> None:
        """Row ``r`` becomes ``arr``, the rest of its used width the pad (1-D: element ``r``)."""
        if self.wide:
            k, old = arr.shape[0], int(self.lens[r])  # type: ignore[index]
            if old > k:
                self.state[r, k:old] = self.slot.pad
                self.runs.append((r * self.width + k, r * self.width + old))
            self.lens[r] = 0  # type: ignore[index]
        self._set(r, arr, 0, grow)

    def _row_values(self, r: int) -> np.ndarray:
        """A copy of row ``r``'s used values (1-D: its one element)."""
        return (self.state[r, : int(self.lens[r])] if self.wide else self.state[r : r + 1]).copy()  # type: ignore[index]

    def set_row(self, row: Any, values: Any) -> None:
        """Row ``row`` becomes ``values``, the rest of the row the pad (1-D: one element)."""
        with self.guard.hold("set_row()"):
            self._put_row(*self._normalize("set_row", row, values))

    def clear_row(self, row: Any) -> None:
        """Row ``row`` becomes the pad."""
        with self.guard.hold("clear_row()"):
            (r,) = self._normalize("clear_row", row)
            if not self.wide or self.lens[r]:  # type: ignore[index]
                self._put_row(r, self.state[r, :0] if self.wide else np.array([self.slot.pad]), grow=False)

    def move_row(self, src: Any, dst: Any) -> None:
        """Row ``dst`` becomes a copy of row ``src`` (``src`` keeps its values), as vLLM's ``move_row``."""
        with self.guard.hold("move_row()"):
            s, d = self._normalize("move_row", src, dst)
            if s != d:
                self._put_row(d, self._row_values(s))

    def swap_rows(self, a: Any, b: Any) -> None:
        """Rows ``a`` and ``b`` trade values."""
        with self.guard.hold("swap_rows()"):
            i, j = self._normalize("swap_rows", a, b)
            if i != j:
                for r, vals in ((i, self._row_values(j)), (j, self._row_values(i))):
                    self._put_row(r, vals)

    def scatter(self, rows: Any, values: Any, cols: Any = None) -> None:
        """Many cells at once: cell ``(rows[i], cols[i])`` (1-D: element ``rows[i]``) becomes ``values[i]``.
        With repeated cells the last value wins. The batched form of :meth:`set` and :meth:`append`. Rows
        and columns follow :meth:`set`'s integer rule (no bool, float or str)."""
        with self.guard.hold("scatter()"):
            r, arr, c = self._normalize("scatter", rows, values, cols)
            if r is None:
                return
            idx = r * self.width + c if self.wide else r
            self.flat[idx] = arr
            if self.wide:
                np.maximum.at(self.lens, r, c + 1)
                self.colmax = max(self.colmax, int(c.max()) + 1)
            self.cells.append(idx)
            self.top = max(self.top, int(r.max()) + 1)


def _live_values(p: Prepared) -> np.ndarray:
    """A copy of the live values of a checked source, on the host."""
    _, host, dev, rows, width = p
    if host is None:
        return dev.detach().cpu().numpy()  # type: ignore[union-attr]
    return live_region(host, rows, width).copy()


def changed_cells(core: Any) -> np.ndarray:
    """Every uncommitted changed flat index of a staged buffer (a cell staged twice appears twice)."""
    out = np.empty(core.nchanged, dtype=np.int64)
    core.changed_into(out)
    return out


class StagedWrites:
    """The staged buffers of one slab: their host states, the check of a commit and its upload."""

    def __init__(
        self, layout: Layout, committer: Committer, full: Mapping[str, torch.Tensor], guard: Exclusive
    ) -> None:
        self.layout, self.guard = layout, guard
        self._commit, self._full = committer, full
        self._handles: dict[str, StagedBuffer] = {}  # the handles: the host states themselves
        self._checks: dict[str, _Checks] = {}  # their checks (a Python host state is its own)
        self.names: frozenset[str] = frozenset()
        self.required: frozenset[str] = layout.required  # what a refresh must be given: required, not staged
        # C's staged commit (every host state native; uploaded: 4-byte words): cores, targets, word offsets
        self._native: tuple[list[Any], list[Any], list[int]] | None = None
        self._kernel = layout.backend.staged  # the host state's kind: the backend's
        if self._kernel is not None:
            StagedBuffer.register(self._kernel.Staged)  # the native host state is a StagedBuffer

    def buffer(self, name: Any) -> StagedBuffer:
        """The staged-write handle of buffer ``name``, made on first use from the buffer's contents."""
        if isinstance(name, str) and name in self._handles:
            return self._handles[name]
        slot = self.layout.slot("stage()", name)
        why = "is padded repeat_last" if slot.repeat_last else "is bfloat16" if slot.bf16 else None
        if why is None and len({c[1] for c in slot.capacity.values()}) > 1:  # 1-D: every width 0
            why = "has a width that differs between capture sizes"
        if why is not None:
            msg = f"{why}; staged writes do not apply, refresh it whole"
            raise self.layout.fail(RefreshError, name, "stage()", msg)
        top, cols = self._commit.mark(slot.index)
        host = self._full[name].detach().cpu().numpy().copy()  # one read of the current contents
        kernel, commit = self._kernel, self._commit
        checks = (StagedBuffer if kernel is None else _Checks)(slot, host, self.guard, top, cols)
        h = checks if kernel is None else kernel.Staged(
            host, checks.lens, slot.pad.tobytes(), slot.lo, slot.hi, slot.rows_of_requests, slot.index,
            self.guard.lock, cols if checks.wide else 0, top, checks, np.ndarray,
        )  # fmt: skip
        self._handles[name], self._checks[name] = h, checks
        self.names = frozenset(self._handles)
        self.required = self.layout.required.difference(self.names)
        slots = [c.slot for c in self._checks.values()]
        # uploaded, C packs the cells as 4-byte slab words: every staged buffer must be
        packs = not commit.uploads or all(s.itemsize % 4 == 0 and s.plan.offset % 4 == 0 for s in slots)
        targets = [None if commit.uploads else commit.flat(s.index) for s in slots]
        native = (list(self._handles.values()), targets, [s.plan.offset // 4 for s in slots])
        self._native = native if kernel is not None and packs else None
        return h

    def host_sources(self, names: Iterable[str], size: int, n: int) -> dict[str, np.ndarray]:
        """Copies of the host states of ``names`` for an eager step of ``n`` requests at ``size`` tokens; one
        needing more rows than the allocation holds gets them all (its check names the shortfall)."""
        out = {}
        for name in names:
            c = self._checks[name]
            live = c.rows if c.slot.rows_of_requests is None else self.layout.rows_at(c.slot, size, n)
            out[name] = c.state[:live].copy()
        return out

    def commit(self, prepared: list[Prepared], size: int, n: int, label: str) -> None:
        """A refresh at ``size`` tokens and ``n`` live requests (the module's rule): the staged cells
        checked (in C where it can, else by :meth:`check`), then applied with ``prepared``."""
        commit, handles, native = self._commit, self._handles, self._native
        if not handles:
            commit.apply(size, prepared)
            return
        if native is not None:
            for p in prepared:
                if p[0].name in handles:
                    break  # a staged buffer given whole: the Python commit takes its host state
            else:
                kernel: Any = self._kernel  # reads the committer's own marks lists
                if kernel.commit(native[0], n, commit.rows, commit.cols, native[1], False) is True:
                    if not commit.apply(size, prepared, (), native, n):  # not packed: its checks passed in C
                        cells = self.check((), size, n, label)
                        commit.write_cells(cells)
                        for c in cells:
                            handles[c.slot.name].clear()
                    return
        cells = self.check(prepared, size, n, label)
        # A staged buffer given whole: its host state takes the values as checked, read before the write (the
        # source may view a buffer this refresh rewrites).
        whole = [(p, _live_values(p)) for p in prepared if p.slot.name in handles]
        commit.apply(size, prepared, cells)
        for c in cells:
            handles[c.slot.name].clear()
        for (slot, _, _, live, w), src in whole:
            h, m = handles[slot.name], self._checks[slot.name]
            if m.wide:  # rows at and past top have length 0 already
                m.lens[:] = np.where(np.arange(m.rows) < live, w, 0)  # type: ignore[index]
            h.top, h.colmax = write_live(m.state, src, slot, live, w, live, h.top, h.colmax)
            h.clear()

    def check(self, prepared: Sequence[Prepared], size: int, n: int, label: str) -> list[Cells]:
        """The checked cells of the staged buffers not in ``prepared`` at ``n`` requests; writes nothing."""
        handles, layout, fits = self._handles, self.layout, self.layout.backend.fits
        given = {p.slot.name for p in prepared}
        for name in given.intersection(handles):
            if handles[name].pending:
                raise layout.fail(RefreshError, name, label, _BOTH)
        cells = []
        for name, h in handles.items():
            m = self._checks[name]
            slot, w = m.slot, m.width
            live = layout.rows_at(slot, size, n)
            shown, cols = self._commit.mark(slot.index)  # rows [:shown] hold host[:shown]; the rest pad
            if name in given or (not h.pending and live == shown):
                continue
            keep = min(live, shown)
            one = h.single() if live <= shown else None
            idx: np.ndarray | slice
            if one is not None:  # one run, no row enters: a slice
                idx = slice(one[0], max(one[0], min(one[1], keep * w)))
            else:
                idx = changed_cells(h)
                if idx.size and keep < m.rows:
                    idx = idx[idx < keep * w]
                if live > shown:  # rows entering the live range: their used width
                    r = np.arange(shown, live, dtype=np.int64)
                    ent = _expand(np.stack((r * w, r * w + m.lens[shown:live]), axis=1)) if m.wide else r
                    idx = np.concatenate((idx, ent)) if idx.size else ent
            vals = m.flat[idx]
            if vals.size and (slot.bounded or slot.kind == "f") and not fits(slot, vals, vals.size, 0):
                check_values(layout, slot, m.state[:live], name, label)  # raises: a full refresh's message
            cells.append(
                Cells(slot, idx, vals, live, max(shown, live), cols, h.colmax if m.wide and live else 0)
            )
        return cells
