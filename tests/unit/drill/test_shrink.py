"""``graphbuf drill`` draws through ``graphbuf.testing`` and shrinks: a planted bug (a task reading one row
past the live batch) is found and shrunk to at most 2 requests, saved as JSON, replayed from the printed
command; ``--seed`` reproduces a run (the padding contract's tests: ``test_padding_contract.py``)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from planted_files import ALLOW, planted

from graphbuf.cli import main
from graphbuf.drill.session import load_batch, run_drill


def test_planted_bug_is_found_and_shrunk_to_at_most_2_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec, saved = planted(tmp_path, "reads_one_past"), tmp_path / "failure.json"
    code = main(["drill", str(spec), "--replays", "40", "--seed", "5", "--allow-factory", "planted_tasks",
                 "--save", str(saved)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1 and "FAIL" in out
    batch = load_batch(saved)
    assert batch["num_reqs"] <= 2 and batch["size"] == 4  # 2 requests padded to the 4-request graph
    assert batch["max_abs_error"] > 0 and batch["error"] is None
    assert len(batch["sources"]["lens"]["data"]) == batch["num_reqs"]
    assert f"smallest failing batch: {batch['num_reqs']} requests (capture size 4)" in out
    command = next(line for line in out.splitlines() if line.startswith("replay it: "))
    argv = shlex.split(command.removeprefix("replay it: "))
    assert argv[:2] == ["graphbuf", "drill"] and argv[3:5] == ["--replay", str(saved)]

    assert main(argv[1:]) == 1  # the printed command replays exactly that batch, and it still fails
    replayed = capsys.readouterr().out
    assert f"smallest failing batch: {batch['num_reqs']} requests (capture size 4)" in replayed
    assert "replays" in replayed and "shrunk" not in replayed


def test_replay_json_reports_the_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec, saved = planted(tmp_path, "reads_one_past"), tmp_path / "f.json"
    assert main(["drill", str(spec), "--replays", "20", "--allow-factory", "planted_tasks", "--save",
                 str(saved), "--json"]) == 1  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["failure"]["num_reqs"] <= 2
    assert report["failure"]["replay_command"].endswith(f"--replay {saved} --allow-factory planted_tasks")
    assert report["failure"]["saved"] == str(saved)


def test_a_correct_task_passes_and_leaves_no_file(tmp_path: Path) -> None:
    spec = planted(tmp_path, "depends_on_scale_pad")  # reads past the live rows of scale, but sums only
    report = run_drill(str(spec), replays=20, allow_factories=ALLOW, save=tmp_path / "never.json")
    # The raw batch has no padded rows, the replay has pad 0 there: sums agree, so the drill passes.
    assert report.ok, report.render()
    assert report.failure is None and not (tmp_path / "never.json").exists()


def test_seed_makes_runs_reproducible(tmp_path: Path) -> None:
    spec = planted(tmp_path, "reads_one_past")
    runs = [run_drill(str(spec), replays=25, seed=s, allow_factories=ALLOW, save=tmp_path / f"{i}.json")
            for i, s in enumerate((3, 3))]  # fmt: skip
    assert (tmp_path / "0.json").read_text() == (tmp_path / "1.json").read_text()
    assert 0 < runs[0].shrink_replays <= 50  # shrinking is bounded by max(--replays, 50)
    a, b = (r.as_dict() for r in runs)
    for r in (a, b):
        r.pop("seconds")
        r.pop("runner")
        r.pop("phases")  # seconds
        r["failure"].pop("saved")
        for row in r["sizes"]:
            row.pop("refresh_us_median")
    assert a == b


def test_replay_of_a_file_that_is_not_a_batch_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec, bogus = planted(tmp_path, "reads_one_past"), tmp_path / "bogus.json"
    bogus.write_text('{"format": "something else"}')
    assert main(["drill", str(spec), "--replay", str(bogus), "--allow-factory", "planted_tasks"]) == 2
    assert "not a saved drill batch" in capsys.readouterr().err
    bogus.write_text('{"format": "graphbuf-drill-batch/1", "spec": "other", "seed": 0, "overrides": {}, '
                     '"device": "cpu", "sources": {}}')  # fmt: skip
    assert main(["drill", str(spec), "--replay", str(bogus), "--allow-factory", "planted_tasks"]) == 2
    assert "saved from spec 'other', not 'planted'" in capsys.readouterr().err
    bogus.write_text('{"format": "graphbuf-drill-batch/1", "spec": "planted", "seed": 0, "overrides": {}, '
                     '"device": "cpu", "sources": {"lens": {"dtype": "int32"}}}')  # fmt: skip
    assert main(["drill", str(spec), "--replay", str(bogus), "--allow-factory", "planted_tasks"]) == 2
    assert "malformed saved drill batch" in capsys.readouterr().err


def test_save_into_a_missing_directory_is_refused_before_any_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A failing drill would otherwise run to the end and then lose its shrunk batch to an OSError."""
    spec, target = planted(tmp_path, "reads_one_past"), tmp_path / "missing" / "failure.json"
    argv = ["drill", str(spec), "--replays", "40", "--allow-factory", "planted_tasks", "--save", str(target)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--save {target}: no such directory" in err
    assert "replays" not in err and not target.parent.exists()
