"""pytest plugin for vllm-ascend's own ``tests/ut`` on CPU: stubs the packages its conftest's import chain
reaches but that cannot load here.

``torchvision`` (transformers' video processors import it; its native part does not load against CPU torch
2.13) and ``opentelemetry`` (optional tracing, imported by vLLM's OpenAI server modules) become modules
that answer every attribute with a ``MagicMock``. Nothing the attention and ACL-graph tests exercise runs
through them. Loaded with ``-p ut_stubs`` before upstream's conftest.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any
from unittest.mock import MagicMock

STUBBED = ("torchvision", "opentelemetry")


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
