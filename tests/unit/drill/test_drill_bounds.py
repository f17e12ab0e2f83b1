"""``graphbuf drill --staged --set max_model_len=1e9`` (issue 35 §5): ran past 200 s, its attention steps
asking the allocator for 64-128 GB; a step's working memory is now bounded by limits.max_bytes before
anything is built."""

from __future__ import annotations

import time

import pytest

from graphbuf.cli import main
from graphbuf.drill.session import drill_plan
from graphbuf.errors import PlanTooLargeError

SPEC = "gemma4-31b-it-mtp"


def test_a_context_past_limits_max_bytes_is_refused_before_anything_is_built() -> None:
    with pytest.raises(
        PlanTooLargeError, match=r"reads up to 1000000000 keys per token .* at least 64000000000"
    ):
        drill_plan(SPEC, {"max_model_len": 10**9, "num_blocks": 2})


def test_the_shipped_envelope_is_within_the_bound() -> None:
    assert drill_plan(SPEC, {"num_blocks": 64}).plan.max_bytes == 1 << 30


def test_drill_staged_with_max_model_len_1e9_exits_2_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.perf_counter()
    code = main(["drill", SPEC, "--staged", "--set", "max_model_len=1000000000", "--set", "num_blocks=2"])
    assert code == 2 and time.perf_counter() - started < 60
    assert "limits.max_bytes: a drill step of 64 tokens" in capsys.readouterr().err
