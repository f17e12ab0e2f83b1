"""Pins for ``graphbuf/buffers/validate.py`` (issue 24 §2): each test fails on the mutant its docstring names
(mutmut's names, measured on the numpy path)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import SMALL_SPEC
from paged_spec import PAGED_SPEC

from graphbuf import GraphSpec, RefreshError, RowsError, StaticBuffers
from graphbuf.graphs.runner import GraphRunner


def _small(**extra: object) -> StaticBuffers:
    spec = copy.deepcopy(SMALL_SPEC)
    spec["buffers"].update(extra)
    return StaticBuffers(GraphSpec.model_validate(spec))


def _sources(n: int) -> dict[str, np.ndarray]:
    return {
        "block_table.a": np.zeros((n, 4), np.int32),
        "block_table.b": np.zeros((n, 4), np.int32),
        "seq_lens": np.full(n, 3, np.int32),
        "query_start_loc": np.arange(n + 1, dtype=np.int32),
        "slot_mapping": np.arange(2 * n, dtype=np.int64),
    }


def test_too_many_rows_for_an_eager_step_say_so() -> None:
    """``_fitted__mutmut_22``: the message tells an eager step from a capture size."""
    sb = _small()
    src = _sources(5)
    src["seq_lens"] = np.full(6, 3, np.int32)
    with pytest.raises(RowsError) as err:
        sb.eager_inputs(10, src, num_reqs=5)
    assert str(err.value) == (
        "eager(size=10): buffer 'seq_lens': 6 live rows, but an eager step of 10 holds 5 (rows = requests)"
    )


def test_a_list_of_numpy_and_python_integers_is_read_exactly() -> None:
    """``_integers__mutmut_2``/``_17``: numpy makes float64 of ``[np.uint64(..), 1]``; the values are read
    back exactly as int64, or as uint64 above int64's range (then checked against the buffer's bounds)."""
    sb = _small()
    src: dict[str, object] = {**_sources(3), "seq_lens": [np.uint64(5), 1, 1]}
    sb.refresh(8, src)
    assert sb.view(8)["seq_lens"][:3].tolist() == [5, 1, 1]
    src["seq_lens"] = [np.uint64(2**63 + 1), 1, 1]
    with pytest.raises(RefreshError, match=r"values 1\.\.9223372036854775809 do not fit int32"):
        sb.refresh(8, src)


def test_a_0_d_source_does_not_give_the_live_count_and_is_refused() -> None:
    """``_rows_of__mutmut_2``: a 0-d array carries no rows (the next source gives the count), then the
    refresh refuses it by name."""
    runner = GraphRunner(
        StaticBuffers(GraphSpec.model_validate(PAGED_SPEC)), lambda s: s.views["seq_lens"].float(),
        output_rows="requests",
    )  # fmt: skip
    runner.capture()
    src = {"seq_lens": np.array(3, np.int32), "block_table": np.zeros((2, 8), np.int32)}
    with pytest.raises(RefreshError, match=r"buffer 'seq_lens': "):
        runner.run(src)


def test_a_tensor_of_another_kind_is_refused_with_the_buffers_rank() -> None:
    """``_typed__mutmut_17``: the message says what is allowed, from the buffer."""
    sb = _small()
    src: dict[str, object] = {**_sources(2), "seq_lens": torch.tensor([1, 2], dtype=torch.int32)._neg_view()}
    with pytest.raises(RefreshError) as err:
        sb.refresh(4, src)
    assert str(err.value) == (
        "refresh(size=4): buffer 'seq_lens': a tensor with a lazy conjugate/negative bit; allowed: a dense "
        "1-D tensor (strided layout)"
    )


def test_a_numpy_source_of_the_wrong_rank_is_named_with_the_call() -> None:
    """``check_typed__mutmut_29``: the layout error starts with the call's label."""
    sb = _small()
    src = {**_sources(2), "scratch": np.zeros((3, 1), np.float32)}  # float buffers take the typed path
    with pytest.raises(RefreshError, match=r"^refresh\(size=4\): buffer 'scratch': "):
        sb.refresh(4, src)


def test_an_eager_step_above_the_table_finds_its_count_from_the_rows() -> None:
    """``requests_of_rows__mutmut_9``: rows past every capture size are turned into a count by the rule."""
    sb = _small()
    src = {**_sources(20), "query_start_loc": np.zeros(21, np.int32)}  # within max_num_batched_tokens
    out = sb.eager_inputs(40, src)
    assert out["query_start_loc"].shape == (21,) and out["seq_lens"].shape == (20,)


def test_a_max_without_a_min_is_checked() -> None:
    """``_fitted__mutmut_59``: a buffer bounded above only still has its values checked."""
    sb = _small(x={"dtype": "int32", "rows": "requests", "max": 10})
    with pytest.raises(
        RefreshError, match=r"^refresh\(size=4\): buffer 'x': value 11 at index \[1\] is above max 10"
    ):
        sb.refresh(4, {**_sources(2), "x": np.array([3, 11], np.int32)})


def test_a_value_equal_to_the_max_is_accepted() -> None:
    """``values_fit__mutmut_59``: the bound is inclusive."""
    sb = _small()
    sb.refresh(4, {**_sources(2), "seq_lens": np.array([64, 64], np.int32)})
    assert sb.view(4)["seq_lens"].tolist() == [64, 64]


def test_a_numpy_subclass_is_refused_under_the_call_s_name() -> None:
    """``_typed__mutmut_86``."""

    class Tagged(np.ndarray):
        pass

    src = {**_sources(2), "seq_lens": np.full(2, 3, np.int32).view(Tagged)}
    with pytest.raises(RefreshError, match=r"^refresh\(size=4\): buffer 'seq_lens': numpy subclass Tagged"):
        _small().refresh(4, src)


def test_bound_rows_past_the_live_ones_are_not_value_checked() -> None:
    """``live_fits__mutmut_15``: only the live region of a bound source is checked; rows past it may hold
    anything (a server's persistent arrays do)."""
    sb = StaticBuffers(GraphSpec.model_validate(PAGED_SPEC))
    host = {"block_table": np.zeros((8, 8), np.int32), "seq_lens": np.full(8, 999, np.int32)}
    host["seq_lens"][:3] = [4, 5, 6]
    bound = sb.bind(host)
    sb.refresh(4, bound, num_reqs=3)
    assert sb.view(4)["seq_lens"].tolist() == [4, 5, 6, 0]


def test_a_one_column_strided_view_is_accepted() -> None:
    """``_check_layout__mutmut_16``: a last dim of one element has no element stride to check."""
    sb = _small()
    wide = np.zeros((2, 8), np.int32)
    src = {**_sources(2), "block_table.a": wide[:, ::2][:, :1]}  # shape (2, 1), element stride 8 bytes
    sb.refresh(4, src)
    assert sb.view(4)["block_table.a"][:2, 0].tolist() == [0, 0]


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda: torch.nested.nested_tensor([torch.zeros(1), torch.zeros(1)]), "a nested tensor"),
        (lambda: torch.tensor([1, 2], dtype=torch.int32).to_sparse(), "a sparse_coo tensor"),
    ],
)
def test_tensors_of_other_layouts_are_named(make, what: str) -> None:
    """``_check_tensor_kind__mutmut_2``/``_6``."""
    with pytest.raises(
        RefreshError, match=rf"^refresh\(size=4\): buffer 'seq_lens': {what}; allowed: a dense 1-D"
    ):
        _small().refresh(4, {**_sources(2), "seq_lens": make()})


def test_a_list_of_numpy_unsigned_and_negative_integers_stays_signed() -> None:
    """``_integers__mutmut_14``: uint64 only above int64's range and never with a negative value."""
    sb = _small()
    sb.refresh(4, {**_sources(2), "slot_mapping": [np.uint64(5), -1, 2, 3]})
    assert sb.view(4)["slot_mapping"].tolist() == [5, -1, 2, 3]


def test_a_tensor_subclass_is_refused_under_its_buffer_s_name() -> None:
    """``_typed__mutmut_7``."""

    class Tagged(torch.Tensor):
        pass

    src = {**_sources(2), "seq_lens": torch.tensor([3, 3], dtype=torch.int32).as_subclass(Tagged)}
    with pytest.raises(RefreshError, match=r"^refresh\(size=4\): buffer 'seq_lens': tensor subclass Tagged"):
        _small().refresh(4, src)


def test_a_negative_num_reqs_for_an_eager_step_says_what_is_allowed() -> None:
    """``check_num_reqs__mutmut_20``."""
    with pytest.raises(RowsError) as err:
        _small().eager_inputs(10, _sources(2), num_reqs=-1)
    assert str(err.value) == "eager(size=10): num_reqs=-1, but allowed: >= 0"


def test_a_2_d_list_of_numpy_and_python_integers_keeps_its_shape() -> None:
    """``_from_list__mutmut_96``: numpy makes float64 of a 2-D list mixing ``np.uint64`` and Python ints; the
    values read back as int64 keep the list's shape (flat, the 2-D buffer would refuse them)."""
    sb = _small()
    src = {**_sources(2), "block_table.a": [[np.uint64(3), 1, 2, 4], [5, 6, 7, np.uint64(8)]]}
    sb.refresh(4, src)
    assert sb.view(4)["block_table.a"].tolist() == [[3, 1, 2, 4], [5, 6, 7, 8]]


def test_a_bound_source_of_the_wrong_rank_is_named_with_bind() -> None:
    """``check_typed__mutmut_12``: bind's layout error starts with ``bind()``, not ``None``."""
    with pytest.raises(RefreshError) as err:
        _small().bind({"seq_lens": np.zeros((8, 1), np.int32)})
    assert str(err.value) == "bind(): buffer 'seq_lens': expected 1-D source, got shape [8, 1]"


def test_a_scalar_staged_into_a_2_d_buffer_is_one_cell() -> None:
    """``check_row__mutmut_51``: ``set(1, 7, col=2)`` on a 2-D buffer stages the one cell (the scalar as a row
    of one value), where a 1-D shape would be refused as the wrong rank."""
    bt = _small().stage("block_table.a")
    bt.set(1, 7, col=2)
    assert bt.host[1].tolist() == [0, 0, 7, 0]
