"""Pins for ``graphbuf/buffers/commit.py`` (issue 24 §2): the bytes a refresh counts and the cells a
``repeat_last`` buffer holds with no live row; each test names the mutant it kills (both backends)."""

from __future__ import annotations

import copy

import numpy as np
from paged_spec import PAGED_SPEC

from graphbuf import GraphSpec, StaticBuffers


def _sb(spec: dict | None = None) -> StaticBuffers:
    return StaticBuffers(GraphSpec.model_validate(spec or PAGED_SPEC))


def _batch(n: int, width: int = 8) -> dict[str, np.ndarray]:
    return {
        "block_table": np.ones((n, width), np.int32),
        "seq_lens": np.full(n, 4, np.int32),
    }


def test_a_refresh_counts_the_rectangle_it_touches() -> None:
    """``_rectangle__mutmut_18``: a 1-D buffer's rectangle is one column wide (2 live rows of a 8-wide
    int32 block table and of int32 seq_lens: 64 + 8 bytes)."""
    sb = _sb()
    sb.refresh(2, _batch(2))
    sb.refresh(2, _batch(2))
    assert sb.stats.last_bytes == 2 * 8 * 4 + 2 * 4


def test_an_empty_batch_after_an_empty_batch_moves_no_byte() -> None:
    """``_rectangle__mutmut_9``: with no live row and nothing to clear, nothing is touched."""
    sb = _sb()
    sb.refresh(2, _batch(0))
    sb.refresh(2, _batch(0))
    assert sb.stats.last_bytes == 0


def test_an_empty_batch_leaves_no_column_mark() -> None:
    """``write_live__mutmut_36``: a refresh that writes no row leaves the column mark at 0, so the next
    1-row, 1-column refresh touches one cell of the block table, not the empty batch's width."""
    sb = _sb()
    sb.refresh(2, _batch(0, width=8))
    sb.refresh(2, _batch(1, width=1))
    assert sb.stats.last_bytes == 1 * 1 * 4 + 1 * 4


def test_a_repeat_last_buffer_with_no_live_row_holds_the_pad() -> None:
    """``write_live__mutmut_6``/``_7``: ``repeat_last`` with no live row repeats nothing; every row takes
    the clean value 0, not the last row of an earlier refresh."""
    spec = copy.deepcopy(PAGED_SPEC)
    spec["buffers"]["positions"] = {"dtype": "int32", "rows": "requests", "pad": "repeat_last"}
    sb = _sb(spec)
    sb.refresh(8, {**_batch(8), "positions": np.arange(5, 13, dtype=np.int32)})
    assert sb.view(8)["positions"].tolist() == list(range(5, 13))
    sb.refresh(4, {**_batch(0), "positions": np.zeros(0, np.int32)})
    assert sb.view(8)["positions"].tolist() == [0] * 8


def test_a_2_d_repeat_last_buffer_with_no_live_row_holds_the_pad() -> None:
    """``write_live__mutmut_27`` (the 2-D branch): no live row, nothing repeated."""
    spec = copy.deepcopy(PAGED_SPEC)
    spec["buffers"]["pairs"] = {"dtype": "int32", "rows": "requests", "cols": 2, "pad": "repeat_last"}
    sb = _sb(spec)
    sb.refresh(8, {**_batch(8), "pairs": np.arange(16, dtype=np.int32).reshape(8, 2) + 1})
    sb.refresh(4, {**_batch(0), "pairs": np.zeros((0, 2), np.int32)})
    assert sb.view(8)["pairs"].tolist() == [[0, 0]] * 8


def test_total_bytes_sum_every_refresh_staged_ones_included() -> None:
    """``Committer.count__mutmut_4``: a staged commit adds its bytes to the total."""
    sb = _sb()
    totals = []
    sb.refresh(4, _batch(3))
    totals.append(sb.stats.last_bytes)
    sb.stage("seq_lens").set(0, [7, 7, 7])
    sb.refresh(4, {"block_table": np.ones((3, 8), np.int32)}, num_reqs=3)
    totals.append(sb.stats.last_bytes)
    assert totals[1] > 0 and sb.stats.total_bytes == sum(totals)
    assert sb.view(4)["seq_lens"].tolist() == [7, 7, 7, 0]
