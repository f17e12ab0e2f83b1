"""Issue 12 §2 and §3: the coverage certificate (`check`, `--coverage`, `--strict`, `--json`), memory per
capture size in `plan`, and `graphbuf sizes` (proposal, bounds, `--write` keeping every other byte)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

import graphbuf
from graphbuf.cli import main
from graphbuf.errors import UsageError
from graphbuf.planning.coverage import coverage
from graphbuf.planning.sizes import propose_sizes

GEMMA = "gemma4-31b-it-mtp"


def _shipped_text() -> str:
    return graphbuf.spec.models.resolve_spec_path(GEMMA).read_text(encoding="utf-8")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _old_gemma(tmp_path: Path) -> Path:
    """The shipped spec as it was before issue 12: capture sizes up to 48 tokens (12 of 16 requests)."""
    text = _shipped_text().replace("stop: 64", "stop: 48")
    path = tmp_path / "old.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_coverage_maps_each_batch_to_its_capture_size_and_waste() -> None:
    cov = coverage([4, 16, 8], 4, max_requests=6)
    assert [(b.requests, b.tokens, b.capture_size) for b in cov.batches] == [
        (1, 4, 4), (2, 8, 8), (3, 12, 16), (4, 16, 16), (5, 20, None), (6, 24, None)
    ]  # fmt: skip
    assert cov.batches[2].waste == 0.25 and cov.max_waste == 0.25
    assert [b.requests for b in cov.uncovered] == [5, 6] and not cov.ok
    assert "5–6 requests (20–24 tokens) run EAGERLY" in cov.summary()
    # max_num_batched_tokens caps the reachable batches.
    assert [b.requests for b in coverage([4, 8], 4, max_requests=6, max_tokens=8).batches] == [1, 2]


def test_check_reports_the_shipped_spec_covers_1_to_16_requests(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "check", GEMMA, "--strict")
    assert (code, err) == (0, "")
    assert (
        out.splitlines()[1]
        == "coverage: 16/16 batch sizes of 1..16 requests replay a graph (max padding waste 0.0%)"
    )


def test_check_names_the_eager_batches_and_strict_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _old_gemma(tmp_path)
    code, out, err = _run(capsys, "check", str(path))
    assert code == 0
    assert out.splitlines()[1] == (
        "coverage: 12/16 batch sizes of 1..16 requests replay a graph; 13–16 requests (52–64 tokens) run "
        "EAGERLY (largest capture size 48)"
    )
    code, out, err = _run(capsys, "check", str(path), "--coverage")
    rows = out.splitlines()[2:]
    assert rows[0].split() == ["requests", "tokens", "capture", "size", "waste"]
    assert rows[1].split() == ["1", "4", "4", "0.0%"] and rows[-1].split() == ["16", "64", "eager", "-"]
    assert len(rows) == 17
    code, out, err = _run(capsys, "check", str(path), "--strict")
    assert code == 1
    assert f"graphbuf: check --strict: {path}: requests 13..16 run eagerly; `graphbuf sizes {path}`" in err
    code, out, err = _run(capsys, "check", str(path), "--json", "--strict")
    assert code == 1
    data = json.loads(out)
    assert data["ok"] is False and data["coverage"]["uncovered_requests"] == [13, 14, 15, 16]
    assert data["coverage"]["batches"][12] == {
        "requests": 13,
        "tokens": 52,
        "capture_size": None,
        "waste": 0.0,
    }


def test_strict_without_an_envelope_fails_and_says_why(
    spec_mapping: Callable[[], dict[str, Any]],
    write_yaml: Callable[..., Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = write_yaml(spec_mapping())
    code, _, err = _run(capsys, "check", str(path), "--strict")
    assert code == 1 and "no serving envelope declared (capture.max_requests)" in err
    d = spec_mapping()
    d["capture"]["max_requests"] = "max_num_seqs"
    code, _, err = _run(capsys, "check", str(write_yaml(d)), "--strict")
    assert code == 0, err
    d["capture"]["max_requests"] = "max_num_seqs * 0"
    code, _out, err = _run(capsys, "check", str(write_yaml(d)))
    assert code == 2 and "capture.max_requests: must be in 1..65536, got 0" in err


def test_plan_reports_memory_per_capture_size_and_totals(capsys: pytest.CaptureFixture[str]) -> None:
    p = graphbuf.plan(GEMMA, overrides={"num_blocks": 100})
    m = p.memory_at(64)
    bt = 16 * 43 * 4
    assert m.buffer_bytes == 2 * bt + 16 * 4 + 17 * 4 + 2 * 64 * 8
    assert m.staging_bytes == 2 * p.total_bytes
    # issue 33 §3: only the route the task options select (blockwise verify) counts; dense is shown apart
    assert m.workspace_bytes == 2 * 16 * 2 * 2 * 128 * 512 * 2
    assert m.unselected_workspace_bytes == 2 * 16 * 2 * 43 * 128 * 512 * 2
    totals = p.memory_totals()
    assert totals["workspace_peak_bytes"] == m.workspace_bytes
    assert totals["workspace_sum_bytes"] == sum(p.memory_at(s).workspace_bytes for s in p.capture_sizes)
    assert totals["unselected_workspace_peak_bytes"] == m.unselected_workspace_bytes
    code, out, _ = _run(capsys, "plan", GEMMA)
    assert code == 0 and "memory per capture size" in out and "totals: device slab 8.0 KiB" in out
    assert "task workspaces 16.0 MiB peak (graphs sharing one memory pool), 136.0 MiB summed" in out
    assert "not counted (routes the task options do not select): verify_kv_dense, 344.0 MiB peak" in out
    assert "verify_kv_dense (not selected)" in out and "verify_kv_blockwise (not selected)" not in out
    _code, out, _ = _run(capsys, "plan", GEMMA, "--json")
    data = json.loads(out)
    assert data["sizes"]["64"]["memory"]["workspaces"] == m.workspace_bytes
    assert data["memory_totals"] == totals


def test_propose_sizes_is_the_fewest_within_the_waste_bound() -> None:
    assert propose_sizes(4, 16, max_waste_pct=0).sizes == tuple(range(4, 65, 4))
    p = propose_sizes(4, 16, max_waste_pct=10)
    assert p.sizes == (4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64)
    assert p.coverage.ok and p.max_waste <= 0.10
    # Exhaustive check on small envelopes: no list with fewer sizes meets the bound.
    import itertools

    for tpr, top, pct in ((1, 9, 25), (2, 7, 40), (3, 8, 15)):
        best = propose_sizes(tpr, top, max_waste_pct=pct)
        candidates = [r * tpr for r in range(1, top)]
        for k in range(1, len(best.sizes)):
            for combo in itertools.combinations(candidates, k - 1):
                cov = coverage([*combo, top * tpr], tpr, top)
                assert not (cov.ok and cov.max_waste <= pct / 100), (tpr, top, combo)
    # issue 19 §5: a graph budget that cannot meet the waste bound (10 % by default) says so, unless forced
    over = (
        r"--max-waste 10 \(the default\) needs 12 graphs, above --max-graphs 4; 4 graphs need --max-waste 50"
    )
    with pytest.raises(UsageError, match=over + ".*--force"):
        propose_sizes(4, 16, max_graphs=4)
    g = propose_sizes(4, 16, max_graphs=4, force=True)
    assert len(g.sizes) <= 4 and g.coverage.ok and g.sizes[-1] == 64
    assert g.max_waste == pytest.approx(0.5)
    roomy = propose_sizes(4, 16, max_graphs=14)  # a budget that fits spends its graphs on less waste
    assert len(roomy.sizes) <= 14 and roomy.max_waste < 0.1 and roomy.coverage.ok
    with pytest.raises(UsageError, match="needs 16 graphs, above --max-graphs 4"):
        propose_sizes(4, 16, max_waste_pct=0, max_graphs=4)
    assert propose_sizes(4, 16, max_waste_pct=0, max_graphs=4, force=True).sizes == g.sizes
    with pytest.raises(UsageError, match=r"--max-waste 100: must be in \[0, 100\)"):
        propose_sizes(4, 16, max_waste_pct=100)


def test_sizes_prints_yaml_and_write_edits_only_the_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _old_gemma(tmp_path)
    before = path.read_text(encoding="utf-8")
    code, out, err = _run(capsys, "sizes", str(path), "--max-waste", "0")
    assert code == 0, err
    printed = yaml.safe_load(out)
    assert printed == {"capture": {"sizes": list(range(4, 65, 4))}}
    assert path.read_text(encoding="utf-8") == before  # no --write: untouched
    code, out, err = _run(capsys, "sizes", str(path), "--max-waste", "10", "--write")
    assert code == 0, err
    after = path.read_text(encoding="utf-8")
    old_value = "{start: 4, stop: 48, step: 4}"
    new_value = "[4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64]"
    assert after == before.replace(old_value, new_value)  # every other byte, comments included, kept
    assert "# Every uniform decode batch" in after and "# serving envelope" in after
    old, new = yaml.safe_load(before), yaml.safe_load(after)
    assert new["capture"].pop("sizes") == yaml.safe_load(new_value)
    old["capture"].pop("sizes")
    assert old == new
    code, out, err = _run(capsys, "check", str(path), "--strict")
    assert code == 0, err


def test_sizes_write_keeps_block_style_neighbours_and_comments(
    spec_mapping: Callable[[], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = spec_mapping()
    d["capture"] = {"tokens_per_request": 2, "sizes": [2], "max_requests": "max_num_seqs"}
    text = yaml.safe_dump(d, sort_keys=False)
    text = text.replace("  sizes:\n  - 2\n", "  sizes:   # graphs\n  - 2   # one\n  # kept comment\n")
    assert "# kept comment" in text
    path = tmp_path / "block.yaml"
    path.write_text(text, encoding="utf-8")
    assert main(["check", str(path), "--strict"]) == 1
    assert main(["sizes", str(path), "--max-waste", "0", "--write"]) == 0
    after = path.read_text(encoding="utf-8")
    # issue 19 §5: the block stays a block, and no comment is glued onto another's line
    assert after == text.replace(
        "  sizes:   # graphs\n  - 2   # one\n", "  sizes:   # graphs\n  # one\n  - 2\n  - 4\n  - 6\n  - 8\n"
    )
    assert main(["check", str(path), "--strict"]) == 0
    capsys.readouterr()


def test_sizes_needs_an_envelope(
    spec_mapping: Callable[[], dict[str, Any]],
    write_yaml: Callable[..., Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = _run(capsys, "sizes", str(write_yaml(spec_mapping())))
    assert code == 2 and "capture.max_requests: not declared" in err
    code, _out, err = _run(capsys, "sizes", GEMMA, "--write")  # never edits the installed shipped spec
    assert code == 2 and "--write edits a spec file; give its path" in err


def test_sizes_max_graphs_over_the_waste_bound_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 19 §5: `sizes --max-graphs N` that cannot meet --max-waste (10 by default) exits 2 with the
    reason on stderr and writes nothing, unless --force."""
    path = _old_gemma(tmp_path)
    before = path.read_bytes()
    code, out, err = _run(capsys, "sizes", str(path), "--max-graphs", "2", "--write")
    assert code == 2 and out == ""
    assert "--max-waste 10 (the default) needs 12 graphs, above --max-graphs 2" in err and "--force" in err
    code, out, err = _run(capsys, "sizes", str(path), "--max-graphs", "2", "--max-waste", "20", "--write")
    assert code == 2 and "--max-waste 20 needs" in err
    assert path.read_bytes() == before
    code, out, err = _run(capsys, "sizes", str(path), "--max-graphs", "2", "--force", "--write")
    assert code == 0, err
    assert "# 2 capture sizes; max padding waste" in out and f"wrote {path}" in out
