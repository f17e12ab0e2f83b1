"""Issue 35 §2, §4, §5: capture and refresh never interleave, the watch sees what a device would, and the
runner's public calls fail typed and before the first byte is written. One test per finding, named for it."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from paged_spec import PAGED_SPEC as SPEC

import graphbuf
from graphbuf import AddressChangedError, ConcurrentUseError
from graphbuf.errors import TaskError, UsageError
from graphbuf.graphs.runner import GraphRunner, Step


def make_buffers() -> graphbuf.StaticBuffers:
    return graphbuf.StaticBuffers(graphbuf.GraphSpec.model_validate(SPEC))


def batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "block_table": torch.randint(0, 16, (n, 8), generator=g, dtype=torch.int32),
        "seq_lens": torch.randint(1, 33, (n,), generator=g, dtype=torch.int32),
    }


def simple(step: Step) -> torch.Tensor:
    return step.views["seq_lens"].float() * 2 + step.views["block_table"].sum(1).float()


def expected(src: dict[str, torch.Tensor]) -> torch.Tensor:
    return src["seq_lens"].float() * 2 + src["block_table"].sum(1).float()


# ---- §2: capture holds the buffers' guard --------------------------------------------------------------


def _capture_in_thread(runner: GraphRunner, inside: threading.Event, errors: list) -> threading.Thread:
    def target() -> None:
        try:
            runner.capture()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=target)
    t.start()
    assert inside.wait(10)
    return t


def test_refresh_and_staged_write_during_capture_are_refused_not_reverted() -> None:
    """A refresh or staged write another thread makes while capture() runs (and would restore over) raises
    ConcurrentUseError; before, it succeeded and a failed size's restore then reverted it."""
    bufs = make_buffers()
    inside, release = threading.Event(), threading.Event()

    def fn(step: Step) -> torch.Tensor:
        if step.size == 8:
            inside.set()
            release.wait(10)
            raise RuntimeError("this size fails: capture restores every buffer")
        return simple(step)

    runner = GraphRunner(bufs, fn, output_rows="requests", on_capture_error="eager")
    errors: list = []
    t = _capture_in_thread(runner, inside, errors)
    try:
        with pytest.raises(ConcurrentUseError, match=r"refresh\(\): another thread is using these"):
            bufs.refresh(2, batch(2))
        with pytest.raises(ConcurrentUseError):
            bufs.stage("seq_lens").set(0, [5])
    finally:
        release.set()
        t.join(10)
    assert errors == [] and runner.captured_sizes == (2, 4)
    src = batch(3, 1)
    torch.testing.assert_close(runner.run(src), expected(src))  # free again afterwards


def test_staged_record_stays_true_across_a_failed_capture() -> None:
    """Staged cells set before a capture whose size fails (and restores) are committed by the next
    refresh exactly: the restore neither reverts nor hides them."""
    bufs = make_buffers()
    lens = bufs.stage("seq_lens")
    lens.set(0, [7, 9, 11])

    def fn(step: Step) -> torch.Tensor:
        if step.size == 2:
            step.views["seq_lens"].fill_(3)  # a write the failed size's restore must undo
            raise RuntimeError("size 2 fails")
        return simple(step)

    runner = GraphRunner(bufs, fn, output_rows="requests", on_capture_error="eager")
    runner.capture()
    assert runner.captured_sizes == (4, 8)
    src = batch(3, 2)
    del src["seq_lens"]
    out = runner.run(src, num_reqs=3)
    want = torch.tensor([7, 9, 11], dtype=torch.float32) * 2 + src["block_table"].sum(1).float()
    torch.testing.assert_close(out, want)
    assert bufs.full["seq_lens"][:3].tolist() == [7, 9, 11]


# ---- §4: the watch sees dtype, and runs after the refresh ----------------------------------------------


def _weighted(weight: torch.Tensor) -> Callable[[Step], torch.Tensor]:
    def fn(step: Step) -> torch.Tensor:
        return step.views["seq_lens"].float() * weight + step.views["block_table"].sum(1).float()

    return fn


def test_a_retyped_watched_tensor_is_an_address_changed_error() -> None:
    """``x.data = x.data.view(torch.int32)`` keeps address, shape and strides: only the dtype says the
    graph would read float32 bits as int32."""
    weight = torch.full((1,), 2.0)
    runner = GraphRunner(make_buffers(), _weighted(weight), output_rows="requests")
    runner.capture()
    weight.data = weight.data.view(torch.int32)
    with pytest.raises(AddressChangedError, match=r"float32, now .* int32"):
        runner.run(batch(3))


class _MovingBuffers(graphbuf.StaticBuffers):
    """Buffers whose refresh runs code that rebinds a tensor the graph reads (as a hook, a profiler callback
    or another thread could while the refresh runs)."""

    victim: torch.Tensor | None = None

    def refresh(self, *args: object, **kwargs: object) -> int:
        if self.victim is not None:
            self.victim.set_(torch.full((1,), 5.0))
        return super().refresh(*args, **kwargs)  # type: ignore[arg-type]


def test_a_tensor_moved_during_the_refresh_is_caught_before_the_replay() -> None:
    """The watch runs after the refresh, immediately before the replay; before, run() replayed with the
    check it made before the refresh and read the moved tensor's old memory."""
    weight = torch.full((1,), 2.0)
    bufs = _MovingBuffers(graphbuf.GraphSpec.model_validate(SPEC))
    runner = GraphRunner(bufs, _weighted(weight), output_rows="requests")
    runner.capture()
    bufs.victim = weight
    with pytest.raises(AddressChangedError, match=r"moved"):
        runner.run(batch(3))
    assert runner.stats.replays == 0


def test_runner_buffers_cannot_be_reassigned() -> None:
    bufs = make_buffers()
    runner = GraphRunner(bufs, simple, output_rows="requests")
    runner.capture()
    with pytest.raises(UsageError, match=r"GraphRunner\.buffers cannot be reassigned"):
        runner.buffers = make_buffers()  # type: ignore[misc]
    assert runner.buffers is bufs
    src = batch(3, 3)
    torch.testing.assert_close(runner.run(src), expected(src))


# ---- §5: typed errors before the first byte --------------------------------------------------------------


def test_on_capture_error_ignore_is_a_typed_usage_error() -> None:
    for bad in ("ignore", None, 3):
        with pytest.raises(UsageError, match=r"GraphRunner\(on_capture_error=.*allowed: 'raise', 'eager'"):
            GraphRunner(make_buffers(), simple, on_capture_error=bad)  # type: ignore[arg-type]


def _scaled_task(step: Step) -> torch.Tensor:
    out = torch.zeros(step.size)

    def kernel(lens: torch.Tensor, out: torch.Tensor, *, scale: float) -> None:
        if scale < 0:
            raise ValueError(f"scale must be >= 0, got {scale}")
        out.copy_(lens.float() * scale)

    step.task("custom", kernel, step.views["seq_lens"], out, scale=2.0)
    return out


def test_a_task_rejecting_its_host_argument_on_reissue_is_a_task_error_before_the_refresh() -> None:
    bufs = make_buffers()
    runner = GraphRunner(bufs, _scaled_task, output_rows="requests")
    runner.capture()
    first = batch(3, 4)
    torch.testing.assert_close(runner.run(first), first["seq_lens"].float() * 2)
    before = bufs.slab.clone()
    with pytest.raises(TaskError, match=r"task 'custom' #0: re-issue with host arguments \{'scale': -1\.0\}.*"
                       r"ValueError: scale must be >= 0"):  # fmt: skip
        runner.run(batch(3, 5), host_args={"custom": {"scale": -1.0}})
    assert torch.equal(bufs.slab, before)  # nothing written
    torch.testing.assert_close(runner.run(first), first["seq_lens"].float() * 2)  # scale 2 still held


def test_a_refresh_failing_after_a_reissue_puts_the_previous_host_arguments_back() -> None:
    bufs = make_buffers()
    runner = GraphRunner(bufs, _scaled_task, output_rows="requests")
    runner.capture()
    bad = batch(3, 6)
    bad["seq_lens"][0] = 10**6  # above the spec's max: the refresh refuses it
    with pytest.raises(graphbuf.RefreshError):
        runner.run(bad, host_args={"custom": {"scale": 3.0}})
    good = batch(3, 7)
    torch.testing.assert_close(runner.run(good), good["seq_lens"].float() * 2)  # scale 2, not 3


def test_limits_max_bytes_raised_past_the_machine_is_a_typed_error_not_the_allocator_s() -> None:
    """limits.max_bytes raised (to 200 GB in the attack; here 2**52 bytes, past any machine, so the allocator
    refuses it without touching a page) let the slab reach torch's allocator, whose RuntimeError surfaced."""
    spec = {
        **SPEC,
        "constants": {**SPEC["constants"], "max_model_len": 2**48},
        "limits": {"max_bytes": 2**52},
    }
    with pytest.raises(
        graphbuf.PlanTooLargeError,
        match=r"the slab of \d+ bytes \(limits\.max_bytes 4503599627370496\) cannot",
    ):
        graphbuf.StaticBuffers(graphbuf.GraphSpec.model_validate(spec))
