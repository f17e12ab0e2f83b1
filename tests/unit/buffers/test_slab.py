"""StaticBuffers: one slab, address-stable views, poison; and a Hypothesis state machine driving refresh
with valid and invalid inputs against a model of what every view must hold, and replaying graphs captured
over the buffers against eager execution."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import graphbuf
import graphbuf.buffers.slab
from graphbuf import GraphSpec, PlanTooLargeError, RefreshError, RowsError, StaticBuffers, WidthError
from graphbuf.buffers.slab import poison_value
from graphbuf.graphs.graph import Graph
from graphbuf.planning.planner import BufferPlan, Plan
from graphbuf.testing import examples

Mapping = dict[str, Any]


@pytest.fixture
def small_spec(spec_mapping: Callable[[], Mapping]) -> GraphSpec:
    return GraphSpec.model_validate(spec_mapping())


def test_one_slab_holds_every_buffer(small_spec: GraphSpec) -> None:
    sb = StaticBuffers(small_spec)
    assert sb.slab.dtype == torch.uint8 and sb.slab.dim() == 1
    assert sb.slab.numel() == sb.plan.total_bytes
    assert sb.device == torch.device("cpu") and sb.slab.device.type == "cpu"
    base = sb.slab.untyped_storage().data_ptr()
    for name, t in sb.full.items():
        b = sb.plan[name]
        assert t.untyped_storage().data_ptr() == base
        assert t.data_ptr() == sb.slab.data_ptr() + b.offset
        assert (t.dtype, tuple(t.shape)) == (b.dtype, b.shape)
    assert sb.names == sb.plan.names == tuple(sb.full)


def test_capture_sizes_are_a_sorted_tuple(small_spec: GraphSpec) -> None:
    assert small_spec.capture.sizes == [8, 2, 4]
    assert StaticBuffers(small_spec).capture_sizes == (2, 4, 8)


def test_views_have_the_captured_rows_and_share_storage(small_spec: GraphSpec) -> None:
    sb = StaticBuffers(small_spec)
    for size in sb.capture_sizes:
        view = sb.view(size)
        assert tuple(view) == sb.names
        for name, t in view.items():
            assert tuple(t.shape) == sb.plan.shape_at(sb.plan[name], size)
            assert t.data_ptr() == sb.full[name].data_ptr()
            assert t.untyped_storage().data_ptr() == sb.slab.untyped_storage().data_ptr()
        assert sb.addresses(size) == tuple(t.data_ptr() for t in view.values())
    assert sb.addresses(2) == sb.addresses(4) == sb.addresses(8)
    assert [tuple(sb.view(s)["query_start_loc"].shape) for s in sb.capture_sizes] == [(2,), (3,), (5,)]
    sb.view(2)["seq_lens"][0] = 42  # a write through one size's view is seen through every other
    assert sb.view(8)["seq_lens"][0].item() == 42
    assert sb.full["seq_lens"][0].item() == 42


def test_size_dependent_columns_are_column_slices_of_one_allocation(
    spec_mapping: Callable[[], Mapping],
) -> None:
    d = spec_mapping()
    d["buffers"]["block_table"]["cols"] = "min(max_blocks, requests + 1)"
    sb = StaticBuffers(GraphSpec.model_validate(d))
    small, big = sb.view(2)["block_table.a"], sb.view(8)["block_table.a"]
    assert tuple(small.shape) == (1, 2) and tuple(big.shape) == (4, 4)
    assert small.data_ptr() == big.data_ptr()
    assert small.stride() == big.stride() == (4, 1)


def test_view_and_mappings_are_read_only(small_spec: GraphSpec) -> None:
    sb = StaticBuffers(small_spec)
    with pytest.raises(RefreshError, match=r"view\(size=6\): not a capture size; sizes: 2, 4, 8"):
        sb.view(6)
    with pytest.raises(TypeError):
        sb.view(2)["seq_lens"] = torch.zeros(1)  # type: ignore[index]
    with pytest.raises(TypeError):
        sb.full["seq_lens"] = torch.zeros(1)  # type: ignore[index]


def test_fresh_slab_holds_pad_values(small_spec: GraphSpec) -> None:
    sb = StaticBuffers(small_spec)
    assert (sb.full["block_table.a"] == 0).all()
    assert (sb.full["slot_mapping"] == -1).all()
    assert (sb.full["query_start_loc"] == 0).all()  # repeat_last starts at 0
    assert (sb.full["scratch"] == 0.5).all()


def test_poison_fills_sentinels(spec_mapping: Callable[[], Mapping]) -> None:
    d = spec_mapping()
    d["buffers"].update(
        flag={"dtype": "bool", "rows": "tokens"},
        byte={"dtype": "uint8", "rows": "tokens"},
        brain={"dtype": "bfloat16", "rows": "requests", "cols": 2},
    )
    sb = StaticBuffers(GraphSpec.model_validate(d), poison=True)
    assert (sb.full["block_table.a"] == torch.iinfo(torch.int32).min).all()
    assert (sb.full["slot_mapping"] == torch.iinfo(torch.int64).min).all()
    assert torch.isnan(sb.full["scratch"]).all() and torch.isnan(sb.full["brain"]).all()
    assert sb.full["flag"].all()
    assert (sb.full["byte"] == 0).all()
    assert math.isnan(poison_value(torch.float16)) and poison_value(torch.int8) == -128
    assert poison_value(torch.bool) is True


def test_a_refresh_overwrites_every_poisoned_row_of_the_view(small_spec: GraphSpec) -> None:
    sb = StaticBuffers(small_spec, poison=True)
    sb.refresh(
        8,
        {
            "block_table.a": [[1]],
            "block_table.b": [[2]],
            "seq_lens": [3],
            "query_start_loc": [0, 2],
            "slot_mapping": [5, 6],
        },
    )
    for name, t in sb.view(8).items():
        if name != "scratch":
            assert (t != poison_value(t.dtype)).all(), name
    assert torch.isnan(sb.view(8)["scratch"]).all()  # keep buffer, never written


def test_constructor_accepts_plan_name_overrides_and_limit(small_spec: GraphSpec) -> None:
    p = graphbuf.plan(small_spec, overrides={"max_blocks": 6})
    assert StaticBuffers(p).plan is p
    assert StaticBuffers(small_spec, overrides={"max_blocks": 6}).full["block_table.b"].shape == (4, 6)
    gemma = StaticBuffers("gemma4-31b-it-mtp", "cpu", overrides={"num_blocks": 64})
    assert gemma.plan["block_table.full"].max == 63
    assert repr(gemma) == "StaticBuffers('gemma4-31b-it-mtp', device='cpu', buffers=6, bytes=8192)"
    with pytest.raises(PlanTooLargeError):
        StaticBuffers(small_spec, max_bytes=1024)


def test_too_large_plan_is_refused_before_allocating(
    spec_mapping: Callable[[], Mapping], monkeypatch: pytest.MonkeyPatch
) -> None:
    class NoAlloc:
        def __getattr__(self, name: str) -> Any:
            if name in ("empty", "zeros", "full", "ones"):
                raise AssertionError(f"torch.{name} called: the slab was allocated")
            return getattr(torch, name)

    monkeypatch.setattr(graphbuf.buffers.slab, "torch", NoAlloc())
    d = spec_mapping()
    d["buffers"]["block_table"]["cols"] = 2**50  # petabytes
    with pytest.raises(PlanTooLargeError, match=r"limits\.max_bytes"):
        StaticBuffers(GraphSpec.model_validate(d))


# ----------------------------------------------------------------------------------------------------------
# State machine


def _expected_view(p: Plan, b: BufferPlan, size: int, src: np.ndarray) -> np.ndarray:
    """What ``view(size)[b.name]`` must hold after a refresh with ``src`` (the contract, written out)."""
    shape = p.shape_at(b, size)
    np_dtype = torch.empty(0, dtype=b.dtype).numpy().dtype
    out = np.full(shape, 0 if b.pad == "repeat_last" else b.pad, dtype=np_dtype)
    n = src.shape[0]
    if len(shape) == 1:
        out[:n] = src
    else:
        out[:n, : src.shape[1]] = src
    if b.pad == "repeat_last" and n:
        out[n:] = out[n - 1]
    return out


_CONTAINERS = ("list", "numpy", "torch")
# Element types that cast safely into each buffer and hold the values the machine draws for it.
_SAFE_DTYPES: dict[str, tuple[Any, ...]] = {
    "block_table": (np.int32, np.int16, np.uint8),
    "seq_lens": (np.int32, np.int16, np.int8),
    "query_start_loc": (np.int32, np.uint8),
    "slot_mapping": (np.int64,),
    "scratch": (np.float32,),
}


def _read_all(views: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A graph-safe function of every buffer (gather by block ids, reductions, arithmetic)."""
    weights = torch.arange(32, dtype=torch.int64) * 3 + 1
    a = weights[views["block_table.a"].long().clamp(0, 31)].sum(1) + views["seq_lens"]
    b = views["block_table.b"].float().mean(1) * views["seq_lens"].float()
    return a, b, views["query_start_loc"].cumsum(0), views["slot_mapping"] * 2, views["scratch"] * 1.5


class BuffersMachine(RuleBasedStateMachine):
    """Refresh a small StaticBuffers at random sizes, live counts, widths and containers; break the input in
    one of several ways; replay graphs captured once per size over the buffers; check addresses, contents,
    the all-or-nothing rule, and that every replay equals eager execution on the same buffers."""

    spec: ClassVar[GraphSpec]
    snapshot: ClassVar[Callable[[StaticBuffers], bytes]]
    tally: ClassVar[dict[str, int]]  # steps run, by kind, over all examples

    def __init__(self) -> None:
        super().__init__()
        self.sb = StaticBuffers(self.spec, poison=True)
        self.plan = self.sb.plan
        self.slab_ptr = self.sb.slab.data_ptr()
        self.addresses = {s: self.sb.addresses(s) for s in self.sb.capture_sizes}
        self.model_size: int | None = None
        self.expected: dict[str, np.ndarray] = {}
        self.keep_expected = np.full(3, np.nan, dtype=np.float32)
        self.graphs: dict[int, tuple[Graph, tuple[torch.Tensor, ...]]] = {}
        for s in self.sb.capture_sizes:
            graph = Graph("cpu")
            with graph.capture():
                out = _read_all(self.sb.view(s))
            self.graphs[s] = (graph, out)

    # -- generating sources ---------------------------------------------------------------------------------

    def _container(self, data: st.DataObject, arr: np.ndarray, dtypes: tuple[Any, ...]) -> Any:
        kind = data.draw(st.sampled_from(_CONTAINERS))
        if kind == "list":
            return arr.tolist()
        dtype = data.draw(st.sampled_from(dtypes))
        if kind == "numpy":
            return arr.astype(dtype)
        return torch.from_numpy(arr.astype(dtype))

    def _ints(self, data: st.DataObject, shape: tuple[int, ...], lo: int, hi: int) -> np.ndarray:
        count = math.prod(shape)
        values = data.draw(st.lists(st.integers(lo, hi), min_size=count, max_size=count))
        return np.array(values, dtype=np.int64).reshape(shape)

    def _draw_valid(
        self, data: st.DataObject, size: int, n: int
    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        cols = self.plan["block_table.a"].shape[1]
        arrays: dict[str, np.ndarray] = {}
        for g in self.spec.groups:
            width = data.draw(st.integers(0, cols), label=f"width.{g}")
            arrays[f"block_table.{g}"] = self._ints(data, (n, width), 0, 31)
        arrays["seq_lens"] = self._ints(data, (n,), 0, 64)
        arrays["query_start_loc"] = self._ints(data, (n + 1,), 0, 8)
        arrays["slot_mapping"] = self._ints(data, (2 * n,), -1, 10**12)
        sources = {
            name: self._container(data, arr, _SAFE_DTYPES[name.split(".")[0]]) for name, arr in arrays.items()
        }
        if data.draw(st.booleans(), label="give keep"):
            k = data.draw(st.integers(0, 3), label="keep rows")
            floats = data.draw(
                st.lists(st.floats(-1e6, 1e6, width=32, allow_subnormal=False), min_size=k, max_size=k)
            )
            arrays["scratch"] = np.array(floats, dtype=np.float32)
            sources["scratch"] = self._container(data, arrays["scratch"], _SAFE_DTYPES["scratch"])
        order = data.draw(st.permutations(list(sources)), label="order")
        return {k: sources[k] for k in order}, arrays

    # -- rules ----------------------------------------------------------------------------------------------

    @rule(data=st.data())
    def refresh_valid(self, data: st.DataObject) -> None:
        size = data.draw(st.sampled_from(self.sb.capture_sizes), label="size")
        cap = size // self.plan.tokens_per_request
        n = data.draw(st.one_of(st.just(cap), st.integers(0, cap)), label="live")
        sources, arrays = self._draw_valid(data, size, n)
        num_reqs = n if data.draw(st.booleans(), label="pass num_reqs") else None
        assert self.sb.refresh(size, sources, num_reqs=num_reqs) == n
        self.tally["valid"] = self.tally.get("valid", 0) + 1
        self.tally["empty"] = self.tally.get("empty", 0) + (n == 0)
        self.model_size = size
        self.expected = {
            b.name: _expected_view(self.plan, b, size, arrays[b.name])
            for b in self.plan.buffers
            if not b.keep
        }
        if "scratch" in arrays:
            self.keep_expected = _expected_view(self.plan, self.plan["scratch"], size, arrays["scratch"])

    @rule(
        data=st.data(),
        fault=st.sampled_from(
            ["too_wide", "too_many_rows", "out_of_bounds", "wrong_dtype", "missing", "disagree"]
        ),
    )
    def refresh_invalid(self, data: st.DataObject, fault: str) -> None:
        size = data.draw(st.sampled_from(self.sb.capture_sizes), label="size")
        cap = size // self.plan.tokens_per_request
        n = data.draw(st.integers(0, cap), label="live")
        sources, _ = self._draw_valid(data, size, n)
        error: type[RefreshError] = RefreshError
        if fault == "too_wide":
            g = data.draw(st.sampled_from(self.spec.groups))
            width = self.plan[f"block_table.{g}"].shape[1] + data.draw(st.integers(1, 3))
            sources[f"block_table.{g}"] = np.zeros((n, width), dtype=np.int32)  # even with 0 rows
            error = WidthError
        elif fault == "too_many_rows":
            extra = data.draw(st.integers(1, 3))
            sources["seq_lens"] = list(range(cap + extra))
            error = RowsError
        elif fault == "out_of_bounds":
            name, value = data.draw(
                st.sampled_from(
                    [
                        ("query_start_loc", 9),
                        ("query_start_loc", -1),
                        ("seq_lens", 65),
                        ("seq_lens", -1),
                        ("block_table.a", 32),
                        ("block_table.b", -5),
                        ("slot_mapping", -2),
                    ]
                )
            )
            if name == "query_start_loc":
                arr = np.zeros(n + 1, dtype=np.int32)
            elif name == "slot_mapping":
                arr = np.zeros(max(2 * n, 2), dtype=np.int64)
            elif name == "seq_lens":
                arr = np.zeros(max(n, 1), dtype=np.int32)
            else:
                arr = np.zeros((max(n, 1), 2), dtype=np.int32)
            arr.flat[data.draw(st.integers(0, arr.size - 1))] = value
            sources[name] = self._container(data, arr, (arr.dtype,))
        elif fault == "wrong_dtype":
            sources["seq_lens"] = data.draw(
                st.sampled_from(
                    [
                        torch.zeros(n, dtype=torch.int64),
                        np.zeros(n, dtype=np.float64),
                        np.zeros(n, dtype=np.int64),
                        torch.zeros(n, dtype=torch.float32),
                        [0.5] * max(n, 1),
                    ]
                )
            )
        elif fault == "missing":
            required = [b.name for b in self.plan.buffers if not b.keep]
            del sources[data.draw(st.sampled_from(required))]
        else:
            rows = n + 1 if n < cap else n - 1
            sources["seq_lens"] = list(range(rows))
        before = self.snapshot(self.sb)
        with pytest.raises(error):
            self.sb.refresh(size, sources)
        assert self.snapshot(self.sb) == before
        self.tally[fault] = self.tally.get(fault, 0) + 1

    @rule(data=st.data())
    def replay_equals_eager(self, data: st.DataObject) -> None:
        size = data.draw(st.sampled_from(self.sb.capture_sizes), label="replay size")
        graph, static = self.graphs[size]
        ptrs = [t.data_ptr() for t in static]
        graph.replay()
        want = _read_all(self.sb.view(size))
        for got, exp in zip(static, want, strict=True):
            torch.testing.assert_close(got, exp, rtol=0, atol=0, equal_nan=True)
        assert [t.data_ptr() for t in static] == ptrs  # outputs are rewritten in place
        self.tally["replay"] = self.tally.get("replay", 0) + 1

    # -- invariants -----------------------------------------------------------------------------------------

    @invariant()
    def addresses_never_change(self) -> None:
        assert self.sb.slab.data_ptr() == self.slab_ptr
        for s, ptrs in self.addresses.items():
            assert self.sb.addresses(s) == ptrs

    @invariant()
    def views_match_the_model(self) -> None:
        for s in self.sb.capture_sizes:
            np.testing.assert_array_equal(self.sb.view(s)["scratch"].numpy(), self.keep_expected)
        if self.model_size is None:
            return
        view = self.sb.view(self.model_size)
        for name, want in self.expected.items():
            np.testing.assert_array_equal(view[name].numpy(), want, err_msg=name)


def test_static_buffers_state_machine(
    small_spec: GraphSpec, slab_bytes: Callable[[StaticBuffers], bytes]
) -> None:
    class Machine(BuffersMachine):
        spec = small_spec
        snapshot = staticmethod(slab_bytes)
        tally: ClassVar[dict[str, int]] = {}

    run_state_machine_as_test(
        Machine,
        settings=settings(max_examples=examples(200), stateful_step_count=10),
    )
    faults = ("too_wide", "too_many_rows", "out_of_bounds", "wrong_dtype", "missing", "disagree")
    assert Machine.tally["valid"] >= 200, Machine.tally
    assert Machine.tally["replay"] >= 100, Machine.tally
    assert Machine.tally["empty"] >= 10, Machine.tally
    assert all(Machine.tally.get(f, 0) >= 20 for f in faults), Machine.tally
