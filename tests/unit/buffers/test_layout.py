"""``graphbuf/buffers/layout.py``: each buffer resolved once into a ``ResolvedBuffer`` (dtype, pad,
capacities, the rows <-> requests tables, the dtypes that need no value check), and the errors that name a
buffer."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import SMALL_SPEC

from graphbuf import GraphSpec, RefreshError, StaticBuffers
from graphbuf.buffers.backend import Backend
from graphbuf.buffers.layout import Layout, dtype_name, host_value, where
from graphbuf.planning.planner import plan


def _layout(**changes: object) -> Layout:
    spec = copy.deepcopy(SMALL_SPEC)
    spec["buffers"].update(changes)
    return Layout(plan(GraphSpec.model_validate(spec)), Backend())


def test_slots_follow_slab_order_and_name_every_group_buffer() -> None:
    layout = _layout()
    names = [s.name for s in layout.order]
    assert sorted(names) == sorted(
        ["scratch", "block_table.a", "block_table.b", "seq_lens", "query_start_loc", "slot_mapping"]
    )
    assert [s.index for s in layout.order] == list(range(len(names)))
    assert layout.required == frozenset(names) - {"scratch"}  # keep: true may be left out
    assert layout.per_group == frozenset({"block_table"})
    assert layout.max_requests == {2: 1, 4: 2, 8: 4} and layout.tokens_per_request == 2


def test_a_slot_holds_what_the_hot_path_reads() -> None:
    s = _layout().slots
    bt, qsl, sm, scratch = s["block_table.a"], s["query_start_loc"], s["slot_mapping"], s["scratch"]
    assert bt.capacity == {2: (1, 4), 4: (2, 4), 8: (4, 4)} and bt.ndim == 2 and bt.itemsize == 4
    assert (bt.lo, bt.hi, bt.bounded, bt.kind) == (0, 31, True, "i")
    assert qsl.repeat_last and qsl.pad == 0 and qsl.capacity[8] == (5, 0)
    assert qsl.rows_of_requests == (1, 2, 3, 4, 5) and qsl.requests_of_rows == {1: 0, 2: 1, 3: 2, 4: 3, 5: 4}
    assert sm.rows_of_requests == (0, 2, 4, 6, 8) and sm.pad == np.int64(-1) and sm.np_dtype == np.int64
    assert scratch.rows_of_requests is None and scratch.pad == np.float32(0.5) and not scratch.bounded
    assert scratch.fast == frozenset()  # floats always take the checked path (NaN)
    assert np.dtype(np.int16) in bt.fast and np.dtype(np.int64) not in bt.fast  # only safe casts skip checks


def test_a_bfloat16_buffer_is_held_as_int16_bits_with_a_float_kind() -> None:
    slot = _layout(h={"dtype": "bfloat16", "rows": "requests", "pad": 1.5}).slots["h"]
    assert slot.bf16 and slot.np_dtype == np.int16 and slot.kind == "f"
    assert slot.pad == torch.tensor(1.5, dtype=torch.bfloat16).view(torch.int16).item()


def test_capacity_and_rows_at_above_the_captured_sizes() -> None:
    layout = _layout()
    qsl = layout.slots["query_start_loc"]
    assert layout.capacity(qsl, 4) == (3, 0)
    assert layout.capacity(qsl, 40) == (21, 0)  # an eager step: evaluated, not tabled
    assert layout.rows_at(qsl, 8, 3) == 4
    assert layout.rows_at(qsl, 40, 20) == 21  # past the table: the rule itself
    scratch = layout.slots["scratch"]
    assert layout.rows_at(scratch, 8, 1) == 3  # rows that do not follow requests: the capacity


def test_eager_bytes_sums_every_buffer_and_stops_above_the_limit() -> None:
    layout = _layout()
    total = sum(layout.capacity(s, 8)[0] * (layout.capacity(s, 8)[1] or 1) * s.itemsize for s in layout.order)
    assert layout.eager_bytes(8, 10**9) == total
    assert total > layout.eager_bytes(8, 10) > 10  # stopped at the first buffer past the limit


def test_errors_name_the_call_the_buffer_and_what_is_allowed() -> None:
    layout = _layout()
    unknown = r"^refresh\(size=8\): buffer 'nope': unknown buffer; known: block_table\.a, "
    with pytest.raises(RefreshError, match=unknown):
        layout.slot("refresh(size=8)", "nope")
    per_group = r"is declared per group; pass each group's buffer: block_table\.a, "
    with pytest.raises(RefreshError, match=per_group):
        layout.slot("refresh(size=8)", "block_table")
    with pytest.raises(RefreshError, match=r"buffer '3': unknown buffer"):
        layout.slot("x", 3)
    assert str(layout.size_error("view", 5)) == "view(size=5): not a capture size; sizes: 2, 4, 8"
    missing = layout.missing_error("refresh(size=4)", ["seq_lens", "scratch"])
    assert str(missing) == (
        "refresh(size=4): missing buffer(s) block_table.a, block_table.b, query_start_loc, slot_mapping; "
        "only buffers declared 'keep: true' may be omitted"
    )


def test_the_labels_and_host_values_errors_use() -> None:
    assert where("refresh", 8) == "refresh(size=8)" and where("refresh", "bind()") == "bind()"
    assert dtype_name(torch.int32) == "int32"
    assert host_value(-1, torch.int64, np.dtype(np.int64)) == np.int64(-1)
    assert host_value(1.0, torch.bfloat16, np.dtype(np.int16)) == np.int16(0x3F80)


def test_the_buffers_use_the_same_layout_they_were_made_with() -> None:
    sb = StaticBuffers(GraphSpec.model_validate(copy.deepcopy(SMALL_SPEC)))
    assert isinstance(sb.layout, Layout) and sb.layout.plan is sb.plan
