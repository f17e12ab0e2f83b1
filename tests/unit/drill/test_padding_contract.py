"""``graphbuf drill --padding-contract`` (``graphbuf/drill/padding_contract.py``): which pads the tasks
depend on, found by writing junk into each buffer's padding; a fault counts as required."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from planted_files import ALLOW, planted

from graphbuf.cli import main
from graphbuf.drill.padding_contract import run_padding_contract


def test_padding_contract_tells_a_required_pad_from_a_free_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = planted(tmp_path, "depends_on_scale_pad")
    contract = run_padding_contract(str(spec), allow_factories=ALLOW)
    assert contract.mode == "replay" and contract.size == 4  # junk replayed through the captured graph
    verdicts = {v.buffer: v for v in contract.verdicts}
    assert verdicts["scale"].verdict == "required" and verdicts["scale"].trials > 0
    assert "live outputs changed" in verdicts["scale"].reason
    assert verdicts["lens"].verdict == "free" and verdicts["table"].verdict == "free"  # rows and columns
    assert main(["drill", str(spec), "--padding-contract", "--allow-factory", "planted_tasks"]) == 0
    table = capsys.readouterr().out
    assert any(line.split()[:3] == ["scale", "0", "required"] for line in table.splitlines())
    assert any(line.split()[:3] == ["lens", "7", "free"] for line in table.splitlines())
    assert main(["drill", str(spec), "--padding-contract", "--json", "--allow-factory", "planted_tasks"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["required"] == ["scale"] and doc["free"] == ["lens", "table"]
    assert {b["buffer"]: b["verdict"] for b in doc["buffers"]} == {
        "lens": "free",
        "scale": "required",
        "table": "free",
    }


def test_padding_contract_counts_a_fault_as_required(tmp_path: Path) -> None:
    spec = planted(tmp_path, "faults_on_junk_table")
    contract = run_padding_contract(str(spec), allow_factories=ALLOW)
    assert contract.mode.startswith("eager on the captured views (capture failed")  # it reads on the host
    verdicts = {v.buffer: v for v in contract.verdicts}
    assert verdicts["table"].verdict == "required" and "raised RuntimeError" in verdicts["table"].reason
    assert verdicts["lens"].verdict == "free"


def test_padding_contract_finds_the_read_past_the_batch(tmp_path: Path) -> None:
    spec = planted(tmp_path, "reads_one_past")  # its last live request reads the first padded row of lens
    verdicts = {v.buffer: v.verdict for v in run_padding_contract(str(spec), allow_factories=ALLOW).verdicts}
    assert verdicts == {"lens": "required", "scale": "free", "table": "free"}
