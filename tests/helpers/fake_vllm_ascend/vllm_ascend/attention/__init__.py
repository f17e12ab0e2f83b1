"""Fake vllm_ascend.attention package."""
