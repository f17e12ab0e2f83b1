"""GraphRunner: bucket choice, eager fallback and reasons, per-replay address check, first-use verification,
capture failure isolation, and host task arguments re-issued before replay (cpu emulator)."""

from __future__ import annotations

import pytest
import torch
from paged_spec import PAGED_SPEC as SPEC

import graphbuf
import graphbuf.graphs.emulator.recording as recording
from graphbuf import (
    CaptureError,
    ConcurrentUseError,
    DeviceUnavailableError,
    Graph,
    SpecError,
    UnknownDeviceError,
)
from graphbuf.graphs.runner import EAGER_CAPTURE_FAILED, EAGER_REFUSED, EAGER_TOO_LARGE, GraphRunner, Step


def make_buffers() -> graphbuf.StaticBuffers:
    return graphbuf.StaticBuffers(graphbuf.GraphSpec.model_validate(SPEC))


def batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "block_table": torch.randint(0, 16, (n, 5), generator=g, dtype=torch.int32),
        "seq_lens": torch.randint(1, 33, (n,), generator=g, dtype=torch.int32),
    }


def simple(step: Step) -> torch.Tensor:
    return step.views["seq_lens"].float() * 2 + step.views["block_table"].sum(1).float()


def expected(src: dict[str, torch.Tensor]) -> torch.Tensor:
    return src["seq_lens"].float() * 2 + src["block_table"].sum(1).float()


def test_bucket_choice_is_smallest_fitting_size() -> None:
    runner = GraphRunner(make_buffers(), simple, output_rows="requests")
    assert [runner.size_for(n) for n in (0, 1, 2, 3, 4, 5, 8, 9)] == [2, 2, 2, 4, 4, 8, 8, None]


def test_run_replays_and_returns_live_rows() -> None:
    runner = GraphRunner(make_buffers(), simple, output_rows="requests")
    runner.capture()
    assert runner.captured_sizes == (2, 4, 8)
    for n, seed in ((3, 1), (1, 2), (8, 3), (3, 4)):
        src = batch(n, seed)
        out = runner.run(src)
        assert out.shape == (n,)
        torch.testing.assert_close(out, expected(src))
    assert runner.stats.replays == 4
    assert runner.stats.replays_by_size == {4: 2, 2: 1, 8: 1}
    assert runner.stats.eager == 0


def test_batch_above_largest_size_runs_eagerly_with_reason() -> None:
    runner = GraphRunner(make_buffers(), simple, output_rows="requests")
    runner.capture()
    src = batch(11, 5)
    out = runner.run(src)
    torch.testing.assert_close(out, expected(src))
    assert runner.stats.eager == 1 and runner.stats.replays == 0
    assert runner.stats.eager_reasons == {EAGER_TOO_LARGE: 1}


def test_address_check_fires_on_every_replay_after_a_swap() -> None:
    bufs = make_buffers()
    runner = GraphRunner(bufs, simple, output_rows="requests")
    runner.capture()
    runner.run(batch(4))
    bufs.view(4)["seq_lens"].set_(torch.zeros(4, dtype=torch.int32))  # rebound behind the runner's back
    for _ in range(2):
        with pytest.raises(graphbuf.AddressChangedError, match=r"seq_lens.*size 4"):
            runner.run(batch(4))
    runner.run(batch(2))  # other sizes are unaffected


def test_address_check_catches_a_resize() -> None:
    bufs = make_buffers()
    runner = GraphRunner(bufs, simple, output_rows="requests")
    runner.capture()
    bufs.view(8)["block_table"].resize_(2, 8)  # same storage, new shape: the graph would misread it
    with pytest.raises(graphbuf.AddressChangedError, match="block_table"):
        runner.run(batch(6))


def test_first_use_verification_refuses_graph_reading_a_rebound_tensor() -> None:
    state = {"scale": torch.tensor(2.0)}

    def fn(step: Step) -> torch.Tensor:
        return step.views["seq_lens"].float() * state["scale"]

    runner = GraphRunner(make_buffers(), fn, output_rows="requests", verify=True)
    runner.capture()
    kept = state["scale"]  # the old tensor stays alive (freed, it would be a LivenessError)
    state["scale"] = torch.tensor(3.0)  # rebound, not copied: the graph still reads the old tensor
    src = batch(3)
    out = runner.run(src)
    torch.testing.assert_close(out, src["seq_lens"].float() * 3)  # the eager result is returned
    assert 4 in runner.stats.refused and "differs from eager" in runner.stats.refused[4]
    out = runner.run(batch(4, 9))
    assert runner.stats.eager_reasons[EAGER_REFUSED] == 1
    # a size verified correctly keeps replaying
    runner2 = GraphRunner(make_buffers(), simple, output_rows="requests", verify=True)
    runner2.capture()
    runner2.run(batch(3))
    runner2.run(batch(3, 1))
    assert runner2.stats.refused == {} and runner2.stats.replays == 2
    assert kept.item() == 2.0


def test_capture_failure_at_one_size_leaves_others_captured() -> None:
    def fn(step: Step) -> torch.Tensor:
        if step.graph is not None and step.size == 4:
            raise RuntimeError("boom at 4")
        return simple(step)

    with pytest.raises(CaptureError, match=r"capture at size 4 .*RuntimeError: boom at 4"):
        GraphRunner(make_buffers(), fn, output_rows="requests").capture()
    runner = GraphRunner(make_buffers(), fn, output_rows="requests", on_capture_error="eager")
    runner.capture()
    assert runner.captured_sizes == (2, 8)
    assert "boom at 4" in runner.stats.capture_failures[4]
    src = batch(3)
    torch.testing.assert_close(runner.run(src), expected(src))
    assert runner.stats.eager_reasons == {EAGER_CAPTURE_FAILED: 1}
    src = batch(7)
    torch.testing.assert_close(runner.run(src), expected(src))
    assert runner.stats.replays == 1


def test_host_task_arguments_are_reissued_only_when_they_change() -> None:
    out_buf = torch.zeros(8)

    def write_lengths(lens: torch.Tensor, out: torch.Tensor, *, host_lens: list[int]) -> None:
        out.copy_(lens.float())
        for i, n in enumerate(host_lens):  # each host value is a kernel argument, baked into the task
            out[i] += n

    def fn(step: Step) -> torch.Tensor:
        r = step.views["seq_lens"].shape[0]
        out = out_buf[:r]
        step.task("custom", write_lengths, step.views["seq_lens"], out, host_lens=[0] * r)
        return out

    runner = GraphRunner(make_buffers(), fn, output_rows="requests")
    runner.capture()
    src = batch(2)
    out = runner.run(src, host_args={"custom": {"host_lens": [10, 20]}})
    torch.testing.assert_close(out, src["seq_lens"].float() + torch.tensor([10.0, 20.0]))
    assert runner.stats.task_updates == 1
    src2 = batch(2, 7)
    out = runner.run(src2, host_args={"custom": {"host_lens": [10, 20]}})
    torch.testing.assert_close(out, src2["seq_lens"].float() + torch.tensor([10.0, 20.0]))
    assert runner.stats.task_updates == 1  # unchanged host args: no re-issue
    out = runner.run(batch(2, 8))  # no host args given: the last issued values stay baked in
    torch.testing.assert_close(out, batch(2, 8)["seq_lens"].float() + torch.tensor([10.0, 20.0]))


def test_verification_is_not_fooled_by_outputs_shared_with_eager() -> None:
    """Tasks write preallocated outputs (NPU out=), so eager and graph share them; a stale graph must still
    be caught."""
    out_buf = torch.zeros(8)
    state = {"scale": torch.tensor(2.0)}

    def scaled(lens: torch.Tensor, out: torch.Tensor, *, unused: int) -> None:
        out.copy_(lens.float() * state["scale"])

    def fn(step: Step) -> torch.Tensor:
        r = step.views["seq_lens"].shape[0]
        step.task("custom", scaled, step.views["seq_lens"], out_buf[:r], unused=0)
        return out_buf[:r]

    runner = GraphRunner(make_buffers(), fn, output_rows="requests", verify=True)
    runner.capture()
    kept = state["scale"]  # alive, so the stale graph runs (freed, it would be a LivenessError)
    state["scale"] = torch.tensor(5.0)  # rebound after capture
    src = batch(3)
    torch.testing.assert_close(runner.run(src), src["seq_lens"].float() * 5)
    assert 4 in runner.stats.refused and kept.item() == 2.0


# ---------------------------------------------------------------------------------- misuse (issue 11 §5)


def test_run_before_capture_says_so() -> None:
    runner = GraphRunner(make_buffers(), simple, output_rows="requests")
    for n in (3, 9):  # a captured size and one above the largest: both refused
        with pytest.raises(CaptureError, match=r"run\(\) before capture\(\)"):
            runner.run(batch(n))


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ("tokenz", r"output_rows 'tokenz': unknown name\(s\) \['tokenz'\]; allowed: tokens, requests"),
        (["requests", "2 * "], r"output_rows\[1\] '2 \* ': "),
        ("requests * max_num_seqz", r"unknown name\(s\) \['max_num_seqz'\].*max_num_seqs"),
        ("requests )", r"output_rows 'requests \)'"),
        ([], "no rule given"),
        ([1.5], r"output_rows\[0\]: 1.5 is float"),
        (None, r"output_rows: None is NoneType; allowed: an expression string"),
    ],
)
def test_output_rows_are_checked_when_the_runner_is_built(rows: object, match: str) -> None:
    with pytest.raises(SpecError, match=match) as info:
        GraphRunner(make_buffers(), simple, output_rows=rows)  # type: ignore[arg-type]
    assert isinstance(info.value, graphbuf.GraphbufError)


def test_unknown_on_capture_error_is_refused() -> None:
    with pytest.raises(ValueError, match=r"on_capture_error='ignore'\): allowed: 'raise', 'eager'"):
        GraphRunner(make_buffers(), simple, on_capture_error="ignore")


def test_concurrent_run_from_two_threads_raises_instead_of_mixing_outputs() -> None:
    import threading

    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def fn(step: Step) -> torch.Tensor:
        if step.graph is None and step.requests == 9:  # the eager step: hold the runner busy
            inside.set()
            release.wait(10)
        return simple(step)

    runner = GraphRunner(make_buffers(), fn, output_rows="requests")
    runner.capture()

    def first() -> None:
        try:
            runner.run(batch(9))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(10)
    with pytest.raises(ConcurrentUseError, match=r"GraphRunner\.run\(\) while another call is running"):
        runner.run(batch(3))
    with pytest.raises(ConcurrentUseError, match=r"GraphRunner\.capture\(\)"):
        runner.capture()
    release.set()
    t.join(10)
    assert errors == []
    torch.testing.assert_close(runner.run(batch(3)), expected(batch(3)))  # free again afterwards


@pytest.mark.parametrize(
    ("device", "error"),
    [
        ("tpu", UnknownDeviceError),
        ("cuda:x", UnknownDeviceError),
        ("mps", UnknownDeviceError),
        pytest.param(
            "cuda",
            DeviceUnavailableError,
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
        ),
        ("cuda:99", DeviceUnavailableError),
        ("npu", DeviceUnavailableError),
        ("npu:3", DeviceUnavailableError),
    ],
)
def test_graph_device_errors(device: str, error: type[Exception]) -> None:
    with pytest.raises(error, match=device.split(":")[0]) as info:
        Graph(device)
    assert isinstance(info.value, graphbuf.GraphbufError)


def test_a_capture_the_uncomputed_values_make_fail_is_taken_again_computing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The runner captures dry on the cpu (as a device captures); an op failing there (say, a gather by
    # uncomputed indices) makes it capture that size again, computing: no size is lost.
    failed = []

    def fails(*args: object, **kwargs: object) -> None:
        failed.append(1)
        raise IndexError("index out of range in self")

    def big(step: Step) -> torch.Tensor:
        wide = step.views["block_table"].float().repeat(1, 4096)  # over the dry threshold: shaped, not run
        return wide.sum(1) / 4096 + step.views["seq_lens"].float() * 2

    class EveryOpVerified(set):  # a process-wide cache: which signatures ran before depends on test order
        def __contains__(self, key: object) -> bool:
            return True

    monkeypatch.setattr(recording, "shaped_like_result", fails)
    monkeypatch.setattr(recording, "VERIFIED", EveryOpVerified())
    runner = GraphRunner(make_buffers(), big, output_rows="requests")
    runner.capture()
    assert runner.captured_sizes == (2, 4, 8) and not runner.stats.capture_failures
    assert len(failed) == 3  # each size's dry capture failed once
    src = batch(3, 5)
    want = src["block_table"].sum(1).float() + src["seq_lens"].float() * 2
    torch.testing.assert_close(runner.run(src), want)
