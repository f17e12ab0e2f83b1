"""A Gemma4 text config for an assistant whose every layer is KV-shared (transformers 5.23.0).

``Gemma4AssistantConfig`` requires ``num_kv_shared_layers == num_hidden_layers`` (every assistant layer reads
the target's K/V), but ``Gemma4TextConfig.kv_sharing_modes`` raises for exactly that layout ("The set of layer
types producing a cache is different than the set of layer types using them": it looks for a producing layer
among the unshared ones, and there are none), so ``Gemma4AssistantForCausalLM`` cannot be built from its own
config. :class:`QueryOnlyTextConfig` answers ``"reuse"`` for every layer in that layout and defers to
transformers otherwise. Imported lazily (by :func:`.tiny.build_assistant`), as every transformers import of
the drill.
"""

from __future__ import annotations

from transformers import Gemma4TextConfig

__all__ = ["QueryOnlyTextConfig"]


class QueryOnlyTextConfig(Gemma4TextConfig):
    """``Gemma4TextConfig`` whose ``kv_sharing_modes`` accepts a model with every layer KV-shared."""

    @property
    def kv_sharing_modes(self) -> list[str | None]:
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return super().kv_sharing_modes
