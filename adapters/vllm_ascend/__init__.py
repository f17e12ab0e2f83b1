"""graphbuf's vllm-ascend adapter (installed as ``graphbuf.adapters.vllm_ascend``).

This package file imports nothing: the vLLM plugin module beside it must stay importable with the standard
library alone. Import the heavy parts explicitly: ``large_head`` (Gemma4 head_dim-512 decode and MTP verify
attention) and ``kernels`` (the NPU kernels or their software stand-ins).
"""

__all__: list[str] = []
