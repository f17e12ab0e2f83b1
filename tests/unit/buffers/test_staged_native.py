"""The native staged host state (``graphbuf/buffers/_staged.c``) against the Python one: every argument form
a write takes gives the same host state, lengths, changed cells and committed bytes; every refused one the
same error; the guard holds."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from graphbuf import StaticBuffers
from graphbuf.buffers import native
from graphbuf.buffers.staged import changed_cells
from graphbuf.errors import ConcurrentUseError, RefreshError, RowsError, WidthError

pytestmark = [
    pytest.mark.backends_compared,
    pytest.mark.skipif(native.KERNEL is None, reason="the staged-write kernel is not built here"),
]

SPEC = "gemma4-31b-it-mtp"
BT, LENS, SM = "block_table.full", "seq_lens", "slot_mapping.full"
QSL = {"query_start_loc": np.arange(0, 4 * 3 + 1, 4, dtype=np.int32)}


def _pair(monkeypatch: pytest.MonkeyPatch) -> tuple[StaticBuffers, StaticBuffers]:
    """(native, python) buffers with every buffer but query_start_loc staged."""
    out = []
    for kernel in (native.KERNEL, None):
        monkeypatch.setattr(native, "KERNEL", kernel)
        b = StaticBuffers(SPEC, overrides={"num_blocks": 64})
        for name in b.names:
            if name != "query_start_loc":
                b.stage(name)
        out.append(b)
    monkeypatch.undo()
    return out[0], out[1]


# (buffer, op, args, kwargs): plain forms and every other form a write accepts
WRITES: list[tuple[str, str, tuple[Any, ...], dict[str, Any]]] = [
    (BT, "set_row", (0, [1, 2, 3]), {}),
    (BT, "set", (np.int64(1), np.array([4, 5], np.int16)), {"col": np.int32(2)}),
    (BT, "set", (), {"row": 2, "values": (6, 7), "col": 1}),
    (BT, "append", (0, np.arange(10, 16, dtype=np.int32)[:3]), {}),  # a view
    (BT, "append", (1, torch.tensor([9], dtype=torch.int32)), {}),
    (BT, "append", (2, []), {}),
    (BT, "scatter", ([0, 2], np.array([11, 12], np.int32)), {"cols": [7, 0]}),
    (BT, "scatter", (np.array([1, 1]), [13, 14], np.array([8, 8])), {}),  # the last value wins
    (BT, "scatter", ([], []), {"cols": []}),
    (BT, "move_row", (0, 2), {}),
    (BT, "swap_rows", (np.int16(1), 2), {}),
    (BT, "clear_row", (), {"row": 1}),
    (BT, "set_row", (1, np.array([21, 22], np.uint8)), {}),
    (LENS, "set", (0, [100, 200, 300]), {}),
    (LENS, "set", (2, np.array([301], np.uint16)), {}),
    (LENS, "set_row", (1, [201]), {}),
    (LENS, "scatter", ([0], np.array([101], np.int32)), {}),
    (SM, "set", (0, np.arange(12)), {}),
    (SM, "set", (3, np.arange(20, 23, dtype=np.int32)), {}),
    (SM, "swap_rows", (0, 11), {}),
    (SM, "move_row", (5, 5), {}),
    (SM, "clear_row", (4,), {}),
]


def test_every_write_form_gives_the_same_state_on_both_host_states(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _pair(monkeypatch)
    for name, op, args, kw in WRITES:
        for buffers in (a, b):
            getattr(buffers.stage(name), op)(*args, **kw)
        ha, hb = a.stage(name), b.stage(name)
        assert ha.host.tobytes() == hb.host.tobytes(), (name, op, args, kw)
        if ha.host.ndim == 2:
            assert ha.lengths.tolist() == hb.lengths.tolist(), (name, op)
        assert ha.pending == hb.pending
        assert sorted(changed_cells(ha).tolist()) == sorted(changed_cells(hb).tolist()), (name, op)
    for size, n in ((12, 3), (4, 1), (12, 3)):  # rows enter, leave and enter again
        qsl = {"query_start_loc": QSL["query_start_loc"][: n + 1]}
        a.refresh(size, qsl, num_reqs=n)
        b.refresh(size, qsl, num_reqs=n)
        for name in a.names:  # (the slab's alignment gaps are never written)
            assert a.full[name].numpy().tobytes() == b.full[name].numpy().tobytes(), (size, n, name)
        assert a.stats == b.stats
        assert not a.stage(BT).pending


REFUSED: list[tuple[str, str, tuple[Any, ...], dict[str, Any], type[Exception]]] = [
    (BT, "set", (16, [1]), {}, RowsError),
    (BT, "set", (True, [1]), {}, RowsError),
    (BT, "set", (0.0, [1]), {}, RowsError),
    (BT, "set", (0, [1, 2]), {"col": 42}, WidthError),
    (BT, "set", (0, [1]), {"col": -1}, WidthError),
    (BT, "set", (0, [2**31]), {}, RefreshError),
    (BT, "set", (0, np.array([1.5])), {}, RefreshError),
    (BT, "set", (0, np.zeros((2, 2), np.int32)), {}, RefreshError),
    (BT, "append", (0, list(range(44))), {}, WidthError),
    (BT, "scatter", ([0], [1]), {}, RefreshError),  # 2-D: cols= missing
    (BT, "scatter", ([0, 1], [1]), {"cols": [0, 1]}, RefreshError),
    (BT, "scatter", ([0], [1]), {"cols": [43]}, WidthError),
    (BT, "scatter", ([-1], [1]), {"cols": [0]}, RowsError),
    (BT, "move_row", (-1, 0), {}, RowsError),
    (BT, "swap_rows", (0, 16), {}, RowsError),
    (LENS, "set", (0, [1]), {"col": 1}, WidthError),
    (LENS, "append", (0, [1]), {}, RefreshError),
    (LENS, "set_row", (0, [1, 2]), {}, RefreshError),
    (LENS, "scatter", ([0], [1]), {"cols": [0]}, WidthError),
    (SM, "set", (63, [1, 2]), {}, RowsError),
    (SM, "set", (0, [-(2**63) - 1]), {}, RefreshError),
    (SM, "set", (0, torch.zeros(1, dtype=torch.bfloat16)), {}, RefreshError),
    # a refresh refuses strided elements (a layout bug); a staged write takes the same rule
    (BT, "append", (0, np.arange(10, 16, dtype=np.int32)[::2]), {}, RefreshError),
]


@pytest.mark.parametrize(("name", "op", "args", "kw", "exc"), REFUSED)
def test_a_refused_write_raises_the_same_error_and_stages_nothing(
    monkeypatch: pytest.MonkeyPatch, name: str, op: str, args: tuple[Any, ...], kw: dict[str, Any],
    exc: type[Exception],
) -> None:  # fmt: skip
    a, b = _pair(monkeypatch)
    msgs = []
    for buffers in (a, b):
        h = buffers.stage(name)
        before = h.host.tobytes()
        with pytest.raises(exc) as info:
            getattr(h, op)(*args, **kw)
        msgs.append(str(info.value))
        assert h.host.tobytes() == before and not h.pending
    assert msgs[0] == msgs[1]


@pytest.mark.parametrize("kind", ["native", "python"])
def test_wrong_arguments_are_type_errors(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Calling-convention errors come from StagedBuffer's own signatures: both host states word them
    alike, naming the public class and the true count."""
    h = _pair(monkeypatch)[0 if kind == "native" else 1].stage(BT)
    with pytest.raises(TypeError, match=r"StagedBuffer.set\(\) got an unexpected keyword argument 'column'"):
        h.set(0, [1], column=2)
    missing = r"StagedBuffer.set\(\) missing 1 required positional argument: 'values'"
    with pytest.raises(TypeError, match=missing):
        h.set(0)
    with pytest.raises(TypeError, match=r"StagedBuffer.set\(\) got multiple values for argument 'row'"):
        h.set(0, [1], row=1)
    extra = r"StagedBuffer.move_row\(\) takes 3 positional arguments but 4 were given"
    with pytest.raises(TypeError, match=extra):
        h.move_row(0, 1, 2)
    assert not h.pending


@pytest.mark.parametrize("kind", ["native", "python"])
def test_a_write_during_a_refresh_is_refused(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """A staged write from code a refresh runs (here a source's conversion; another thread alike) while it
    holds the buffers raises ConcurrentUseError and stages nothing."""
    buffers = _pair(monkeypatch)[0 if kind == "native" else 1]
    h = buffers.stage(BT)
    inner: list[BaseException] = []

    class Hostile:  # numpy converts it inside the refresh, between the guard's acquire and release
        def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
            try:
                h.set_row(0, [1])
            except ConcurrentUseError as exc:
                inner.append(exc)
            return np.array(0, np.int32)

    with pytest.raises(RefreshError):  # one offset is not a query_start_loc of one request
        buffers.refresh(4, {"query_start_loc": [Hostile()]}, num_reqs=1)
    assert len(inner) == 1 and str(inner[0]).startswith("set_row(): another thread is using")
    assert not h.pending
    h.set_row(0, [1])  # the guard was released
    assert h.pending


def test_a_bad_value_is_rejected_at_commit_with_a_full_refresh_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = _pair(monkeypatch)
    errors = []
    for buffers in (a, b):
        buffers.stage(LENS).set(0, [1, 2, 6000])  # above max_model_len
        before = buffers.slab.numpy().tobytes()
        with pytest.raises(RefreshError) as info:
            buffers.refresh(12, QSL, num_reqs=3)
        errors.append(str(info.value))
        assert buffers.slab.numpy().tobytes() == before and buffers.stage(LENS).pending
    assert errors[0] == errors[1] and "above max" in errors[0]


@pytest.mark.parametrize("kind", ["native", "python"])
def test_a_source_inside_the_slab_is_written_as_it_was_checked(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A full source that is a view of a staged buffer's memory in the slab: the staged writes of the same
    refresh must not change it between its check and its write (both commits write the staged cells after
    the full sources)."""
    b = _pair(monkeypatch)[0 if kind == "native" else 1]
    b.stage(BT).set_row(0, [0, 4])
    b.refresh(4, {"query_start_loc": np.array([0, 4], np.int32)}, num_reqs=1)
    view = b.full[BT][0, :2].numpy()  # [0, 4] in the slab: a valid query_start_loc for one request
    b.stage(BT).set_row(0, [0, 5])  # staged: the same refresh writes it over the view's bytes
    b.refresh(4, {"query_start_loc": view}, num_reqs=1)
    assert b.full["query_start_loc"][:2].tolist() == [0, 4]  # as checked
    assert b.full[BT][0, :3].tolist() == [0, 5, 0]


@pytest.mark.parametrize("k", [1, 64, 65, 127, 128, 129, 1000, 1024, 1025, 2047])
def test_pack_pads_pairs_to_an_eighth_of_their_octave_with_copies_of_the_last(k: int) -> None:
    """pack's bucket: 64, or k rounded up to an eighth of the power of two below it (at most 1/8 padding);
    the padding repeats the last pair (the same index, the same word), so placing it changes nothing."""
    image = np.arange(4 * 4096, dtype=np.int32)
    rects = [(3 * i, 1, 1, 1) for i in range(k)]  # k one-word spans: k pairs
    arena = np.zeros(16 * 4096, dtype=np.uint8)
    got = native.KERNEL.pack(rects, image, [], 0, [], [], [], arena)
    assert isinstance(got, tuple), got
    pairs, b, runs = got
    low = 1 << (k.bit_length() - 1)
    assert pairs == k and not runs
    assert b == 64 if k <= 64 else (b % (low // 8) == 0 and k <= b < k + low // 8), (k, b)
    idx = arena[: 8 * b].view(np.int64)
    val = arena[8 * b : 12 * b].view(np.int32)
    want = np.array([3 * i for i in range(k)], dtype=np.int64)
    np.testing.assert_array_equal(idx[:k], want)
    np.testing.assert_array_equal(val[:k], image[want])
    assert (idx[k:] == want[-1]).all() and (val[k:] == image[want[-1]]).all()


def test_pack_sends_spans_of_run_min_words_as_runs() -> None:
    """A span of at least 2048 words goes to the run area (one device copy), not 2048 pairs."""
    image = np.arange(8192, dtype=np.int32)
    arena = np.zeros(16 * 4096, dtype=np.uint8)
    rects = [(100, 1, 2048, 2048), (5000, 1, 2047, 2047)]
    pairs, b, runs = native.KERNEL.pack(rects, image, [], 0, [], [], [], arena)
    assert pairs == 2047 and runs == [(100, 2048)]
    np.testing.assert_array_equal(arena[12 * b : 12 * b + 4 * 2048].view(np.int32), image[100:2148])


def test_pack_refuses_a_staged_buffer_of_narrow_elements_before_others() -> None:
    """A staged core of 2-byte elements before a 4-byte one: pack answers None (nothing packed, every cell
    still pending for the Python upload), never success with the later core's cells skipped."""
    import threading

    lock = threading.Lock()

    def core(dtype: type, index: int) -> object:
        host = np.zeros(8, dtype=dtype)
        zero = np.zeros(1, dtype).tobytes()
        return native.KERNEL.Staged(host, None, zero, None, None, tuple(range(9)), index, lock, 0, 8, None,
                                    np.ndarray)  # fmt: skip

    narrow, wide = core(np.int16, 0), core(np.int32, 1)
    wide.set(2, np.array([7], dtype=np.int32))
    narrow.set(1, np.array([5], dtype=np.int16))
    arena = np.zeros(16 * 64, dtype=np.uint8)
    got = native.KERNEL.pack([], np.zeros(4, np.int32), [narrow, wide], 8, [8, 8], [0, 0], [0, 16], arena)
    assert got is None and narrow.pending and wide.pending
