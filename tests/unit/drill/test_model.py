"""The whole-model drill (``graphbuf drill gemma4-31b-it-mtp --model tiny``): transformers' own Gemma4 and its
MTP assistant served through graphbuf, judged per dtype by three layers (replay = eager on the same buffers,
replay = a live-only eager step, teacher-forced agreement with transformers), its drafts accepted 0..k times
per step; each planted bug fails the bfloat16 drill with a shrunk scenario that ``--replay FILE``
reproduces."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the model extra: pip install -c constraints.txt -e '.[model]'")

import torch

from graphbuf.cli import main
from graphbuf.drill.model import ModelDrillReport, Request, Scenario, run_model_drill
from graphbuf.drill.model.run import MODEL_SPEC, load_model_batch
from graphbuf.drill.model.tiny import build_models, successor
from graphbuf.planning.planner import plan
from graphbuf.spec.models import load_spec

CONSTANTS = plan(load_spec(MODEL_SPEC), overrides={"num_blocks": 2}).constants


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any]:
    return build_models(CONSTANTS, dtype=torch.float32, seed=0)


@pytest.fixture(scope="module")
def shipped() -> ModelDrillReport:
    """What ``graphbuf drill gemma4-31b-it-mtp --model tiny`` serves and judges: 4 requests, both dtypes."""
    return run_model_drill(requests=4, seed=0)


def test_the_tiny_model_keeps_what_matters_to_capture(models: tuple[Any, Any]) -> None:
    model = models[0]
    cfg = model.config
    kinds = cfg.layer_types
    assert kinds[-1] == "full_attention" and kinds.count("full_attention") >= 3
    assert cfg.final_logit_softcapping is not None and cfg.attention_k_eq_v
    for layer, kind in zip(model.model.layers, kinds):
        attn = layer.self_attn
        assert attn.scaling == 1.0  # Gemma4: q and k are RMS-normed, no 1/sqrt(d)
        kv_heads = cfg.num_attention_heads // attn.num_key_value_groups
        if kind == "full_attention":
            assert (attn.head_dim, cfg.num_attention_heads, kv_heads) == (512, 16, 2)
            assert attn.v_proj is None  # K=V sharing: V = v_norm(k_proj x)
        else:  # the 31B's sliding geometry per rank at TP=2
            assert (attn.head_dim, kv_heads) == (256, 8) and attn.sliding_window < CONSTANTS[
                "max_model_len"
            ] // 2
    # vLLM unifies page sizes: a sliding block's bytes equal a full manager block's, twice its kernel block
    bs, full = CONSTANTS["block_size"], CONSTANTS["full_manager_block_size"]
    assert bs * 8 * 256 == full * 2 * 512 and full == 2 * bs


def test_the_assistant_is_transformers_own_query_only_drafter(models: tuple[Any, Any]) -> None:
    from transformers import Gemma4AssistantForCausalLM

    assistant = models[1]
    assert isinstance(assistant, Gemma4AssistantForCausalLM)
    text = assistant.config.get_text_config()
    assert text.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    for layer in assistant.model.layers:
        attn = layer.self_attn
        assert attn.is_kv_shared_layer and not hasattr(attn, "k_proj")  # query-only: reads the target's KV
    assert assistant.pre_projection.in_features == 2 * CONSTANTS["hidden_size"]


def test_the_target_favours_a_successor_that_the_assistant_drafts(models: tuple[Any, Any]) -> None:
    """The weights that let the assistant be right: the target's untied lm_head adds SUCCESSOR * E[pred(v)]
    to E[v], and the assistant's lm_head row v is its projection of E[pred(v)]."""
    from graphbuf.drill.model.tiny import SUCCESSOR

    target, assistant = models
    embedding = target.model.embed_tokens.weight
    succ = successor(embedding.shape[0], 0)
    assert target.lm_head.weight is not embedding
    torch.testing.assert_close(target.lm_head.weight[succ], embedding[succ] + SUCCESSOR * embedding)
    projection = assistant.pre_projection.weight[:, : embedding.shape[1]]
    torch.testing.assert_close(assistant.lm_head.weight[succ], embedding @ projection.T)


def test_small_whole_model_drill_passes_all_three_layers_in_both_dtypes(shipped: ModelDrillReport) -> None:
    report = shipped
    assert report.ok, report.render()
    text = report.render()
    for run in report.runs:
        r, d = run.result, run.as_dict()
        assert run.requests == 4 and all(len(s) >= 16 for s in r.streams.values())
        assert r.replay_eager.checked == r.steps and r.replay_eager.failed == 0  # every step replayed
        assert r.live_eager.checked == r.steps and r.draft_replay_eager.checked > 0
        assert run.teacher.positions == sum(len(s) for s in r.streams.values())
        assert r.decode_steps > 0 and r.dp_padded_steps > 0 and r.nulled_blocks > 0  # the 31B's paths
        assert run.eager_steps == r.prefills  # capture sizes cover every live count
        assert d["joined_mid_run"] >= 1 and d["finished_mid_run"] >= 1
        assert set(d["replays_by_size"]) == {"verify", "decode", "draft"}
    words = ("1. replay = eager on the same buffers", "2. replay = live-only eager step",
             "3. teacher-forced vs transformers", "drafter vs transformers' Gemma4AssistantForCausalLM",
             "accepted drafts per request-step", "eager steps", "PASS")  # fmt: skip
    assert all(w in text for w in words), text


def test_the_shipped_run_accepts_from_0_to_k_drafts_per_step(shipped: ModelDrillReport) -> None:
    """Acceptance comes from comparing each draft with the verify step's choice: the assistant is right
    where the target follows its successor and wrong elsewhere, so a request-step accepts 0, some and all
    k drafts; the report prints the histogram and every verify step's counts."""
    k = int(CONSTANTS["num_speculative_tokens"])
    for run in shipped.runs:
        r, d = run.result, run.as_dict()
        assert set(r.accepted) <= set(range(k + 1))
        assert r.accepted[0] > 0 and r.accepted[k] > 0 and sum(r.accepted[a] for a in range(1, k)) > 0, d
        assert sum(r.accepted.values()) == sum(len(s) for s in r.accepted_by_step)  # one count per request
        assert d["accepted_per_request_step"] == {str(a): n for a, n in sorted(r.accepted.items())}
        assert r.drafter.positions == k * sum(r.accepted.values())  # every draft judged against transformers


#: Small enough to serve quickly, and reaching every bug: request 1 finishes after 2 steps, so request 0 runs
#: alone with padded rows behind it (pad_not_cleared); request 0 runs into the block table's last column
#: (short_block_table); request 2 joins mid-run.
PLANTED = Scenario(
    (
        Request(tuple(range(5, 53)), 0, 12),
        Request(tuple(range(60, 68)), 0, 2),
        Request(tuple(range(100, 112)), 3, 6),
    )
)


#: The check that sees each planted bug in bfloat16 (the failure names at least this one).
CAUGHT_BY = {
    "scale": "layer 3 (teacher-forced)",
    "stale_seq_len": "layer 2 (replay = live-only eager)",
    "pad_not_cleared": "layer 2 (replay = live-only eager)",
    "short_block_table": "layer 2 (replay = live-only eager)",
    "draft_group0_table": "drafter vs transformers' assistant",
}


@pytest.mark.parametrize("fault", list(CAUGHT_BY))
def test_planted_bug_fails_the_bf16_drill_with_a_shrunk_saved_scenario(fault: str, tmp_path: Path) -> None:
    """Which layer sees it: layer 2 a stale length, a padded row not cleared, a short block table; layer 3 the
    scale; the drafter check the draft layers bound to group 0's table (the drafts still follow the input
    token's successor, so acceptance need not drop). Replaying a saved file: the CLI test."""
    saved = tmp_path / "failure.json"
    report = run_model_drill(
        dtypes=("bfloat16",), faults=(fault,), scenario=PLANTED, save=saved, shrink_budget=1
    )
    assert not report.ok and report.failure is not None, report.render()
    doc = load_model_batch(saved)
    assert doc["faults"] == [fault] and doc["dtype"] == "bfloat16"
    assert CAUGHT_BY[fault] in report.failure["what"], report.render()
    small = Scenario.from_dict(doc["scenario"])
    tokens = sum(r.max_new for r in small.requests)
    assert report.failure["requests"] == len(small.requests) and report.failure["tokens"] == tokens
    assert (len(small.requests), tokens) < (3, 20) or report.shrink_serves > 0  # shrunk, or tried to


def test_cli_replays_a_saved_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "stale.json"
    alone = Scenario((Request(tuple(range(100, 112)), 0, 4),))
    run_model_drill(
        dtypes=("float32",), faults=("stale_seq_len",), scenario=alone, save=saved, shrink_budget=0
    )
    command = f"graphbuf drill gemma4-31b-it-mtp --model tiny --replay {shlex.quote(str(saved))} --json"
    assert main(shlex.split(command)[1:]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["runs"][0]["dtype"] == "float32"
    assert out["failure"]["what"].startswith("layer 2 (replay = live-only eager)")


def test_unknown_fault_and_bad_replay_file_are_spec_errors(tmp_path: Path) -> None:
    from graphbuf.errors import BatchFileError, SpecError

    with pytest.raises(SpecError, match="unknown faults"):
        run_model_drill(dtypes=("float32",), faults=("typo",), scenario=PLANTED)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    with pytest.raises(BatchFileError, match="not a saved model-drill scenario"):
        run_model_drill(replay=bad)
