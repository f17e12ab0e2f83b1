"""Pins for ``graphbuf/buffers/bound.py`` and ``graphbuf/buffers/layout.py`` (issue 24 §1): each test fails
on the mutant its docstring names (line numbers of main b2b8a44). Both paths (numpy, kernel)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pins import buffers, contents

from graphbuf import AddressChangedError, RefreshError, WidthError

KINDS = ["numpy", "kernel"]


@pytest.mark.parametrize("given", [[np.zeros(4, np.int32)], None, "x", 3])
def test_bind_of_a_non_mapping_is_a_refresh_error(given: object) -> None:
    """bound.py:61 ``if not isinstance(sources, Mapping)``: a list, None, str or int is refused with the type
    named (mutant: the check dropped or negated, and ``.items()`` fails untyped or a mapping is refused)."""
    sb = buffers({"x": {"dtype": "int32", "rows": "requests"}}, sizes=[4])
    with pytest.raises(
        RefreshError,
        match=rf"^bind\(\): sources must be a mapping of buffer name to source, got {type(given).__name__}$",
    ):
        sb.bind(given)  # type: ignore[arg-type]
    sb.bind({"x": np.zeros(4, np.int32)}).refresh(4, 2)  # a mapping is accepted


def test_a_bound_float_buffer_is_checked_for_nan_with_only_two_d_sources() -> None:
    """bound.py:116 ``if all(e[5] for e in entries)``: a float source (never of an unchecked dtype: its values
    need the NaN check) goes through ``check_source`` at every refresh, beside an integer one that does not.
    Mutants (``any``, or another entry field such as ``e[3]``, "2-D", in the test) let a NaN through."""
    sb = buffers(
        {"w": {"dtype": "float32", "rows": "requests", "cols": 2},
         "bt": {"dtype": "int32", "rows": "requests", "cols": 3, "min": 0}},
        sizes=[4],
    )  # fmt: skip
    w = np.ones((4, 2), np.float32)
    bt = np.zeros((4, 3), np.int32)
    bound = sb.bind({"w": w, "bt": bt})
    bound.refresh(4, 3)
    w[1, 1] = np.nan
    before = contents(sb)
    with pytest.raises(RefreshError, match=r"buffer 'w': NaN at index \[1, 1\]"):
        bound.refresh(4, 3)
    assert contents(sb) == before


def test_a_fixed_rows_buffer_bound_to_a_longer_source_reads_its_capacity() -> None:
    """bound.py:119 ``min(e[1].shape[0], e[0].capacity[s][0])``: a fixed-rows buffer (rows 3) bound to a
    5-row source reads 3 rows (mutant ``max``, or the columns ``[1]`` taken for the rows: 5 rows read, or
    0)."""
    sb = buffers(
        {"fixed": {"dtype": "int32", "rows": 3, "pad": -1},
         "lens": {"dtype": "int32", "rows": "requests", "pad": 0}},
        sizes=[2, 4],
    )  # fmt: skip
    fixed = np.arange(10, 15, dtype=np.int32)
    lens = np.arange(1, 6, dtype=np.int32)
    bound = sb.bind({"fixed": fixed, "lens": lens})
    bound.refresh(4, 2)
    assert sb.full["fixed"].tolist() == [10, 11, 12]
    assert sb.full["lens"].tolist() == [1, 2, 0, 0]
    assert sb.stats.last_bytes == 3 * 4 + 2 * 4


@pytest.mark.parametrize("overflow", ["reject", "truncate"])
def test_a_bound_width_above_the_allocation_is_rejected_or_cut(overflow: str) -> None:
    """bound.py:195 ``if not 0 <= w <= max_cols: return None``: a live width above the captured columns leaves
    the fast path, so ``overflow: reject`` raises WidthError and ``truncate`` writes the captured columns
    only (mutant: the check dropped, the write indexes past the buffer; or its bound moved, a width at the
    edge is refused)."""
    sb = buffers(
        {"bt": {"dtype": "int32", "rows": "requests", "cols": 3, "pad": 0, "min": 0, "overflow": overflow}},
        sizes=[4],
    )  # fmt: skip
    src = np.arange(1, 4 * 6 + 1, dtype=np.int32).reshape(4, 6)
    bound = sb.bind({"bt": src})
    bound.refresh(4, 2, widths={"bt": 3})  # exactly the allocation: accepted
    assert sb.full["bt"].tolist() == [[1, 2, 3], [7, 8, 9], [0, 0, 0], [0, 0, 0]]
    bound.refresh(4, 1, widths={"bt": 0})
    assert sb.full["bt"].tolist() == [[0, 0, 0]] * 4
    before = contents(sb)
    if overflow == "reject":
        with pytest.raises(WidthError, match=r"buffer 'bt': source is 5 wide, above the captured"):
            bound.refresh(4, 2, widths={"bt": 5})
        assert contents(sb) == before
    else:
        bound.refresh(4, 2, widths={"bt": 5})
        assert sb.full["bt"].tolist() == [[1, 2, 3], [7, 8, 9], [0, 0, 0], [0, 0, 0]]
    with pytest.raises(RefreshError, match=r"width 7 outside the bound source's 0..6 columns"):
        bound.refresh(4, 2, widths={"bt": 7})
    with pytest.raises(RefreshError, match=r"width -1 outside"):
        bound.refresh(4, 2, widths={"bt": -1})


@pytest.mark.parametrize(("bound_", "bad", "msg"), [
    ({"min": 0}, -3, r"value -3 at index \[1\] is below min 0"),
    ({"max": 9}, 12, r"value 12 at index \[1\] is above max 9"),
])  # fmt: skip
def test_a_min_only_or_max_only_bound_is_checked_on_the_fast_path(bound_: dict, bad: int, msg: str) -> None:
    """layout.py:109 ``bounded = b.min is not None or b.max is not None`` (mutant ``and``: a buffer with only
    one bound counts as unbounded and the bound fast path skips its values)."""
    sb = buffers({"lens": {"dtype": "int32", "rows": "requests", "pad": 0, **bound_}}, sizes=[4])
    lens = np.array([1, 2, 3, 4], np.int32)
    bound = sb.bind({"lens": lens})
    bound.refresh(4, 3)
    lens[1] = bad
    before = contents(sb)
    with pytest.raises(RefreshError, match=msg):
        bound.refresh(4, 3)
    assert contents(sb) == before
    with pytest.raises(RefreshError, match=msg):
        sb.refresh(4, {"lens": lens[:3]})


def test_eager_one_request_past_the_largest_capture_with_num_reqs() -> None:
    """layout.py:125 ``if num_reqs < len(table)``: the table covers 0..largest requests; at exactly one more
    (``num_reqs`` given, so the rows are looked up, not inferred) the rule is evaluated (mutant ``<=``:
    IndexError)."""
    sb = buffers(
        {"lens": {"dtype": "int32", "rows": "requests", "pad": 0},
         "qsl": {"dtype": "int32", "rows": "requests + 1", "pad": "repeat_last"}},
        sizes=[2, 4], tpr=2,
    )  # fmt: skip
    n = 4 // 2 + 1  # largest capture: 2 requests; the table has 3 entries
    before = contents(sb)
    out = sb.eager_inputs(2 * n, {"lens": [5, 6, 7], "qsl": [0, 1, 2, 3]}, num_reqs=n)
    assert out["lens"].tolist() == [5, 6, 7] and out["qsl"].tolist() == [0, 1, 2, 3]
    with pytest.raises(RefreshError, match=r"buffer 'qsl': 3 rows, but num_reqs implies 3 live requests"):
        sb.eager_inputs(2 * n, {"lens": [5, 6, 7], "qsl": [0, 1, 2]}, num_reqs=n)
    bound = sb.bind({"lens": np.arange(8, dtype=np.int32), "qsl": np.arange(9, dtype=np.int32)})
    out = sb.eager_inputs(2 * n, bound, num_reqs=n)
    assert out["lens"].tolist() == [0, 1, 2] and out["qsl"].tolist() == [0, 1, 2, 3]
    assert contents(sb) == before
    assert torch.equal(sb.full["lens"], torch.zeros(2, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------------------
# Survivors of tools/mutation.py (mutmut names: build/mutation/refresh.bound)


def test_bind_refuses_a_tensor_without_a_numpy_view_with_the_full_reason() -> None:
    """``BoundSources.__init__`` (``__init____mutmut_39``/``_46``/``_47``: the label, the layout, the
    advice)."""
    sb = buffers({"x": {"dtype": "float32", "rows": "requests"}}, sizes=[4])
    with pytest.raises(RefreshError) as err:
        sb.bind({"x": torch.zeros(4, dtype=torch.complex64)})
    assert str(err.value) == (
        "bind(): buffer 'x': a complex64 strided tensor has no numpy view; bind a dense tensor of a "
        "numpy-compatible dtype or pass it to refresh()"
    )
    with pytest.raises(
        RefreshError, match=r"^bind\(\): buffer 'x': a float32 sparse_coo tensor has no numpy"
    ):
        sb.bind({"x": torch.zeros(4).to_sparse()})


def test_bound_sources_repr_and_moved_message() -> None:
    """``__repr__`` (``__repr____mutmut_2``) and the full ``check_moved`` message
    (``check_moved__mutmut_13``)."""
    sb = buffers(
        {"a": {"dtype": "int32", "rows": "requests"}, "b": {"dtype": "int32", "rows": "requests"}}, sizes=[4]
    )
    a = torch.zeros(4, dtype=torch.int32)
    bound = sb.bind({"a": a, "b": np.zeros(4, np.int32)})
    assert repr(bound) == "BoundSources(a, b)" and bound.names == ("a", "b")
    ptr = a.data_ptr()
    a.set_(torch.zeros(6, dtype=torch.int32))
    with pytest.raises(AddressChangedError) as err:
        bound.refresh(4, 2)
    assert str(err.value) == (
        f"refresh(size=4): bound source 'a' moved: bound at {ptr:#x} shape [4] stride [1], now "
        f"{a.data_ptr():#x} shape [6] stride [1]; a bound tensor must keep its address and layout (set_ "
        "rebinds, resize_ reshapes): bind it again"
    )


def test_eager_inputs_have_the_buffer_dtypes_shapes_and_padded_cells() -> None:
    """``refresh/eager.py`` ``build_eager`` (mutmut ``x_build_eager__mutmut_10``/``_14``/``_20``/``_23``/
    ``_36``: the image's dtype, its 2-D shape, the width and column mark of the write, the bfloat16 view):
    each eager tensor is the buffer at the eager size, equal to the oracle."""
    from slab_oracle import expected_buffer

    bufs = {
        "bt": {"dtype": "int32", "rows": "requests", "cols": 4, "pad": -1},
        "w": {"dtype": "bfloat16", "rows": "requests", "cols": 2, "pad": 0.5},
        "qsl": {"dtype": "int64", "rows": "requests + 1", "pad": "repeat_last"},
    }
    sb = buffers(bufs, sizes=[2])
    bt = np.arange(15, dtype=np.int32).reshape(5, 3)
    w = np.arange(10, dtype=np.int8).reshape(5, 2)
    qsl = np.arange(6, dtype=np.int64)
    out = sb.eager_inputs(7, {"bt": bt, "w": w, "qsl": qsl}, num_reqs=5)
    want = {
        "bt": expected_buffer((7, 4), bt, end=0, pad=-1, repeat_last=False, dtype=torch.int32),
        "w": expected_buffer((7, 2), w, end=0, pad=0.5, repeat_last=False, dtype=torch.bfloat16),
        "qsl": expected_buffer((8,), qsl, end=8, pad=0, repeat_last=True, dtype=torch.int64),
    }
    for name, t in want.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
        assert torch.equal(out[name], t), (name, out[name], t)


def test_rows_past_the_table_and_fixed_rows_on_the_checked_path() -> None:
    """``Layout.rows_at`` (mutmut ``rows_at__mutmut_4``/``_6``/``_7``: a fixed-rows buffer's rows are its
    capacity at the size, read on the bound checked path; ``rows_at__mutmut_11``: past the table a
    ``tokens`` rule is evaluated with ``tokens``) and ``Layout.capacity`` at an eager size
    (``capacity__mutmut_15``: a 2-D buffer's columns)."""
    sb = buffers(
        {"slots": {"dtype": "int64", "rows": "tokens", "pad": -1},
         "fixed": {"dtype": "int32", "rows": 3, "pad": 7},
         "f": {"dtype": "float32", "rows": "requests", "cols": 2, "pad": 0.0}},
        sizes=[2], tpr=2,
    )  # fmt: skip
    slots = np.arange(20, dtype=np.int64)
    fixed = np.array([4, 5, 6, 9], np.int32)
    f = np.ones((10, 3), np.float32)
    bound = sb.bind({"slots": slots, "fixed": fixed, "f": f})  # a float source: every refresh is checked
    bound.refresh(2, 1, widths={"f": 2})
    assert sb.full["fixed"].tolist() == [4, 5, 6] and sb.full["slots"].tolist() == [0, 1]
    out = sb.eager_inputs(8, bound, num_reqs=4, widths={"f": 1})
    assert out["slots"].tolist() == list(range(8))
    assert out["fixed"].tolist() == [4, 5, 6]
    assert out["f"].tolist() == [[1.0, 0.0]] * 4


def test_a_mapping_refresh_of_a_non_mapping_names_the_type() -> None:
    """``prepare_mapping`` (mutmut ``x_prepare_mapping__mutmut_2``/``_3``: the message)."""
    sb = buffers({"x": {"dtype": "int32", "rows": "requests"}}, sizes=[4])
    with pytest.raises(RefreshError) as err:
        sb.refresh(4, [np.zeros(2, np.int32)])  # type: ignore[arg-type]
    assert str(err.value) == (
        "refresh(size=4): sources must be a mapping of buffer name to source, or BoundSources from bind(); "
        "got list"
    )


@pytest.mark.parametrize("beside", [{}, {"w": np.ones((4, 2), np.float32)}])
def test_a_bound_array_whose_dtype_is_reassigned_in_place_is_checked_as_a_mapping_source(
    beside: dict,
) -> None:
    """The unchecked read of a bound source holds for a dtype the buffer takes without a value check, read at
    every refresh: an int32 array reinterpreted in place as uint32 (same shape and strides) is refused as a
    mapping refresh refuses it, whether or not a float source (always checked) is bound beside it."""
    bufs = {"lens": {"dtype": "int32", "rows": "requests", "pad": 0}}
    if beside:
        bufs["w"] = {"dtype": "float32", "rows": "requests", "cols": 2}
    sb = buffers(bufs, sizes=[4])
    lens = np.array([1, 2, 3, 4], np.int32)
    bound = sb.bind({"lens": lens, **beside})
    bound.refresh(4, 3)
    assert sb.full["lens"].tolist() == [1, 2, 3, 0]
    lens.dtype = np.uint32
    before = contents(sb)
    msg = r"^refresh\(size=4\): buffer 'lens': dtype uint32 cannot be cast safely to int32$"
    with pytest.raises(RefreshError, match=msg):
        bound.refresh(4, 3)
    with pytest.raises(RefreshError, match=msg):
        sb.refresh(4, {"lens": lens[:3], **{k: v[:3] for k, v in beside.items()}})
    assert contents(sb) == before


@pytest.mark.parametrize("src", [np.array(3, np.int32), torch.tensor(3, dtype=torch.int32)])
def test_a_0_d_source_is_refused_at_bind_by_its_rank(src: object) -> None:
    """A 0-d array or tensor is refused by bind's rank check (``check_typed``) before its rows check, which
    therefore never sees a 0-d source."""
    sb = buffers({"x": {"dtype": "int32", "rows": "requests"}}, sizes=[4])
    with pytest.raises(RefreshError) as err:
        sb.bind({"x": src})
    assert str(err.value) == "bind(): buffer 'x': expected 1-D source, got shape []"


def test_a_bound_array_changed_in_place_is_named_before_the_widths_are_read() -> None:
    """A numpy array reshaped in place after bind and a ``widths`` that is wrong too: the moved source is
    named first (nothing of a moved source is read, its widths included), whatever the other sources'
    dtypes (before the one loop, an all-integer bind named the widths first)."""
    sb = buffers({"x": {"dtype": "int32", "rows": "requests", "cols": 4}}, sizes=[4])
    x = np.zeros((6, 4), np.int32)
    bound = sb.bind({"x": x})
    x.shape = (4, 6)
    before = contents(sb)
    with pytest.raises(AddressChangedError, match="'x' changed in place"):
        sb.refresh(4, bound, num_reqs=3, widths={"x": 1.5})
    assert contents(sb) == before
