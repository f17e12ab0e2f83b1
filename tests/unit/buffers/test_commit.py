"""Pins for ``graphbuf/buffers/commit.py`` (issue 24 §1), on both backends (the backend fixture): the
live-row write (``write_live``) and the byte accounting; each fails on the mutant its docstring names (line
numbers of main b2b8a44)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pins import buffers
from slab_oracle import expected_buffer

REPEAT_2D = {
    "qsl": {"dtype": "int32", "rows": "requests + 1", "cols": 3, "pad": "repeat_last"},
    "lens": {"dtype": "int32", "rows": "requests", "pad": 7},
}


@pytest.mark.parametrize("staging", [None, 2], ids=["in-place", "staged"])
def test_two_d_repeat_last_and_stale_rows_equal_the_oracle(staging: int | None) -> None:
    """commit.py:72 (``t[n:end, :c] = t[n - 1, :c]``: a 2-D ``repeat_last`` buffer repeats its last live row,
    all ``c`` columns, down to the rows captured at the size) and :75 (``t[top:rows, :c] = slot.pad``: rows
    an earlier, larger refresh dirtied go back to the pad). Mutants of either (row/column bounds off by one,
    the pad or the repeated row replaced, the ``end > n`` test flipped) change a byte the oracle checks."""
    sb = buffers(REPEAT_2D, sizes=[2, 4, 8], upload_copies=staging)
    rng = np.random.default_rng(3)
    for size, n, w in ((8, 7, 3), (8, 2, 2), (4, 3, 1), (8, 1, 3), (2, 0, 0), (8, 5, 2), (8, 8, 3)):
        qsl = rng.integers(0, 100, (n + 1, w), dtype=np.int32)
        lens = rng.integers(0, 100, n, dtype=np.int32)
        assert sb.refresh(size, {"qsl": qsl, "lens": lens}) == n
        full = sb.plan["qsl"].shape
        want = expected_buffer(full, end=size + 1, src=qsl, pad=0,
                               repeat_last=True, dtype=torch.int32)  # fmt: skip
        assert torch.equal(sb.full["qsl"], want), (size, n, w)
        want = expected_buffer(sb.plan["lens"].shape, end=0, src=lens, pad=7,
                               repeat_last=False, dtype=torch.int32)  # fmt: skip
        assert torch.equal(sb.full["lens"], want), (size, n, w)


@pytest.mark.parametrize("staging", [None, 2], ids=["in-place", "staged"])
def test_one_d_repeat_last_and_stale_rows_equal_the_oracle(staging: int | None) -> None:
    """commit.py:59-63, the 1-D twin of :72/:75: repeat the last live element up to ``end``, then the pad
    over rows an earlier refresh dirtied."""
    sb = buffers(
        {"qsl": {"dtype": "int64", "rows": "requests + 1", "pad": "repeat_last"},
         "lens": {"dtype": "int16", "rows": "requests", "pad": -2}},
        sizes=[2, 4, 8], upload_copies=staging,
    )  # fmt: skip
    rng = np.random.default_rng(5)
    for size, n in ((8, 8), (8, 3), (4, 4), (2, 0), (8, 6), (2, 1)):
        qsl = rng.integers(0, 1000, n + 1, dtype=np.int64)
        lens = rng.integers(0, 100, n, dtype=np.int16)
        sb.refresh(size, {"qsl": qsl, "lens": lens})
        want = expected_buffer(sb.plan["qsl"].shape, end=size + 1, src=qsl, pad=0,
                               repeat_last=True, dtype=torch.int64)  # fmt: skip
        assert torch.equal(sb.full["qsl"], want), (size, n)
        want = expected_buffer(sb.plan["lens"].shape, end=0, src=lens, pad=-2,
                               repeat_last=False, dtype=torch.int16)  # fmt: skip
        assert torch.equal(sb.full["lens"], want), (size, n)


@pytest.mark.parametrize("staging", [None, 2], ids=["in-place", "staged"])
def test_a_zero_wide_source_moves_no_bytes_of_its_buffer(staging: int | None) -> None:
    """commit.py:102 (``_cols`` of a clean buffer is 0): an ``(n, 0)`` source of a 2-D buffer writes no cell,
    so a refresh moves 0 bytes (mutant ``else 1``: it would count, and pad, one column per row). Then a
    3-wide refresh moves its rectangle, and a 0-wide one after it clears that rectangle (counted)."""
    sb = buffers(
        {"bt": {"dtype": "int32", "rows": "requests", "cols": 4, "pad": 0}}, sizes=[4], upload_copies=staging
    )
    sb.refresh(4, {"bt": np.zeros((3, 0), dtype=np.int32)})
    assert sb.stats.last_bytes == 0
    sb.refresh(4, {"bt": np.ones((2, 3), dtype=np.int32)})
    assert sb.stats.last_bytes == 3 * 3 * 4  # 3 rows: the first refresh's mark, 0 columns wide
    sb.refresh(4, {"bt": np.zeros((2, 0), dtype=np.int32)})
    assert sb.stats.last_bytes == 2 * 3 * 4
    assert not sb.full["bt"].any()
    sb.refresh(4, {"bt": np.zeros((1, 0), dtype=np.int32)})
    assert sb.stats.last_bytes == 0
    assert sb.stats.refreshes == 4 and sb.stats.total_bytes == 3 * 3 * 4 + 2 * 3 * 4


def test_a_source_viewing_another_buffer_is_read_before_that_buffer_is_written() -> None:
    """commit.py ``_detached`` and ``Committer._write_numpy`` (mutmut ``x__detached__mutmut_3``/``_5``,
    ``_write_numpy__mutmut_8``): ``b``'s source is a view of buffer ``a``, which the same refresh writes
    first; ``b`` gets the values that were checked (``a``'s old ones), not ``a``'s new ones."""
    sb = buffers(
        {"a": {"dtype": "int32", "rows": "requests", "max": 50}, "b": {"dtype": "int32", "rows": "requests"}},
        sizes=[4],
    )
    sb.refresh(4, {"a": np.array([1, 2, 3], np.int32), "b": np.zeros(3, np.int32)})
    view = sb.full["a"][:3].numpy()
    sb.refresh(4, {"a": np.array([7, 8, 9], np.int32), "b": view})
    assert sb.full["a"].tolist() == [7, 8, 9, 0]
    assert sb.full["b"].tolist() == [1, 2, 3, 0]


def test_staging_copies_are_used_in_turn() -> None:
    """``Committer._upload`` (mutmut ``xǁCommitterǁ_upload__mutmut_47``: ``(k + 2) % depth``): each staged
    refresh assembles in the next staging copy, round robin."""
    sb = buffers({"x": {"dtype": "int32", "rows": "requests"}}, sizes=[4], upload_copies=3)
    commit = sb._commit  # the committer's own turn counter: nothing else shows it on the cpu
    assert commit.depth == 3 and sb.upload_copies == 3
    turns = []
    for n in (1, 2, 3, 4):
        sb.refresh(4, {"x": np.arange(n, dtype=np.int32)})
        turns.append(commit.turn)
    assert turns == [1, 2, 0, 1]
    assert sb.full["x"].tolist() == [0, 1, 2, 3]
