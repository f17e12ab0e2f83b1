"""``graphbuf/buffers/mapping.py``: the call's arguments checked once for every entry point (``read_call``),
and the mapping front-end (``prepare_mapping``): every source validated, the live count agreed."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SMALL_SPEC

from graphbuf import GraphSpec, RefreshError, RowsError, StaticBuffers
from graphbuf.buffers.mapping import prepare_mapping, read_call

CPU = torch.device("cpu")


def _sb() -> StaticBuffers:
    return StaticBuffers(GraphSpec.model_validate(copy.deepcopy(SMALL_SPEC)))


def _sources(n: int) -> dict[str, np.ndarray]:
    return {
        "block_table.a": np.zeros((n, 4), np.int32),
        "block_table.b": np.ones((n, 4), np.int32),
        "seq_lens": np.full(n, 7, np.int32),
        "query_start_loc": np.arange(0, 2 * n + 1, 2, dtype=np.int32),
        "slot_mapping": np.arange(2 * n, dtype=np.int64),
    }


class _Counting(Mapping[str, Any]):
    """A mapping that counts how often it is read."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data, self.reads = data, 0

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __iter__(self) -> Iterator[str]:
        self.reads += 1
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def items(self):  # type: ignore[override]
        self.reads += 1
        return self.data.items()


def test_a_plain_dict_is_taken_as_it_is() -> None:
    sb, src = _sb(), _sources(2)
    assert read_call(sb, src, None, None, "refresh(size=4)") is src


def test_any_other_mapping_is_read_exactly_once_into_a_dict() -> None:
    sb, m = _sb(), _Counting(_sources(2))
    out = read_call(sb, m, None, None, "refresh(size=4)")
    assert type(out) is dict and out == m.data and m.reads == 1


def test_bound_sources_need_their_own_buffers_and_num_reqs() -> None:
    sb, other = _sb(), _sb()
    bound = sb.bind(_sources(4))
    assert read_call(sb, bound, 2, None, "r") is bound
    with pytest.raises(RefreshError, match=r"^r: these bound sources belong to other StaticBuffers$"):
        read_call(other, bound, 2, None, "r")
    with pytest.raises(RefreshError, match=r"^r: bound sources carry no row counts; pass num_reqs=$"):
        read_call(sb, bound, None, None, "r")


@pytest.mark.parametrize("sources", [[("seq_lens", 1)], None, "seq_lens", np.zeros(3)])
def test_sources_that_are_no_mapping_name_their_type(sources: object) -> None:
    named = rf"^r: sources must be a mapping .*; got {type(sources).__name__}$"
    with pytest.raises(RefreshError, match=named):
        read_call(_sb(), sources, None, None, "r")


@pytest.mark.parametrize("sources", [{}, _Counting({})])
def test_widths_are_refused_with_a_mapping(sources: object) -> None:
    with pytest.raises(RefreshError, match=r"^r: widths= applies to BoundSources"):
        read_call(_sb(), sources, None, {"seq_lens": 1}, "r")


def test_prepare_mapping_validates_every_source_and_agrees_on_the_live_count() -> None:
    sb = _sb()
    label = "refresh(size=8)"
    prepared, live = prepare_mapping(sb.layout, _sources(3), 8, None, label, strict=True, device=CPU)
    assert live == 3 and len(prepared) == 5
    assert {p.slot.name: p.rows for p in prepared}["query_start_loc"] == 4
    _, live = prepare_mapping(sb.layout, _sources(3), 8, 3, "refresh(size=8)", strict=True, device=CPU)
    assert live == 3


def test_prepare_mapping_names_what_is_missing_unless_it_is_not_required() -> None:
    sb, src = _sb(), _sources(2)
    required = sb.layout.required - {"seq_lens"}  # a refresh with seq_lens staged
    del src["seq_lens"]
    with pytest.raises(RefreshError, match=r"^refresh\(size=4\): missing buffer\(s\) seq_lens;"):
        prepare_mapping(sb.layout, src, 4, None, "refresh(size=4)", strict=True, device=CPU)
    _, live = prepare_mapping(
        sb.layout, src, 4, None, "refresh(size=4)", strict=True, device=CPU, required=required
    )
    assert live == 2
    del src["slot_mapping"]  # omitting one buffer never excuses another; the omitted one is not named
    with pytest.raises(RefreshError, match=r"^refresh\(size=4\): missing buffer\(s\) slot_mapping;"):
        prepare_mapping(
            sb.layout, src, 4, None, "refresh(size=4)", strict=True, device=CPU, required=required
        )


def test_prepare_mapping_checks_num_reqs_against_the_capture_size() -> None:
    sb = _sb()
    with pytest.raises(RowsError, match=r"^refresh\(size=4\): num_reqs=3, but capture size 4 holds 0\.\.2"):
        prepare_mapping(sb.layout, _sources(2), 4, 3, "refresh(size=4)", strict=True, device=CPU)
    with pytest.raises(RowsError, match=r"num_reqs=True is not an integer"):
        prepare_mapping(sb.layout, _sources(2), 4, True, "refresh(size=4)", strict=True, device=CPU)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["numpy", "tensor"])
def test_a_list_source_is_converted_and_the_arrays_checked_after_it(as_tensor: bool) -> None:
    """Converting a list runs user code (numpy reads its objects); a plain array checked before it is
    checked again afterwards, so a change made by that code is seen."""
    sb = _sb()
    src: dict[str, Any] = _sources(2)
    if as_tensor:  # no numpy array among the sources: the tensors are checked again too
        src = {k: torch.from_numpy(v) for k, v in src.items()}
    lens = src["seq_lens"]

    class Row:
        """A sequence numpy reads item by item; reading it changes an already-checked source."""

        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> int:
            if not 0 <= i < 4:
                raise IndexError(i)
            lens[0] = 10**6
            return 1

    src = {"seq_lens": lens, **{k: v for k, v in src.items() if k != "seq_lens"}}
    src["block_table.b"] = [Row(), Row()]
    with pytest.raises(RefreshError, match=r"^refresh\(size=4\): buffer 'seq_lens': .*1000000"):
        prepare_mapping(sb.layout, src, 4, None, "refresh(size=4)", strict=True, device=CPU)
