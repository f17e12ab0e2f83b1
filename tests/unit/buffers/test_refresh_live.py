"""Refresh cost follows the live work (issue 9 §1, §2, §6), one refresh and one size error (§4), every
bad source typed (§5), the eager path as strict as the graph path (issue 11 §4), and misuse of
StaticBuffers/BoundSources as an error (issue 11 §5)."""

from __future__ import annotations

import re
import threading
import tracemalloc
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest
import torch

import graphbuf
from graphbuf import (
    AddressChangedError,
    ConcurrentUseError,
    DeviceUnavailableError,
    GraphbufError,
    GraphRunner,
    GraphSpec,
    RefreshError,
    RowsError,
    StaticBuffers,
    UnknownDeviceError,
    UsageError,
    WidthError,
)

Sources = dict[str, Any]


def _spec(spec_mapping: Callable[[], dict[str, Any]], max_model_len: int = 64) -> GraphSpec:
    m = spec_mapping()
    m["constants"]["max_model_len"] = max_model_len
    m["constants"]["max_num_batched_tokens"] = 64  # query_start_loc's max: eager steps of 11 requests fit
    return GraphSpec.model_validate(m)


def _sources(n: int, width: int = 4) -> Sources:
    """Valid sources of the small spec for ``n`` requests (tokens_per_request 2)."""
    return {
        "block_table.a": np.arange(n * width, dtype=np.int32).reshape(n, width) % 32,
        "block_table.b": 31 - np.arange(n * width, dtype=np.int32).reshape(n, width) % 32,
        "seq_lens": np.arange(10, 10 + n, dtype=np.int32),
        "query_start_loc": np.arange(0, 2 * n + 1, 2, dtype=np.int32),
        "slot_mapping": np.arange(2 * n, dtype=np.int64),
    }


def _expected(sb: StaticBuffers, size: int, src: Sources) -> dict[str, np.ndarray]:
    """The contents of ``view(size)`` after refreshing ``src`` into clean buffers, built by hand."""
    out = {}
    for name, view in sb.view(size).items():
        if name not in src:
            continue
        b = sb.plan[name]
        want = np.zeros(tuple(view.shape), dtype=view.numpy().dtype)
        a = np.asarray(src[name])
        n = a.shape[0]
        if b.pad == "repeat_last":
            want[:n] = a
            if n:
                want[n:] = a[n - 1]
        else:
            want[...] = b.pad
            if want.ndim == 2:
                want[:n, : a.shape[1]] = a
            else:
                want[:n] = a
        out[name] = want
    return out


# ----------------------------------------------------------------------------------------------------------
# §1 every invariant holds while only live and dirtied cells are written


@pytest.mark.parametrize("staging", [None, 2, 3], ids=["cpu", "staged2", "staged3"])
def test_random_sequence_of_sizes_rows_and_widths_equals_hand_built_contents(
    spec_mapping: Callable[[], dict[str, Any]], staging: int | None
) -> None:
    sb = StaticBuffers(_spec(spec_mapping), poison=True, upload_copies=staging)
    rng = np.random.default_rng(3)
    for _ in range(60):
        size = int(rng.choice(sb.capture_sizes))
        n = int(rng.integers(0, size // 2 + 1))
        src = _sources(n, int(rng.integers(0, 5)))
        assert sb.refresh(size, src) == n
        for name, want in _expected(sb, size, src).items():
            np.testing.assert_array_equal(sb.view(size)[name].numpy(), want, err_msg=f"{name} at {size}")


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_bound_fast_path_equals_mapping_refresh_in_bytes_and_errors(
    spec_mapping: Callable[[], dict[str, Any]], kind: str
) -> None:
    """Bound sources typed at bind take a fast prepare; it must write what a mapping refresh of the same
    slices writes, and refuse (same message, no byte changed) what it refuses."""
    spec = _spec(spec_mapping)
    bound_sb, mapped_sb = StaticBuffers(spec, poison=True), StaticBuffers(spec, poison=True)
    rng = np.random.default_rng(5)
    arrays = {
        "block_table.a": rng.integers(0, 32, (4, 6), dtype=np.int32),  # wider than the 4 captured columns
        "block_table.b": rng.integers(0, 32, (4, 4), dtype=np.int32),
        "seq_lens": rng.integers(0, 65, 4, dtype=np.int32),
        "query_start_loc": np.arange(0, 10, 2, dtype=np.int32),
        "slot_mapping": np.arange(8, dtype=np.int64),
    }
    if kind == "torch":
        arrays = {k: torch.from_numpy(v) for k, v in arrays.items()}
    bound = bound_sb.bind(arrays)
    for _ in range(40):
        size = int(rng.choice(bound_sb.capture_sizes))
        n = int(rng.integers(0, size // 2 + 1))
        w = {"block_table.a": int(rng.integers(0, 5)), "block_table.b": int(rng.integers(0, 5))}
        assert bound_sb.refresh(size, bound, num_reqs=n, widths=w) == n
        assert mapped_sb.refresh(size, bound.sources(n, w), num_reqs=n) == n
        for name, t in bound_sb.full.items():  # the slab's alignment gaps are never written: compare buffers
            assert t.numpy().tobytes() == mapped_sb.full[name].numpy().tobytes(), (name, size, n, w)
    seq = arrays["seq_lens"]
    seq[1] = 65  # above max_model_len (64), inside the live rows of 2 requests
    w4 = {"block_table.a": 4}
    before = bound_sb.slab.numpy().tobytes()
    with pytest.raises(RefreshError) as fast:
        bound_sb.refresh(4, bound, num_reqs=2, widths=w4)
    with pytest.raises(RefreshError) as mapped:
        mapped_sb.refresh(4, bound.sources(2, w4), num_reqs=2)
    assert str(fast.value) == str(mapped.value) and "seq_lens" in str(fast.value)
    assert bound_sb.slab.numpy().tobytes() == before
    assert bound_sb.refresh(2, bound, num_reqs=1, widths=w4) == 1  # the bad value is past the live row
    seq[1] = 0
    with pytest.raises(WidthError):  # 5 columns of a 4-column allocation: overflow reject, as mapped
        bound_sb.refresh(8, bound, num_reqs=4, widths={"block_table.a": 5})


# ----------------------------------------------------------------------------------------------------------
# §2 byte accounting: O(live), whatever the capacity


def _live_bytes(sb: StaticBuffers, size: int, src: Sources) -> int:
    total = 0
    for name, a in src.items():
        b = sb.plan[name]
        a = np.asarray(a)
        rows = a.shape[0]
        if b.pad == "repeat_last" and rows:
            rows = sb.view(size)[name].shape[0]  # padded rows of this size hold the last live row
        cells = rows * (a.shape[1] if a.ndim == 2 else 1)
        total += cells * sb.full[name].element_size()
    return total


@pytest.mark.parametrize("staging", [None, 2])
def test_stats_count_only_live_and_cleared_bytes_whatever_the_capacity(
    spec_mapping: Callable[[], dict[str, Any]], staging: int | None
) -> None:
    small = StaticBuffers(_spec(spec_mapping, 64), upload_copies=staging)
    huge = StaticBuffers(_spec(spec_mapping, 64 * 4096), upload_copies=staging)  # 16384-column block tables
    assert huge.plan.total_bytes > 100 * small.plan.total_bytes
    for sb in (small, huge):
        assert sb.stats == graphbuf.buffers.RefreshStats(0, 0, 0)
        wide, narrow = _sources(4, 4), _sources(1, 1)
        sb.refresh(8, wide)
        wide_bytes = sb.stats.last_bytes
        assert wide_bytes == _live_bytes(sb, 8, wide)
        sb.refresh(8, narrow)  # clears what the wide one wrote: no more than those cells plus the live ones
        assert _live_bytes(sb, 8, narrow) < sb.stats.last_bytes <= wide_bytes + _live_bytes(sb, 8, narrow)
        for _ in range(3):  # nothing left to clear: live bytes only
            sb.refresh(8, narrow)
            assert sb.stats.last_bytes == _live_bytes(sb, 8, narrow)
        assert sb.stats.refreshes == 5
    assert small.stats == huge.stats  # the same live work costs the same bytes at 0.004 and 1 MiB
    assert huge.stats.total_bytes < huge.plan.total_bytes // 100


def test_a_rejected_refresh_counts_nothing(spec_mapping: Callable[[], dict[str, Any]]) -> None:
    sb = StaticBuffers(_spec(spec_mapping))
    sb.refresh(8, _sources(2))
    before = sb.stats
    with pytest.raises(RefreshError):
        sb.refresh(8, {**_sources(2), "seq_lens": np.array([1, 99], dtype=np.int32)})
    assert sb.stats == before


# ----------------------------------------------------------------------------------------------------------
# §4 one refresh, one size error


def test_a_size_that_is_not_a_capture_size_is_one_typed_error_everywhere(
    spec_mapping: Callable[[], dict[str, Any]],
) -> None:
    sb = StaticBuffers(_spec(spec_mapping))
    bound = sb.bind({k: np.zeros((8, *v.shape[1:]), v.dtype) for k, v in _sources(4).items()})
    calls = {
        "view": lambda: sb.view(6),
        "addresses": lambda: sb.addresses(6),
        "refresh": lambda: sb.refresh(6, _sources(1)),
        "refresh": lambda: sb.refresh(6, bound, num_reqs=1),  # noqa: F601 -- the bound form, same error
        "bound.refresh": lambda: bound.refresh(6, 1),
    }
    for op, call in calls.items():
        with pytest.raises(RefreshError, match=r"\(size=6\): not a capture size; sizes: 2, 4, 8") as info:
            call()
        assert isinstance(info.value, GraphbufError) and not isinstance(info.value, KeyError), op
    for bad in ("8", 8.0, True, None):
        with pytest.raises(RefreshError, match="not a capture size"):
            sb.view(bad)  # type: ignore[arg-type]


def test_refresh_takes_a_mapping_or_bound_sources(spec_mapping: Callable[[], dict[str, Any]]) -> None:
    a, b = StaticBuffers(_spec(spec_mapping)), StaticBuffers(_spec(spec_mapping))
    src = _sources(3, 2)
    bound = b.bind(_sources(4, 2))  # the largest capture's rows; the first rows of 3 requests equal src
    for k, v in src.items():
        assert np.array_equal(bound.sources(3)[k], v)
    assert a.refresh(8, src) == 3
    assert b.refresh(8, bound, num_reqs=3) == 3
    for name in src:
        assert a.full[name].tolist() == b.full[name].tolist(), name
    with pytest.raises(RefreshError, match="bound sources carry no row counts; pass num_reqs="):
        b.refresh(8, bound)
    with pytest.raises(RefreshError, match="belong to other StaticBuffers"):
        a.refresh(8, bound, num_reqs=3)
    with pytest.raises(RefreshError, match="widths= applies to BoundSources"):
        a.refresh(8, src, widths={"block_table.a": 2})


# ----------------------------------------------------------------------------------------------------------
# §5 every bad source: a typed RefreshError, no byte changed


def _with(name: str, value: Any) -> Callable[[Sources], Sources]:
    return lambda s: {**s, name: value}


_0D = "expected 1-D source, got shape \\[\\]"
_I32 = torch.int32

HOSTILE: list[tuple[str, Callable[[Sources], Any], dict[str, Any], str]] = [
    ("None", lambda s: None, {}, "sources must be a mapping"),
    ("list of pairs", lambda s: list(s.items()), {}, "sources must be a mapping"),
    ("sparse", _with("seq_lens", torch.tensor([1, 2], dtype=_I32).to_sparse()), {}, "sparse_coo tensor"),
    (
        "nested",
        _with("seq_lens", torch.nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3])])),
        {},
        "nested tensor",
    ),
    ("conj", _with("scratch", torch.ones(3, dtype=torch.complex64).conj()), {}, "conjugate"),
    ("neg-bit", _with("scratch", torch.ones(3, dtype=torch.complex64).conj().imag), {}, "negative bit"),
    ("0-d tensor", _with("seq_lens", torch.tensor(3, dtype=_I32)), {}, _0D),
    ("0-d array", _with("seq_lens", np.array(3, dtype=np.int32)), {}, _0D),
    ("masked array", _with("seq_lens", np.ma.masked_array([1, 2], mask=[0, 1])), {}, "MaskedArray"),
    ("matrix", _with("block_table.a", np.asmatrix(np.zeros((2, 4), np.int32))), {}, "subclass matrix"),
    ("float string", _with("seq_lens", ["1", "2"]), {}, "list holds"),
    ("ragged", _with("block_table.a", [[1, 2], [3]]), {}, "ragged"),
    ("dict source", _with("seq_lens", {0: 1}), {}, "unsupported source type dict"),
    ("num_reqs float", lambda s: s, {"num_reqs": 2.0}, "num_reqs=2.0 is not an integer"),
    ("num_reqs str", lambda s: s, {"num_reqs": "2"}, "num_reqs='2' is not an integer"),
    ("num_reqs bool", lambda s: s, {"num_reqs": True}, "num_reqs=True is not an integer"),
    ("unknown name", _with(3, [1]), {}, "unknown buffer"),
    ("meta source", _with("seq_lens", torch.empty(2, dtype=_I32, device="meta")), {}, "source is on meta"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "make", "kw", "match"), HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_sources_raise_a_typed_refresh_error_and_change_nothing(
    spec_mapping: Callable[[], dict[str, Any]], case: str, make: Callable, kw: dict, match: str | None
) -> None:
    sb = StaticBuffers(_spec(spec_mapping))
    sb.refresh(8, _sources(2))
    before = sb.slab.numpy().tobytes()
    with pytest.raises(RefreshError, match=match) as info:
        sb.refresh(8, make(_sources(2)), **kw)
    assert type(info.value).__mro__[0] in (RefreshError, RowsError, WidthError)
    assert sb.slab.numpy().tobytes() == before


@pytest.mark.parametrize(
    ("dtype", "values", "bad"),
    [
        ("bfloat16", [1, 2, 257], "257 at index \\[2\\] is not exactly representable in bfloat16"),
        ("float16", [2049, 1, 2], "2049 at index \\[0\\] is not exactly representable in float16"),
        ("float32", [1.0, 1e-50, 0.0], "1e-50 underflows float32"),
        ("float32", [1e39], "1e\\+39 does not fit float32"),
    ],
)
def test_lists_follow_the_safe_cast_rule_of_arrays(
    spec_mapping: Callable[[], dict[str, Any]], dtype: str, values: list, bad: str
) -> None:
    m = spec_mapping()
    m["buffers"]["scratch"] = {"dtype": dtype, "rows": 3, "keep": True, "pad": 0}
    sb = StaticBuffers(GraphSpec.model_validate(m))
    with pytest.raises(RefreshError, match=bad):
        sb.refresh(8, {**_sources(1), "scratch": values})
    # the same values as an int32 / float64 array are rejected too (no safe cast)
    arr = np.array(values, dtype=np.int32 if isinstance(values[0], int) else np.float64)
    with pytest.raises(RefreshError, match="cannot be cast safely"):
        sb.refresh(8, {**_sources(1), "scratch": arr})
    sb.refresh(8, {**_sources(1), "scratch": [1, 2, 3]})  # exact values pass
    assert sb.full["scratch"].tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("bad", [2.0, "2", True, None, [2]])
def test_num_reqs_and_widths_of_the_wrong_type_are_refused_on_the_bound_path(
    spec_mapping: Callable[[], dict[str, Any]], bad: Any
) -> None:
    sb = StaticBuffers(_spec(spec_mapping))
    bound = sb.bind({k: np.zeros((8, *v.shape[1:]), v.dtype) for k, v in _sources(4).items()})
    if bad is not None:
        with pytest.raises(RowsError, match="is not an integer"):
            sb.refresh(8, bound, num_reqs=bad)
    with pytest.raises(RefreshError, match=r"widths\['block_table.a'\]: .* is not an integer"):
        sb.refresh(8, bound, num_reqs=2, widths={"block_table.a": bad if bad is not None else False})


def test_a_bound_tensor_is_watched_on_address_shape_and_stride(
    spec_mapping: Callable[[], dict[str, Any]],
) -> None:
    sb = StaticBuffers(_spec(spec_mapping))
    src = {k: torch.zeros((8, *v.shape[1:]), dtype=torch.from_numpy(v).dtype) for k, v in _sources(4).items()}
    seq = torch.zeros(16, dtype=torch.int32)
    src["seq_lens"] = seq[:8]
    bound = sb.bind(src)
    sb.refresh(8, bound, num_reqs=2)
    before = sb.slab.numpy().tobytes()
    src["block_table.a"].resize_(4, 4)  # in place: same address, new shape
    with pytest.raises(
        AddressChangedError, match=r"'block_table.a' moved.*shape \[8, 4\].*now .* shape \[4, 4\]"
    ):
        sb.refresh(8, bound, num_reqs=2)
    assert sb.slab.numpy().tobytes() == before
    bound = sb.bind({**src, "block_table.a": torch.zeros(8, 4, dtype=torch.int32)})
    src["seq_lens"].set_(seq.untyped_storage(), 0, (8,), (2,))  # same address, new stride
    with pytest.raises(AddressChangedError, match="'seq_lens' moved"):
        sb.refresh(8, bound, num_reqs=2)
    assert sb.slab.numpy().tobytes() == before


# ----------------------------------------------------------------------------------------------------------
# §6 bounded memory


def test_memory_does_not_grow_with_refreshes_or_row_width_pairs(
    spec_mapping: Callable[[], dict[str, Any]],
) -> None:
    sb = StaticBuffers(_spec(spec_mapping, 1024))
    arrays = {k: np.zeros((8, 64) if v.ndim == 2 else (9,), v.dtype) for k, v in _sources(4).items()}
    arrays["block_table.a"] = arrays["block_table.b"] = np.zeros((8, 64), np.int32)
    bound = sb.bind(arrays)
    pairs = [(size, n, w) for size in sb.capture_sizes for n in range(size // 2 + 1) for w in range(64)]
    for size, n, w in pairs:  # warm every path once
        sb.refresh(size, bound, num_reqs=n, widths={"block_table.a": w, "block_table.b": w})
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for _ in range(3):
        for size, n, w in pairs:
            sb.refresh(size, bound, num_reqs=n, widths={"block_table.a": w, "block_table.b": w})
            sb.refresh(
                size, {k: v for k, v in bound.sources(n, {"block_table.a": w, "block_table.b": w}).items()}
            )
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert grown < 16 * 1024, grown
    assert sb.stats.refreshes == 7 * len(pairs)


# ----------------------------------------------------------------------------------------------------------
# issue 11 §4: the eager path is as strict as the graph path


def _sources_any(n: int) -> Sources:
    return {k: v for k, v in _sources(n).items()}


EAGER_BAD: list[tuple[str, Callable[[Sources, int], Sources], bool]] = [
    ("block id -5", lambda s, n: {**s, "block_table.a": _set(s["block_table.a"], (0, 1), -5)}, False),
    ("seq_len above max", lambda s, n: {**s, "seq_lens": _set(s["seq_lens"], 1, 65)}, False),
    ("NaN into int32", lambda s, n: {**s, "seq_lens": torch.full((n,), float("nan"))}, False),
    ("NaN list into int32", lambda s, n: {**s, "seq_lens": [float("nan")] * n}, False),
    ("int64 2**32+3", lambda s, n: {**s, "seq_lens": [2**32 + 3] * n}, True),
    ("int64 array", lambda s, n: {**s, "seq_lens": np.full(n, 2**32 + 3, np.int64)}, False),
    ("1.7 into int", lambda s, n: {**s, "seq_lens": [1.7] + [1] * (n - 1)}, False),
    ("1-row block table", lambda s, n: {**s, "block_table.a": s["block_table.a"][:1]}, True),
    ("too wide", lambda s, n: {**s, "block_table.b": np.zeros((n, 5), np.int32)}, False),
    ("too many rows", lambda s, n: {**s, "seq_lens": np.ones(n + 1, np.int32)}, True),
    ("slot below -1", lambda s, n: {**s, "slot_mapping": _set(s["slot_mapping"], 0, -2)}, False),
    ("missing buffer", lambda s, n: {k: v for k, v in s.items() if k != "seq_lens"}, False),
    ("unknown buffer", lambda s, n: {**s, "seq_len": s["seq_lens"]}, False),
    ("bf16 tensor into int", lambda s, n: {**s, "seq_lens": torch.ones(n, dtype=torch.bfloat16)}, False),
    ("sparse", lambda s, n: {**s, "seq_lens": torch.ones(n, dtype=torch.int32).to_sparse()}, False),
    ("masked", lambda s, n: {**s, "seq_lens": np.ma.masked_array(np.ones(n, np.int32))}, False),
]


def _set(a: np.ndarray, at: Any, value: Any) -> np.ndarray:
    a = a.copy()
    a[at] = value
    return a


def _outcome(call: Callable[[], Any]) -> tuple[type, str]:
    try:
        call()
    except Exception as exc:
        return type(exc), str(exc)
    return type(None), ""


def _norm(msg: str, size_dependent: bool) -> str:
    msg = re.sub(r"^(refresh|eager)\(size=\d+\)", "<call>", msg)
    if size_dependent:  # counts that follow the batch (rows, requests, capacity) differ by construction
        msg = re.sub(r"\d+", "#", msg.replace("an eager step of", "capture size"))
    return msg


@pytest.mark.parametrize(("case", "mutate", "size_dependent"), EAGER_BAD, ids=[c[0] for c in EAGER_BAD])
def test_eager_steps_reject_what_a_refresh_rejects_with_the_same_error(
    spec_mapping: Callable[[], dict[str, Any]], case: str, mutate: Callable, size_dependent: bool
) -> None:
    sb = StaticBuffers(_spec(spec_mapping))
    runner = GraphRunner(sb, lambda step: step.views["seq_lens"] + 0, output_rows="requests")
    sb.refresh(8, _sources(4))
    runner.capture()
    before = sb.slab.numpy().tobytes()
    got = {}
    for n in (4, 11):  # 4: replayed at the captured size 8; 11: above the largest capture size, eager
        got[n] = _outcome(lambda n=n: runner.run(mutate(_sources(n), n), num_reqs=n))
        assert sb.slab.numpy().tobytes() == before, (case, n)
    (t4, m4), (t11, m11) = got[4], got[11]
    assert issubclass(t4, RefreshError), (case, m4)
    assert t4 is t11, (case, m4, m11)
    assert m4.startswith("refresh(size=8)") and m11.startswith("eager(size=22)"), (m4, m11)
    assert _norm(m4, size_dependent) == _norm(m11, size_dependent), (m4, m11)
    assert runner.stats.eager == 0 and runner.stats.replays == 0


def test_eager_inputs_are_padded_as_a_refresh_pads_and_leave_the_slab_alone(
    spec_mapping: Callable[[], dict[str, Any]],
) -> None:
    sb = StaticBuffers(_spec(spec_mapping))
    sb.refresh(8, _sources(4))
    before = sb.slab.numpy().tobytes()
    src = _sources(11, 3)
    views = sb.eager_inputs(22, src, num_reqs=11)
    assert sb.slab.numpy().tobytes() == before
    assert views["block_table.a"].shape == (11, 4)
    assert views["block_table.a"][:, :3].tolist() == src["block_table.a"].tolist()
    assert (views["block_table.a"][:, 3] == 0).all()
    assert views["query_start_loc"].tolist() == src["query_start_loc"].tolist()
    assert views["scratch"].data_ptr() == sb.view(8)["scratch"].data_ptr()  # keep: the captured buffer
    seen = []
    runner = GraphRunner(sb, lambda step: seen.append(dict(step.views)) or step.views["seq_lens"] + 0,
                         output_rows="requests")  # fmt: skip
    runner.capture()
    bound = sb.bind({k: np.pad(v, [(0, 2)] + [(0, 0)] * (v.ndim - 1)) for k, v in _sources(11, 4).items()})
    out = runner.run(bound, num_reqs=11, widths={"block_table.a": 2, "block_table.b": 4})
    assert out.tolist() == list(range(10, 21)) and runner.stats.eager == 1
    assert (seen[-1]["block_table.a"][:, 2:] == 0).all()
    with pytest.raises(RefreshError, match=r"^eager\(size=22\): buffer 'seq_lens': value 99 at index \[3\]"):
        bound.sources(11)["seq_lens"][3] = 99
        runner.run(bound, num_reqs=11)


# ----------------------------------------------------------------------------------------------------------
# issue 11 §5: misuse of StaticBuffers and BoundSources is an error


class _Blocking(dict):
    """A sources mapping whose items() waits until released: holds a refresh open in one thread."""

    def __init__(self, src: Sources, entered: threading.Event, release: threading.Event) -> None:
        super().__init__(src)
        self.entered, self.release = entered, release

    def items(self) -> Any:
        self.entered.set()
        assert self.release.wait(10)
        return super().items()


@pytest.mark.parametrize("second", ["refresh", "bound", "eager_inputs", "bind"])
def test_concurrent_use_from_two_threads_raises_concurrent_use_error(
    spec_mapping: Callable[[], dict[str, Any]], second: str
) -> None:
    sb = StaticBuffers(_spec(spec_mapping))
    arrays = {k: np.zeros((8, *v.shape[1:]), v.dtype) for k, v in _sources(4).items()}
    bound = sb.bind(arrays)
    entered, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def first() -> None:
        try:
            sb.refresh(8, _Blocking(_sources(2), entered, release))
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=first)
    t.start()
    assert entered.wait(10)
    calls: dict[str, Callable[[], Any]] = {
        "refresh": lambda: sb.refresh(8, _sources(1)),
        "bound": lambda: bound.refresh(8, 1),
        "eager_inputs": lambda: sb.eager_inputs(22, _sources(11)),
        "bind": lambda: sb.bind(arrays),
    }
    try:
        with pytest.raises(ConcurrentUseError, match="another thread is using these StaticBuffers"):
            calls[second]()
    finally:
        release.set()
        t.join()
    assert not errors
    assert sb.stats.refreshes == 1
    calls[second]()  # one at a time is fine


@pytest.mark.parametrize(
    ("device", "error"),
    [
        ("tpu", UnknownDeviceError),
        ("cuda:x", UnknownDeviceError),
        ("meta", UnknownDeviceError),
        (3.5, UnknownDeviceError),
    ],
)
def test_unknown_device_names_are_a_typed_error(
    spec_mapping: Callable[[], dict[str, Any]], device: Any, error: type
) -> None:
    with pytest.raises(error, match="StaticBuffers\\(device="):
        StaticBuffers(_spec(spec_mapping), device)


@pytest.mark.parametrize("device", ["cuda", "cuda:7", "npu", "npu:0"])
def test_a_device_this_machine_lacks_is_device_unavailable(
    spec_mapping: Callable[[], dict[str, Any]], device: str
) -> None:
    kind = device.split(":")[0]
    mod = getattr(torch, kind, None)
    if (
        kind == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.device_count() > int(device.partition(":")[2] or 0)
    ):
        pytest.skip("this machine has that device")
    if kind == "npu" and mod is not None and mod.is_available():
        pytest.skip("this machine has an NPU")
    with pytest.raises(DeviceUnavailableError, match=f"StaticBuffers\\(device='{device}'\\)"):
        StaticBuffers(_spec(spec_mapping), device)


def test_staging_depth_is_checked(spec_mapping: Callable[[], dict[str, Any]]) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="upload_copies="):
            StaticBuffers(_spec(spec_mapping), upload_copies=bad)
    assert StaticBuffers(_spec(spec_mapping)).upload_copies is None


def test_staging_is_the_former_name_of_upload_copies(spec_mapping: Callable[[], dict[str, Any]]) -> None:
    """``staging=`` (upload copies, not the staged writes of ``stage()``) still works, with a warning."""
    with pytest.warns(DeprecationWarning, match="upload_copies="):
        sb = StaticBuffers(_spec(spec_mapping), staging=3)
    assert sb.upload_copies == 3
    with pytest.warns(DeprecationWarning, match="upload_copies"):
        assert sb.staging == 3
    with pytest.raises(UsageError, match=r"StaticBuffers\(staging=0\): allowed: an integer >= 1"):
        StaticBuffers(_spec(spec_mapping), staging=0)
    with pytest.raises(UsageError, match="pass upload_copies= only"):
        StaticBuffers(_spec(spec_mapping), upload_copies=2, staging=2)


def _unused(_: Mapping) -> None:  # keep Mapping imported for annotations above
    return None
