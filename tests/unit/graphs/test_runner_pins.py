"""Pins for ``graphbuf/graphs/runner.py`` (issue 24 §1; the watch's are in ``test_watch.py``), on the cpu
emulator: each test fails on the mutant its docstring names (line numbers of main b2b8a44)."""

from __future__ import annotations

import time

import pytest
import torch
from paged_spec import PAGED_SPEC

import graphbuf
from graphbuf import (
    AddressChangedError,
    CaptureError,
    ConcurrentUseError,
    Graph,
    LivenessError,
    RefreshError,
    RowsError,
    SpecError,
    TaskError,
)
from graphbuf.graphs.runner import Durations, GraphRunner, Step


def _buffers() -> graphbuf.StaticBuffers:
    return graphbuf.StaticBuffers(graphbuf.GraphSpec.model_validate(PAGED_SPEC))


def _batch(lens: list[int]) -> dict[str, torch.Tensor]:
    n = len(lens)
    return {
        "block_table": torch.arange(n * 8, dtype=torch.int32).reshape(n, 8) % 16,
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
    }


def _lens(step: Step) -> torch.Tensor:
    return step.views["seq_lens"].float() * 2


def test_watched_lists_the_buffers_of_each_size_by_name() -> None:
    """watch.py:59 (``labels``) and runner.py:309 (``watched``): the labels of what is checked before a replay
    of each size, buffers named by the runner: the one the callable reads first, the unread one appended by
    ``name_inputs`` (mutant: ``return None`` or another size's graph)."""
    runner = GraphRunner(_buffers(), _lens, output_rows="requests")
    runner.capture()
    for size in (2, 4, 8):
        assert runner.watched(size) == (
            f"buffer 'seq_lens' at size {size}",
            f"buffer 'block_table' at size {size}",
        )


def test_name_inputs_watches_a_tensor_the_capture_did_not_use() -> None:
    """watch.py:73 ``if id(t) not in out._ids``: a named tensor the work does not read is appended to the
    watch (mutant ``in``: it is dropped, and its move goes unreported); a used one is renamed in place."""
    g = Graph("cpu")
    x = torch.ones(3)
    with g.capture():
        y = x * 2
    extra = torch.zeros(2)
    g.name_inputs({"the x": x, "extra": extra})
    assert g.watched == ("the x", "extra")
    g.replay()
    torch.testing.assert_close(y, torch.full((3,), 2.0))
    extra.set_(torch.zeros(5))
    with pytest.raises(AddressChangedError, match=r"^before replay: extra moved: captured at 0x"):
        g.check_inputs()
    with pytest.raises(AddressChangedError, match=r"^replay: extra moved"):
        g.replay()


def test_name_inputs_keeps_a_freed_entry_reported() -> None:
    """watch.py:68-70: a tensor freed before ``name_inputs`` keeps its entry, so the next check reports it
    (mutant: ``continue`` without the append drops it)."""
    g = Graph("cpu")
    x = torch.ones(3)
    with g.capture():
        x.mul_(2)
    label = g.watched[0]
    del x
    g.name_inputs({"other": torch.zeros(1)})
    assert g.watched == (label, "other")
    with pytest.raises(LivenessError, match=r"was freed after capture"):
        g.check_inputs()


def test_run_with_a_list_and_no_num_reqs_names_the_type() -> None:
    """runner.py:330 (now refresh/mapping.py ``read_call``, the argument check every entry point shares)
    ``raise RefreshError('run(): sources must be a mapping ...')`` (mutant: the check dropped, a list reaches
    ``.items()``: AttributeError)."""
    bufs = _buffers()
    runner = GraphRunner(bufs, _lens, output_rows="requests")
    runner.capture()
    slab = bufs.slab.numpy().tobytes()
    message = (
        r"^run\(\): sources must be a mapping of buffer name to source, or BoundSources from bind\(\); "
        r"got list$"
    )
    with pytest.raises(RefreshError, match=message):
        runner.run([torch.zeros(3, dtype=torch.int32)])  # type: ignore[arg-type]
    assert bufs.slab.numpy().tobytes() == slab


def test_one_rule_applies_to_every_output() -> None:
    """runner.py:431 ``if len(rows) == 1: rows = rows * len(output)``: one ``output_rows`` rule cuts each of
    a tuple's outputs (mutant: the rule applies to the first only, or the lengths are compared first and a
    ValueError raised)."""

    def two(step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        lens = step.views["seq_lens"].float()
        return lens + 1, step.views["block_table"].float().sum(1)

    runner = GraphRunner(_buffers(), two, output_rows="requests")
    runner.capture()
    src = _batch([3, 1, 4])
    a, b = runner.run(src)
    torch.testing.assert_close(a, torch.tensor([4.0, 2.0, 5.0]))
    torch.testing.assert_close(b, src["block_table"].float().sum(1))
    runner2 = GraphRunner(_buffers(), two, output_rows=["requests", "requests - 1"])
    runner2.capture()
    a, b = runner2.run(src)
    assert a.shape == (3,) and b.shape == (2,)


def test_verification_reports_the_largest_error() -> None:
    """runner.py:494 ``err = (g - w).abs().nan_to_num(inf).max()``: the refusal names the LARGEST absolute
    error of the first replay against eager (mutants ``min``, a sign, or another reduction)."""
    state = {"scale": torch.tensor(2.0)}

    def fn(step: Step) -> torch.Tensor:
        return step.views["seq_lens"].float() * state["scale"]

    runner = GraphRunner(_buffers(), fn, output_rows="requests", verify=True)
    runner.capture()
    kept = state["scale"]
    state["scale"] = torch.tensor(3.0)  # the graph still reads the old tensor: errors are the lengths
    out = runner.run(_batch([1, 7, 2]))
    torch.testing.assert_close(out, torch.tensor([3.0, 21.0, 6.0]))
    assert runner.stats.refused == {
        4: "first replay differs from eager: output 0 max abs error 7 (rtol=1e-05, atol=1e-05)"
    }
    assert kept.item() == 2.0


def test_durations_keep_a_ring_of_the_latest_samples_and_print_their_summary() -> None:
    """runner.py ``Durations``: ``RECENT`` is 1024 (mutant 1025), the ring keeps the latest, ``min``/``max``/
    ``last``/``count``/``total`` follow every sample, ``clear`` forgets, and the repr gives count, total and
    last."""
    d = Durations()
    assert Durations.RECENT == 1024 and d.min == float("inf") and d.max == 0.0
    for i in range(1030):
        d.add(float(i % 7) + 1.0)
    assert len(d.recent) == 1024 and d.recent[0] == float(6 % 7) + 1.0 and d.recent[-1] == float(1029 % 7) + 1
    assert d.count == 1030 and d.min == 1.0 and d.max == 7.0 and d.last == float(1029 % 7) + 1
    assert d.total == sum(float(i % 7) + 1.0 for i in range(1030))
    d.clear()
    assert (d.count, d.total, d.last, d.min, d.max, d.recent) == (0, 0.0, 0.0, float("inf"), 0.0, ())
    d.add(0.25)
    d.add(0.5)
    assert repr(d) == "Durations(count=2, total=0.75, last=0.5)"
    assert (d.min, d.max) == (0.25, 0.5)


# ---------------------------------------------------------------------------------------------------------
# Survivors of tools/mutation.py (mutmut names: build/mutation/graphs.runner, graphs.watch)


def _small_buffers() -> graphbuf.StaticBuffers:
    from conftest import SMALL_SPEC

    return graphbuf.StaticBuffers(graphbuf.GraphSpec.model_validate(SMALL_SPEC))


def test_tokens_rule_counts_tokens_per_request() -> None:
    """``_parse_rows`` allows ``tokens`` and ``live_rows`` binds it to ``live * tokens_per_request``
    (``x__parse_rows__mutmut_17``, ``live_rows__mutmut_8``/``_9``: ``TOKENS``, ``live / tpr``)."""
    bufs = _small_buffers()  # 2 tokens per request

    def fn(step: Step) -> torch.Tensor:
        return step.views["slot_mapping"].float() + 1

    runner = GraphRunner(bufs, fn)  # output_rows defaults to "tokens"
    runner.capture()
    src = {
        "block_table.a": [[1, 2]], "block_table.b": [[3]], "seq_lens": [5], "query_start_loc": [0, 2],
        "slot_mapping": [10, 11],
    }  # fmt: skip
    out = runner.run(src)
    torch.testing.assert_close(out, torch.tensor([11.0, 12.0]))


def test_eager_steps_are_counted_sized_and_given_their_widths() -> None:
    """``_eager``: each eager step counts (``_eager__mutmut_11``: ``= 1``), the callable sees the live token
    count as ``step.size`` (``_eager__mutmut_22``) and bound ``widths`` reach the eager inputs
    (``_eager__mutmut_5``/``_9``); a replayed bound run honours them too (``_run__mutmut_52``/``_54``)."""
    sizes: list[int] = []

    def fn(step: Step) -> torch.Tensor:
        if step.graph is None:
            sizes.append(step.size)
        return step.views["block_table"].sum(1).float() + step.views["seq_lens"].float()

    bufs = _buffers()
    runner = GraphRunner(bufs, fn, output_rows="requests")
    runner.capture()
    bt = torch.arange(16 * 10, dtype=torch.int32).reshape(16, 10) % 16
    lens = torch.arange(16, dtype=torch.int32)
    bound = bufs.bind({"block_table": bt, "seq_lens": lens})
    want = lambda n: bt[:n, :3].sum(1).float() + lens[:n].float()  # noqa: E731
    torch.testing.assert_close(runner.run(bound, num_reqs=11, widths={"block_table": 3}), want(11))
    torch.testing.assert_close(runner.run(bound, num_reqs=12, widths={"block_table": 3}), want(12))
    assert runner.stats.eager == 2 and sizes == [11, 12]
    torch.testing.assert_close(runner.run(bound, num_reqs=3, widths={"block_table": 3}), want(3))
    assert runner.stats.replays == 1


def test_capture_passes_each_size_to_host_args_and_a_step_reads_its_kind() -> None:
    """``_capture`` calls ``host_args(size)`` per size (``_capture__mutmut_15``: ``host_args(None)``), and
    ``Step.task`` reads the step's host arguments by the task's kind (``Step.task__mutmut_2``)."""
    seen: list[object] = []
    got: list[float] = []

    def scale(x: torch.Tensor, out: torch.Tensor, *, factor: float) -> torch.Tensor:
        got.append(factor)
        return torch.mul(x, factor, out=out)

    outs = {s: torch.zeros(s) for s in (2, 4, 8)}

    def fn(step: Step) -> torch.Tensor:
        out = outs[step.size] if step.graph is not None else torch.zeros(step.size)
        step.task("attention", scale, step.views["seq_lens"].float(), out, factor=1.0)
        return out

    def args(size: int) -> dict[str, dict[str, float]]:
        seen.append(size)
        return {"attention": {"factor": 2.0}}

    runner = GraphRunner(_buffers(), fn, output_rows="requests")
    runner.capture(host_args=args)
    assert seen == [8, 4, 2] and got == [2.0, 2.0, 2.0]
    got.clear()
    out = runner.run(_batch([1, 2, 3] * 4), host_args={"attention": {"factor": 3.0}})  # 12: eager
    torch.testing.assert_close(out, torch.tensor([3.0, 6.0, 9.0] * 4))
    assert got == [3.0]


def test_without_verify_a_run_never_calls_the_callable_and_timings_are_durations() -> None:
    """``_run``: ``if self.verify and not captured.verified`` (``_run__mutmut_79``: ``or`` would run the
    callable eagerly on every first replay); ``refresh_s`` records each refresh's duration, a small
    non-negative number of seconds (``_run__mutmut_63``: ``perf_counter() + t0``)."""
    calls = []

    def fn(step: Step) -> torch.Tensor:
        calls.append(step.graph is None)
        return step.views["seq_lens"].float() * 2

    runner = GraphRunner(_buffers(), fn, output_rows="requests")
    runner.capture()
    before = len(calls)
    t0 = time.perf_counter()
    for n in (1, 3, 5, 3):
        runner.run(_batch(list(range(n))))
    elapsed = time.perf_counter() - t0
    assert len(calls) == before
    d = runner.stats.refresh_s
    assert d.count == 4 and 0.0 <= d.min <= d.max <= d.total <= elapsed


def test_first_use_verification_runs_the_step_with_the_live_request_count() -> None:
    """``_run``: the eager step of first-use verification carries ``requests = live`` (``_run__mutmut_89``:
    ``None``)."""
    requests: list[object] = []

    def fn(step: Step) -> torch.Tensor:
        if step.graph is None:
            requests.append(step.requests)
        return step.views["seq_lens"].float()

    runner = GraphRunner(_buffers(), fn, output_rows="requests", verify=True)
    runner.capture()
    runner.run(_batch([4, 5, 6]))
    assert requests == [3] and runner.stats.refused == {}


def test_host_args_that_are_no_mapping_name_their_type_and_what_is_allowed() -> None:
    """``_host_args__mutmut_3`` (the message dropped)."""
    runner = GraphRunner(_buffers(), _lens, output_rows="requests")
    runner.capture()
    with pytest.raises(TaskError) as err:
        runner.run(_batch([3, 4]), host_args=[("decode", {})])
    assert str(err.value) == (
        "run(): host_args is list; allowed: a mapping of task kind to {host argument name: value}"
    )


def test_a_second_call_from_inside_the_callable_is_refused_with_the_whole_reason() -> None:
    """``__init____mutmut_55`` (the guard's message)."""
    inner: list[BaseException] = []

    def fn(step: Step) -> torch.Tensor:
        try:
            runner.live_rows(step.views["seq_lens"], 1)
            runner.capture()
        except ConcurrentUseError as exc:
            inner.append(exc)
        return _lens(step)

    runner = GraphRunner(_buffers(), fn, output_rows="requests")
    runner.capture()
    assert str(inner[0]) == (
        "GraphRunner.capture() while another call is running on this runner (from another thread, or from "
        "inside the captured callable); a runner's graphs, buffers and outputs serve one caller at a time. "
        "Use one runner per thread, or serialize the calls."
    )


@pytest.mark.parametrize(
    ("result", "rules", "message"),
    [
        (
            lambda s: [s.views["seq_lens"]],
            "requests",
            "the callable returned list; allowed: a tensor, or a tuple of tensors (one per output_rows rule)",
        ),
        (
            lambda s: (s.views["seq_lens"], 3),
            "requests",
            "output 1 of the callable is int; allowed: a tensor with rows (>= 1-D)",
        ),
        (
            lambda s: (s.views["seq_lens"], s.views["seq_lens"], s.views["seq_lens"]),
            ("requests", "requests"),
            "the callable returned 3 outputs, but output_rows has 2 rules; allowed: one rule, or one per "
            "output",
        ),
    ],
    ids=["list", "int-output", "rule-count"],
)
def test_what_the_callable_returns_is_refused_with_its_whole_message(result, rules, message: str) -> None:
    """``_check_output__mutmut_10``/``_21``/``_29`` (the messages)."""
    runner = GraphRunner(_buffers(), result, output_rows=rules)
    with pytest.raises(CaptureError) as err:
        runner.capture()
    assert f"failed: CaptureError: {message}. Every buffer was restored." in str(err.value), str(err.value)


def test_a_rule_above_its_output_names_that_rule_and_that_output() -> None:
    """``_slice__mutmut_20``/``_22``/``_25``: with one rule per output the error names the output's own rule
    and its row count (dim 0), not the first rule or another dim."""

    def two(step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        lens = step.views["seq_lens"].float()
        return lens, torch.zeros(step.size, 7)

    runner = GraphRunner(_buffers(), two, output_rows=("requests", "requests + 100"))
    runner.capture()
    with pytest.raises(SpecError) as err:
        runner.run(_batch([3, 4]))
    assert str(err.value) == (
        "GraphRunner output_rows[1] 'requests + 100' gives 102 rows at 2 requests, but output 1 has 2 rows"
    )


def test_widths_with_a_mapping_are_refused_by_run_itself() -> None:
    """``_run__mutmut_9``: ``run()`` passes its own ``widths`` to the one argument check (run's label)."""
    runner = GraphRunner(_buffers(), _lens, output_rows="requests")
    runner.capture()
    with pytest.raises(RefreshError, match=r"^run\(\): widths= applies to BoundSources"):
        runner.run(_batch([3, 4]), widths={"block_table": 2})


def test_the_first_use_check_gives_the_step_its_size() -> None:
    """``_run__mutmut_98``: the eager step that verifies a first replay has the capture size."""
    sizes: list[object] = []

    def fn(step: Step) -> torch.Tensor:
        sizes.append(step.size)
        return step.views["seq_lens"].float() * 2

    runner = GraphRunner(_buffers(), fn, output_rows="requests", verify=True)
    runner.capture()
    sizes.clear()
    runner.run(_batch([3, 4, 5]))
    assert sizes == [4] and runner.stats.refused == {}


def test_live_rows_slices_by_the_rules_and_checks_the_output() -> None:
    """``live_rows__mutmut_6`` (no test reached ``live_rows``)."""
    runner = GraphRunner(_buffers(), _lens, output_rows=("requests", "2 * requests"))
    a, b = torch.arange(8.0), torch.arange(16.0)
    got = runner.live_rows((a, b), 3)
    assert got[0].tolist() == [0.0, 1.0, 2.0] and got[1].tolist() == list(map(float, range(6)))
    assert got[0].data_ptr() == a.data_ptr()  # views, no copy
    with pytest.raises(CaptureError, match="the callable returned list"):
        runner.live_rows([a, b], 3)  # type: ignore[arg-type]


def test_stats_as_dict_keys_refused_sizes_by_their_size() -> None:
    """``RunnerStats.as_dict__mutmut_18``: a refused size is keyed by its own size."""
    calls = {"n": 0}

    def flaky(step: Step) -> torch.Tensor:
        calls["n"] += 1
        return step.views["seq_lens"].float() + (calls["n"] > 3)  # the eager check sees other values

    runner = GraphRunner(_buffers(), flaky, output_rows="requests", verify=True)
    runner.capture()
    runner.run(_batch([3, 4]))
    refused = runner.stats.as_dict()["refused"]
    assert list(refused) == ["2"] and refused["2"].startswith("first replay differs from eager")


def test_a_rule_that_fails_to_evaluate_is_named() -> None:
    """``_rows__mutmut_15``: the rule that failed is named, by its own index."""
    runner = GraphRunner(_buffers(), _lens, output_rows="cdiv(requests, 0)")
    runner.capture()
    with pytest.raises(SpecError, match=r"^GraphRunner output_rows 'cdiv\(requests, 0\)' at 2 requests: "):
        runner.run(_batch([3, 4]))


def test_only_the_first_replay_of_a_size_is_checked_against_eager() -> None:
    """``_run__mutmut_93``: once a size is verified its later replays run no eager step."""
    eager = {"n": 0}

    def fn(step: Step) -> torch.Tensor:
        eager["n"] += 1
        return step.views["seq_lens"].float()

    runner = GraphRunner(_buffers(), fn, output_rows="requests", verify=True)
    runner.capture()
    eager["n"] = 0
    for lens in ([3, 4], [5, 6], [7, 8]):
        runner.run(_batch(lens))
    assert eager["n"] == 1 and runner.stats.replays == 3


def test_stats_as_dict_names_every_counter() -> None:
    """``RunnerStats.as_dict__mutmut_5`` (a key renamed)."""
    runner = GraphRunner(_buffers(), _lens, output_rows="requests")
    runner.capture()
    runner.run(_batch([3, 4]))
    d = runner.stats.as_dict()
    names = {"replays", "eager", "task_updates", "replays_by_size", "eager_reasons", "capture_failures"}
    assert names <= set(d)
    assert (d["replays"], d["eager"], d["task_updates"]) == (1, 0, 0) and d["replays_by_size"][2] == 1


def test_nan_in_the_same_place_in_replay_and_eager_is_no_mismatch() -> None:
    """``_mismatch__mutmut_26``: NaNs compare equal (a padded output row may hold NaN both ways)."""

    def fn(step: Step) -> torch.Tensor:
        return step.views["seq_lens"].float() / step.views["seq_lens"].float()  # 0/0 on padded rows

    runner = GraphRunner(_buffers(), fn, output_rows="requests + 1", verify=True)
    runner.capture()
    out = runner.run(_batch([3, 4, 5]))  # size 4: row 3 is padded, seq_lens 0
    assert torch.isnan(out[3]) and runner.stats.refused == {}


def test_output_rows_of_a_wrong_type_and_unknown_names_are_refused_in_full() -> None:
    """``_parse_rows__mutmut_3``/``_42``: the type named; the spec's constants listed."""
    with pytest.raises(SpecError) as err:
        GraphRunner(_buffers(), _lens, output_rows=5)  # type: ignore[arg-type]
    assert str(err.value) == (
        "GraphRunner output_rows: 5 is int; allowed: an expression string, or a list of them (one per output)"
    )
    with pytest.raises(SpecError) as err:
        GraphRunner(_buffers(), _lens, output_rows="requests + pages")
    assert str(err.value).endswith(
        "unknown name(s) ['pages']; allowed: tokens, requests and the spec's constants "
        "(block_size, max_model_len, max_num_seqs, num_blocks)"
    )


def test_capture_gives_each_step_its_request_count() -> None:
    """``_capture__mutmut_39``: the captured step of size s holds s // tokens_per_request requests."""
    seen: dict[int, int] = {}

    def fn(step: Step) -> torch.Tensor:
        seen[step.size] = step.requests
        return _lens(step)

    GraphRunner(_buffers(), fn, output_rows="requests").capture()
    assert seen == {2: 2, 4: 4, 8: 8}


def test_an_eager_check_output_too_short_names_the_live_count() -> None:
    """``_run__mutmut_111``: the first-use check slices the eager output at the live count."""

    def fn(step: Step) -> torch.Tensor:
        lens = step.views["seq_lens"].float()
        return lens if step.graph is not None else lens[:1]

    runner = GraphRunner(_buffers(), fn, output_rows="requests", verify=True)
    runner.capture()
    with pytest.raises(SpecError) as err:
        runner.run(_batch([3, 4]))
    assert (
        str(err.value)
        == "GraphRunner output_rows 'requests' gives 2 rows at 2 requests, but output 0 has 1 rows"
    )


def test_num_reqs_given_to_run_is_checked_under_run_s_name() -> None:
    """``_run__mutmut_26``."""
    runner = GraphRunner(_buffers(), _lens, output_rows="requests")
    runner.capture()
    with pytest.raises(RowsError, match=r"^run\(\): num_reqs=-1, but allowed: >= 0"):
        runner.run(_batch([3, 4]), num_reqs=-1)


def test_stats_key_capture_failures_by_size() -> None:
    """``RunnerStats.as_dict__mutmut_15``."""

    def fn(step: Step) -> torch.Tensor:
        if step.size == 8 and step.graph is not None:
            step.views["seq_lens"].sum().item()  # a host read: that size cannot be captured
        return _lens(step)

    runner = GraphRunner(_buffers(), fn, output_rows="requests", on_capture_error="eager")
    runner.capture()
    assert list(runner.stats.as_dict()["capture_failures"]) == ["8"]
