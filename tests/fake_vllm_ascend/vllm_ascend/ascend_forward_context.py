"""Fake of vllm_ascend.ascend_forward_context: only the ``_EXTRA_CTX.capturing`` flag graphbuf reads."""

from types import SimpleNamespace

_EXTRA_CTX = SimpleNamespace(capturing=False)
