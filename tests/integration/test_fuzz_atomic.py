"""The atomicity fuzzer (``tests/integration/fuzz_atomic.py``) at a short length: every CI run replays its
first
calls with the fixed seed (``.ci/sanitize`` runs it in full, under ASan + UBSan; ``--deep`` 10x longer)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fuzz_atomic.py sits beside this test

from fuzz_atomic import run


def test_twin_refreshes_keep_the_atomic_promise_and_equal_the_oracle() -> None:
    counts = run(12, seed=20260)
    assert counts["calls"] == 12 * 3 * 8
    assert counts["accepted"] and counts["rejected"]
