"""The tiny Gemma4 and its MTP assistant: transformers' own ``Gemma4ForCausalLM`` and
``Gemma4AssistantForCausalLM`` from small configs, with seeded random weights.

The geometry comes from the model spec's constants (``specs/gemma4-tiny-model.yaml``):
``sliding_layers_per_full`` sliding : 1 full layers with the last layer full, full layers at head_dim
``global_head_dim`` (512) with ``attention_k_eq_v`` (no v_proj; V = v_norm(k_proj x)) and
``num_global_key_value_heads`` KV heads, sliding layers with a window, final logit soft-capping. The
assistant has ``assistant_layers`` query-only layers (the last one full, the rest sliding), every one
KV-shared: it reads the target's KV of its last sliding and last full layer. transformers is imported lazily,
and only inside this package.

Random weights alone make an assistant that never agrees with its target. So the target's ``lm_head`` (untied)
adds to the embedding a successor term: ``lm_head[v] = E[v] + SUCCESSOR * E[pred(v)]`` for a permutation
``succ`` drawn from the seed (:func:`successor`), which makes ``succ(x)`` the target's choice after ``x``
at about half the positions; elsewhere the layers (attention included) decide. The assistant is derived
from the target (:func:`build_assistant`): ``pre_projection`` maps the target's embedding of its input token
through a random projection ``P``, its ``lm_head[v]`` is ``P E[pred(v)]``, so it drafts ``succ(x)``, and is
right where the target is predictable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from graphbuf.errors import SpecError

__all__ = [
    "ASSISTANT_RESIDUAL",
    "MODEL_CONSTANTS",
    "SUCCESSOR",
    "build_assistant",
    "build_model",
    "build_models",
    "layer_types",
    "successor",
    "tiny_config",
]

#: The spec constants the tiny model is built from.
MODEL_CONSTANTS = (
    "num_layers", "sliding_layers_per_full", "hidden_size", "intermediate_size", "vocab_size",
    "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window", "num_global_key_value_heads",
    "global_head_dim", "final_logit_softcapping", "max_model_len", "assistant_layers",
    "assistant_hidden_size", "assistant_intermediate_size",
)  # fmt: skip
#: The successor term's weight in the target's ``lm_head`` (module docstring): the larger, the more often the
#: target chooses ``succ(x)`` after ``x`` (about half the positions of a greedy stream at 1.5).
SUCCESSOR = 1.5
#: The assistant's post-attention and post-feedforward norm weights, scaled: its layers' share of the
#: residual, so the input token's projection still decides most drafts.
ASSISTANT_RESIDUAL = 0.5


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
    no KV-shared layers, ``lm_head`` untied from the embedding, no end-of-sequence token so generation runs
    to its length)."""
    from transformers import Gemma4TextConfig

    c = _constants(constants)
    return Gemma4TextConfig(
        **_shared_geometry(c),
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_layers"],
        layer_types=layer_types(c["num_layers"], c["sliding_layers_per_full"]),
        final_logit_softcapping=float(c["final_logit_softcapping"]),
        vocab_size_per_layer_input=c["vocab_size"],
        num_kv_shared_layers=0,
        tie_word_embeddings=False,
    )


def _shared_geometry(c: Mapping[str, int]) -> dict[str, Any]:
    """What the target's and the assistant's text configs share: the vocabulary, the attention geometry
    (the assistant reads the target's KV caches), the positions and the special tokens."""
    return {
        "vocab_size": c["vocab_size"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"],
        "head_dim": c["head_dim"],
        "global_head_dim": c["global_head_dim"],
        "num_global_key_value_heads": c["num_global_key_value_heads"],
        "attention_k_eq_v": True,
        "sliding_window": c["sliding_window"],
        "hidden_size_per_layer_input": 0,
        "max_position_embeddings": 4 * c["max_model_len"],
        "pad_token_id": 0,
        "bos_token_id": None,
        "eos_token_id": None,
        "attn_implementation": "eager",
    }


def _assistant_text(
    constants: Mapping[str, Any], layer_kinds: list[str], shared: int, config_class: Any
) -> Any:
    c = _constants(constants)
    return config_class(
        **_shared_geometry(c),
        hidden_size=c["assistant_hidden_size"],
        intermediate_size=c["assistant_intermediate_size"],
        num_hidden_layers=len(layer_kinds),
        layer_types=layer_kinds,
        final_logit_softcapping=None,
        vocab_size_per_layer_input=0,
        num_kv_shared_layers=shared,
    )


def _randomize(model: Any, seed: int) -> None:
    """From ``seed``: linear weights N(0, 1/fan_in), embeddings N(0, 0.15²), norm weights 1 + N(0, 0.2²), the
    q and k norms' times ``head_dim ** -0.25`` (attention scores of unit spread at Gemma4's scale 1.0, as
    trained q/k norms give; at 1 their spread is ``sqrt(head_dim)`` and bf16 rounding decides every
    softmax)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                scale = p.shape[0] ** -0.25 if name.endswith(("q_norm.weight", "k_norm.weight")) else 1.0
                p.copy_(scale * (1.0 + 0.2 * torch.randn(p.shape, generator=gen)))
            elif "embed_tokens" in name:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    model.tie_weights()


def successor(vocab: int, seed: int) -> torch.Tensor:
    """The permutation ``succ`` (``succ[x]``: the token the target favours after ``x``), from ``seed``."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 2))


def build_model(constants: Mapping[str, Any], *, dtype: torch.dtype, seed: int, device: str = "cpu") -> Any:
    """The tiny ``Gemma4ForCausalLM`` in eval mode on ``device``, weights drawn from ``seed``
    (:func:`_randomize`) with the successor term in its ``lm_head`` (module docstring), then cast to
    ``dtype``."""
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(tiny_config(constants))
    _randomize(model, seed)
    embedding = model.model.embed_tokens.weight
    pred = torch.argsort(successor(embedding.shape[0], seed))  # pred[succ[x]] == x
    with torch.no_grad():
        model.lm_head.weight.copy_(embedding + SUCCESSOR * embedding[pred])
    return model.to(device=device, dtype=dtype).eval()


def build_assistant(
    constants: Mapping[str, Any], target: Any, *, dtype: torch.dtype, seed: int, device: str = "cpu"
) -> Any:
    """The tiny ``Gemma4AssistantForCausalLM`` beside ``target`` (:func:`build_model`'s, same ``seed``):
    ``assistant_layers`` query-only layers (sliding, the last full) at the target's head geometry, every one
    KV-shared, hidden size ``assistant_hidden_size``, ``pre_projection`` from twice the target's hidden size.
    Weights from ``seed + 1`` (:func:`_randomize`), then derived from the target's (:func:`_derive`).

    transformers 5.23.0 cannot build it from its own config (see :mod:`.query_only`): the class is built
    around a buildable stand-in text model, whose ``model`` and ``text_config`` are then the real ones."""
    from transformers import (
        Gemma4AssistantConfig,
        Gemma4AssistantForCausalLM,
        Gemma4TextConfig,
        Gemma4TextModel,
    )

    from .query_only import QueryOnlyTextConfig

    n = int(constants["assistant_layers"])
    kinds = ["sliding_attention"] * (n - 1) + ["full_attention"]
    text = _assistant_text(constants, kinds, n, QueryOnlyTextConfig)
    stand_in = _assistant_text(constants, ["sliding_attention", "full_attention", "full_attention"], 1,
                               Gemma4TextConfig)  # fmt: skip
    config = Gemma4AssistantConfig(
        text_config=text, backbone_hidden_size=int(constants["hidden_size"]), use_ordered_embeddings=False,
        tie_word_embeddings=True,
    )  # fmt: skip
    config.text_config = stand_in  # AutoModel knows Gemma4TextConfig only
    torch.manual_seed(seed + 1)
    model = Gemma4AssistantForCausalLM(config)
    model.model = Gemma4TextModel(text)
    model.config.text_config = text
    _randomize(model, seed + 1)
    _derive(model, target.model.embed_tokens.weight.float().cpu(), seed)
    return model.to(device=device, dtype=dtype).eval()


def _derive(assistant: Any, embedding: torch.Tensor, seed: int) -> None:
    """The assistant drafts ``succ(x)`` from the target's embedding of ``x``: ``pre_projection``'s embedding
    half is a random projection ``P`` (``[assistant hidden, target hidden]``, N(0, 1/fan_in)), its ``lm_head``
    (tied to its unused ``embed_tokens``) is ``P E[pred(v)]`` per token ``v``, and its layers' post-norms are
    scaled by :data:`ASSISTANT_RESIDUAL`. The hidden-state half, the layers and ``post_projection`` keep their
    random weights."""
    vocab, width = embedding.shape
    gen = torch.Generator().manual_seed(seed + 3)
    projection = torch.randn((assistant.hidden_size, width), generator=gen) / math.sqrt(width)
    pred = torch.argsort(successor(vocab, seed))
    with torch.no_grad():
        assistant.pre_projection.weight[:, :width].copy_(projection)
        assistant.lm_head.weight.copy_(embedding[pred] @ projection.T)
        for layer in assistant.model.layers:
            for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
                norm.weight.mul_(ASSISTANT_RESIDUAL)
    assistant.tie_weights()


def build_models(
    constants: Mapping[str, Any], *, dtype: torch.dtype, seed: int, device: str = "cpu"
) -> tuple[Any, Any]:
    """The target and its assistant, both from ``seed``, the assistant derived from the float32 target."""
    target = build_model(constants, dtype=torch.float32, seed=seed)
    assistant = build_assistant(constants, target, dtype=dtype, seed=seed, device=device)
    return target.to(device=device, dtype=dtype), assistant
