"""Install the real vllm-ascend Python packages and their vLLM pairs for CPU tests: three upstreams.

* ``0.23``: vllm-ascend 0.23.0.post1 (registry sdist) + vLLM 0.23.0, in ``.cache/real-vllm-ascend``;
* ``main``: vllm-ascend main 182b75ea (the tarball in the shared folder's ``upstream/``, installed offline
  with ``SETUPTOOLS_SCM_PRETEND_VERSION``: a tarball has no git history) + vLLM 0.27.1, in
  ``.cache/real-vllm-ascend-main``;
* ``updatable``: the reconstructed UpdatableGraph tree (182b75ea with the post-change ``updatable_graph.py``,
  ``acl_graph.py``, ``attention_v1.py`` and ``utils.py`` of one public commit, daa64412; its
  ``RECONSTRUCTION.md`` says what is coherent), the shared folder's tarball, + vLLM 0.28.0, in
  ``.cache/real-vllm-ascend-updatable``. It stands for vllm-ascend 0.30+, where the graph owns the tasks.

Every tarball is checked against its sha256 (:data:`SHA256`) before pip reads it.

Nothing is compiled and nothing enters the calling venv: everything goes under the upstream's cache
directory (git-ignored):

* ``build/``: setuptools_scm, pybind11, wheel (``build-requirements.txt``), on ``PYTHONPATH`` of the
  no-build-isolation build only;
* ``vllm_ascend/``: vllm-ascend, ``COMPILE_CUSTOM_KERNELS=0``;
* ``vllm/``: the vLLM wheel, ``--no-deps``;
* ``deps/``: the pure-Python import chain (``requirements.txt`` / ``requirements-main.txt``), ``--no-deps``
  with exact pins.

The shared folder is ``ROOT.parent / "shared"`` (CI lays it beside the clone), or ``GRAPHBUF_SHARED`` when
set; the ``main`` upstream fails loudly when its tarball is not there. The tarball is read only: pip reads it
in place and writes nothing beside it. Idempotent: a stamp file per upstream records what was installed; a
second run with the same pins does nothing. Run ``python tests/integration/real_vllm_ascend/install.py
[NAME ...]`` (default: all three; prints the cache paths; also installs upstream's unit-test dependencies,
:func:`ensure_ut`); tests call :func:`ensure`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SHARED_ENV = "GRAPHBUF_SHARED"
"""Environment variable naming the shared folder (default ``ROOT.parent / "shared"``)."""
UPSTREAM_ENV = "GRAPHBUF_REAL_UPSTREAM"
"""Environment variable naming the upstream a real-module subprocess runs against (default ``0.23``)."""
SITE_DIRS = ("vllm_ascend", "vllm", "deps")
"""Subdirectories of a cache that go first on ``sys.path`` (in this order) in a real-module subprocess."""

_SITE_LAYOUT = 2
"""Bump when the cache layout or the install steps change: every cache is then rebuilt."""
_PIP_QUIET = ["-q", "--disable-pip-version-check", "--no-warn-conflicts", "--no-input"]


@dataclass(frozen=True)
class Upstream:
    """One vllm-ascend + vLLM pair: ``vllm_ascend`` is a requirement, or a tarball path under the shared
    folder's ``upstream/`` when ``pretend_version`` is set."""

    name: str
    cache: Path
    vllm_ascend: str
    vllm: str
    requirements: str
    pretend_version: str | None = None


UPSTREAMS: dict[str, Upstream] = {
    "0.23": Upstream(
        "0.23", ROOT / ".cache" / "real-vllm-ascend", "vllm-ascend==0.23.0.post1", "vllm==0.23.0",
        "requirements.txt",
    ),
    "main": Upstream(
        "main", ROOT / ".cache" / "real-vllm-ascend-main", "vllm-ascend-main-182b75ea.tar.gz", "vllm==0.27.1",
        "requirements-main.txt", pretend_version="0.19.1rc2.dev1637+g182b75ea8",
    ),
    "updatable": Upstream(
        "updatable", ROOT / ".cache" / "real-vllm-ascend-updatable",
        "vllm-ascend-main-updatable-recon-daa6441.tar.gz", "vllm==0.28.0", "requirements-updatable.txt",
        pretend_version="0.28.0.dev0+recon.daa6441",
    ),
}  # fmt: skip
"""The upstreams every real-module test runs against."""

UT_DEPS = ROOT / ".cache" / "upstream-ut-deps"
"""What vllm-ascend's own ``tests/ut`` conftest imports beyond an upstream's chain (``requirements-ut.txt``),
shared by every upstream; :func:`ensure_ut`."""
UT_TARBALLS = {
    "0.23": "vllm-ascend-v0.23.0-tests-ut.tar.gz",
    "main": "vllm-ascend-182b75ea-tests-ut.tar.gz",
    "updatable": "vllm-ascend-updatable-recon-daa6441-tests-ut.tar.gz",
}
"""Upstream's unit tests per upstream, in the shared folder's ``upstream/`` (the reconstruction's are
182b75ea's, unchanged, with its ``EXPECTED-RESULTS.md``)."""
SHA256 = {
    "vllm-ascend-main-182b75ea.tar.gz": "938f7918200d8c743b45f594c98387c1ba419677e50292b260e93217f819d83b",
    "vllm-ascend-main-updatable-recon-daa6441.tar.gz":
        "68ccc42a36fcd0836e1889f478340beabc52bfbccbb309c2e494bdf3a384e903",
    "vllm-ascend-updatable-recon-daa6441-tests-ut.tar.gz":
        "9cc2c882766008dc1f5e79e23fbed9b112ffc77fad765893a2838df79a879b79",
}  # fmt: skip
"""The published sha256 of the shared tarballs (``upstream/README.md``), checked by :func:`shared_tarball`."""

# Kept for callers of the one-upstream harness.
CACHE = UPSTREAMS["0.23"].cache
VLLM_ASCEND = UPSTREAMS["0.23"].vllm_ascend
VLLM = UPSTREAMS["0.23"].vllm


def shared_dir() -> Path:
    """The shared folder: ``$GRAPHBUF_SHARED`` or ``ROOT.parent / "shared"``; FileNotFoundError if absent."""
    path = Path(os.environ.get(SHARED_ENV) or ROOT.parent / "shared")
    if not (path / "upstream").is_dir():
        raise FileNotFoundError(
            f"the shared folder {path} has no upstream/ (CI lays shared/ beside the clone; elsewhere set "
            f"{SHARED_ENV}); the vllm-ascend main tarball and upstream's unit tests live there"
        )
    return path


def shared_tarball(name: str) -> Path:
    """The shared folder's ``upstream/<name>``, its sha256 checked where one is published (ValueError on a
    mismatch: a different tree would silently change what every real-module test means)."""
    tarball = shared_dir() / "upstream" / name
    if not tarball.is_file():
        raise FileNotFoundError(f"{tarball} is missing (the shared folder's upstream sources)")
    expected = SHA256.get(name)
    if expected is not None:
        got = hashlib.sha256(tarball.read_bytes()).hexdigest()
        if got != expected:
            raise ValueError(f"{tarball}: sha256 {got}, expected {expected} (upstream/README.md)")
    return tarball


def _source(upstream: Upstream) -> str:
    if upstream.pretend_version is None:
        return upstream.vllm_ascend
    return str(shared_tarball(upstream.vllm_ascend))


def _stamp(upstream: Upstream) -> str:
    h = hashlib.sha256()
    for name in (upstream.requirements, "build-requirements.txt"):
        h.update((HERE / name).read_bytes())
    what = (upstream.name, upstream.vllm_ascend, upstream.vllm, upstream.pretend_version)  # not the path
    h.update(f"{what!r} {_SITE_LAYOUT} {sys.version_info[:2]}".encode())
    return h.hexdigest()[:16]


def _pip(*args: str, env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", "install", *_PIP_QUIET, *args]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")


def ensure(name: str = "0.23") -> Path:
    """Install upstream ``name`` into its cache unless the stamp says it is there; return the cache."""
    upstream = UPSTREAMS[name]
    cache = upstream.cache
    stamp_file = cache / "installed.stamp"
    stamp = _stamp(upstream)
    if stamp_file.exists() and stamp_file.read_text().strip() == stamp:
        return cache
    source = _source(upstream)
    if cache.exists():
        shutil.rmtree(cache)
    cache.mkdir(parents=True)
    build = cache / "build"
    _pip("--no-deps", "--target", str(build), "-r", str(HERE / "build-requirements.txt"))
    env = dict(os.environ)
    env.update(
        SOC_VERSION="ascend910b1",
        COMPILE_CUSTOM_KERNELS="0",
        PYTHONPATH=os.pathsep.join(filter(None, [str(build), env.get("PYTHONPATH", "")])),
    )
    if upstream.pretend_version is not None:
        env["SETUPTOOLS_SCM_PRETEND_VERSION"] = upstream.pretend_version
    _pip("--no-deps", "--no-build-isolation", "--target", str(cache / "vllm_ascend"), source, env=env)
    _pip("--no-deps", "--target", str(cache / "vllm"), upstream.vllm)
    _pip("--no-deps", "--target", str(cache / "deps"), "-r", str(HERE / upstream.requirements))
    stamp_file.write_text(stamp + "\n")
    return cache


def ensure_ut() -> Path:
    """Install ``requirements-ut.txt`` into ``UT_DEPS`` unless its stamp says it is there; return it."""
    stamp_file = UT_DEPS / "installed.stamp"
    h = hashlib.sha256((HERE / "requirements-ut.txt").read_bytes())
    stamp = f"{h.hexdigest()[:16]} {_SITE_LAYOUT} {sys.version_info[:2]}"
    if stamp_file.exists() and stamp_file.read_text().strip() == stamp:
        return UT_DEPS
    if UT_DEPS.exists():
        shutil.rmtree(UT_DEPS)
    _pip("--no-deps", "--target", str(UT_DEPS), "-r", str(HERE / "requirements-ut.txt"))
    stamp_file.write_text(stamp + "\n")
    return UT_DEPS


if __name__ == "__main__":
    for _name in sys.argv[1:] or list(UPSTREAMS):
        start = time.perf_counter()
        path = ensure(_name)
        print(f"real vllm-ascend test harness {_name}: {path} ({time.perf_counter() - start:.1f} s)")
    start = time.perf_counter()
    print(f"upstream unit-test dependencies: {ensure_ut()} ({time.perf_counter() - start:.1f} s)")
