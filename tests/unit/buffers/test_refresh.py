"""StaticBuffers.refresh: live rows, padding, repeat_last, keep, truncate, casts; every rejected source is a
RefreshError naming the buffer, the size and the limit, and changes no byte of the slab."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from graphbuf import GraphSpec, RefreshError, RowsError, StaticBuffers, WidthError
from graphbuf.buffers import native

Mapping = dict[str, Any]
Sources = dict[str, Any]


@pytest.fixture
def sb(spec_mapping: Callable[[], Mapping]) -> StaticBuffers:
    return StaticBuffers(GraphSpec.model_validate(spec_mapping()), poison=True)


def _arrays(n: int, width: int = 4) -> dict[str, np.ndarray]:
    """Valid sources for ``n`` live requests of the small spec (tokens_per_request 2), as numpy arrays."""
    return {
        "block_table.a": (np.arange(n * width, dtype=np.int32).reshape(n, width) % 32),
        "block_table.b": (31 - np.arange(n * width, dtype=np.int32).reshape(n, width) % 32),
        "seq_lens": np.arange(10, 10 + n, dtype=np.int32),
        "query_start_loc": np.arange(0, 2 * n + 1, 2, dtype=np.int32),
        "slot_mapping": np.arange(100, 100 + 2 * n, dtype=np.int64),
    }


def _as(kind: str, arrays: dict[str, np.ndarray]) -> Sources:
    if kind == "numpy":
        return dict(arrays)
    if kind == "torch":
        return {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}
    return {k: v.tolist() for k, v in arrays.items()}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


# ----------------------------------------------------------------------------------------------------------
# Valid refreshes


def test_refresh_writes_live_rows_and_pads_the_rest(sb: StaticBuffers) -> None:
    live = sb.refresh(
        8,
        {
            "block_table.a": [[1, 2], [3, 4], [5, 6]],
            "block_table.b": [[7], [8], [9]],
            "seq_lens": [11, 12, 13],
            "query_start_loc": [0, 2, 4, 6],
            "slot_mapping": [20, 21, 22, 23, 24, 25],
        },
    )
    assert live == 3
    v = sb.view(8)
    assert v["block_table.a"].tolist() == [[1, 2, 0, 0], [3, 4, 0, 0], [5, 6, 0, 0], [0, 0, 0, 0]]
    assert v["block_table.b"].tolist() == [[7, 0, 0, 0], [8, 0, 0, 0], [9, 0, 0, 0], [0, 0, 0, 0]]
    assert v["seq_lens"].tolist() == [11, 12, 13, 0]
    assert v["query_start_loc"].tolist() == [0, 2, 4, 6, 6]
    assert v["slot_mapping"].tolist() == [20, 21, 22, 23, 24, 25, -1, -1]
    assert np.isnan(v["scratch"].numpy()).all()  # keep buffer omitted: still poisoned


@pytest.mark.parametrize("kind", ["list", "numpy", "torch"])
@pytest.mark.parametrize(
    ("size", "n", "width"), [(2, 0, 0), (2, 1, 4), (4, 1, 2), (4, 2, 0), (8, 3, 3), (8, 4, 4), (8, 0, 4)]
)
def test_live_region_equals_source_and_the_rest_equals_pad(
    sb: StaticBuffers, kind: str, size: int, n: int, width: int
) -> None:
    arrays = _arrays(n, width)
    assert sb.refresh(size, _as(kind, arrays)) == n
    v = sb.view(size)
    cap = size // 2
    for name in ("block_table.a", "block_table.b"):
        got = v[name].numpy()
        assert got.shape == (cap, 4)
        np.testing.assert_array_equal(got[:n, :width], arrays[name])
        assert (got[:n, width:] == 0).all() and (got[n:] == 0).all()
    np.testing.assert_array_equal(v["seq_lens"].numpy()[:n], arrays["seq_lens"])
    assert (v["seq_lens"].numpy()[n:] == 0).all()
    qsl = v["query_start_loc"].numpy()
    np.testing.assert_array_equal(qsl[: n + 1], arrays["query_start_loc"])
    assert (qsl[n + 1 :] == 2 * n).all()  # repeat_last: padded requests get empty queries
    sm = v["slot_mapping"].numpy()
    np.testing.assert_array_equal(sm[: 2 * n], arrays["slot_mapping"])
    assert (sm[2 * n :] == -1).all()


def test_a_smaller_refresh_clears_stale_rows_and_columns(sb: StaticBuffers) -> None:
    sb.refresh(8, _as("list", _arrays(4, 4)))
    sb.refresh(8, _as("list", _arrays(1, 2)))
    v = sb.view(8)
    assert v["block_table.a"].tolist() == [[0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert v["seq_lens"].tolist() == [10, 0, 0, 0]
    assert v["query_start_loc"].tolist() == [0, 2, 2, 2, 2]
    assert v["slot_mapping"].tolist() == [100, 101, -1, -1, -1, -1, -1, -1]


def test_refresh_runs_inside_a_profiler_range(sb: StaticBuffers) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sb.refresh(8, _arrays(3))
    assert [e.name for e in prof.events()].count("graphbuf.buffers") == 1
    sb.refresh(8, _arrays(2))  # outside a profiler: no range, same result
    np.testing.assert_array_equal(sb.view(8)["seq_lens"].numpy()[:3], [10, 11, 0])


def test_num_reqs_may_be_given_and_must_agree(sb: StaticBuffers) -> None:
    assert sb.refresh(4, _as("numpy", _arrays(2)), num_reqs=2) == 2
    assert sb.refresh(4, _as("numpy", _arrays(0)), num_reqs=0) == 0


def test_keep_buffer_may_be_omitted_and_keeps_its_contents(sb: StaticBuffers) -> None:
    sb.refresh(4, {**_as("list", _arrays(1)), "scratch": [1.5, 2.5]})
    assert sb.view(4)["scratch"].tolist() == [1.5, 2.5, 0.5]
    sb.refresh(8, _as("list", _arrays(3)))
    assert sb.view(8)["scratch"].tolist() == [1.5, 2.5, 0.5]
    sb.refresh(2, {**_as("list", _arrays(1)), "scratch": np.array([7.0], dtype=np.float32)})
    assert sb.view(2)["scratch"].tolist() == [7.0, 0.5, 0.5]


def test_overflow_truncate_keeps_the_first_columns(spec_mapping: Callable[[], Mapping]) -> None:
    d = spec_mapping()
    d["buffers"]["block_table"]["overflow"] = "truncate"
    buffers = StaticBuffers(GraphSpec.model_validate(d))
    wide = np.arange(12, dtype=np.int32).reshape(2, 6)
    sources = {**_as("numpy", _arrays(2)), "block_table.a": wide, "block_table.b": torch.from_numpy(wide)}
    assert buffers.refresh(4, sources) == 2
    assert buffers.view(4)["block_table.a"].tolist() == [[0, 1, 2, 3], [6, 7, 8, 9]]
    assert buffers.view(4)["block_table.b"].tolist() == [[0, 1, 2, 3], [6, 7, 8, 9]]


def test_width_limit_is_the_captured_columns_at_that_size(
    spec_mapping: Callable[[], Mapping], slab_bytes: Callable[[StaticBuffers], bytes]
) -> None:
    d = spec_mapping()
    d["buffers"]["block_table"]["cols"] = "min(max_blocks, requests + 1)"
    buffers = StaticBuffers(GraphSpec.model_validate(d))
    assert buffers.view(2)["block_table.a"].shape == (1, 2)
    ok = {**_as("numpy", _arrays(1, 2))}
    assert buffers.refresh(2, ok) == 1
    assert buffers.view(2)["block_table.a"].tolist() == [[0, 1]]
    before = slab_bytes(buffers)
    with pytest.raises(
        WidthError,
        match=r"refresh\(size=2\): buffer 'block_table.a': source is 3 wide, above the "
        r"captured allocation of 2 columns \(cols = min\(max_blocks, requests",
    ):
        buffers.refresh(2, _as("numpy", _arrays(1, 3)))
    assert slab_bytes(buffers) == before


@pytest.mark.parametrize(
    ("name", "source"),
    [
        ("block_table.a", torch.tensor([[1, 2]], dtype=torch.int16)),
        ("block_table.a", np.array([[1, 2]], dtype=np.uint8)),
        ("block_table.a", [[True, False]]),
        ("seq_lens", torch.tensor([5], dtype=torch.int8)),
        ("seq_lens", (5,)),
        ("slot_mapping", torch.tensor([3, 4], dtype=torch.int32)),
        ("slot_mapping", np.array([3, 4], dtype=np.uint32)),
    ],
)
def test_safe_casts_are_accepted(sb: StaticBuffers, name: str, source: Any) -> None:
    sources = {**_as("list", _arrays(1)), name: source}
    assert sb.refresh(2, sources) == 1
    got = sb.view(2)[name].numpy()
    expected = np.asarray(source.numpy() if isinstance(source, torch.Tensor) else source)
    np.testing.assert_array_equal(got[tuple(slice(0, k) for k in expected.shape)], expected)


def test_sources_with_strided_rows_but_contiguous_elements_are_accepted(sb: StaticBuffers) -> None:
    wide = np.arange(40, dtype=np.int32).reshape(4, 10) % 32
    sources = {
        **_as("list", _arrays(4)),
        "block_table.a": wide[:, :3],
        "block_table.b": torch.from_numpy(wide)[::1, 2:5],
    }
    assert sb.refresh(8, sources) == 4
    np.testing.assert_array_equal(sb.view(8)["block_table.a"].numpy()[:, :3], wide[:, :3])
    np.testing.assert_array_equal(sb.view(8)["block_table.b"].numpy()[:, :3], wide[:, 2:5])


def test_host_bounds_are_checked_with_strict_on_or_off(
    spec_mapping: Callable[[], Mapping], slab_bytes: Callable[[StaticBuffers], bytes]
) -> None:
    for strict in (False, True):
        buffers = StaticBuffers(GraphSpec.model_validate(spec_mapping()), strict=strict)
        before = slab_bytes(buffers)
        bad = {**_as("torch", _arrays(2)), "seq_lens": torch.tensor([1, 65], dtype=torch.int32)}
        for per_call in (None, False, True):
            with pytest.raises(RefreshError, match="above max 64"):
                buffers.refresh(4, bad, strict=per_call)
        assert slab_bytes(buffers) == before


def test_refresh_needs_a_source_or_num_reqs_for_the_live_count(
    spec_mapping: Callable[[], Mapping],
) -> None:
    d = spec_mapping()
    d["buffers"] = {"fixed": {"dtype": "int32", "rows": 3, "pad": 9}}
    buffers = StaticBuffers(GraphSpec.model_validate(d))
    with pytest.raises(RefreshError, match=r"no source determines the live request count; pass num_reqs="):
        buffers.refresh(4, {"fixed": [1]})
    assert buffers.refresh(4, {"fixed": [1]}, num_reqs=2) == 2
    assert buffers.view(4)["fixed"].tolist() == [1, 9, 9]


# ----------------------------------------------------------------------------------------------------------
# Rejected refreshes: error type, message, and not a byte changed.


def _replace(name: str, value: Any) -> Callable[[Sources], Sources]:
    """Sources with ``name`` replaced by ``value`` and moved last (so valid sources come before it)."""

    def apply(sources: Sources) -> Sources:
        out = {k: v for k, v in sources.items() if k != name}
        out[name] = value
        return out

    return apply


def _drop(name: str) -> Callable[[Sources], Sources]:
    return lambda sources: {k: v for k, v in sources.items() if k != name}


_T = torch.zeros(4, 2, dtype=torch.int32)
_N = np.zeros((4, 2), dtype=np.int32)

# (id, change to the valid 2-request sources at size 4, error class, message fragments)
BAD_REFRESHES: list[tuple[str, Callable[[Sources], Sources], type[RefreshError], list[str]]] = [
    (
        "unknown-name",
        _replace("bogus", [1]),
        RefreshError,
        ["buffer 'bogus': unknown buffer; known: block_table.a, block_table.b, seq_lens"],
    ),
    (
        "per-group-base-name",
        _replace("block_table", [[1], [2]]),
        RefreshError,
        [
            "buffer 'block_table': is declared per group; pass each group's buffer: "
            "block_table.a, block_table.b"
        ],
    ),
    (
        "missing",
        _drop("seq_lens"),
        RefreshError,
        ["missing buffer(s) seq_lens; only buffers declared 'keep: true' may be omitted"],
    ),
    ("missing-group-member", _drop("block_table.b"), RefreshError, ["missing buffer(s) block_table.b"]),
    (
        "int64-tensor-to-int32",
        _replace("seq_lens", torch.tensor([1, 2])),
        RefreshError,
        ["buffer 'seq_lens': dtype int64 cannot be cast safely to int32"],
    ),
    (
        "int64-array-to-int32",
        _replace("seq_lens", np.array([1, 2], dtype=np.int64)),
        RefreshError,
        ["buffer 'seq_lens': dtype int64 cannot be cast safely to int32"],
    ),
    (
        "uint32-array-to-int32",
        _replace("seq_lens", np.array([1, 2], dtype=np.uint32)),
        RefreshError,
        ["dtype uint32 cannot be cast safely to int32"],
    ),
    (
        "float-tensor-to-int",
        _replace("block_table.a", torch.zeros(2, 2)),
        RefreshError,
        ["buffer 'block_table.a': dtype float32 cannot be cast safely to int32"],
    ),
    (
        "float-list-to-int",
        _replace("seq_lens", [1.0, 2.0]),
        RefreshError,
        ["buffer 'seq_lens': list holds floats; int32 takes integers"],
    ),
    (
        "list-out-of-int32",
        _replace("seq_lens", [0, 2**31]),
        RefreshError,
        ["buffer 'seq_lens': values 0..2147483648 do not fit int32 (-2147483648..2147483647)"],
    ),
    (
        "list-out-of-int64",
        _replace("slot_mapping", [2**63] * 4),
        RefreshError,
        ["buffer 'slot_mapping': values 9223372036854775808..9223372036854775808 do not fit int64"],
    ),
    (
        "list-beyond-any-int",
        _replace("slot_mapping", [0, 1, 2, 2**70]),
        RefreshError,
        ["buffer 'slot_mapping': values 0..1180591620717411303424 do not fit int64"],
    ),
    (
        "list-of-strings",
        _replace("seq_lens", ["1", "2"]),
        RefreshError,
        ["buffer 'seq_lens': list holds <U1"],
    ),
    (
        "ragged-list",
        _replace("block_table.a", [[1, 2], [3]]),
        RefreshError,
        ["buffer 'block_table.a': ragged or non-numeric list"],
    ),
    (
        "1d-for-2d",
        _replace("block_table.a", [1, 2]),
        RefreshError,
        ["buffer 'block_table.a': expected 2-D source, got shape [2]"],
    ),
    (
        "2d-for-1d",
        _replace("seq_lens", [[1], [2]]),
        RefreshError,
        ["buffer 'seq_lens': expected 1-D source, got shape [2, 1]"],
    ),
    (
        "0d-tensor",
        _replace("seq_lens", torch.tensor(3, dtype=torch.int32)),
        RefreshError,
        ["buffer 'seq_lens': expected 1-D source, got shape []"],
    ),
    (
        "too-many-rows",
        _replace("seq_lens", [1, 2, 3]),
        RowsError,
        ["buffer 'seq_lens': 3 live rows, but capture size 4 holds 2 (rows = requests)"],
    ),
    (
        "too-many-rows-2d",
        _replace("block_table.b", np.zeros((3, 1), dtype=np.int32)),
        RowsError,
        ["buffer 'block_table.b': 3 live rows, but capture size 4 holds 2"],
    ),
    (
        "too-many-tokens",
        _replace("slot_mapping", torch.zeros(6, dtype=torch.int64)),
        RowsError,
        ["buffer 'slot_mapping': 6 live rows, but capture size 4 holds 4 (rows = tokens)"],
    ),
    (
        "too-wide",
        _replace("block_table.a", np.zeros((2, 5), dtype=np.int32)),
        WidthError,
        [
            "buffer 'block_table.a': source is 5 wide, above the captured allocation of 4 columns "
            "(cols = max_blocks); "
            "overflow: reject"
        ],
    ),
    (
        "below-min",
        _replace("seq_lens", [3, -1]),
        RefreshError,
        ["buffer 'seq_lens': value -1 at index [1] is below min 0 (min: 0)"],
    ),
    (
        "above-max-expr",
        _replace("block_table.b", [[0, 1], [2, 32]]),
        RefreshError,
        ["buffer 'block_table.b': value 32 at index [1, 1] is above max 31 (max: num_blocks - 1)"],
    ),
    (
        "above-max-array",
        _replace("seq_lens", np.array([65, 1], dtype=np.int32)),
        RefreshError,
        ["buffer 'seq_lens': value 65 at index [0] is above max 64 (max: max_model_len)"],
    ),
    (
        "above-max-tensor",
        _replace("query_start_loc", torch.tensor([0, 2, 9], dtype=torch.int32)),
        RefreshError,
        ["buffer 'query_start_loc': value 9 at index [2] is above max 8 (max: max_num_batched_tokens)"],
    ),
    (
        "below-min-int64",
        _replace("slot_mapping", [0, -2, 1, 2]),
        RefreshError,
        ["buffer 'slot_mapping': value -2 at index [1] is below min -1"],
    ),
    (
        "nan-list",
        _replace("scratch", [1.0, float("nan")]),
        RefreshError,
        ["buffer 'scratch': NaN at index [1]"],
    ),
    (
        "nan-tensor",
        _replace("scratch", torch.tensor([float("nan")])),
        RefreshError,
        ["buffer 'scratch': NaN at index [0]"],
    ),
    (
        "nan-bf16-tensor",
        _replace("scratch", torch.tensor([0.0, float("nan")], dtype=torch.bfloat16)),
        RefreshError,
        ["buffer 'scratch': NaN at index [1]"],
    ),
    (
        "nan-float16-array",
        _replace("scratch", np.array([np.nan], dtype=np.float16)),
        RefreshError,
        ["buffer 'scratch': NaN at index [0]"],
    ),
    (
        "transposed-tensor",
        _replace("block_table.a", _T.t()),
        RefreshError,
        ["buffer 'block_table.a': source elements are strided", "transposed"],
    ),
    (
        "transposed-array",
        _replace("block_table.a", _N.T),
        RefreshError,
        ["buffer 'block_table.a': source elements are strided"],
    ),
    (
        "strided-1d",
        _replace("seq_lens", torch.arange(4, dtype=torch.int32)[::2]),
        RefreshError,
        ["buffer 'seq_lens': source elements are strided"],
    ),
    (
        "meta-tensor",
        _replace("seq_lens", torch.zeros(2, dtype=torch.int32, device="meta")),
        RefreshError,
        ["buffer 'seq_lens': source is on meta; allowed: host memory or cpu"],
    ),
    (
        "string-source",
        _replace("seq_lens", "12"),
        RefreshError,
        ["buffer 'seq_lens': unsupported source type str; allowed: torch.Tensor, numpy.ndarray, list"],
    ),
    ("int-source", _replace("seq_lens", 2), RefreshError, ["buffer 'seq_lens': unsupported source type int"]),
    ("none-source", _replace("seq_lens", None), RefreshError, ["unsupported source type NoneType"]),
    (
        "disagreeing-rows",
        _replace("seq_lens", [1]),
        RefreshError,
        ["buffer 'seq_lens': 1 rows, but block_table.a implies 2 live requests, so 2 rows (rows = requests)"],
    ),
    (
        "disagreeing-requests-plus-one",
        _replace("query_start_loc", [0, 2]),
        RefreshError,
        ["buffer 'query_start_loc': 2 rows, but block_table.a implies 2 live requests, so 3 rows"],
    ),
    (
        "disagreeing-tokens",
        _replace("slot_mapping", [0, 1, 2]),
        RefreshError,
        [
            "buffer 'slot_mapping': 3 rows, but block_table.a implies 2 live requests, so 4 rows "
            "(rows = tokens)"
        ],
    ),
]


def _baseline(sb: StaticBuffers) -> Sources:
    """Fill the slab with a valid refresh at size 4 (keep buffer included) and return those sources."""
    sources = {**_as("list", _arrays(2, 3)), "scratch": [0.25, 0.75]}
    assert sb.refresh(4, sources) == 2
    return sources


@pytest.mark.parametrize(
    ("change", "error", "fragments"), [c[1:] for c in BAD_REFRESHES], ids=[c[0] for c in BAD_REFRESHES]
)
def test_rejected_refresh_names_buffer_size_limit_and_changes_no_byte(
    sb: StaticBuffers,
    slab_bytes: Callable[[StaticBuffers], bytes],
    change: Callable[[Sources], Sources],
    error: type[RefreshError],
    fragments: list[str],
) -> None:
    sources = change(_baseline(sb))
    before = slab_bytes(sb)
    ptr = sb.slab.data_ptr()
    with pytest.raises(error) as info:
        sb.refresh(4, sources)
    assert type(info.value) is error
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert msg.startswith("refresh(size=4): ")
    for fragment in fragments:
        assert fragment in msg
    assert slab_bytes(sb) == before
    assert sb.slab.data_ptr() == ptr


def test_bad_source_first_or_last_changes_no_byte(
    sb: StaticBuffers, slab_bytes: Callable[[StaticBuffers], bytes]
) -> None:
    good = _baseline(sb)
    before = slab_bytes(sb)
    fresh = _as("list", _arrays(1, 1))  # different valid data: any partial write would show
    with pytest.raises(RefreshError):
        sb.refresh(4, {"seq_lens": [1, 2, 3], **{k: v for k, v in fresh.items() if k != "seq_lens"}})
    with pytest.raises(RefreshError):
        sb.refresh(4, {**{k: v for k, v in fresh.items() if k != "seq_lens"}, "seq_lens": [999]})
    with pytest.raises(RefreshError):  # every source valid alone; the counts disagree
        sb.refresh(4, {**fresh, "seq_lens": good["seq_lens"]})
    assert slab_bytes(sb) == before


def test_unknown_capture_size(sb: StaticBuffers, slab_bytes: Callable[[StaticBuffers], bytes]) -> None:
    sources = _baseline(sb)
    before = slab_bytes(sb)
    for size in (3, 0, 16, -4):
        with pytest.raises(
            RefreshError, match=rf"^refresh\(size={size}\): not a capture size; sizes: 2, 4, 8$"
        ):
            sb.refresh(size, sources)
    assert slab_bytes(sb) == before


@pytest.mark.parametrize(
    ("num_reqs", "error", "fragment"),
    [
        (3, RowsError, "refresh(size=4): num_reqs=3, but capture size 4 holds 0..2 requests"),
        (-1, RowsError, "num_reqs=-1, but capture size 4 holds 0..2 requests"),
        (
            1,
            RefreshError,
            "buffer 'block_table.a': 2 rows, but num_reqs implies 1 live requests, so 1 rows",
        ),
    ],
)
def test_bad_num_reqs_changes_no_byte(
    sb: StaticBuffers,
    slab_bytes: Callable[[StaticBuffers], bytes],
    num_reqs: int,
    error: type[RefreshError],
    fragment: str,
) -> None:
    sources = _baseline(sb)
    before = slab_bytes(sb)
    with pytest.raises(error) as info:
        sb.refresh(4, sources, num_reqs=num_reqs)
    assert fragment in str(info.value)
    assert slab_bytes(sb) == before


def test_error_hierarchy() -> None:
    assert issubclass(RefreshError, ValueError)
    assert issubclass(RowsError, RefreshError) and issubclass(WidthError, RefreshError)


# ----------------------------------------------------------------------------------------------------------
# Float, bfloat16 and bool buffers


FLOAT_SPEC: Mapping = {
    "version": 1,
    "name": "floats",
    "capture": {"sizes": [2, 4]},
    "buffers": {
        "half": {"dtype": "float16", "rows": "tokens", "pad": -2.0},
        "brain": {"dtype": "bfloat16", "rows": "requests", "cols": 3, "pad": -1.5},
        "single": {"dtype": "float32", "rows": "requests + 1", "pad": "repeat_last", "min": -10, "max": 10},
        "double": {"dtype": "float64", "rows": "tokens", "pad": 0.25},
        "brain_last": {"dtype": "bfloat16", "rows": "requests", "pad": "repeat_last"},
        "flag": {"dtype": "bool", "rows": "tokens", "pad": False},
    },
}


@pytest.fixture
def fb() -> StaticBuffers:
    return StaticBuffers(GraphSpec.model_validate(FLOAT_SPEC), poison=True)


def _float_sources() -> Sources:
    return {
        "half": [1.5, -3.25],
        "brain": [[1.5, 2.25], [-0.5, 4.0]],
        "single": [0.5, 1.5, 2.5],
        "double": np.array([0.1, 0.2]),
        "brain_last": [3.0, 5.5],
        "flag": [True, False],
    }


def test_float_bfloat16_and_bool_buffers_refresh(fb: StaticBuffers) -> None:
    assert fb.refresh(4, _float_sources()) == 2
    v = fb.view(4)
    assert v["half"].tolist() == [1.5, -3.25, -2.0, -2.0]
    assert v["brain"].dtype == torch.bfloat16
    assert v["brain"].float().tolist() == [
        [1.5, 2.25, -1.5],
        [-0.5, 4.0, -1.5],
        [-1.5, -1.5, -1.5],
        [-1.5, -1.5, -1.5],
    ]
    assert v["single"].tolist() == [0.5, 1.5, 2.5, 2.5, 2.5]
    assert v["double"].tolist() == [0.1, 0.2, 0.25, 0.25]
    assert v["brain_last"].float().tolist() == [3.0, 5.5, 5.5, 5.5]
    assert v["flag"].tolist() == [True, False, False, False]


def _float_base(n: int) -> Sources:
    """Valid float-spec sources (tokens_per_request 1) for ``n`` live requests."""
    return {
        "half": [0.0] * n,
        "brain": [[0.0]] * n,
        "single": [0.0] * (n + 1),
        "double": [0.0] * n,
        "brain_last": [0.0] * n,
        "flag": [True] * n,
    }


@pytest.mark.parametrize(
    ("name", "source", "n"),
    [
        ("brain", torch.tensor([[1.5, 2.25]], dtype=torch.bfloat16), 1),
        ("brain", np.array([[1, -2]], dtype=np.int8), 1),
        ("brain", torch.tensor([[1, 2]], dtype=torch.uint8), 1),
        ("brain", [[True, False]], 1),
        ("single", torch.tensor([0.5, 1.5], dtype=torch.bfloat16), 1),
        ("single", np.array([0.5, 1.5], dtype=np.float16), 1),
        ("single", np.array([1, 2], dtype=np.int16), 1),
        ("double", torch.tensor([0.5, 1.5, 2.5, 3.5], dtype=torch.float32), 4),
        ("half", np.array([1, 2], dtype=np.int8), 2),
        ("brain_last", torch.tensor([1.5, 2.5], dtype=torch.bfloat16), 2),
        ("flag", np.array([True], dtype=np.bool_), 1),
        ("flag", [1, 0], 2),
    ],
)
def test_float_and_bool_safe_casts(fb: StaticBuffers, name: str, source: Any, n: int) -> None:
    sources = {**_float_base(n), name: source}
    assert fb.refresh(4, sources) == n
    got = _np(fb.view(4)[name])
    expected = np.asarray(_np(source) if isinstance(source, torch.Tensor) else source).astype(got.dtype)
    np.testing.assert_array_equal(got[tuple(slice(0, k) for k in expected.shape)], expected)


@pytest.mark.parametrize(
    ("name", "source", "fragment"),
    [
        ("brain", torch.zeros(1, 2), "buffer 'brain': dtype float32 cannot be cast safely to bfloat16"),
        ("brain", np.zeros((1, 2), dtype=np.float32), "dtype float32 cannot be cast safely to bfloat16"),
        ("brain", torch.zeros(1, 2, dtype=torch.float16), "dtype float16 cannot be cast safely to bfloat16"),
        ("brain", np.zeros((1, 2), dtype=np.int16), "dtype int16 cannot be cast safely to bfloat16"),
        ("half", np.zeros(2), "buffer 'half': dtype float64 cannot be cast safely to float16"),
        ("half", torch.zeros(2, dtype=torch.bfloat16), "dtype bfloat16 cannot be cast safely to float16"),
        ("single", np.zeros(2, dtype=np.int64), "dtype int64 cannot be cast safely to float32"),
        ("flag", np.zeros(2, dtype=np.int32), "buffer 'flag': dtype int32 cannot be cast safely to bool"),
        ("flag", [0, 2], "buffer 'flag': values 0..2 do not fit bool (0..1)"),
        ("flag", [0.0, 1.0], "buffer 'flag': list holds floats; bool takes integers"),
        ("brain", [[float("nan"), 1.0]], "buffer 'brain': NaN at index [0, 0]"),
        (
            "brain",
            torch.tensor([[1.0, float("nan")]], dtype=torch.bfloat16),
            "buffer 'brain': NaN at index [0, 1]",
        ),
        ("half", np.array([np.nan, 0], dtype=np.float16), "buffer 'half': NaN at index [0]"),
        ("double", [0.0, float("nan")], "buffer 'double': NaN at index [1]"),
        ("single", [0.0, 11.0], "buffer 'single': value 11.0 at index [1] is above max 10"),
        ("single", np.array([-10.5, 0], dtype=np.float32), "value -10.5 at index [0] is below min -10"),
    ],
)
def test_float_and_bool_rejections_change_no_byte(
    fb: StaticBuffers, slab_bytes: Callable[[StaticBuffers], bytes], name: str, source: Any, fragment: str
) -> None:
    assert fb.refresh(4, _float_sources()) == 2
    before = slab_bytes(fb)
    sources = {k: v for k, v in _float_sources().items() if k != name}
    sources[name] = source
    with pytest.raises(RefreshError) as info:
        fb.refresh(4, sources)
    assert fragment in str(info.value)
    assert str(info.value).startswith("refresh(size=4): ")
    assert slab_bytes(fb) == before


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_float_list_out_of_dtype_range_is_rejected(
    fb: StaticBuffers, slab_bytes: Callable[[StaticBuffers], bytes]
) -> None:
    assert fb.refresh(4, _float_sources()) == 2
    before = slab_bytes(fb)
    with pytest.raises(RefreshError, match="half"):
        fb.refresh(4, {**_float_sources(), "half": [1e6, 0.0]})
    assert slab_bytes(fb) == before


# ----------------------------------------------------------------------------------------------------------
# Device-resident sources (need CUDA)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_and_host_sources(
    spec_mapping: Callable[[], Mapping], slab_bytes: Callable[[StaticBuffers], bytes]
) -> None:
    buffers = StaticBuffers(GraphSpec.model_validate(spec_mapping()), device="cuda", poison=True)
    ptrs = {s: buffers.addresses(s) for s in buffers.capture_sizes}
    slab_ptr = buffers.slab.data_ptr()
    arrays = _arrays(3, 2)
    sources: Sources = {k: torch.from_numpy(v).cuda() for k, v in arrays.items()}
    sources["seq_lens"] = arrays["seq_lens"].tolist()  # a host source in the same refresh
    for _ in range(3):  # both staging copies, then the first again
        assert buffers.refresh(8, sources) == 3
        torch.cuda.synchronize()
        v = {k: t.cpu().numpy() for k, t in buffers.view(8).items()}
        np.testing.assert_array_equal(v["block_table.a"][:3, :2], arrays["block_table.a"])
        assert (v["block_table.a"][:3, 2:] == 0).all() and (v["block_table.a"][3:] == 0).all()
        np.testing.assert_array_equal(v["seq_lens"], [10, 11, 12, 0])
        np.testing.assert_array_equal(v["query_start_loc"], [0, 2, 4, 6, 6])
        np.testing.assert_array_equal(v["slot_mapping"], [100, 101, 102, 103, 104, 105, -1, -1])
        assert np.isnan(v["scratch"]).all()
    assert buffers.slab.data_ptr() == slab_ptr
    assert {s: buffers.addresses(s) for s in buffers.capture_sizes} == ptrs

    # Device sources are bounds-checked only in strict mode (the check syncs the device).
    bad = {**sources, "seq_lens": torch.tensor([1, 2, 99], dtype=torch.int32, device="cuda")}
    before = slab_bytes(buffers)
    with pytest.raises(RefreshError, match="buffer 'seq_lens': value 99 at index \\[2\\] is above max 64"):
        buffers.refresh(8, bad, strict=True)
    assert slab_bytes(buffers) == before
    assert buffers.refresh(8, bad) == 3
    torch.cuda.synchronize()
    assert buffers.view(8)["seq_lens"].cpu().tolist() == [1, 2, 99, 0]

    for name, value, fragment in [
        ("block_table.a", torch.zeros(2, 3, dtype=torch.int32, device="cuda").t(), "strided"),
        ("seq_lens", torch.zeros(3, dtype=torch.int64, device="cuda"), "dtype int64 cannot be cast safely"),
        ("seq_lens", torch.zeros(3, dtype=torch.int32, device="meta"), "source is on meta"),
    ]:
        before = slab_bytes(buffers)
        with pytest.raises(RefreshError, match=fragment):
            buffers.refresh(8, {**sources, name: value})
        assert slab_bytes(buffers) == before


@pytest.mark.parametrize("depth", [2, 3])
def test_staged_upload_path_cycles_staging_copies_and_uploads_live_rectangles(
    spec_mapping: Callable[[], Mapping], depth: int
) -> None:
    """The accelerator path (``depth`` staging copies, an event per refresh), driven on a cpu slab: a CUDA/NPU
    slab takes exactly this path with pinned staging and device events. With the native packer every touched
    rectangle goes into one packed arena placed by one indexed write (on a device after its one upload; on
    the cpu the arena is read in place); without it, one upload per touched buffer rectangle."""
    sb = StaticBuffers(GraphSpec.model_validate(spec_mapping()), poison=True, upload_copies=depth)
    assert sb.upload_copies == depth
    for n in (4, 1, 3, 0, 2, 4, 1):
        sources = _arrays(n)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            assert sb.refresh(8, sources) == n
        copies = [e for e in prof.events() if e.name == "aten::copy_"]
        puts = [e for e in prof.events() if e.name == "aten::scatter_"]
        if native.KERNEL is not None:  # one packed placement, whatever the number of buffers
            assert len(puts) == 1 and not copies, [e.name for e in prof.events()]
        else:
            assert len(copies) == len(sources), [e.name for e in prof.events()]  # one upload per buffer
        view = sb.view(8)
        np.testing.assert_array_equal(view["seq_lens"].numpy()[:n], sources["seq_lens"])
        assert (view["seq_lens"].numpy()[n:] == 0).all()
        np.testing.assert_array_equal(view["block_table.a"].numpy()[:n, :4], sources["block_table.a"])
        assert (view["block_table.a"].numpy()[n:] == 0).all()
    assert sb.stats.refreshes == 7
    before = sb.slab.numpy().tobytes()
    with pytest.raises(WidthError):
        sb.refresh(8, {**_arrays(2), "block_table.a": np.zeros((2, 99), dtype=np.int32)})
    assert sb.slab.numpy().tobytes() == before
    assert sb.stats.refreshes == 7
