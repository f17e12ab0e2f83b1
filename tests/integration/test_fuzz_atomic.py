"""The atomicity fuzzer (``tests/integration/fuzz_atomic.py``) at a short length: every CI run replays its
first calls with the fixed seed, ten times as many under the ``deep`` Hypothesis profile
(``.ci/sanitize`` runs it in full, under ASan + UBSan; ``--deep`` 10x longer)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fuzz_atomic.py sits beside this test

from fuzz_atomic import run

from graphbuf.testing import examples


def test_twin_refreshes_keep_the_atomic_promise_and_equal_the_oracle() -> None:
    steps = examples(12)  # the `deep` Hypothesis profile: ten times longer
    counts = run(steps, seed=20260)
    assert counts["calls"] == steps * 3 * 8
    assert counts["accepted"] and counts["rejected"]
