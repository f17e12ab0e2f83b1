"""bench/bench_steps.py runs (quick) and its four contenders leave the same buffers (checked inside run)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_steps


def test_bench_steps_quick_measures_every_contender_at_every_point(capsys) -> None:
    res = bench_steps.run(quick=True)
    want = {(b, n) for b in (128, 16) for n in (1, 16, 64)}
    assert {(p["block"], p["live"]) for p in res["points"]} == want
    for p in res["points"]:
        for k in ("copy", "unchecked", "bound", "staged"):
            assert p[f"{k}_us"] > 0
        assert p["staged_bytes"] == p["unchecked_bytes"]  # the same changed and cleared cells
        assert p["staged_bytes"] < p["copy_bytes"]
    bench_steps.main(["--quick"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("steps: staged/copy worst=") and " copy/staged bytes at 128K=" in last
