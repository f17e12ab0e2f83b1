"""Issue 21 §1/§2 in the refresh and runner path: every error raised before the first byte is written, and
typed (a graphbuf error naming what and where), or the input accepted and written correctly.

Each test names the finding it holds; every "unchanged" below compares the whole slab's bytes."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch
from paged_spec import PAGED_SPEC

import graphbuf
from graphbuf import (
    AddressChangedError,
    ArgumentError,
    CaptureError,
    Graph,
    GraphRunner,
    GraphSpec,
    RefreshError,
    SpecError,
    StaticBuffers,
    Step,
    TaskError,
)

Spec = dict[str, Any]


@pytest.fixture
def path(backend: str) -> str:
    """The refresh path, by backend (conftest): the native kernel or the numpy path."""
    return "kernel" if backend == "native" else "numpy"


def _paged(**changes: Any) -> StaticBuffers:
    spec = copy.deepcopy(PAGED_SPEC)
    spec["buffers"].update(changes)
    return StaticBuffers(GraphSpec.model_validate(spec))


def _bytes(sb: StaticBuffers) -> bytes:
    return sb.slab.numpy().tobytes()


def _batch(n: int) -> dict[str, np.ndarray]:
    return {
        "block_table": np.arange(n * 8, dtype=np.int32).reshape(n, 8) % 16,
        "seq_lens": np.arange(1, n + 1, dtype=np.int32),
    }


# ----------------------------------------------------------------------------------------------------------
# Bound numpy arrays changed in place after bind


def _bound_setup() -> tuple[StaticBuffers, dict[str, np.ndarray], Any]:
    sb = _paged()
    arrays = {
        "block_table": np.ones((8, 8), dtype=np.int32),
        "seq_lens": np.full(8, 3, dtype=np.int32),
    }
    bound = sb.bind(arrays)
    sb.refresh(8, bound, num_reqs=6)
    return sb, arrays, bound


@pytest.mark.parametrize(
    "change",
    [
        lambda a: a.resize((2,), refcheck=False),
        lambda a: a.resize((1,), refcheck=False),  # was accepted: one value broadcast to every live row
        lambda a: a.resize((0,), refcheck=False),  # was "min() arg is an empty sequence"
        lambda a: setattr(a, "shape", (2, 4)),
    ],
    ids=["resize-2", "resize-1", "resize-0", "shape"],
)
def test_bound_numpy_array_changed_in_place_raises_before_any_write(
    path: str, change: Callable[[np.ndarray], None]
) -> None:
    sb, arrays, bound = _bound_setup()
    arrays["block_table"][:] = 2  # a valid new batch in the other buffer: must not be written either
    before = _bytes(sb)
    change(arrays["seq_lens"])
    for call in (
        lambda: sb.refresh(8, bound, num_reqs=6),
        lambda: bound.refresh(4, 1),
        lambda: sb.eager_inputs(16, bound, num_reqs=6),
    ):
        with pytest.raises(AddressChangedError, match="'seq_lens'"):
            call()
        assert _bytes(sb) == before


def test_bound_2d_numpy_array_resized_raises(path: str) -> None:
    sb, arrays, bound = _bound_setup()
    before = _bytes(sb)
    arrays["block_table"].resize((8, 1), refcheck=False)  # was: block-table columns broadcast
    with pytest.raises(AddressChangedError, match="'block_table'"):
        sb.refresh(8, bound, num_reqs=6)
    assert _bytes(sb) == before


# ----------------------------------------------------------------------------------------------------------
# A mapping whose keys() or items() runs code: read exactly once, before any check


class _KeysMutates(Mapping):
    """keys() puts a value above ``max`` into an already-given source."""

    def __init__(self, data: dict[str, np.ndarray]) -> None:
        self._d = data

    def __getitem__(self, k: str) -> np.ndarray:
        return self._d[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def keys(self) -> Any:
        self._d["seq_lens"][0] = 12345
        self._d["block_table"][0, 0] = -7
        return self._d.keys()


class _ItemsMutates(_KeysMutates):
    """items() puts a bad value into each source right after yielding it."""

    def items(self) -> Any:
        bad = {"seq_lens": (0, 12345), "block_table": ((0, 0), -7)}

        def gen() -> Iterator[tuple[str, np.ndarray]]:
            for k in list(self._d):
                yield k, self._d[k]
                at, value = bad[k]
                self._d[k][at] = value

        return gen()


@pytest.mark.parametrize("cls", [_KeysMutates, _ItemsMutates])
def test_a_mapping_cannot_change_a_source_after_its_check(path: str, cls: type) -> None:
    sb = _paged()
    before = _bytes(sb)
    try:
        sb.refresh(8, cls(_batch(3)))
    except RefreshError:
        assert _bytes(sb) == before  # rejected: nothing written
    full = sb.full
    assert int(full["seq_lens"].max()) <= 32  # max: max_model_len
    assert int(full["block_table"].min()) >= 0  # min: 0


@pytest.mark.parametrize("cls", [_KeysMutates, _ItemsMutates])
def test_a_mapping_cannot_change_a_source_after_its_check_in_run(cls: type) -> None:
    runner = GraphRunner(_paged(), lambda s: s.views["seq_lens"] * 1, output_rows="requests")
    runner.capture()
    with contextlib.suppress(RefreshError):  # rejected, or accepted with the values it was given
        runner.run(cls(_batch(3)))
    assert int(runner.buffers.full["seq_lens"].max()) <= 32
    assert int(runner.buffers.full["block_table"].min()) >= 0


class _Meddling(torch.Tensor):
    """A tensor subclass whose methods (``__torch_function__``) write another source after its check."""

    victim: np.ndarray

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        cls.victim[0] = 12345  # seq_lens max is 32
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_subclass_source_is_refused_before_its_code_can_change_another(path: str) -> None:
    """No user code between a value's check and its write: a tensor subclass runs its own code on every
    method graphbuf calls, so it is refused by type (a plain Tensor, or nn.Parameter, is accepted)."""
    sb = _paged()
    batch = _batch(3)
    _Meddling.victim = batch["seq_lens"]
    meddling = torch.as_tensor(batch["block_table"]).as_subclass(_Meddling)
    sources = {"seq_lens": batch["seq_lens"], "block_table": meddling}
    before = _bytes(sb)
    with pytest.raises(RefreshError, match="tensor subclass _Meddling"):
        sb.refresh(8, sources)
    assert _bytes(sb) == before
    sources["block_table"] = torch.nn.Parameter(torch.as_tensor(batch["block_table"]), requires_grad=False)
    assert sb.refresh(8, {**sources, "seq_lens": _batch(3)["seq_lens"]}) == 3


# ----------------------------------------------------------------------------------------------------------
# Sources that were refused with an untyped or untrue error


def test_big_endian_integer_source_into_a_bounded_buffer(path: str) -> None:
    sb = _paged()
    src = _batch(3)
    src["seq_lens"] = np.array([5, 6, 7], dtype=">i4")
    src["block_table"] = src["block_table"].astype(">i2")
    assert sb.refresh(4, src) == 3
    assert sb.full["seq_lens"][:3].tolist() == [5, 6, 7]
    assert sb.full["block_table"][:3].tolist() == _batch(3)["block_table"].tolist()
    before = _bytes(sb)
    src["seq_lens"] = np.array([5, 99, 7], dtype=">i4")
    with pytest.raises(RefreshError, match=r"'seq_lens'.*value 99 at index \[1\] is above max"):
        sb.refresh(4, src)
    assert _bytes(sb) == before


def test_empty_negative_stride_source_into_bfloat16(path: str) -> None:
    sb = _paged(scale={"dtype": "bfloat16", "rows": "requests"})
    src = {**_batch(0), "scale": np.zeros(4, dtype=np.int8)[::-1][:0]}
    assert src["scale"].strides[0] < 0
    assert sb.refresh(2, src) == 0
    src = {**_batch(2), "scale": np.array([1, 2, 3], dtype=np.int8)[::-1][:2]}
    with pytest.raises(RefreshError, match="'scale': source elements are strided"):  # typed, as before
        sb.refresh(2, src)


def test_torch_uint16_tensor_into_int32_is_accepted_like_numpy_uint16(path: str) -> None:
    sb = _paged()
    src: dict[str, Any] = _batch(3)
    src["seq_lens"] = torch.tensor([4, 5, 6], dtype=torch.int32).to(torch.uint16)
    assert sb.refresh(4, src) == 3
    assert sb.full["seq_lens"][:3].tolist() == [4, 5, 6]
    src["seq_lens"] = torch.tensor([4, 500, 6], dtype=torch.int32).to(torch.uint16)
    with pytest.raises(RefreshError, match="value 500"):
        sb.refresh(4, src)


def test_a_list_with_numpy_uint64_does_not_hold_floats(path: str) -> None:
    sb = _paged()
    src: dict[str, Any] = _batch(3)
    src["seq_lens"] = [np.uint64(5), 1, 1]
    assert sb.refresh(4, src) == 3
    assert sb.full["seq_lens"][:3].tolist() == [5, 1, 1]
    src["seq_lens"] = [np.uint64(5), 1, 1.5]
    with pytest.raises(RefreshError, match="holds floats"):
        sb.refresh(4, src)


def test_eager_inputs_are_bounded_by_limits_before_allocating() -> None:
    sb = _paged()
    with pytest.raises(RefreshError, match=r"eager\(size=2147483648\).*limits.max_bytes"):
        sb.eager_inputs(2**31, _batch(3), num_reqs=3)
    with pytest.raises(RefreshError, match="num_reqs=40"):
        sb.eager_inputs(16, _batch(3), num_reqs=40)


# ----------------------------------------------------------------------------------------------------------
# GraphRunner.run: everything rejected before refresh or replay writes


def _lens(step: Step) -> torch.Tensor:
    return step.views["seq_lens"] * 1


def _runner(fn: Callable[[Step], Any] = _lens, **kw: Any) -> GraphRunner:
    runner = GraphRunner(_paged(), fn, **kw)
    runner.capture()
    runner.run(_batch(2))  # something in the slab to keep
    return runner


def _rejects_before_writing(runner: GraphRunner, error: type[Exception], match: str, **kw: Any) -> None:
    before = _bytes(runner.buffers)
    with pytest.raises(error, match=match):
        runner.run(_batch(3), **kw)
    assert _bytes(runner.buffers) == before


@pytest.mark.parametrize(
    "returns",
    [lambda s: None, lambda s: 1.5, lambda s: s.views["seq_lens"].sum()],
    ids=["None", "float", "0-d"],
)
def test_callable_result_is_checked_at_capture(returns: Callable[[Step], Any]) -> None:
    runner = GraphRunner(_paged(), returns, output_rows="requests")
    with pytest.raises(CaptureError, match="allowed: a tensor"):
        runner.capture()


def test_fewer_rules_than_outputs_is_refused_at_capture() -> None:
    runner = GraphRunner(
        _paged(), lambda s: (_lens(s), _lens(s), _lens(s)), output_rows=["requests", "requests"]
    )
    with pytest.raises(CaptureError, match="3 outputs, but output_rows has 2 rules"):
        runner.capture()


@pytest.mark.parametrize(
    ("rule", "match"),
    [
        ("cdiv(requests, 0)", r"output_rows 'cdiv\(requests, 0\)' at 3 requests"),
        ("requests - 10", r"output_rows 'requests - 10' gives -7 rows at 3 requests"),
        ("requests * 100", r"output_rows 'requests \* 100' gives 300 rows at 3 requests, but output 0 has 4"),
    ],
)
def test_output_rule_failing_at_run_time_is_named_before_writing(rule: str, match: str) -> None:
    runner = GraphRunner(_paged(), _lens, output_rows=rule)
    runner.capture()
    _rejects_before_writing(runner, SpecError, match)


def _task_fn(step: Step) -> torch.Tensor:
    out = torch.zeros(step.size)

    def write(lens: torch.Tensor, o: torch.Tensor, *, host_lens: list[int]) -> None:
        o.copy_(lens.float())

    step.task("custom", write, step.views["seq_lens"], out, host_lens=[0] * step.size)
    return out


@pytest.mark.parametrize(
    ("host_args", "match"),
    [
        ([("custom", {"host_lens": [1, 2, 3, 4]})], "host_args is list"),
        ({"custom": [1, 2]}, r"host_args\['custom'\] is list"),
        ({"atention": {"x": 1}}, "unknown task kind 'atention'"),
        ({"custom": {"host_lenz": [1, 2, 3, 4]}}, r"unknown: \['host_lenz'\]"),
        ({"custom": {"host_lens": 3}}, "captured as a sequence of 4 values"),
        ({"custom": {"host_lens": [1, 2]}}, "captured as a sequence of 4 values"),
        ({"custom": {"host_lens": torch.ones(4)}}, "is a tensor"),
    ],
    ids=["list", "kind-not-mapping", "unknown-kind", "unknown-name", "scalar", "length", "tensor"],
)
def test_host_args_are_checked_before_writing(host_args: Any, match: str) -> None:
    runner = _runner(_task_fn, output_rows="requests")
    _rejects_before_writing(runner, TaskError, match, host_args=host_args)
    assert runner.stats.task_updates == 0


def test_run_with_an_enormous_request_count_is_a_typed_error() -> None:
    runner = _runner(output_rows="requests")
    with pytest.raises(RefreshError, match=r"eager\(size=10+\): the buffers' shapes cannot be evaluated"):
        runner.run(_batch(3), num_reqs=10**30)


def test_graph_task_of_an_unknown_kind_is_a_task_error() -> None:
    g = Graph("cpu")
    with g.capture(), pytest.raises(TaskError, match="unknown task kind 'nope'"):
        g.task("nope", lambda: None)


def test_graph_runner_refuses_what_is_not_buffers_or_a_callable() -> None:
    with pytest.raises(ArgumentError, match="allowed: a StaticBuffers"):
        GraphRunner(None, _lens)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="allowed: a callable"):
        GraphRunner(_paged(), 3)  # type: ignore[arg-type]


def test_stats_types_are_exported() -> None:
    runner = _runner(output_rows="requests")
    assert isinstance(runner.stats.refresh_s, graphbuf.Durations)
    assert isinstance(runner.buffers.stats, graphbuf.RefreshStats)
    assert graphbuf.EAGER_TOO_LARGE in {graphbuf.EAGER_TOO_LARGE, graphbuf.EAGER_REFUSED}


def test_runner_refreshes_only_through_static_buffers_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _runner(output_rows="requests")
    sb = runner.buffers
    calls = []
    real = sb.refresh
    monkeypatch.setattr(sb, "refresh", lambda *a, **k: calls.append(a[0]) or real(*a, **k))

    def elsewhere(*a: Any, **k: Any) -> None:
        raise AssertionError("BoundSources.refresh called")

    monkeypatch.setattr(graphbuf.BoundSources, "refresh", elsewhere)
    bound = sb.bind({"block_table": np.zeros((8, 8), np.int32), "seq_lens": np.ones(8, np.int32)})
    runner.run(_batch(3))
    runner.run(bound, num_reqs=2)
    assert calls == [4, 2]


class _Row:
    """A row of a list source that numpy reads as a sequence; reading it puts 12345 into ``target``."""

    def __init__(self, target: np.ndarray, values: list[int]) -> None:
        self.target, self.values = target, values

    def __len__(self) -> int:
        self.target[0] = 12345
        return len(self.values)

    def __getitem__(self, i: int) -> int:
        return self.values[i]


def test_a_list_source_cannot_change_a_source_checked_before_it(path: str) -> None:
    sb = _paged()
    before = _bytes(sb)
    lens = np.array([1, 2, 3], dtype=np.int32)
    rows = [_Row(lens, [1] * 8) for _ in range(3)]
    with pytest.raises(RefreshError, match=r"'seq_lens': value 12345 at index \[0\] is above max"):
        sb.refresh(4, {"seq_lens": lens, "block_table": rows})
    assert _bytes(sb) == before
