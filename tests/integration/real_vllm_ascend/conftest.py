"""Bootstrap of the real-module tests: runs only in a subprocess
(``tests/integration/test_real_vllm_ascend.py``).

The main test run ignores this directory (``--ignore`` in pyproject's addopts). Here the real vllm-ascend and
its vLLM of the upstream ``$GRAPHBUF_REAL_UPSTREAM`` names (``install.UPSTREAMS``: ``0.23`` by default, or
``main``) go first on ``sys.path``, ``torch_npu`` is graphbuf's own stub
(``torch_npu_stub.py``), and vllm-ascend's attention module is imported the way the platform imports it
(``vllm_ascend.ops`` first: importing ``attention_v1`` alone stops in a circular import).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import importlib  # noqa: E402
import os  # noqa: E402

import install  # noqa: E402
import torch_npu_stub  # noqa: E402

UPSTREAM = os.environ.get(install.UPSTREAM_ENV, "0.23")
_cache = install.ensure(UPSTREAM)
sys.path[:0] = [str(_cache / name) for name in install.SITE_DIRS]
torch_npu_stub.install()
for _name in ("vllm_ascend.ops", "vllm_ascend.attention.attention_v1"):  # in this order
    importlib.import_module(_name)

from real_fixtures import *  # noqa: E402, F403


def pytest_report_header() -> str:
    return f"real upstream: {UPSTREAM} ({_cache})"
