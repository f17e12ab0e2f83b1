"""Issue 21 §2: constants resolve in time linear in their number, in any order; a cycle of any length is named
with every member; a huge literal names ``constants.<name>``.

No timing assertions: the figures (a 20,000-long chain, either order) are printed by
``bench/bench_constants.py``; here the chains resolve, and to the right values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from graphbuf.cli import main
from graphbuf.errors import SpecError
from graphbuf.spec.models import GraphSpec, load_spec


def _doc(constants: dict[str, Any]) -> dict[str, Any]:
    return {
        "version": 1,
        "name": "chain",
        "constants": constants,
        "capture": {"sizes": [1]},
        "buffers": {"a": {"dtype": "int32", "rows": "tokens"}},
    }


def _chain(n: int, reverse: bool) -> dict[str, Any]:
    """c0 = 1, c{i} = c{i-1} + 1, declared in dependency order or its reverse."""
    items = [("c0", 1), *((f"c{i}", f"c{i - 1} + 1") for i in range(1, n))]
    return dict(reversed(items) if reverse else items)


@pytest.mark.parametrize("reverse", [False, True], ids=["dependency-order", "reverse-order"])
@pytest.mark.parametrize("n", [500, 5000])
def test_a_long_chain_resolves_in_either_order(n: int, reverse: bool) -> None:
    spec = GraphSpec.model_validate(_doc(_chain(n, reverse)))
    values = spec.constants_with()
    assert values[f"c{n - 1}"] == n
    assert list(values) == list(spec.constants)  # declaration order kept
    assert all(values[f"c{i}"] == i + 1 for i in range(n))


def test_a_long_reverse_chain_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    path = tmp_path / "chain.yaml"
    path.write_text(yaml.safe_dump(_doc(_chain(2000, True)), sort_keys=False), encoding="utf-8")
    assert main(["check", str(path)]) == 0, capsys.readouterr().err


def test_a_null_in_the_chain_unsets_everything_above_it() -> None:
    constants = _chain(600, True)
    constants["c0"] = None
    values = GraphSpec.model_validate(_doc(constants)).constants_with()
    assert all(v is None for v in values.values())
    values = GraphSpec.model_validate(_doc(constants)).constants_with({"c0": 5})
    assert values["c599"] == 604


@pytest.mark.parametrize("n", [1, 2, 3, 500, 5000])
def test_a_cycle_of_any_length_is_named_with_every_member(n: int) -> None:
    constants: dict[str, Any] = {f"k{i}": f"k{(i + 1) % n} + 1" for i in range(n)}
    constants["free"] = 3
    with pytest.raises(SpecError) as info:
        GraphSpec.model_validate(_doc(constants))
    msg = str(info.value)
    members = " -> ".join([*(f"k{i}" for i in range(n)), "k0"])
    assert f"constants.k0: dependency cycle: {members} ({n} constants)" in msg
    assert "too deep" not in msg


def test_a_cycle_behind_a_chain_lists_only_its_members() -> None:
    constants: dict[str, Any] = {"top": "a + 1", "a": "b", "b": "c", "c": "d", "d": "b * 2"}
    with pytest.raises(SpecError, match=r"constants\.b: dependency cycle: b -> c -> d -> b \(3 constants\)$"):
        GraphSpec.model_validate(_doc(constants))


@pytest.mark.parametrize("digits", [20, 4300, 5000, 100_000])
def test_a_huge_constant_literal_names_its_constant(tmp_path: Path, digits: int) -> None:
    path = tmp_path / "huge.yaml"
    path.write_text(
        "version: 1\nname: huge\nconstants:\n  small: 4\n  big: " + "9" * digits + "\n"
        "capture: {sizes: [1]}\nbuffers: {a: {dtype: int32, rows: tokens}}\n",
        encoding="utf-8",
    )
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert f"{path}: constants.big:" in str(info.value)
    assert len(str(info.value)) < 400


def test_a_huge_literal_elsewhere_names_its_path(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    path.write_text(
        "version: 1\nname: huge\ncapture: {sizes: [1, 2, " + "7" * 5000 + "]}\n"
        "buffers: {a: {dtype: int32, rows: tokens}}\n",
        encoding="utf-8",
    )
    with pytest.raises(SpecError, match=r"capture\.sizes\[2\]: integer literal of 5000 digits; at most 19"):
        load_spec(path)
