"""The packed upload (issue 32 §3), driven on a cpu slab: the rectangles the native write gives with the
write are the numpy backend's, the arena holds the views of every bucket the packer pads to, and one
placement (one ``scatter_`` of the pairs, one copy per run) leaves the words the packer read."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphbuf import StaticBuffers
from graphbuf.buffers import commit, native
from graphbuf.buffers.backend import Backend
from graphbuf.testing import examples

KERNEL = STAGED = native.KERNEL  # as built: this module compares the kernel to Python itself
pytestmark = [
    pytest.mark.backends_compared,  # run once (conftest)
    pytest.mark.skipif(STAGED is None, reason="the native backend is not built here"),
]

DEV = torch.zeros(1)  # stands for a device source: the split only asks whether there is one


@st.composite
def write_case(draw: Any) -> dict[str, Any]:
    """Slots of 1- to 8-byte elements (1-D or 2-D), their marks and ends, and items with a host source, no
    source, or a device source."""
    targets, slots, pads, ends, rows_of, cols_of = [], [], [], [], [], []
    for i in range(draw(st.integers(1, 3))):
        dtype = np.dtype(draw(st.sampled_from(("int8", "int16", "int32", "int64", "float32"))))
        two = draw(st.booleans())
        shape = (draw(st.integers(0, 6)), draw(st.integers(0, 5))) if two else (draw(st.integers(0, 8)),)
        repeat = draw(st.booleans())
        targets.append(np.zeros(shape, dtype))
        slots.append(
            SimpleNamespace(
                index=i,
                pad=np.array(0, dtype),
                repeat_last=repeat,
                ndim=len(shape),
                itemsize=np.dtype(dtype).itemsize,
            )
        )
        pads.append(bytes(dtype.itemsize))
        ends.append(draw(st.integers(0, shape[0])) if repeat else 0)
        rows_of.append(draw(st.integers(0, shape[0])))
        cols_of.append(draw(st.integers(0, shape[1])) if two else 0)
    items = []
    for i in draw(st.lists(st.integers(0, len(targets) - 1), unique=True, max_size=len(targets))):
        t = targets[i]
        n = draw(st.integers(0, t.shape[0]))
        w = draw(st.integers(0, t.shape[1])) if t.ndim == 2 else 0
        src = draw(st.sampled_from(("host", "none", "device")))
        host = np.full((n, w) if t.ndim == 2 else (n,), 7, t.dtype) if src == "host" else None
        items.append((slots[i], host, DEV if src == "device" else None, n, w))
    words_of = tuple(
        (5 * i, t.itemsize // 4, (t.shape[1] if t.ndim == 2 else 1) * (t.itemsize // 4))
        if t.itemsize % 4 == 0
        else None
        for i, t in enumerate(targets)
    )
    return {"targets": targets, "items": items, "ends": tuple(ends), "pads": tuple(pads), "rows_of": rows_of,
            "cols_of": cols_of, "words_of": words_of}  # fmt: skip


@settings(max_examples=examples(300))
@given(write_case(), st.integers(0, 40))
def test_the_native_write_gives_the_rectangles_numpy_gives(case: dict[str, Any], limit: int) -> None:
    """write(..., words_of, limit): the same write as without them, and the packed upload's rectangles, their
    words and the rest exactly as the numpy backend's ``write_words`` computes them from the marks before the
    write (device sources, rectangles over the limit and elements narrower than 4 bytes included)."""
    kernel: Any = KERNEL
    targets, items, ends, pads = case["targets"], case["items"], case["ends"], case["pads"]
    marks = (case["rows_of"], case["cols_of"])
    base = [t.copy() for t in targets]
    base_marks = (list(marks[0]), list(marks[1]))
    commit = SimpleNamespace(
        targets=[base], ends={8: ends}, pads=pads, words_of=case["words_of"], host_slab=None
    )
    commit.rows, commit.cols = base_marks  # what write_words reads of a committer
    want = Backend().write_words(commit, 0, items, 8, limit)
    plain = [t.copy() for t in targets]
    plain_marks = (list(marks[0]), list(marks[1]))
    moved = kernel.write(plain, items, ends, pads, *plain_marks)
    ours = [t.copy() for t in targets]
    our_marks = (list(marks[0]), list(marks[1]))
    got = kernel.write(ours, items, ends, pads, *our_marks, case["words_of"], limit)
    assert moved is not None  # same dtypes, contiguous sources: the kernel writes them
    assert got == want and moved == want[0]
    assert [t.tobytes() for t in base] == [t.tobytes() for t in plain]
    assert [t.tobytes() for t in ours] == [t.tobytes() for t in plain] and our_marks == plain_marks


@pytest.mark.parametrize(
    ("words_of", "error"),
    [((None, None), ValueError), ([None] * 3, TypeError), (((0, 1), None, None), TypeError),
     (((0, -1, 3), None, None), ValueError), (((0, 0, 3), None, None), ValueError),
     (((0, "1", 3), None, None), TypeError)],
)  # fmt: skip
def test_the_native_write_refuses_a_bad_words_of_before_writing(words_of: Any, error: type) -> None:
    kernel: Any = KERNEL
    targets = [np.full((4, 3), 5, np.int32), np.full(6, 5, np.int64), np.full(2, 5, np.int32)]
    slot = SimpleNamespace(index=0, pad=np.array(0, np.int32), repeat_last=False)
    items = [(slot, np.ones((2, 3), np.int32), None, 2, 3)]
    rows_of, cols_of = [0, 0, 0], [0, 0, 0]
    with pytest.raises(error):
        kernel.write(
            targets, items, (0, 0, 0), (bytes(4), bytes(8), bytes(4)), rows_of, cols_of, words_of, 100
        )
    assert (targets[0] == 5).all() and rows_of == [0, 0, 0] and cols_of == [0, 0, 0]


def _buckets(cap: int) -> list[int]:
    """The pair counts pack pads to, up to ``cap``: 0, 64, or the count rounded up to an eighth of the
    power of two below it."""
    out, top = [0, 64], 64
    while top < cap:
        out += [top + m * (top // 8) for m in range(1, 9) if top + m * (top // 8) <= cap]
        top *= 2
    return out


def test_pack_pads_to_the_smallest_bucket_that_holds_the_pairs() -> None:
    """At every bucket's edges pack's bucket is the smallest of them that holds the pairs, and one placement
    of each leaves the words it read."""
    cap = 4096
    buckets = _buckets(cap)
    image = np.arange(2 * cap, dtype=np.int32)
    arena = commit._Arena(cap, False, torch.device("cpu"))
    words = torch.zeros(2 * cap, dtype=torch.int32)
    for k in sorted({b + d for b in buckets for d in (-1, 0, 1) if 1 <= b + d <= cap}):
        got = STAGED.pack([(0, k, 1, 2)], image, [], 0, [], [], [], arena.host)  # k one-word spans
        assert isinstance(got, tuple), (k, got)
        pairs, b, runs = got
        assert pairs == k and not runs
        assert b == min(x for x in buckets if x >= k), (k, b)
        words.zero_()
        arena.place(words, pairs, b, runs, 0)
        np.testing.assert_array_equal(words.numpy()[: 2 * k : 2], image[: 2 * k : 2])
        assert not words.numpy()[1 : 2 * k : 2].any()


def test_one_placement_leaves_the_words_the_packer_read() -> None:
    """Pairs (one scatter_) and runs (one copy each, from word 3 b of the arena), at buckets in turn: runs
    and pairs; pairs alone; runs alone (bucket 0); rows back to back (one span: a run when long, else
    pairs); more runs than pack keeps on its stack (their words copied to the run area once b is known)."""
    image = np.arange(5, 5 + 65536, dtype=np.int32)
    arena = commit._Arena(1 << 16, False, torch.device("cpu"))
    words = torch.zeros(65536, dtype=torch.int32)
    want = np.zeros(65536, dtype=np.int32)
    many = [(20000 + 2100 * i, 1, 2048 + i, 2048 + i) for i in range(20)]
    for rects, shape in (
        ([(0, 1, 2048, 2048), (3000, 5, 3, 10), (4000, 1, 2047, 2047), (9000, 1, 2500, 2500)], (2062, 2)),
        ([(12000, 70, 1, 3)], (70, 0)),
        ([(13000, 1, 3000, 3000)], (0, 1)),
        ([(17000, 1100, 2, 2), (16000, 10, 100, 100)], (1000, 1)),  # 2200 and 1000 words back to back
        ([(16000, 10, 100, 100)], (1000, 0)),
        (many, (0, 20)),
    ):
        words.zero_()
        pairs, b, runs = STAGED.pack(rects, image, [], 0, [], [], [], arena.host)
        assert (pairs, len(runs)) == shape, rects[:2]
        if rects == many:
            assert runs == [(start, length) for start, _, length, _ in many]
        arena.place(words, pairs, b, runs, sum(n for _, n in runs))
        want[:] = 0
        for start, rows, length, stride in rects:
            for r in range(rows):
                at = start + r * stride
                want[at : at + length] = image[at : at + length]
        np.testing.assert_array_equal(words.numpy(), want)


def test_a_source_the_kernel_leaves_to_numpy_packs_as_numpy_gives() -> None:
    """A misaligned source (the native write answers None): the numpy ``write_words``, the same bytes
    in the slab as the in-place refresh."""
    spec = "gemma4-31b-it-mtp"
    ours, ref = StaticBuffers(spec, upload_copies=2), StaticBuffers(spec)
    rng = np.random.default_rng(3)
    slots = {s.name: s for s in ours.layout.order}
    for n in (3, 1, 4, 2):
        size = next(s for s in ours.capture_sizes if s >= 4 * n)
        src = {}
        for name in ours.names:
            shape = ours.full[name].shape
            dtype = ours.full[name].numpy().dtype
            rows = ours.layout.rows_at(slots[name], size, n)
            live = np.sort(rng.integers(0, 4, (rows, *shape[1:2]))).astype(dtype)
            raw = np.zeros(live.nbytes + 1, np.uint8)[1:]  # one byte off: misaligned for the kernel
            src[name] = np.frombuffer(raw, dtype=dtype).reshape(live.shape)
            src[name][...] = live
        src["query_start_loc"] = np.arange(0, 4 * (n + 1), 4, dtype=np.int32)
        assert ours.refresh(size, src) == ref.refresh(size, src) == n
        for name in ours.names:
            assert torch.equal(ours.full[name], ref.full[name]), name


class _RefusesCoresOnce:
    """The kernel's packer, except that its first call with staged cores answers None (a core it cannot
    read), as no StaticBuffers built today makes it answer."""

    def __init__(self) -> None:
        self.answers: list[Any] = []

    def pack(self, rects: Any, image: Any, cores: Any, *rest: Any) -> Any:
        got = None if cores and not self.answers else STAGED.pack(rects, image, cores, *rest)
        self.answers.append(got if got is None or type(got) is int else "packed")
        return got


def test_a_refused_staged_pack_still_packs_rectangles_larger_than_the_arena() -> None:
    """When pack refuses the staged cores, the rectangles are packed alone, growing the arena when they
    need more than it holds (here 64 x 128 int32 words against its first 4096), and the staged cells are
    written by the Python check: the slab ends equal to an in-place twin's."""
    from graphbuf import GraphSpec

    spec = GraphSpec.model_validate({
        "version": 1, "name": "refused", "capture": {"tokens_per_request": 1, "sizes": [64]},
        "buffers": {"table": {"dtype": "int32", "rows": "requests", "cols": 128},
                    "big": {"dtype": "int32", "rows": "requests", "cols": 128}},
    })  # fmt: skip
    twins = [StaticBuffers(spec, upload_copies=2), StaticBuffers(spec)]
    packer = _RefusesCoresOnce()
    twins[0]._commit._packer = packer
    big = np.arange(64 * 128, dtype=np.int32).reshape(64, 128)
    for sb in twins:
        table = sb.stage("table")
        table.set(3, [7, 8, 9])
        table.scatter([0, 63], [5, 6], cols=[127, 0])
        sb.refresh(64, {"big": big}, num_reqs=64)
    assert packer.answers == [None, -8192, "packed"]
    assert all(torch.equal(twins[0].full[k], twins[1].full[k]) for k in twins[0].names)
    assert twins[0].full["table"][3, :3].tolist() == [7, 8, 9] and int(twins[0].full["table"][63, 0]) == 6
    assert not twins[0].stage("table").pending


def test_a_device_source_inside_the_slab_is_read_before_the_packed_placement() -> None:
    """A device-resident source viewing a buffer the same refresh packs (``b`` from ``a[2:4]``) is cloned
    before the placement rewrites ``a``: ``b`` gets the values that were checked, not ``a``'s new pad. On the
    cpu the source is handed to the committer as a device source (what ``check_source`` makes of a tensor on
    the slab's device); ``test_native``'s CUDA test drives the same case through ``refresh``."""
    from graphbuf import GraphSpec
    from graphbuf.buffers.validate import prepared

    spec = GraphSpec.model_validate({
        "version": 1, "name": "alias", "capture": {"tokens_per_request": 1, "sizes": [4, 8]},
        "buffers": {"a": {"dtype": "int32", "rows": "requests", "pad": 100},
                    "b": {"dtype": "int32", "rows": "requests", "pad": 0, "min": 0, "max": 5}},
    })  # fmt: skip
    sb = StaticBuffers(spec, upload_copies=2)
    sb.refresh(8, {"a": np.arange(8, dtype=np.int32) % 5, "b": np.zeros(8, np.int32)})
    a, b = sb.layout.slots["a"], sb.layout.slots["b"]
    sb._commit.apply(
        4, [prepared(a, np.array([1, 1], np.int32), None, 2, 0), prepared(b, None, sb.full["a"][2:4], 2, 0)]
    )
    assert sb.view(4)["a"].tolist() == [1, 1, 100, 100]
    assert sb.view(4)["b"].tolist() == [2, 3, 0, 0]


def _misaligned(values: np.ndarray) -> np.ndarray:
    """``values`` in an array one byte off its dtype's alignment (the native write declines it)."""
    raw = np.zeros(values.nbytes + 1, np.uint8)
    out = np.frombuffer(raw.data, dtype=values.dtype, count=values.size, offset=1).reshape(values.shape)
    out[...] = values
    assert not out.flags.aligned
    return out


def test_staged_bytes_are_the_same_when_the_native_write_declines_the_sources() -> None:
    """With staged cells packed by C, a refresh whose full sources the native write declines (misaligned:
    the numpy ``write_words`` then gives the rectangles) counts the same bytes and writes the same slab as
    one it takes: the staged bytes subtract every packed rectangle's words (``write_words__mutmut_35``, the
    words of the last rectangle only)."""
    from graphbuf import GraphSpec

    spec = GraphSpec.model_validate({
        "version": 1, "name": "declined", "capture": {"tokens_per_request": 1, "sizes": [8]},
        "buffers": {"t": {"dtype": "int32", "rows": "requests", "cols": 8},
                    "a": {"dtype": "int32", "rows": "requests"},
                    "b": {"dtype": "int32", "rows": "requests", "cols": 4}},
    })  # fmt: skip
    a, b = np.arange(5, dtype=np.int32), np.arange(20, dtype=np.int32).reshape(5, 4)
    twins = [StaticBuffers(spec, upload_copies=2) for _ in range(2)]
    for sb, sources in zip(twins, ({"a": a, "b": b}, {"a": _misaligned(a), "b": _misaligned(b)})):
        t = sb.stage("t")
        t.set(0, [1, 2, 3])
        t.scatter([4, 2], [9, 8], cols=[7, 1])
        sb.refresh(8, sources, num_reqs=5)
    assert twins[0].stats == twins[1].stats
    assert twins[0].stats.last_bytes == 4 * (5 + 5 * 4 + 3 + 2 + 8)  # a, b, then t's rows entering: 0, 2, 4
    assert all(torch.equal(twins[0].full[k], twins[1].full[k]) for k in twins[0].names)
