"""pytest plugin: applies graphbuf's vllm-ascend patch before upstream's tests import the attention module.

``patch.install()`` defers to the import hook, so ``vllm_ascend.attention.attention_v1`` is patched (after
the whole-surface check) the moment upstream's tests first import it. Loaded with ``-p graphbuf_patch``.
"""

from __future__ import annotations

import sys

import graphbuf.adapters.vllm_ascend.glue.patch as patch

STATE = patch.install()


def pytest_report_header() -> str:
    return f"graphbuf vllm-ascend patch: {STATE}"


def pytest_sessionfinish(session: object, exitstatus: int) -> None:
    module = sys.modules.get(patch.TARGET_MODULE)
    if module is not None and not patch.is_patched(module):
        raise RuntimeError(f"graphbuf's patch was not applied: {patch.inactive_reason()}")
