"""Fake ``vllm_ascend`` for graphbuf's plugin tests, put on ``sys.path`` by
``tests/unit/adapters/glue/test_plugin.py``.

The real vllm-ascend cannot be imported on a CPU machine: its attention module imports ``torch_npu`` at
module level. This tree reproduces only what graphbuf's patch touches: ``__version__``,
``ascend_forward_context._EXTRA_CTX.capturing``, ``attention.utils.AscendCommonAttentionMetadata`` and
``attention.attention_v1`` with the class and method names and signatures of vllm-ascend 0.25.1 - main. The
original methods record their calls.
"""

__version__ = "0.23.0"
