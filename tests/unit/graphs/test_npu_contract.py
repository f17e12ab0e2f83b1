"""graphbuf's NPU code paths against a torch_npu stand-in that enforces torch_npu's graph rules (CPU, CI).

The stand-in (``tests/helpers/npu_contract_standin.py``) computes the ops graphbuf calls and refuses what
torch_npu
documents as not allowed. Each test named ``test_finding_*`` encodes one finding of issue 14's "Why" list
and failed against main before the fix (see notes/h4.md); the ``test_standin_*`` tests show the stand-in
refuses what it must, so a passing contract test means something.
"""

from __future__ import annotations

import ast
import math
import sys
from pathlib import Path

import npu_contract_standin as standin
import pytest
import torch
from attention_cases import BLOCK, BLOCKS, HEAD_DIM, KV_HEADS, TOL, WIDTH, make_case, sdpa_reference

from graphbuf.adapters.vllm_ascend.bindings import large_head as lh
from graphbuf.adapters.vllm_ascend.bindings.attention_tasks import LargeHeadBinding
from graphbuf.adapters.vllm_ascend.kernels import attention as kernels
from graphbuf.graphs.graph import Graph
from graphbuf.graphs.runner import Step
from graphbuf.graphs.tasks import TaskKind

ContractError = standin.ContractError
SCALE = 1.0 / math.sqrt(HEAD_DIM)
DTYPE = torch.bfloat16
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def npu(monkeypatch):
    """The stand-in installed as torch_npu / torch.npu with 2 NPUs; graphbuf's NPU kernels selected."""
    standin.install(devices=2)
    kernels.npu_runtime.cache_clear()
    monkeypatch.setattr(kernels, "uses_npu_kernels", lambda tensor: True)
    try:
        yield standin.STATE
    finally:
        standin.uninstall()
        kernels.npu_runtime.cache_clear()


def _copy_case(static, lens, q_len, seed):
    for dst, src in zip(static, make_case(lens, q_len, DTYPE, seed, "cpu"), strict=True):
        dst.copy_(src)


def _distinct_lengths(batch: int, seed: int) -> list[int]:
    """``batch`` distinct KV lengths, each >= 100 and within the block table."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(WIDTH * BLOCK - 100, generator=g)[:batch] + 100).tolist()


def _binding_step(graph: Graph | None, views, host=None) -> Step:
    return Step(size=views["seq_lens"].shape[0], views=views, graph=graph, host_args=host or {}, requests=0)


# --- finding 1: npu_fusion_attention captured inside ACL graphs ---------------------------------------------


@pytest.mark.parametrize("path", ["verify", "decode_device_lengths"])
def test_finding_1_masked_attention_is_graph_capable(npu, path):
    q_len = 4 if path == "verify" else 1
    static = make_case([300, 5, 129], q_len, DTYPE, 1, "cpu")
    graph = Graph("npu")
    with torch.no_grad(), graph.capture():
        if path == "verify":
            out = lh.verify_attention(*static, q_len, SCALE)
        else:
            out = lh.decode_attention(*static, SCALE)  # the routed decode: device lengths
    for seed, lens in ((2, [512, 1, 385]), (3, [130, 257, 4])):
        _copy_case(static, lens, q_len, seed)
        graph.replay()
        torch.testing.assert_close(out.float(), sdpa_reference(*static, q_len, SCALE), **TOL)


def test_finding_1_verify_task_through_binding(npu):
    query, kc, vc, table, lens = make_case([300, 5, 129], 3, DTYPE, 4, "cpu")
    out = torch.zeros_like(query)
    binding = LargeHeadBinding(group=None, q_len=3, scale=SCALE)
    views = {"block_table": table, "seq_lens": lens}
    graph = Graph("npu")
    with torch.no_grad(), graph.capture():
        binding.verify(_binding_step(graph, views), query, kc, vc, out)
    assert npu.groups == []  # no host arguments: nothing to re-issue, so no task group
    _copy_case((query, kc, vc, table, lens), [200, 512, 3], 3, 5)
    graph.replay()
    torch.testing.assert_close(out.float(), sdpa_reference(query, kc, vc, table, lens, 3, SCALE), **TOL)


# --- finding 2: the decode task group holds far more than one op --------------------------------------------


def _capture_decode(npu, start_lens, seed=6):
    query, kc, vc, table, lens = make_case(start_lens, 1, DTYPE, seed, "cpu")
    out = torch.zeros_like(query)
    binding = LargeHeadBinding(group=None, q_len=1, scale=SCALE)
    views = {"block_table": table, "seq_lens": lens}
    graph = Graph("npu")
    host = {TaskKind.ATTENTION.value: {"seq_lens_kv": list(start_lens)}}
    with torch.no_grad(), graph.capture():
        binding.decode(_binding_step(graph, views, host), query, kc, vc, out)
    return graph, (query, kc, vc, table, lens), out


def test_finding_2_decode_task_group_is_one_out_op_with_preallocated_buffers(npu):
    graph, _, _ = _capture_decode(npu, [300, 5, 129])
    assert len(graph.tasks) == 1
    assert [[c.name for c in g.calls] for g in npu.groups] == [["npu_fused_infer_attention_score.out"]]
    call = npu.groups[0].calls[0]
    assert call.kwargs["workspace"] is not None and len(call.kwargs["out"]) == 2
    assert npu.group_allocations == 0


def test_finding_2_workspace_sized_for_longest_kv_the_table_allows(npu):
    graph, static, out = _capture_decode(npu, [0, 0, 0])  # the binding's default capture lengths
    longest = [WIDTH * BLOCK, WIDTH * BLOCK - 1, 1]
    _copy_case(static, longest, 1, 7)
    graph.update_tasks(TaskKind.ATTENTION, seq_lens_kv=longest, scale=SCALE)
    graph.replay()
    torch.testing.assert_close(out.float(), sdpa_reference(*static, 1, SCALE), **TOL)
    assert npu.group_allocations == 0


# --- finding 3: an update whose output must change ----------------------------------------------------------


def test_finding_3_update_changes_output_at_distinct_lengths(npu):
    first, second = _distinct_lengths(4, 1), _distinct_lengths(4, 2)
    assert len(set(first + second)) == 8 and min(first + second) >= 100
    graph, static, out = _capture_decode(npu, first)
    _copy_case(static, first, 1, 8)
    graph.replay()
    at_first = out.float().clone()
    torch.testing.assert_close(at_first, sdpa_reference(*static, 1, SCALE), **TOL)
    # Same seed: same query and caches; the lengths (and the table rows they need) change.
    _copy_case(static, second, 1, 8)
    graph.update_tasks(TaskKind.ATTENTION, seq_lens_kv=second, scale=SCALE)
    graph.replay()
    torch.testing.assert_close(out.float(), sdpa_reference(*static, 1, SCALE), **TOL)
    assert not torch.allclose(out.float(), at_first, **TOL)


def test_finding_3_stale_lengths_without_update_are_visible(npu):
    first, second = _distinct_lengths(3, 3), _distinct_lengths(3, 4)
    graph, static, out = _capture_decode(npu, first)
    _copy_case(static, second, 1, 9)
    graph.replay()  # no update: the task still runs with the captured lengths
    assert not torch.allclose(out.float(), sdpa_reference(*static, 1, SCALE), **TOL)


# --- finding 4: update -> replay back to back ---------------------------------------------------------------


def test_finding_4_update_replay_loop_matches_eager_every_step(npu):
    graph, static, out = _capture_decode(npu, _distinct_lengths(4, 10))
    for step in range(6):
        lens = _distinct_lengths(4, 20 + step)
        _copy_case(static, lens, 1, 30 + step)
        graph.update_tasks(TaskKind.ATTENTION, seq_lens_kv=lens, scale=SCALE)
        graph.replay()
        eager = lh.decode_attention(*static, SCALE, seq_lens_host=lens)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
        torch.testing.assert_close(out.float(), sdpa_reference(*static, 1, SCALE), **TOL)
        if step % 2:
            graph.replay()  # a replay without an update re-arms the event and keeps the last lengths
            torch.testing.assert_close(out, eager, rtol=0, atol=0)
    waits = [e for e in npu.log if e[0] == "wait_stream"]
    assert len(waits) >= 6  # every update and every re-arm first waits for the replaying stream


# --- finding 5: devices and versions ------------------------------------------------------------------------


def _fia_out(query, kc, vc, table, out, workspace, lse, *, seq_lens_kv, scale):
    kernels.npu_runtime().npu_fused_infer_attention_score.out(
        query, kc.view(BLOCKS, BLOCK, -1), vc.view(BLOCKS, BLOCK, -1), workspace=workspace, out=[out, lse],
        block_table=table, actual_seq_lengths_kv=seq_lens_kv, num_heads=query.shape[1],
        num_key_value_heads=kc.shape[2], scale=scale, input_layout="BNSD", block_size=BLOCK, sparse_mode=0,
    )  # fmt: skip


def _one_op_task(graph: Graph, static, lengths: list[int]):
    """A task of exactly one FIA .out, its buffers allocated in the capture before the group."""
    query, kc, vc, table, _ = static
    q = query.unsqueeze(2)
    longest = [WIDTH * BLOCK] * q.shape[0]
    workspace = kernels.npu_runtime()._npu_fused_infer_attention_score_get_max_workspace(
        q, kc, vc, actual_seq_lengths_kv=longest
    )
    out, lse = torch.empty_like(q), torch.empty(0, dtype=torch.float32)
    return graph.task(
        "paged_attention", _fia_out, q, kc, vc, table, out, workspace, lse, seq_lens_kv=lengths, scale=SCALE
    )


def test_finding_5_update_stream_on_the_graphs_device(npu):
    static = make_case([300, 5], 1, DTYPE, 11, "cpu")
    static[3].copy_(lh.sanitize_block_table(static[3], static[4], BLOCKS, BLOCK))
    graph = Graph("npu:1")  # the current device stays 0
    with torch.no_grad(), graph.capture():
        task = _one_op_task(graph, static, [300, 5])
    task.update(seq_lens_kv=[200, 100], scale=SCALE)
    graph.replay()
    assert npu.updates == 1


def test_finding_5_bare_npu_graph_updates_on_the_device_current_at_capture(npu):
    static = make_case([300, 5], 1, DTYPE, 19, "cpu")
    static[3].copy_(lh.sanitize_block_table(static[3], static[4], BLOCKS, BLOCK))
    graph = Graph("npu")
    with torch.npu.device(1), torch.no_grad(), graph.capture():
        task = _one_op_task(graph, static, [300, 5])
    task.update(seq_lens_kv=[150, 120], scale=SCALE)  # the current device is 0 again
    graph.replay()
    assert npu.updates == 1


def test_finding_5_out_call_without_workspace_or_lse_is_an_error(npu):
    query, kc, vc, table, lens = make_case([300, 5], 1, DTYPE, 12, "cpu")
    ids = lh.sanitize_block_table(table, lens, BLOCKS, BLOCK)
    q = query.unsqueeze(2)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="workspace"):
        kernels.paged_decode_bnsd(q, kc, vc, ids, [300, 5], SCALE, out=out)
    workspace = kernels.npu_runtime()._npu_fused_infer_attention_score_get_max_workspace(
        q, kc, vc, actual_seq_lengths_kv=[WIDTH * BLOCK] * 2
    )
    with pytest.raises(ValueError, match="softmax_lse"):
        kernels.paged_decode_bnsd(q, kc, vc, ids, [300, 5], SCALE, out=out, workspace=workspace)


def test_finding_5_npu_extra_and_readme_state_one_pair_per_vllm_ascend_line():
    lines = (ROOT / "pyproject.toml").read_text().splitlines()
    (extra,) = [ln for ln in lines if ln.startswith("npu = [")]
    pins = {}
    for req in ast.literal_eval(extra.partition("=")[2].strip()):
        name, sep, version = req.replace(" ", "").partition("==")
        assert sep, f"npu extra entry {req!r} must pin one version with =="
        pins[name.lower()] = version
    assert set(pins) == {"torch", "torch-npu"}, pins
    # torch-npu X.Y.Z[.postN] is built for torch X.Y.Z: the pair must agree.
    assert pins["torch-npu"].split(".post")[0] == pins["torch"], pins
    assert pins == {"torch": "2.10.0", "torch-npu": "2.10.0.post4"}  # vllm-ascend 0.23's pin
    readme = (ROOT / "README.md").read_text()
    assert "vllm-ascend 0.23" in readme and "torch 2.10.0" in readme and "torch-npu 2.10.0.post4" in readme


# --- the stand-in refuses what it must ----------------------------------------------------------------------


def test_standin_refuses_not_graph_capable_op_under_capture(npu):
    q = torch.randn(1, 2, 4, 8)
    torch_npu = kernels.npu_runtime()
    torch_npu.npu_fusion_attention(q, q, q, 2, "BNSD")  # eager: allowed
    graph = Graph("npu")
    with pytest.raises(ContractError, match="not-graph-capable"), graph.capture():
        torch_npu.npu_fusion_attention(q, q, q, 2, "BNSD")
    assert not graph.captured


def test_standin_counts_and_refuses_allocations_in_a_task_group(npu):
    x = torch.randn(4)
    graph = Graph("npu")
    with pytest.raises(ContractError, match="task-group"), graph.capture():
        graph.task("custom", lambda t, *, n: t * n, x, n=2)  # t * n allocates inside the group
    assert npu.group_allocations == 1


def test_standin_refuses_update_on_the_capture_stream_and_foreign_tensors(npu):
    static = make_case([300, 5], 1, DTYPE, 13, "cpu")
    static[3].copy_(lh.sanitize_block_table(static[3], static[4], BLOCKS, BLOCK))
    graph = Graph("npu")
    with torch.no_grad(), graph.capture():
        task = _one_op_task(graph, static, [300, 5])
        capture_stream = torch.npu.current_stream()
    with pytest.raises(ContractError, match="update-stream"):
        torch.npu.graph_task_update_begin(capture_stream, task.handle.handle)
    torch_npu = kernels.npu_runtime()
    other_out = torch.empty_like(task.tensor_args[4])
    side = torch.npu.Stream()
    with torch.npu.stream(side), pytest.raises(ContractError, match="other tensor arguments"):
        torch.npu.graph_task_update_begin(side, task.handle.handle)
        query, kc, vc, table = task.tensor_args[:4]
        torch_npu.npu_fused_infer_attention_score.out(
            query, kc.view(BLOCKS, BLOCK, -1), vc.view(BLOCKS, BLOCK, -1), workspace=task.tensor_args[5],
            out=[other_out, task.tensor_args[6]], block_table=table, actual_seq_lengths_kv=[1, 1],
            num_heads=query.shape[1], num_key_value_heads=kc.shape[2], scale=SCALE, input_layout="BNSD",
            block_size=BLOCK, sparse_mode=0,
        )  # fmt: skip
        torch.npu.graph_task_update_end(side)


def test_standin_refuses_replay_of_an_unrecorded_event_and_mismatched_devices(npu):
    event = torch.npu.ExternalEvent()  # device 0
    with torch.npu.device(1), pytest.raises(ContractError, match="device"):
        event.record(torch.npu.Stream())
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        event.wait(torch.npu.current_stream())
    with pytest.raises(ContractError, match="event"):
        graph.replay()
    event.record(torch.npu.current_stream())
    graph.replay()


def test_finding_2_buffers_fit_every_length_the_table_allows(npu):
    """paged_decode_buffers (the binding's and the routed decode's only source of FIA buffers) takes no
    lengths: its workspace fits the longest KV length the block table allows, its lse the op's own rule."""
    query, kc, vc, table, lens = make_case([300, 5], 1, DTYPE, 20, "cpu")
    ids = lh.sanitize_block_table(table, lens, BLOCKS, BLOCK)
    q = query.unsqueeze(2)
    out, workspace, lse = kernels.paged_decode_buffers(q, kc, vc, ids, SCALE)
    _, lse_rule = kernels.npu_runtime()._npu_fused_infer_attention_score_infer_output(q, vc)
    assert out.shape == q.shape and lse.shape == lse_rule.shape and lse.dtype == lse_rule.dtype
    for lengths in ([1, 1], [WIDTH * BLOCK, WIDTH * BLOCK], [WIDTH * BLOCK, 0]):
        kernels.paged_decode_out(q, kc, vc, ids, out, workspace, lse, seq_lens_kv=lengths, scale=SCALE)


def test_standin_workspace_too_small_for_longer_lengths_is_refused(npu):
    query, kc, vc, table, lens = make_case([300, 5], 1, DTYPE, 14, "cpu")
    ids = lh.sanitize_block_table(table, lens, BLOCKS, BLOCK)
    q = query.unsqueeze(2)
    torch_npu = kernels.npu_runtime()
    small = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
        q, kc, vc, actual_seq_lengths_kv=[0, 0]
    )
    out, lse = torch.empty_like(q), torch.empty(0, dtype=torch.float32)
    with pytest.raises(ContractError, match="workspace"):
        kernels.paged_decode_bnsd(q, kc, vc, ids, [300, 5], SCALE, out=out, workspace=small, softmax_lse=lse)


# --- found while writing these tests: capture poisoned caller data through a view ---------------------------


def test_capture_leaves_caller_tensors_viewed_inside_it_untouched(npu):
    """Graph poisons what the capture allocated (a device capture runs no kernel). A view of a caller's tensor
    made inside the capture and still alive afterwards (the decode task's BNSD query, a reshaped cache) is
    the caller's memory: poisoning it wrote NaN into the static query / KV cache on the device."""
    static = make_case([300, 5, 129], 1, DTYPE, 15, "cpu")
    before = [t.clone() for t in static]
    _capture_decode_on(static, [300, 5, 129])
    for got, want in zip(static, before, strict=True):
        assert torch.equal(got, want)


def _capture_decode_on(static, start_lens):
    query, kc, vc, table, lens = static
    out = torch.zeros_like(query)
    binding = LargeHeadBinding(group=None, q_len=1, scale=SCALE)
    views = {"block_table": table, "seq_lens": lens}
    graph = Graph("npu")
    kept = []
    host = {TaskKind.ATTENTION.value: {"seq_lens_kv": list(start_lens)}}
    with torch.no_grad(), graph.capture():
        kept.append(query.view(query.shape[0], -1))  # a view of the caller's query, alive after capture
        binding.decode(_binding_step(graph, views, host), query, kc, vc, out)
    return graph, kept


# --- the routed attention (vllm-ascend's forward_impl patched by the plugin) --------------------------------
#
# The real routed protocol: ``routing.plan_route`` plans the group (its GroupBuffers, task registry and
# routes) from a builder carrying the vLLM config fields graphbuf reads, and refreshes graphbuf's buffers for
# each batch; ``routing.forward`` runs each layer under a ``torch.npu.graph`` capture as vllm-ascend's
# ACLGraphWrapper takes it (its forward context says ``capturing``); before each replay
# ``routing.update_routed(update_stream, ...)`` re-issues the tasks as the patched update_graph_params calls
# it. Lengths change every step (distinct, >= 100); the reference is computed from the runner's own table.

LAYERS = ("model.layers.5.self_attn.attn", "model.layers.11.self_attn.attn")
MAX_REQS = 4  # the capture size's requests; batches keep the last row as padding


class _Mode:
    def __init__(self, name: str) -> None:
        self.name = name


def _fake_surface(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The rest of the upstream surface routing reads (adapters/vllm_ascend/glue/upstream.py): the attention
    module's backend and fence, and vLLM's forward context (always available here)."""
    import types

    attention = types.ModuleType("vllm_ascend.attention.attention_v1")
    attention.AscendAttentionBackend = types.SimpleNamespace(get_supported_kernel_block_sizes=lambda: [])
    attention.record_attention_compute_start = lambda: None
    forward_context = types.ModuleType("vllm.forward_context")
    forward_context.is_forward_context_available = lambda: True
    forward_context.get_forward_context = lambda: types.SimpleNamespace(cudagraph_runtime_mode=None)
    monkeypatch.setitem(sys.modules, "vllm_ascend.attention.attention_v1", attention)
    monkeypatch.setitem(sys.modules, "vllm.forward_context", forward_context)


class _Routed:
    """One routed KV group driven as vllm-ascend drives it: build, forward (capture), update, replay."""

    def __init__(self, monkeypatch, q_len: int, spec_tokens: int, rows: int = MAX_REQS) -> None:
        import types

        from graphbuf.adapters.vllm_ascend.glue import routing

        self.routing, self.q_len, self.rows = routing, q_len, rows
        package = types.ModuleType("vllm_ascend")
        context = types.ModuleType("vllm_ascend.ascend_forward_context")
        context._EXTRA_CTX = types.SimpleNamespace(capturing=False)
        self.context = context._EXTRA_CTX
        monkeypatch.setitem(sys.modules, "vllm_ascend", package)
        monkeypatch.setitem(sys.modules, "vllm_ascend.ascend_forward_context", context)
        _fake_surface(monkeypatch)
        tpr = 1 + spec_tokens
        config = types.SimpleNamespace(
            compilation_config=types.SimpleNamespace(
                cudagraph_mode=_Mode("FULL_DECODE_ONLY"),
                cudagraph_capture_sizes=[r * tpr for r in (1, 2, MAX_REQS)],  # vLLM: multiples of 1 + k
            ),
            speculative_config=types.SimpleNamespace(num_speculative_tokens=spec_tokens)
            if spec_tokens
            else None,
            quant_config=None,
            model_config=types.SimpleNamespace(max_model_len=WIDTH * BLOCK),
            scheduler_config=types.SimpleNamespace(max_num_seqs=MAX_REQS, max_num_batched_tokens=2048),
            parallel_config=types.SimpleNamespace(tensor_parallel_size=2),
        )
        spec = types.SimpleNamespace(
            head_size=HEAD_DIM, num_kv_heads=KV_HEADS, sliding_window=None, block_size=BLOCK
        )
        self.builder = types.SimpleNamespace(
            vllm_config=config,
            kv_cache_spec=spec,
            device="cpu",
            decode_threshold=tpr,
            compilation_config=config.compilation_config,
        )
        self.impls = [
            types.SimpleNamespace(
                head_size=HEAD_DIM,
                scale=SCALE,
                sliding_window=None,
                sinks=None,
                alibi_slopes=None,
                attn_type="decoder",
                key_cache=None,
                value_cache=None,
            )
            for _ in LAYERS
        ]
        first = make_case([1] * rows, q_len, DTYPE, 0, "cpu")
        self.query = torch.empty_like(first[0])
        self.caches = [(torch.empty_like(first[1]), torch.empty_like(first[2])) for _ in LAYERS]
        self.outputs = [torch.full_like(self.query, float("nan")) for _ in LAYERS]
        self.table = torch.zeros(rows, WIDTH, dtype=torch.int32)  # the runner's persistent tensors
        self.seq_lens = torch.zeros(rows, dtype=torch.int32)
        self.graph = torch.npu.NPUGraph()
        self.update_stream = torch.npu.Stream()

    def load(self, live_lens: list[int], seed: int) -> None:
        """A new batch in the runner's tensors and the layers' caches (in place, as vLLM's runner writes)."""
        lens = live_lens + [0] * (self.rows - len(live_lens))
        query, kc, vc, table, seq_lens = make_case(lens, self.q_len, DTYPE, seed, "cpu")
        self.query.copy_(query)
        for i, (k, v) in enumerate(self.caches):
            k.copy_(kc if i == 0 else vc)  # distinct caches per layer
            v.copy_(vc if i == 0 else kc)
        needed = (seq_lens.view(-1, 1) + BLOCK - 1) // BLOCK
        column = torch.arange(WIDTH).view(1, -1)
        self.table.copy_(torch.where(column < needed, table, 0))  # vLLM's runner: 0 past a row's blocks
        self.seq_lens.copy_(seq_lens)
        self.live = len(live_lens)
        self.lens = lens

    def build(self):  # type: ignore[no-untyped-def]
        """The group's metadata of the loaded batch, built as the patched builder builds it."""
        import types

        live, q = self.live, self.q_len
        common = types.SimpleNamespace(
            query_start_loc_cpu=[i * q for i in range(live + 1)] + [live * q] * (self.rows - live),
            seq_lens=self.seq_lens, block_table_tensor=self.table, num_reqs=self.rows,
            num_actual_tokens=live * q, num_input_tokens=self.rows * q, max_query_len=q, causal=True,
        )  # fmt: skip
        metadata = types.SimpleNamespace(
            attn_state=_Mode("DecodeOnly" if q == 1 else "SpecDecoding"), num_prefills=0,
            seq_lens_list=list(self.lens[:live]),
        )  # fmt: skip
        route = self.routing.plan_route(self.builder, common, metadata)
        assert route is not None and route.q_len == q and route.group is not None, route
        setattr(metadata, self.routing.ROUTE_ATTR, route)
        return metadata

    def forward(self, metadata) -> None:  # type: ignore[no-untyped-def]
        def original(*args, **kwargs):
            raise AssertionError("the routed batch fell back to vllm-ascend's path")

        for impl, (kc, vc), out in zip(self.impls, self.caches, self.outputs, strict=True):
            self.routing.forward(original, impl, self.query, None, None, (kc, vc), metadata, out)

    def capture(self, metadata) -> None:  # type: ignore[no-untyped-def]
        self.context.capturing = True
        try:
            with torch.no_grad(), torch.npu.graph(self.graph):
                self.forward(metadata)
        finally:
            self.context.capturing = False

    def update(self, metadata) -> int:  # type: ignore[no-untyped-def]
        """What the patched update_graph_params does for graphbuf's groups before the replay."""
        return self.routing.update_routed(
            self.update_stream, self.rows * self.q_len, dict.fromkeys(LAYERS, metadata)
        )

    def references(self) -> list[torch.Tensor]:
        lens = torch.tensor(self.lens, dtype=torch.int32)
        return [
            sdpa_reference(self.query, kc, vc, self.table, lens, self.q_len, SCALE) for kc, vc in self.caches
        ]


FIA_OUT = "npu_fused_infer_attention_score.out"


def _step_lengths(step: int, live: int = MAX_REQS - 1) -> list[int]:
    """``live`` distinct KV lengths >= 100 for ``step``; no two steps share a list."""
    return _distinct_lengths(live, 100 + step)


@pytest.mark.parametrize("spec_tokens", [0, 2], ids=["decode", "mtp_group_decode"])
def test_routed_paged_decode_update_then_replay_follows_lengths_every_step(npu, monkeypatch, spec_tokens):
    """Capture through routing.forward with a planned group (one task per layer), then per step: new batch
    built (graphbuf's buffers refreshed), update_routed on the update stream, replay; matches the reference
    and the eager kernel at lengths that change every step. The group holds the one FIA .out per layer."""
    # An MTP group's 1-token batches replay vLLM's sizes (multiples of 1 + k): 3 rows, the last one padding.
    rows = MAX_REQS if spec_tokens == 0 else 1 + spec_tokens
    routed = _Routed(monkeypatch, 1, spec_tokens, rows)
    routed.load(_step_lengths(0, rows - 1), seed=40)
    captured = routed.build()
    routed.capture(captured)
    route = getattr(captured, routed.routing.ROUTE_ATTR)
    tasks = route.group.decodes.tasks(route.size)
    assert [t.owner for t in tasks] == routed.impls and all(t.npu is not None for t in tasks)
    assert [[c.name for c in g.calls] for g in npu.groups] == [[FIA_OUT]] * len(LAYERS)
    assert npu.group_allocations == 0
    for call in (g.calls[0] for g in npu.groups):  # buffers made before the group, lse by the op's rule
        query, value = call.args[0], call.args[2]
        _, lse_rule = kernels.npu_runtime()._npu_fused_infer_attention_score_infer_output(
            query, value, input_layout="BNSD", softmax_lse_flag=False
        )
        out, lse = call.kwargs["out"]
        assert out.shape == query.shape and (lse.shape, lse.dtype) == (lse_rule.shape, lse_rule.dtype)
        assert call.kwargs["workspace"] is not None
    seen: list[list[int]] = []
    for step in range(1, 5):
        lens = _step_lengths(step, rows - 1)
        routed.load(lens, seed=40 + step)
        metadata = routed.build()
        assert routed.update(metadata) == len(LAYERS)
        routed.graph.replay()
        seen.append(lens)
        assert [t.lens for t in tasks] == [[*lens, 0]] * len(LAYERS)
        route = getattr(metadata, routed.routing.ROUTE_ATTR)
        for out, ref, (kc, vc) in zip(routed.outputs, routed.references(), routed.caches, strict=True):
            torch.testing.assert_close(out.float(), ref, **TOL)
            eager = lh.decode_attention(routed.query, kc, vc, route.block_table, route.seq_lens, SCALE,
                                        seq_lens_host=routed.lens)  # fmt: skip
            torch.testing.assert_close(out, eager, rtol=0, atol=0)
            assert not out[rows - 1].any()  # the padded request
    assert len({tuple(x) for x in seen}) == len(seen) and min(min(x) for x in seen) >= 100
    assert npu.updates == len(LAYERS) * len(seen) and npu.group_allocations == 0


def test_routed_paged_decode_without_update_is_stale_or_blocks(npu, monkeypatch):
    """Skipping update_routed is visible: with no event recorded the replay would block the device (the
    stand-in refuses it); with the events armed but nothing re-issued, the captured lengths replay."""
    routed = _Routed(monkeypatch, 1, 0)
    first = _step_lengths(0)
    routed.load(first, seed=50)
    captured = routed.build()
    routed.capture(captured)
    routed.load(_step_lengths(1), seed=51)
    metadata = routed.build()
    with pytest.raises(ContractError, match="event"):
        routed.graph.replay()
    route = getattr(metadata, routed.routing.ROUTE_ATTR)
    route.group.decodes.arm(route.size, routed.update_stream)  # events only: no lengths re-issued
    routed.graph.replay()
    fresh = routed.references()
    routed.lens = [*first, 0]
    stale = routed.references()
    for out, want, old in zip(routed.outputs, fresh, stale, strict=True):
        assert not torch.allclose(out.float(), want, **TOL)
        torch.testing.assert_close(out.float(), old, **TOL)


def test_routed_paged_decode_back_to_back_steps_without_host_sync(npu, monkeypatch):
    """Build -> update -> replay for 6 steps back to back with no synchronize and no device-to-host read
    (what a 910B would stall on); each step's output is kept by a device copy and checked after the loop.
    Every update first waits for the replaying stream (the ordering the device needs without a host sync)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten._local_scalar_dense.default:
                HostReads.count += 1
            return func(*args, **(kwargs or {}))

    syncs = []
    monkeypatch.setattr(torch.npu, "synchronize", lambda device=None: syncs.append(device))
    routed = _Routed(monkeypatch, 1, 0)
    routed.load(_step_lengths(0), seed=60)
    routed.capture(routed.build())
    steps = [(_step_lengths(10 + i), 61 + i) for i in range(6)]
    batches = []
    for lens, seed in steps:  # the inputs of every step, made before the loop (host work of the runner)
        routed.load(lens, seed)
        batches.append(([t.clone() for t in (routed.query, routed.table, routed.seq_lens)],
                        [(k.clone(), v.clone()) for k, v in routed.caches], list(routed.lens)))  # fmt: skip
    kept = torch.empty((len(steps), len(LAYERS), *routed.query.shape), dtype=DTYPE)
    waits_before = sum(1 for e in npu.log if e[0] == "wait_stream")
    with HostReads():
        for i, ((tensors, caches, lens), (live, _)) in enumerate(zip(batches, steps, strict=True)):
            for dst, src in zip((routed.query, routed.table, routed.seq_lens), tensors, strict=True):
                dst.copy_(src, non_blocking=True)
            for (k, v), (k_src, v_src) in zip(routed.caches, caches, strict=True):
                k.copy_(k_src, non_blocking=True)
                v.copy_(v_src, non_blocking=True)
            routed.live, routed.lens = len(live), lens
            assert routed.update(routed.build()) == len(LAYERS)
            routed.graph.replay()
            for j, out in enumerate(routed.outputs):
                kept[i, j].copy_(out, non_blocking=True)
    assert HostReads.count == 0 and syncs == []
    # Each task update first waits for the replaying stream (one per layer and step).
    assert sum(1 for e in npu.log if e[0] == "wait_stream") - waits_before == len(steps) * len(LAYERS)
    for i, (tensors, caches, lens) in enumerate(batches):
        query, table, _ = tensors
        for j, (kc, vc) in enumerate(caches):
            ref = sdpa_reference(query, kc, vc, table, torch.tensor(lens, dtype=torch.int32), 1, SCALE)
            torch.testing.assert_close(kept[i, j].float(), ref, **TOL)


@pytest.mark.parametrize("mode", ["blockwise", "dense"])
def test_routed_verify_replays_follow_device_lengths_with_nothing_to_reissue(npu, monkeypatch, mode):
    """MTP verify (q_len 3) through routing.forward with a planned group: captured as ordinary kernels (no
    task group: no host arguments), the masked kernel the graph-capable v3; per step build -> update_routed
    (re-issues nothing) -> replay matches the reference at lengths that change every step."""
    import dataclasses

    routed = _Routed(monkeypatch, 3, 2)
    routed.load(_step_lengths(0), seed=70)
    captured = routed.build()
    group = getattr(captured, routed.routing.ROUTE_ATTR).group
    group.modes = dataclasses.replace(group.modes, verify=mode)
    assert group.modes.verify == mode
    routed.capture(captured)
    assert npu.groups == [] and npu.group_allocations == 0
    for step in range(1, 4):
        routed.load(_step_lengths(step), seed=70 + step)
        assert routed.update(routed.build()) == 0
        routed.graph.replay()
        for out, ref in zip(routed.outputs, routed.references(), strict=True):
            torch.testing.assert_close(out.float(), ref, **TOL)


@pytest.mark.parametrize("q_len", [1, 3])
def test_routed_attention_without_a_task_registry_reads_device_lengths(npu, monkeypatch, q_len):
    """A Route not planned by plan_route (no group, so nothing can re-issue host lengths) decodes with the
    device lengths under a capture: no task group, no baked host list; replays after in-place changes of the
    buffers match the reference."""
    import types

    from graphbuf.adapters.vllm_ascend.glue import routing

    package = types.ModuleType("vllm_ascend")
    context = types.ModuleType("vllm_ascend.ascend_forward_context")
    context._EXTRA_CTX = types.SimpleNamespace(capturing=True)
    monkeypatch.setitem(sys.modules, "vllm_ascend", package)
    monkeypatch.setitem(sys.modules, "vllm_ascend.ascend_forward_context", context)
    _fake_surface(monkeypatch)

    static = make_case([300, 5, 129], q_len, DTYPE, 16, "cpu")
    query, kc, vc, table, lens = static
    impl = types.SimpleNamespace(
        head_size=HEAD_DIM, scale=SCALE, sliding_window=None, sinks=None, alibi_slopes=None,
        attn_type="decoder", key_cache=kc, value_cache=vc,
    )  # fmt: skip
    route = routing.Route(q_len=q_len, block_table=table, seq_lens=lens, size=query.shape[0], num_reqs=3)
    metadata = types.SimpleNamespace(attn_state=types.SimpleNamespace(name="DecodeOnly"))
    setattr(metadata, routing.ROUTE_ATTR, route)
    output = torch.zeros_like(query)

    def original(*args, **kwargs):
        raise AssertionError("the routed batch fell back to vllm-ascend's path")

    graph = Graph("npu")
    with torch.no_grad(), graph.capture():
        routing.forward(original, impl, query, None, None, (kc, vc), metadata, output)
    assert npu.groups == []
    for seed, new in ((17, [512, 3, 385]), (18, [130, 257, 4])):
        _copy_case(static, new, q_len, seed)
        graph.replay()
        torch.testing.assert_close(output.float(), sdpa_reference(*static, q_len, SCALE), **TOL)


def test_routed_paged_decode_refuses_a_capture_its_forward_context_does_not_announce(npu, monkeypatch):
    """A capture vllm-ascend did not start (its forward context does not say capturing, vLLM's says FULL)
    registers no task, so nobody would re-issue the host lengths: refused with a clear error."""
    routed = _Routed(monkeypatch, 1, 0)
    routed.load(_step_lengths(0), seed=80)
    metadata = routed.build()
    import types

    monkeypatch.setattr(
        sys.modules["vllm.forward_context"],
        "get_forward_context",
        lambda: types.SimpleNamespace(cudagraph_runtime_mode=_Mode("FULL")),
    )
    with (
        pytest.raises(RuntimeError, match="does not say capturing"),
        torch.no_grad(),
        torch.npu.graph(routed.graph),
    ):
        routed.forward(metadata)
    routed.forward(metadata)  # no capture underway: one eager call, correct
    for out, ref in zip(routed.outputs, routed.references(), strict=True):
        torch.testing.assert_close(out.float(), ref, **TOL)
