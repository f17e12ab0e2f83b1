"""Glue to vLLM and vllm-ascend: the plugin, the patch, the routing, what a routed call resolves, and the
upstream surface table. Imports nothing itself."""
