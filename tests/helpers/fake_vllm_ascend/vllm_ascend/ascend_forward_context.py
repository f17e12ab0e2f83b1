"""Fake of vllm_ascend.ascend_forward_context: the ``_EXTRA_CTX`` proxy and its ``capturing`` flag."""


class _ExtraForwardContextProxy:
    extra_attrs = ("capturing",)

    def __init__(self) -> None:
        self.capturing = False


_EXTRA_CTX = _ExtraForwardContextProxy()
