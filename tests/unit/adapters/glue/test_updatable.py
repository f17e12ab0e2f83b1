"""The adapter under vllm-ascend's UpdatableGraph mechanism (issue 31 §1-§3) and the per-replay accounting on
both mechanisms (§2), on the fake tree with the rule-enforcing torch_npu stand-in (graphbuf's NPU kernel path
on CPU tensors).

The UpdatableGraph modules are the fake of ``tests/helpers/fake_vllm_ascend/updatable/`` (written from the
contract in upstream-facts.md); the real reconstructed tree is driven by
``tests/integration/real_vllm_ascend/test_real_updatable.py``. Upstream's own large-head provider exists in
no tree we have: §3 models it from its documented contract as a ``FIABnsdLargeHeadParamProvider`` class in
the fake attention module.
"""

from __future__ import annotations

import importlib
import logging
import sys
from types import SimpleNamespace
from typing import Any

import npu_contract_standin as standin
import pytest
import torch
from vllm_plugin_harness import HEAD, LAYERS, SIZE, WIDTH, add_updatable, original_calls, set_capturing
from vllm_plugin_harness import RoutedModel as Model

import graphbuf.adapters.vllm_ascend.glue.activation as activation
import graphbuf.adapters.vllm_ascend.glue.patch as patch
import graphbuf.adapters.vllm_ascend.glue.plugin as plugin
import graphbuf.adapters.vllm_ascend.glue.routing as routing
import graphbuf.adapters.vllm_ascend.glue.upstream as upstream
from graphbuf.errors import ConcurrentUseError, LivenessError, RefreshError, WidthError

TOL = {"rtol": 2e-2, "atol": 2e-2}
FIA_OUT = "npu_fused_infer_attention_score.out"


def _check_outputs(model: Model) -> None:
    for i, out in enumerate(model.outputs):
        torch.testing.assert_close(out.float(), model.reference(i), **TOL)


def _routed_capture(tree: Any, graph: Any) -> Model:
    model = Model(tree)
    model.capture(model.build([5, 9, 3]), graph)
    return model


# ------------------------------------------------------------------------------ §1 mechanism detection


def test_the_mechanism_is_detected_from_the_surface_and_logged_once(upd_tree: Any) -> None:
    decided = activation.current()
    assert decided is not None and decided.mechanism is upstream.Mechanism.UPDATABLE
    for module, attr in upstream.UPDATABLE_PARTS:
        assert f"{module}.{attr}" in decided.evidence
    originals = upd_tree.av1.AscendAttentionBackendImpl.__dict__[patch._ORIGINALS_ATTR]
    assert set(originals) == {"forward_impl"}  # update_graph_params left alone: upstream never calls it
    assert "update mechanism UpdatableGraph" in decided.describe()
    assert upstream.first_miss(upd_tree.av1) is None


def test_the_version_string_never_decides_the_mechanism(
    fake_tree: Any, npu_standin: Any, monkeypatch: Any
) -> None:
    """A 0.23 version string on a tree with the UpdatableGraph surface: UpdatableGraph; a 0.32 string on a
    tree without it: update_graph_params."""
    monkeypatch.setattr(importlib.import_module("vllm_ascend"), "__version__", "0.32.0rc1")
    assert upstream.detect_mechanism()[0] is upstream.Mechanism.LEGACY
    add_updatable(monkeypatch)
    monkeypatch.setattr(importlib.import_module("vllm_ascend"), "__version__", "0.23.0")
    assert upstream.detect_mechanism()[0] is upstream.Mechanism.UPDATABLE


@pytest.mark.parametrize("drop", ["acl", "utils"])
def test_a_half_present_mechanism_is_a_miss_naming_what_is_missing(
    fake_tree: Any, npu_standin: Any, monkeypatch: Any, caplog: Any, drop: str
) -> None:
    add_updatable(monkeypatch)
    if drop == "acl":
        acl = importlib.import_module("vllm_ascend.compilation.acl_graph")
        monkeypatch.delattr(acl.ACLGraphWrapper, "_updatable_graph_replay")
        missing = "vllm_ascend.compilation.acl_graph.ACLGraphWrapper._updatable_graph_replay"
    else:
        importlib.import_module("vllm_ascend.compilation.acl_graph")  # imported while it was whole
        utils = importlib.import_module("vllm_ascend.utils")
        monkeypatch.delattr(utils, "use_updatable_graph")
        missing = "vllm_ascend.utils.use_updatable_graph"
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    with caplog.at_level(logging.WARNING):
        decision = plugin.activate(npu_available=True)
    assert decision.startswith("inactive:") and "half-present" in decision
    assert f"{missing} missing" in decision
    assert "vllm_ascend.compilation.updatable_graph.register_task" in decision  # what was found
    assert not patch.is_patched(module)


def test_an_updatable_surface_row_miss_names_the_row(
    fake_tree: Any, npu_standin: Any, monkeypatch: Any
) -> None:
    add_updatable(monkeypatch)
    extra = importlib.import_module("vllm_ascend.ascend_forward_context")
    monkeypatch.setattr(type(extra._EXTRA_CTX), "extra_attrs", ("capturing",))
    module = importlib.import_module("vllm_ascend.attention.attention_v1")
    with pytest.raises(upstream.UpstreamError, match=r"UpdatableGraph mechanism.*_EXTRA_CTX.is_draft_model"):
        patch.apply(module)
    assert not patch.is_patched(module) and activation.current() is None


# -------------------------------------------------------------------- §1 registration and providers


def test_routed_decode_is_captured_through_register_task_and_follows_every_replay(upd_tree: Any) -> None:
    """Capture through upstream's register_task (one provider per layer, equal by value), then 6 steps whose
    batches grow, shrink and pad: the provider refreshes graphbuf's buffers and returns only seq_lens_kv,
    upstream's replay re-issues the task, the outputs follow the live lengths."""
    graph = upd_tree.graph_module.UpdatableGraph()
    model = _routed_capture(upd_tree, graph)
    providers = [t.provider for t in graph.tasks]
    assert providers == [routing.DecodeParamProvider(LAYERS, i) for i in range(len(LAYERS))]
    assert len(set(providers)) == 2 and hash(providers[0]) == hash(routing.DecodeParamProvider(LAYERS, 0))
    assert [[c.name for c in g.calls] for g in standin.STATE.groups] == [[FIA_OUT]] * 2
    wrapper = upd_tree.acl.ACLGraphWrapper(torch.npu.Stream(), upd_tree.av1.AscendAttentionBackend)
    route = None
    for step, lens in enumerate([[7, 2, 11], [12, 1], [4, 4, 4, 4], [3], [10, 6, 8], [1, 12]]):
        metadata = model.build(lens)
        route = getattr(metadata, routing.ROUTE_ATTR)
        assert route.staged is not None  # the provider refreshes from these at the replay
        params = routing.DecodeParamProvider(LAYERS, 0).resolve(upd_tree.context.attn_metadata)
        assert params == {"seq_lens_kv": [*lens, *[0] * (SIZE - len(lens))]}, step
        wrapper.replay(upd_tree.context, graph)
        assert standin.STATE.blocked is None  # the update released the replay
        _check_outputs(model)
        seq_lens = route.seq_lens.tolist()
        assert seq_lens == [*lens, *[0] * (SIZE - len(lens))]  # padded rows cleared
        assert not route.block_table[len(lens) :].any()
        assert route.group.decodes.updates_seen >= len(LAYERS)
    assert original_calls(upd_tree.av1, "update_graph_params") == []


def test_the_provider_refuses_a_too_wide_table_with_nothing_written(upd_tree: Any) -> None:
    graph = upd_tree.graph_module.UpdatableGraph()
    model = _routed_capture(upd_tree, graph)
    model.build([5, 6])
    route = getattr(upd_tree.context.attn_metadata[LAYERS[0]], routing.ROUTE_ATTR)
    routing.DecodeParamProvider(LAYERS, 0).resolve(upd_tree.context.attn_metadata)
    before = (route.block_table.clone(), route.seq_lens.clone())
    wide = torch.zeros(SIZE, WIDTH + 2, dtype=torch.int32)
    staged = route.staged
    bad = routing.Route(**{**route.__dict__, "staged": (wide, staged[1], staged[2]), "step": route.step + 99})
    with pytest.raises(WidthError):
        bad.apply()
    assert torch.equal(route.block_table, before[0]) and torch.equal(route.seq_lens, before[1])


def test_a_provider_without_its_routed_batch_raises_naming_the_layer(upd_tree: Any) -> None:
    with pytest.raises(
        upstream.UpstreamError, match=r"layer #0 of KV group \['model.layers.5.*must be routed"
    ):
        routing.DecodeParamProvider(LAYERS, 0).resolve({LAYERS[0]: SimpleNamespace()})


def test_no_task_is_registered_in_a_draft_graph(upd_tree: Any) -> None:
    """A draft graph resolves from upstream's own draft parameter list: graphbuf registers nothing there and
    the size keeps upstream's path."""
    upd_tree.extra.is_draft_model = True
    graph = upd_tree.graph_module.UpdatableGraph()
    model = Model(upd_tree)
    metadata = model.build([5, 9, 3])
    model.capture(metadata, graph)
    assert graph.tasks == []
    assert original_calls(upd_tree.av1, "forward_impl") == [HEAD] * len(LAYERS)
    route = getattr(metadata, routing.ROUTE_ATTR)
    assert "draft graph" in route.group.fallbacks[SIZE]


def test_vllm_ascend_16794_task_tensors_held_strongly_and_weak_references_refused(upd_tree: Any) -> None:
    """vllm-ascend #16794 (error 507011): upstream keeps only weak references to a task's kwargs, so graphbuf
    holds every workspace and buffer of its task for the capture's life, and refuses a weak one at capture."""
    import gc
    import weakref

    graph = upd_tree.graph_module.UpdatableGraph()
    model = _routed_capture(upd_tree, graph)
    route = getattr(upd_tree.context.attn_metadata[LAYERS[0]], routing.ROUTE_ATTR)
    held = [t.task.tensor_args for t in route.group.decodes.tasks(SIZE)]
    upstream_kwargs = graph.tasks[0].kwargs["tensors"]
    assert all(not t.untyped_storage().resizable() for t in upstream_kwargs if t.numel())  # weak upstream
    refs = [weakref.ref(t) for args in held for t in args]
    del held
    gc.collect()
    assert all(r() is not None for r in refs)  # graphbuf's DecodeTask keeps them
    weak = upd_tree.graph_module.weak_ref_tensors(model.query)  # the task's query is a view of it
    with pytest.raises(LivenessError, match=r"weak reference.*#16794"):
        route.group.decodes.run(
            model.impls[0], SIZE, True, weak, *model.caches[0], route.block_table, route.seq_lens,
            [1] * SIZE, 0.125, model.outputs[0], lambda op, kw: None, LAYERS[0],
        )  # fmt: skip


# ---------------------------------------------------------------------------- §2 never a silent hang


def test_updatable_replay_without_provider_resolution_raises_at_the_next_step(upd_tree: Any) -> None:
    """The reconstructed tree's case (its runner never sets the wrapper's attn_backend, so
    use_updatable_graph is False): the replay runs without updates. Before: the device waits forever on the
    tasks' events (the stand-in: a host sync refuses). After: graphbuf's next build raises UpstreamError
    naming the mechanism and the layers."""
    graph = upd_tree.graph_module.UpdatableGraph()
    model = _routed_capture(upd_tree, graph)
    model.build([5, 6])
    upd_tree.acl.ACLGraphWrapper(torch.npu.Stream(), attn_backend=None).replay(upd_tree.context, graph)
    assert standin.STATE.blocked is graph  # the device is stuck behind the tasks' ExternalEvent waits
    with pytest.raises(upstream.UpstreamError) as caught:
        model.build([5, 6])
    message = str(caught.value)
    assert "UpdatableGraph mechanism" in message and "_updatable_graph_replay did not resolve" in message
    assert "layer #0" in message and "layer #1" in message and f"KV group [{', '.join(LAYERS)}]" in message
    with pytest.raises(standin.ContractError, match=r"\[event\].*would hang"):
        torch.npu.synchronize()


def test_legacy_replay_without_update_graph_params_raises_at_the_next_step(legacy_tree: Any) -> None:
    """The downstream case on the legacy mechanism: a hook upstream no longer calls (update_graph_params).
    graphbuf's task waits on its own event; the next build raises naming the mechanism and the layers."""
    graph = torch.npu.NPUGraph()
    model = _routed_capture(legacy_tree, graph)
    model.build([5, 6])
    graph.replay()  # no update_graph_params before it
    assert standin.STATE.blocked is graph
    with pytest.raises(upstream.UpstreamError, match=r"update_graph_params mechanism.*was not called"):
        model.build([5, 6])


def test_legacy_replay_with_update_graph_params_counts_one_update_and_goes_on(legacy_tree: Any) -> None:
    graph = torch.npu.NPUGraph()
    model = _routed_capture(legacy_tree, graph)
    for lens in ([5, 6], [12, 1, 3], [2]):
        metadata = model.build(lens)
        legacy_tree.av1.AscendAttentionBackendImpl.update_graph_params(
            torch.npu.Stream(), legacy_tree.context, SIZE, None, None, draft_attn_metadatas=None
        )
        graph.replay()
        _check_outputs(model)
        assert getattr(metadata, routing.ROUTE_ATTR).group.decodes.updates_seen == 1


def test_the_downstream_hook_case_fails_loudly_on_both_mechanisms(
    fake_tree: Any, npu_standin: Any, monkeypatch: Any
) -> None:
    """A plugin's wrapper on update_graph_params (the hook graphbuf used before 0.30) is never called under
    UpdatableGraph; graphbuf no longer relies on it. Played here: graphbuf's legacy path forced onto an
    UpdatableGraph tree (what the pre-fix adapter did): the first replay blocks and the next build raises."""
    add_updatable(monkeypatch)
    monkeypatch.setattr(upstream, "detect_mechanism", lambda: (upstream.Mechanism.LEGACY, "forced"))
    av1 = importlib.import_module("vllm_ascend.attention.attention_v1")
    assert patch.install() == "applied"
    tree = SimpleNamespace(av1=av1, context=sys.modules["vllm.forward_context"].CONTEXT)
    graph = importlib.import_module("vllm_ascend.compilation.updatable_graph").UpdatableGraph()
    model = _routed_capture(tree, graph)
    model.build([4, 4])
    acl = importlib.import_module("vllm_ascend.compilation.acl_graph")
    acl.ACLGraphWrapper(torch.npu.Stream(), av1.AscendAttentionBackend).replay(tree.context, graph)
    assert standin.STATE.blocked is graph  # graphbuf's own task events: nobody records them on this path
    with pytest.raises(
        upstream.UpstreamError, match="0 task updates under the update_graph_params mechanism"
    ):
        model.build([4, 4])


# ------------------------------------------------------------------------ §3 upstream's large-head route


class FIABnsdLargeHeadParamProvider:
    """Upstream's own large-head provider, modelled from its documented contract (the revised upstream PR;
    no tree we have carries it): its presence in the attention module is what graphbuf detects."""


@pytest.mark.parametrize(
    ("env", "owner"), [(None, "upstream"), ("graphbuf", "graphbuf"), ("upstream", "upstream")]
)
def test_upstreams_large_head_provider_is_detected_and_the_switch_chooses(
    fake_tree: Any, npu_standin: Any, monkeypatch: Any, caplog: Any, env: str | None, owner: str
) -> None:
    add_updatable(monkeypatch)
    av1 = importlib.import_module("vllm_ascend.attention.attention_v1")
    monkeypatch.setattr(av1, "FIABnsdLargeHeadParamProvider", FIABnsdLargeHeadParamProvider, raising=False)
    if env is None:
        monkeypatch.delenv(activation.OWNER_ENV, raising=False)
    else:
        monkeypatch.setenv(activation.OWNER_ENV, env)
    monkeypatch.setattr(routing, "_owners_logged", {})
    assert patch.install() == "applied"
    decided = activation.current()
    assert decided.upstream_large_head == "FIABnsdLargeHeadParamProvider" and decided.owner == owner
    tree = SimpleNamespace(av1=av1, context=sys.modules["vllm.forward_context"].CONTEXT)
    model = Model(tree)
    with caplog.at_level(logging.INFO, logger=routing.__name__):
        metadata = model.build([5, 9])
    [line] = [r.getMessage() for r in caplog.records if "large-head layers" in r.getMessage()]
    assert f"routed by {owner}" in line and "FIABnsdLargeHeadParamProvider" in line
    route = routing.route_of(metadata)
    set_capturing(True)
    model.forward(metadata)
    set_capturing(False)
    if owner == "upstream":
        assert route is None and original_calls(av1, "forward_impl") == [HEAD] * len(LAYERS)
    else:
        assert route is not None and route.q_len == 1 and original_calls(av1, "forward_impl") == []


def test_without_upstreams_provider_graphbuf_owns_by_default_and_a_bad_switch_is_refused(
    fake_tree: Any, npu_standin: Any, monkeypatch: Any
) -> None:
    monkeypatch.delenv(activation.OWNER_ENV, raising=False)
    assert activation.large_head_owner(None)[0] == "graphbuf"
    assert activation.large_head_owner("FIABnsdLargeHeadParamProvider")[0] == "upstream"
    monkeypatch.setenv(activation.OWNER_ENV, "both")
    importlib.import_module("vllm_ascend.attention.attention_v1")
    decision = plugin.activate(npu_available=True)
    assert decision.startswith("inactive:") and "GRAPHBUF_LARGE_HEAD_OWNER='both'" in decision


# ---------------------------------------------------------------------------------- sglang-omni #2160


def test_sglang_omni_2160_two_threads_updating_one_graph_get_a_typed_error(upd_tree: Any) -> None:
    """Two threads resolving one graph's providers at once: the second gets ConcurrentUseError, not a torn
    refresh (sglang-omni #2160)."""
    import threading

    graph = upd_tree.graph_module.UpdatableGraph()
    model = _routed_capture(upd_tree, graph)
    model.build([5, 6])
    route = getattr(upd_tree.context.attn_metadata[LAYERS[0]], routing.ROUTE_ATTR)
    inside, release = threading.Event(), threading.Event()
    group = route.group
    real_apply = type(group).apply

    def slow_apply(self: Any, *args: Any) -> bool:
        inside.set()
        release.wait(10)
        return real_apply(self, *args)

    errors: list[BaseException] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(group), "apply", slow_apply)
        first = threading.Thread(
            target=lambda: routing.DecodeParamProvider(LAYERS, 0).resolve(upd_tree.context.attn_metadata)
        )
        first.start()
        assert inside.wait(10)
        try:
            routing.DecodeParamProvider(LAYERS, 1).resolve(upd_tree.context.attn_metadata)
        except BaseException as exc:
            errors.append(exc)
        release.set()
        first.join(10)
    assert len(errors) == 1 and isinstance(errors[0], ConcurrentUseError)
    assert "another thread updates the same graph" in str(errors[0])


def test_negative_runner_lengths_are_refused_with_nothing_written(upd_tree: Any) -> None:
    graph = upd_tree.graph_module.UpdatableGraph()
    _ = _routed_capture(upd_tree, graph)
    model = Model(upd_tree)
    with pytest.raises(RefreshError, match=r"must lie in \[0, 12\]"):
        model.build([5, -2])


def test_the_activation_line_names_the_updatable_mechanism_and_the_owner(
    fake_tree: Any, npu_standin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Section 7 on a 0.30+ surface: the one INFO line, logged when the deferred patch applies, says active,
    UpdatableGraph and what decided it, what graphbuf routes and what upstream owns."""
    add_updatable(monkeypatch)
    monkeypatch.delenv(activation.OWNER_ENV, raising=False)
    lines: list[str] = []
    monkeypatch.setattr(activation, "_announced", False)
    monkeypatch.setattr(
        activation, "_logger", lambda: SimpleNamespace(info=lambda f, *a: lines.append(f % a))
    )
    monkeypatch.setattr(plugin, "_decision", None)
    real_activate = plugin.activate
    monkeypatch.setattr(plugin, "activate", lambda: real_activate(npu_available=True))
    plugin.register()
    assert lines == []  # deferred until the attention module imports
    importlib.import_module("vllm_ascend.attention.attention_v1")
    [line] = lines
    assert line.startswith("graphbuf vllm-ascend plugin: active: vllm_ascend.attention.attention_v1 patched")
    assert "update mechanism UpdatableGraph (vllm_ascend.compilation.updatable_graph.register_task" in line
    assert "registered with the graph through register_task" in line
    assert "graphbuf routes the 512-dim full-attention layers" in line and "large-head owner graphbuf" in line


def test_a_drafter_building_its_steps_before_one_replay_is_not_a_hang(legacy_tree: Any) -> None:
    """A drafter builds each of its k draft steps' metadata before the draft graph's one replay and one
    update: 1 + k planned steps may wait for one update (GroupBuffers.steps_per_update, from the vLLM
    config's num_speculative_tokens); one more without an update raises."""
    graph = torch.npu.NPUGraph()
    model = _routed_capture(legacy_tree, graph)
    group = routing.route_of(model.build([5, 6])).group
    assert group.steps_per_update == 1  # no speculative config: one step per update
    group.steps_per_update = 3  # as with num_speculative_tokens = 2
    update = legacy_tree.av1.AscendAttentionBackendImpl.update_graph_params
    for _ in range(2):
        for lens in ([5, 6], [7, 8]):  # with the first build above: three planned steps, then one update
            model.build(lens)
        update(torch.npu.Stream(), legacy_tree.context, SIZE, None, None, draft_attn_metadatas=None)
        graph.replay()
        model.build([1, 2])
    model.build([3, 4])
    model.build([5, 6])
    with pytest.raises(upstream.UpstreamError, match=r"3 replay\(s\) ran graphbuf's tasks"):
        model.build([5, 6])
