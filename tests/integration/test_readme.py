"""The README's code runs as written: every Python block (a block marked ``<!-- fragment -->`` on the line
before its fence is skipped; at most one may be), and the planted-bug drill transcript's ``$`` lines, from a
copy of the shipped example."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
FRAGMENT = "<!-- fragment -->"
TRANSCRIPT = "<!-- run by tests/integration/test_readme.py"


def _fenced(info: str) -> list[tuple[int, str, str]]:
    """(line number, line before the fence, body) of every block fenced with ```info."""
    lines, found, i = README.split("\n"), [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = lines.index("```", i + 1)
            if lines[i] == "```" + info:
                found.append((i + 1, lines[i - 1] if i else "", "\n".join(lines[i + 1 : end]) + "\n"))
            i = end
        i += 1
    return found


PYTHON = _fenced("python")


def test_at_most_one_python_block_is_a_fragment() -> None:
    assert PYTHON, "the README has no Python block"
    assert sum(before.strip() == FRAGMENT for _, before, _ in PYTHON) <= 1


@pytest.mark.parametrize("line, body", [(n, b) for n, before, b in PYTHON if before.strip() != FRAGMENT])
def test_python_block_runs(line: int, body: str) -> None:
    namespace: dict[str, object] = {"__name__": f"readme_line_{line}"}
    exec(compile(body, f"README.md:{line}", "exec"), namespace)
    for name, value in list(namespace.items()):  # a block that defines a property test runs it too
        if name.startswith("test_") and callable(value):
            value()


def test_planted_drill_transcript_runs_as_printed(tmp_path: Path) -> None:
    (block,) = [b for _, before, b in _fenced("") if before.startswith(TRANSCRIPT)]
    commands = [line[2:] for line in block.splitlines() if line.startswith("$ ")]
    assert len(commands) == 3 and "--replay failure.json" in commands[2]
    shutil.copytree(ROOT / "examples" / "planted", tmp_path / "examples" / "planted")
    script = "\n".join(f'{c}\necho "rc=$?"' for c in commands)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    out = result.stdout
    assert result.returncode == 0, result.stderr
    assert out.count("rc=") == 3 and out.count("rc=1") == 2, out + result.stderr  # cd, then two FAILs
    assert out.count("smallest failing batch: 2 requests (capture size 4)") == 2, out
    printed = [line for line in block.splitlines() if line.startswith("replay it: ")]
    assert printed and printed[0].removeprefix("replay it: ") == commands[2]
    assert f"replay it: {commands[2]}" in out  # the printed replay command is the one the README runs
