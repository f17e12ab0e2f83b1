"""``graphbuf drill`` with the built-in paged-decode task on the issue's example spec (no ``tasks:``): the
table, JSON, eager fallbacks above the largest size, exit codes, and the built-in task's own numerics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import graphbuf
import graphbuf.drill.session as drill
from graphbuf.cli import main
from graphbuf.drill.session import PagedDecodeAttention, run_drill
from graphbuf.graphs.runner import Step
from graphbuf.testing import paged_kv, sample, sources

EXAMPLE = {
    "version": 1,
    "name": "example",
    "constants": {
        "max_model_len": 256,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 8192,
        "block_size": 16,
        "num_speculative_tokens": 3,
    },
    "capture": {
        "tokens_per_request": "1 + num_speculative_tokens",
        "sizes": {"start": 4, "stop": 32, "step": 4},
    },
    "groups": ["sliding", "full"],
    "buffers": {
        "block_table": {"dtype": "int32", "rows": "requests", "cols": "cdiv(max_model_len, block_size)",
                        "per_group": True, "pad": 0, "overflow": "reject"},
        "seq_lens": {"dtype": "int32", "rows": "requests", "pad": 0},
        "query_start_loc": {"dtype": "int32", "rows": "requests + 1", "pad": "repeat_last"},
        "slot_mapping": {"dtype": "int64", "rows": "tokens", "per_group": True, "pad": -1},
    },
}  # fmt: skip


@pytest.fixture
def example(tmp_path: Path) -> Path:
    path = tmp_path / "example.yaml"
    path.write_text(yaml.safe_dump(EXAMPLE, sort_keys=False))
    return path


def test_drill_table_and_exit_code(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["drill", str(example), "--replays", "40", "--seed", "3"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "tasks: paged_decode" in out and "PASS" in out
    assert "size  replays  max abs err  refresh µs  addresses stable" in out
    for size in range(4, 33, 4):
        assert any(line.split()[:1] == [str(size)] and line.endswith("yes") for line in out.splitlines())
    assert "drill: 40/40 replays" in captured.err  # progress


def test_drill_json_counts_replays_and_eager_fallbacks(
    example: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["drill", str(example), "--replays", "60", "--seed", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["device"] == "cpu"
    assert [s["size"] for s in report["sizes"]] == list(range(4, 33, 4))
    replays = sum(s["replays"] for s in report["sizes"])
    assert replays + report["eager"]["runs"] == 60
    assert report["eager"]["runs"] > 0  # batches above the largest capture size ran eagerly
    assert report["runner"]["eager_reasons"] == {
        "batch above the largest capture size": report["eager"]["runs"]
    }
    assert all(s["max_abs_error"] <= report["tolerance"] for s in report["sizes"])
    assert all(s["addresses_stable"] for s in report["sizes"])


def test_drill_exits_1_on_a_mismatch(example: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Rebinding(PagedDecodeAttention):
        """Rebinds its query instead of copying into it: the graph keeps replaying the captured one."""

        def randomize(self, live_requests: int, generator: torch.Generator, kv: bool = False) -> None:
            if kv:
                super().randomize(live_requests, generator, kv=True)
            else:
                self.query = torch.randn(self.query.shape, generator=generator)

    monkeypatch.setattr(drill, "_build_tasks", lambda spec, p: [Rebinding(group="full")])
    saved = example.with_name("failure.json")
    assert main(["drill", str(example), "--replays", "10", "--save", str(saved)]) == 1
    assert drill.load_batch(saved)["num_reqs"] >= 1


def test_built_in_task_matches_a_per_query_reference(example: Path) -> None:
    bufs = graphbuf.StaticBuffers(str(example), overrides={})
    p = bufs.plan
    task = PagedDecodeAttention(group="full", num_heads=4, num_kv_heads=2, head_dim=8)
    object.__setattr__(p, "constants", {**p.constants, "num_blocks": 32})
    task.bind(bufs, torch.Generator().manual_seed(0))
    src = sample(sources(p, 3, relations=[paged_kv]), seed=0)[0]
    views = {k: torch.as_tensor(v) for k, v in src.items()}
    out = task(Step(12, views, None, {}, 3))
    bt, lens, q_len = src["block_table.full"], src["seq_lens"], 4
    for r in range(3):
        for i in range(q_len):
            n = int(lens[r]) - q_len + i + 1
            pos = np.arange(n)
            blocks = torch.as_tensor(bt[r][pos // 16].astype(np.int64))
            k = task.key_cache[blocks, torch.as_tensor(pos % 16)].repeat_interleave(2, dim=1)
            v = task.value_cache[blocks, torch.as_tensor(pos % 16)].repeat_interleave(2, dim=1)
            q = task.query[r * q_len + i]
            probs = torch.softmax(torch.einsum("hd,khd->hk", q, k) / 8**0.5, dim=-1)
            torch.testing.assert_close(out[r * q_len + i], torch.einsum("hk,khd->hd", probs, v))


def test_run_drill_report_renders(example: Path) -> None:
    report = run_drill(str(example), replays=8, seed=2)
    text = report.render()
    assert report.ok and text.splitlines()[0].startswith("graphbuf drill: example on cpu")


def test_on_an_accelerator_one_rounding_step_of_the_output_is_not_an_error() -> None:
    # Seen on an H200: the padded replay and the live-rows reference round float32 sums to bfloat16 after
    # kernels of different reduction orders; one bf16 step apart (2**-9 at 0.3) is the same result.
    want = torch.tensor([0.3, -2.0, 0.0], dtype=torch.bfloat16)
    one = torch.tensor([0.3 + 2**-9, -2.0 - 2**-6, 0.0], dtype=torch.bfloat16)
    assert one.ne(want).sum() == 2
    assert drill.output_error(one, want, rounding=True) == 0.0
    assert drill.output_error(one, want, rounding=False) == 2**-6
    two = torch.tensor([0.3 + 2**-7, -2.0, 1e-3], dtype=torch.bfloat16)
    assert drill.output_error(two, want, rounding=True) > 1e-4  # past one step, and any change from 0
    ints = torch.tensor([1, 2])
    assert drill.output_error(ints + 1, ints, rounding=True) == 1.0
    assert drill.DrillSession("gemma4-31b-it-mtp", capture=False).rounding is False
    report = drill.DrillReport(spec="s", device="cuda:0", tasks=["t"], tolerance=1e-4, rows={}, rounding=True)
    assert "tolerance 0.0001 past one rounding step of the output dtype" in report.render()
    assert report.as_dict()["rounding"] is True
