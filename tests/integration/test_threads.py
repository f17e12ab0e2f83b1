"""Thread rules: what may be shared across threads and what must not.

- A ``GraphSpec`` and a ``Plan`` are immutable (assigning any field raises) and may be shared freely.
- ``load_spec``, ``plan`` and the CLI's ``main`` are reentrant: concurrent calls give equal results.
- ``StaticBuffers``, ``BoundSources``, ``Graph`` and ``GraphRunner`` are not thread-safe: one per thread.
  Per-thread objects built from one shared Plan work concurrently (a capture on one thread records none of
  another thread's ops); one object shared by several threads works only under an external lock.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pydantic
import pytest
import torch
import yaml
from paged_spec import PAGED_SPEC as SPEC

import graphbuf
from graphbuf import Graph, GraphRunner, GraphSpec, Plan, StaticBuffers, Step
from graphbuf.cli import main as cli_main

THREADS = 8
SHIPPED = "gemma4-31b-it-mtp"

WEIGHTS = np.arange(1, 9, dtype=np.float64)
T = TypeVar("T")


def in_threads(work: Callable[[int], T], n: int = THREADS) -> list[T]:
    """Run ``work(i)`` for i in 0..n-1 on n threads released together; re-raise the first failure."""
    start = threading.Barrier(n)

    def run(i: int) -> T:
        start.wait()
        return work(i)

    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(run, range(n)))


def make_batch(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    w = int(rng.integers(1, 9))
    return {
        "block_table": rng.integers(0, 16, size=(n, w)).astype(np.int32),
        "seq_lens": rng.integers(0, 33, size=n).astype(np.int32),
    }


def expected(src: dict[str, np.ndarray], offset: float) -> torch.Tensor:
    bt = src["block_table"].astype(np.float64)
    return torch.from_numpy(
        src["seq_lens"] * 2.0 + (bt * WEIGHTS[: bt.shape[1]]).sum(axis=1) + offset
    ).float()


def step_fn(offset: float) -> Callable[[Step], torch.Tensor]:
    """The captured step of one thread; ``offset`` makes every thread's results its own."""
    weights = torch.from_numpy(WEIGHTS).float()
    bias = torch.tensor(offset)

    def fn(step: Step) -> torch.Tensor:
        bt, lens = step.views["block_table"], step.views["seq_lens"]
        return lens.float() * 2 + (bt.float() * weights[: bt.shape[1]]).sum(1) + bias

    return fn


@pytest.fixture(scope="module")
def shared_plan() -> Plan:
    return graphbuf.plan(GraphSpec.model_validate(SPEC))


def test_per_thread_buffers_and_runners_from_one_shared_plan(shared_plan: Plan) -> None:
    spec_dump = shared_plan.spec.model_dump()

    def work(i: int) -> int:
        bufs = StaticBuffers(shared_plan, "cpu")
        rng = np.random.default_rng(100 + i)
        bufs.refresh(8, make_batch(8, rng))
        runner = GraphRunner(bufs, step_fn(1000.0 * i), output_rows="requests")
        runner.capture()
        assert runner.captured_sizes == (2, 4, 8) and runner.stats.capture_failures == {}
        for _ in range(40):
            src = make_batch(int(rng.integers(1, 11)), rng)
            out = runner.run(src)
            torch.testing.assert_close(out, expected(src, 1000.0 * i), rtol=0, atol=0)
        return runner.stats.replays + runner.stats.eager

    assert in_threads(work) == [40] * THREADS
    assert shared_plan.spec.model_dump() == spec_dump
    assert shared_plan == graphbuf.plan(GraphSpec.model_validate(SPEC))  # nothing in the shared plan changed


def test_a_capture_records_no_op_of_another_thread() -> None:
    x = torch.arange(64.0)

    def body(src: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_((src * 2 + 1).cumsum(0))

    def capture_one(src: torch.Tensor, out: torch.Tensor) -> Graph:
        g = Graph("cpu")
        with g.capture():
            body(src, out)
        return g

    reference = capture_one(x.clone(), torch.empty(64))
    assert reference.emulator is not None
    steps = reference.emulator.num_steps

    lock, done = threading.Lock(), [0]
    captured = threading.Event()

    def work(i: int) -> bool:
        if i % 2:  # odd threads run eager in-place ops until every even thread has captured
            noise = torch.zeros(256)
            for _ in range(200_000):
                noise.add_(1).mul_(0.5)
                if captured.is_set():
                    return True
            return False
        src, out = torch.full((64,), float(i)), torch.empty(64)
        g = capture_one(src, out)
        with lock:
            done[0] += 1
            if done[0] == THREADS // 2:
                captured.set()
        assert g.emulator is not None and g.emulator.num_steps == steps
        src.fill_(i + 0.5)
        g.replay()
        return torch.equal(out, (src * 2 + 1).cumsum(0))

    assert all(in_threads(work))


def test_one_shared_runner_works_under_an_external_lock(shared_plan: Plan) -> None:
    bufs = StaticBuffers(shared_plan, "cpu")
    runner = GraphRunner(bufs, step_fn(7.0), output_rows="requests")
    runner.capture()
    lock = threading.Lock()

    def work(i: int) -> int:
        rng = np.random.default_rng(i)
        for _ in range(25):
            src = make_batch(int(rng.integers(1, 9)), rng)
            with lock:  # refresh, check, replay and the read of the static output are one critical section
                out = runner.run(src).clone()
            torch.testing.assert_close(out, expected(src, 7.0), rtol=0, atol=0)
        return i

    assert in_threads(work) == list(range(THREADS))
    assert runner.stats.replays == THREADS * 25


def test_per_thread_bound_sources_and_runners_from_one_shared_plan(shared_plan: Plan) -> None:
    def work(i: int) -> int:
        bufs = StaticBuffers(shared_plan, "cpu")
        runner = GraphRunner(bufs, step_fn(100.0 * i), output_rows="requests")
        runner.capture()
        table = np.zeros((12, 8), dtype=np.int32)  # this thread's persistent host buffers
        lens = np.zeros(12, dtype=np.int32)
        bound = bufs.bind({"block_table": table, "seq_lens": lens})
        rng = np.random.default_rng(i)
        for _ in range(25):
            src = make_batch(int(rng.integers(1, 9)), rng)
            n, w = src["block_table"].shape
            table[:n, :w], lens[:n] = src["block_table"], src["seq_lens"]  # the step writes in place
            out = runner.run(bound, num_reqs=n, widths={"block_table": w})
            torch.testing.assert_close(out, expected(src, 100.0 * i), rtol=0, atol=0)
        assert runner.stats.replays == 25
        return i

    assert in_threads(work) == list(range(THREADS))


def test_concurrent_load_spec_and_plan_of_one_file_are_equal(tmp_path: Path) -> None:
    path = tmp_path / "gemma.yaml"
    text = graphbuf.spec.models.shipped_specs()[SHIPPED].read_text(encoding="utf-8")
    path.write_text(text, encoding="utf-8")
    overrides = {"num_blocks": 4096}
    ref_spec = graphbuf.load_spec(path, overrides=overrides)
    ref_plan = graphbuf.plan(str(path), overrides=overrides)

    def work(i: int) -> tuple[GraphSpec, Plan, Plan]:
        return (
            graphbuf.load_spec(path, overrides=overrides),
            graphbuf.plan(str(path), overrides=overrides),
            graphbuf.plan(SHIPPED, overrides=overrides),
        )

    for spec, from_file, from_name in in_threads(work):
        assert spec == ref_spec
        assert from_file == ref_plan and from_name == ref_plan
        assert from_file.to_dict() == ref_plan.to_dict()


def test_concurrent_cli_calls_are_independent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec_mapping: Callable[[], dict[str, Any]]
) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(spec_mapping(), sort_keys=False), encoding="utf-8")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ngroups: [a\n", encoding="utf-8")
    codes = in_threads(lambda i: cli_main(["check", str(good if i % 2 else bad)]))
    assert codes == [2, 0] * (THREADS // 2)
    out, err = capsys.readouterr()
    assert out.count(f"{good}: ok: small, 6 buffers") == THREADS // 2
    assert err.count(f"{bad}: line 3, column 1: invalid YAML") == THREADS // 2


def test_shared_spec_and_plan_refuse_assignment(shared_plan: Plan) -> None:
    spec = shared_plan.spec
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        spec.name = "other"  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        spec.buffers["seq_lens"].dtype = "int64"  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        spec.capture.tokens_per_request = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        shared_plan.total_bytes = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        shared_plan.buffers[0].offset = 512  # type: ignore[misc]
    with pytest.raises(TypeError):
        shared_plan.constants["num_blocks"] = 1  # type: ignore[index]
    assert isinstance(shared_plan.buffers, tuple) and isinstance(shared_plan.capture_sizes, tuple)
    assert shared_plan == graphbuf.plan(GraphSpec.model_validate(SPEC))
