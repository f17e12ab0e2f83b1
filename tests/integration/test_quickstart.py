"""The README's quick start, run as written: the command is read from README.md (not copied here) and run
verbatim in a fresh copy of the repository with a fresh virtual environment, as a new user would on a fresh
machine. Only ``GRAPHBUF_DRILL_REPLAYS`` (documented in the README) reduces the replays; capture of every size
is as in the quick start. pip's cache is reused, so after the first run the install costs seconds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Not part of a fresh clone: environments, caches, build outputs.
SKIP = (".venv", ".cache", ".git", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache",
        "*.egg-info", "*.so", "results")  # fmt: skip


def quick_start_command() -> str:
    """The one shell line of the README's "Quick start" section that runs ``graphbuf drill``."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines() if "graphbuf drill" in line]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_quick_start_command_installs_and_drills() -> None:
    command = quick_start_command()
    assert command.startswith("python3 -m venv .venv && ") and "graphbuf drill gemma4-31b-it-mtp" in command
    assert "GRAPHBUF_DRILL_REPLAYS" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_quick_start_runs_verbatim_on_a_fresh_copy(tmp_path: Path) -> None:
    command = quick_start_command()
    clone = tmp_path / "graphbuf"
    shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(*SKIP))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON", "PIP_NO_CACHE"))}
    env["GRAPHBUF_DRILL_REPLAYS"] = "2"
    venv_bin = str(Path(os.environ.get("VIRTUAL_ENV", "/nonexistent")) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    started = time.perf_counter()
    result = subprocess.run(
        ["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True, timeout=1800
    )
    wall = time.perf_counter() - started
    tail = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, f"the README's quick start failed (exit {result.returncode}):\n{tail}"
    assert "PASS in " in result.stdout and "seconds per phase: import " in result.stdout, tail
    assert "Traceback" not in result.stderr, tail
    print(f"\nquick start on a fresh copy: {wall:.0f} s wall (install + drill, 2 replays)\n{result.stdout}")
