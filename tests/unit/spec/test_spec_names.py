"""Spec names (issue 35 §4, §5): a shipped spec is named only by its bare name, never reached through a path;
a path the OS refuses is a labelled SpecError (CLI exit 2), not an OSError."""

from __future__ import annotations

from pathlib import Path

import pytest

from graphbuf.cli import main
from graphbuf.errors import SpecError
from graphbuf.spec.models import load_spec, resolve_spec_path, shipped_specs

SHIPPED = "gemma4-tiny-model"


def test_nonexistent_path_ending_in_a_shipped_name_does_not_load_it(tmp_path: Path) -> None:
    for path in (
        tmp_path / "nowhere" / f"{SHIPPED}.yaml",
        str(tmp_path / f"{SHIPPED}.yaml"),
        f"./{SHIPPED}.yaml",
        f"sub/{SHIPPED}",
    ):
        with pytest.raises(SpecError, match=rf"a path never names a shipped spec.*{SHIPPED}"):
            load_spec(path)


def test_bare_shipped_names_still_resolve() -> None:
    assert resolve_spec_path(SHIPPED) == shipped_specs()[SHIPPED]
    assert resolve_spec_path(f"{SHIPPED}.yaml") == shipped_specs()[SHIPPED]
    assert resolve_spec_path(Path(SHIPPED)) == shipped_specs()[SHIPPED]


def test_an_existing_file_named_like_a_shipped_spec_is_that_file(tmp_path: Path) -> None:
    own = tmp_path / f"{SHIPPED}.yaml"
    own.write_text(shipped_specs()[SHIPPED].read_text(encoding="utf-8"), encoding="utf-8")
    assert resolve_spec_path(own) == own


def test_spec_path_over_the_os_name_limit_is_a_spec_error() -> None:
    name = "a" * 300 + ".yaml"
    with pytest.raises(SpecError, match=r"cannot be used as a spec path: File name too long"):
        resolve_spec_path(name)


def test_cli_spec_path_over_the_os_name_limit_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "a" * 300 + ".yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphbuf: usage error:")  # SPEC names no usable file: the README's usage error
    assert "File name too long" in err and "Traceback" not in err
