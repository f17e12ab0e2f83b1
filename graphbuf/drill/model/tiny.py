"""The tiny Gemma4: transformers' own ``Gemma4ForCausalLM`` from a small config, with seeded random weights.

The geometry comes from the model spec's constants (``specs/gemma4-tiny-model.yaml``): 5 sliding : 1 full
layers with the last layer full, full layers at head_dim ``global_head_dim`` (512) with ``attention_k_eq_v``
(no v_proj; V = v_norm(k_proj x)) and ``num_global_key_value_heads`` KV heads, sliding layers with a window,
final logit soft-capping. transformers is imported here, lazily, and nowhere else in graphbuf.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from graphbuf.errors import SpecError

__all__ = ["MODEL_CONSTANTS", "build_model", "layer_types", "tiny_config"]

#: The spec constants the tiny model is built from.
MODEL_CONSTANTS = (
    "num_layers", "sliding_layers_per_full", "hidden_size", "intermediate_size", "vocab_size",
    "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window", "num_global_key_value_heads",
    "global_head_dim", "final_logit_softcapping", "max_model_len",
)  # fmt: skip


def layer_types(num_layers: int, sliding_per_full: int) -> list[str]:
    """Gemma4's pattern: ``sliding_per_full`` sliding layers, then one full; the last layer is full."""
    types = [
        "full_attention" if (i + 1) % (sliding_per_full + 1) == 0 else "sliding_attention"
        for i in range(num_layers)
    ]
    types[-1] = "full_attention"
    return types


def _constants(constants: Mapping[str, Any]) -> dict[str, int]:
    missing = [name for name in MODEL_CONSTANTS if constants.get(name) is None]
    if missing:
        raise SpecError(f"model drill: the spec lacks the model constants {missing}; see gemma4-tiny-model")
    return {name: int(constants[name]) for name in MODEL_CONSTANTS}


def tiny_config(constants: Mapping[str, Any]) -> Any:
    """A ``Gemma4TextConfig`` with the spec's geometry (eager attention, no per-layer embeddings, no MoE,
    no KV-shared layers, no end-of-sequence token so generation runs to its length)."""
    from transformers import Gemma4TextConfig

    c = _constants(constants)
    return Gemma4TextConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_layers"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        global_head_dim=c["global_head_dim"],
        num_global_key_value_heads=c["num_global_key_value_heads"],
        attention_k_eq_v=True,
        sliding_window=c["sliding_window"],
        layer_types=layer_types(c["num_layers"], c["sliding_layers_per_full"]),
        final_logit_softcapping=float(c["final_logit_softcapping"]),
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=c["vocab_size"],
        num_kv_shared_layers=0,
        max_position_embeddings=4 * c["max_model_len"],
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="eager",
    )


def build_model(constants: Mapping[str, Any], *, dtype: torch.dtype, seed: int, device: str = "cpu") -> Any:
    """The tiny ``Gemma4ForCausalLM`` in eval mode on ``device``: weights drawn from ``seed`` (linear weights
    N(0, 1/fan_in), embeddings N(0, 0.05²), norm weights 1 + N(0, 0.2²)), then cast to ``dtype``."""
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(tiny_config(constants))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    model.tie_weights()
    return model.to(device=device, dtype=dtype).eval()
