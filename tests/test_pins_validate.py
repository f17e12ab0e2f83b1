"""Pins for ``graphbuf/refresh/validate.py`` (issue 24 §1): each test fails on the mutant its docstring names
(line numbers of main b2b8a44)."""

from __future__ import annotations

import numpy as np
import pytest
from pins import buffers, contents, numpy_path, path

from graphbuf import RefreshError

BIG = 40  # above validate._SMALL (32): values_fit takes its reduction path, not the Python min/max one


def test_negative_int8_into_unsigned_shortcut_is_rejected_on_the_numpy_path() -> None:
    """validate.py:321 ``if hi <= _IMAX[arr.dtype]`` negated: the unsigned view would be taken with ``hi``
    above int8's max, and -1 (255 unsigned, below max 300) would be accepted."""
    sb = buffers({"x": {"dtype": "int32", "rows": "tokens", "min": 0, "max": 300}}, sizes=[64])
    src = np.arange(BIG, dtype=np.int8)
    src[7] = -1
    before = contents(sb)
    with numpy_path(), pytest.raises(RefreshError, match=r"value -1 at index \[7\] is below min 0"):
        sb.refresh(64, {"x": src})
    assert contents(sb) == before
    src[7] = 100  # without the -1 the same source is accepted
    with numpy_path():
        sb.refresh(64, {"x": src})
    assert sb.full["x"][:BIG].tolist() == src.tolist()


@pytest.mark.parametrize("kind", ["numpy", "kernel"])
def test_bounds_error_names_the_first_offending_index(kind: str) -> None:
    """validate.py:350 (min) and :354 (max) ``np.argwhere(...)[0]``: the message names the FIRST index holding
    the extreme value, not the last (mutant ``[-1]``/``[1]``)."""
    sb = buffers({"x": {"dtype": "int32", "rows": "tokens", "min": 0, "max": 50}}, sizes=[64])
    low = np.full(BIG, 5, dtype=np.int32)
    low[[3, 9, 30]] = -4
    high = np.full(BIG, 5, dtype=np.int32)
    high[[4, 11, 31]] = 90
    with path(kind):
        with pytest.raises(RefreshError, match=r"value -4 at index \[3\] is below min 0 \(min: 0\)"):
            sb.refresh(64, {"x": low})
        with pytest.raises(RefreshError, match=r"value 90 at index \[4\] is above max 50 \(max: 50\)"):
            sb.refresh(64, {"x": high})


@pytest.mark.parametrize("kind", ["numpy", "kernel"])
def test_rows_that_match_no_request_count_are_named(kind: str) -> None:
    """validate.py:396: "rows match no live request count" (any mutant of that raise, or of the ``found is
    None`` test, goes unseen without this): 3 rows of a ``tokens`` buffer at 2 tokens per request."""
    sb = buffers({"slots": {"dtype": "int64", "rows": "tokens", "pad": -1}}, sizes=[4, 8], tpr=2)
    before = contents(sb)
    with (
        path(kind),
        pytest.raises(
            RefreshError,
            match=r"^refresh\(size=8\): buffer 'slots': 3 rows match no live request count "
            r"\(rows = tokens\)$",
        ),
    ):
        sb.refresh(8, {"slots": np.arange(3, dtype=np.int64)})
    assert contents(sb) == before
    with path(kind):
        assert sb.refresh(8, {"slots": np.arange(4, dtype=np.int64)}) == 2  # 4 rows: 2 requests
