"""Staged writes (issue 22 §1-2): the write API, stage-time errors, commit checks, rejected commits, bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphbuf import GraphSpec, StaticBuffers
from graphbuf.buffers import native
from graphbuf.buffers.backend import Backend
from graphbuf.errors import RefreshError, RowsError, WidthError

SPEC = "gemma4-31b-it-mtp"
BT = "block_table.full"
W = 43  # cdiv(5500, 128)


def _buffers(staging: int | None = None, **kw) -> StaticBuffers:
    return StaticBuffers(SPEC, overrides={"num_blocks": 64}, upload_copies=staging, **kw)


def _rest(n: int, *, slots: bool = True) -> dict[str, np.ndarray]:
    """Full sources of every buffer but the full-group table and seq_lens, for ``n`` requests."""
    out = {
        "block_table.sliding": np.zeros((n, W), np.int32),
        "query_start_loc": np.arange(0, 4 * n + 1, 4, dtype=np.int32),
    }
    if slots:
        out["slot_mapping.full"] = np.full(4 * n, -1, np.int64)
        out["slot_mapping.sliding"] = np.full(4 * n, -1, np.int64)
    return out


def _state(b: StaticBuffers) -> bytes:
    return b.slab.numpy().tobytes()


@pytest.fixture
def host_state(backend: str) -> str:
    """Staged buffers' host state, by backend (conftest): the native one (``graphbuf.buffers._native.Staged``)
    or the Python one."""
    return "native" if backend == "native" else "python"


@pytest.fixture(params=["in-place", "staged"])
def buffers(request, host_state: str) -> StaticBuffers:
    return _buffers(None if request.param == "in-place" else 2)


def test_the_write_api_mirrors_a_block_table(buffers: StaticBuffers) -> None:
    bt, lens = buffers.stage(BT), buffers.stage("seq_lens")
    bt.set_row(0, [1, 2, 3])
    bt.append(0, [4, 5])
    bt.set(1, [9, 8], col=2)
    bt.set_row(2, [7])
    lens.set(0, np.array([640, 300, 10], np.int32))
    buffers.refresh(12, _rest(3), num_reqs=3)
    t = buffers.full[BT]
    assert t[0, :6].tolist() == [1, 2, 3, 4, 5, 0]
    assert t[1, :5].tolist() == [0, 0, 9, 8, 0]
    assert bt.lengths[:3].tolist() == [5, 4, 1]
    bt.move_row(0, 2)  # condense: row 0's request moves to row 2 (vLLM's move_row copies)
    bt.swap_rows(0, 1)
    bt.clear_row(1)
    bt.scatter([2, 2], np.array([30, 31], np.int32), cols=[5, 6])
    lens.scatter([0], np.array([11], np.int32))
    buffers.refresh(12, _rest(3), num_reqs=3)
    assert t[0, :5].tolist() == [0, 0, 9, 8, 0]
    assert t[1].tolist() == [0] * W
    assert t[2, :8].tolist() == [1, 2, 3, 4, 5, 30, 31, 0]
    assert buffers.full["seq_lens"][:4].tolist() == [11, 300, 10, 0]
    assert not bt.pending and not lens.pending


def test_rows_past_the_live_count_stay_on_the_host_until_they_are_live(buffers: StaticBuffers) -> None:
    bt = buffers.stage(BT)
    bt.set_row(0, [1])
    bt.set_row(5, [6, 6])  # past the live rows: kept in the host state, the buffer row stays pad
    buffers.stage("seq_lens").set(0, np.array([1, 1, 1, 1, 1, 1], np.int32))
    buffers.refresh(4, _rest(1), num_reqs=1)
    assert buffers.full[BT][5].tolist() == [0] * W
    assert bt.host[5, :2].tolist() == [6, 6]
    buffers.refresh(24, _rest(6), num_reqs=6)  # row 5 enters the live range: its values go up
    assert buffers.full[BT][5, :3].tolist() == [6, 6, 0]
    buffers.refresh(8, _rest(2), num_reqs=2)  # and leaves it: cleared
    assert buffers.full[BT][2:].eq(0).all()
    assert buffers.full["seq_lens"][2:].eq(0).all()


def test_staging_outside_the_allocation_fails_at_stage_time(buffers: StaticBuffers) -> None:
    bt, sm = buffers.stage(BT), buffers.stage("slot_mapping.full")
    with pytest.raises(RowsError, match=r"set\(\): buffer 'block_table.full': row 16 outside the captured "):
        bt.set(16, [1])
    with pytest.raises(WidthError, match=r"columns 42\.\.43 reach outside the captured allocation of 43"):
        bt.set(0, [1, 2], col=42)
    with pytest.raises(WidthError, match="column 43 outside"):
        bt.scatter([0], np.array([1], np.int32), cols=[43])
    with pytest.raises(RowsError, match="row -1 outside"):
        bt.move_row(-1, 0)
    with pytest.raises(RowsError, match=r"rows 63\.\.64 reach outside the captured allocation of 64 rows"):
        sm.set(63, [1, 2])
    with pytest.raises(RefreshError, match="dtype float64 cannot be cast safely to int32"):
        bt.set(0, np.array([1.5]))
    with pytest.raises(RefreshError, match=r"values 0\.\.2147483648 do not fit int32"):
        bt.set(0, [0, 2**31])
    with pytest.raises(RefreshError, match="is padded repeat_last; staged writes do not apply"):
        buffers.stage("query_start_loc")
    assert not bt.pending and not sm.pending  # a refused write stages nothing


def _full_refresh_error(staged: StaticBuffers, size: int, n: int) -> RefreshError:
    """The error a full refresh of ``staged``'s host state raises."""
    ref = _buffers()
    srcs = {**_rest(n), BT: staged.stage(BT).host[:n].copy(), "seq_lens": staged.stage("seq_lens").host[:n]}
    with pytest.raises(RefreshError) as info:
        ref.refresh(size, srcs, num_reqs=n)
    return info.value


@pytest.mark.parametrize("kernel", ["native", "numpy"])
def test_a_rejected_commit_changes_no_byte_and_keeps_its_writes_staged(
    buffers: StaticBuffers, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kernel == "numpy":
        monkeypatch.setattr(buffers.layout, "backend", Backend())  # numpy, as if built without the kernel
    bt, lens = buffers.stage(BT), buffers.stage("seq_lens")
    bt.set_row(0, np.array([1, 2], np.int32))
    lens.set(0, np.array([200, 300], np.int32))
    buffers.refresh(8, _rest(2), num_reqs=2)
    before, stats = _state(buffers), buffers.stats
    bt.append(1, np.array([5, 64], np.int32))  # 64 is above max (num_blocks - 1)
    lens.set(1, np.array([301], np.int32))
    with pytest.raises(RefreshError) as info:
        buffers.refresh(8, _rest(2), num_reqs=2)
    want = _full_refresh_error(buffers, 8, 2)
    assert type(info.value) is type(want) and str(info.value) == str(want)
    assert str(want) == (
        "refresh(size=8): buffer 'block_table.full': value 64 at index [1, 1] is above max 63 (max: "
        "num_blocks - 1)"
    )
    assert _state(buffers) == before and buffers.stats == stats
    assert bt.pending and lens.pending  # the writes stay staged: fix the bad cell, refresh again
    with pytest.raises(RefreshError):
        buffers.refresh(8, _rest(2), num_reqs=2)
    bt.set(1, np.array([6], np.int32), col=1)
    buffers.refresh(8, _rest(2), num_reqs=2)
    assert buffers.full[BT][1, :3].tolist() == [5, 6, 0]
    assert buffers.full["seq_lens"][:2].tolist() == [200, 301]


def test_a_value_entering_the_live_range_is_checked(buffers: StaticBuffers) -> None:
    lens = buffers.stage("seq_lens")
    buffers.stage(BT)
    lens.set(0, np.array([1, 9999], np.int32))  # row 1 is not live yet: nothing checks it
    buffers.refresh(4, _rest(1), num_reqs=1)
    before = _state(buffers)
    with pytest.raises(RefreshError, match=r"'seq_lens': value 9999 at index \[1\] is above max 5500"):
        buffers.refresh(8, _rest(2), num_reqs=2)
    assert _state(buffers) == before


def test_a_staged_buffer_given_whole_takes_the_source(buffers: StaticBuffers) -> None:
    bt = buffers.stage(BT)
    bt.set_row(0, [1, 2])
    with pytest.raises(RefreshError, match="has staged writes; pass it whole or leave it out"):
        buffers.refresh(4, {**_rest(1), BT: np.zeros((1, W), np.int32), "seq_lens": [1]}, num_reqs=1)
    buffers.refresh(4, {**_rest(1), "seq_lens": [1]})  # commits the staged row
    src = np.zeros((2, 4), np.int32)
    src[1] = [3, 4, 5, 6]
    buffers.refresh(8, {**_rest(2), BT: src, "seq_lens": [1, 1]})  # given whole: the host state follows
    assert bt.host[:2, :5].tolist() == [[0, 0, 0, 0, 0], [3, 4, 5, 6, 0]]
    bt.append(1, [7])
    buffers.refresh(8, {**_rest(2), "seq_lens": [1, 1]})
    assert buffers.full[BT][1, :6].tolist() == [3, 4, 5, 6, 7, 0]


def test_a_source_viewing_the_host_state_is_read_before_the_rows_it_leaves_are_padded(
    buffers: StaticBuffers,
) -> None:
    # Found while re-cutting staged.py: the host state padded the rows past the live range before it copied
    # the source, so a source viewing those rows left the host state unlike the buffer.
    lens = buffers.stage("seq_lens")
    lens.set(0, np.array([5, 6, 7, 8], np.int32))
    buffers.refresh(16, {**_rest(4), BT: np.zeros((4, W), np.int32)}, num_reqs=4)
    buffers.refresh(12, {**_rest(3), BT: np.zeros((3, W), np.int32), "seq_lens": lens.host[1:4]}, num_reqs=3)
    assert lens.host[:5].tolist() == buffers.full["seq_lens"][:5].tolist() == [6, 7, 8, 0, 0]


@pytest.mark.parametrize("copies", [None, 2], ids=["in-place", "uploaded"])
def test_a_source_viewing_a_buffer_the_refresh_rewrites_becomes_the_host_state_as_checked(
    copies: int | None,
) -> None:
    # Found by a review (H7, issue 32): a staged buffer given whole took its host state from the source after
    # the write, so a source viewing another buffer of the same refresh left the host state at that buffer's
    # new values while the buffer held the checked (old) ones; later staged commits built on the wrong state.
    spec = GraphSpec.model_validate({
        "version": 1, "name": "alias", "capture": {"tokens_per_request": 1, "sizes": [4]},
        "buffers": {"x": {"dtype": "int32", "rows": "requests"}, "y": {"dtype": "int32", "rows": "requests"}},
    })  # fmt: skip
    sb = StaticBuffers(spec, upload_copies=copies)
    sb.refresh(4, {"x": np.zeros(3, np.int32), "y": np.array([1, 2, 3], np.int32)})
    x = sb.stage("x")
    sb.refresh(4, {"x": sb.full["y"][:3], "y": np.array([7, 8, 9], np.int32)}, num_reqs=3)
    assert sb.full["x"][:3].tolist() == x.host[:3].tolist() == [1, 2, 3]
    x.set(1, [5])
    sb.refresh(4, {"y": np.array([7, 8, 9], np.int32)}, num_reqs=3)
    assert sb.full["x"][:4].tolist() == x.host[:4].tolist() == [1, 5, 3, 0]


def test_the_first_staged_write_starts_from_the_buffer_contents(buffers: StaticBuffers) -> None:
    src = np.arange(1, 9, dtype=np.int32).reshape(2, 4)
    buffers.refresh(8, {**_rest(2), BT: src, "seq_lens": [5, 6]})
    bt = buffers.stage(BT)
    assert bt.host[:2, :4].tolist() == src.tolist()
    bt.append(0, [9])
    buffers.refresh(8, {**_rest(2), "seq_lens": [5, 6]})
    assert buffers.full[BT][0, :6].tolist() == [1, 2, 3, 4, 9, 0]


def test_bytes_count_changed_and_cleared_cells(host_state: str) -> None:
    b = _buffers()
    bt, lens = b.stage(BT), b.stage("seq_lens")
    rest = {"query_start_loc": np.arange(0, 9, 4, dtype=np.int32)}
    for name in ("block_table.sliding", "slot_mapping.full", "slot_mapping.sliding"):
        b.stage(name)
    b.refresh(8, rest, num_reqs=2)  # rows enter: a table row's used width (0), a 1-D row's value
    assert b.stats.last_bytes == 3 * 4 + 2 * 4 + 2 * 8 * 8  # query_start_loc, seq_lens, slot mappings
    bt.append(0, np.array([1, 2], np.int32))
    lens.set(0, np.array([7], np.int32))
    b.refresh(8, rest, num_reqs=2)
    assert b.stats.last_bytes == 3 * 4 + 2 * 4 + 4
    bt.append(1, np.array([3], np.int32))
    b.refresh(4, {"query_start_loc": np.array([0, 4], np.int32)}, num_reqs=1)  # row 1 leaves
    # query_start_loc: 2 live + 1 cleared; block table: row 1's 2 columns (the column mark) cleared, its
    # staged cell not written; seq_lens: row 1 cleared; slot mappings: 4 token rows each cleared.
    assert b.stats.last_bytes == 3 * 4 + 2 * 4 + 4 + 2 * 4 * 8


def test_a_staged_commit_is_one_scatter_per_element_size_not_per_buffer(
    monkeypatch: pytest.MonkeyPatch, host_state: str
) -> None:
    """The Python host state: one indexed write per element size; the native one packs every cell as 4-byte
    slab words: one indexed write in all (int64 cells are two words each)."""
    b = _buffers(2)
    calls = []
    real, real_scatter = torch.Tensor.__setitem__, torch.Tensor.scatter_

    def spy(self, key, value):  # the scatter: one indexed write per element size
        if isinstance(key, torch.Tensor):
            calls.append((str(self.dtype), key.numel()))
        return real(self, key, value)

    def spy_scatter(self, dim, index, src):  # padded to a bucket of 64 with copies of the last pair: distinct
        calls.append((str(self.dtype), index.unique().numel()))
        return real_scatter(self, dim, index, src)

    monkeypatch.setattr(torch.Tensor, "__setitem__", spy)
    monkeypatch.setattr(torch.Tensor, "scatter_", spy_scatter)
    b.stage(BT).set_row(0, np.array([1, 2, 3], np.int32))
    b.stage("block_table.sliding").set_row(0, np.array([4], np.int32))
    b.stage("seq_lens").set(0, np.array([5], np.int32))
    b.stage("slot_mapping.full").set(0, np.arange(4, dtype=np.int64))
    b.refresh(4, {"query_start_loc": np.array([0, 4], np.int32), "slot_mapping.sliding": np.arange(4)})
    full = 2 + 2 * 4  # the full sources: query_start_loc (2 int32 words), slot_mapping.sliding (4 int64)
    if host_state == "native":  # 3 staged buffers and 2 full sources: 1 indexed write of 23 words
        assert calls == [("torch.int32", 5 + 2 * 4 + full)]
    else:  # without the kernels: the full sources copied per rectangle, the staged buffers in 2 scatters
        assert sorted(calls) == [("torch.int32", 5), ("torch.int64", 4)]
    assert b.full[BT][0, :4].tolist() == [1, 2, 3, 0]
    assert b.full["slot_mapping.full"][:5].tolist() == [0, 1, 2, 3, -1]


def test_a_refresh_missing_a_buffer_names_only_the_unstaged_ones(host_state: str) -> None:
    b = _buffers()
    for name in b.names:
        if name != "query_start_loc":
            b.stage(name)
    with pytest.raises(RefreshError) as got:
        b.refresh(4, {}, num_reqs=1)
    assert "missing buffer(s) query_start_loc;" in str(got.value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_staged_commit_is_one_host_to_device_copy() -> None:
    """A refresh uploads its staged buffers' changed cells and the buffers given whole (query_start_loc is
    repeat_last, never staged) in one packed copy (with the native backend; two without it: the changed
    cells and the whole buffers apart), never one per buffer."""
    from torch.profiler import ProfilerActivity, profile

    b = StaticBuffers(SPEC, overrides={"num_blocks": 64}, device="cuda")
    k = 4

    def step(i: int) -> None:
        b.stage(BT).set(0, np.array([i % 64], np.int32), col=i % W)
        b.stage("block_table.sliding").set(0, np.array([(i + 1) % 64], np.int32))
        b.stage("seq_lens").set(0, np.array([4 + i], np.int32))
        b.stage("slot_mapping.full").set(0, np.arange(4, dtype=np.int64) + i)
        b.stage("slot_mapping.sliding").set(0, np.arange(4, dtype=np.int64) + 2 * i)
        b.refresh(4, {"query_start_loc": np.array([0, 4], np.int32)}, num_reqs=1)

    def htod() -> float:
        for i in range(3):
            step(i)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(k):
                step(i)
            torch.cuda.synchronize()
        return sum(e.name.startswith("Memcpy HtoD") for e in prof.events()) / k

    assert htod() == (1 if native.KERNEL is not None else 2)
    for name in b.names:
        if name != "query_start_loc":
            h = b.stage(name).host
            np.testing.assert_array_equal(b.full[name].cpu().numpy()[: h.shape[0]], h, err_msg=name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_full_refresh_is_one_host_to_device_copy(backend: str) -> None:
    """Issue 32 §3: every buffer given whole from the host is one packed upload (at most 2 with
    device-resident sources, which are copied on the device), the contents those of a cpu refresh."""
    from torch.profiler import ProfilerActivity, profile

    if backend != "native":
        pytest.skip("the packed upload is the native backend's")

    b = StaticBuffers(SPEC, overrides={"num_blocks": 64}, device="cuda")
    ref = StaticBuffers(SPEC, overrides={"num_blocks": 64})
    rng = np.random.default_rng(5)

    def sources(n: int) -> dict[str, np.ndarray]:
        return {
            BT: rng.integers(0, 64, (n, W), dtype=np.int32),
            "block_table.sliding": rng.integers(0, 64, (n, W), dtype=np.int32),
            "seq_lens": rng.integers(1, 5000, n, dtype=np.int32),
            "query_start_loc": np.arange(0, 4 * n + 1, 4, dtype=np.int32),
            "slot_mapping.full": rng.integers(0, 64 * 128, 4 * n).astype(np.int64),
            "slot_mapping.sliding": rng.integers(0, 64 * 128, 4 * n).astype(np.int64),
        }

    for n in (3, 1, 2):
        b.refresh(4 * n, sources(n))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for n in (3, 1, 2, 3):
            src = sources(n)
            b.refresh(4 * n, src)
            ref.refresh(4 * n, src)
        torch.cuda.synchronize()
    assert sum(e.name.startswith("Memcpy HtoD") for e in prof.events()) == 4
    for name in b.names:
        assert torch.equal(b.full[name].cpu(), ref.full[name]), name


def test_an_eager_step_reads_staged_host_state_and_leaves_the_writes_staged(buffers: StaticBuffers) -> None:
    # A runner runs a capture size eagerly when its capture failed (seen on an H200): a staged step there
    # must see what the staged writes say, exactly as if the buffers were given whole.
    b = buffers
    b.refresh(8, {**_rest(2), BT: np.zeros((2, W), np.int32), "seq_lens": np.array([3, 4], np.int32)})
    b.stage(BT).set(1, np.array([7, 8], np.int32), col=1)
    b.stage("seq_lens").set(0, np.array([9, 10], np.int32))
    before = _state(b)
    got = b.eager_inputs(8, {"query_start_loc": np.array([0, 4, 8], np.int32), **_rest(2, slots=True)},
                         num_reqs=2)  # fmt: skip
    table = np.zeros((2, W), np.int32)
    table[1, 1:3] = [7, 8]
    want = b.eager_inputs(8, {**_rest(2), BT: table, "seq_lens": np.array([9, 10], np.int32)}, num_reqs=2)
    for name in b.names:
        assert torch.equal(got[name], want[name]), name
    assert _state(b) == before and b.stage(BT).pending and b.stage("seq_lens").pending
    with pytest.raises(RefreshError, match="above max"):
        b.stage("seq_lens").set(1, np.array([5501], np.int32))
        b.eager_inputs(8, {"query_start_loc": np.array([0, 4, 8], np.int32), **_rest(2)}, num_reqs=2)


def test_a_packed_upload_larger_than_its_arena_grows_it_and_writes_every_cell(host_state: str) -> None:
    """The packed upload's arena starts at 4096 words: a commit of 8 rows x 2560 columns entering the live
    range (runs: rows of at least 2048 words, placed by a copy each), rows of a full source as runs too,
    rows leaving as pad runs, and a whole buffer past PACK_MAX (its own copy) still write the bytes an
    in-place commit writes."""
    from graphbuf import GraphSpec

    spec = GraphSpec.model_validate({
        "version": 1, "name": "wide", "constants": {"max_num_seqs": 8, "width": 2560, "big": 4096},
        "capture": {"tokens_per_request": 1, "sizes": [8]},
        "buffers": {
            "bt": {"dtype": "int32", "rows": "requests", "cols": "width", "min": 0, "max": 9999},
            "lens": {"dtype": "int64", "rows": "requests", "min": 0},
            "wide": {"dtype": "int32", "rows": "requests", "cols": "big"},
            "mid": {"dtype": "int64", "rows": 4, "cols": 1030, "pad": -1},
        },
    })  # fmt: skip
    rng = np.random.default_rng(7)
    rows = rng.integers(0, 9999, (8, 2560), dtype=np.int32)
    wide = rng.integers(0, 1 << 30, (8, 4096), dtype=np.int32)  # 128 KiB: above PACK_MAX
    mid = rng.integers(0, 1 << 40, (4, 1030))  # rows of 2060 words: runs of the image, 32 KiB in all
    got = []
    for staging in (None, 2):
        b = StaticBuffers(spec, upload_copies=staging)
        h = b.stage("bt")
        for r in range(8):
            h.set_row(r, rows[r])
        b.stage("lens").set(0, np.arange(8, dtype=np.int64) + 1)
        b.refresh(8, {"wide": wide, "mid": mid}, num_reqs=8)
        got.append({name: b.full[name].clone() for name in b.names})
        b.refresh(8, {"wide": wide[:3], "mid": mid[:, :1000]}, num_reqs=3)  # rows 3..7 leave: pad runs
        got.append({name: b.full[name].clone() for name in b.names})
    for name in got[0]:
        assert torch.equal(got[0][name], got[2][name]) and torch.equal(got[1][name], got[3][name]), name
    assert torch.equal(got[2]["bt"], torch.from_numpy(rows))
    assert torch.equal(got[3]["mid"][:, 1000:], torch.full((4, 30), -1))


# Values a refresh refuses for their type, dtype or size (issue 32 §1: one value rule, list casts included).
_REFUSED = {
    "float list": [1.5, 2.0],
    "float array": np.array([1.5, 2.0]),
    "int64 array": np.array([1, 2], np.int64),
    "uint32 array": np.array([1, 2], np.uint32),
    "float16 tensor": torch.tensor([1, 2], dtype=torch.float16),
    "past int32": [2**31, 0],
    "past 64 bits": [2**64, 0],
    "strings": ["a", "b"],
    "ragged": [[1], [2, 3]],
}


@pytest.mark.parametrize("values", list(_REFUSED.values()), ids=list(_REFUSED))
def test_a_value_a_refresh_refuses_is_refused_by_a_staged_write_in_the_same_words(values: object) -> None:
    b = _buffers()
    full_sources = {**_rest(2), BT: np.zeros((2, W), np.int32), "seq_lens": values}
    with pytest.raises(RefreshError) as full:
        b.refresh(8, full_sources, num_reqs=2)
    h = b.stage("seq_lens")
    with pytest.raises(RefreshError) as staged:
        h.set(0, values)
    assert type(staged.value) is type(full.value)
    # the same words after the call's label ("refresh(size=8): " against "set(): ")
    assert str(staged.value).split(": ", 1)[1] == str(full.value).split(": ", 1)[1]
    assert not h.pending


def test_a_value_out_of_bounds_fails_the_commit_as_it_fails_a_refresh() -> None:
    """Bounds are checked when a refresh commits staged values: the same error, label included."""
    bad = np.array([5, -1], np.int32)  # seq_lens: min 0
    b = _buffers()
    with pytest.raises(RefreshError) as full:
        b.refresh(8, {**_rest(2), BT: np.zeros((2, W), np.int32), "seq_lens": bad}, num_reqs=2)
    h = b.stage("seq_lens")
    h.set(0, bad)
    with pytest.raises(RefreshError) as staged:
        b.refresh(8, {**_rest(2), BT: np.zeros((2, W), np.int32)}, num_reqs=2)
    assert type(staged.value) is type(full.value) and str(staged.value) == str(full.value)
    assert h.pending  # a rejected commit keeps its writes staged
