"""Runs ``tests/real_vllm_ascend/`` against the real vllm-ascend 0.23.0.post1 and vLLM 0.23.0.

The real packages go first on ``sys.path`` of a subprocess only (its own pytest run, bootstrapped by
``tests/real_vllm_ascend/conftest.py``), never in this process. ``install.py`` installs them once into
``.cache/real-vllm-ascend`` (git-ignored); this test installs them itself when they are missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REAL = HERE / "real_vllm_ascend"
ROOT = HERE.parent

pytestmark = pytest.mark.real_vllm_ascend


@pytest.fixture(scope="module")
def installed() -> None:
    sys.path.insert(0, str(REAL))
    try:
        import install

        install.ensure()
    finally:
        sys.path.remove(str(REAL))


@pytest.mark.parametrize("module", sorted(p.name for p in REAL.glob("test_real_*.py")))
def test_real_module(installed: None, module: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_PLUGINS="", GRAPHBUF_REAL_VLLM_ASCEND="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "--rootdir", str(REAL), str(REAL / module)]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = (result.stdout + result.stderr)[-12000:]
    assert result.returncode == 0, f"{module} against the real vllm-ascend failed:\n{tail}"
    assert " passed" in result.stdout and " failed" not in result.stdout, tail
