"""The README's code runs as written: every Python block (a block marked ``<!-- fragment -->`` on the line
before its fence is skipped; at most one may be), and the planted-bug drill transcript is what its ``$`` lines
print (``python tests/integration/test_readme.py`` rewrites it from a run); what the README says a user needs
is there."""

from __future__ import annotations

import os
import re
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


def _transcript() -> tuple[list[str], str]:
    """The planted-drill transcript block: its ``$`` commands and its whole text."""
    (block,) = [b for _, before, b in _fenced("") if before.startswith(TRANSCRIPT)]
    return [line[2:] for line in block.splitlines() if line.startswith("$ ")], block


def run_transcript(root: Path, commands: list[str]) -> str:
    """The transcript as the commands print it (stdout), run in order by one shell in ``root``, a copy of
    the repository's examples with ``.venv`` the running interpreter's environment."""
    script = "\n".join(f"echo '$ {c}'\n{c}" for c in commands)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GRAPHBUF_DRILL_REPLAYS")}
    result = subprocess.run(
        ["bash", "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert "Traceback" not in result.stderr, result.stderr
    return result.stdout


def _copy_root(root: Path) -> Path:
    shutil.copytree(ROOT / "examples" / "planted", root / "examples" / "planted")
    (root / ".venv").symlink_to(Path(sys.executable).parent.parent)  # `.venv/bin/graphbuf`, as installed
    return root


def _normalized(text: str) -> list[str]:
    """Lines with every decimal figure (timings, refresh µs) and the padding that right-aligns it as `` #``:
    what a rerun may change (a refresh of 112.0 µs is one column wider than one of 62.1)."""
    return [re.sub(r" *\d+\.\d+", " #", line).rstrip() for line in text.strip().splitlines()]


def test_planted_drill_transcript_is_what_its_commands_print(tmp_path: Path) -> None:
    """Issue 33 §4: the transcript is the commands' own output (timings aside), run as shown from a
    repository root with the quick start's `.venv/bin/graphbuf`; it leaves nothing untracked in examples/."""
    if not (Path(sys.executable).parent / "graphbuf").exists():
        pytest.skip("the graphbuf console script is not installed beside this interpreter")
    commands, block = _transcript()
    assert len(commands) == 3 and all(c.startswith(".venv/bin/graphbuf drill ") for c in commands[1:])
    out = run_transcript(_copy_root(tmp_path), commands)
    assert _normalized(out) == _normalized(block), f"README transcript differs from a run:\n{out}"
    assert out.count("seconds per phase: import ") == 2 and out.count("FAIL in ") == 2, out
    assert f"replay it: {commands[2]}" in out  # the printed replay command is the one the README runs next
    assert not list((tmp_path / "examples").rglob("*.json"))  # no failure.json left in examples/planted
    assert (tmp_path / "build" / "failure.json").is_file()  # written where .gitignore keeps it untracked
    assert "build/" in (ROOT / ".gitignore").read_text(encoding="utf-8").split()


def regenerate() -> None:
    """Rewrite the README transcript from a run (``python tests/integration/test_readme.py``)."""
    import tempfile

    commands, block = _transcript()
    with tempfile.TemporaryDirectory() as tmp:
        out = run_transcript(_copy_root(Path(tmp)), commands)
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    (ROOT / "README.md").write_text(text.replace(block, out if out.endswith("\n") else out + "\n"), "utf-8")


# ----------------------------------------------------------------------------------------------------------
# Issue 33 §4: what the README says is true.


def _section(title: str) -> str:
    return README.split(f"\n{title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_quick_start_figures_are_the_drill_s_own_phase_line() -> None:
    from graphbuf.drill.session import PHASES

    quick = _section("## Quick start")
    lines = [line for line in quick.splitlines() if "seconds per phase: " in line]
    assert lines, "the quick start quotes no `seconds per phase:` line of the drill"
    names = [k.replace("_", " ") for k in PHASES]
    for line in lines:
        shown = line.split("seconds per phase: ", 1)[1]
        assert re.fullmatch(", ".join(rf"{n} \d+\.\d" for n in names) + r"`?.*", shown), (
            f"not the drill's phase line: {line}"
        )
    stale = re.findall(r"\b(setup|task update|eager fallbacks|task inputs|the rest) \(?\d", quick)
    assert not stale, f"the quick start times phases the drill does not print: {stale}"


def test_the_readme_tells_a_user_what_their_own_spec_needs() -> None:
    testing = _section("## Property testing (`graphbuf.testing`)")
    for needed in ("share one width", "relations=[", "`graphbuf.testing.paged_kv`", "--staged",
                   "Batch(size=8, num_reqs=2"):  # fmt: skip
        assert needed in testing, needed
    assert "needs the `test` extra" not in README and "graphbuf[test]" not in README
    assert "Hypothesis is a dependency of graphbuf" in testing
    assert "`--staged`" in _section("## Commands") or "[--staged]" in _section("## Commands")


def test_the_readme_names_the_file_that_registers_the_profiles() -> None:
    named = re.search(r"\*\*Profiles\.\*\* `([^`]+)` registers", README)
    assert named, "the Profiles paragraph names no file"
    assert "register_profiles()" in (ROOT / named.group(1)).read_text(encoding="utf-8")


def test_the_mutation_section_names_the_modules_the_tool_mutates() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import mutation
    finally:
        sys.path.remove(str(ROOT / "tools"))
    section = README.split("**Mutation testing**", 1)[1].split("\n## ", 1)[0]
    assert "refresh/*" not in section and "`graphbuf/buffers/`" in section
    for key, (path, _tests) in mutation.MODULES.items():
        assert (ROOT / path).is_file(), path
        if key.startswith("refresh."):
            module = key.split(".", 1)[1]
            assert path == f"graphbuf/buffers/{module}.py" and f"`{module}`" in section, key


def test_every_install_command_outside_the_npu_section_is_pinned() -> None:
    """Issue 33 §1: an install the README (before the adapter's NPU section) or tools/mutation.py tells a
    user to run keeps torch at the constraints' build."""
    text = README.split("\n## The vllm-ascend adapter", 1)[0].replace("\n", " ")
    text += (ROOT / "tools" / "mutation.py").read_text(encoding="utf-8").replace("\n", " ")
    commands = [m.group(1) for m in re.finditer(r"pip install ([^`]+)`", text)]
    assert len(commands) >= 5, commands
    for args in commands:
        assert "-c constraints.txt" in args, args


if __name__ == "__main__":
    regenerate()
