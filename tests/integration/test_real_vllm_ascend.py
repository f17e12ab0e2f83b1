"""Runs ``tests/integration/real_vllm_ascend/`` against the three real upstreams (``install.UPSTREAMS``):
vllm-ascend 0.23.0.post1 + vLLM 0.23.0, vllm-ascend main 182b75ea + vLLM 0.27.1, and the reconstructed
UpdatableGraph tree (182b75ea with the post-change graph files, standing for 0.30+) + vLLM 0.28.0.

The real packages go first on ``sys.path`` of a subprocess only (its own pytest run, bootstrapped by
``tests/integration/real_vllm_ascend/conftest.py`` with ``GRAPHBUF_REAL_UPSTREAM``), never in this process.
``install.py`` installs them once into ``.cache/real-vllm-ascend[-main|-updatable]`` (git-ignored); this test
installs them itself when they are missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REAL = HERE / "real_vllm_ascend"
ROOT = HERE.parents[1]

pytestmark = pytest.mark.real_vllm_ascend


UPSTREAMS = ("0.23", "main", "updatable")
"""``install.UPSTREAMS`` keys (the harness module is imported only inside the fixture)."""


@pytest.fixture(scope="module", params=UPSTREAMS)
def installed(request: pytest.FixtureRequest) -> str:
    sys.path.insert(0, str(REAL))
    try:
        import install

        assert tuple(install.UPSTREAMS) == UPSTREAMS
        install.ensure(request.param)
    finally:
        sys.path.remove(str(REAL))
    return request.param


@pytest.mark.parametrize("module", sorted(p.name for p in REAL.glob("test_real_*.py")))
def test_real_module(installed: str, module: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_PLUGINS="", GRAPHBUF_REAL_VLLM_ASCEND="1",
               GRAPHBUF_REAL_UPSTREAM=installed)  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "--rootdir", str(REAL), str(REAL / module)]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = (result.stdout + result.stderr)[-12000:]
    assert result.returncode == 0, f"{module} against the real vllm-ascend {installed} failed:\n{tail}"
    assert " passed" in result.stdout and " failed" not in result.stdout, tail


def _test_command(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if "pip install" in line and "-m pytest" in line]
    assert len(lines) == 1, lines
    return lines[0]


def test_readme_test_command_is_what_ci_runs_and_keeps_pip_quiet() -> None:
    """Section 8: one command, in the README and in .ci/run; every pip install passes --no-warn-conflicts
    (the --no-deps installs otherwise print a wall of resolver complaints) and it installs this harness."""
    readme = _test_command((ROOT / "README.md").read_text())
    assert readme == _test_command((ROOT / ".ci" / "run").read_text())
    installs = [part for part in readme.split("&&") if "pip install" in part]
    assert installs
    assert all("--no-warn-conflicts" in part and "-c constraints.txt" in part for part in installs)
    assert "tests/integration/real_vllm_ascend/install.py" in readme


def test_ci_stops_when_the_readme_test_command_fails(tmp_path: Path) -> None:
    """A failure anywhere in the README command's && chain (an install out of disk space, a failing test)
    fails .ci/run: at top level, set -e would let a failed chain through and CI would end green."""
    ci = (ROOT / ".ci" / "run").read_text()
    readme = _test_command(ci)
    script = ci.replace(readme, "true && false && true").replace(".ci/sanitize", "echo REACHED")
    script = script.replace('cd "$(dirname "$0")/.."', "")
    path = tmp_path / "run"
    path.write_text(script)
    got = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=30)
    assert got.returncode != 0 and "REACHED" not in got.stdout, got


def test_harness_pins_every_package_and_never_torch() -> None:
    names = sorted(p.name for p in REAL.glob("*requirements*.txt"))
    assert {"requirements.txt", "requirements-main.txt", "requirements-updatable.txt"} <= set(names)
    for name in names:
        pins = [line for line in (REAL / name).read_text().splitlines() if line and not line.startswith("#")]
        assert pins and all("==" in line for line in pins), name
        packages = {line.split("==")[0].lower() for line in pins}
        assert not packages & {"torch", "torchvision", "torch-npu", "torchaudio", "triton"}, name
