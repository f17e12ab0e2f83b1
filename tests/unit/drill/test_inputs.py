"""``graphbuf drill``'s inputs from users: hostile ``--replay`` files (deep nesting, huge seeds, counts and
data), a ``--set`` that would make the drill's KV caches huge, problems that are usage errors (not spec
errors), and what it reports back: the progress line with an ETA and the seconds per phase."""

from __future__ import annotations

import copy
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from planted_tasks import PLANTED_SPEC

from graphbuf.cli import main
from graphbuf.drill.session import PHASES, REPLAYS_ENV, Progress, default_replays, run_drill
from graphbuf.errors import BatchFileError, PlanTooLargeError, UsageError

ALLOW = ("planted_tasks",)


def _spec(tmp_path: Path, factory: str = "depends_on_scale_pad") -> Path:  # passes the drill
    doc: dict[str, Any] = copy.deepcopy(PLANTED_SPEC)
    doc["tasks"] = [{"name": "planted", "factory": f"planted_tasks:{factory}"}]
    path = tmp_path / "planted.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _batch(**changes: Any) -> dict[str, Any]:
    doc = {
        "format": "graphbuf-drill-batch/1", "spec": "planted", "seed": 0, "overrides": {}, "device": "cpu",
        "num_reqs": 1, "size": 4, "task_seed": 0,
        "sources": {"lens": {"dtype": "int32", "shape": [1], "data": [3]},
                    "scale": {"dtype": "int32", "shape": [1], "data": [2]},
                    "table": {"dtype": "int32", "shape": [1, 3], "data": [1, 0, 0]}},
    }  # fmt: skip
    doc.update(changes)
    if "sources" in changes:
        doc["sources"] = {**_batch()["sources"], **changes["sources"]}
    return doc


def _replay(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    spec, saved = _spec(tmp_path), tmp_path / "batch.json"
    saved.write_text(text)
    code = main(["drill", str(spec), "--replay", str(saved), "--allow-factory", "planted_tasks"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deep"),
        ('{"a": ' * 100_000 + "1" + "}" * 100_000, "nested too deep"),
        (json.dumps(_batch(seed=2**80)), "seed 1208925819614629174706176: must be an integer"),
        (json.dumps(_batch(task_seed=2**80)), "task_seed: 1208925819614629174706176 is not an integer"),
        (json.dumps(_batch()).replace('"num_reqs": 1', '"num_reqs": 1e400'), "1e400 is out of the float64"),
        (json.dumps(_batch(num_reqs=10**30)), "num_reqs: 1" + "0" * 30 + " is not an integer"),
        (json.dumps(_batch(sources={"lens": {"dtype": "int32", "shape": [1], "data": [2**63]}})),
         "lens.data[0]: 9223372036854775808 is not an integer in [-2147483648, 2147483647]"),
        (json.dumps(_batch(sources={"lens": {"dtype": "int32", "shape": [1], "data": [1.5]}})),
         "sources.lens.data[0]: 1.5 is not an integer"),
        (json.dumps(_batch(sources={"lens": {"dtype": "int32", "shape": [2**40], "data": [1]}})),
         "lens.shape[0]: 1099511627776 is not an integer in [0, 2147483647]"),
        (json.dumps(_batch()).replace('"seed": 0', '"seed": NaN'), "NaN is not a number a saved batch"),
        (json.dumps(_batch(overrides={"n": 2**80})), "overrides.n: 1208925819614629174706176 is not"),
        ('{"format": "graphbuf-drill-batch/1", "seed": ' + "9" * 5000 + "}", "cannot read a saved"),
    ],
    ids=["deep-list", "deep-object", "seed-2**80", "task-seed-2**80", "count-1e400", "count-1e30",
         "data-2**63", "data-float", "shape-huge", "nan", "override-2**80", "digits-5000"],
)  # fmt: skip
def test_hostile_replay_files_are_usage_errors_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, fragment: str
) -> None:
    code, err = _replay(tmp_path, text, capsys)
    assert code == 2, err
    assert err.startswith("graphbuf: usage error: ") and fragment in err, err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_a_valid_replay_file_still_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _replay(tmp_path, json.dumps(_batch()), capsys)
    assert code == 0, err


def test_bad_overrides_in_a_replay_file_are_blamed_on_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _replay(tmp_path, json.dumps(_batch(overrides={"num_blockz": 3})), capsys)
    assert code == 2
    assert err.startswith(f"graphbuf: usage error: {tmp_path / 'batch.json'}: overrides "), err
    assert "num_blockz" in err and "spec error" not in err
    with pytest.raises(BatchFileError, match=r"batch\.json: overrides"):
        run_drill(str(_spec(tmp_path)), replay=tmp_path / "batch.json", allow_factories=ALLOW)


def test_a_spec_error_under_a_replay_file_stays_the_spec_s(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec, saved = _spec(tmp_path), tmp_path / "batch.json"
    saved.write_text(json.dumps(_batch(overrides={"max_lens": 4})))
    argv = ["drill", str(spec), "--replay", str(saved), "--allow-factory", "planted_tasks", "--set", "nope=1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphbuf: spec error:") and "nope" in err, err


def test_drill_kv_caches_are_bounded_by_limits_max_bytes_before_any_allocation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 10**12 blocks of 128 x 2 x 512 bf16 per K and V cache: torch would be asked for ~2.6e17 bytes.
    assert main(["drill", "gemma4-31b-it-mtp", "--set", "num_blocks=1000000000000", "--replays", "1"]) == 2
    err = capsys.readouterr().err
    assert "limits.max_bytes" in err and "num_blocks=1000000000000" in err, err
    with pytest.raises(PlanTooLargeError, match="the drill's tasks would allocate"):
        run_drill("gemma4-31b-it-mtp", overrides={"num_blocks": 10**12}, replays=1)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["drill", "{spec}", "--replays", "-1"], "--replays -1: must be ≥ 0"),
        (["drill", "{spec}", "--seed", str(2**80)], "--seed 1208925819614629174706176: must be an integer"),
        (["drill", "{spec}", "--replay", "{dir}/absent.json"], "absent.json: no such file"),
        (["drill", "{spec}", "--save", "{dir}/no/such/dir/f.json"], "no such directory"),
        (["sizes", "gemma4-31b-it-mtp", "--write"], "--write edits a spec file"),
    ],
    ids=["replays-negative", "seed-huge", "replay-missing", "save-dir-missing", "write-shipped-spec"],
)
def test_problems_that_are_not_spec_errors_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    spec = _spec(tmp_path)
    argv = [a.replace("{spec}", str(spec)).replace("{dir}", str(tmp_path)) for a in argv]
    assert main([*argv, "--allow-factory", "planted_tasks"] if argv[0] == "drill" else argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphbuf: usage error: ") and fragment in err, err


def test_a_missing_dependency_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m == "graphbuf.drill.session" or m == "graphbuf.testing"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # as if it were not installed
    assert main(["drill", str(_spec(tmp_path)), "--allow-factory", "planted_tasks"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphbuf: usage error: missing dependency: the module 'hypothesis'"), err


def test_replays_default_comes_from_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(REPLAYS_ENV, raising=False)
    assert default_replays() == 60
    monkeypatch.setenv(REPLAYS_ENV, "3")
    assert main(["drill", str(_spec(tmp_path)), "--allow-factory", "planted_tasks", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sum(s["replays"] for s in report["sizes"]) + report["eager"]["runs"] == 3
    monkeypatch.setenv(REPLAYS_ENV, "lots")
    with pytest.raises(UsageError, match=f"{REPLAYS_ENV}='lots': must be an integer"):
        default_replays()


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_one_line_with_an_eta() -> None:
    stream = _Tty()
    progress = Progress(stream)
    progress("capture", 0, 4)
    for i in range(1, 5):
        progress("capture", i, 4)
    progress.last = 0.0  # past the redraw interval
    progress("replay", 0, 60)
    progress("replay", 1, 60)
    progress.last = 0.0
    progress("replay", 30, 60)
    progress("replay", 60, 60)
    progress.close()
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, rewritten with carriage returns
    assert "\rdrill: 30/60 replays, ETA " in text and "\rdrill: 4/4 sizes captured in " in text
    assert "\rdrill: 60/60 replays in " in text


def test_progress_off_a_terminal_is_plain_lines() -> None:
    stream = io.StringIO()
    progress = Progress(stream)
    progress("replay", 0, 40)
    for i in range(1, 41):
        progress("replay", i, 40)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines[0].startswith("drill: 1/40 replays, ETA ")
    assert lines[-1].startswith("drill: 40/40 replays in ")
    assert len(lines) <= 3  # throttled: not one line per replay


def test_report_gives_the_seconds_of_each_phase(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_drill(str(_spec(tmp_path)), replays=6, allow_factories=ALLOW, import_seconds=0.5)
    assert tuple(report.phases) == PHASES
    assert all(v >= 0 for v in report.phases.values())
    assert report.phases["import"] == 0.5
    assert min(report.phases[k] for k in ("capture", "replay", "eager_reference")) > 0
    assert sum(report.phases.values()) == pytest.approx(report.seconds, rel=1e-6)
    assert set(report.as_dict()["phases"]) == set(PHASES)
    rendered = report.render()
    assert "seconds per phase: import 0.5, capture " in rendered and "eager reference" in rendered
    assert main(["drill", str(_spec(tmp_path)), "--allow-factory", "planted_tasks", "--replays", "2",
                 "--json"]) == 0  # fmt: skip
    phases = json.loads(capsys.readouterr().out)["phases"]
    assert phases["import"] >= 0 and set(phases) == set(PHASES)


def test_drill_and_padding_contract_import_each_other_one_way_only() -> None:
    """Issue 19: no import cycle, not even inside a function: padding_contract uses the drill's session; the
    drill (and its CLI handler) never imports padding_contract (graphbuf.cli dispatches to each)."""
    import ast

    import graphbuf.drill.session

    tree = ast.parse(Path(graphbuf.drill.session.__file__).read_text(encoding="utf-8"))
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert not {m for m in imported if m and "padding_contract" in m}, imported
