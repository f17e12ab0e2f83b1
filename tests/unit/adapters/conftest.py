"""Fixtures of the fake vllm-ascend tree for the patch, routing and plugin tests of this folder."""

from vllm_plugin_harness import av1, fake_tree, kernels

__all__ = ["av1", "fake_tree", "kernels"]
