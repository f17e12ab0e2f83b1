"""Validation of one source, and of the call's request count and widths. Pure: nothing here writes memory.

:func:`check_source` turns one source into a :data:`Prepared` record: a host array ready to copy (bfloat16 as
its int16 bits) or a device tensor, its live rows and live width, after every check a refresh makes (type,
dtype safe cast, layout, rows and width against the capacity, NaN and ``min``/``max`` on the live values).
The checks cost O(live): only the source's own elements are read.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from graphbuf.buffers.layout import NP_OF_TORCH, Layout, ResolvedBuffer, dtype_name
from graphbuf.errors import RefreshError, RowsError, WidthError

__all__ = [
    "Prepared",
    "Source",
    "check_num_reqs",
    "check_row",
    "check_source",
    "check_typed",
    "check_values",
    "check_widths",
    "count_of",
    "fit_typed",
    "live_requests",
    "no_count_error",
    "prepared",
    "requests_hint",
    "requests_of_rows",
    "values_fit",
]

#: What a refresh takes per buffer: a torch tensor, a numpy array or a (nested) list of numbers.
Source = torch.Tensor | np.ndarray | Sequence[Any]


class Prepared(NamedTuple):
    """One validated source, ready to write. ``host``: host values (bfloat16 as its int16 bits) or None;
    ``dev``: a source on the slab's device or None; the live values are ``host[:rows, :width]`` (1-D:
    ``host[:rows]``): a bound source is passed whole, not sliced. The native write reads it as a 5-tuple.

    Built on the hot path with :func:`prepared` (``tuple.__new__``), measured: ~0.13 µs more per source than
    a plain tuple, where the NamedTuple constructor costs ~0.25 µs more."""

    slot: ResolvedBuffer
    host: np.ndarray | None
    dev: torch.Tensor | None
    rows: int
    width: int


_new_tuple = tuple.__new__


def prepared(
    slot: ResolvedBuffer, host: np.ndarray | None, dev: torch.Tensor | None, rows: int, width: int
) -> Prepared:
    """A :class:`Prepared` record, built without the NamedTuple constructor's argument binding."""
    return _new_tuple(Prepared, (slot, host, dev, rows, width))  # type: ignore[no-any-return]


_BF16_SAFE_FROM = frozenset((torch.bool, torch.uint8, torch.int8, torch.bfloat16))
_UNSIGNED = {np.dtype(f"i{n}"): np.dtype(f"u{n}") for n in (1, 2, 4, 8)}
_IMAX = {d: int(np.iinfo(d).max) for d in _UNSIGNED}  # np.iinfo costs more than the reduction it guards
_BF16_SAFE_NP = frozenset((np.dtype(np.bool_), np.dtype(np.uint8), np.dtype(np.int8)))
_MAX = np.maximum.reduce  # the ufunc's own reduce: ndarray.max() adds a Python wrapper per call
_MIN = np.minimum.reduce
_SMALL = 32  # elements up to which values_fit checks a 1-D source in Python (measured break-even)


def count_of(n: Any) -> int | None:
    """``n`` as an int if it is an integer (numpy integers included; bool, float and str not), else None."""
    if isinstance(n, bool):
        return None
    try:
        return operator.index(n)
    except TypeError:
        return None


def check_source(
    layout: Layout, name: Any, src: Any, size: int, label: str, strict: bool, device: torch.device
) -> Prepared:
    """Validate ``src`` for buffer ``name`` at ``size`` tokens; ``label`` starts every error message."""
    slot = layout.slot(label, name)
    host: np.ndarray | None = None
    tp = type(src)
    if tp is np.ndarray:
        host = src
    elif tp is torch.Tensor and src.is_cpu and src.dtype in NP_OF_TORCH and _plain(src):
        host = src.detach().numpy() if src.requires_grad else src.numpy()  # detach() costs a new tensor
    if host is not None and host.dtype in slot.fast:  # no dtype work, integer values
        return layout.backend.accept(layout, slot, name, host, size, label, strict)
    host, dev = _typed(layout, slot, name, src, label, device)
    return _fitted(layout, slot, name, host, dev, size, label, strict)


def fit_typed(
    layout: Layout, slot: ResolvedBuffer, name: str, host: np.ndarray, size: int, label: str, strict: bool
) -> Prepared:
    """A host source of a dtype ``slot`` casts safely without a value check, validated (layout, capacity,
    bounds): what :meth:`graphbuf.buffers.backend.Backend.accept` does in numpy."""
    _check_layout(slot, host, name, label)
    return _fitted(layout, slot, name, host, None, size, label, strict)


def _typed(
    layout: Layout, slot: ResolvedBuffer, name: str, src: Any, label: str, device: torch.device
) -> tuple[np.ndarray | None, torch.Tensor | None]:
    """``src`` as host values or a device tensor of this device, after the type, dtype and layout checks."""
    tp = type(src)
    if isinstance(src, torch.Tensor):
        if tp is not torch.Tensor and tp is not torch.nn.Parameter:
            raise layout.fail(
                RefreshError, name, label,
                f"tensor subclass {tp.__name__} (its methods run its own code between graphbuf's check and "
                "write); pass a plain torch.Tensor, e.g. t.as_subclass(torch.Tensor)",
            )  # fmt: skip
        _check_tensor_kind(slot, src, name, label)
        if src.device.type == "cpu":
            if src.dtype == torch.bfloat16 or src.dtype not in NP_OF_TORCH:
                _check_torch_dtype(slot, src.dtype, name, label)
                host = src.detach().to(torch.float32).numpy()
                _check_layout(slot, host, name, label)
            else:
                host = src.detach().numpy()
                check_typed(slot, host, name, label)
            return host, None
        if device.type != "cpu" and src.device == device:
            _check_device_layout(slot, src, name, label)
            return None, src.detach()
        raise layout.fail(
            RefreshError, name, label, f"source is on {src.device}; allowed: host memory or {device}"
        )
    if isinstance(src, np.ndarray):
        if tp is not np.ndarray:
            raise layout.fail(
                RefreshError, name, label,
                f"numpy subclass {tp.__name__} (its extra state, e.g. a mask, would be dropped); pass a "
                "plain numpy.ndarray",
            )  # fmt: skip
        check_typed(slot, src, name, label)
        return src, None
    if isinstance(src, (list, tuple)):
        return _from_list(slot, src, name, label), None
    raise layout.fail(
        RefreshError, name, label,
        f"unsupported source type {tp.__name__}; allowed: torch.Tensor, numpy.ndarray, list",
    )  # fmt: skip


_CPU = torch.device("cpu")


def check_row(slot: ResolvedBuffer, values: Any, name: str, label: str) -> np.ndarray:
    """One row of staged values (1-D: a run of elements) under a refresh's rules of type, dtype and layout
    (:func:`_typed`, the one value rule both share): a fresh, contiguous 1-D array of the buffer's dtype,
    owned here (nothing the caller does to ``values`` afterwards reaches it). Bounds and NaN are checked
    when a refresh commits the values."""
    tp = type(values)
    src = values
    if tp is np.ndarray or ((tp is torch.Tensor or tp is torch.nn.Parameter) and _plain(values)):
        nd = values.ndim
        if nd > 1:
            raise Layout.fail(
                RefreshError, name, label, f"values of shape {list(values.shape)}; pass one row (1-D)"
            )
        row = values.reshape(1) if nd == 0 else values
        src = row.reshape(1, -1) if slot.ndim == 2 else row
    elif tp is list or tp is tuple:
        src = [values] if slot.ndim == 2 else values
    elif isinstance(values, (numbers.Number, np.generic)) and not isinstance(values, (str, bytes)):
        src = [[values]] if slot.ndim == 2 else [values]
    host, _ = _typed(Layout, slot, name, src, label, _CPU)  # type: ignore[arg-type]
    return np.array(host, dtype=slot.np_dtype, order="C").reshape(-1)


def _check_device_layout(slot: ResolvedBuffer, src: torch.Tensor, name: str, label: str) -> None:
    _check_torch_dtype(slot, src.dtype, name, label)
    if src.dim() != slot.ndim:
        raise Layout.fail(
            RefreshError, name, label, f"expected {slot.ndim}-D source, got shape {list(src.shape)}"
        )
    if src.dim() and src.shape[-1] > 1 and src.stride(-1) != 1:
        raise Layout.fail(
            RefreshError, name, label,
            f"source elements are strided (stride {src.stride(-1)} in the last dim); pass rows "
            "with contiguous elements (a transposed source is a layout bug)",
        )  # fmt: skip


def _fitted(
    layout: Layout,
    slot: ResolvedBuffer,
    name: str,
    host: np.ndarray | None,
    dev: torch.Tensor | None,
    size: int,
    label: str,
    strict: bool,
) -> Prepared:
    """The typed source against the capacity at ``size`` (rows; width clipped or rejected by ``overflow``)
    and its values against the bounds; bfloat16 host values as their int16 bits."""
    shape = host.shape if host is not None else tuple(dev.shape)  # type: ignore[union-attr]
    rows = shape[0]
    b = slot.plan
    cap_rows, cap_cols = layout.capacity(slot, size)
    if rows > cap_rows:
        held = "capture size" if size in slot.capacity else "an eager step of"
        raise layout.fail(
            RowsError, name, label,
            f"{rows} live rows, but {held} {size} holds {cap_rows} (rows = {b.rows.text})",
        )  # fmt: skip
    width = 0
    if slot.ndim == 2:
        width = shape[1]
        if width > cap_cols:
            if b.overflow == "reject":
                raise layout.fail(
                    WidthError, name, label,
                    f"source is {width} wide, above the captured allocation of {cap_cols} columns "
                    f"(cols = {b.cols.text}); overflow: reject",  # type: ignore[union-attr]
                )  # fmt: skip
            width = cap_cols
            if host is not None:
                host = host[:, :cap_cols]
            else:
                dev = dev[:, :cap_cols]  # type: ignore[index]
    if host is not None:
        if (
            host.size
            and (slot.lo is not None or slot.hi is not None or host.dtype.kind == "f")
            and not layout.backend.fits(slot, host, rows, width)
        ):
            check_values(layout, slot, host, name, label)
        if slot.bf16:  # torch refuses negative strides, which numpy keeps on one-element and empty views
            dense = host if min(host.strides, default=0) >= 0 else np.array(host, order="C")
            host = torch.from_numpy(dense).to(torch.bfloat16).view(torch.int16).numpy()
    elif strict and dev.numel():  # type: ignore[union-attr]
        _check_values_device(layout, slot, dev, name, label)  # type: ignore[arg-type]
    return _new_tuple(Prepared, (slot, host, dev, rows, width))


def _plain(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_nested and not t.is_conj() and not t.is_neg()


def _check_tensor_kind(slot: ResolvedBuffer, t: torch.Tensor, name: str, label: str) -> None:
    what = None
    if t.is_nested:
        what = "a nested tensor"
    elif t.layout != torch.strided:
        what = f"a {str(t.layout).removeprefix('torch.')} tensor"
    elif t.is_conj() or t.is_neg():
        what = "a tensor with a lazy conjugate/negative bit"
    elif t.dim() == 0:
        what = "a 0-d tensor"
    if what is not None:
        raise Layout.fail(
            RefreshError, name, label, f"{what}; allowed: a dense {slot.ndim}-D tensor (strided layout)"
        )


def _check_torch_dtype(slot: ResolvedBuffer, dtype: torch.dtype, name: str, label: str) -> None:
    if slot.bf16:
        ok = dtype in _BF16_SAFE_FROM
    elif dtype == torch.bfloat16:
        ok = slot.np_dtype in (np.dtype(np.float32), np.dtype(np.float64))
    else:
        ok = dtype in NP_OF_TORCH and np.can_cast(NP_OF_TORCH[dtype], slot.np_dtype, "safe")
    if not ok:
        raise Layout.fail(
            RefreshError,
            name,
            label,
            f"dtype {dtype_name(dtype)} cannot be cast safely to {dtype_name(slot.plan.dtype)}",
        )


def _check_layout(slot: ResolvedBuffer, arr: np.ndarray, name: str, label: str) -> None:
    if arr.ndim != slot.ndim:
        raise Layout.fail(
            RefreshError, name, label, f"expected {slot.ndim}-D source, got shape {list(arr.shape)}"
        )
    # numpy gives empty arrays zero strides: only a non-empty source can be strided.
    if arr.ndim and arr.size and arr.shape[-1] > 1 and arr.strides[-1] != arr.itemsize:
        raise Layout.fail(
            RefreshError, name, label,
            f"source elements are strided ({arr.strides[-1]} bytes apart in the last dim); pass rows "
            "with contiguous elements (a transposed source is a layout bug)",
        )  # fmt: skip


def check_typed(slot: ResolvedBuffer, arr: np.ndarray, name: str, label: str) -> None:
    """A numpy source's dtype casts safely to the buffer's, and its layout fits (ndim, contiguous rows)."""
    if slot.bf16:
        ok = arr.dtype in _BF16_SAFE_NP
    else:
        ok = arr.dtype.kind in "biuf" and np.can_cast(arr.dtype, slot.np_dtype, "safe")
    if not ok:
        raise Layout.fail(
            RefreshError,
            name,
            label,
            f"dtype {arr.dtype} cannot be cast safely to {dtype_name(slot.plan.dtype)}",
        )
    _check_layout(slot, arr, name, label)


def _from_list(slot: ResolvedBuffer, src: list | tuple, name: str, label: str) -> np.ndarray:
    """A list's values, accepted exactly when each converts to the buffer's dtype as a value-safe cast:
    integers exactly, floats without overflow or underflow (a nonzero value that would become 0 or
    subnormal); floats never into integer buffers."""
    try:
        arr = np.asarray(src)
    except (ValueError, TypeError, OverflowError) as exc:
        raise Layout.fail(RefreshError, name, label, f"ragged or non-numeric list ({exc})") from None
    if arr.size == 0:  # an empty list has no dtype (numpy guesses float64); `[]` for a 2-D buffer is 0x0
        shape = (0, 0) if arr.shape == (0,) and slot.ndim == 2 else arr.shape
        arr = arr.astype(slot.np_dtype).reshape(shape)
    logical = dtype_name(slot.plan.dtype)
    if arr.dtype.kind == "O" and slot.kind in "iu":
        _big_integers(slot, arr, name, label, logical)  # ints past 64 bits: raises "do not fit"
    if arr.dtype.kind not in "biuf":
        raise Layout.fail(
            RefreshError, name, label, f"list holds {arr.dtype} values; allowed: numbers of one shape"
        )
    if arr.dtype.kind == "f" and slot.kind != "f":
        arr = _integers(arr, src)  # numpy promotes a uint64 beside a Python int to float64
    if arr.dtype.kind == "f" and slot.kind != "f":
        raise Layout.fail(RefreshError, name, label, f"list holds floats; {logical} takes integers")
    _check_layout(slot, arr, name, label)
    if not arr.size or arr.dtype.kind == "b":
        return arr
    if slot.kind in "iub":
        info = np.iinfo(slot.np_dtype) if slot.kind != "b" else None
        lo, hi = (0, 1) if info is None else (int(info.min), int(info.max))
        amin, amax = int(arr.min()), int(arr.max())
        if amin < lo or amax > hi:
            raise Layout.fail(
                RefreshError, name, label, f"values {amin}..{amax} do not fit {logical} ({lo}..{hi})"
            )
        return arr
    if slot.plan.dtype == torch.float64:
        return arr
    finfo = torch.finfo(slot.plan.dtype)
    if arr.dtype.kind in "iu":  # integers must convert exactly (257 is not a bfloat16, 2049 not a float16)
        back = torch.from_numpy(arr.astype(np.float64)).to(slot.plan.dtype).to(torch.float64).numpy()
        bad = np.flatnonzero(back != arr)
        if bad.size:
            at = list(np.unravel_index(bad[0], arr.shape))
            raise Layout.fail(
                RefreshError, name, label,
                f"value {arr.flat[bad[0]]} at index {[int(i) for i in at]} is not exactly representable in "
                f"{logical} (it would become {back.flat[bad[0]]:g})",
            )  # fmt: skip
        return arr
    mag = np.abs(arr[np.isfinite(arr)])
    big = float(mag.max(initial=0.0))
    if big > finfo.max:
        raise Layout.fail(
            RefreshError, name, label, f"value {big:g} does not fit {logical} (largest finite {finfo.max:g})"
        )
    tiny = float(mag[mag > 0].min(initial=np.inf))
    if tiny < finfo.smallest_normal:
        raise Layout.fail(
            RefreshError, name, label,
            f"value {tiny:g} underflows {logical} (smallest normal {finfo.smallest_normal:g})",
        )  # fmt: skip
    return arr


def _big_integers(slot: ResolvedBuffer, arr: np.ndarray, name: str, label: str, logical: str) -> None:
    """An object array numpy made from integers past 64 bits: the values as given do not fit the buffer's
    integer dtype (the message an integer list out of range gets). Anything else returns (not integers)."""
    items = arr.ravel().tolist()
    if not items or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in items):
        return
    info = np.iinfo(slot.np_dtype)
    raise Layout.fail(
        RefreshError, name, label,
        f"values {min(items)}..{max(items)} do not fit {logical} ({info.min}..{info.max})",
    )  # fmt: skip


def _integers(arr: np.ndarray, src: list | tuple) -> np.ndarray:
    """A float ``arr`` numpy made from integers only (``[np.uint64(5), 1]``) as exact integers: int64, or
    uint64 above its range; else ``arr`` unchanged (it holds floats)."""
    items = np.asarray(src, dtype=object).ravel()
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)) for v in items):
        return arr
    ints = [int(v) for v in items]
    dtype = np.uint64 if ints and max(ints) > np.iinfo(np.int64).max and min(ints) >= 0 else np.int64
    try:
        return np.array(ints, dtype=dtype).reshape(arr.shape)
    except OverflowError:
        return arr


def _bounds_error(
    layout: Layout, slot: ResolvedBuffer, name: str, label: str, at: Any, value: Any, which: str
) -> RefreshError:
    b = slot.plan
    limit = b.min if which == "min" else b.max
    spec = layout.plan.spec.buffers[b.spec_name]
    rel = "below" if which == "min" else "above"
    return Layout.fail(
        RefreshError, name, label,
        f"value {value} at index {list(at)} is {rel} {which} {limit} ({which}: {getattr(spec, which)})",
    )  # fmt: skip


def values_fit(slot: ResolvedBuffer, arr: np.ndarray) -> bool:
    """True when every value of the non-empty integer ``arr`` lies within the slot's ``min``/``max``: one
    reduction when ``min`` is 0 (viewed unsigned, a negative value lies above any ``max``). False for float
    and bool arrays and for any value outside: then :func:`check_values` finds it and names it."""
    kind = arr.dtype.kind
    if kind not in "iu":
        return False
    if not arr.dtype.isnative:  # an explicit foreign byte order: compare the values in the host's
        arr = arr.astype(arr.dtype.newbyteorder("="))
    lo, hi = slot.lo, slot.hi
    if arr.ndim == 1 and arr.shape[0] <= _SMALL:  # a short row: Python's min/max beat a ufunc reduce
        vals = arr.tolist()
        return (lo is None or min(vals) >= lo) and (hi is None or max(vals) <= hi)
    if lo == 0 and hi is not None:
        if kind == "u":
            return bool(_MAX(arr, None) <= hi)
        if hi <= _IMAX[arr.dtype]:
            return bool(_MAX(arr.view(_UNSIGNED[arr.dtype]), None) <= hi)
    if lo is not None and _MIN(arr, None) < lo:
        return False
    return hi is None or bool(_MAX(arr, None) <= hi)


def check_values(layout: Layout, slot: ResolvedBuffer, arr: np.ndarray, name: str, label: str) -> None:
    """NaN and ``min``/``max`` over the live values of one host source; the message gives the index.
    (The refresh path asks :func:`values_fit` first and calls this only to find and name a bad value.)"""
    if arr.dtype.kind == "f" and np.isnan(arr).any():
        at = np.argwhere(np.isnan(arr))[0]
        raise Layout.fail(RefreshError, name, label, f"NaN at index {at.tolist()}")
    if slot.lo is not None:
        amin = arr.min()
        if amin < slot.lo:
            raise _bounds_error(layout, slot, name, label, np.argwhere(arr == amin)[0].tolist(), amin, "min")
    if slot.hi is not None:
        amax = arr.max()
        if amax > slot.hi:
            raise _bounds_error(layout, slot, name, label, np.argwhere(arr == amax)[0].tolist(), amax, "max")


def _check_values_device(
    layout: Layout, slot: ResolvedBuffer, t: torch.Tensor, name: str, label: str
) -> None:
    # Strict mode only: each reduction read back to the host is a device sync.
    if t.is_floating_point() and bool(torch.isnan(t).any()):
        raise Layout.fail(RefreshError, name, label, "NaN in device source")
    if slot.lo is not None:
        amin = t.min().item()
        if amin < slot.lo:
            raise _bounds_error(layout, slot, name, label, (t == amin).nonzero()[0].tolist(), amin, "min")
    if slot.hi is not None:
        amax = t.max().item()
        if amax > slot.hi:
            raise _bounds_error(layout, slot, name, label, (t == amax).nonzero()[0].tolist(), amax, "max")


def check_num_reqs(num_reqs: Any, cap: int | None, label: str, size: Any = None) -> int:
    """``num_reqs`` as an int in ``0..cap`` (``cap`` None: any count >= 0); otherwise :class:`RowsError`."""
    n = num_reqs if type(num_reqs) is int else count_of(num_reqs)
    if n is None:
        raise RowsError(f"{label}: num_reqs={num_reqs!r} is not an integer (bool, float and str are refused)")
    if n < 0 or (cap is not None and n > cap):
        holds = f"capture size {size} holds 0..{cap} requests" if cap is not None else "allowed: >= 0"
        raise RowsError(f"{label}: num_reqs={n}, but {holds}")
    return n


def requests_of_rows(layout: Layout, slot: ResolvedBuffer, rows: int, size: int | None) -> int | None:
    """THE live-count rule: the request count ``rows`` rows of ``slot`` stand for at ``size`` tokens (None:
    any size, as for an eager step), or None when no count gives that many rows."""
    found = slot.requests_of_rows.get(rows)  # type: ignore[union-attr]
    if found is None and size not in slot.capacity:
        found = layout.plan.requests_for_rows(slot.name, rows)
    return found


def no_count_error(label: str) -> RefreshError:
    return RefreshError(f"{label}: no source determines the live request count; pass num_reqs=")


def requests_hint(layout: Layout, sources: Mapping[str, Any], label: str) -> int:
    """The live request count the first source whose rows follow the request count stands for, read from its
    row count alone (the size is not known yet): what :class:`graphbuf.GraphRunner` picks a capture size
    by. The refresh then checks that every source agrees."""
    for name, src in sources.items():
        slot = layout.slots.get(name) if isinstance(name, str) else None
        if slot is None or slot.rows_of_requests is None:
            continue
        rows = _rows_of(src)
        if rows is not None:
            n = requests_of_rows(layout, slot, rows, None)
            if n is not None:
                return n
    raise no_count_error(label)


def _rows_of(src: Any) -> int | None:
    if isinstance(src, (np.ndarray, torch.Tensor)):
        return int(src.shape[0]) if src.ndim else None
    if isinstance(src, (list, tuple)):
        return len(src)
    return None  # not a source of rows: the refresh names what is wrong with it


def live_requests(
    layout: Layout, prepared: list[Prepared], size: int, num_reqs: int | None, label: str
) -> int:
    """The live request count every source's rows agree on (with ``num_reqs`` when given)."""
    live, source = num_reqs, "num_reqs"
    for slot, _, _, rows, _ in prepared:
        table = slot.rows_of_requests
        if table is None:
            continue
        if live is not None and live < len(table) and table[live] == rows:  # the common case, agreed
            continue
        name = slot.name
        if live is None:
            found = requests_of_rows(layout, slot, rows, size)
            if found is None:
                raise Layout.fail(
                    RefreshError,
                    name,
                    label,
                    f"{rows} rows match no live request count (rows = {slot.plan.rows.text})",
                )
            live, source = found, name
        else:
            want = layout.rows_at(slot, size, live)
            if want != rows:
                raise Layout.fail(
                    RefreshError, name, label,
                    f"{rows} rows, but {source} implies {live} live requests, so {want} rows "
                    f"(rows = {slot.plan.rows.text})",
                )  # fmt: skip
    if live is None:
        raise no_count_error(label)
    return live


def check_widths(widths: Any, wide: frozenset[str], label: str) -> dict[str, int]:
    """``widths`` (name → live width of a bound 2-D buffer) as ints; bool, float and str rejected."""
    if type(widths) is not dict and not isinstance(widths, Mapping):  # the ABC check costs ~1 µs
        raise RefreshError(
            f"{label}: widths must be a mapping of buffer name to width, got {type(widths).__name__}"
        )
    out = {}
    for name, w in widths.items():
        if name not in wide:
            allowed = ", ".join(sorted(wide)) or "none"
            raise RefreshError(f"{label}: widths[{name!r}]: not a bound 2-D buffer; allowed: {allowed}")
        n = count_of(w)
        if n is None:
            raise RefreshError(f"{label}: widths[{name!r}]: {w!r} is not an integer")
        out[name] = n
    return out
