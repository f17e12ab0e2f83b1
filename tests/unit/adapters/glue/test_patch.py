"""The patch of vllm-ascend's attention classes (patch.py) on the fake tree: ``update_graph_params``
wrapped so routed layers are skipped, idempotence, reversal, the deferred import hook and the refusal of an
unexpected layout."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_plugin_harness import Runner, make_builder, make_impl, original_calls

import graphbuf.adapters.vllm_ascend.glue.patch as patch
import graphbuf.adapters.vllm_ascend.glue.upstream as upstream
from graphbuf.errors import GraphbufError

# ---------------------------------------------------------------------------- graph task updates


def test_update_graph_params_skips_routed_groups(av1: Any) -> None:
    runner = Runner()
    routed = make_builder(av1).build(0, runner.common(av1, [1, 1], "DecodeOnly"))
    sliding = make_builder(av1, head_size=256).build(0, runner.common(av1, [1, 1], "DecodeOnly"))
    context = SimpleNamespace(
        attn_metadata={"layers.0.attn": sliding, "layers.5.attn": routed, "layers.6.attn": sliding},
        capturing=False,
    )
    drafts = [{"mtp.0.attn": routed, "mtp.1.attn": sliding}]
    av1.AscendAttentionBackendImpl.update_graph_params(
        "stream", context, 2, "cfg", None, draft_attn_metadatas=drafts
    )

    [call] = original_calls(av1, "update_graph_params")
    assert call["keys"] == ["layers.0.attn", "layers.6.attn"]
    assert call["drafts"] == [["mtp.1.attn"]]
    assert call["num_tokens"] == 2
    assert call["forward_context"].capturing is False  # every other attribute is the real context's
    assert list(context.attn_metadata) == ["layers.0.attn", "layers.5.attn", "layers.6.attn"]  # untouched


def test_update_graph_params_without_routed_groups_passes_arguments_through(av1: Any) -> None:
    sliding = make_builder(av1, head_size=256).build(0, Runner().common(av1, [1, 1], "DecodeOnly"))
    context = SimpleNamespace(attn_metadata={"layers.0.attn": sliding})
    impl = make_impl(av1, head_size=256)
    impl.update_graph_params("stream", context, 2, "cfg")  # a staticmethod is callable on instances too
    [call] = original_calls(av1, "update_graph_params")
    assert call["forward_context"] is context
    assert call["drafts"] is None


# ------------------------------------------------------------------------- idempotence, reversal


def test_double_patch_wraps_once_and_keeps_metadata(fake_tree: Any) -> None:
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    impl_cls, builder_cls = module.AscendAttentionBackendImpl, module.AscendAttentionMetadataBuilder
    original_forward = impl_cls.__dict__["forward_impl"]
    original_update = impl_cls.__dict__["update_graph_params"]
    original_build = builder_cls.__dict__["build"]

    assert patch.install() == "applied"
    assert patch.install() == "already applied"
    assert patch.apply(module) is False

    wrapped = impl_cls.__dict__["forward_impl"]
    assert wrapped is not original_forward
    assert wrapped.__wrapped__ is original_forward  # one layer of wrapping, not two
    assert (wrapped.__name__, wrapped.__qualname__, wrapped.__doc__) == (
        original_forward.__name__,
        original_forward.__qualname__,
        original_forward.__doc__,
    )
    update = impl_cls.__dict__["update_graph_params"]
    assert isinstance(update, staticmethod)
    assert update.__func__.__wrapped__ is original_update.__func__
    assert update.__func__.__name__ == "update_graph_params"
    assert builder_cls.__dict__["build"].__wrapped__ is original_build
    assert patch.is_patched(module)


def test_unpatch_restores_the_original_methods(fake_tree: Any) -> None:
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    impl_cls, builder_cls = module.AscendAttentionBackendImpl, module.AscendAttentionMetadataBuilder
    before = (
        impl_cls.__dict__["forward_impl"],
        impl_cls.__dict__["update_graph_params"],
        builder_cls.__dict__["build"],
    )
    patch.install()
    assert patch.unpatch() is True
    after = (
        impl_cls.__dict__["forward_impl"],
        impl_cls.__dict__["update_graph_params"],
        builder_cls.__dict__["build"],
    )
    assert all(a is b for a, b in zip(before, after, strict=True))
    assert not patch.is_patched(module)
    assert "_graphbuf_originals" not in impl_cls.__dict__
    assert patch.unpatch() is False


def test_patch_is_deferred_until_the_attention_module_is_imported(fake_tree: Any) -> None:
    assert "vllm_ascend.attention.attention_v1" not in sys.modules
    assert patch.install() == "deferred"
    assert patch.install() == "deferred"
    hooks = [finder for finder in sys.meta_path if isinstance(finder, patch._PatchOnImport)]
    assert len(hooks) == 1
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    assert patch.is_patched(module)
    assert patch.install() == "already applied"
    patch.unpatch()
    assert not any(isinstance(finder, patch._PatchOnImport) for finder in sys.meta_path)
    assert not patch.is_patched(module)


def test_unexpected_layout_is_refused_and_nothing_changes(fake_tree: Any) -> None:
    module = types.ModuleType("vllm_ascend.attention.attention_v1")

    class AscendAttentionBackendImpl:
        def forward_impl(self, query, attn_metadata):  # type: ignore[no-untyped-def]
            return None

    class AscendAttentionMetadataBuilder:
        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):  # type: ignore[no-untyped-def]
            return None

    module.AscendAttentionBackendImpl = AscendAttentionBackendImpl  # type: ignore[attr-defined]
    module.AscendAttentionMetadataBuilder = AscendAttentionMetadataBuilder  # type: ignore[attr-defined]
    build = AscendAttentionMetadataBuilder.__dict__["build"]
    with pytest.raises(
        upstream.UpstreamError,
        match=r"AscendAttentionBackendImpl.forward_impl takes \(self, query, attn_metadata\), graphbuf "
        r"reads \(self, query, key, value, kv_cache, attn_metadata, output\)\. Nothing was patched",
    ) as raised:
        patch.apply(module)
    assert isinstance(raised.value, GraphbufError)
    assert AscendAttentionMetadataBuilder.__dict__["build"] is build
    assert not patch.is_patched(module)
