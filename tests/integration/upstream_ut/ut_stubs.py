"""pytest plugin for vllm-ascend's own ``tests/ut`` on CPU: stubs the packages its conftest's import chain
reaches but that cannot load here.

``torchvision`` (transformers' video processors import it; its native part does not load against CPU torch
2.13) and ``opentelemetry`` (optional tracing, imported by vLLM's OpenAI server modules) become modules
that answer every attribute with a ``MagicMock``. Nothing the attention and ACL-graph tests exercise runs
through them. Loaded with ``-p ut_stubs`` before upstream's conftest.

Upstream's conftest stubs ``torch_npu`` with a plain module holding a few ``MagicMock`` attributes; its NPU
(``a2/``) tests ``patch`` more of them (``patch`` refuses an attribute a module lacks). At session start the
ops in :data:`NPU_OPS` that the module lacks are added as ``MagicMock``s, so those tests run on CPU instead
of failing in their decorators; and vLLM's CPU platform, which has no graph pool (an NPU platform hands
``ACLGraphWrapper`` one), gets a ``MagicMock`` pool.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any
from unittest.mock import MagicMock

STUBBED = ("torchvision", "opentelemetry")
NPU_OPS = ("_npu_paged_attention", "_npu_paged_attention_get_workspace", "npu_fused_infer_attention_score_v2")
"""``torch_npu`` ops upstream's a2 attention tests patch but its CPU conftest stub does not define."""


class _Anything(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = MagicMock(name=f"{self.__name__}.{attr}")
        setattr(self, attr, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _Anything(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__version__ = "0.0.0"


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())


def pytest_sessionstart(session: Any) -> None:
    torch_npu = sys.modules.get("torch_npu")
    if torch_npu is None:
        return
    for name in NPU_OPS:
        if name not in vars(torch_npu):
            setattr(torch_npu, name, MagicMock(name=f"torch_npu.{name}"))
    from vllm.platforms import current_platform

    platform = type(current_platform)
    if getattr(platform, "_global_graph_pool", "absent") is None:
        platform._global_graph_pool = MagicMock(name="graph_pool")
