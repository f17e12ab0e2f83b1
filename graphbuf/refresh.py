"""The per-replay hot path: validate every source, then write all buffers in three phases.

Phase 1 validates each source's name, dtype, ndim, rows and width without touching memory. Phase 2
assembles a host image of the slab: one copy of a precomputed pad image (padded rows and stale columns of
every buffer at once), then the live rows of each host source; the image's values are then checked against
every buffer's ``min``/``max`` in one vector pass per dtype. Only then does anything reach the buffers
(phase 3): on cpu one copy of the image into the slab; on an accelerator ONE host-to-device upload from
pinned memory (double-buffered, fenced by events so an upload in flight is never overwritten), then
device-to-device copies of device-resident sources. Any error before phase 3 leaves every byte as it was.

Host work runs through numpy views: a numpy slice assignment costs a fraction of a torch op dispatch, which
is what lets validation pay for itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from graphbuf.errors import RefreshError, RowsError, WidthError
from graphbuf.planner import BufferPlan, Plan

__all__ = ["Refresher", "Source"]

Source = torch.Tensor | np.ndarray | Sequence[Any]

_NP_OF_TORCH: dict[torch.dtype, np.dtype] = {
    torch.bool: np.dtype(np.bool_),
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
}
# bfloat16 has no numpy dtype: its slab bytes are addressed as int16 and sources converted through torch.
_BF16_SAFE_FROM = frozenset((torch.bool, torch.uint8, torch.int8, torch.bfloat16))


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class _Slot:
    """Everything the hot path needs about one buffer, resolved once."""

    plan: BufferPlan
    np_dtype: np.dtype  # element type of the numpy views (int16 bits for bfloat16)
    bf16: bool
    kind: str  # numpy kind of the logical dtype: b, i, u, f
    pad: Any  # pad as a numpy scalar of np_dtype (ignored when repeat_last)
    repeat_last: bool
    capacity: dict[int, tuple[int, int]]  # capture size → (rows, cols); cols 0 for 1-D
    requests_of_rows: dict[int, int] | None  # live rows → live requests; None: rows don't depend on them
    rows_of_requests: tuple[int, ...] | None
    # Full-allocation views of each host image (one on cpu, two staging copies on an accelerator).
    targets: list[np.ndarray]
    device_view: torch.Tensor  # full allocation on the device
    lo: int | None
    hi: int | None
    fast: frozenset[np.dtype]  # source dtypes the fast path takes (safe casts); empty: always the slow path
    in_image: bool = True  # covered by the pad image and the vector bounds checks (every non-keep buffer)


# A validated source: (slot, host array or None, device tensor or None, live rows, width). A plain tuple:
# it is built once per source per refresh, where a dataclass's __init__ alone would cost ~0.25 µs.
_Prepared = tuple[_Slot, np.ndarray | None, torch.Tensor | None, int, int]


class Refresher:
    """Writes sources into the buffers of one slab (built by :class:`graphbuf.StaticBuffers`).

    ``staged``: assemble in two alternating staging copies and upload from them, as on an accelerator
    (default: exactly when the slab is not on the cpu). Tests set it to run the upload path on a cpu slab.
    """

    def __init__(
        self,
        plan: Plan,
        slab: torch.Tensor,
        device_views: Mapping[str, torch.Tensor],
        *,
        strict: bool = False,
        staged: bool | None = None,
    ) -> None:
        self.plan = plan
        self.device = slab.device
        self.strict = strict
        self.on_host = slab.device.type == "cpu" if staged is None else not staged
        self._slab = slab
        if self.on_host:
            self._images = [np.empty(slab.numel(), dtype=np.uint8)]
            self._slab_np = slab.numpy()
            self._staging: list[torch.Tensor] = []
        else:
            pin = slab.device.type != "cpu"  # pinned host memory is what makes the upload asynchronous
            self._staging = [torch.empty(slab.numel(), dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
            self._images = [s.numpy() for s in self._staging]
        self._events: list[Any] = [None, None]
        self._turn = 0
        tpr = plan.tokens_per_request
        self._slots: dict[str, _Slot] = {}
        for b in plan.buffers:
            self._slots[b.name] = self._make_slot(b, self._images, device_views[b.name], tpr)
        self._order = tuple(self._slots.values())
        self._required = frozenset(s.plan.name for s in self._order if not s.plan.keep)
        self._per_group = {b.spec_name for b in plan.buffers if b.group is not None}
        required = [s.plan for s in self._order if not s.plan.keep]
        self._image_end = max((b.offset + b.nbytes for b in required), default=0)
        self._image_span = self.spans_of(frozenset())
        self._pad_image = self._make_pad_image()
        self._checks = [
            [
                (img[start:end].view(udtype), lo, span, np.empty_like(span), np.empty(span.shape, dtype=bool))
                for start, end, udtype, lo, span in self._make_checks()
            ]
            for img in self._images
        ]

    def _make_pad_image(self) -> np.ndarray:
        image = np.zeros(self._image_end, dtype=np.uint8)
        for slot in self._order:
            b = slot.plan
            if slot.in_image:
                image[b.offset : b.offset + b.nbytes].view(slot.np_dtype)[:] = slot.pad
        return image

    def _make_checks(self) -> list[tuple[int, int, np.dtype, np.ndarray | None, np.ndarray]]:
        """Per run of same-dtype integer buffers in the image that declare bounds: the byte range, the
        unsigned element dtype, and per-element lower bound (None: all 0) and allowed span. In unsigned
        arithmetic ``x - lo <= span`` tests both bounds with one subtract and one compare."""
        checks = []
        slots = [s for s in self._order if s.in_image]
        i = 0
        while i < len(slots):
            j = i
            while j + 1 < len(slots) and slots[j + 1].np_dtype == slots[i].np_dtype:
                j += 1
            run = slots[i : j + 1]
            i = j + 1
            dtype = run[0].np_dtype
            if run[0].kind == "f" or all(s.lo is None and s.hi is None for s in run):
                continue  # float sources take the slow path, which checks their bounds and NaN
            start, end = run[0].plan.offset, run[-1].plan.offset + run[-1].plan.nbytes
            udtype = np.dtype(f"u{dtype.itemsize}")
            info = np.iinfo(dtype) if dtype.kind != "b" else None
            dmin, dmax = (0, 1) if info is None else (int(info.min), int(info.max))
            lo = np.full((end - start) // dtype.itemsize, dmin, dtype=dtype)
            hi = np.full_like(lo, dmax)
            for s in run:
                a = (s.plan.offset - start) // dtype.itemsize
                z = a + s.plan.nbytes // dtype.itemsize
                lo[a:z] = dmin if s.lo is None else max(dmin, s.lo)
                hi[a:z] = dmax if s.hi is None else min(dmax, s.hi)
            span = (hi.view(udtype) - lo.view(udtype)).astype(udtype)
            lo_u = lo.view(udtype).copy()
            # Elements that take any value (alignment gaps, unbounded buffers) as lo 0 and the widest span,
            # so a run whose other lower bounds are 0 compares its unsigned view directly, skipping the
            # subtract (negatives wrap high).
            unbounded = (lo == dmin) & (hi == dmax)
            lo_u[unbounded] = 0
            span[unbounded] = np.iinfo(udtype).max
            checks.append((start, end, udtype, lo_u if lo_u.any() else None, span))
        return checks

    def _make_slot(self, b: BufferPlan, blobs: list[np.ndarray], dev: torch.Tensor, tpr: int) -> _Slot:
        bf16 = b.dtype == torch.bfloat16
        np_dtype = np.dtype(np.int16) if bf16 else _NP_OF_TORCH[b.dtype]
        kind = "f" if bf16 else np_dtype.kind
        targets = [blob[b.offset : b.offset + b.nbytes].view(np_dtype).reshape(b.shape) for blob in blobs]
        capacity = {}
        for s in self.plan.capture_sizes:
            shape = self.plan.shape_at(b, s)
            capacity[s] = (shape[0], shape[1] if len(shape) > 1 else 0)
        requests_of_rows = rows_of_requests = None
        if b.rows.names & {"tokens", "requests"}:
            max_req = max(self.plan.capture_sizes) // tpr
            rows_of_requests = tuple(
                b.rows.eval({**self.plan.constants, "tokens": r * tpr, "requests": r})
                for r in range(max_req + 1)
            )
            requests_of_rows = {}
            for r, n in enumerate(rows_of_requests):
                requests_of_rows.setdefault(n, r)
        repeat_last = b.pad == "repeat_last"
        pad = self._host_value(0 if repeat_last else b.pad, b.dtype, np_dtype)
        fast = frozenset()
        if kind != "f" and not b.keep:  # float sources take the slow path: it looks for NaN
            fast = frozenset(d for d in _NP_OF_TORCH.values() if np.can_cast(d, np_dtype, "safe"))
        return _Slot(
            plan=b,
            np_dtype=np_dtype,
            bf16=bf16,
            kind=kind,
            pad=pad,
            repeat_last=repeat_last,
            capacity=capacity,
            requests_of_rows=requests_of_rows,
            rows_of_requests=rows_of_requests,
            targets=targets,
            device_view=dev,
            lo=b.min,
            hi=b.max,
            fast=fast,
            in_image=not b.keep,
        )

    @staticmethod
    def _host_value(value: Any, dtype: torch.dtype, np_dtype: np.dtype) -> Any:
        if dtype == torch.bfloat16:
            return torch.tensor(value, dtype=torch.bfloat16).view(torch.int16).item()
        return np_dtype.type(value)

    # ------------------------------------------------------------------------------------------------------
    # Phase 1: validation. Nothing below writes memory.

    def _fail(self, cls: type[RefreshError], name: str, size: int | str, msg: str) -> RefreshError:
        """``size``: the capture size being refreshed, or the name of the call (``"bind()"``)."""
        return cls(f"{self._where(size)}: buffer {name!r}: {msg}")

    @staticmethod
    def _where(size: int | str) -> str:
        return f"refresh(size={size})" if isinstance(size, int) else size

    def _size_error(self, size: int) -> RefreshError:
        sizes = ", ".join(map(str, self.plan.capture_sizes))
        return RefreshError(f"refresh(size={size}): not a capture size; sizes: {sizes}")

    def _missing_error(self, size: int | str, given: Iterable[str]) -> RefreshError:
        missing = ", ".join(sorted(self._required.difference(given)))
        return RefreshError(
            f"{self._where(size)}: missing buffer(s) {missing}; only buffers declared 'keep: true' may "
            "be omitted"
        )

    def _slot(self, size: int | str, name: str) -> _Slot:
        slot = self._slots.get(name)
        if slot is None:
            if name in self._per_group:
                names = ", ".join(s.plan.name for s in self._order if s.plan.spec_name == name)
                raise self._fail(
                    RefreshError, name, size, f"is declared per group; pass each group's buffer: {names}"
                )
            raise self._fail(RefreshError, name, size, f"unknown buffer; known: {', '.join(self._slots)}")
        return slot

    def _prepare(self, name: str, src: Any, size: int, strict: bool) -> _Prepared:
        slot = self._slot(size, name)
        b = slot.plan
        host: np.ndarray | None = None
        dev: torch.Tensor | None = None
        if isinstance(src, torch.Tensor):
            if src.device.type == "cpu":
                if src.dtype == torch.bfloat16 or src.dtype not in _NP_OF_TORCH:
                    self._check_torch_dtype(slot, src.dtype, name, size)
                    host = src.detach().to(torch.float32).numpy()
                    self._check_layout(slot, host, name, size)
                else:
                    host = src.detach().numpy()
                    self._check_typed(slot, host, name, size)
            elif not self.on_host and src.device == self.device:
                self._check_torch_dtype(slot, src.dtype, name, size)
                if src.dim() != b.ndim:
                    raise self._fail(
                        RefreshError, name, size, f"expected {b.ndim}-D source, got shape {list(src.shape)}"
                    )
                if src.dim() and src.shape[-1] > 1 and src.stride(-1) != 1:
                    raise self._fail(
                        RefreshError,
                        name,
                        size,
                        f"source elements are strided (stride {src.stride(-1)} in the last dim); pass rows "
                        "with contiguous elements (a transposed source is a layout bug)",
                    )
                dev = src
            else:
                raise self._fail(
                    RefreshError,
                    name,
                    size,
                    f"source is on {src.device}; allowed: host memory or {self.device}",
                )
        elif isinstance(src, np.ndarray):
            host = src
            self._check_typed(slot, host, name, size)
        elif isinstance(src, (list, tuple)):
            host = self._from_list(slot, src, name, size)
        else:
            raise self._fail(
                RefreshError,
                name,
                size,
                f"unsupported source type {type(src).__name__}; allowed: torch.Tensor, numpy.ndarray, list",
            )
        shape = host.shape if host is not None else tuple(dev.shape)  # type: ignore[union-attr]
        rows = shape[0]
        cap_rows, cap_cols = slot.capacity[size]
        if rows > cap_rows:
            raise self._fail(
                RowsError,
                name,
                size,
                f"{rows} live rows, but capture size {size} holds {cap_rows} (rows = {b.rows.text})",
            )
        width = 0
        if b.ndim == 2:
            width = shape[1]
            if width > cap_cols:
                if b.overflow == "reject":
                    raise self._fail(
                        WidthError,
                        name,
                        size,
                        f"source is {width} wide, above the captured allocation of {cap_cols} columns "
                        f"(cols = {b.cols.text}); overflow: reject",  # type: ignore[union-attr]
                    )
                width = cap_cols
                if host is not None:
                    host = host[:, :cap_cols]
                else:
                    dev = dev[:, :cap_cols]  # type: ignore[index]
        if (
            host is not None
            and host.size
            and (slot.lo is not None or slot.hi is not None or slot.kind == "f")
        ):
            self._check_values_host(slot, host, name, size)
        elif dev is not None and strict and dev.numel():
            self._check_values_device(slot, dev, name, size)
        return (slot, host, dev, rows, width)

    def _check_torch_dtype(self, slot: _Slot, dtype: torch.dtype, name: str, size: int) -> None:
        if slot.bf16:
            ok = dtype in _BF16_SAFE_FROM
        elif dtype == torch.bfloat16:
            ok = slot.np_dtype in (np.dtype(np.float32), np.dtype(np.float64))
        else:
            ok = dtype in _NP_OF_TORCH and np.can_cast(_NP_OF_TORCH[dtype], slot.np_dtype, "safe")
        if not ok:
            raise self._fail(
                RefreshError,
                name,
                size,
                f"dtype {_dtype_name(dtype)} cannot be cast safely to {_dtype_name(slot.plan.dtype)}",
            )

    def _check_layout(self, slot: _Slot, arr: np.ndarray, name: str, size: int | str) -> None:
        if arr.ndim != slot.plan.ndim:
            raise self._fail(
                RefreshError, name, size, f"expected {slot.plan.ndim}-D source, got shape {list(arr.shape)}"
            )
        # numpy gives empty arrays zero strides: only a non-empty source can be strided.
        if arr.ndim and arr.size and arr.shape[-1] > 1 and arr.strides[-1] != arr.itemsize:
            raise self._fail(
                RefreshError,
                name,
                size,
                f"source elements are strided ({arr.strides[-1]} bytes apart in the last dim); pass rows "
                "with contiguous elements (a transposed source is a layout bug)",
            )

    def _check_typed(self, slot: _Slot, arr: np.ndarray, name: str, size: int | str) -> None:
        if slot.bf16:
            ok = arr.dtype in (np.dtype(np.bool_), np.dtype(np.uint8), np.dtype(np.int8))
        else:
            ok = arr.dtype.kind in "biuf" and np.can_cast(arr.dtype, slot.np_dtype, "safe")
        if not ok:
            raise self._fail(
                RefreshError,
                name,
                size,
                f"dtype {arr.dtype} cannot be cast safely to {_dtype_name(slot.plan.dtype)}",
            )
        self._check_layout(slot, arr, name, size)

    def _from_list(self, slot: _Slot, src: Sequence[Any], name: str, size: int) -> np.ndarray:
        try:
            arr = np.asarray(src)
        except (ValueError, TypeError) as exc:
            raise self._fail(RefreshError, name, size, f"ragged or non-numeric list ({exc})") from None
        if arr.size == 0:  # an empty list has no dtype (numpy guesses float64); `[]` for a 2-D buffer is 0x0
            shape = (0, 0) if arr.shape == (0,) and slot.plan.ndim == 2 else arr.shape
            arr = arr.astype(slot.np_dtype).reshape(shape)
        if arr.dtype.kind not in "biuf":
            raise self._fail(
                RefreshError, name, size, f"list holds {arr.dtype} values; allowed: numbers of one shape"
            )
        if arr.dtype.kind == "f" and slot.kind != "f":
            raise self._fail(
                RefreshError,
                name,
                size,
                f"list holds floats; {_dtype_name(slot.plan.dtype)} takes integers",
            )
        self._check_layout(slot, arr, name, size)
        if arr.size and slot.kind in "iub" and arr.dtype.kind != "b":
            info = np.iinfo(slot.np_dtype) if slot.kind != "b" else None
            lo, hi = (0, 1) if info is None else (int(info.min), int(info.max))
            amin, amax = int(arr.min()), int(arr.max())
            if amin < lo or amax > hi:
                raise self._fail(
                    RefreshError,
                    name,
                    size,
                    f"values {amin}..{amax} do not fit {_dtype_name(slot.plan.dtype)} ({lo}..{hi})",
                )
        elif arr.size and slot.kind == "f" and slot.plan.dtype != torch.float64:
            finite = torch.finfo(slot.plan.dtype).max
            big = float(np.abs(arr[np.isfinite(arr)]).max(initial=0.0))
            if big > finite:
                raise self._fail(
                    RefreshError, name, size,
                    f"value {big:g} does not fit {_dtype_name(slot.plan.dtype)} (largest finite {finite:g})",
                )  # fmt: skip
        return arr

    def _bounds_error(
        self, slot: _Slot, name: str, size: int, where: Any, value: Any, which: str
    ) -> RefreshError:
        b = slot.plan
        limit = b.min if which == "min" else b.max
        spec = self.plan.spec.buffers[b.spec_name]
        rel = "below" if which == "min" else "above"
        return self._fail(
            RefreshError,
            name,
            size,
            f"value {value} at index {list(where)} is {rel} {which} {limit} "
            f"({which}: {getattr(spec, which)})",
        )

    def _check_values_host(self, slot: _Slot, arr: np.ndarray, name: str, size: int) -> None:
        if arr.dtype.kind == "f" and np.isnan(arr).any():
            where = np.argwhere(np.isnan(arr))[0]
            raise self._fail(RefreshError, name, size, f"NaN at index {where.tolist()}")
        if slot.lo is not None:
            amin = arr.min()
            if amin < slot.lo:
                raise self._bounds_error(slot, name, size, np.argwhere(arr == amin)[0].tolist(), amin, "min")
        if slot.hi is not None:
            amax = arr.max()
            if amax > slot.hi:
                raise self._bounds_error(slot, name, size, np.argwhere(arr == amax)[0].tolist(), amax, "max")

    def _check_values_device(self, slot: _Slot, t: torch.Tensor, name: str, size: int) -> None:
        # Strict mode only: each reduction read back to the host is a device sync.
        if t.is_floating_point() and bool(torch.isnan(t).any()):
            raise self._fail(RefreshError, name, size, "NaN in device source")
        if slot.lo is not None:
            amin = t.min().item()
            if amin < slot.lo:
                where = (t == amin).nonzero()[0].tolist()
                raise self._bounds_error(slot, name, size, where, amin, "min")
        if slot.hi is not None:
            amax = t.max().item()
            if amax > slot.hi:
                where = (t == amax).nonzero()[0].tolist()
                raise self._bounds_error(slot, name, size, where, amax, "max")

    # ------------------------------------------------------------------------------------------------------

    def refresh(
        self,
        size: int,
        sources: Mapping[str, Any],
        *,
        num_reqs: int | None = None,
        strict: bool | None = None,
    ) -> int:
        """Validate all ``sources``, then write them; return the live request count."""
        if torch._C._autograd._profiler_enabled():
            with torch.profiler.record_function("graphbuf.refresh"):
                return self._refresh(size, sources, num_reqs, strict)
        return self._refresh(size, sources, num_reqs, strict)

    def _refresh(
        self, size: int, sources: Mapping[str, Any], num_reqs: int | None, strict: bool | None
    ) -> int:
        if size not in self.plan.capture_sizes:
            raise self._size_error(size)
        strict = self.strict if strict is None else strict
        k = self._begin()
        prepared = []
        slots = self._slots
        fast_given = (
            0  # non-keep buffers taken by the fast path (each name at most once: sources is a mapping)
        )
        for name, src in sources.items():
            # The common case inline: a host array of a safe dtype that fits. Anything unusual goes to the
            # slow path, which accepts it or says precisely why not.
            slot = slots.get(name)
            if slot is not None and slot.fast:
                tp = type(src)
                arr = src if tp is np.ndarray else None
                if tp is torch.Tensor and src.is_cpu and not src.requires_grad and src.dtype in _NP_OF_TORCH:
                    arr = src.numpy()
                if arr is not None and arr.dtype in slot.fast:
                    shape = arr.shape
                    cap_rows, cap_cols = slot.capacity[size]
                    if len(shape) == 1 and not cap_cols:
                        n = shape[0]
                        if n <= cap_rows and (n < 2 or arr.strides[0] == arr.itemsize):
                            t = slot.targets[k]
                            t[:n] = arr
                            if slot.repeat_last and n:
                                t[n:] = t[n - 1]
                            prepared.append((slot, arr, None, n, 0))
                            fast_given += 1
                            continue
                    elif len(shape) == 2 and cap_cols:
                        rows, width = shape
                        if (
                            rows <= cap_rows
                            and width <= cap_cols
                            and (width < 2 or arr.strides[1] == arr.itemsize)
                        ):
                            t = slot.targets[k]
                            t[:rows, :width] = arr
                            if slot.repeat_last and rows:
                                t[rows:] = t[rows - 1]
                            prepared.append((slot, arr, None, rows, width))
                            fast_given += 1
                            continue
            p = self._prepare(name, src, size, strict)
            self._place(p, k)
            prepared.append(p)
        if fast_given != len(self._required) and not self._required.issubset(sources.keys()):
            raise self._missing_error(size, sources.keys())
        live = self._live_requests(prepared, size, num_reqs)
        if not self._image_in_bounds(k):
            self._raise_bounds(prepared, size, k)
        if len(prepared) == len(self._required):
            spans = self._image_span
        else:
            spans = self.spans_of({p[0].plan.name for p in prepared})
        self._commit(k, spans, prepared)
        return live

    # The steps every refresh shares (the bound-source refresh of :mod:`graphbuf.bound` too).

    def _begin(self) -> int:
        """Claim host image ``k`` and reset it to the pad image; return ``k``.

        The image is scratch: sources are placed into it while they are validated, and nothing reaches
        the buffers before every source and bound has passed (:meth:`_commit`).
        """
        k = self._turn
        if self._events[k] is not None:
            self._events[k].synchronize()  # the upload that last read this staging copy has finished
        self._images[k][: self._image_end] = self._pad_image
        return k

    def _image_in_bounds(self, k: int) -> bool:
        """One vector pass per dtype run of image ``k``: every value within its buffer's min/max."""
        for region, lo, span, diff, over in self._checks[k]:
            if lo is not None:
                region = np.subtract(region, lo, out=diff)
            np.greater(region, span, out=over)
            if over.tobytes().find(1) >= 0:  # cheaper than count_nonzero or any() on a few KiB
                return False
        return True

    def spans_of(self, names: set[str] | frozenset[str]) -> list[tuple[int, int]]:
        """Byte ranges of the image a refresh writing ``names`` copies out: every non-keep buffer (the pad
        image) plus the given keep buffers, merged where adjacent."""
        written = set(names) | self._required
        spans: list[tuple[int, int]] = []
        open_lo = None
        end = 0
        for slot in self._order:
            b = slot.plan
            if b.name in written:
                if open_lo is None:
                    open_lo = b.offset
                end = b.offset + b.nbytes
            elif open_lo is not None:
                spans.append((open_lo, end))
                open_lo = None
        if open_lo is not None:
            spans.append((open_lo, end))
        return spans

    def _commit(self, k: int, spans: list[tuple[int, int]], prepared: Sequence[_Prepared] = ()) -> None:
        """Phase 3: write image ``k``'s ``spans`` into the slab, then the device-resident ``prepared``."""
        if self.on_host:
            slab, image = self._slab_np, self._images[k]
            for lo, hi in spans:
                slab[lo:hi] = image[lo:hi]
            return
        self._turn ^= 1
        staged = self._staging[k]
        for lo, hi in spans:
            self._slab[lo:hi].copy_(staged[lo:hi], non_blocking=True)
        for slot, _, dev, n, width in prepared:
            if dev is None:
                continue
            view = slot.device_view
            if view.dim() == 1:
                view[:n].copy_(dev, non_blocking=True)
            else:
                view[:n, :width].copy_(dev, non_blocking=True)
            if slot.repeat_last and n:
                view[n:].copy_(view[n - 1].expand_as(view[n:]))
        event = getattr(torch, self.device.type).Event()
        event.record()
        self._events[k] = event

    def _live_requests(self, prepared: list[_Prepared], size: int, num_reqs: int | None) -> int:
        cap_requests = size // self.plan.tokens_per_request
        if num_reqs is not None and not 0 <= num_reqs <= cap_requests:
            raise RowsError(
                f"refresh(size={size}): num_reqs={num_reqs}, but capture size {size} holds "
                f"0..{cap_requests} requests"
            )
        live, source = num_reqs, "num_reqs"
        for slot, _, _, rows, _ in prepared:
            table = slot.requests_of_rows
            if table is None:
                continue
            name = slot.plan.name
            if live is None:
                found = table.get(rows)
                if found is None:
                    raise self._fail(
                        RefreshError, name, size,
                        f"{rows} rows match no live request count (rows = {slot.plan.rows.text})",
                    )  # fmt: skip
                live, source = found, name
            elif slot.rows_of_requests[live] != rows:  # type: ignore[index]
                raise self._fail(
                    RefreshError, name, size,
                    f"{rows} rows, but {source} implies {live} live requests, so "
                    f"{slot.rows_of_requests[live]} rows (rows = {slot.plan.rows.text})",  # type: ignore[index]
                )  # fmt: skip
        if live is None:
            raise RefreshError(
                f"refresh(size={size}): no source determines the live request count; pass num_reqs="
            )
        return live

    # ------------------------------------------------------------------------------------------------------
    # Phase 2: host assembly (live rows, stale columns, padded rows).

    def _assemble(self, p: _Prepared, t: np.ndarray) -> None:
        slot, src, _, n, w = p
        if src is not None:
            if slot.bf16:
                src = torch.from_numpy(np.ascontiguousarray(src)).to(torch.bfloat16).view(torch.int16).numpy()
            if t.ndim == 1:
                t[:n] = src
            else:
                t[:n, :w] = src
        if t.ndim == 2 and w < t.shape[1]:
            t[:n, w:] = slot.pad
        if slot.repeat_last and n and src is not None:
            t[n:] = t[n - 1]
        else:
            t[n:] = slot.pad

    def _place(self, p: _Prepared, k: int) -> None:
        """Write one slow-path source into host image ``k`` (the fast path writes its own inline)."""
        slot, src, _, n, width = p
        t = slot.targets[k]
        if not slot.in_image:
            self._assemble(p, t)  # keep buffers lie outside the pad image: write their pads too
            return
        if src is None:
            return  # a device source: its live rows are copied on the device after the upload
        if slot.bf16:
            src = torch.from_numpy(np.ascontiguousarray(src)).to(torch.bfloat16).view(torch.int16).numpy()
        if t.ndim == 1:
            t[:n] = src
        else:
            t[:n, :width] = src
        if slot.repeat_last and n:
            t[n:] = t[n - 1]

    def _raise_bounds(self, prepared: list[_Prepared], size: int, k: int) -> None:
        for slot, src, _, _, _ in prepared:
            if src is not None and src.size:
                self._check_values_host(slot, src, slot.plan.name, size)
        for slot in self._order:  # unreachable with a checked spec (pads lie within bounds); name the buffer
            b, view = slot.plan, slot.targets[k]
            if (
                slot.in_image
                and view.size
                and ((b.min is not None and view.min() < b.min) or (b.max is not None and view.max() > b.max))
            ):
                raise self._fail(
                    RefreshError, b.name, size, f"a padded value lies outside min/max of {b.name}"
                )
        raise RefreshError(f"refresh(size={size}): a value is outside its buffer's min/max bounds")
