"""Install the real vllm-ascend 0.23.0.post1 Python package and its pair vLLM 0.23.0 for CPU tests.

Nothing is compiled and nothing enters the calling venv: everything goes under ``CACHE`` (git-ignored):

* ``build/``: setuptools_scm, pybind11, wheel (``build-requirements.txt``), on ``PYTHONPATH`` of the
  no-build-isolation sdist build only;
* ``vllm_ascend/``: ``vllm-ascend==0.23.0.post1`` from its sdist, ``COMPILE_CUSTOM_KERNELS=0``;
* ``vllm/``: ``vllm==0.23.0`` wheel, ``--no-deps``;
* ``deps/``: the pure-Python import chain (``requirements.txt``), ``--no-deps`` with exact pins.

Idempotent: a stamp file records what was installed; a second run with the same pins does nothing.
Run ``python tests/real_vllm_ascend/install.py`` (prints the cache path); tests call :func:`ensure`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CACHE = ROOT / ".cache" / "real-vllm-ascend"
VLLM_ASCEND = "vllm-ascend==0.23.0.post1"
VLLM = "vllm==0.23.0"
SITE_DIRS = ("vllm_ascend", "vllm", "deps")
"""Subdirectories of ``CACHE`` that go first on ``sys.path`` (in this order) in a real-module subprocess."""

_PIP_QUIET = ["-q", "--disable-pip-version-check", "--no-warn-conflicts", "--no-input"]


def _stamp() -> str:
    h = hashlib.sha256()
    for name in ("requirements.txt", "build-requirements.txt", "install.py"):
        h.update((HERE / name).read_bytes())
    h.update(f"{VLLM_ASCEND} {VLLM} {sys.version_info[:2]}".encode())
    return h.hexdigest()[:16]


def _pip(*args: str, env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", "install", *_PIP_QUIET, *args]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")


def ensure() -> Path:
    """Install into ``CACHE`` unless the stamp says it is there; return ``CACHE``."""
    stamp_file = CACHE / "installed.stamp"
    stamp = _stamp()
    if stamp_file.exists() and stamp_file.read_text().strip() == stamp:
        return CACHE
    if CACHE.exists():
        shutil.rmtree(CACHE)
    CACHE.mkdir(parents=True)
    build = CACHE / "build"
    _pip("--no-deps", "--target", str(build), "-r", str(HERE / "build-requirements.txt"))
    env = dict(os.environ)
    env.update(
        SOC_VERSION="ascend910b1",
        COMPILE_CUSTOM_KERNELS="0",
        PYTHONPATH=os.pathsep.join(filter(None, [str(build), env.get("PYTHONPATH", "")])),
    )
    _pip("--no-deps", "--no-build-isolation", "--target", str(CACHE / "vllm_ascend"), VLLM_ASCEND, env=env)
    _pip("--no-deps", "--target", str(CACHE / "vllm"), VLLM)
    _pip("--no-deps", "--target", str(CACHE / "deps"), "-r", str(HERE / "requirements.txt"))
    stamp_file.write_text(stamp + "\n")
    return CACHE


if __name__ == "__main__":
    start = time.perf_counter()
    path = ensure()
    print(f"real vllm-ascend test harness: {path} ({time.perf_counter() - start:.1f} s)")
