"""StaticBuffers: one slab per device holding every captured buffer at a fixed address, forever."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from graphbuf.buffers.backend import chosen
from graphbuf.buffers.bound import BoundSources
from graphbuf.buffers.commit import Committer, RefreshStats
from graphbuf.buffers.eager import build_eager
from graphbuf.buffers.layout import Layout, where
from graphbuf.buffers.mapping import prepare_mapping, read_call
from graphbuf.buffers.staged import StagedBuffer, StagedWrites
from graphbuf.buffers.validate import Prepared, Source, check_num_reqs, count_of
from graphbuf.devices import resolve_device
from graphbuf.errors import PlanTooLargeError, RefreshError, RowsError, UsageError
from graphbuf.exclusive import Exclusive
from graphbuf.planning.planner import Plan, plan
from graphbuf.spec.expr import ExprError
from graphbuf.spec.models import GraphSpec

__all__ = ["StaticBuffers", "poison_value"]


_profiling = torch._C._autograd._profiler_enabled  # True inside a torch.profiler session


def poison_value(dtype: torch.dtype) -> int | float | bool:
    """The sentinel a poisoned slab holds: NaN for floats, the minimum for integers, True for bool."""
    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).min


class StaticBuffers:
    """Every buffer of a spec in ONE slab on ``device``.

    Invariants: the slab is allocated once and never moves; buffers are written only by :meth:`refresh` (a
    refresh assumes cells it did not dirty still hold the pad); one thread at a time (a second concurrent
    call raises :class:`graphbuf.ConcurrentUseError` instead of waiting).

    Args:
        spec: a :class:`GraphSpec`, a spec path or shipped name, or an existing :class:`Plan`.
        device: where the slab lives (``"cpu"``, ``"cuda[:N]"``, ``"npu[:N]"``).
        overrides: constant overrides (e.g. ``{"num_blocks": n}``), applied before planning.
        poison: fill the slab with :func:`poison_value` sentinels, not the pads: a never-written row shows.
        strict: also check NaN and ``min``/``max`` of device-resident sources (a device sync); host sources
            are always checked.
        max_bytes: the slab limit (default: the spec's ``limits.max_bytes``).
        upload_copies: host copies of the slab that uploads are assembled in, in turn: at least the refreshes
            in flight (issued, upload not finished). Default 2 on an accelerator; on the cpu None writes the
            slab in place, N uploads as an accelerator would. Uploads are non-blocking copies on the device's
            current stream. (Not the staged writes of :meth:`stage`.)
        staging: the former name of ``upload_copies`` (deprecated).
    """

    def __init__(
        self,
        spec: GraphSpec | Plan | str,
        device: str | torch.device = "cpu",
        *,
        overrides: Mapping[str, int] | None = None,
        poison: bool = False,
        strict: bool = False,
        max_bytes: int | None = None,
        upload_copies: int | None = None,
        staging: int | None = None,
    ) -> None:
        self.device = resolve_device(device, f"StaticBuffers(device={device!r})")
        copies = _upload_copies(upload_copies, staging, self.device)
        p = spec if isinstance(spec, Plan) else plan(spec, overrides=overrides, max_bytes=max_bytes)
        self.plan, self.strict = p, strict
        try:
            self.slab = torch.empty(p.total_bytes, dtype=torch.uint8, device=self.device)
        except RuntimeError as exc:  # the allocator refused it (torch.OutOfMemoryError is a RuntimeError)
            raise PlanTooLargeError(
                f"{p.spec.name}: the slab of {p.total_bytes} bytes (limits.max_bytes "
                f"{p.max_bytes}) cannot be allocated on {self.device}: {str(exc).splitlines()[0]}. "
                "Lower limits.max_bytes to what the device holds, or shrink the constants that size the "
                "buffers."
            ) from None
        full: dict[str, torch.Tensor] = {}
        for b in p.buffers:
            pad = poison_value(b.dtype) if poison else 0 if b.pad == "repeat_last" else b.pad
            full[b.name] = self.slab[b.offset : b.offset + b.nbytes].view(b.dtype).view(b.shape).fill_(pad)
        self._full = MappingProxyType(full)
        self._views: dict[int, Mapping[str, torch.Tensor]] = {}
        for s in p.capture_sizes:  # each buffer's leading rows (and columns) at s
            views = {b.name: full[b.name][tuple(map(slice, p.shape_at(b, s)))] for b in p.buffers}
            self._views[s] = MappingProxyType(views)
        self.layout = Layout(p, chosen())  # the backend, chosen here once: nothing else decides
        self._labels = {s: where("refresh", s) for s in p.capture_sizes}  # not formatted per call
        self._commit = Committer(self.layout, self.slab, full, copies=copies, dirty=poison)
        self._guard = Exclusive(
            "{call}: another thread is using these StaticBuffers (or BoundSources bound to them); use one "
            "StaticBuffers per thread or serialize the calls"
        )
        self._staged = StagedWrites(self.layout, self._commit, full, self._guard)

    @property
    def capture_sizes(self) -> tuple[int, ...]:
        """The capture sizes, sorted ascending."""
        return self.plan.capture_sizes

    @property
    def names(self) -> tuple[str, ...]:
        """Buffer names (per-group buffers as ``<name>.<group>``), in slab order."""
        return self.plan.names

    @property
    def full(self) -> Mapping[str, torch.Tensor]:
        """Each buffer's whole allocation (its shape at the largest capture size)."""
        return self._full

    @property
    def stats(self) -> RefreshStats:
        """Refresh count and bytes written (in place) or uploaded: last refresh and total."""
        return self._commit.stats

    @property
    def upload_copies(self) -> int | None:
        """Host copies uploads are assembled in (None: a cpu slab written in place)."""
        return self._commit.depth if self._commit.uploads else None

    @property
    def staging(self) -> int | None:
        """The former name of :attr:`upload_copies` (deprecated)."""
        warnings.warn("StaticBuffers.staging is now upload_copies", DeprecationWarning, stacklevel=2)
        return self.upload_copies

    def view(self, size: int) -> Mapping[str, torch.Tensor]:
        """Name → the rows a graph of ``size`` tokens captures, as views into the slab (a buffer's views at
        every size start at the same address)."""
        return self._at("view", size)

    def addresses(self, size: int) -> tuple[int, ...]:
        """Data pointers of ``view(size)`` in :attr:`names` order: what a graph of ``size`` baked in."""
        return tuple(t.data_ptr() for t in self._at("addresses", size).values())

    def _at(self, op: str, size: Any) -> Mapping[str, torch.Tensor]:
        views = self._views.get(size) if type(size) is int else None
        if views is None:
            raise self.layout.size_error(op, size)
        return views

    def refresh(
        self,
        size: int,
        sources: Mapping[str, Source] | BoundSources,
        *,
        num_reqs: int | None = None,
        widths: Mapping[str, int] | None = None,
        strict: bool | None = None,
    ) -> int:
        """Write ``sources`` into the buffers captured at ``size``; return the live request count. Every other
        way in (``BoundSources.refresh``, :class:`graphbuf.GraphRunner`) calls this.

        ``sources``: a mapping of buffer name to torch tensor, numpy array or list, on the host or on this
        device, read once (every buffer not declared ``keep: true``; the live request count comes from the
        rows or ``num_reqs``, and all must agree); or :class:`BoundSources` from :meth:`bind` (``num_reqs``
        required, ``widths`` the 2-D live widths). Everything is validated first: on any
        :class:`graphbuf.RefreshError` (or :class:`graphbuf.AddressChangedError` for a bound source changed in
        place) no byte changes. After a valid refresh with n live rows of source width w, ``[:n, :w]`` equals
        the source, ``[:n, w:]`` and rows ``[n:]`` the pad (``repeat_last``: the last live row, up to the rows
        captured at ``size``). Cost (:attr:`stats`): the live cells and those earlier refreshes dirtied.
        """
        guard = self._guard
        guard.enter("refresh()")
        try:
            label = self._labels.get(size) if type(size) is int else None
            if label is None:
                raise self.layout.size_error("refresh", size)
            if _profiling():
                with torch.profiler.record_function("graphbuf.buffers"):
                    return self._refresh(size, label, sources, num_reqs, widths, strict)
            return self._refresh(size, label, sources, num_reqs, widths, strict)
        finally:
            guard.release()

    def _refresh(self, size: int, label: str, sources: Any, num_reqs: Any, widths: Any, strict: Any) -> int:
        prepared, live = self._prepare(label, size, sources, num_reqs, widths, strict, self._staged.required)
        self._staged.commit(prepared, size, live, label)
        return live

    def eager_inputs(
        self,
        size: int,
        sources: Mapping[str, Source] | BoundSources,
        *,
        num_reqs: int | None = None,
        widths: Mapping[str, int] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Fresh device tensors for an eager step of ``size`` tokens, validated and padded as :meth:`refresh`
        does (same errors, labelled ``eager(size=N)``); no byte of the slab changes. Buffers not given
        (``keep: true``) are the largest capture's views; staged buffers left out of a mapping (with
        ``num_reqs``) give their host state, staged writes included (they stay staged). The tensors are
        bounded by ``limits.max_bytes`` (checked before anything is allocated), ``num_reqs`` by ``size``."""
        with self._guard.hold("eager_inputs()"):
            n = count_of(size)
            if n is None or n < 1:
                raise RefreshError(f"eager(size={size!r}): allowed: a token count >= 1")
            label = where("eager", n)
            limit = self.plan.max_bytes
            try:
                need = self.layout.eager_bytes(n, limit)
            except ExprError as exc:
                msg = f"{label}: the buffers' shapes cannot be evaluated at {n} tokens: {exc}"
                raise RefreshError(msg) from None
            if need > limit:
                raise RefreshError(
                    f"{label}: an eager step of {n} tokens needs more than limits.max_bytes ({limit} bytes) "
                    "of inputs; allowed: a step whose inputs fit the spec's limits.max_bytes"
                )
            cap = n // self.layout.tokens_per_request
            reqs = None if num_reqs is None else check_num_reqs(num_reqs, None, label)
            if reqs is not None and reqs > cap:
                msg = f"{label}: num_reqs={reqs}, but an eager step of {n} tokens holds 0..{cap} requests"
                raise RowsError(msg)
            staged = self._staged.names
            if staged and reqs is not None and isinstance(sources, Mapping):
                left_out = staged.difference(sources)
                if left_out:
                    sources = {**sources, **self._staged.host_sources(sorted(left_out), n, reqs)}
            prepared, _ = self._prepare(label, n, sources, num_reqs, widths, None, None)
            out = build_eager(self.layout, prepared, n, self.device)
            largest = self._views[self.capture_sizes[-1]]
            return {name: out[name] if name in out else largest[name] for name in self.names}

    def _prepare(
        self, label: str, size: int, sources: Any, num_reqs: Any, widths: Any, strict: Any, required: Any
    ) -> tuple[list[Prepared], int]:
        strict = self.strict if strict is None else strict
        sources = read_call(self, sources, num_reqs, widths, label)  # a plain dict, or BoundSources
        if type(sources) is dict:
            return prepare_mapping(self.layout, sources, size, num_reqs, label, strict, self.device, required)
        return sources.prepare(size, num_reqs, widths, label, strict=strict, device=self.device)

    def hold(self, call: str) -> Exclusive:
        """These buffers' guard, taken for ``call`` until the ``with`` block ends: meanwhile every other call
        on them (a refresh, a staged write or commit, a bind) raises :class:`graphbuf.ConcurrentUseError`."""
        return self._guard.hold(call)

    def stage(self, name: str) -> StagedBuffer:
        """Staged writes to buffer ``name`` (set/append in a row, set/move/swap/clear rows, scatter),
        committed by the next ``refresh(size, sources, num_reqs=n)`` that leaves ``name`` out of ``sources``:
        only the changed cells are checked and written (see :mod:`graphbuf.buffers.staged`)."""
        with self._guard.hold("stage()"):
            return self._staged.buffer(name)

    def bind(self, sources: Mapping[str, torch.Tensor | np.ndarray]) -> BoundSources:
        """Bind persistent host ``sources`` once, to refresh with ``refresh(size, bound, num_reqs=n)``: see
        :class:`BoundSources` (each source must keep its address and shape while bound)."""
        with self._guard.hold("bind()"):
            return BoundSources(self, self.layout, sources)

    def __repr__(self) -> str:
        return (
            f"StaticBuffers({self.plan.spec.name!r}, device={str(self.device)!r}, "
            f"buffers={len(self.names)}, bytes={self.plan.total_bytes})"
        )


def _upload_copies(copies: Any, staging: Any, device: torch.device) -> int | None:
    """``upload_copies=`` checked, or its default (``staging=``: its former name, with a warning)."""
    name = "upload_copies"
    if staging is not None:
        if copies is not None:
            raise UsageError("StaticBuffers: pass upload_copies= only (staging= is its former name)")
        warnings.warn("StaticBuffers(staging=) is now upload_copies=", DeprecationWarning, stacklevel=3)
        copies, name = staging, "staging"
    if copies is None:
        return 2 if device.type != "cpu" else None
    if count_of(copies) is None or copies < 1:
        raise UsageError(f"StaticBuffers({name}={copies!r}): allowed: an integer >= 1, or None on the cpu")
    return copies  # type: ignore[no-any-return]
