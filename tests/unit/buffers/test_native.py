"""The native refresh kernel (``graphbuf.buffers._native``) against the numpy reference path.

Every refresh through the kernel must leave the bytes, the statistics and the errors the numpy path
(``graphbuf.buffers.native.KERNEL = None``) leaves: property-based over drawn specs and batches (mapping and
bound sources, accepted and rejected), over every safe source dtype into every buffer dtype, and for large
(streamed) copies. ``fit`` and ``write`` are also called directly: edge cases against the exact answer and
:func:`graphbuf.buffers.commit.write_live`, hostile inputs raising before any byte is written. The fallback
(``GRAPHBUF_NATIVE=0``) and the build itself are checked too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pins import numpy_path, twins

import graphbuf
from graphbuf import GraphSpec, StaticBuffers
from graphbuf.buffers import native
from graphbuf.buffers.commit import write_live
from graphbuf.planning.planner import BufferPlan, Plan
from graphbuf.spec.models import DTYPES
from graphbuf.testing import Rejected, batches, bounds, examples, sample, specs

pytestmark = pytest.mark.backends_compared  # compares the backends itself (conftest)

ROOT = Path(__file__).resolve().parents[3]
KERNEL = native.KERNEL  # as imported: None only where the extension was not built
SHIPPED_OVERRIDES = {"num_blocks": 64, "max_model_len": 512}
SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large]
INT_DTYPES = ("uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64")
SOURCE_DTYPES = (
    "bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "float16", "float32", "float64",
)  # fmt: skip
BF16_SAFE = ("bool", "uint8", "int8")  # what graphbuf casts safely into bfloat16 (numpy has no bfloat16)
I64_MAX = 2**63 - 1

needs_kernel = pytest.mark.skipif(
    KERNEL is None, reason="the native kernel is not built here (see test_built)"
)


# ----------------------------------------------------------------------------------------------------------
# Helpers


def contents(sb: StaticBuffers) -> dict[str, bytes]:
    """Every buffer's bytes (the slab's alignment gaps hold whatever the allocator left: not compared)."""
    slab = sb.slab.cpu()
    return {b.name: slab[b.offset : b.offset + b.nbytes].numpy().tobytes() for b in sb.plan.buffers}


def slab_bytes(sb: StaticBuffers) -> bytes:
    """The whole slab, gaps included (for no-byte-changed checks on one StaticBuffers)."""
    return sb.slab.cpu().numpy().tobytes()


def both(nat: StaticBuffers, ref: StaticBuffers, op: Callable[[StaticBuffers], Any]) -> tuple[Any, ...]:
    """Run ``op`` on ``nat`` (kernel) and ``ref`` (numpy path; both from :func:`pins.twins`); assert the same
    outcome (result, or exception type and message), the same buffer bytes and the same stats, and that a
    raising ``op`` changed no byte. Return the outcome."""
    outcomes = []
    for sb, ctx in ((nat, nullcontext()), (ref, numpy_path())):
        before = slab_bytes(sb)
        with ctx:
            try:
                outcome: tuple[Any, ...] = ("ok", op(sb))
            except Exception as exc:  # any error must match across the paths
                outcome = ("error", type(exc), str(exc))
                assert slab_bytes(sb) == before, f"a rejected refresh changed bytes: {exc}"
        outcomes.append(outcome)
    assert outcomes[0] == outcomes[1]
    assert contents(nat) == contents(ref)
    assert nat.stats == ref.stats
    return outcomes[0]


def np_dtype(name: str) -> np.dtype:
    return np.dtype(np.bool_) if name == "bool" else np.dtype(name)


def safe_sources(buffer_dtype: str) -> tuple[str, ...]:
    """Source dtypes graphbuf casts safely into ``buffer_dtype``."""
    if buffer_dtype == "bfloat16":
        return BF16_SAFE
    return tuple(s for s in SOURCE_DTYPES if np.can_cast(np_dtype(s), np_dtype(buffer_dtype), "safe"))


def value_range(dtype: str) -> tuple[int, int]:
    """Integer values ``dtype`` holds exactly (floats: a range every float dtype here holds exactly)."""
    if dtype == "bool":
        return 0, 1
    if dtype.startswith("float") or dtype == "bfloat16":
        return -2048, 2048
    info = np.iinfo(np.dtype(dtype))
    return int(info.min), int(info.max)


def truth(arr: np.ndarray, rows: int, width: int, lo: int | None, hi: int | None) -> bool:
    """Whether every value of the region (2-D ``[:rows, :width]``, 1-D ``[:rows]``) lies within lo..hi."""
    region = arr[:rows, :width] if arr.ndim == 2 else arr[:rows]
    vals = [int(v) for v in region.reshape(-1).tolist()]
    return all((lo is None or v >= lo) and (hi is None or v <= hi) for v in vals)


def slot(index: int, dtype: np.dtype, pad: Any, repeat_last: bool = False) -> SimpleNamespace:
    """What ``write``/``write_live`` read of a slot."""
    return SimpleNamespace(index=index, pad=np.array(pad, dtype=dtype), repeat_last=repeat_last)


# ----------------------------------------------------------------------------------------------------------
# 1. Equivalence over drawn specs and batches


def narrower(draw: Any, b: BufferPlan, lo: int, hi: int, *, overlap: bool = False) -> str:
    """A source dtype that casts safely into ``b`` and holds ``lo..hi`` (``overlap``: some of it), the
    buffer's own numpy dtype if no other does; bfloat16 takes bool/uint8/int8."""
    fits = [
        d for d in safe_sources(b.dtype_name)
        if (value_range(d)[0] <= hi and lo <= value_range(d)[1] if overlap
            else value_range(d)[0] <= lo and hi <= value_range(d)[1])
    ]  # fmt: skip
    if b.dtype_name != "bfloat16" and b.dtype_name not in fits:
        fits.append(b.dtype_name)
    signed = [d for d in fits if d.startswith("int")]
    if signed and draw(st.booleans()):  # the narrowest signed one half the time: sign extension, negatives
        return signed[0]
    return draw(st.sampled_from(fits)) if fits else b.dtype_name


@st.composite
def persistent(draw: Any, sb: StaticBuffers) -> dict[str, np.ndarray]:
    """Host arrays to bind: every buffer, more rows and columns than its allocation, values within bounds,
    some of a narrower dtype than the buffer's."""
    out = {}
    for b in sb.plan.buffers:
        shape = tuple(sb.full[b.name].shape)
        rows = shape[0] + draw(st.integers(0, 2))
        lo, hi = bounds(b)
        dtype = narrower(draw, b, lo, hi, overlap=True)
        if dtype == "bfloat16":  # its bounds miss bool/uint8/int8: left unbound
            continue
        dlo, dhi = value_range(dtype)
        lo, hi = max(lo, dlo), min(hi, dhi)
        full = (rows,) if len(shape) == 1 else (rows, shape[1] + draw(st.integers(0, 3)))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        out[b.name] = rng.integers(lo, hi, size=full, endpoint=True).astype(np_dtype(dtype))
    return out


def restyle(draw: Any, p: Plan, sources: dict[str, Any]) -> dict[str, Any]:
    """The same values in other forms a refresh takes: a narrower safe dtype, a torch tensor, rows in a
    wider array (row stride > width), reversed rows (negative row stride)."""
    out = {}
    for name, src in sources.items():
        b = p[name]
        host = src.float().numpy() if isinstance(src, torch.Tensor) else np.asarray(src)
        if host.size and draw(st.booleans()):
            lo, hi = int(host.min()), int(host.max())
            if np.array_equal(host, host.astype(np.int64)):
                dtype = narrower(draw, b, lo, hi)
                if dtype != "bfloat16":
                    src = host.astype(np_dtype(dtype))
        if isinstance(src, np.ndarray) and src.ndim == 2:
            style = draw(st.sampled_from(("plain", "wider", "reversed")))
            if style == "wider":
                wide = np.zeros((src.shape[0], src.shape[1] + 3), dtype=src.dtype)
                wide[:, : src.shape[1]] = src
                src = wide[:, : src.shape[1]]
            elif style == "reversed":
                src = np.ascontiguousarray(src[::-1])[::-1]
        # a torch tensor (torch has no uint16/uint32 numpy view)
        if isinstance(src, np.ndarray) and src.dtype not in (np.uint16, np.uint32) and draw(st.booleans()):
            src = torch.from_numpy(np.ascontiguousarray(src))
        out[name] = src
    return out


def poke(draw: Any, sb: StaticBuffers, arrays: dict[str, np.ndarray]) -> None:
    """Maybe set one value of one bound array just outside its buffer's min or max (where the array's
    dtype holds that value: a narrower signed array may get a negative value against min 0)."""
    choices = []
    for name, arr in arrays.items():
        b = sb.plan[name]
        if arr.size == 0 or arr.dtype.kind == "b":
            continue
        dlo, dhi = value_range(arr.dtype.name)
        outside = [(b.min, b.min - 1)] if b.min is not None else []
        outside += [(b.max, b.max + 1)] if b.max is not None else []
        choices += [(name, bad) for _, bad in outside if dlo <= bad <= dhi]
    if choices and draw(st.booleans()):
        name, bad = draw(st.sampled_from(choices))
        arr = arrays[name]
        arr.reshape(-1)[draw(st.integers(0, arr.size - 1))] = bad


def widen_bounds(draw: Any, doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with some integer buffers' ``max`` raised above what a narrower source dtype holds (specs()
    draws max <= 100), so narrow sources meet bounds beyond their own range."""
    buffers = {}
    for name, buf in doc["buffers"].items():
        kind = DTYPES[buf["dtype"]][0]
        if kind in "iu" and buf["dtype"] != "uint8" and draw(st.booleans()):
            top = value_range(buf["dtype"])[1]
            buf = {**buf, "max": min(top, draw(st.sampled_from((200, 255, 40000, 65535, 2**31 + 5, top))))}
            if (buf["pad"] == "repeat_last" or buf["pad"] >= 0) and draw(st.booleans()):
                buf["min"] = 0  # with a max above a narrow signed source's: the one-reduction check
        buffers[name] = buf
    return {**doc, "buffers": buffers}


@settings(max_examples=examples(200), suppress_health_check=SLOW)
@given(doc=specs(), data=st.data())
def test_kernel_and_numpy_refreshes_leave_the_same_bytes_stats_and_errors(
    doc: dict[str, Any], data: st.DataObject
) -> None:
    p = graphbuf.plan(GraphSpec.model_validate(widen_bounds(data.draw, doc)))
    poison = data.draw(st.booleans(), label="poison")
    staging = data.draw(st.sampled_from((None, 2)), label="staging")
    nat, ref = twins(p, poison=poison, upload_copies=staging)
    arrays = data.draw(persistent(nat), label="bound arrays")
    bindable = nat.layout.required.issubset(arrays)
    bound = {id(nat): nat.bind(arrays), id(ref): ref.bind(arrays)} if bindable else {}
    # a batch of keep buffers only may leave every source out: then batches(rejected=True) has nothing to
    # mutate (and raises), so rejected batches need a buffer that is always given
    kinds = ("accepted", "bound") if bound else ("accepted",)
    if nat.layout.required:
        kinds += ("rejected",)
    seen = set()
    for _ in range(data.draw(st.integers(3, 6), label="steps")):
        kind = data.draw(st.sampled_from(kinds), label="kind")
        seen.add(kind)
        if kind == "accepted":
            batch = data.draw(batches(p))
            srcs = restyle(data.draw, p, batch.sources)
            # num_reqs: a batch whose sources are all keep buffers left out determines no count itself
            k = batch.num_reqs
            outcome = both(nat, ref, lambda sb, s=batch.size, x=srcs, k=k: sb.refresh(s, x, num_reqs=k))
            assert outcome == ("ok", batch.num_reqs)
        elif kind == "rejected":
            bad = data.draw(batches(p, rejected=True))
            assert isinstance(bad, Rejected)
            bad = Rejected(bad.size, restyle(data.draw, p, bad.sources), bad.num_reqs, bad.error, bad.reason)
            outcome = both(nat, ref, lambda sb, x=bad: sb.refresh(x.size, x.sources, num_reqs=x.num_reqs))
            assert outcome[0] == "error" and outcome[1] is bad.error, (bad.reason, outcome)
        else:
            size = data.draw(st.sampled_from(p.capture_sizes), label="size")
            n = data.draw(st.integers(0, nat.layout.max_requests[size]), label="num_reqs")
            wide = [name for name, a in arrays.items() if a.ndim == 2]
            widths = {name: data.draw(st.integers(0, arrays[name].shape[1])) for name in wide
                      if data.draw(st.booleans())}  # fmt: skip
            poke(data.draw, nat, arrays)
            both(
                nat, ref, lambda sb, s=size, k=n, w=widths: sb.refresh(s, bound[id(sb)], num_reqs=k, widths=w)
            )
    assert seen


# ----------------------------------------------------------------------------------------------------------
# 2. Every safe source dtype into every buffer dtype


def matrix_spec(dtype: str) -> GraphSpec:
    """Buffers of ``dtype``: pad 0, a non-zero pad, a float pad (float dtypes), repeat_last 1-D and 2-D."""
    kind = DTYPES[dtype][0]
    zero: Any = False if kind == "b" else 0
    other: Any = True if kind == "b" else (7 if kind == "u" else -1)
    wide_pad: Any = 1.5 if kind == "f" else other
    return GraphSpec.model_validate({
        "version": 1,
        "name": f"matrix-{dtype}",
        "constants": {"max_num_seqs": 8, "block_size": 16, "max_model_len": 64,
                      "max_blocks": "cdiv(max_model_len, block_size)"},
        "capture": {"tokens_per_request": 1, "sizes": [2, 4, 8]},
        "buffers": {
            "flat": {"dtype": dtype, "rows": "requests", "pad": zero},
            "other": {"dtype": dtype, "rows": "tokens", "pad": other},
            "wide": {"dtype": dtype, "rows": "requests", "cols": "max_blocks", "pad": wide_pad},
            "rep": {"dtype": dtype, "rows": "requests + 1", "pad": "repeat_last"},
            "rep_wide": {"dtype": dtype, "rows": "requests", "cols": "max_blocks", "pad": "repeat_last"},
        },
    })  # fmt: skip


MATRIX = [(buf, src) for buf in DTYPES for src in safe_sources(buf)]
STEPS = ((8, 8, 4), (4, 3, 2), (2, 1, 1), (8, 5, 3), (8, 8, 4), (2, 2, 0))  # (size, requests, width)


@pytest.mark.parametrize(("buffer_dtype", "source_dtype"), MATRIX, ids=[f"{s}->{b}" for b, s in MATRIX])
def test_every_safe_dtype_pair_refreshes_to_the_same_bytes(buffer_dtype: str, source_dtype: str) -> None:
    spec = matrix_spec(buffer_dtype)
    nat, ref = twins(spec)
    rng = np.random.default_rng(len(buffer_dtype) * 31 + len(source_dtype))
    lo, hi = value_range(source_dtype)
    extremes = [lo, hi]
    for size, n, w in STEPS:
        srcs: dict[str, np.ndarray] = {}
        for name, t in ref.view(size).items():
            rows = n + 1 if name == "rep" else n
            shape = (rows, w) if t.dim() == 2 else (rows,)
            vals = rng.integers(max(lo, -100), min(hi, 100), size=shape, endpoint=True)
            flat = vals.reshape(-1)
            flat[: min(2, flat.size)] = extremes[
                : min(2, flat.size)
            ]  # the dtype's extremes: sign/zero extension
            srcs[name] = vals.astype(np_dtype(source_dtype))
            if source_dtype.startswith("float") and flat.size:
                srcs[name].reshape(-1)[-1] = 0.5  # a fraction (exact in every float dtype)
        assert both(nat, ref, lambda sb, s=size, x=srcs: sb.refresh(s, x)) == ("ok", n)
        for name, src in srcs.items():  # and the bytes are the right ones
            got = nat.view(size)[name]
            live = got[: src.shape[0], : src.shape[1]] if src.ndim == 2 else got[: src.shape[0]]
            if got.dtype.is_floating_point:  # integer sources convert exactly (a safe cast)
                assert np.array_equal(live.to(torch.float64).numpy(), src.astype(np.float64)), name
            else:
                assert np.array_equal(live.numpy().astype(np.int64), src.astype(np.int64)), name


# ----------------------------------------------------------------------------------------------------------
# 3. fit, directly


def fit(*args: Any) -> Any:
    assert KERNEL is not None
    return KERNEL.fit(*args)


I64 = np.array([[-(2**63), 0, I64_MAX]], dtype=np.int64)
U64 = np.array([0, 2**63, 2**64 - 1], dtype=np.uint64)
FIT_CASES: list[tuple[str, np.ndarray, int, int, Any, Any, Any]] = [
    # (id, arr, rows, width, lo, hi, expected)
    ("unbounded", np.array([-5, 7], np.int32), 2, 0, None, None, True),
    ("lo0-negative-int32", np.array([3, -1, 2], np.int32), 3, 0, 0, 10, False),
    ("lo0-negative-int64-2d", np.array([[3, 4], [-1, 2]], np.int64), 2, 2, 0, 10, False),
    ("lo0-negative-int8-no-hi", np.array([3, -1], np.int8), 2, 0, 0, None, False),
    ("lo0-hi-int64-max", np.array([0, I64_MAX], np.int64), 2, 0, 0, I64_MAX, True),
    ("lo0-hi-int64-max-negative", np.array([-1, 5], np.int64), 2, 0, 0, I64_MAX, False),
    ("uint64-above-int64-max", U64, 2, 0, 0, I64_MAX, False),
    ("uint64-at-int64-max", np.array([I64_MAX, 1], np.uint64), 2, 0, 0, I64_MAX, True),
    ("beyond-int64-both", I64, 1, 3, -(2**70), 2**70, True),
    ("lo-beyond-int64-above", I64, 1, 3, 2**70, None, False),
    ("hi-beyond-int64-below", I64, 1, 3, None, -(2**70), False),
    ("uint64-hi-beyond", U64, 3, 0, None, 2**70, True),
    ("uint64-lo-beyond", U64, 3, 0, 2**70, None, False),
    ("uint64-lo-negative", U64, 3, 0, -(2**70), 2**64 - 1, True),
    ("uint64-hi-negative", U64, 3, 0, None, -1, False),
    ("int64-extremes-exact", I64, 1, 3, -(2**63), I64_MAX, True),
    ("int64-min-below", I64, 1, 3, -(2**63) + 1, None, False),
    ("float-lo", np.array([1, 2], np.int32), 2, 0, 0.0, 5, None),
    ("float-hi", np.array([1, 2], np.int32), 2, 0, 0, 5.5, None),
    ("float16-array", np.array([1, 2], np.float16), 2, 0, 0, 5, None),
    ("float32-array", np.array([[1, 2]], np.float32), 1, 2, 0, 5, None),
    ("float64-array", np.array([np.nan], np.float64), 1, 0, 0, 5, None),
    ("bool-in", np.array([True, False]), 2, 0, 0, 1, True),
    ("bool-hi0", np.array([True, False]), 2, 0, 0, 0, False),
    ("bool-lo1", np.array([[True, False]]), 1, 2, 1, None, False),
    ("empty-rows", np.array([-9, 9], np.int32), 0, 0, 0, 1, True),
    ("empty-width", np.full((3, 4), -9, np.int32), 3, 0, 0, 1, True),
    ("empty-array", np.zeros((0, 0), np.int64), 0, 0, 0, 1, True),
    ("region-only", np.array([[1, 99], [2, 99]], np.int16), 2, 1, 0, 10, True),
    ("region-rows-only", np.array([1, 2, -99], np.int16), 2, 0, 0, 10, True),
    ("uint8-255", np.array([255, 0], np.uint8), 2, 0, 0, 254, False),
    ("int16-lo-negative", np.array([-300, 7], np.int16), 2, 0, -300, 7, True),
    ("int16-lo-negative-below", np.array([-301, 7], np.int16), 2, 0, -300, 7, False),
    ("uint32-lo-positive", np.array([5, 6], np.uint32), 2, 0, 6, None, False),
]


@needs_kernel
@pytest.mark.parametrize(("arr", "rows", "width", "lo", "hi", "expected"),
                         [c[1:] for c in FIT_CASES], ids=[c[0] for c in FIT_CASES])  # fmt: skip
def test_fit_edge_cases(arr: np.ndarray, rows: int, width: int, lo: Any, hi: Any, expected: Any) -> None:
    got = fit(arr, rows, width, lo, hi)
    assert got is expected
    if expected is not None:
        assert truth(arr, rows, width, lo, hi) is expected  # the table itself is right
    ro = arr.copy()
    ro.flags.writeable = False
    assert fit(ro, rows, width, lo, hi) is expected  # a read-only array reads the same


@needs_kernel
@pytest.mark.parametrize("style", ["every-other-column", "reversed-rows", "1d-strided", "1d-reversed",
                                   "big-endian", "transposed", "broadcast-rows"])  # fmt: skip
def test_fit_on_unusual_layouts_is_none_or_right(style: str) -> None:
    rng = np.random.default_rng(3)
    base = rng.integers(-5, 20, size=(6, 8)).astype(np.int32)
    arr = {
        "every-other-column": base[:, ::2],
        "reversed-rows": base[::-1],
        "1d-strided": base[:, 0],
        "1d-reversed": base[0, ::-1],
        "big-endian": base.astype(">i4"),
        "transposed": base.T,
        "broadcast-rows": np.broadcast_to(base[0], (6, 8)),
    }[style]
    rows, width = 5, 3
    for lo, hi in ((0, 25), (-5, 19), (0, 19), (-4, None), (None, 18), (-(2**70), 2**70)):
        got = fit(arr, rows, width, lo, hi)
        assert got is None or got is truth(arr, rows, width, lo, hi), (lo, hi, got)
    if style == "reversed-rows":  # rows are contiguous: the kernel answers
        assert fit(arr, rows, width, 0, 25) is truth(arr, rows, width, 0, 25)


@needs_kernel
def test_fit_rejects_bad_calls_without_crashing() -> None:
    arr = np.arange(12, dtype=np.int32).reshape(3, 4)
    with pytest.raises(ValueError, match="outside the array"):
        fit(arr, 4, 4, 0, 10)  # more rows than the array
    with pytest.raises(ValueError, match="outside the array"):
        fit(arr, 3, 5, 0, 10)  # wider than the array
    with pytest.raises(ValueError, match="outside the array"):
        fit(arr[:, 0], 4, 0, 0, 10)
    with pytest.raises(ValueError, match="rows must be >= 0"):
        fit(arr, -1, 4, 0, 10)
    with pytest.raises(ValueError, match="width must be >= 0"):
        fit(arr, 1, -1, 0, 10)
    with pytest.raises(TypeError, match="takes 5 arguments"):
        fit(arr, 3, 4, 0)
    with pytest.raises(TypeError):
        fit(arr, 1.5, 4, 0, 10)
    for obj in (object(), [1, 2, 3], None):
        with pytest.raises(TypeError):
            fit(obj, 1, 1, 0, 10)
    # 0-d and 3-D arrays: no region of them is read; an empty one is not checked (None), any other refused
    for odd in (np.array(5, np.int32), np.zeros((2, 2, 2), np.int32)):
        assert fit(odd, 0, 0, 0, 10) is None
        with pytest.raises(ValueError, match="outside the array's 0 x 0"):
            fit(odd, 1, 1, 0, 10)


@st.composite
def fit_inputs(draw: Any) -> tuple[np.ndarray, int, int, int | None, int | None]:
    dtype = np.dtype(draw(st.sampled_from((*INT_DTYPES, "bool"))))
    dlo, dhi = (0, 1) if dtype.kind == "b" else (int(np.iinfo(dtype).min), int(np.iinfo(dtype).max))
    if draw(st.booleans()):
        shape: tuple[int, ...] = (draw(st.integers(0, 40)),)
    else:
        shape = (draw(st.integers(0, 9)), draw(st.integers(0, 9)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    arr = rng.integers(
        dlo, dhi, size=shape, endpoint=True, dtype=np.int64 if dtype.kind != "u" else np.uint64
    )
    arr = arr.astype(dtype)
    # the type's edges, those of wider types, beyond int64
    edges = (0, -1, 1, dlo, dhi, dlo - 1, dhi + 1, 127, 200, 255, 32767, 65535, 2**31 - 1, 2**32, 2**63 - 1)
    edges += (-(2**63), 2**64, -(2**70), 2**70)
    near = st.one_of(
        st.none(), st.sampled_from(edges), st.integers(dlo - 2, dhi + 2), st.integers(-(2**64), 2**64)
    )
    lo, hi = draw(st.one_of(st.just(0), near)), draw(near)  # lo 0: the one-reduction path
    rows = draw(st.one_of(st.just(shape[0]), st.integers(0, shape[0])))  # often the whole array
    width = draw(st.one_of(st.just(shape[-1]), st.integers(0, shape[-1]))) if len(shape) == 2 else 3
    return arr, rows, width, lo, hi


@needs_kernel
@settings(max_examples=examples(300))
@given(fit_inputs())
def test_fit_is_exact_on_integer_arrays(case: tuple[np.ndarray, int, int, int | None, int | None]) -> None:
    arr, rows, width, lo, hi = case
    assert fit(arr, rows, width, lo, hi) is truth(arr, rows, width, lo, hi)


def accept(*args: Any) -> Any:
    assert KERNEL is not None
    return KERNEL.accept(*args)


@st.composite
def accept_inputs(draw: Any) -> tuple[np.ndarray, int, int, int, int | None, int | None]:
    """fit_inputs' arrays in the layouts a mapping source may take, with a declared ndim and capacity."""
    arr, _, _, lo, hi = draw(fit_inputs())
    layout = draw(st.sampled_from(("plain", "columns", "rows", "reversed", "wider", "3d")))
    if layout == "columns" and arr.ndim == 2:
        arr = np.repeat(arr, 2, axis=1)[:, ::2]  # every other element: strided
    elif layout == "rows" and arr.ndim == 2:
        arr = np.repeat(arr, 2, axis=0)[::2]  # every other row: rows strided, elements contiguous
    elif layout == "reversed":
        arr = arr[::-1]
    elif layout == "wider" and arr.ndim == 2:
        arr = np.concatenate([arr, arr], axis=1)[:, : arr.shape[1]]
    elif layout == "3d":
        arr = arr.reshape(1, *arr.shape)
    ndim = draw(st.sampled_from((1, 2)))
    cap_rows = draw(st.integers(0, 12))
    cap_cols = draw(st.integers(0, 12))
    return arr, ndim, cap_rows, cap_cols, lo, hi


def accept_truth(arr: np.ndarray, ndim: int, cap_rows: int, cap_cols: int, lo: Any, hi: Any) -> Any:
    """What accept must answer: the checks check_source makes for a fast-dtype source, all passed."""
    if arr.ndim != ndim:
        return None
    if arr.size and arr.shape[-1] > 1 and arr.strides[-1] != arr.itemsize:
        return None
    if arr.shape[0] > cap_rows or (ndim == 2 and arr.shape[1] > cap_cols):
        return None
    if arr.size:
        values = [int(v) for v in arr.reshape(-1).tolist()]
        if (lo is not None and min(values) < lo) or (hi is not None and max(values) > hi):
            return None
    return (arr.shape[0], arr.shape[1] if ndim == 2 else 0)


@needs_kernel
@settings(max_examples=examples(300))
@given(accept_inputs())
def test_accept_is_exactly_the_checks_it_replaces(case: tuple[Any, ...]) -> None:
    """``accept`` answers (rows, width) exactly when every check of check_source's general path passes."""
    assert accept(*case) == accept_truth(*case)


@needs_kernel
def test_accept_leaves_everything_else_to_the_general_path() -> None:
    a = np.arange(6, dtype=np.int32)
    assert accept(a, 1, 6, 0, 0, 5) == (6, 0)
    assert accept(a, 1, 6, 0, 0, 4) is None  # a value above hi: the general path names it
    assert accept(a, 1, 5, 0, None, None) is None  # too many rows: the general path raises RowsError
    assert accept(a.reshape(2, 3), 2, 2, 2, None, None) is None  # too wide: clipped or WidthError there
    assert accept(a.astype(np.float32), 1, 6, 0, None, None) is None  # floats: NaN is looked for there
    assert accept(_misaligned([1, 2], np.int32), 1, 6, 0, None, None) is None
    assert accept(a, 1, 6, 0, 0.5, None) is None  # a float bound: numpy compares it
    for obj in ([1, 2], None, object()):
        assert accept(obj, 1, 6, 0, None, None) is None  # not a buffer: its type is named there
    with pytest.raises(TypeError, match="takes 6 arguments"):
        accept(a, 1, 6, 0, None)
    with pytest.raises(ValueError, match="cap_rows must be >= 0"):
        accept(a, 1, -1, 0, None, None)


@needs_kernel
def test_accept_all_is_check_source_for_every_source_or_none() -> None:
    """``accept_all``: the Prepared records check_source gives, in the mapping's order, when every source
    takes the native path at a capture size with rows agreeing with ``n``; None otherwise."""
    from graphbuf.buffers.validate import Prepared, check_source

    sb = StaticBuffers("gemma4-31b-it-mtp", overrides={"num_blocks": 64})
    slots = sb.layout.slots
    srcs = {
        "seq_lens": np.array([5, 9], np.int32),
        "block_table.full": np.array([[1, 2], [3, 4]], np.int16),  # a safe, narrower dtype
        "query_start_loc": np.array([0, 4, 8], np.int32),
    }
    got = KERNEL.accept_all(srcs, slots, 8, 2, Prepared, np.ndarray)
    want = [check_source(sb.layout, k, v, 8, "r", False, sb.device) for k, v in srcs.items()]
    assert [type(p) for p in got] == [Prepared] * 3
    assert [(p.slot, p.host, p.dev, p.rows, p.width) for p in got] == [tuple(p) for p in want]
    assert KERNEL.accept_all(srcs, slots, 8, None, Prepared, np.ndarray) == got  # n not checked
    assert KERNEL.accept_all({}, slots, 8, 2, Prepared, np.ndarray) == []
    for bad in (
        {**srcs, "seq_lens": [5, 9]},  # a list: converted on the general path
        {**srcs, "seq_lens": np.array([5, 9], np.int64)},  # needs a value check to cast
        {**srcs, "seq_lens": np.array([5, 9000], np.int32)},  # above max: the general path names it
        {**srcs, "unknown": np.zeros(2, np.int32)},
        {**srcs, "seq_lens": np.array([5, 9, 1], np.int32)},  # 3 rows for 2 requests
    ):
        assert KERNEL.accept_all(bad, slots, 8, 2, Prepared, np.ndarray) is None
    eager = sb.capture_sizes[-1] + 4
    assert KERNEL.accept_all(srcs, slots, eager, 2, Prepared, np.ndarray) is None  # not a capture size
    assert KERNEL.accept_all(srcs, slots, 8, 9, Prepared, np.ndarray) is None  # beyond the table
    with pytest.raises(TypeError, match="accept_all"):
        KERNEL.accept_all(list(srcs.items()), slots, 8, 2, Prepared, np.ndarray)


@needs_kernel
def test_fit_signed_with_lo_0_and_hi_above_the_dtype() -> None:
    """Regression (B1, fixed in 394d3e3): the unsigned-max shortcut must not take a signed array whose
    ``hi`` lies above its dtype's max (a negative value viewed unsigned would pass)."""
    assert fit(np.array([-100], np.int8), 1, 0, 0, 200) is False
    assert fit(np.array([-5], np.int32), 1, 0, 0, 2**32) is False
    assert fit(np.array([[-3, 4]], np.int16), 1, 2, 0, 65535) is False
    assert fit(np.array([100, 127], np.int8), 2, 0, 0, 200) is True


def test_refresh_rejects_a_negative_narrow_source_below_min_0() -> None:
    """Regression (B1) through refresh: an int8 -1 into an int32 buffer with min 0, max 255."""
    spec = GraphSpec.model_validate({
        "version": 1, "name": "b1", "constants": {"max_num_seqs": 2},
        "capture": {"tokens_per_request": 1, "sizes": [2]},
        "buffers": {"x": {"dtype": "int32", "rows": "requests", "pad": 0, "min": 0, "max": 255}},
    })  # fmt: skip
    nat, ref = twins(spec)
    outcome = both(nat, ref, lambda sb: sb.refresh(2, {"x": np.array([-1, 3], np.int8)}))
    assert outcome[0] == "error" and outcome[1] is graphbuf.RefreshError


# ----------------------------------------------------------------------------------------------------------
# 4. write, directly


def write(*args: Any) -> Any:
    assert KERNEL is not None
    return KERNEL.write(*args)


@st.composite
def write_case(draw: Any) -> dict[str, Any]:
    """Slots (targets, marks, pads, ends) and items, every region within its target."""
    nslots = draw(st.integers(1, 3))
    targets, pads, ends, rows_of, cols_of, slots = [], [], [], [], [], []
    for i in range(nslots):
        name = draw(st.sampled_from(("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32",
                                     "float64")))  # fmt: skip
        dtype = np_dtype(name)
        two = draw(st.booleans())
        shape = (draw(st.integers(0, 6)), draw(st.integers(0, 5))) if two else (draw(st.integers(0, 8)),)
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        targets.append(rng.integers(0, 2, size=shape).astype(dtype) if name == "bool"
                       else rng.integers(-50, 50, size=shape).astype(dtype))  # fmt: skip
        pad = (
            draw(st.sampled_from((0, 1, 3)))
            if name in ("bool", "uint8")
            else draw(st.sampled_from((0, -1, 7)))
        )
        repeat = draw(st.booleans())
        slots.append(slot(i, dtype, bool(pad) if name == "bool" else pad, repeat))
        pads.append(slots[-1].pad.tobytes())
        ends.append(draw(st.integers(0, shape[0])) if repeat else 0)
        rows_of.append(draw(st.integers(0, shape[0])))
        cols_of.append(draw(st.integers(0, shape[1])) if two else 0)
    items = []
    for i in draw(st.lists(st.integers(0, nslots - 1), unique=True, max_size=nslots)):
        t, s = targets[i], slots[i]
        n = draw(st.integers(0, t.shape[0]))
        w = draw(st.integers(0, t.shape[1])) if t.ndim == 2 else 0
        host = None
        if draw(st.integers(0, 4)):
            src_name = draw(st.sampled_from([d for d in SOURCE_DTYPES
                                             if np.can_cast(np_dtype(d), t.dtype, "safe")]))  # fmt: skip
            sdt = np_dtype(src_name)
            extra_r, extra_c = draw(st.integers(0, 2)), draw(st.integers(0, 3))
            shape = (n + extra_r, w + extra_c) if t.ndim == 2 else (n + extra_r,)
            rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
            vlo, vhi = value_range(src_name)
            host = rng.integers(max(vlo, -100), min(vhi, 100), size=shape, endpoint=True).astype(sdt)
            style = draw(st.sampled_from(("plain", "reversed", "strided", "embedded")))
            if style == "reversed":
                host = host[::-1]
            elif style == "strided" and host.ndim == 2:
                host = np.repeat(host, 2, axis=1)[:, ::2]
            elif style == "strided":
                host = np.repeat(host, 2)[::2]
            elif style == "embedded" and host.ndim == 2:
                big = np.zeros((host.shape[0] + 1, host.shape[1] + 2), dtype=sdt)
                big[1:, 1:-1] = host
                host = big[1:, 1:-1]
        items.append((s, host, None, n, w))
    return {"targets": targets, "items": items, "ends": tuple(ends), "pads": tuple(pads),
            "rows_of": rows_of, "cols_of": cols_of, "slots": slots}  # fmt: skip


@needs_kernel
@settings(max_examples=examples(300))
@given(write_case())
def test_write_is_write_live(case: dict[str, Any]) -> None:
    """Same cells, same values, same high-water marks and bytes moved as write_live; or None and nothing
    written."""
    ours = [t.copy() for t in case["targets"]]
    rows_of, cols_of = list(case["rows_of"]), list(case["cols_of"])
    moved = write(ours, case["items"], case["ends"], case["pads"], rows_of, cols_of)
    if moved is None:  # a cast the kernel leaves to numpy: nothing written, no mark changed
        assert all(a.tobytes() == b.tobytes() for a, b in zip(ours, case["targets"]))
        assert (rows_of, cols_of) == (case["rows_of"], case["cols_of"])
        plain = all(h is None or (h.dtype == case["targets"][s.index].dtype and h.flags.c_contiguous)
                    for s, h, _, _, _ in case["items"])  # fmt: skip
        assert not plain  # same dtype, contiguous: the kernel writes those itself
        return
    want = [t.copy() for t in case["targets"]]
    w_rows, w_cols = list(case["rows_of"]), list(case["cols_of"])
    w_moved = 0
    for s, host, _, n, w in case["items"]:
        i = s.index
        rows, cols, end = w_rows[i], w_cols[i], case["ends"][i]
        w_rows[i], w_cols[i] = write_live(want[i], host, s, n, w, end, rows, cols)
        c = max(w, cols) if want[i].ndim == 2 else 1
        w_moved += max(n, end if n else 0, rows) * c * want[i].itemsize  # no live row: nothing repeated
    for got, exp in zip(ours, want):
        assert got.tobytes() == exp.tobytes()
    assert (rows_of, cols_of, moved) == (w_rows, w_cols, w_moved)


def hostile_setup() -> tuple[list[np.ndarray], list[Any], tuple[int, ...], tuple[bytes, ...]]:
    targets = [np.full((4, 3), 5, np.int32), np.full(6, 5, np.int64), np.full((2, 2), 5, np.float32)]
    slots = [
        slot(0, np.dtype(np.int32), -1),
        slot(1, np.dtype(np.int64), 0),
        slot(2, np.dtype(np.float32), 1.5),
    ]
    return targets, slots, (0, 0, 0), tuple(s.pad.tobytes() for s in slots)


@needs_kernel
@pytest.mark.parametrize("bad", [
    "bad-region-rows", "bad-region-cols", "bad-mark", "bad-end", "short-source", "narrow-source",
    "ndim-source", "read-only-target", "negative-n", "not-a-tuple", "short-tuple", "no-index",
    "index-range", "pad-width", "pad-type", "lengths", "targets-tuple", "ends-list", "items-int",
    "non-contiguous-target", "0d-target", "non-buffer-source", "duplicate-slot",
])  # fmt: skip
def test_write_refuses_hostile_input_before_writing_anything(bad: str) -> None:
    targets, slots, ends, pads = hostile_setup()
    src0 = np.arange(12, dtype=np.int32).reshape(4, 3)
    src1 = np.arange(6, dtype=np.int64)
    good = [(slots[0], src0, None, 4, 3), (slots[1], src1, None, 6, 0)]  # written first if not checked first
    rows_of, cols_of = [0, 0, 0], [0, 0, 0]
    last: Any = (slots[2], np.ones((2, 2), np.float32), None, 2, 2)
    args: list[Any] = [targets, None, ends, pads, rows_of, cols_of]
    error: type[Exception] = ValueError
    if bad == "bad-region-rows":
        last = (slots[2], np.ones((3, 2), np.float32), None, 3, 2)
    elif bad == "bad-region-cols":
        last = (slots[2], np.ones((2, 3), np.float32), None, 2, 3)
    elif bad == "bad-mark":
        rows_of[2] = 3
    elif bad == "bad-end":
        args[2] = (0, 0, 3)
    elif bad == "short-source":
        last = (slots[2], np.ones((1, 2), np.float32), None, 2, 2)
    elif bad == "narrow-source":
        last = (slots[2], np.ones((2, 1), np.float32), None, 2, 2)
    elif bad == "ndim-source":
        last = (slots[2], np.ones(4, np.float32), None, 2, 2)
    elif bad == "read-only-target":
        targets[2].flags.writeable = False  # numpy refuses a writable buffer: ValueError
    elif bad == "negative-n":
        last = (slots[2], np.ones((2, 2), np.float32), None, -1, 2)
    elif bad == "not-a-tuple":
        last, error = [slots[2], None, None, 2, 2], TypeError
    elif bad == "short-tuple":
        last, error = (slots[2], None, None, 2), TypeError
    elif bad == "no-index":
        last, error = (object(), None, None, 2, 2), AttributeError
    elif bad == "index-range":
        last, error = (SimpleNamespace(index=3), None, None, 1, 1), IndexError
    elif bad == "pad-width":
        args[3] = (*pads[:2], b"\0\0")
    elif bad == "pad-type":
        args[3], error = (*pads[:2], 0), TypeError
    elif bad == "lengths":
        args[4] = [0, 0]
    elif bad == "targets-tuple":
        args[0], error = tuple(targets), TypeError
    elif bad == "ends-list":
        args[2], error = list(ends), TypeError
    elif bad == "items-int":
        args[1], error = 3, TypeError
    elif bad == "non-contiguous-target":
        targets[2] = np.full((2, 4), 5, np.float32)[:, ::2]
    elif bad == "0d-target":
        targets[2] = np.array(5, np.float32)
    elif bad == "non-buffer-source":
        last, error = (slots[2], [[1.0, 2.0], [3.0, 4.0]], None, 2, 2), TypeError
    elif bad == "duplicate-slot":  # the marks are read before any write: one item per buffer
        last = (slots[0], src0, None, 2, 3)
    if args[1] is None:
        args[1] = [*good, last]
    before = [t.tobytes() for t in targets]
    marks = (list(args[4]), list(args[5]))
    with pytest.raises(error):
        write(*args)
    assert [t.tobytes() for t in targets] == before  # no byte, in any target, before the bad item either
    assert (args[4], args[5]) == marks


@needs_kernel
def test_write_argument_count() -> None:
    with pytest.raises(TypeError, match="takes 6 arguments"):
        write([], [], (), (), [])


@needs_kernel
@pytest.mark.parametrize(
    "style", ["every-other-column", "reversed-rows", "reversed-1d", "wider", "narrow-cast"]
)
def test_write_source_layouts_give_the_right_bytes_or_none(style: str) -> None:
    rng = np.random.default_rng(11)
    two = style != "reversed-1d"
    base = rng.integers(-100, 100, size=(5, 8) if two else (9,)).astype(np.int32)
    src = {
        "every-other-column": lambda: base[:, ::2],
        "reversed-rows": lambda: base[::-1],
        "reversed-1d": lambda: base[::-1],
        "wider": lambda: base,
        "narrow-cast": lambda: base.astype(np.int16)[::-1],
    }[style]()
    t = np.full((6, 4), 9, np.int32) if two else np.full(10, 9, np.int32)
    s = slot(0, t.dtype, -1)
    n, w = (4, 3) if two else (7, 0)
    ours, rows_of, cols_of = t.copy(), [2], [4 if two else 0]
    moved = write([ours], [(s, src, None, n, w)], (0,), (s.pad.tobytes(),), rows_of, cols_of)
    want = t.copy()
    marks = write_live(want, src, s, n, w, 0, 2, 4 if two else 0)
    if moved is None:
        assert ours.tobytes() == t.tobytes() and style in ("every-other-column", "reversed-1d")
        return
    assert ours.tobytes() == want.tobytes()
    assert (rows_of[0], cols_of[0]) == marks
    live = ours[:n, :w] if two else ours[:n]
    assert np.array_equal(live, src[:n, :w] if two else src[:n])
    if style in ("reversed-rows", "wider", "narrow-cast"):
        assert moved == 4 * 4 * 4  # the kernel did it: rows max(4, 2) x cols max(3, 4) x 4 bytes


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint8", "int16", "int32", "int64", "float32"])
def test_bool_source_with_non_0_1_bytes(dtype: str) -> None:
    """Regression (B2, fixed in 394d3e3): a bool byte 2 becomes 1 in a number buffer on both paths."""
    spec = GraphSpec.model_validate({
        "version": 1, "name": "b2", "constants": {"max_num_seqs": 2},
        "capture": {"tokens_per_request": 1, "sizes": [2]},
        "buffers": {"x": {"dtype": dtype, "rows": "requests", "pad": False if dtype == "bool" else 0}},
    })  # fmt: skip
    nat, ref = twins(spec)
    bad = np.array([2, 1], np.uint8).view(np.bool_)
    assert both(nat, ref, lambda sb: sb.refresh(2, {"x": bad})) == ("ok", 2)
    if dtype != "bool":
        assert nat.full["x"].tolist() == [1, 1]


@needs_kernel
@pytest.mark.parametrize("shift", [1, -1, 0])
def test_write_from_a_source_inside_its_target(shift: int) -> None:
    """A source that shares bytes with its target (a view of the slab): the bytes numpy's overlap-safe copy
    gives, or None with nothing written."""
    for two in (False, True):
        t = np.arange(40, dtype=np.int32).reshape(8, 5) if two else np.arange(10, dtype=np.int32)
        ours = t.copy()
        src = ours[1:] if shift == 1 else (ours[:-1][::-1] if shift == -1 else ours)
        n, w = (6, 4) if two else (6, 0)
        s = slot(0, t.dtype, -1)
        rows_of, cols_of = [t.shape[0]], [5 if two else 0]
        moved = write([ours], [(s, src, None, n, w)], (0,), (s.pad.tobytes(),), rows_of, cols_of)
        want = t.copy()
        wsrc = want[1:] if shift == 1 else (want[:-1][::-1] if shift == -1 else want)
        marks = write_live(want, wsrc, s, n, w, 0, t.shape[0], 5 if two else 0)
        if moved is None:
            assert ours.tobytes() == t.tobytes()
        else:
            assert ours.tobytes() == want.tobytes() and (rows_of[0], cols_of[0]) == marks


def test_refresh_from_views_of_the_slab() -> None:
    """Sources that are views of the buffers themselves (their own rows, shifted; another buffer's)."""
    spec = GraphSpec.model_validate({
        "version": 1, "name": "views", "constants": {"max_num_seqs": 8, "w": 4},
        "capture": {"tokens_per_request": 1, "sizes": [4, 8]},
        "buffers": {
            "a": {"dtype": "int32", "rows": "requests", "pad": -1},
            "b": {"dtype": "int32", "rows": "requests", "pad": 0},
            "t": {"dtype": "int64", "rows": "requests", "cols": "w", "pad": 7},
        },
    })  # fmt: skip
    nat, ref = twins(spec)
    first = {"a": np.arange(8, dtype=np.int32), "b": np.arange(8, dtype=np.int32) * 3,
             "t": np.arange(32, dtype=np.int64).reshape(8, 4)}  # fmt: skip
    assert both(nat, ref, lambda sb: sb.refresh(8, first)) == ("ok", 8)
    steps: list[Callable[[StaticBuffers], dict[str, Any]]] = [
        lambda sb: {"a": sb.full["a"][1:5], "b": sb.full["a"][3:7], "t": sb.full["t"][2:6, :3]},
        lambda sb: {"a": sb.full["b"][:4], "b": sb.full["a"][:4], "t": sb.full["t"][:4].flip(0)},
        lambda sb: {"a": sb.full["a"][2:6].numpy(), "b": sb.full["b"][1:5].numpy(),
                    "t": sb.full["t"][1:5].numpy()},
    ]  # fmt: skip
    for make in steps:
        assert both(nat, ref, lambda sb, m=make: sb.refresh(4, m(sb))) == ("ok", 4)


@pytest.mark.parametrize("staging", [None, 2], ids=["in-place", "staged"])
@pytest.mark.parametrize("path", ["kernel", "numpy"])
def test_staged_empty_refresh_of_a_repeat_last_buffer(staging: int | None, path: str) -> None:
    """Regression (B3, fixed in a80f120): 0 live requests leave a repeat_last buffer at its pad, staged or
    not, on both paths (staged, no stale staging rows are uploaded), and count no repeated rows."""
    spec = GraphSpec.model_validate({
        "version": 1, "name": "b3", "constants": {"max_num_seqs": 4},
        "capture": {"tokens_per_request": 1, "sizes": [4]},
        "buffers": {"x": {"dtype": "int32", "rows": "requests", "pad": "repeat_last"}},
    })  # fmt: skip
    with nullcontext() if path == "kernel" else numpy_path():
        sb = StaticBuffers(spec, upload_copies=staging)
        assert sb.refresh(4, {"x": np.array([5, 6], np.int32)}) == 2
        assert sb.view(4)["x"].tolist() == [5, 6, 6, 6]
        for _ in range(2):  # the second lands in the staging copy the first refresh used
            assert sb.refresh(4, {"x": np.zeros(0, np.int32)}, num_reqs=0) == 0
            assert sb.view(4)["x"].tolist() == [0, 0, 0, 0]
        assert sb.stats.last_bytes == 0  # the mark is 0 after the first empty refresh: nothing touched


# ----------------------------------------------------------------------------------------------------------
# 5. Large (streamed) copies


STREAM_MIN = getattr(KERNEL, "STREAM_MIN", 16 << 20)  # bytes a write copies above which it streams


@needs_kernel
@pytest.mark.parametrize("style", ["contiguous", "wider", "reversed", "1d", "1d-unaligned", "cast"])
@pytest.mark.parametrize("streamed", [False, True], ids=["cached", "streamed"])
def test_large_writes_are_write_live(style: str, streamed: bool) -> None:
    """Copies just below and just above ``STREAM_MIN`` in total (cached stores, then streaming stores)."""
    rng = np.random.default_rng(5)
    if style.startswith("1d"):
        dtype = np.uint8 if style == "1d-unaligned" else np.int32
        count = STREAM_MIN // np.dtype(dtype).itemsize + (16 if streamed else -16)
        backing = np.full(count + 1, 7, dtype)
        t = backing[1:] if style == "1d-unaligned" else backing[:count]  # off 16-byte alignment
        src = rng.integers(0, 100, size=count + 5).astype(dtype)
        n, w, rows, cols = count, 0, count, 0
    else:  # "contiguous": target rows as wide as the live width, one whole copy; else row by row
        width = 1024 if style == "contiguous" else 1040
        n = STREAM_MIN // (1024 * 4) + (1 if streamed else -1)
        t = np.full((n + 5, width), 7, np.int32)
        full = rng.integers(-1000, 1000, size=(n + 5, 1100)).astype(np.int16 if style == "cast" else np.int32)
        src = {"contiguous": np.ascontiguousarray(full[:, :1024]), "wider": full, "reversed": full[::-1],
               "cast": full}[style]  # fmt: skip
        w, rows, cols = 1024, n + 5, width
    assert (n * max(w, 1) * t.itemsize > STREAM_MIN) == streamed
    s = slot(0, t.dtype, 3)
    ours, rows_of, cols_of = t.copy(), [rows], [cols]
    moved = write([ours], [(s, src, None, n, w)], (0,), (s.pad.tobytes(),), rows_of, cols_of)
    want = t.copy()
    marks = write_live(want, src, s, n, w, 0, rows, cols)
    assert moved == rows * max(cols, 1) * t.itemsize
    assert ours.tobytes() == want.tobytes()
    assert (rows_of[0], cols_of[0]) == marks


@pytest.mark.parametrize("staging", [None, 2], ids=["in-place", "staged"])
def test_large_refreshes_through_static_buffers(staging: int | None) -> None:
    """A buffer whose live rows exceed ``STREAM_MIN``, refreshed from a bound source wider than the live
    width and from a mapping source."""
    big = STREAM_MIN // (1024 * 4) + 64
    spec = GraphSpec.model_validate({
        "version": 1, "name": "large", "constants": {"max_num_seqs": big, "width": 1024},
        "capture": {"tokens_per_request": 1, "sizes": [512, big]},
        "buffers": {"big": {"dtype": "int32", "rows": "requests", "cols": "width", "pad": -1, "min": -1}},
    })  # fmt: skip
    nat, ref = twins(spec, upload_copies=staging)
    rng = np.random.default_rng(9)
    persistent_src = rng.integers(0, 1 << 30, size=(big + 6, 1100)).astype(np.int32)
    bound = {id(nat): nat.bind({"big": persistent_src}), id(ref): ref.bind({"big": persistent_src})}
    for n, w in ((big, 1024), (big, 1000), (512, 1024)):
        size = 512 if n <= 512 else big
        step = lambda sb, s=size, k=n, x=w: sb.refresh(s, bound[id(sb)], num_reqs=k, widths={"big": x})  # noqa: E731
        assert both(nat, ref, step) == ("ok", n)
        persistent_src[:8] += 1  # the bound memory is read at each refresh
    mapping = {"big": rng.integers(0, 1 << 30, size=(big, 1024)).astype(np.int32)}
    assert both(nat, ref, lambda sb: sb.refresh(big, mapping)) == ("ok", big)
    assert np.array_equal(nat.full["big"].numpy(), mapping["big"])
    assert nat.stats.last_bytes == big * 1024 * 4


# ----------------------------------------------------------------------------------------------------------
# 6. Fallback, 7. built where it can be

FALLBACK = textwrap.dedent(
    """
    import sys
    import torch
    import graphbuf
    import graphbuf.buffers.native as native

    assert native.KERNEL is None, native.KERNEL
    sb = graphbuf.StaticBuffers("gemma4-31b-it-mtp", overrides={"num_blocks": 64, "max_model_len": 512})
    for size, sources in torch.load(sys.argv[1], weights_only=False):
        sb.refresh(size, sources)
    with open(sys.argv[2], "wb") as f:
        f.write(sb.slab.numpy().tobytes())
    print(sb.stats.refreshes, sb.stats.last_bytes, sb.stats.total_bytes)
    """
)


def test_fallback_without_the_kernel_writes_the_same_bytes(tmp_path: Path) -> None:
    """``GRAPHBUF_NATIVE=0`` in a fresh process: no kernel, and the shipped spec refreshes to the bytes and
    stats this process (kernel built) leaves."""
    sb = StaticBuffers("gemma4-31b-it-mtp", overrides=SHIPPED_OVERRIDES)
    steps = [(b.size, b.sources) for b in sample(batches(sb), seed=4, count=3)]
    for size, sources in steps:
        sb.refresh(size, sources)
    torch.save(steps, tmp_path / "steps.pt")
    env = {**os.environ, "GRAPHBUF_NATIVE": "0"}
    out = subprocess.run(
        [sys.executable, "-c", FALLBACK, str(tmp_path / "steps.pt"), str(tmp_path / "slab.bin")],
        env=env, capture_output=True, text=True, check=False, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = (tmp_path / "slab.bin").read_bytes()
    mine = slab_bytes(sb)
    assert len(got) == len(mine)
    for b in sb.plan.buffers:  # alignment gaps hold whatever the allocator left
        assert got[b.offset : b.offset + b.nbytes] == mine[b.offset : b.offset + b.nbytes], b.name
    s = sb.stats
    assert out.stdout.split() == [str(s.refreshes), str(s.last_bytes), str(s.total_bytes)]
    assert s.refreshes == 3 and s.total_bytes > 0


def test_built_where_a_compiler_and_headers_exist() -> None:
    """CI has both: the extension must not silently fail to build there; elsewhere numpy is the path."""
    can_build = (shutil.which("cc") or shutil.which("gcc")) and os.path.exists(
        os.path.join(sysconfig.get_paths()["include"], "Python.h")
    )
    if os.environ.get("GRAPHBUF_NATIVE", "1") == "0":
        assert native.KERNEL is None
    elif can_build:
        assert native.KERNEL is not None
        assert callable(native.KERNEL.fit) and callable(native.KERNEL.write)
    else:
        assert native.KERNEL is None


# ----------------------------------------------------------------------------------------------------------
# Found under ASan/UBSan: code run by a slot's ``index``, misaligned memory, a zero-width buffer


class _Hooked:
    """A slot whose ``index`` runs ``hook`` first (Python code inside the kernel's first phase)."""

    def __init__(self, index: int, hook: Callable[[], None]) -> None:
        self._index, self._hook = index, hook

    @property
    def index(self) -> int:
        self._hook()
        return self._index


@needs_kernel
@pytest.mark.parametrize("victim", ["items", "targets", "rows_of", "cols_of"])
def test_write_survives_python_code_run_by_a_slot_index(victim: str) -> None:
    """The kernel works on its own copy of ``items`` and rechecks the lists after each lookup."""
    pads = (np.int32(0).tobytes(),) * 2
    targets = [np.full(4, 5, np.int32), np.full(4, 5, np.int32)]
    rows_of, cols_of = [0, 0], [0, 0]
    items: list[Any] = []
    lists = {"items": items, "targets": targets, "rows_of": rows_of, "cols_of": cols_of}
    items += [
        (_Hooked(0, lists[victim].clear), np.arange(4, dtype=np.int32), None, 4, 0),
        (_Hooked(1, lambda: None), None, None, 0, 0),
    ]
    saved = list(targets)
    before = [t.tobytes() for t in saved]
    if victim == "items":  # the kernel's own copy of items is unaffected: both written
        assert write(targets, items, (0, 0), pads, rows_of, cols_of) == 16
        assert lists["targets"][0].tolist() == [0, 1, 2, 3]
        return
    with pytest.raises(RuntimeError, match="changed size during the call"):
        write(targets, items, (0, 0), pads, rows_of, cols_of)
    assert [t.tobytes() for t in saved] == before


def _misaligned(values: list[int], dtype: type) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    a = np.frombuffer(bytearray(len(values) * itemsize + 1), dtype=dtype, offset=1, count=len(values))
    a[...] = values
    assert not a.flags.aligned
    return a


@needs_kernel
@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64])
def test_misaligned_memory_takes_the_numpy_path(dtype: type) -> None:
    src = _misaligned([3, 4, 5], dtype)
    assert fit(src, 3, 0, 0, 10) is None and fit(src.reshape(1, 3), 1, 3, 0, 10) is None
    s = slot(0, np.dtype(dtype), 0)
    aligned = np.zeros(3, dtype)
    assert write([aligned], [(s, src, None, 3, 0)], (0,), (s.pad.tobytes(),), [0], [0]) is None
    target = _misaligned([9, 9, 9], dtype)
    assert write([target], [(s, aligned, None, 3, 0)], (0,), (s.pad.tobytes(),), [0], [0]) is None
    assert target.tolist() == [9, 9, 9]  # None: nothing written
    spec = GraphSpec.model_validate({
        "version": 1, "name": "m", "constants": {"max_num_seqs": 4},
        "capture": {"tokens_per_request": 1, "sizes": [4]},
        "buffers": {"x": {"dtype": "int64", "rows": "requests", "pad": 0, "min": 0, "max": 6}},
    })  # fmt: skip
    sb = StaticBuffers(spec)
    assert sb.refresh(4, {"x": src}) == 3
    assert sb.view(4)["x"].tolist() == [3, 4, 5, 0]
    with pytest.raises(graphbuf.RefreshError, match="above max 6"):  # bounds still checked (numpy's)
        sb.refresh(4, {"x": _misaligned([3, 9, 5], dtype)})


@needs_kernel
def test_a_zero_width_buffer_of_many_rows_costs_nothing() -> None:
    """Repeating a row of no bytes over 2**40 rows is no work (it once looped 2**40 times)."""
    s = slot(0, np.dtype(np.int32), 0)
    t = np.zeros((2**40, 0), np.int32)
    rows_of, cols_of = [0], [0]
    assert write([t], [(s, None, None, 1, 0)], (2**40,), (s.pad.tobytes(),), rows_of, cols_of) == 0
    assert (rows_of, cols_of) == ([2**40], [0])


# ----------------------------------------------------------------------------------------------------------
# A source that is a view of another buffer of the same refresh (found by the outside review)

ALIAS_SPEC = GraphSpec.model_validate({
    "version": 1, "name": "alias", "constants": {"max_num_seqs": 8},
    "capture": {"tokens_per_request": 1, "sizes": [4, 8]},
    "buffers": {
        "a": {"dtype": "int32", "rows": "requests", "pad": 100},
        "b": {"dtype": "int32", "rows": "requests", "pad": 0, "min": 0, "max": 5},
    },
})  # fmt: skip


@pytest.mark.parametrize("staging", [None, 2], ids=["in-place", "staged"])
@pytest.mark.parametrize("path", ["kernel", "numpy"])
def test_a_source_inside_another_buffer_is_read_before_that_buffer_is_written(
    path: str, staging: int | None
) -> None:
    """``b`` from rows of ``a``, which the same refresh pads: ``b`` gets the values that were checked
    (2, 3), not ``a``'s pad (100, above ``b``'s max) written a moment earlier."""
    with nullcontext() if path == "kernel" else numpy_path():
        sb = StaticBuffers(ALIAS_SPEC, upload_copies=staging)
        sb.refresh(8, {"a": np.arange(8, dtype=np.int32) % 5, "b": np.zeros(8, np.int32)})
        assert sb.refresh(4, {"a": np.array([1, 1], np.int32), "b": sb.full["a"][2:4]}) == 2
        assert sb.view(4)["a"].tolist() == [1, 1, 100, 100]
        assert sb.view(4)["b"].tolist() == [2, 3, 0, 0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_device_source_inside_another_buffer_is_read_before_the_uploads() -> None:
    sb = StaticBuffers(ALIAS_SPEC, device="cuda")
    sb.refresh(8, {"a": np.arange(8, dtype=np.int32) % 5, "b": np.zeros(8, np.int32)})
    assert sb.refresh(4, {"a": np.array([1, 1], np.int32), "b": sb.full["a"][2:4]}) == 2
    torch.cuda.synchronize()
    assert sb.view(4)["b"].tolist() == [2, 3, 0, 0]
