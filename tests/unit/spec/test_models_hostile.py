"""Issue 12 §1 and §4: constants in any order, and a parser that never crashes on a hostile spec.

Every malformed spec is a SpecError (exit 2 from the CLI) naming the file and the field and showing the value;
the Hypothesis tests feed generated spec mappings and YAML texts and accept nothing else escaping.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphbuf
from graphbuf.cli import main
from graphbuf.errors import GraphbufError, SpecError
from graphbuf.spec.models import GraphSpec, load_spec
from graphbuf.testing import examples

GEMMA = "gemma4-31b-it-mtp"


def _load_text(tmp_path: Path, text: str) -> GraphSpec:
    path = tmp_path / "hostile.yaml"
    path.write_text(text, encoding="utf-8")
    return load_spec(path)


def _error(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hostile.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    msg = str(info.value)
    for line in msg.splitlines():
        assert line.startswith(f"{path}: "), line
    return msg


# ---------------------------------------------------------------------------------------------------- §1


def test_a_spec_dumped_with_sorted_keys_means_what_it_meant(tmp_path: Path) -> None:
    shipped = yaml.safe_load(graphbuf.spec.models.resolve_spec_path(GEMMA).read_text(encoding="utf-8"))
    path = tmp_path / "sorted.yaml"
    path.write_text(yaml.safe_dump(shipped), encoding="utf-8")  # sort_keys=True: constants reordered
    before = graphbuf.plan(GEMMA, overrides={"num_blocks": 100})
    after = graphbuf.plan(str(path), overrides={"num_blocks": 100})
    assert list(before.spec.constants) != list(after.spec.constants)  # the order really changed
    assert dict(before.constants) == dict(after.constants)
    a, b = before.to_dict(), after.to_dict()
    # Same buffers, shapes, bounds and totals; only the slab layout follows the (now sorted) buffer order.
    by_name = lambda d: {x["name"]: {k: v for k, v in x.items() if k != "offset"} for x in d["buffers"]}  # noqa: E731
    assert by_name(a) == by_name(b)
    for key in ("constants", "capture_sizes", "tokens_per_request", "total_bytes", "memory_totals"):
        assert a[key] == b[key], key


def test_constants_resolve_by_dependency_and_overrides_flow_to_dependents(
    spec_mapping: Callable[[], dict[str, Any]],
) -> None:
    d = spec_mapping()
    d["constants"] = {"z": "y * 2", "y": "x + 1", **d["constants"], "x": 3}
    spec = GraphSpec.model_validate(d)
    assert spec.constants_with()["z"] == 8
    assert spec.constants_with({"x": 10})["z"] == 22
    assert list(spec.constants_with()) == list(d["constants"])  # declaration order kept


def test_a_constant_cycle_names_the_cycle(spec_mapping: Callable[[], dict[str, Any]]) -> None:
    d = spec_mapping()
    d["constants"].update(a="b + 1", b="a - 1")
    with pytest.raises(SpecError, match=r"constants\.a: dependency cycle: a -> b -> a"):
        GraphSpec.model_validate(d, source="cyc.yaml")
    d["constants"] = {**spec_mapping()["constants"], "self": "self + 1"}
    with pytest.raises(SpecError, match="dependency cycle: self -> self"):
        GraphSpec.model_validate(d)


# ---------------------------------------------------------------------------------------------------- §4


def _small_yaml(spec_mapping: Callable[[], dict[str, Any]], **constants: Any) -> str:
    d = spec_mapping()
    d["constants"].update(constants)
    return yaml.safe_dump(d, sort_keys=False)


def test_bounded_expression_depth_literal_size_and_value_magnitude(
    tmp_path: Path, spec_mapping: Callable[[], dict[str, Any]]
) -> None:
    chained = "+".join(["1"] * 500)  # 999 characters: within the length bound, beyond the depth bound
    assert "nested deeper than 64 levels" in _error(tmp_path, _small_yaml(spec_mapping, chained=chained))
    assert "longer than 1000 characters" in _error(tmp_path, _small_yaml(spec_mapping, long="1+" * 600 + "1"))
    digits = "1" * 5000
    msg = _error(tmp_path, _small_yaml(spec_mapping).replace("max_model_len: 64", f"max_model_len: {digits}"))
    assert "invalid YAML value" in msg or "max_model_len" in msg
    assert "has 30 digits; at most 19" in _error(tmp_path, _small_yaml(spec_mapping, big="1" * 30 + " + 1"))
    # A product of huge constants overflows in evaluation, and its error formats.
    msg = _error(tmp_path, _small_yaml(spec_mapping, h=2**62, h2="h * h * h"))
    assert "constants.h2: 'h * h * h' overflows" in msg
    # 26 constants, each squaring the last: refused at once instead of never finishing.
    squares = {"s0": 3, **{f"s{i}": f"s{i - 1} * s{i - 1}" for i in range(1, 26)}}
    assert "overflows" in _error(tmp_path, _small_yaml(spec_mapping, **squares))
    # A constant beyond int64 (valid YAML) is refused by the model, showing the value.
    assert "less than or equal to 9223372036854775807" in _error(
        tmp_path, _small_yaml(spec_mapping, big=2**70)
    )


def test_merge_keys_are_accepted_and_complex_keys_refused(tmp_path: Path) -> None:
    text = graphbuf.spec.models.resolve_spec_path(GEMMA).read_text(encoding="utf-8")
    merged = text.replace(
        "  seq_lens:\n    dtype: int32\n    rows: requests\n    pad: 0\n",
        "  seq_lens: &lens\n    dtype: int32\n    rows: requests\n    pad: 0\n",
    ).replace(
        "  query_start_loc:\n    dtype: int32\n    rows: requests + 1\n    pad: repeat_last\n    min: 0\n",
        "  query_start_loc:\n    <<: *lens\n    rows: requests + 1\n    pad: repeat_last\n",
    )
    assert "<<: *lens" in merged
    spec = _load_text(tmp_path, merged)
    assert spec.buffers["query_start_loc"].rows == "requests + 1"  # own key wins over the merged one
    assert spec.buffers["query_start_loc"].max == "max_num_batched_tokens"
    assert spec.buffers["query_start_loc"].min == 0  # from the merge
    msg = _error(tmp_path, "? [a, b]\n: 1\nversion: 1\n")
    assert "complex keys are not allowed" in msg
    msg = _error(tmp_path, "version: 1\nconstants:\n  ? {a: 1}\n  : 2\n")
    assert "complex keys are not allowed" in msg


@pytest.mark.parametrize(
    ("path", "value", "fragment"),
    [
        (("buffers", "seq_lens", "pad"), True, "buffers.seq_lens.pad"),
        (("buffers", "seq_lens", "rows"), True, "buffers.seq_lens.rows"),
        (("buffers", "block_table", "cols"), False, "buffers.block_table.cols"),
        (("capture", "sizes"), [2, True, 8], "capture.sizes[1]"),
        (("capture", "sizes"), {"start": True, "stop": 8}, "capture.sizes.start"),
        (("capture", "tokens_per_request"), True, "capture.tokens_per_request"),
        (("buffers", "seq_lens", "max"), True, "buffers.seq_lens.max"),
        (("limits", "max_bytes"), True, "limits.max_bytes"),
        (("workspaces",), {"w": {"dtype": "int8", "shape": [True]}}, "workspaces.w.shape[0]"),
    ],
)
def test_a_bool_is_never_a_number(
    spec_mapping: Callable[[], dict[str, Any]], path: tuple[str, ...], value: Any, fragment: str
) -> None:
    d = spec_mapping()
    node = d
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    with pytest.raises(SpecError) as info:
        GraphSpec.model_validate(d, source="b.yaml")
    assert f"b.yaml: {fragment}" in str(info.value)
    msg = str(info.value)
    assert any(f in msg for f in ("got True", "got False", "got [", "True is a bool")), msg


def test_a_bool_pad_is_allowed_for_a_bool_buffer_only(spec_mapping: Callable[[], dict[str, Any]]) -> None:
    d = spec_mapping()
    d["buffers"]["flag"] = {"dtype": "bool", "rows": "requests", "pad": False}
    assert graphbuf.plan(GraphSpec.model_validate(d))["flag"].pad is False
    d["buffers"]["flag"]["dtype"] = "int8"
    with pytest.raises(SpecError, match=r"buffers\.flag\.pad: False is a bool; a int8 buffer needs a number"):
        GraphSpec.model_validate(d)


def test_list_sizes_are_capped_like_the_range(spec_mapping: Callable[[], dict[str, Any]]) -> None:
    d = spec_mapping()
    d["capture"]["sizes"] = list(range(2, 2 * 5000 + 1, 2))
    d["constants"].update(max_num_seqs=10**6, max_num_batched_tokens=10**7)
    with pytest.raises(SpecError, match=r"capture\.sizes: 5000 sizes; at most 4096"):
        GraphSpec.model_validate(d)


@pytest.mark.parametrize(
    ("field", "rule", "fragment"),
    [
        ("rows", "requests - 2", "is -2 at 0 requests"),
        ("rows", "max(1, 12 - tokens)", "shrinks from 12 at 0 requests to 10 at 1"),
        ("cols", "max_blocks - requests", "shrinks from 4 at 0 requests to 3 at 1"),
        ("rows", "requests % 3 + 1", "shrinks from 3 at 2 requests to 1 at 3"),
    ],
)
def test_rows_and_cols_rules_are_non_negative_and_non_decreasing(
    spec_mapping: Callable[[], dict[str, Any]], field: str, rule: str, fragment: str
) -> None:
    d = spec_mapping()
    d["buffers"]["block_table"][field] = rule
    with pytest.raises(SpecError) as info:
        GraphSpec.model_validate(d, source="r.yaml")
    assert f"r.yaml: buffers.block_table.{field}: {rule!r} {fragment}" in str(info.value)


def test_numpy_integers_are_accepted_as_overrides() -> None:
    p = graphbuf.plan(GEMMA, overrides={"num_blocks": np.int64(100), "max_model_len": np.int32(1024)})
    assert p["block_table.full"].max == 99 and p["block_table.full"].shape == (16, 8)
    for bad in (True, 1.5, np.float64(3.0), "7"):
        with pytest.raises(SpecError, match=r"overrides\.num_blocks: expected an integer, got"):
            graphbuf.plan(GEMMA, overrides={"num_blocks": bad})
    with pytest.raises(SpecError, match="beyond"):
        graphbuf.plan(GEMMA, overrides={"num_blocks": 2**64})


def test_a_directory_as_a_spec_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SpecError, match="is a directory; a spec is a YAML file"):
        load_spec(tmp_path)
    assert main(["check", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_plan_json_is_strict_json_with_a_nan_pad(
    tmp_path: Path, spec_mapping: Callable[[], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    d = spec_mapping()
    d["buffers"]["scratch"]["pad"] = math.nan
    d["buffers"]["inf"] = {"dtype": "float32", "rows": 1, "pad": -math.inf}
    path = tmp_path / "nan.yaml"
    path.write_text(yaml.safe_dump(d), encoding="utf-8")
    for argv in (["plan", str(path), "--json"], ["check", str(path), "--json"]):
        assert main(argv) == 0
        out = capsys.readouterr().out

        def no_constant(name: str) -> None:
            raise AssertionError(f"non-standard JSON token {name}")

        data = json.loads(out, parse_constant=no_constant)
        if argv[0] == "plan":
            pads = {b["name"]: b["pad"] for b in data["buffers"]}
            assert pads["scratch"] == "nan" and pads["inf"] == "-inf"


def test_a_spec_error_under_json_is_json_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("version: 2\n", encoding="utf-8")
    assert main(["check", str(path), "--json"]) == 2
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["ok"] is False and data["exit"] == 2
    assert any(line.startswith(f"{path}: version:") for line in data["errors"])


def test_the_pydantic_errors_show_the_offending_value(spec_mapping: Callable[[], dict[str, Any]]) -> None:
    d = spec_mapping()
    d["buffers"]["seq_lens"]["overflow"] = "explode"
    d["groups"] = [["x"]]
    with pytest.raises(SpecError) as info:
        GraphSpec.model_validate(d, source="v.yaml")
    msg = str(info.value)
    assert "v.yaml: buffers.seq_lens.overflow:" in msg and "got 'explode'" in msg
    assert "v.yaml: groups[0]:" in msg and "got ['x']" in msg


# ------------------------------------------------------------------------------------------ Hypothesis

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [
            "requests",
            "tokens",
            "requests + 1",
            "max_blocks",
            "cdiv(",
            "1 // 0",
            "-",
            "repeat_last",
            "int32",
            "a",
        ]
    ),
    st.text(max_size=12),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=4)
    ),
    max_leaves=12,
)
_PATHS = [
    ("version",),
    ("constants", "max_num_seqs"),
    ("constants", "max_blocks"),
    ("constants", "new"),
    ("capture",),
    ("capture", "sizes"),
    ("capture", "tokens_per_request"),
    ("capture", "max_requests"),
    ("groups",),
    ("buffers",),
    ("buffers", "seq_lens"),
    ("buffers", "seq_lens", "rows"),
    ("buffers", "block_table", "cols"),
    ("buffers", "seq_lens", "pad"),
    ("buffers", "seq_lens", "dtype"),
    ("buffers", "seq_lens", "min"),
    ("workspaces",),
    ("tasks",),
    ("limits", "max_bytes"),
]


def _edit(base: Mapping[str, Any], edits: list[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    d = copy.deepcopy(dict(base))
    for path, value in edits:
        node: Any = d
        for key in path[:-1]:
            if not isinstance(node, dict):
                break
            node = node.setdefault(key, {})
        if isinstance(node, dict):
            node[path[-1]] = value
    return d


@settings(max_examples=examples(300), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.sampled_from(_PATHS), _VALUES), min_size=1, max_size=4))
def test_generated_spec_mappings_raise_nothing_but_spec_error(
    spec_mapping: Callable[[], dict[str, Any]], edits: list[tuple[tuple[str, ...], Any]]
) -> None:
    d = _edit(spec_mapping(), edits)
    try:
        spec = GraphSpec.model_validate(d, source="gen.yaml")
        graphbuf.plan(spec)
    except SpecError:
        pass
    except GraphbufError as exc:  # a plan above its limit is the one other documented outcome
        assert type(exc).__name__ == "PlanTooLargeError"


_YAML_PIECES = st.sampled_from(
    [
        "version: 1\n",
        "name: x\n",
        "capture: {sizes: [2, 4]}\n",
        "capture:\n  sizes: {start: 1, stop: 4}\n  tokens_per_request: 1\n",
        "buffers: {a: {dtype: int32, rows: requests}}\n",
        "buffers:\n  a: &b {dtype: int8, rows: tokens}\n  c: {<<: *b, cols: 2}\n",
        "constants: {a: b, b: a}\n",
        "constants: {n: 99999999999999999999999}\n",
        "? [x]\n: 1\n",
        "- 1\n",
        "&a [*a]\n",
        "constants: !!python/object:os.system {}\n",
        "tasks: [{name: t, factory: 'os:system', options: {x: 1}}]\n",
        "buffers: {a: {dtype: int32, rows: 'requests ' + '+ requests ' * 300}}\n",
        "\t: bad\n",
        "constants: {a: 1, a: 2}\n",
        "{",
        "",
        "---\n---\n",
    ]
)


@settings(max_examples=examples(200))
@given(pieces=st.lists(_YAML_PIECES, min_size=1, max_size=5), noise=st.text(max_size=20))
def test_generated_yaml_texts_raise_nothing_but_spec_error(
    pieces: list[str], noise: str, tmp_path_factory
) -> None:
    path = tmp_path_factory.mktemp("gen") / "gen.yaml"
    path.write_text("".join(pieces) + noise, encoding="utf-8")
    try:
        graphbuf.plan(str(path))
    except SpecError:
        pass
    except GraphbufError as exc:
        assert type(exc).__name__ == "PlanTooLargeError"


def test_a_plan_error_under_json_is_json_too(
    spec_mapping: Callable[[], dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = spec_mapping()
    d["limits"] = {"max_bytes": 1024}
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(d), encoding="utf-8")
    for command in ("check", "plan"):
        assert main([command, str(path), "--json"]) == 2  # PlanTooLargeError is a SpecError
        data = json.loads(capsys.readouterr().out)
        assert data["ok"] is False and data["exit"] == 2 and "limits.max_bytes" in data["errors"][0]
