"""Pins for ``graphbuf/buffers/validate.py`` (issue 24 §1): each test fails on the mutant its docstring names
(line numbers of main b2b8a44)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pins import buffers, contents

from graphbuf import RefreshError

BIG = 40  # elements per source: more than a short row


def test_negative_int8_into_unsigned_shortcut_is_rejected() -> None:
    """A negative int8 value into a buffer of ``min`` 0, ``max`` 300 (above int8's max) is named on both
    backends (an unsigned-view shortcut, since removed, could read -1 as 255, below the max)."""
    sb = buffers({"x": {"dtype": "int32", "rows": "tokens", "min": 0, "max": 300}}, sizes=[64])
    src = np.arange(BIG, dtype=np.int8)
    src[7] = -1
    before = contents(sb)
    with pytest.raises(RefreshError, match=r"value -1 at index \[7\] is below min 0"):
        sb.refresh(64, {"x": src})
    assert contents(sb) == before
    src[7] = 100  # without the -1 the same source is accepted
    sb.refresh(64, {"x": src})
    assert sb.full["x"][:BIG].tolist() == src.tolist()


def test_bounds_error_names_the_first_offending_index() -> None:
    """validate.py:350 (min) and :354 (max) ``np.argwhere(...)[0]``: the message names the FIRST index holding
    the extreme value, not the last (mutant ``[-1]``/``[1]``)."""
    sb = buffers({"x": {"dtype": "int32", "rows": "tokens", "min": 0, "max": 50}}, sizes=[64])
    low = np.full(BIG, 5, dtype=np.int32)
    low[[3, 9, 30]] = -4
    high = np.full(BIG, 5, dtype=np.int32)
    high[[4, 11, 31]] = 90
    with pytest.raises(RefreshError, match=r"value -4 at index \[3\] is below min 0 \(min: 0\)"):
        sb.refresh(64, {"x": low})
    with pytest.raises(RefreshError, match=r"value 90 at index \[4\] is above max 50 \(max: 50\)"):
        sb.refresh(64, {"x": high})


def test_rows_that_match_no_request_count_are_named() -> None:
    """validate.py:396: "rows match no live request count" (any mutant of that raise, or of the ``found is
    None`` test, goes unseen without this): 3 rows of a ``tokens`` buffer at 2 tokens per request."""
    sb = buffers({"slots": {"dtype": "int64", "rows": "tokens", "pad": -1}}, sizes=[4, 8], tpr=2)
    before = contents(sb)
    with pytest.raises(
        RefreshError,
        match=r"^refresh\(size=8\): buffer 'slots': 3 rows match no live request count \(rows = tokens\)$",
    ):
        sb.refresh(8, {"slots": np.arange(3, dtype=np.int64)})
    assert contents(sb) == before
    assert sb.refresh(8, {"slots": np.arange(4, dtype=np.int64)}) == 2  # 4 rows: 2 requests


# ---------------------------------------------------------------------------------------------------------
# Survivors of tools/mutation.py (mutmut names: build/mutation/refresh.validate)


def test_a_torch_dtype_numpy_lacks_is_refused_by_name() -> None:
    """``_check_torch_dtype`` (mutmut ``x__check_torch_dtype__mutmut_10``: ``not in NP_OF_TORCH`` would look
    the complex dtype up and fail untyped)."""
    sb = buffers({"x": {"dtype": "float64", "rows": "requests"}}, sizes=[4])
    with pytest.raises(
        RefreshError, match=r"^refresh\(size=4\): buffer 'x': dtype complex64 cannot be cast "
    ):
        sb.refresh(4, {"x": torch.zeros(2, dtype=torch.complex64)})


@pytest.mark.parametrize(("dtype", "values", "msg"), [
    ("bfloat16", [1, 257], r"value 257 at index \[1\] is not exactly representable in bfloat16 \(it would "
                           r"become 256\)"),
    ("float32", [1.0, 1e39], r"value 1e\+39 does not fit float32 \(largest finite 3\.40282e\+38\)"),
    ("float32", [1.0, 1e-39], r"value 1e-39 underflows float32 \(smallest normal 1\.17549e-38\)"),
])  # fmt: skip
def test_list_values_a_float_buffer_cannot_hold_are_named(dtype: str, values: list, msg: str) -> None:
    """``_from_list`` (mutmut ``x__from_list__mutmut_129``: the index built from ``int(None)``;
    ``x__from_list__mutmut_158``: the buffer's name dropped from a float error)."""
    sb = buffers({"x": {"dtype": dtype, "rows": "requests"}}, sizes=[4])
    with pytest.raises(RefreshError, match=rf"^refresh\(size=4\): buffer 'x': {msg}$"):
        sb.refresh(4, {"x": values})


def test_widths_must_be_a_mapping() -> None:
    """``check_widths`` (mutmut ``x_check_widths__mutmut_4``: the negation dropped, a list reaches
    ``.items()``); any Mapping is accepted."""
    from types import MappingProxyType

    sb = buffers({"bt": {"dtype": "int32", "rows": "requests", "cols": 3}}, sizes=[4])
    bound = sb.bind({"bt": np.ones((4, 3), np.int32)})
    with pytest.raises(RefreshError, match=r"widths must be a mapping of buffer name to width, got list"):
        bound.refresh(4, 2, widths=[2])  # type: ignore[arg-type]
    bound.refresh(4, 2, widths=MappingProxyType({"bt": 2}))
    assert sb.full["bt"].tolist() == [[1, 1, 0], [1, 1, 0], [0, 0, 0], [0, 0, 0]]


def test_values_past_the_live_width_are_not_checked() -> None:
    """A bound source with exactly the live rows is cut to the live width before its values are checked: a
    stale out-of-range value in a column past it is not read. (Mutmut ``x_live_fits__mutmut_20`` only sends
    such a source to the checked path, which slices it and accepts it: listed as equivalent.)"""
    sb = buffers({"bt": {"dtype": "int32", "rows": "requests", "cols": 4, "min": 0, "max": 9}}, sizes=[4])
    src = np.ones((4, 6), np.int32)
    src[:, 5] = 1000  # stale, past the live width
    bound = sb.bind({"bt": src})
    bound.refresh(4, 4, widths={"bt": 3})
    assert sb.full["bt"].tolist() == [[1, 1, 1, 0]] * 4
