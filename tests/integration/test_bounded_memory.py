"""Bounded memory (issue 9 §6): nothing grows with the number of refreshes, replays or eager steps, or with
the set of (rows, width) pairs seen. Deterministic: sizes and traced allocations, never timings."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from paged_spec import PAGED_SPEC

from graphbuf import GraphRunner, GraphSpec, StaticBuffers
from graphbuf.graphs.runner import Durations, Step
from graphbuf.planning.planner import plan

GROWTH_LIMIT = 16 * 1024  # bytes; one leaked entry per call would be hundreds of KiB here
WARM = 2500  # fills CPython's bounded free lists (up to 2000 tuples per length), which tracemalloc counts


def _traced_growth(step: Callable[[int], object], warm: int, calls: int) -> int:
    """Bytes still allocated after ``calls`` more calls of ``step(i)`` than after ``warm`` warm-up calls
    (``i`` counts on across both, so every call may bring a value never seen before)."""
    for i in range(warm):
        step(i)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(warm, warm + calls):
            step(i)
        return tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()


def _linear_requests(p: Any, name: str, rows: int) -> int | None:
    """The reference answer of ``requests_for_rows``: scan request counts upward (as far as it searches)."""
    b = p[name]
    tpr = p.tokens_per_request
    for r in range((rows + 1) * max(1, p.capture_sizes[-1] // tpr) + 1):
        n = b.rows.eval({**p.constants, "tokens": r * tpr, "requests": r})
        if n == rows:
            return r
        if n > rows:
            return None
    return None


def test_requests_for_rows_matches_a_linear_scan_and_keeps_no_memo(
    spec_mapping: Callable[[], dict[str, Any]],
) -> None:
    p = plan(GraphSpec.model_validate(spec_mapping()))
    for name in p.names:
        for rows in range(0, 60):
            assert p.requests_for_rows(name, rows) == _linear_requests(p, name, rows), (name, rows)
    names = p.names
    growth = _traced_growth(lambda i: p.requests_for_rows(names[i % len(names)], 10 + i), WARM, 10_000)
    assert growth < GROWTH_LIMIT, growth


def test_eager_inputs_of_ten_thousand_distinct_sizes_grow_nothing(
    spec_mapping: Callable[[], dict[str, Any]],
) -> None:
    m = spec_mapping()
    m["constants"]["max_num_batched_tokens"] = 1 << 20
    sb = StaticBuffers(GraphSpec.model_validate(m))

    def step(i: int) -> None:
        n = 5 + i  # above the largest capture's 4 requests: every call a row count never seen before
        src = {
            "block_table.a": np.zeros((n, 1 + i % 4), np.int32),
            "block_table.b": np.zeros((n, 1 + i % 4), np.int32),
            "seq_lens": np.ones(n, np.int32),
            "query_start_loc": np.arange(0, 2 * n + 1, 2, dtype=np.int32),
            "slot_mapping": np.arange(2 * n, dtype=np.int64),
        }
        out = sb.eager_inputs(2 * n, src)  # no num_reqs: the live count is solved from the rows
        assert out["seq_lens"].shape == (n,)

    growth = _traced_growth(step, WARM, 5_000)
    assert growth < GROWTH_LIMIT, growth


def test_durations_is_a_fixed_size_summary() -> None:
    d = Durations()
    for i in range(10_000):
        d.add(1e-6 * (1 + i % 7))
    assert d.count == 10_000
    assert d.last == pytest.approx(1e-6 * (1 + 9_999 % 7))
    assert d.min == pytest.approx(1e-6) and d.max == pytest.approx(7e-6)
    assert d.total == pytest.approx(sum(1e-6 * (1 + i % 7) for i in range(10_000)))
    assert len(d.recent) == Durations.RECENT
    assert d.recent[-1] == d.last
    d.clear()
    assert (d.count, d.total, d.recent) == (0, 0.0, ())


def _simple(step: Step) -> torch.Tensor:
    return step.views["seq_lens"].float() * 2 + step.views["block_table"].sum(1).float()


def test_runner_stats_and_memos_stay_bounded_over_ten_thousand_runs() -> None:
    runner = GraphRunner(StaticBuffers(GraphSpec.model_validate(PAGED_SPEC)), _simple, output_rows="requests")
    runner.capture()
    g = torch.Generator().manual_seed(0)
    batches = [
        {
            "block_table": torch.randint(0, 16, (n, 1 + n % 8), generator=g, dtype=torch.int32),
            "seq_lens": torch.randint(1, 33, (n,), generator=g, dtype=torch.int32),
        }
        for n in range(0, 9)
    ]

    def step(i: int) -> None:
        if i % 50 == 49:  # an eager step of a request count never seen before
            n = 9 + i // 50
            src = {
                "block_table": torch.zeros((n, 3), dtype=torch.int32),
                "seq_lens": torch.ones(n, dtype=torch.int32),
            }
        else:
            src = batches[i % len(batches)]
            n = src["seq_lens"].shape[0]
        assert runner.run(src).shape == (n,)

    growth = _traced_growth(step, WARM, 10_000)
    stats = runner.stats
    assert stats.replays + stats.eager == WARM + 10_000
    assert stats.refresh_s.count == stats.replays
    assert len(stats.refresh_s.recent) == Durations.RECENT
    assert 0 < stats.refresh_s.min <= stats.refresh_s.last <= stats.refresh_s.max
    assert set(stats.replays_by_size) <= {2, 4, 8}
    assert growth < GROWTH_LIMIT, growth
