"""BoundSources (StaticBuffers.bind): persistent host sources bound once, refreshed by request count.

A bound refresh must leave exactly the bytes a mapping refresh of the same live rows leaves (checked against
``StaticBuffers.refresh`` and against contents built by hand), read the bound memory as it is at each
refresh, clear stale rows and columns, and reject every bad call with a message naming the place, changing
no byte.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from paged_spec import PAGED_SPEC

import graphbuf
from graphbuf import (
    AddressChangedError,
    BoundSources,
    GraphSpec,
    RefreshError,
    RowsError,
    StaticBuffers,
    WidthError,
)
from graphbuf.graphs.runner import EAGER_TOO_LARGE, GraphRunner, Step

Mapping = dict[str, Any]

ROWS = 6  # persistent buffers hold more requests than the largest capture (4), like vLLM's max_num_seqs
WIDE = 7  # and are wider than the captured block tables (4 columns)
W4 = {"block_table.a": 4, "block_table.b": 4}  # live widths within the captured allocation


def _buffers(spec: Mapping, staged: bool = False) -> StaticBuffers:
    # staged: the accelerator path (two staging copies, uploads of the touched rectangles) on a cpu slab
    return StaticBuffers(GraphSpec.model_validate(spec), poison=True, upload_copies=2 if staged else None)


def _persistent(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Persistent host buffers of the small spec, full of valid values everywhere (stale ones included)."""
    return {
        "block_table.a": rng.integers(0, 32, (ROWS, WIDE), dtype=np.int32),
        "block_table.b": rng.integers(0, 32, (ROWS, WIDE), dtype=np.int32),
        "seq_lens": rng.integers(0, 65, ROWS, dtype=np.int32),
        "query_start_loc": np.sort(rng.integers(0, 9, ROWS + 1)).astype(np.int32),
        "slot_mapping": rng.integers(-1, 1000, 2 * ROWS, dtype=np.int64),
        "scratch": rng.random((3,), dtype=np.float32),
    }


def _contents(sb: StaticBuffers) -> dict[str, bytes]:
    """Every buffer's bytes (the slab's alignment gaps hold whatever the allocator left)."""
    return {name: t.numpy().tobytes() for name, t in sb.full.items()}


def _as(kind: str, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    return dict(arrays) if kind == "numpy" else {k: torch.from_numpy(v) for k, v in arrays.items()}


@pytest.fixture
def small(spec_mapping: Callable[[], Mapping]) -> Mapping:
    return spec_mapping()


# ----------------------------------------------------------------------------------------------------------
# Same bytes as a mapping refresh, and as contents built by hand


@pytest.mark.parametrize("staged", [False, True], ids=["host", "staged"])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("with_keep", [False, True], ids=["no-keep", "keep"])
def test_bound_refresh_equals_mapping_refresh_and_hand_built_contents(
    small: Mapping, slab_bytes: Callable[[StaticBuffers], bytes], kind: str, staged: bool, with_keep: bool
) -> None:
    rng = np.random.default_rng(7)
    arrays = _persistent(rng)
    if not with_keep:
        del arrays["scratch"]
    bound_sb, mapped_sb = _buffers(small, staged), _buffers(small, staged)
    bound = bound_sb.bind(_as(kind, arrays))
    cases = 0
    for _ in range(12):  # the persistent memory changes between rounds, as each step rewrites it
        fresh = _persistent(rng)
        for name, a in arrays.items():
            a[...] = fresh[name]
        for size in (2, 4, 8):
            n = int(rng.integers(0, size // 2 + 1))
            widths = {"block_table.a": int(rng.integers(0, 5)), "block_table.b": int(rng.integers(0, 5))}
            assert bound.refresh(size, n, widths=widths) == n
            assert mapped_sb.refresh(size, bound.sources(n, widths)) == n
            assert _contents(bound_sb) == _contents(mapped_sb)
            v = bound_sb.view(size)
            for name in ("block_table.a", "block_table.b"):
                w = widths[name]
                want = np.zeros((size // 2, 4), dtype=np.int32)
                want[:n, :w] = arrays[name][:n, :w]
                np.testing.assert_array_equal(v[name].numpy(), want)
            want_lens = np.zeros(size // 2, dtype=np.int32)
            want_lens[:n] = arrays["seq_lens"][:n]
            np.testing.assert_array_equal(v["seq_lens"].numpy(), want_lens)
            qsl = np.empty(size // 2 + 1, dtype=np.int32)
            qsl[: n + 1] = arrays["query_start_loc"][: n + 1]
            qsl[n + 1 :] = qsl[n]  # repeat_last
            np.testing.assert_array_equal(v["query_start_loc"].numpy(), qsl)
            slots = np.full(size, -1, dtype=np.int64)
            slots[: 2 * n] = arrays["slot_mapping"][: 2 * n]
            np.testing.assert_array_equal(v["slot_mapping"].numpy(), slots)
            scratch = v["scratch"].numpy()
            if with_keep:
                np.testing.assert_array_equal(scratch, arrays["scratch"])
            else:
                assert np.isnan(scratch).all()  # keep buffer not bound: never written
            cases += 1
    assert cases == 36


@pytest.mark.parametrize("staged", [False, True], ids=["host", "staged"])
def test_bound_and_mapping_refreshes_interleave_on_one_buffers(small: Mapping, staged: bool) -> None:
    """Both kinds share the host images (and, staged, their alternation): each result is its own."""
    sb, ref = _buffers(small, staged), _buffers(small)
    rng = np.random.default_rng(13)
    arrays = _persistent(rng)
    bound = sb.bind(arrays)
    for i in range(40):
        size = (2, 4, 8)[i % 3]
        n = int(rng.integers(0, size // 2 + 1))
        widths = {"block_table.a": int(rng.integers(0, 5)), "block_table.b": int(rng.integers(0, 5))}
        fresh = _persistent(rng)
        for name, a in arrays.items():
            a[...] = fresh[name]
        if i % 2:
            bound.refresh(size, n, widths=widths)
        else:
            sb.refresh(size, {k: v.copy() for k, v in bound.sources(n, widths).items()})
        ref.refresh(size, bound.sources(n, widths))
        assert _contents(sb) == _contents(ref), i


def test_bound_default_width_is_the_source_width_and_overflow_truncate_cuts_it(small: Mapping) -> None:
    small["buffers"]["block_table"]["overflow"] = "truncate"
    sb = _buffers(small)
    arrays = _persistent(np.random.default_rng(1))
    bound = sb.bind(arrays)
    bound.refresh(8, 3)  # no widths: all 7 bound columns, cut to the 4 captured ones
    np.testing.assert_array_equal(sb.view(8)["block_table.a"].numpy()[:3], arrays["block_table.a"][:3, :4])


def test_a_smaller_bound_refresh_clears_stale_rows_and_columns(small: Mapping) -> None:
    sb = _buffers(small)
    arrays = _persistent(np.random.default_rng(2))
    arrays["block_table.a"][...] = 5
    bound = sb.bind(arrays)
    bound.refresh(8, 4, widths={"block_table.a": 4, "block_table.b": 4})
    bound.refresh(8, 1, widths={"block_table.a": 2, "block_table.b": 0})
    v = sb.view(8)
    assert v["block_table.a"].tolist() == [[5, 5, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert v["block_table.b"].tolist() == [[0, 0, 0, 0]] * 4
    assert v["seq_lens"].tolist()[1:] == [0, 0, 0]
    assert v["slot_mapping"].tolist()[2:] == [-1] * 6


def test_bound_sources_are_read_at_each_refresh_not_at_bind(small: Mapping) -> None:
    sb = _buffers(small)
    arrays = _persistent(np.random.default_rng(3))
    tensors = _as("torch", arrays)
    bound = sb.bind(tensors)
    bound.refresh(4, 2, widths=W4)
    tensors["seq_lens"][:2] = torch.tensor([41, 42], dtype=torch.int32)  # written in place, as vLLM does
    bound.refresh(4, 2, widths=W4)
    assert sb.view(4)["seq_lens"].tolist() == [41, 42]


def test_request_counts_and_widths_may_be_numpy_integers(small: Mapping) -> None:
    sb = _buffers(small)
    bound = sb.bind(_persistent(np.random.default_rng(12)))
    widths = {"block_table.a": np.int64(2), "block_table.b": np.int32(1)}
    assert bound.refresh(8, np.int64(3), widths=widths) == 3
    assert type(bound.refresh(8, np.int32(2), widths=widths)) is int
    assert bound.sources(np.int64(2), widths)["block_table.a"].shape == (2, 2)
    with pytest.raises(RowsError, match="num_reqs=True"):
        bound.refresh(8, True, widths=widths)


def test_bound_refresh_runs_inside_a_profiler_range(small: Mapping) -> None:
    bound = _buffers(small).bind(_persistent(np.random.default_rng(4)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        bound.refresh(8, 2, widths=W4)
    assert [e.name for e in prof.events()].count("graphbuf.buffers") == 1


def test_bound_sources_of_the_gemma_spec_match_a_mapping_refresh_at_every_size(
    slab_bytes: Callable[[StaticBuffers], bytes],
) -> None:
    a = StaticBuffers("gemma4-31b-it-mtp", overrides={"num_blocks": 4096}, poison=True)
    b = StaticBuffers("gemma4-31b-it-mtp", overrides={"num_blocks": 4096}, poison=True)
    rng = np.random.default_rng(5)
    max_req, tpr = 16, a.plan.tokens_per_request
    persistent = {
        "block_table.full": torch.from_numpy(rng.integers(0, 4096, (max_req, 43), dtype=np.int32)),
        "block_table.sliding": torch.from_numpy(rng.integers(0, 4096, (max_req, 43), dtype=np.int32)),
        "seq_lens": torch.from_numpy(rng.integers(4, 5500, max_req, dtype=np.int32)),
        "query_start_loc": torch.arange(0, (max_req + 1) * tpr, tpr, dtype=torch.int32),
        "slot_mapping.full": torch.from_numpy(rng.integers(-1, 4096 * 128, max_req * tpr)),
        "slot_mapping.sliding": torch.from_numpy(rng.integers(-1, 4096 * 128, max_req * tpr)),
    }
    bound = a.bind(persistent)
    for size in a.capture_sizes:
        for n in {0, size // tpr // 2, size // tpr}:
            widths = {"block_table.full": int(rng.integers(0, 44)), "block_table.sliding": 43}
            bound.refresh(size, n, widths=widths)
            b.refresh(size, bound.sources(n, widths))
            assert _contents(a) == _contents(b), (size, n)


# ----------------------------------------------------------------------------------------------------------
# Rejected binds and refreshes: the error names the place, and no byte changes


def _bind_case(mutate: Callable[[dict[str, Any]], None]) -> Callable[[StaticBuffers], Any]:
    def run(sb: StaticBuffers) -> Any:
        sources: dict[str, Any] = _persistent(np.random.default_rng(0))
        mutate(sources)
        return sb.bind(sources)

    return run


def _set(name: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda s: s.__setitem__(name, value)


BIND_ERRORS = [
    (
        "unknown",
        _set("nope", np.zeros(4, np.int32)),
        RefreshError,
        r"bind\(\): buffer 'nope': unknown buffer",
    ),
    ("per-group name", _set("block_table", np.zeros((6, 4), np.int32)), RefreshError, "declared per group"),
    ("missing", lambda s: s.pop("seq_lens"), RefreshError, r"bind\(\): missing buffer\(s\) seq_lens"),
    ("list", _set("seq_lens", [1] * 6), RefreshError, "bind.*'seq_lens'.*keeps its address"),
    (
        "unsafe dtype",
        _set("seq_lens", np.zeros(6, np.int64)),
        RefreshError,
        "'seq_lens'.*int64 cannot be cast",
    ),
    ("float into int", _set("seq_lens", np.zeros(6, np.float32)), RefreshError, "cannot be cast safely"),
    ("bfloat16 tensor", _set("scratch", torch.zeros(3, dtype=torch.bfloat16)), RefreshError, "no numpy view"),
    (
        "device",
        _set("seq_lens", torch.zeros(6, dtype=torch.int32, device="meta")),
        RefreshError,
        "host memory",
    ),
    ("too few rows", _set("seq_lens", np.zeros(3, np.int32)), RowsError, "'seq_lens'.*3 rows.*up to 4"),
    ("too few tokens", _set("slot_mapping", np.zeros(7, np.int64)), RowsError, "'slot_mapping'.*up to 8"),
    ("wrong ndim", _set("seq_lens", np.zeros((6, 1), np.int32)), RefreshError, "expected 1-D source"),
    (
        "strided",
        _set("block_table.a", np.zeros((6, 8), np.int32)[:, ::2]),
        RefreshError,
        "'block_table.a'.*strided",
    ),
]


@pytest.mark.parametrize(("case", "mutate", "error", "match"), BIND_ERRORS, ids=[c[0] for c in BIND_ERRORS])
def test_bad_bind_is_rejected_with_the_place(
    small: Mapping,
    slab_bytes: Callable[[StaticBuffers], bytes],
    case: str,
    mutate: Callable[[dict[str, Any]], None],
    error: type[Exception],
    match: str,
) -> None:
    sb = _buffers(small)
    before = slab_bytes(sb)
    with pytest.raises(error, match=match):
        _bind_case(mutate)(sb)
    assert slab_bytes(sb) == before


def _bad_values(name: str, index: Any, value: Any) -> Callable[[dict[str, np.ndarray]], None]:
    def mutate(arrays: dict[str, np.ndarray]) -> None:
        arrays[name][index] = value

    return mutate


def _nothing(arrays: dict[str, np.ndarray]) -> None:
    return None


REFRESH_ERRORS: list[tuple[str, Callable[..., None], dict[str, Any], type[Exception], str]] = [
    (
        "not a capture size",
        _nothing,
        {"size": 6, "n": 1},
        RefreshError,
        r"refresh\(size=6\): not a capture size",
    ),
    ("too many requests", _nothing, {"size": 4, "n": 3}, RowsError, r"num_reqs=3.*holds 0\.\.2"),
    ("negative requests", _nothing, {"size": 4, "n": -1}, RowsError, "num_reqs=-1"),
    ("requests not int", _nothing, {"size": 4, "n": 1.0}, RowsError, r"num_reqs=1\.0"),
    ("width of 1-D", _nothing, {"widths": {"seq_lens": 1}}, RefreshError, r"widths\['seq_lens'\].*allowed"),
    ("width unknown", _nothing, {"widths": {"x": 1}}, RefreshError, r"widths\['x'\]: not a bound 2-D"),
    ("width not int", _nothing, {"widths": {"block_table.a": 1.5}}, RefreshError, "1.5 is not an integer"),
    (
        "width negative",
        _nothing,
        {"widths": {"block_table.a": -1}},
        RefreshError,
        "'block_table.a': width -1",
    ),
    (
        "width > source",
        _nothing,
        {"widths": {"block_table.a": 1, "block_table.b": 8}},
        RefreshError,
        r"0\.\.7 col",
    ),
    (
        "width > captured",
        _nothing,
        {"widths": {"block_table.a": 5}},
        WidthError,
        "is 5 wide, above.*4 columns",
    ),
    (
        "default width",
        _nothing,
        {"widths": {"block_table.a": 4}},
        WidthError,
        "'block_table.b': source is 7 wide",
    ),
    ("block id", _bad_values("block_table.b", (1, 2), 32), {}, RefreshError, "'block_table.b'.*32 at index"),
    ("negative len", _bad_values("seq_lens", 0, -3), {}, RefreshError, "'seq_lens': value -3 at index"),
    ("slot below -1", _bad_values("slot_mapping", 3, -2), {}, RefreshError, "'slot_mapping': value -2"),
    ("NaN keep", _bad_values("scratch", 1, np.nan), {}, RefreshError, "'scratch': NaN at index"),
]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize(
    ("case", "mutate", "call", "error", "match"), REFRESH_ERRORS, ids=[c[0] for c in REFRESH_ERRORS]
)
def test_bad_bound_refresh_is_rejected_with_the_place_and_changes_nothing(
    small: Mapping,
    slab_bytes: Callable[[StaticBuffers], bytes],
    kind: str,
    case: str,
    mutate: Callable[[dict[str, np.ndarray]], None],
    call: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    sb = _buffers(small)
    arrays = _persistent(np.random.default_rng(9))
    bound = sb.bind(_as(kind, arrays))
    bound.refresh(8, 4, widths={"block_table.a": 3, "block_table.b": 2})
    before = slab_bytes(sb)
    mutate(arrays)
    widths = call.get("widths", {"block_table.a": 4, "block_table.b": 4})
    with pytest.raises(error, match=match):
        bound.refresh(call.get("size", 8), call.get("n", 3), widths=widths)
    assert slab_bytes(sb) == before


def test_a_bound_tensor_that_moved_is_caught_before_it_is_read(
    small: Mapping, slab_bytes: Callable[[StaticBuffers], bytes]
) -> None:
    sb = _buffers(small)
    tensors = _as("torch", _persistent(np.random.default_rng(10)))
    bound = sb.bind(tensors)
    bound.refresh(8, 2, widths=W4)
    before = slab_bytes(sb)
    tensors["seq_lens"].set_(
        torch.full((6,), 9, dtype=torch.int32)
    )  # rebound: the bound view reads old memory
    for call in (lambda: bound.refresh(8, 2, widths=W4), lambda: bound.sources(2)):
        with pytest.raises(AddressChangedError, match="bound source 'seq_lens' moved"):
            call()
    assert slab_bytes(sb) == before
    sb.bind(tensors).refresh(8, 2, widths=W4)  # bound again: reads the new memory
    assert sb.view(8)["seq_lens"].tolist() == [9, 9, 0, 0]


def test_sources_beyond_the_largest_capture_need_the_rows(small: Mapping) -> None:
    bound = _buffers(small).bind(_persistent(np.random.default_rng(11)))
    assert bound.sources(6)["query_start_loc"].shape == (7,)  # above any capture size, within the binding
    with pytest.raises(RowsError, match=r"sources\(\): buffer 'block_table.a': 7 requests need 7 rows"):
        bound.sources(7)
    assert isinstance(bound, BoundSources) and "seq_lens" in repr(bound)


# ----------------------------------------------------------------------------------------------------------
# GraphRunner with bound sources


def _paged_runner() -> tuple[GraphRunner, dict[str, torch.Tensor]]:
    bufs = graphbuf.StaticBuffers(GraphSpec.model_validate(PAGED_SPEC))

    def fn(step: Step) -> torch.Tensor:
        return step.views["seq_lens"].float() * 2 + step.views["block_table"].sum(1).float()

    runner = GraphRunner(bufs, fn, output_rows="requests")
    runner.capture()
    g = torch.Generator().manual_seed(0)
    persistent = {
        "block_table": torch.randint(0, 16, (12, 8), generator=g, dtype=torch.int32),
        "seq_lens": torch.randint(1, 33, (12,), generator=g, dtype=torch.int32),
    }
    return runner, persistent


def test_runner_replays_bound_sources_and_falls_back_eagerly_with_them() -> None:
    runner, persistent = _paged_runner()
    bound = runner.buffers.bind(persistent)
    for n, w in ((3, 5), (1, 8), (8, 2), (11, 4)):  # 11 requests: above the largest capture size (8)
        out = runner.run(bound, num_reqs=n, widths={"block_table": w})
        want = persistent["seq_lens"][:n].float() * 2 + persistent["block_table"][:n, :w].sum(1).float()
        torch.testing.assert_close(out, want)
        persistent["seq_lens"].add_(1)  # the next step's lengths, written in place
    assert runner.stats.replays == 3
    assert runner.stats.eager_reasons == {EAGER_TOO_LARGE: 1}


def test_runner_rejects_misused_bound_sources() -> None:
    runner, persistent = _paged_runner()
    bound = runner.buffers.bind(persistent)
    with pytest.raises(RefreshError, match="bound sources carry no row counts; pass num_reqs="):
        runner.run(bound)
    with pytest.raises(RefreshError, match="widths= applies to BoundSources"):
        runner.run(
            {"block_table": persistent["block_table"][:2], "seq_lens": persistent["seq_lens"][:2]}, widths={}
        )
    other = graphbuf.StaticBuffers(GraphSpec.model_validate(PAGED_SPEC)).bind(persistent)
    with pytest.raises(RefreshError, match="belong to other StaticBuffers"):
        runner.run(other, num_reqs=2)
