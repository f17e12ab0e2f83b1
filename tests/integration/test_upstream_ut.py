"""vllm-ascend's own attention and ACL-graph unit tests keep their outcome under graphbuf's patch (#23 §4,
#31 §4).

For each upstream (``install.UPSTREAMS``: 0.23.0.post1 + vLLM 0.23.0, main 182b75ea + vLLM 0.27.1, the
reconstructed UpdatableGraph tree + vLLM 0.28.0) the shared folder's ``tests/ut`` tarball of that tree is
extracted into a temporary directory (the tarball is only read) and upstream's
``tests/ut/attention/test_attention_mask.py``, ``tests/ut/attention/a2/test_attention_v1.py`` (its
``update_graph_params`` tests run on CPU, filling ``attn_metadata`` with ``MagicMock``s) and
``tests/ut/compilation`` run twice with upstream's own conftest: once as they are, once with graphbuf's patch
applied (``tests/integration/upstream_ut/graphbuf_patch.py``). Every test must end the same way both times,
and the plain run must fail exactly the tests ``upstream_ut/expected_outcomes.py`` lists for that tree, each
with the cause the tree itself gives it (none on 0.23 and main; on the reconstruction, 182b75ea's tests
meeting the PCP refactor and the UpdatableGraph capture).

``tests/integration/upstream_ut/ut_stubs.py`` stubs torchvision (its native part does not load against CPU
torch 2.13) and opentelemetry and fills the torch_npu attributes the NPU-designated tests patch;
``pcp_shim.py`` (the reconstruction only) lets ``a2/test_attention_v1.py`` be collected;
``requirements-ut.txt`` holds the pure-Python packages upstream's conftest imports.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REAL = HERE / "real_vllm_ascend"
PLUGINS = HERE / "upstream_ut"
UPSTREAMS = ("0.23", "main", "updatable")
SHIMS = {"updatable": ["-p", "pcp_shim"]}
"""Extra plugins per upstream (loaded in both runs)."""
SELECTED = ("tests/ut/attention/test_attention_mask.py", "tests/ut/attention/a2/test_attention_v1.py",
            "tests/ut/compilation")  # fmt: skip
"""Upstream's attention and ACL-graph unit tests, relative to the extracted tree."""

pytestmark = pytest.mark.real_vllm_ascend


def _harness():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(REAL))
    try:
        import install

        return install
    finally:
        sys.path.remove(str(REAL))


def _outcomes(report: Path) -> dict[str, str]:
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = kinds[0] if kinds else "passed"
    return outcomes


def _run(install, upstream: str, tree: Path, report: Path, patched: bool) -> dict[str, str]:  # type: ignore[no-untyped-def]
    cache = install.ensure(upstream)
    paths = [str(PLUGINS), *(str(cache / d) for d in install.SITE_DIRS), str(install.ensure_ut()), str(tree)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(PYTHONPATH=os.pathsep.join(paths), VLLM_TARGET_DEVICE="cpu", VLLM_PLUGINS="")
    plugins = ["-p", "ut_stubs", *SHIMS.get(upstream, []), *(["-p", "graphbuf_patch"] if patched else [])]
    cmd = [sys.executable, "-m", "pytest", "-q", *plugins, "-p", "no:cacheprovider", "-o", "addopts=",
           f"--junitxml={report}", *SELECTED]  # fmt: skip
    result = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    tail = (result.stdout + result.stderr)[-6000:]
    assert result.returncode in (0, 1) and report.exists(), f"{upstream}: upstream tests did not run:\n{tail}"
    if patched:  # the plugin's session-end check fails the run when the hook left the module unpatched
        assert "graphbuf's patch was not applied" not in tail, tail
    return _outcomes(report)


def _expected_failures(upstream: str) -> dict[str, str]:
    sys.path.insert(0, str(PLUGINS))
    try:
        import expected_outcomes

        return expected_outcomes.EXPECTED_FAILURES[upstream]
    finally:
        sys.path.remove(str(PLUGINS))


@pytest.mark.parametrize("upstream", UPSTREAMS)
def test_upstream_unit_tests_keep_their_outcome_under_the_patch(tmp_path: Path, upstream: str) -> None:
    install = _harness()
    assert tuple(install.UT_TARBALLS) == UPSTREAMS
    tarball = install.shared_tarball(install.UT_TARBALLS[upstream])
    with tarfile.open(tarball) as archive:
        archive.extractall(tmp_path, filter="data")
    [tree] = [p for p in tmp_path.iterdir() if (p / "tests" / "ut" / "conftest.py").exists()]
    plain = _run(install, upstream, tree, tmp_path / "plain.xml", patched=False)
    patched = _run(install, upstream, tree, tmp_path / "patched.xml", patched=True)
    assert sum(1 for o in plain.values() if o == "passed") >= 25, plain
    assert any("update_graph_params" in name for name in plain), sorted(plain)
    failing = {name for name, outcome in plain.items() if outcome in ("failure", "error")}
    expected = _expected_failures(upstream)
    assert failing == set(expected), (
        f"{upstream}: the plain run fails {sorted(failing - set(expected))} beyond the tree's own list and "
        f"passes {sorted(set(expected) - failing)} from it (upstream_ut/expected_outcomes.py)"
    )
    changed = {name: (plain.get(name), patched.get(name)) for name in plain.keys() | patched.keys()
               if plain.get(name) != patched.get(name)}  # fmt: skip
    assert changed == {}, f"{upstream}: outcome changed under graphbuf's patch (plain, patched): {changed}"
