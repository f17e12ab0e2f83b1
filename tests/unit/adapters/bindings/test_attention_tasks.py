"""Adapter task binding on the shipped Gemma4 spec (cpu emulator, software kernels).

Per-layer decode and verify tasks share their KV group's buffers, decode KV lengths are host task arguments
re-issued before replay, the drill runs both tasks, and a too-wide block table is rejected with the buffers
unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import graphbuf
from graphbuf.adapters.vllm_ascend.bindings.attention_tasks import Gemma4AttentionTask, LargeHeadBinding
from graphbuf.cli import main
from graphbuf.drill.session import run_drill
from graphbuf.graphs.runner import GraphRunner, Step
from graphbuf.graphs.tasks import TaskKind
from graphbuf.testing import sample, sources

# The shipped spec at a small model length so the software kernels run fast; the layout is unchanged.
SMALL = {"max_model_len": 256, "num_blocks": 32}


def make_batch(p: graphbuf.Plan, live: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``live`` requests drawn through the adapter's relation (graphbuf.testing), seeded by ``rng``."""
    return sample(sources(p, live), seed=int(rng.integers(2**31)))[0]


def gemma_buffers(**extra: int) -> graphbuf.StaticBuffers:
    return graphbuf.StaticBuffers("gemma4-31b-it-mtp", overrides={**SMALL, **extra})


def tasks_for(bufs: graphbuf.StaticBuffers, layers: int, mode: str) -> Gemma4AttentionTask:
    c = bufs.plan.constants
    task = Gemma4AttentionTask(
        mode, mode=mode, group="full", layers=layers, num_heads=int(c["num_heads_per_rank"]),
        num_kv_heads=int(c["full_kv_heads_per_rank"]), head_dim=64,
    )  # fmt: skip
    task.bind(bufs, torch.Generator().manual_seed(0))
    return task


def reference(task: Gemma4AttentionTask, bt: np.ndarray, lens: np.ndarray) -> torch.Tensor:
    """Independent FP32 loop: each query sees keys 0 .. seq_len - q_len + i of its own request."""
    q_len = task.binding.q_len if task.mode == "verify" else 1
    bs = task.key_caches[0].shape[1]
    rows = len(lens) * q_len
    out = torch.zeros(rows, task.layers, task.num_heads, task.head_dim)
    rep = task.num_heads // task.num_kv_heads
    for layer in range(task.layers):
        kc, vc = task.key_caches[layer].float(), task.value_caches[layer].float()
        for r, n in enumerate(lens):
            for i in range(q_len):
                visible = int(n) - q_len + i + 1
                if visible <= 0:
                    continue
                pos = torch.arange(visible)
                blocks = torch.as_tensor(bt[r][(pos // bs).numpy()].astype(np.int64))
                k = kc[blocks, pos % bs].repeat_interleave(rep, dim=1)  # [visible, Nq, D]
                v = vc[blocks, pos % bs].repeat_interleave(rep, dim=1)
                q = task.query[r * q_len + i].float()
                p = torch.softmax(torch.einsum("hd,khd->hk", q, k) * task.binding.scale, dim=-1)
                out[r * q_len + i, layer] = torch.einsum("hk,khd->hd", p, v)
    return out


def test_every_layer_binds_the_same_group_buffers() -> None:
    bufs = gemma_buffers()
    decode, verify = tasks_for(bufs, 2, "decode"), tasks_for(bufs, 2, "verify")
    runner = GraphRunner(bufs, lambda s: (decode(s), verify(s)), output_rows=["requests", "tokens"])
    runner.capture()
    for size in bufs.capture_sizes:
        graph = runner._graphs[size].graph
        views = bufs.view(size)
        kinds = [t.kind for t in graph.tasks]
        assert kinds == [TaskKind.ATTENTION] * 2 + [TaskKind.SPEC_VERIFY_ATTENTION] * 2
        for task in graph.tasks:
            bt, lens = task.tensor_args[3], task.tensor_args[4]
            assert bt.data_ptr() == views["block_table.full"].data_ptr()
            assert bt.shape == views["block_table.full"].shape
            assert lens.data_ptr() == views["seq_lens"].data_ptr()


def test_refresh_work_does_not_depend_on_layer_count() -> None:
    """Layers bind views; the plan (what refresh writes) is identical for 60 and 240 layers."""
    p60 = graphbuf.plan("gemma4-31b-it-mtp", overrides={"num_layers": 60})
    p240 = graphbuf.plan("gemma4-31b-it-mtp", overrides={"num_layers": 240})
    assert p60.constants["num_full_layers"] == 10 and p240.constants["num_full_layers"] == 40
    assert [(b.name, b.shape, b.offset) for b in p60.buffers] == [
        (b.name, b.shape, b.offset) for b in p240.buffers
    ]
    assert p60.total_bytes == p240.total_bytes


@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_replays_follow_fresh_lengths_and_tables(mode: str) -> None:
    bufs = gemma_buffers()
    task = tasks_for(bufs, 2, mode)
    runner = GraphRunner(bufs, task, output_rows=task.output_rows)
    runner.capture()
    rng = np.random.default_rng(1)
    gen = torch.Generator().manual_seed(1)
    addresses = {s: bufs.addresses(s) for s in bufs.capture_sizes}
    for live in (3, 1, 7, 2, 2):
        task.randomize(live, gen)
        src = make_batch(bufs.plan, live, rng)
        size = runner.size_for(live)
        got = runner.run(src, host_args=task.host_args(size, live, src))
        want = reference(task, src["block_table.full"], src["seq_lens"])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert runner.stats.replays == 5
    assert {s: bufs.addresses(s) for s in bufs.capture_sizes} == addresses
    if mode == "decode":
        assert runner.stats.task_updates >= 2 * 4  # two layers re-issued per changed batch
        graph = runner._graphs[runner.size_for(2)].graph
        assert all(list(t.host_args["seq_lens_kv"])[:2] == list(src["seq_lens"]) for t in graph.tasks)


def test_decode_without_reissue_replays_stale_host_lengths() -> None:
    """Faithful to the device: host KV lengths are baked into the captured task until it is re-issued."""
    bufs = gemma_buffers()
    task = tasks_for(bufs, 1, "decode")
    runner = GraphRunner(bufs, task, output_rows="requests")
    runner.capture()
    rng = np.random.default_rng(2)
    src = make_batch(bufs.plan, 4, rng)
    fresh = runner.run(src, host_args=task.host_args(16, 4, src)).clone()
    torch.testing.assert_close(fresh, reference(task, src["block_table.full"], src["seq_lens"]))
    src2 = dict(src, seq_lens=np.maximum(src["seq_lens"] // 2, 1).astype(np.int32))
    stale = runner.run(src2).clone()  # no host args: the task keeps the lengths it was issued with
    torch.testing.assert_close(stale, fresh)
    updated = runner.run(src2, host_args=task.host_args(16, 4, src2))
    torch.testing.assert_close(updated, reference(task, src2["block_table.full"], src2["seq_lens"]))
    assert not torch.allclose(updated, stale)


def test_host_args_pad_lengths_to_the_captured_batch() -> None:
    assert LargeHeadBinding.host_args(4, [7, 9]) == {"attention": {"seq_lens_kv": [7, 9, 0, 0]}}


def test_too_wide_block_table_is_rejected_and_buffers_unchanged() -> None:
    bufs = gemma_buffers()
    src = make_batch(bufs.plan, 4, np.random.default_rng(3))
    bufs.refresh(16, src)
    before = bufs.slab.numpy().tobytes()
    alloc = bufs.full["block_table.full"].shape[1]
    wide = dict(src, **{"block_table.full": np.zeros((4, alloc + 1), dtype=np.int32)})
    with pytest.raises(graphbuf.WidthError, match=r"block_table\.full.*captured allocation of 2 columns"):
        bufs.refresh(16, wide)
    assert bufs.slab.numpy().tobytes() == before


def test_drill_runs_decode_and_verify_on_the_gemma_spec() -> None:
    report = run_drill(
        "gemma4-31b-it-mtp", replays=16, seed=1, overrides={"max_model_len": 256, "drill_layers": 1}
    )
    assert report.tasks == ["decode", "verify"]
    assert report.ok, report.render()
    assert all(r.replays >= 1 for r in report.rows.values())
    assert all(r.addresses_stable for r in report.rows.values())
    assert report.stats["task_updates"] > 0


def test_drill_json_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["drill", "gemma4-31b-it-mtp", "--replays", "16", "--json", "--set", "max_model_len=256",
                 "--set", "drill_layers=1"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["ok"] is True
    assert [s["size"] for s in out["sizes"]] == list(range(4, 65, 4))


@pytest.mark.parametrize(
    "options",
    [
        {"verify": {"verify_mode": "blockwise", "chunk_blocks": 1}, "decode": {}},
        {"verify": {"verify_mode": "dense"}, "decode": {"decode_mode": "dense"}},
    ],
)
def test_spec_options_choose_the_routes_the_drill_proves(options: dict[str, dict[str, object]]) -> None:
    spec = graphbuf.load_spec("gemma4-31b-it-mtp")
    tasks = [t.model_copy(update={"options": {**t.options, **options[t.name]}}) for t in spec.tasks]
    spec = spec.model_copy(update={"tasks": tasks})
    report = run_drill(spec, replays=12, overrides={"max_model_len": 256, "drill_layers": 1})
    assert report.ok, report.render()
    # Dense decode has no host arguments to re-issue; paged decode re-issues its KV lengths.
    assert (report.stats["task_updates"] > 0) == ("decode_mode" not in options["decode"])


def test_dense_decode_task_reads_device_lengths_without_host_args() -> None:
    bufs = gemma_buffers()
    task = Gemma4AttentionTask(
        "decode", mode="decode", group="full", layers=1, num_heads=16, num_kv_heads=2, head_dim=64,
        decode_mode="dense",
    )  # fmt: skip
    task.bind(bufs, torch.Generator().manual_seed(0))
    runner = GraphRunner(bufs, task, output_rows="requests")
    runner.capture()
    rng = np.random.default_rng(4)
    for live in (4, 2):
        src = make_batch(bufs.plan, live, rng)
        assert task.host_args(runner.size_for(live), live, src) == {}
        got = runner.run(src)
        torch.testing.assert_close(got, reference(task, src["block_table.full"], src["seq_lens"]))
    graph = runner._graphs[runner.size_for(2)].graph
    assert [t.kind for t in graph.tasks] == [TaskKind.CUSTOM]
    # None at all, the scale included: a CUDA graph refuses a task with host arguments at capture.
    assert [dict(t.host_args) for t in graph.tasks] == [{}]
    with pytest.raises(ValueError, match="decode_mode 'pagd'; allowed: paged, dense"):
        LargeHeadBinding(q_len=1, scale=1.0, decode_mode="pagd")


def test_drill_reports_a_mismatch_as_failure() -> None:
    """A callable that reads a rebound (not refreshed) tensor differs from eager: the drill says FAIL."""

    class Stale:
        name, output_rows = "stale", "requests"

        def bind(self, buffers: graphbuf.StaticBuffers, generator: torch.Generator) -> None:
            self.scale = self.captured = torch.ones(())  # ``captured`` keeps it alive (no LivenessError)

        def randomize(self, live: int, generator: torch.Generator) -> None:
            self.scale = torch.full((), float(live))  # rebound: the graph keeps the old tensor

        def __call__(self, step: Step) -> torch.Tensor:
            return step.views["seq_lens"].float() * self.scale

    import graphbuf.drill.session as drill

    original = drill._build_tasks
    drill._build_tasks = lambda spec, p: [Stale()]
    try:
        report = run_drill("gemma4-31b-it-mtp", replays=12, overrides={"max_model_len": 256})
    finally:
        drill._build_tasks = original
    assert not report.ok and "FAIL" in report.render()


def test_widening_the_envelope_is_an_edit_of_capture_sizes(
    tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    shipped = graphbuf.spec.models.resolve_spec_path("gemma4-31b-it-mtp").read_text()
    assert "sizes: {start: 4, stop: 64, step: 4}" in shipped  # 1..max_num_seqs (16) requests
    wide = tmp_path / "wide.yaml"
    wide.write_text(shipped)
    assert main(["check", str(wide)]) == 0
    p = graphbuf.plan(str(wide))
    assert p.capture_sizes == tuple(range(4, 65, 4))
    assert p["block_table.full"].shape == (16, 43)
    assert p.to_dict()["sizes"]["64"]["workspace_bytes"]["verify_kv_dense"] == 2 * 16 * 2 * 43 * 128 * 512 * 2
    capsys.readouterr()
    bad = tmp_path / "bad.yaml"
    bad.write_text(shipped.replace("stop: 64", "stop: 68"))
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: capture.sizes: size 68 implies 17 requests, above max_num_seqs (16)" in err


def test_randomize_depends_only_on_the_bind_and_its_generator() -> None:
    """A saved drill batch replays with the KV it failed with: the inputs after ``randomize(live, g)`` are
    the same whatever batches came before (each call restores the blocks the previous one changed)."""
    bufs = gemma_buffers()
    task = tasks_for(bufs, layers=2, mode="decode")

    def state(seed: int) -> list[torch.Tensor]:
        task.randomize(3, torch.Generator().manual_seed(seed))
        return [t.clone() for t in (task.query, *task.key_caches, *task.value_caches)]

    first = state(11)
    for seed in (12, 13, 14):
        assert any(not torch.equal(a, b) for a, b in zip(first, state(seed)))
    again = state(11)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_large_head_binding_takes_its_scale_from_the_caller() -> None:
    """No default: ``1/sqrt(head_dim)`` built directly was 22.6x off Gemma4's 1.0 at head_dim 512."""
    with pytest.raises(TypeError, match="scale"):
        LargeHeadBinding(q_len=1)  # type: ignore[call-arg]
    for bad in (0.0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="must be a finite number > 0"):
            LargeHeadBinding(q_len=1, scale=bad)
    assert LargeHeadBinding(q_len=4, scale=1.0).scale == 1.0
