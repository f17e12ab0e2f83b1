"""``graphbuf/buffers/eager.py``: the inputs of a step above the largest capture size, built fresh from
validated sources and padded exactly as a refresh pads a captured buffer; the slab is not touched."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import SMALL_SPEC

from graphbuf import GraphSpec, StaticBuffers
from graphbuf.buffers.eager import build_eager
from graphbuf.buffers.mapping import prepare_mapping

CPU = torch.device("cpu")


def _sb() -> StaticBuffers:
    return StaticBuffers(GraphSpec.model_validate(copy.deepcopy(SMALL_SPEC)))


def _sources(n: int, width: int = 3) -> dict[str, np.ndarray]:
    return {
        "block_table.a": np.arange(n * width, dtype=np.int32).reshape(n, width) % 32,
        "block_table.b": np.full((n, width), 5, np.int32),
        "seq_lens": np.arange(10, 10 + n, dtype=np.int32),
        "query_start_loc": np.arange(n + 1, dtype=np.int32),  # within max_num_batched_tokens (8)
        "slot_mapping": np.arange(2 * n, dtype=np.int64),
    }


def test_an_eager_step_is_padded_as_a_refresh_pads() -> None:
    """At 20 tokens (10 requests of room) with 7 live: block-table columns past the width and rows past
    the live ones hold the pad, ``query_start_loc`` repeats its last live value, ``slot_mapping`` pads -1."""
    sb = _sb()
    label = "eager(size=20)"
    prepared, live = prepare_mapping(sb.layout, _sources(7), 20, None, label, strict=True, device=CPU)
    out = build_eager(sb.layout, prepared, 20, CPU)
    assert live == 7 and set(out) == set(_sources(1))
    bt = out["block_table.a"]
    assert bt.shape == (10, 4) and bt.dtype == torch.int32
    assert bt[:7, :3].numpy().tolist() == _sources(7)["block_table.a"].tolist()
    assert (bt[:, 3] == 0).all() and (bt[7:] == 0).all()
    qsl = out["query_start_loc"]
    assert qsl.shape == (11,) and qsl[:8].tolist() == list(range(8)) and (qsl[8:] == 7).all()
    sm = out["slot_mapping"]
    assert sm.shape == (20,) and sm[:14].tolist() == list(range(14)) and (sm[14:] == -1).all()


def test_eager_tensors_are_new_and_the_sources_are_copied() -> None:
    sb = _sb()
    src = _sources(2)
    before = sb.slab.clone()
    prepared, _ = prepare_mapping(sb.layout, src, 10, None, "eager(size=10)", strict=True, device=CPU)
    out = build_eager(sb.layout, prepared, 10, CPU)
    src["seq_lens"][:] = 0
    assert out["seq_lens"][:2].tolist() == [10, 11]
    assert torch.equal(sb.slab, before)
    assert all(t.untyped_storage().data_ptr() != sb.slab.untyped_storage().data_ptr() for t in out.values())


def test_a_bfloat16_buffer_comes_back_as_bfloat16() -> None:
    spec = copy.deepcopy(SMALL_SPEC)
    spec["buffers"]["h"] = {"dtype": "bfloat16", "rows": "requests", "pad": -2.0}
    sb = StaticBuffers(GraphSpec.model_validate(spec))
    src = {**_sources(2), "h": torch.tensor([1.5, 0.25], dtype=torch.bfloat16)}
    prepared, _ = prepare_mapping(sb.layout, src, 12, None, "eager(size=12)", strict=True, device=CPU)
    h = build_eager(sb.layout, prepared, 12, CPU)["h"]
    assert h.dtype == torch.bfloat16 and h.tolist() == [1.5, 0.25, -2.0, -2.0, -2.0, -2.0]


@pytest.mark.parametrize("n", [0, 1, 5])
def test_eager_inputs_give_the_same_tensors(n: int) -> None:
    """``StaticBuffers.eager_inputs`` is this module behind the guard and the size checks."""
    sb = _sb()
    prepared, _ = prepare_mapping(sb.layout, _sources(n), 16, None, "eager(size=16)", strict=True, device=CPU)
    direct = build_eager(sb.layout, prepared, 16, CPU)
    via = sb.eager_inputs(16, _sources(n))
    assert all(torch.equal(direct[k], via[k]) for k in direct)
