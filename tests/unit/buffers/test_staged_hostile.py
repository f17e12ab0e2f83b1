"""Issue 35 §1 and the buffers findings of its hostile pass: staged writes own what they record.

Each test is named for one finding and runs on both host states (the native one where built, the Python
one). A staged write copies its indices and values at the call, checks them once and writes exactly what
it checked; the exposed host state and lengths cannot be made writable; values take a refresh's value rule
and indices :meth:`set`'s integer rule; every refusal is a typed graphbuf error."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from paged_spec import PAGED_SPEC

from graphbuf import GraphbufError, GraphSpec, RefreshError, StaticBuffers, UsageError
from graphbuf.buffers.staged import changed_cells
from graphbuf.errors import RowsError

SPEC = "gemma4-31b-it-mtp"
BT, LENS, SM = "block_table.full", "seq_lens", "slot_mapping.full"


@pytest.fixture
def kind(backend: str) -> str:
    """The host state the buffers of the test get, by backend (conftest; chosen when they are built)."""
    return "native" if backend == "native" else "python"


def _buffers(copies: int | None = None) -> StaticBuffers:
    return StaticBuffers(SPEC, overrides={"num_blocks": 64}, upload_copies=copies)


def _qsl(n: int) -> dict[str, np.ndarray]:
    return {"query_start_loc": np.arange(0, 4 * n + 1, 4, dtype=np.int32)}


def _rest(n: int, *, but: tuple[str, ...]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {
        "block_table.sliding": np.zeros((n, 43), np.int32),
        "block_table.full": np.zeros((n, 43), np.int32),
        "seq_lens": np.ones(n, np.int32),
        "slot_mapping.sliding": np.full(4 * n, -1, np.int64),
        "slot_mapping.full": np.full(4 * n, -1, np.int64),
        **_qsl(n),
    }
    return {k: v for k, v in out.items() if k not in but}


# ---------------------------------------------------------------------------------------------- memory safety


def test_scatter_rows_that_view_the_host_state_write_the_cells_checked(kind: str) -> None:
    """Finding: scatter() on the C host state read its ``rows`` again while writing; rows viewing the host
    state changed under the writes (a write outside the allocation, an unchecked cell recorded)."""
    b = _buffers()
    h = b.stage(SM)
    h.set(0, [1, 2])  # host[0:2] == [1, 2]: a valid rows array that views the host state
    rows = h.host[0:2]
    h.scatter(rows, np.array([40, 3], np.int64))  # writing host[1] = 40 must not move the second cell
    assert h.host[:3].tolist() == [1, 40, 3]
    assert h.host[40] == -1  # the pad: never written
    assert sorted(set(changed_cells(h).tolist())) == [0, 1, 2]
    b.refresh(48, _rest(12, but=(SM,)), num_reqs=12)
    assert b.full[SM][:3].tolist() == [1, 40, 3] and b.full[SM][40] == -1


def test_scatter_values_that_view_the_host_state_are_read_before_any_write(kind: str) -> None:
    """Finding: values viewing the host state were read after earlier cells were written (C host state),
    in numpy's order on the Python one: both now read every value at the call."""
    h = _buffers().stage(SM)
    h.set(0, [5, 6, 7])
    h.scatter([1, 2], h.host[0:2])  # host[1] = old host[0], host[2] = old host[1]
    assert h.host[:3].tolist() == [5, 5, 6]


def test_lengths_and_host_cannot_be_made_writable(kind: str) -> None:
    """Finding: ``lengths`` (documented read-only) could be flipped writable, since its base was; a
    negative length then made the C append write before the allocation."""
    h = _buffers().stage(BT)
    h.set_row(0, [1, 2])
    for arr in (h.lengths, h.lengths[0:3], h.host, h.host[0]):
        with pytest.raises(ValueError, match="WRITEABLE"):
            arr.flags.writeable = True
    h.append(0, [3])
    assert h.host[0, :4].tolist() == [1, 2, 3, 0] and h.lengths[0] == 3
    mine = h.host
    mine.shape = (-1,)  # a caller's own view, reshaped in place: no other view changes
    assert h.host.ndim == 2 and h.lengths.shape == (16,)


# ------------------------------------------------------------------ bytes another buffer or step did not ask


@pytest.mark.parametrize("staging", [None, 2])
def test_a_reused_rows_array_does_not_reach_the_record(kind: str, staging: int | None) -> None:
    """Finding: the Python host state kept the caller's ``rows`` array as its record; a server setting
    its entries to -1 before the refresh made the commit write flat index -1 (the last row, or with
    staging the element before the buffer: the neighbour's last element)."""
    b = _buffers(staging)
    b.refresh(48, _rest(12, but=()), num_reqs=12)
    before = {name: b.full[name].clone() for name in b.names}
    h = b.stage(SM)
    rows = np.array([3, 4], np.int64)
    h.scatter(rows, np.array([30, 40], np.int64))
    rows[:] = -1  # the server reuses its index array
    b.refresh(48, _rest(12, but=(SM,)), num_reqs=12)
    want = before[SM].clone()
    want[3], want[4] = 30, 40
    assert torch.equal(b.full[SM], want)
    for name in b.names:
        if name != SM:
            assert torch.equal(b.full[name], before[name]), name


def _float_buffers() -> StaticBuffers:
    spec = copy.deepcopy(PAGED_SPEC)
    spec["buffers"]["scale"] = {"dtype": "float32", "rows": "requests"}
    return StaticBuffers(GraphSpec.model_validate(spec))


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ([1e-50], "underflows float32"),
        ([2**24 + 1], "not exactly representable in float32"),
        (np.ma.masked_array(np.array([1.0, 2.0], np.float32), mask=[0, 1]), "numpy subclass MaskedArray"),
    ],
    ids=["underflow", "inexact", "masked"],
)
def test_staged_values_take_the_refresh_value_rule(kind: str, values: Any, match: str) -> None:
    """Finding: staged values skipped rules a refresh applies (1e-50 into float32, 2**24+1 into float32,
    a masked array whose mask was dropped): set() now refuses them with the refresh's message."""
    b = _float_buffers()
    h = b.stage("scale")
    with pytest.raises(RefreshError, match=match) as staged:
        h.set(0, values)
    assert not h.pending and not h.host.any()
    src = {"block_table": np.zeros((1, 8), np.int32), "seq_lens": np.ones(1, np.int32), "scale": values}
    c = _float_buffers()
    with pytest.raises(RefreshError, match=match) as full:
        c.refresh(2, src)
    assert str(staged.value).split(": ", 2)[2] == str(full.value).split(": ", 2)[2]


@pytest.mark.parametrize("rows", [[1.7], [True], ["1"], np.array([1.0]), np.array([True])])
def test_scatter_indices_take_the_integer_rule_of_set(kind: str, rows: Any) -> None:
    """Finding: scatter() truncated indices (1.7 -> 1, True -> 1, "1" -> 1) that set() refuses."""
    h = _buffers().stage(LENS)
    with pytest.raises(RowsError, match=r"not an integer|allowed: integers"):
        h.scatter(rows, [5])
    assert not h.pending


# ----------------------------------------------------------------------------- unbounded, untyped, misleading


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([2**64], "row 18446744073709551616 outside"),
        ([float("nan")], r"rows\[0\] = nan is not an integer"),
        (None, "rows of type NoneType"),
        ([[0], [1, 2]], r"rows\[0\] = \[0\] is not an integer"),
        (np.array([2**63], np.uint64), "row 9223372036854775808 outside"),
    ],
    ids=["2**64", "nan", "None", "ragged", "uint64-2**63"],
)
def test_scatter_refusals_are_typed_and_name_the_index_as_given(kind: str, rows: Any, match: str) -> None:
    """Findings: bare OverflowError/ValueError/TypeError from scatter(); uint64 indices reported after
    wrapping (2**63 -> "row -9223372036854775808")."""
    h = _buffers().stage(LENS)
    with pytest.raises(RowsError, match=match):
        h.scatter(rows, [5])
    assert not h.pending


@pytest.mark.parametrize(
    ("values", "match"),
    [
        (torch.tensor([1, 2], dtype=torch.int32).to_sparse(), "sparse_coo tensor"),
        (torch.tensor([1, 2], dtype=torch.int32)._neg_view(), "lazy conjugate/negative bit"),
    ],
    ids=["sparse", "neg-bit"],
)
def test_set_refuses_unusual_tensors_with_a_typed_error(kind: str, values: Any, match: str) -> None:
    """Findings: set(0, sparse) raised a bare TypeError, set(0, neg-bit tensor) a bare RuntimeError."""
    h = _buffers().stage(LENS)
    with pytest.raises(RefreshError, match=match):
        h.set(0, values)
    assert not h.pending


def test_set_beyond_any_integer_says_the_values_do_not_fit_as_a_refresh_does(kind: str) -> None:
    """Finding: set(0, [2**64]) said "dtype object cannot be cast safely to int32"."""
    b = _buffers()
    with pytest.raises(RefreshError) as staged:
        b.stage(LENS).set(0, [2**64])
    with pytest.raises(RefreshError) as full:
        _buffers().refresh(4, {**_rest(1, but=(LENS,)), LENS: [2**64]})
    msg = "values 18446744073709551616..18446744073709551616 do not fit int32 (-2147483648..2147483647)"
    assert str(staged.value).endswith(msg) and str(full.value).endswith(msg)


def test_stage_of_an_unhashable_name_is_a_typed_error(kind: str) -> None:
    """Finding: stage(["lens"]) raised a bare TypeError."""
    with pytest.raises(RefreshError, match="unknown buffer"):
        _buffers().stage(["lens"])  # type: ignore[arg-type]


def test_staging_zero_is_a_typed_usage_error() -> None:
    """Finding: StaticBuffers(..., upload_copies=0) raised a bare ValueError."""
    with pytest.raises(UsageError, match=r"upload_copies=0\): allowed: an integer >= 1") as info:
        _buffers(0)
    assert isinstance(info.value, GraphbufError)


# ------------------------------------------------------------------------------ left from the previous pass


@pytest.fixture
def path(backend: str) -> str:
    """The refresh path, by backend (conftest)."""
    return "kernel" if backend == "native" else "numpy"


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_one_element_negative_stride_source_into_bfloat16(path: str, dtype: Any) -> None:
    """Finding: a one-element source with a negative stride into a bfloat16 buffer raised a bare
    ValueError (torch refuses negative strides; numpy keeps them on one-element views)."""
    spec = copy.deepcopy(PAGED_SPEC)
    spec["buffers"]["scale"] = {"dtype": "bfloat16", "rows": "requests"}
    sb = StaticBuffers(GraphSpec.model_validate(spec))
    src = np.array([1, 2, 3], dtype=dtype)[::-1][:1]
    assert src.strides[0] < 0
    batch = {"block_table": np.zeros((1, 8), np.int32), "seq_lens": np.ones(1, np.int32), "scale": src}
    assert sb.refresh(2, batch) == 1
    assert sb.full["scale"][:2].tolist() == [3.0, 0.0]
