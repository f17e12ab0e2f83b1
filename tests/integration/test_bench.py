"""The benchmark command runs end to end and writes what the README promises: one JSON per benchmark with
every figure, and the refresh-vs-layers PNG. Figures are checked for presence and internal consistency only;
no timing is asserted (shared machines are noisy). Each benchmark also checks its own contenders leave
identical contents and raises if they do not, which fails the command here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


@pytest.fixture(scope="module")
def quick_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    tmp = tmp_path_factory.mktemp("bench")
    out, plot = tmp / "results", tmp / "refresh_vs_layers.png"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--quick", "--out", str(out), "--plot", str(plot)],
        capture_output=True,
        text=True,
        timeout=1200,  # the drill bench captures every size of the shipped spec
        cwd=REPO,
    )
    return proc, out, plot


def _results(out: Path, name: str) -> dict[str, Any]:
    doc = json.loads((out / f"{name}.json").read_text())
    assert doc["benchmark"] == name and "meta" in doc
    return doc


def test_run_py_succeeds_and_writes_every_json_and_the_plot(
    quick_run: tuple[subprocess.CompletedProcess[str], Path, Path],
) -> None:
    proc, out, plot = quick_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    names = ("refresh", "capacity", "address_check", "emulator", "cuda", "verify", "decode", "cli", "drill")
    for name in names:
        assert f"=== {name} ===" in proc.stdout
        _results(out, name)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.with_name("refresh_vs_capacity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_capacity_results_hold_every_envelope_and_live_count(
    quick_run: tuple[subprocess.CompletedProcess[str], Path, Path],
) -> None:
    _, out, _ = quick_run
    res = _results(out, "capacity")["results"]
    assert res["capacity"][0]["envelope"] == "4K x 16" and res["capacity"][-1]["capacity_mib"] >= 64
    for r in res["capacity"]:  # the same live work moves the same bytes whatever the capacity
        assert r["last_bytes"] == res["capacity"][0]["last_bytes"]
    assert res["live"][-1]["live_requests"] == 256
    for r in res["live"]:
        assert r["last_bytes"] == r["live_bytes"]
    for r in res["capacity"] + res["live"]:  # both contenders measured beside graphbuf at every point
        assert r["vllm_style_us"] > 0 and r["vllm_checked_us"] > 0
    assert res["summary"]["max_bound_over_vllm_checked"] > 0


def test_drill_bench_times_every_phase_of_a_passing_drill(
    quick_run: tuple[subprocess.CompletedProcess[str], Path, Path],
) -> None:
    """bench_drill.py runs the shipped spec's drill (tiny replays) and accounts for its whole wall time."""
    proc, out, _ = quick_run
    res = _results(out, "drill")["results"]
    assert res["ok"] and res["spec"] == "gemma4-31b-it-mtp" and res["tasks"] == ["decode", "verify"]
    phases = res["phases_s"]
    for name in ("import", "capture", "refresh", "replay", "eager reference", "compare"):
        assert phases[name] >= 0
    assert res["phase_calls"]["capture"] == 1 and res["phase_calls"]["replay"] >= 1
    assert sum(res["replays_by_size"].values()) + res["eager_runs"] == res["replays"] == 2
    # the phases partition the run: their sum is the wall time (up to the bench's own few milliseconds)
    assert abs(sum(phases.values()) - res["total_s"]) <= 0.05 * res["total_s"] + 0.5
    assert "total wall" in proc.stdout


def test_refresh_results_hold_every_source_form_at_every_size(
    quick_run: tuple[subprocess.CompletedProcess[str], Path, Path],
) -> None:
    _, out, _ = quick_run
    res = _results(out, "refresh")["results"]
    for fill in ("full", "half"):
        rows = res["sizes"][fill]
        assert [r["size"] for r in rows] == list(range(4, 65, 4))
        for r in rows:
            for key in ("graphbuf_us", "graphbuf_np_us", "graphbuf_bound_us", "floor_us", "baseline_us"):
                assert r[key] > 0, (fill, r["size"], key)
            assert r["baseline_layers"] == 60
            for form, key in (
                ("", "graphbuf_us"),
                ("_np", "graphbuf_np_us"),
                ("_bound", "graphbuf_bound_us"),
            ):
                assert r[f"ratio_baseline_over_graphbuf{form}"] == pytest.approx(
                    r["baseline_us"] / r[key], rel=0.01
                )
    assert [r["layers"] for r in res["layers"]] == [15, 30, 60, 120, 240]
    s = res["summary"]
    all_rows = res["sizes"]["full"] + res["sizes"]["half"]
    assert s["min_ratio_baseline_over_graphbuf_bound"] == min(
        r["ratio_baseline_over_graphbuf_bound"] for r in all_rows
    )
    assert s["target_ratio_baseline_over_graphbuf"] == 50


def test_cuda_benchmark_code_paths_run_on_the_cpu_device() -> None:
    """bench_cuda with ``device="cpu"``: the same refresh (mapping and bound), content checks and replay
    code as on CUDA, with no device copies to count."""
    sys.path.insert(0, str(BENCH))
    try:
        import bench_cuda
    finally:
        sys.path.remove(str(BENCH))
    res = bench_cuda.run(quick=True, device="cpu", sizes=(4,))
    assert [(r["size"], r["fill"]) for r in res["refresh"]] == [(4, "full"), (4, "half")]
    for r in res["refresh"]:
        assert r["refresh_host_us"] > 0 and r["refresh_bound_host_us"] > 0
        assert r["htod_copies_per_refresh"] == 0 and r["bound_htod_copies_per_refresh"] == 0
    assert {r["task"] for r in res["replay"]} == {"decode", "verify"}
    assert all(r["max_abs_diff_replay_vs_eager"] == 0 for r in res["replay"])
    assert "bound µs" in bench_cuda.render(res)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_benchmark_on_cuda_captures_both_gemma4_tasks_and_counts_uploads() -> None:
    """On a GPU (an H200 found both: sources on ``cuda:0`` refused for buffers on ``cuda``; Gemma4 decode
    capturing host arguments a CUDA graph cannot re-issue): refresh contents equal a cpu refresh, both tasks
    capture and replay what eager computes, and each refresh's uploads are counted."""
    sys.path.insert(0, str(BENCH))
    try:
        import bench_cuda
    finally:
        sys.path.remove(str(BENCH))
    res = bench_cuda.run(quick=True, device="cuda", sizes=(4,))
    assert not res["skipped"]
    for r in res["refresh"]:
        assert 1 <= r["htod_copies_per_refresh"] <= 6  # one per touched buffer, at most
    assert {r["task"] for r in res["replay"]} == {"decode", "verify"}
    assert all(r["max_abs_diff_replay_vs_eager"] == 0 for r in res["replay"])


def test_decode_results_follow_live_context_and_match_the_plan(
    quick_run: tuple[subprocess.CompletedProcess[str], Path, Path],
) -> None:
    _, out, _ = quick_run
    rows = _results(out, "decode")["results"]["rows"]
    assert rows and all(r["paged_gathered_bytes"] == r["plan_paged_kv_read_bytes_per_layer"] for r in rows)
    assert all(r["dense_gathered_bytes"] == r["plan_dense_kv_read_bytes_per_layer"] for r in rows)
    short = min(rows, key=lambda r: r["context"])
    assert short["paged_gathered_bytes"] * 10 < short["dense_gathered_bytes"]
    assert all(r["max_abs_diff"] <= 0.015 for r in rows)
