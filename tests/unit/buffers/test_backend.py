"""The backend: chosen once when StaticBuffers is built; each native method gives the numpy method's answer,
through C where C takes the input and through numpy where C declines (floats, the general path's inputs, a
misaligned source)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphbuf import RefreshError, StaticBuffers
from graphbuf.buffers import native
from graphbuf.buffers.backend import Backend, NativeBackend, chosen
from graphbuf.testing import examples

pytestmark = pytest.mark.backends_compared  # compares the backends itself (conftest)

needs_kernel = pytest.mark.skipif(native.KERNEL is None, reason="the native kernel is not built here")
SPEC = "gemma4-31b-it-mtp"
SMALL = {"num_blocks": 64, "max_model_len": 512}


def _committer(targets: list, ends: tuple, pads: tuple, rows: list, cols: list) -> SimpleNamespace:
    """What a backend's write reads of a committer: upload copy 0's targets, ends at size 8, pads, marks."""
    return SimpleNamespace(targets=[targets], ends={8: ends}, pads=pads, rows=rows, cols=cols, host_slab=None)


def test_the_backend_is_chosen_when_the_buffers_are_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """``chosen()`` reads the kernel once; buffers keep the backend they were built with, and every part of
    them (checks, writes, the packer of uploads, the staged host states) reads that one."""
    built = StaticBuffers(SPEC, overrides=SMALL)
    want = NativeBackend if native.KERNEL is not None else Backend
    assert type(built.layout.backend) is want and type(chosen()) is want
    monkeypatch.setattr(native, "KERNEL", None)
    numpy_built = StaticBuffers(SPEC, overrides=SMALL, upload_copies=2)
    assert type(numpy_built.layout.backend) is Backend and type(chosen()) is Backend
    assert type(built.layout.backend) is want  # built before: unchanged
    assert numpy_built.layout.backend.packer is None and numpy_built.layout.backend.staged is None
    handle = numpy_built.stage("block_table.full")
    assert type(handle).__module__ == "graphbuf.buffers.staged"  # the Python host state


@needs_kernel
@settings(max_examples=examples(200))
@given(
    st.sampled_from(["int32", "int64", "int16", "float32", "float64"]),
    st.lists(st.integers(-5, 70), min_size=1, max_size=40),
    st.sampled_from([None, 0, 3]),
    st.sampled_from([None, 63, 10**12]),
)
def test_fits_is_the_numpy_answer_through_c_or_numpy(dtype: str, values: list[int], lo: int, hi: int) -> None:
    """``fits`` over integer and float regions (C declines floats), bounds partly unset."""
    sb = StaticBuffers(SPEC, overrides=SMALL)
    slot = sb.layout.slots["seq_lens"]
    slot = dataclasses.replace(slot, lo=lo, hi=hi)  # the same slot with drawn bounds
    arr = np.array(values, dtype=dtype)
    rows = len(values) - len(values) // 3
    assert NativeBackend(native.KERNEL).fits(slot, arr, rows, 0) is Backend().fits(slot, arr, rows, 0)
    if arr.dtype.kind == "f":
        arr[0] = np.nan
        assert NativeBackend(native.KERNEL).fits(slot, arr, rows, 0) is False


@needs_kernel
def test_accept_all_declined_by_c_gives_the_numpy_records_and_errors() -> None:
    """A list source sends the whole mapping to numpy: the same records as numpy's, not marked agreed; a
    source C takes with ``num_reqs`` is marked agreed; a bad value raises numpy's error through both."""
    sb = StaticBuffers(SPEC, overrides=SMALL)
    layout = sb.layout
    srcs = {"seq_lens": [5, 6], "query_start_loc": np.array([0, 4, 8], np.int32)}
    ours = NativeBackend(native.KERNEL).accept_all(layout, srcs, 8, None, "r", False, sb.device)
    ref = Backend().accept_all(layout, srcs, 8, None, "r", False, sb.device)
    assert ours[1] is False and ref[1] is False
    for a, b in zip(ours[0], ref[0]):
        assert a.slot is b.slot and (a.rows, a.width) == (b.rows, b.width)
        assert np.array_equal(a.host, b.host)
    arrays = {"query_start_loc": np.array([0, 4, 8], np.int32)}
    got, agreed = NativeBackend(native.KERNEL).accept_all(layout, arrays, 8, 2, "r", False, sb.device)
    assert agreed and got[0].rows == 3
    bad = {"seq_lens": np.array([5, -1], np.int32)}
    errors = []
    for backend in (NativeBackend(native.KERNEL), Backend()):
        with pytest.raises(RefreshError) as info:
            backend.accept_all(layout, bad, 8, None, "r", False, sb.device)
        errors.append(str(info.value))
    assert errors[0] == errors[1] and "below min 0" in errors[0]


@needs_kernel
def test_a_write_c_declines_is_the_numpy_write() -> None:
    """A misaligned source: C writes nothing and answers None; the native write then gives numpy's bytes,
    marks and byte count."""
    sb = StaticBuffers(SPEC, overrides=SMALL)
    slot = sb.layout.slots["seq_lens"]
    raw = np.zeros(4 * 3 + 1, np.uint8)[1:]
    src = np.frombuffer(raw, np.int32)
    src[:] = [7, 8, 9]
    item = (slot, src, None, 3, 0)
    results = []
    for backend in (NativeBackend(native.KERNEL), Backend()):
        targets = [np.full(t.shape, 1, t.numpy().dtype) for t in sb.full.values()]
        rows, cols = [5] * len(targets), [0] * len(targets)
        ends, pads = (0,) * len(targets), (bytes(4),) * len(targets)
        moved = backend.write(_committer(targets, ends, pads, rows, cols), 0, [item], 8)
        results.append((moved, rows, cols, targets[slot.index].tolist()))
    k = len(sb.layout.order)
    empty = [np.zeros(sb.full[s.name].shape, np.int32) for s in sb.layout.order]
    assert native.KERNEL.write(empty, [item], (0,) * k, (bytes(4),) * k, [0] * k, [0] * k) is None  # declined
    assert not any(t.any() for t in empty)
    assert results[0] == results[1]
    assert results[0][3][:6] == [7, 8, 9, 0, 0, 1] and results[0][0] == 5 * 4


def test_a_device_source_is_left_for_the_device_copy(backend: str) -> None:
    """An item with no host values (a device source) gets its pads and marks written, its live cells not."""
    sb = StaticBuffers(SPEC, overrides=SMALL)
    slot = sb.layout.slots["seq_lens"]
    target = np.full(sb.full["seq_lens"].shape, 9, np.int32)
    targets = [target if s is slot else np.zeros(1) for s in sb.layout.order]
    n = len(targets)
    rows = [4 if i == slot.index else 0 for i in range(n)]
    dev = torch.zeros(2, dtype=torch.int32)
    commit = _committer(targets, (0,) * n, (bytes(4),) * n, rows, [0] * n)
    moved = chosen().write(commit, 0, [(slot, None, dev, 2, 0)], 8)
    assert target[:2].tolist() == [9, 9] and target[2:4].tolist() == [0, 0] and target[4] == 9
    assert rows[slot.index] == 2 and moved == 4 * 4
