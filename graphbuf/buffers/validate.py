"""Validation of one source (type, safe dtype cast, layout, rows and width against the capacity, NaN and
``min``/``max`` of the live values only), of the request count and of widths. Nothing here writes memory."""

from __future__ import annotations

import contextlib
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
    "accept_typed",
    "check_num_reqs",
    "check_row",
    "check_source",
    "check_typed",
    "check_values",
    "check_widths",
    "count_of",
    "live_region",
    "live_requests",
    "prepared",
    "requests_hint",
]

#: What a refresh takes per buffer: a torch tensor, a numpy array or a (nested) list of numbers.
Source = torch.Tensor | np.ndarray | Sequence[Any]


class Prepared(NamedTuple):
    """One validated source: ``host`` (bfloat16 as int16 bits) or ``dev`` (a tensor on the slab's device)
    holds its live values ``[:rows, :width]`` (1-D: ``[:rows]``; a bound source whole); C reads a 5-tuple."""

    slot: ResolvedBuffer
    host: np.ndarray | None
    dev: torch.Tensor | None
    rows: int
    width: int


_new_tuple = tuple.__new__


def prepared(
    slot: ResolvedBuffer, host: np.ndarray | None, dev: torch.Tensor | None, rows: int, width: int
) -> Prepared:
    """A :class:`Prepared`, built without the NamedTuple constructor's argument binding (hot paths)."""
    return _new_tuple(Prepared, (slot, host, dev, rows, width))  # type: ignore[no-any-return]


def live_region(arr: np.ndarray, rows: int, width: int) -> np.ndarray:
    """The live values of a host source, a view: ``arr[:rows, :width]`` (1-D: ``arr[:rows]``)."""
    return arr[:rows, :width] if arr.ndim == 2 else arr[:rows]


_BF16_SAFE_NP = frozenset((np.dtype(np.bool_), np.dtype(np.uint8), np.dtype(np.int8)))
_FLOAT32_UP = (np.dtype(np.float32), np.dtype(np.float64))
_CPU = torch.device("cpu")
_NO_COUNT = "no source determines the live request count; pass num_reqs="


def count_of(n: Any) -> int | None:
    """``n`` as an int if it is an integer (numpy integers included; bool, float and str not), else None."""
    try:
        return None if isinstance(n, bool) else operator.index(n)
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
    elif tp is torch.Tensor and src.is_cpu and src.dtype in NP_OF_TORCH and _odd(src) is None:
        host = src.detach().numpy() if src.requires_grad else src.numpy()
    if host is not None and host.dtype in slot.fast:  # no dtype work, integer values
        return layout.backend.accept(layout, slot, name, host, size, label, strict)
    typed = _typed(slot, name, src, label, device)
    return accept_typed(layout, slot, name, typed, size, label, strict)


def _typed(
    slot: ResolvedBuffer, name: str, src: Any, label: str, device: torch.device
) -> np.ndarray | torch.Tensor:
    """``src`` as host values or a ``device`` tensor, type and dtype checked (a list: layout, values too)."""
    tp = type(src)
    if tp is torch.Tensor or tp is torch.nn.Parameter:
        what = _odd(src) or ("a 0-d tensor" if src.dim() == 0 else None)
        if what is not None:
            msg = f"{what}; allowed: a dense {slot.ndim}-D tensor (strided layout)"
            raise Layout.fail(RefreshError, name, label, msg)
        on_device = src.device.type != "cpu"
        if on_device and (device.type == "cpu" or src.device != device):
            msg = f"source is on {src.device}; allowed: host memory or {device}"
            raise Layout.fail(RefreshError, name, label, msg)
        _check_cast(slot, src.dtype, name, label)
        host = src.detach()
        if not on_device:  # bfloat16 (numpy has none) as float32
            host = (host if src.dtype in NP_OF_TORCH else host.to(torch.float32)).numpy()
        return host
    if tp is np.ndarray:
        _check_cast(slot, src.dtype, name, label)
        return src
    if isinstance(src, (list, tuple)):
        return _from_list(slot, src, name, label)
    if isinstance(src, torch.Tensor):
        why = (
            f"tensor subclass {tp.__name__} (its methods run its own code between graphbuf's check and "
            "write); pass a plain torch.Tensor, e.g. t.as_subclass(torch.Tensor)"
        )
    elif isinstance(src, np.ndarray):
        why = (
            f"numpy subclass {tp.__name__} (its extra state, e.g. a mask, would be dropped); pass a plain "
            "numpy.ndarray"
        )
    else:
        why = f"unsupported source type {tp.__name__}; allowed: torch.Tensor, numpy.ndarray, list"
    raise Layout.fail(RefreshError, name, label, why)


def check_row(slot: ResolvedBuffer, values: Any, name: str, label: str) -> np.ndarray:
    """One row of staged values (1-D: a run of elements) under a refresh's type, dtype and layout rules, as a
    fresh contiguous 1-D array of the buffer's dtype. Bounds and NaN are checked when a refresh commits."""
    tp = type(values)
    src = values
    if tp is np.ndarray or ((tp is torch.Tensor or tp is torch.nn.Parameter) and _odd(values) is None):
        if values.ndim > 1:
            msg = f"values of shape {list(values.shape)}; pass one row (1-D)"
            raise Layout.fail(RefreshError, name, label, msg)
        src = values.reshape(1, -1) if slot.ndim == 2 else (values if values.ndim else values.reshape(1))
    elif tp is list or tp is tuple:
        src = [values] if slot.ndim == 2 else values
    elif isinstance(values, (numbers.Number, np.generic)) and not isinstance(values, (str, bytes)):
        src = [[values]] if slot.ndim == 2 else [values]
    host = _typed(slot, name, src, label, _CPU)
    _check_layout(slot, host, name, label)
    return np.array(host, dtype=slot.np_dtype, order="C").reshape(-1)


def accept_typed(
    layout: Layout, slot: ResolvedBuffer, name: str, src: Any, size: int, label: str, strict: bool
) -> Prepared:
    """A typed source (host values or a device tensor) against the layout and the capacity at ``size`` (a
    wider source clipped or rejected by ``overflow``), then against the bounds (a device's if ``strict``)."""
    _check_layout(slot, src, name, label)
    rows = src.shape[0]
    b = slot.plan
    cap_rows, cap_cols = layout.capacity(slot, size)
    if rows > cap_rows:
        held = "capture size" if size in slot.capacity else "an eager step of"
        msg = f"{rows} live rows, but {held} {size} holds {cap_rows} (rows = {b.rows.text})"
        raise layout.fail(RowsError, name, label, msg)
    width = 0
    if slot.ndim == 2:
        width = src.shape[1]
        if width > cap_cols:
            if b.overflow == "reject":
                msg = f"source is {width} wide, above the captured allocation of {cap_cols} columns"
                msg = f"{msg} (cols = {b.cols.text}); overflow: reject"  # type: ignore[union-attr]
                raise layout.fail(WidthError, name, label, msg)
            width = cap_cols
            src = src[:, :cap_cols]
    if isinstance(src, torch.Tensor):
        if strict and src.numel():
            check_values(layout, slot, src, name, label)
        return prepared(slot, None, src, rows, width)
    checked = slot.bounded or src.dtype.kind == "f"
    if src.size and checked and not layout.backend.fits(slot, src, rows, width):
        check_values(layout, slot, src, name, label)
    if slot.bf16:  # torch refuses negative strides, which numpy keeps on one-element and empty views
        dense = src if min(src.strides, default=0) >= 0 else np.array(src, order="C")
        src = torch.from_numpy(dense).to(torch.bfloat16).view(torch.int16).numpy()
    return prepared(slot, src, None, rows, width)


def _odd(t: torch.Tensor) -> str | None:
    """What keeps ``t`` from being a plain dense tensor, or None."""
    if t.is_nested:
        return "a nested tensor"
    if t.layout != torch.strided:
        return f"a {str(t.layout).removeprefix('torch.')} tensor"
    if t.is_conj() or t.is_neg():
        return "a tensor with a lazy conjugate/negative bit"
    return None


def _check_cast(slot: ResolvedBuffer, dtype: np.dtype | torch.dtype, name: str, label: str) -> None:
    np_dtype = NP_OF_TORCH.get(dtype) if isinstance(dtype, torch.dtype) else dtype
    if dtype is torch.bfloat16:
        ok = slot.bf16 or slot.np_dtype in _FLOAT32_UP
    elif slot.bf16:
        ok = np_dtype in _BF16_SAFE_NP
    else:
        ok = np_dtype is not None and np_dtype.kind in "biuf" and np.can_cast(np_dtype, slot.np_dtype, "safe")
    if not ok:
        msg = f"dtype {dtype_name(dtype)} cannot be cast safely to {dtype_name(slot.plan.dtype)}"
        raise Layout.fail(RefreshError, name, label, msg)


def _check_layout(slot: ResolvedBuffer, src: np.ndarray | torch.Tensor, name: str, label: str) -> None:
    """``src`` (host or device) has the buffer's rank and contiguous last-dim elements."""
    if src.ndim != slot.ndim:
        msg = f"expected {slot.ndim}-D source, got shape {list(src.shape)}"
        raise Layout.fail(RefreshError, name, label, msg)
    if not src.ndim or src.shape[-1] <= 1:
        return
    if isinstance(src, np.ndarray):  # numpy gives empty arrays zero strides: only a non-empty one is strided
        apart = f"{src.strides[-1]} bytes apart" if src.size and src.strides[-1] != src.itemsize else ""
    else:
        apart = f"stride {src.stride(-1)}" if src.stride(-1) != 1 else ""
    if apart:
        msg = f"source elements are strided ({apart} in the last dim); pass rows with contiguous elements"
        raise Layout.fail(RefreshError, name, label, f"{msg} (a transposed source is a layout bug)")


def check_typed(slot: ResolvedBuffer, arr: np.ndarray, name: str, label: str) -> None:
    """:func:`_check_cast` and :func:`_check_layout` of a numpy source."""
    _check_cast(slot, arr.dtype, name, label)
    _check_layout(slot, arr, name, label)


def _from_list(slot: ResolvedBuffer, src: list | tuple, name: str, label: str) -> np.ndarray:
    """A list's values, accepted when each converts to the buffer's dtype exactly (integers) or without
    overflow or underflow to 0 or a subnormal (floats); floats never into integer buffers."""
    try:
        arr = np.asarray(src)
    except (ValueError, TypeError, OverflowError) as exc:
        raise Layout.fail(RefreshError, name, label, f"ragged or non-numeric list ({exc})") from None
    if arr.size == 0:  # an empty list has no dtype (numpy guesses float64); `[]` for a 2-D buffer is 0x0
        shape = (0, 0) if arr.shape == (0,) and slot.ndim == 2 else arr.shape
        arr = arr.astype(slot.np_dtype).reshape(shape)
    logical, kind = dtype_name(slot.plan.dtype), arr.dtype.kind
    ints = None  # every value as a Python int, if each is an integer (bools are not)
    if (kind == "O" and slot.kind in "iu") or (kind == "f" and slot.kind != "f"):
        items = np.asarray(src, dtype=object).ravel()
        if all(isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)) for v in items):
            ints = [int(v) for v in items]
    if ints is not None and kind == "O":  # integers past 64 bits
        _check_ints(slot, min(ints), max(ints), name, label)
    if kind not in "biuf":
        msg = f"list holds {arr.dtype} values; allowed: numbers of one shape"
        raise Layout.fail(RefreshError, name, label, msg)
    if ints is not None:  # numpy promotes a uint64 beside a Python int to float64: int64, or uint64 above it
        dtype = np.uint64 if max(ints) > np.iinfo(np.int64).max and min(ints) >= 0 else np.int64
        with contextlib.suppress(OverflowError):  # a negative beside one above int64: floats, refused
            arr = np.array(ints, dtype=dtype).reshape(arr.shape)
    if arr.dtype.kind == "f" and slot.kind != "f":
        raise Layout.fail(RefreshError, name, label, f"list holds floats; {logical} takes integers")
    _check_layout(slot, arr, name, label)
    if not arr.size or arr.dtype.kind == "b" or slot.plan.dtype == torch.float64:
        return arr
    if slot.kind in "iub":
        _check_ints(slot, int(arr.min()), int(arr.max()), name, label)
        return arr
    finfo = torch.finfo(slot.plan.dtype)
    if arr.dtype.kind in "iu":  # integers must convert exactly (257 is not a bfloat16, 2049 not a float16)
        back = torch.from_numpy(arr.astype(np.float64)).to(slot.plan.dtype).to(torch.float64).numpy()
        bad = np.argwhere(back != arr)
        if bad.size:
            at = tuple(bad[0])
            msg = f"value {arr[at]} at index {bad[0].tolist()} is not exactly representable in {logical}"
            raise Layout.fail(RefreshError, name, label, f"{msg} (it would become {back[at]:g})")
        return arr
    mag = np.abs(arr[np.isfinite(arr)])
    big = float(mag.max(initial=0.0))
    if big > finfo.max:
        msg = f"value {big:g} does not fit {logical} (largest finite {finfo.max:g})"
        raise Layout.fail(RefreshError, name, label, msg)
    tiny = float(mag[mag > 0].min(initial=np.inf))
    if tiny < finfo.smallest_normal:
        msg = f"value {tiny:g} underflows {logical} (smallest normal {finfo.smallest_normal:g})"
        raise Layout.fail(RefreshError, name, label, msg)
    return arr


def _check_ints(slot: ResolvedBuffer, amin: int, amax: int, name: str, label: str) -> None:
    info = np.iinfo(slot.np_dtype) if slot.kind != "b" else None
    lo, hi = (0, 1) if info is None else (int(info.min), int(info.max))
    if amin < lo or amax > hi:
        msg = f"values {amin}..{amax} do not fit {dtype_name(slot.plan.dtype)} ({lo}..{hi})"
        raise Layout.fail(RefreshError, name, label, msg)


def check_values(
    layout: Layout, slot: ResolvedBuffer, arr: np.ndarray | torch.Tensor, name: str, label: str
) -> None:
    """NaN and ``min``/``max`` over the live values of one source, a host array or a device tensor (each
    reduction read back from a device is a sync: strict mode only); the message gives the first index."""
    xp: Any = torch if isinstance(arr, torch.Tensor) else np
    if (arr.is_floating_point() if xp is torch else arr.dtype.kind == "f") and bool(xp.isnan(arr).any()):
        at = "in device source" if xp is torch else f"at index {np.argwhere(np.isnan(arr))[0].tolist()}"
        raise Layout.fail(RefreshError, name, label, f"NaN {at}")
    for which, limit, beyond in (("min", slot.lo, "below"), ("max", slot.hi, "above")):
        if limit is None:
            continue
        value = arr.min() if which == "min" else arr.max()
        value = value.item() if xp is torch else value
        if value < limit if which == "min" else value > limit:
            at = xp.argwhere(arr == value)[0].tolist()
            spec = layout.plan.spec.buffers[slot.plan.spec_name]
            msg = f"value {value} at index {at} is {beyond} {which} {limit} ({which}: {getattr(spec, which)})"
            raise Layout.fail(RefreshError, name, label, msg)


def check_num_reqs(num_reqs: Any, cap: int | None, label: str, size: Any = None) -> int:
    """``num_reqs`` as an int in ``0..cap`` (``cap`` None: any count >= 0); otherwise :class:`RowsError`."""
    n = num_reqs if type(num_reqs) is int else count_of(num_reqs)
    if n is None:
        raise RowsError(f"{label}: num_reqs={num_reqs!r} is not an integer (bool, float and str are refused)")
    if n < 0 or (cap is not None and n > cap):
        holds = f"capture size {size} holds 0..{cap} requests" if cap is not None else "allowed: >= 0"
        raise RowsError(f"{label}: num_reqs={n}, but {holds}")
    return n


def _requests_of_rows(layout: Layout, slot: ResolvedBuffer, rows: int, size: int | None) -> int | None:
    """THE live-count rule: the request count ``rows`` rows of ``slot`` stand for at ``size`` tokens (None:
    any size), or None when no count gives that many rows."""
    found = slot.requests_of_rows.get(rows)  # type: ignore[union-attr]
    if found is None and size not in slot.capacity:
        found = layout.plan.requests_for_rows(slot.name, rows)
    return found


def requests_hint(layout: Layout, sources: Mapping[str, Any], label: str) -> int:
    """The live request count the rows of the first source that follows it stand for (the size is not known
    yet): what :class:`graphbuf.GraphRunner` picks a capture size by; the refresh checks every source."""
    for name, src in sources.items():
        slot = layout.slots.get(name) if isinstance(name, str) else None
        if slot is None or slot.rows_of_requests is None:
            continue
        # a source without rows is skipped: the refresh names what is wrong with it
        if isinstance(src, (list, tuple)) or (isinstance(src, (np.ndarray, torch.Tensor)) and src.ndim):
            n = _requests_of_rows(layout, slot, len(src), None)
            if n is not None:
                return n
    raise RefreshError(f"{label}: {_NO_COUNT}")


def live_requests(layout: Layout, items: list[Prepared], size: int, num_reqs: int | None, label: str) -> int:
    """The live request count every source's rows agree on (with ``num_reqs`` when given)."""
    live, source = num_reqs, "num_reqs"
    for slot, _, _, rows, _ in items:
        table = slot.rows_of_requests
        if table is None or (live is not None and live < len(table) and table[live] == rows):  # agreed
            continue
        if live is None:
            live = _requests_of_rows(layout, slot, rows, size)
            if live is None:
                msg = f"{rows} rows match no live request count (rows = {slot.plan.rows.text})"
                raise Layout.fail(RefreshError, slot.name, label, msg)
            source = slot.name
        elif (want := layout.rows_at(slot, size, live)) != rows:
            msg = f"{rows} rows, but {source} implies {live} live requests, so {want} rows"
            raise Layout.fail(RefreshError, slot.name, label, f"{msg} (rows = {slot.plan.rows.text})")
    if live is None:
        raise RefreshError(f"{label}: {_NO_COUNT}")
    return live


def check_widths(widths: Any, wide: frozenset[str], label: str) -> dict[str, int]:
    """``widths`` (name → live width of a bound 2-D buffer) as ints; bool, float and str rejected."""
    if type(widths) is not dict and not isinstance(widths, Mapping):  # the ABC check is slow
        got = type(widths).__name__
        raise RefreshError(f"{label}: widths must be a mapping of buffer name to width, got {got}")
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
