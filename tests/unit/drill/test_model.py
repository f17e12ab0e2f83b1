"""The whole-model drill (``graphbuf drill gemma4-31b-it-mtp --model tiny``): transformers' own Gemma4 served
under MTP through graphbuf matches ``model.generate`` token for token in float32; each planted bug (attention
scale 1/sqrt(d), a seq_len not refreshed, a padded row not cleared, a block table one column short) makes it
fail with a shrunk scenario that ``--replay FILE`` reproduces."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the model extra: pip install -c constraints.txt -e '.[model]'")

from graphbuf.cli import main
from graphbuf.drill.model import Request, Scenario, run_model_drill
from graphbuf.drill.model.run import MODEL_SPEC, load_model_batch
from graphbuf.drill.model.tiny import build_model
from graphbuf.planning.planner import plan
from graphbuf.spec.models import load_spec

CONSTANTS = plan(load_spec(MODEL_SPEC), overrides={"num_blocks": 1}).constants


def test_the_tiny_model_keeps_what_matters_to_capture() -> None:
    import torch

    model = build_model(CONSTANTS, dtype=torch.float32, seed=0)
    cfg = model.config
    kinds = cfg.layer_types
    assert kinds[-1] == "full_attention" and kinds[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert cfg.final_logit_softcapping is not None and cfg.attention_k_eq_v
    for layer, kind in zip(model.model.layers, kinds):
        attn = layer.self_attn
        assert attn.scaling == 1.0  # Gemma4: q and k are RMS-normed, no 1/sqrt(d)
        kv_heads = cfg.num_attention_heads // attn.num_key_value_groups
        if kind == "full_attention":
            assert (attn.head_dim, cfg.num_attention_heads, kv_heads) == (512, 16, 2)
            assert attn.v_proj is None  # K=V sharing: V = v_norm(k_proj x)
        else:
            assert attn.is_sliding and attn.sliding_window < CONSTANTS["max_model_len"] // 2


def test_small_whole_model_drill_matches_transformers_token_for_token() -> None:
    report = run_model_drill(requests=4, seed=0, dtypes=("float32",))
    (run,) = report.runs
    d = run.as_dict()
    assert report.ok, report.render()
    assert run.identical == run.requests == 4 and not run.divergences and run.result.error is None
    assert all(len(s) >= 16 for s in run.result.streams.values())
    assert len(run.replays_by_size) >= 2  # replays at 2+ capture sizes
    assert d["joined_mid_run"] >= 1 and d["finished_mid_run"] >= 1
    assert {0, 1} <= set(run.result.accepted) and len(run.result.accepted) >= 3  # accepted lengths vary
    assert run.replay_tokens_per_s > 0 and run.reference_tokens_per_s > 0
    text = report.render()
    words = ("requests 4", "decode steps", "accepted draft tokens per request-step", "eager steps",
             "replays per capture size", "identical sequences: 4/4", "tokens/s: replay", "PASS")  # fmt: skip
    assert all(w in text for w in words), text


#: Small enough to serve quickly, and reaching every bug: request 0 finishes within 2 steps, so request 1
#: moves to row 0 with padded rows behind it (pad_not_cleared); request 1 runs into the block table's last
#: column (short_block_table); request 2 joins mid-run.
PLANTED = Scenario(
    (
        Request(tuple(range(3, 11)), 0, 3),
        Request(tuple(range(40, 70)), 0, 31),
        Request(tuple(range(100, 112)), 3, 10),
    ),
    draft_seed=1,
    accuracy=0.6,
)


@pytest.mark.parametrize("fault", ["scale", "stale_seq_len", "pad_not_cleared", "short_block_table"])
def test_planted_bug_fails_with_a_shrunk_replayable_scenario(fault: str, tmp_path: Path) -> None:
    saved = tmp_path / "failure.json"
    report = run_model_drill(
        dtypes=("float32",), faults=(fault,), scenario=PLANTED, save=saved, shrink_budget=3
    )
    assert not report.ok and report.failure is not None, report.render()
    doc = load_model_batch(saved)
    assert doc["faults"] == [fault]
    small = Scenario.from_dict(doc["scenario"])
    tokens = sum(r.max_new for r in small.requests)
    assert report.failure["requests"] == len(small.requests) and report.failure["tokens"] == tokens
    assert (len(small.requests), tokens) < (3, 44) or report.shrink_serves > 0  # shrunk, or tried to
    replayed = run_model_drill(replay=saved)  # the saved scenario fails again, alone
    assert not replayed.ok and replayed.runs[0].requests == len(small.requests)


def test_cli_replays_a_saved_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "scale.json"
    alone = Scenario((PLANTED.requests[1],), draft_seed=1)
    run_model_drill(dtypes=("float32",), faults=("scale",), scenario=alone, save=saved, shrink_budget=0)
    command = f"graphbuf drill gemma4-31b-it-mtp --model tiny --replay {shlex.quote(str(saved))} --json"
    assert main(shlex.split(command)[1:]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["runs"][0]["identical"] == 0
    assert out["failure"]["what"].startswith("request 0 differs from transformers at token")


def test_unknown_fault_and_bad_replay_file_are_spec_errors(tmp_path: Path) -> None:
    from graphbuf.errors import SpecError

    with pytest.raises(SpecError, match="unknown faults"):
        run_model_drill(dtypes=("float32",), faults=("typo",), scenario=PLANTED)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    with pytest.raises(SpecError, match="not a saved model-drill scenario"):
        run_model_drill(replay=bad)
