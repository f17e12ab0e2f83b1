"""Spec loading and validation: every invalid spec is a SpecError naming the file, the field path and what
is allowed; YAML is loaded safely; shipped specs load by name and match the committed JSON Schema."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import graphbuf
from graphbuf import GraphSpec, PlanTooLargeError, SpecError, load_spec
from graphbuf.spec.models import DEFAULT_MAX_BYTES, shipped_specs

REPO = Path(__file__).resolve().parents[3]
Mapping = dict[str, Any]
Mutation = Callable[[Mapping], None]


def _buf(d: Mapping, name: str) -> Mapping:
    return d["buffers"][name]


def _set_constants_first(d: Mapping, **first: Any) -> None:
    d["constants"] = {**first, **d["constants"]}


# (id, mutation of the small valid spec, fragments the error message must contain: path, problem, allowed)
BAD_SPECS: list[tuple[str, Mutation, list[str]]] = [
    ("unknown-top-key", lambda d: d.update(colour=1), ["colour: unknown key", "allowed: version, name"]),
    (
        "unknown-buffer-key",
        lambda d: _buf(d, "seq_lens").update(colour=1),
        [
            "buffers.seq_lens.colour: unknown key",
            "allowed: dtype, rows, cols, per_group, pad, overflow, keep",
        ],
    ),
    (
        "unknown-capture-key",
        lambda d: d["capture"].update(size=[2]),
        ["capture.size: unknown key", "allowed: tokens_per_request, sizes"],
    ),
    (
        "unknown-limits-key",
        lambda d: d.update(limits={"max_byte": 1}),
        ["limits.max_byte: unknown key", "allowed: max_bytes"],
    ),
    ("missing-version", lambda d: d.pop("version"), ["version: Field required"]),
    ("missing-buffers", lambda d: d.pop("buffers"), ["buffers: Field required"]),
    ("missing-capture", lambda d: d.pop("capture"), ["capture: Field required"]),
    ("missing-sizes", lambda d: d["capture"].pop("sizes"), ["capture.sizes: Field required"]),
    ("missing-dtype", lambda d: _buf(d, "seq_lens").pop("dtype"), ["buffers.seq_lens.dtype: Field required"]),
    ("missing-rows", lambda d: _buf(d, "seq_lens").pop("rows"), ["buffers.seq_lens.rows: Field required"]),
    ("version-2", lambda d: d.update(version=2), ["version: got 2; allowed: 1"]),
    (
        "dtype-int4",
        lambda d: _buf(d, "seq_lens").update(dtype="int4"),
        ["buffers.seq_lens.dtype:", "'int32'", "'bfloat16'", "got 'int4'"],
    ),
    (
        "dtype-complex",
        lambda d: _buf(d, "scratch").update(dtype="complex64"),
        ["buffers.scratch.dtype:", "'float32'", "got 'complex64'"],
    ),
    (
        "sizes-zero",
        lambda d: d["capture"].update(sizes=[0, 2]),
        ["capture.sizes[0]: size 0 must be positive"],
    ),
    (
        "sizes-negative",
        lambda d: d["capture"].update(sizes=[2, -4]),
        ["capture.sizes[1]: size -4 must be positive"],
    ),
    (
        "sizes-duplicate",
        lambda d: d["capture"].update(sizes=[2, 4, 2]),
        ["capture.sizes[2]: size 2 is duplicated"],
    ),
    (
        "sizes-not-multiple",
        lambda d: d["capture"].update(sizes=[2, 3]),
        ["capture.sizes[1]: size 3 is not a multiple of tokens_per_request (2)"],
    ),
    (
        "sizes-above-max-tokens",
        lambda d: d["constants"].update(max_num_batched_tokens=6),
        ["capture.sizes[0]: size 8 exceeds max_num_batched_tokens (6)"],
    ),
    (
        "sizes-above-max-seqs",
        lambda d: d["constants"].update(max_num_seqs=1),
        [
            "capture.sizes[0]: size 8 implies 4 requests, above max_num_seqs (1)",
            "capture.sizes[2]: size 4 implies 2 requests, above max_num_seqs (1)",
        ],
    ),
    (
        "sizes-range-start",
        lambda d: d["capture"].update(sizes={"start": 0, "stop": 4, "step": 2}),
        ["capture.sizes.start: must be ≥ 1, got 0", "capture.sizes: size 0 must be positive"],
    ),
    (
        "sizes-range-step",
        lambda d: d["capture"].update(sizes={"start": 2, "stop": 4, "step": 0}),
        ["capture.sizes.step: must be ≥ 1, got 0", "capture.sizes: no capture sizes"],
    ),
    (
        "sizes-range-stop",
        lambda d: d["capture"].update(sizes={"start": 4, "stop": 2, "step": 2}),
        ["capture.sizes.stop: 2 is below start 4"],
    ),
    (
        "sizes-range-not-multiple",
        lambda d: d["capture"].update(sizes={"start": 1, "stop": 4}),
        ["capture.sizes: size 1 is not a multiple of tokens_per_request (2)", "size 3 is not a multiple"],
    ),
    (
        "sizes-range-missing-stop",
        lambda d: d["capture"].update(sizes={"start": 2}),
        ["capture.sizes.stop: Field required"],
    ),
    ("sizes-empty", lambda d: d["capture"].update(sizes=[]), ["capture.sizes: no capture sizes"]),
    ("sizes-word", lambda d: d["capture"].update(sizes=[2, "four"]), ["capture.sizes[1]: Input should be"]),
    ("sizes-fraction", lambda d: d["capture"].update(sizes=[2, 4.5]), ["capture.sizes[1]: Input should be"]),
    ("sizes-scalar", lambda d: d["capture"].update(sizes=4), ["capture.sizes: got 4; allowed: a mapping"]),
    (
        "tpr-zero",
        lambda d: d["capture"].update(tokens_per_request=0),
        ["capture.tokens_per_request: must be ≥ 1, got 0"],
    ),
    (
        "tpr-capture-var",
        lambda d: d["capture"].update(tokens_per_request="tokens"),
        ["capture.tokens_per_request: unknown name(s) tokens", "allowed: block_size, max_blocks"],
    ),
    (
        "rows-zero",
        lambda d: _buf(d, "seq_lens").update(rows="requests - 1"),
        ["buffers.seq_lens.rows: 'requests - 1' evaluates to 0 at capture size 2; must be ≥ 1"],
    ),
    (
        "cols-zero",
        lambda d: _buf(d, "block_table").update(cols=0),
        ["buffers.block_table.cols: '0' evaluates to 0 at capture size 8; must be ≥ 1"],
    ),
    (
        "cols-negative",
        lambda d: _buf(d, "block_table").update(cols="max_blocks - tokens"),
        ["buffers.block_table.cols: 'max_blocks - tokens' evaluates to -4 at capture size 8; must be ≥ 1"],
    ),
    (
        "rows-unknown-name",
        lambda d: _buf(d, "seq_lens").update(rows="requests * nope"),
        [
            "buffers.seq_lens.rows: unknown name(s) nope in 'requests * nope'",
            "allowed: block_size, max_blocks, max_model_len, max_num_batched_tokens, max_num_seqs, "
            "num_blocks, "
            "requests, tokens",
        ],
    ),
    (
        "rows-power",
        lambda d: _buf(d, "seq_lens").update(rows="requests ** 2"),
        ["buffers.seq_lens.rows: unexpected '*'"],
    ),
    (
        "rows-true-division",
        lambda d: _buf(d, "seq_lens").update(rows="tokens / 2"),
        ["buffers.seq_lens.rows: unexpected character '/'", "allowed: integers, names, + - * // %"],
    ),
    (
        "rows-unknown-function",
        lambda d: _buf(d, "seq_lens").update(rows="abs(requests)"),
        ["buffers.seq_lens.rows: unknown function 'abs'", "allowed: cdiv, max, min"],
    ),
    (
        "rows-python-code",
        lambda d: _buf(d, "seq_lens").update(rows="__import__('os').getpid()"),
        ["buffers.seq_lens.rows: unexpected character"],
    ),
    (
        "rows-attribute",
        lambda d: _buf(d, "seq_lens").update(rows="requests.real"),
        ["buffers.seq_lens.rows: unexpected character '.'"],
    ),
    (
        "rows-fraction",
        lambda d: _buf(d, "seq_lens").update(rows=1.5),
        ["buffers.seq_lens.rows: got 1.5; allowed: an integer within ±(2**63 - 1) or an expression"],
    ),
    (
        "rows-unset-constant",
        lambda d: (d["constants"].update(num_blocks=None), _buf(d, "seq_lens").update(rows="num_blocks")),
        ["buffers.seq_lens.rows: 'num_blocks' in 'num_blocks' has no value"],
    ),
    (
        "max-capture-var",
        lambda d: _buf(d, "seq_lens").update(max="requests"),
        ["buffers.seq_lens.max: unknown name(s) requests", "allowed: block_size"],
    ),
    (
        "min-bad-expr",
        lambda d: _buf(d, "seq_lens").update(min="1 +"),
        ["buffers.seq_lens.min: expression '1 +' ends early"],
    ),
    (
        "min-above-max",
        lambda d: _buf(d, "seq_lens").update(min=10, max=5),
        ["buffers.seq_lens.max: max 5 is below min 10"],
    ),
    (
        "pad-int8",
        lambda d: _buf(d, "seq_lens").update(dtype="int8", pad=200),
        ["buffers.seq_lens.pad: 200 is not representable in int8"],
    ),
    (
        "pad-uint8-negative",
        lambda d: _buf(d, "seq_lens").update(dtype="uint8", pad=-1),
        ["buffers.seq_lens.pad: -1 is not representable in uint8"],
    ),
    (
        "pad-bool",
        lambda d: _buf(d, "seq_lens").update(dtype="bool", pad=2),
        ["buffers.seq_lens.pad: 2 is not representable in bool"],
    ),
    (
        "pad-int-fraction",
        lambda d: _buf(d, "seq_lens").update(pad=1.5),
        ["buffers.seq_lens.pad: 1.5 is not representable in int32"],
    ),
    (
        "pad-int-nan",
        lambda d: _buf(d, "seq_lens").update(pad=math.nan),
        ["buffers.seq_lens.pad: nan is not representable in int32"],
    ),
    (
        "pad-int64-overflow",
        lambda d: _buf(d, "slot_mapping").update(pad=2**63),
        ["buffers.slot_mapping.pad: 9223372036854775808 is not representable in int64"],
    ),
    (
        "pad-float16-overflow",
        lambda d: _buf(d, "scratch").update(dtype="float16", pad=70000.0),
        ["buffers.scratch.pad: 70000.0 is not representable in float16"],
    ),
    (
        "pad-bfloat16-overflow",
        lambda d: _buf(d, "scratch").update(dtype="bfloat16", pad=1e39),
        ["buffers.scratch.pad: 1e+39 is not representable in bfloat16"],
    ),
    (
        "pad-word",
        lambda d: _buf(d, "seq_lens").update(pad="zero"),
        ["buffers.seq_lens.pad:", "'repeat_last'"],
    ),
    (
        "overflow-clip",
        lambda d: _buf(d, "block_table").update(overflow="clip"),
        ["buffers.block_table.overflow: got 'clip'; allowed: one of 'reject', 'truncate'"],
    ),
    (
        "keep-not-bool",
        lambda d: _buf(d, "scratch").update(keep="sometimes"),
        ["buffers.scratch.keep: Input should be a valid boolean"],
    ),
    (
        "constant-reserved",
        lambda d: d["constants"].update(tokens=3),
        ["constants.tokens: not a usable name; reserved: cdiv, max, min, requests, tokens"],
    ),
    (
        "constant-not-identifier",
        lambda d: d["constants"].update({"block-size": 3}),
        ["constants.block-size: not a usable name"],
    ),
    (
        "tpr-unset-constant",
        lambda d: (d["constants"].update(mtp=None), d["capture"].update(tokens_per_request="1 + mtp")),
        ["capture.tokens_per_request: 'mtp' in '1 + mtp' has no value"],
    ),
    (
        "constant-cycle",
        lambda d: d["constants"].update(a="b + 1", b="c * 2", c="a"),
        ["constants.a: dependency cycle: a -> b -> c -> a"],
    ),
    (
        "constant-unknown-name",
        lambda d: _set_constants_first(d, early="nope + 1"),
        ["constants.early: unknown name(s) nope"],
    ),
    (
        "constant-bad-expr",
        lambda d: d["constants"].update(bad="max_num_seqs +"),
        ["constants.bad: expression 'max_num_seqs +' ends early"],
    ),
    (
        "constant-division-by-zero",
        lambda d: d["constants"].update(bad="max_num_seqs // 0"),
        ["constants.bad: division by zero"],
    ),
    ("constant-fraction", lambda d: d["constants"].update(bad=1.5), ["constants.bad: got 1.5; allowed:"]),
    ("groups-empty", lambda d: d.update(groups=[]), ["groups: at least one group is required"]),
    ("groups-duplicate", lambda d: d.update(groups=["a", "b", "a"]), ["groups[2]: duplicate group 'a'"]),
    (
        "groups-not-identifier",
        lambda d: d.update(groups=["a", "b-c"]),
        ["groups[1]: 'b-c' is not an identifier"],
    ),
    ("buffers-empty", lambda d: d.update(buffers={}), ["buffers: at least one buffer is required"]),
    (
        "buffer-dotted-name",
        lambda d: d["buffers"].update({"x.y": {"dtype": "int8", "rows": 1}}),
        ["buffers.x.y: buffer names must be identifiers"],
    ),
    (
        "limits-zero",
        lambda d: d.update(limits={"max_bytes": 0}),
        ["limits.max_bytes: must be positive, got 0"],
    ),
    (
        "workspace-unknown-name",
        lambda d: d.update(workspaces={"w": {"dtype": "int8", "shape": ["requests", "nope"]}}),
        ["workspaces.w.shape[1]: unknown name(s) nope"],
    ),
    (
        "task-factory",
        lambda d: d.update(tasks=[{"name": "t", "factory": "no_colon"}]),
        ["tasks[0].factory: expected 'package.module:function', got 'no_colon'"],
    ),
    (
        "task-group",
        lambda d: d.update(tasks=[{"name": "t", "factory": "m:f", "group": "zz"}]),
        ["tasks[0].group: unknown group 'zz'; groups: a, b"],
    ),
]


@pytest.mark.parametrize(("mutate", "fragments"), [c[1:] for c in BAD_SPECS], ids=[c[0] for c in BAD_SPECS])
def test_bad_spec_file_is_a_spec_error_naming_file_path_and_allowed(
    spec_mapping: Callable[[], Mapping],
    write_yaml: Callable[..., Path],
    mutate: Mutation,
    fragments: list[str],
) -> None:
    d = spec_mapping()
    mutate(d)
    path = write_yaml(d, "bad.yaml")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    for line in msg.splitlines():
        assert line.startswith(f"{path}: "), line
    for fragment in fragments:
        assert fragment in msg


@pytest.mark.parametrize(("mutate", "fragments"), [c[1:] for c in BAD_SPECS], ids=[c[0] for c in BAD_SPECS])
def test_bad_spec_mapping_is_a_spec_error_naming_source_and_path(
    spec_mapping: Callable[[], Mapping], mutate: Mutation, fragments: list[str]
) -> None:
    d = spec_mapping()
    mutate(d)
    with pytest.raises(SpecError) as info:
        GraphSpec.model_validate(d, source="inline.yaml")
    for line in str(info.value).splitlines():
        assert line.startswith("inline.yaml: "), line
    for fragment in fragments:
        assert fragment in str(info.value)
    with pytest.raises(SpecError, match=r"^<spec>: "):
        GraphSpec.model_validate(d)


def test_unknown_key_in_size_range_lists_allowed_keys(spec_mapping: Callable[[], Mapping]) -> None:
    d = spec_mapping()
    d["capture"]["sizes"] = {"start": 2, "stop": 8, "step": 2, "end": 8}
    with pytest.raises(SpecError) as info:
        GraphSpec.model_validate(d)
    assert "capture.sizes.end: unknown key" in str(info.value)
    assert "allowed: start, stop, step" in str(info.value)


def test_every_problem_is_reported_at_once(spec_mapping: Callable[[], Mapping]) -> None:
    d = spec_mapping()
    d["capture"]["sizes"] = [2, 3, 2]
    _buf(d, "seq_lens")["pad"] = 1.5
    _buf(d, "block_table")["cols"] = "nope"
    with pytest.raises(SpecError) as info:
        GraphSpec.model_validate(d, source="multi.yaml")
    lines = str(info.value).splitlines()
    assert lines == [
        "multi.yaml: capture.sizes[1]: size 3 is not a multiple of tokens_per_request (2)",
        "multi.yaml: capture.sizes[2]: size 2 is duplicated",
        "multi.yaml: buffers.block_table.cols: unknown name(s) nope in 'nope'; allowed: block_size, "
        "max_blocks, "
        "max_model_len, max_num_batched_tokens, max_num_seqs, num_blocks, requests, tokens",
        "multi.yaml: buffers.seq_lens.pad: 1.5 is not representable in int32",
    ]


@pytest.mark.parametrize("top", [[1, 2], "text", 3, None])
def test_non_mapping_spec_is_a_spec_error(top: object) -> None:
    with pytest.raises(SpecError, match=r"^<spec>: \(top level\): "):
        GraphSpec.model_validate(top)


def test_error_hierarchy() -> None:
    assert issubclass(SpecError, ValueError)
    assert issubclass(PlanTooLargeError, SpecError)
    assert graphbuf.SpecError is SpecError


# ----------------------------------------------------------------------------------------------------------
# Valid specs: defaults, ranges, constants, overrides.


def test_small_spec_loads_from_mapping_and_from_yaml(
    spec_mapping: Callable[[], Mapping], write_yaml: Callable[..., Path]
) -> None:
    from_mapping = GraphSpec.model_validate(spec_mapping())
    from_file = load_spec(write_yaml(spec_mapping()))
    from_str_path = load_spec(str(write_yaml(spec_mapping(), "again.yaml")))
    assert from_mapping == from_file == from_str_path
    assert from_file.name == "small"
    assert list(from_file.buffers) == [
        "scratch",
        "block_table",
        "seq_lens",
        "query_start_loc",
        "slot_mapping",
    ]
    assert from_file.limits.max_bytes == DEFAULT_MAX_BYTES == 1 << 30


def test_groups_default_to_one_group(spec_mapping: Callable[[], Mapping]) -> None:
    d = spec_mapping()
    del d["groups"]
    spec = GraphSpec.model_validate(d)
    assert spec.groups == ["default"]
    assert "block_table.default" in graphbuf.plan(spec).names


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ({"start": 2, "stop": 8, "step": 2}, (2, 4, 6, 8)),
        ({"start": 2, "stop": 7, "step": 2}, (2, 4, 6)),
        ({"start": 4, "stop": 4, "step": 2}, (4,)),
        ([8, 2, 6], (2, 6, 8)),
        ([4], (4,)),
    ],
)
def test_capture_sizes_range_is_stop_inclusive_or_a_list(
    spec_mapping: Callable[[], Mapping], sizes: object, expected: tuple[int, ...]
) -> None:
    d = spec_mapping()
    d["capture"]["sizes"] = sizes
    assert graphbuf.plan(GraphSpec.model_validate(d)).capture_sizes == expected


def test_range_step_defaults_to_one(spec_mapping: Callable[[], Mapping]) -> None:
    d = spec_mapping()
    d["capture"] = {"sizes": {"start": 1, "stop": 4}}
    assert graphbuf.plan(GraphSpec.model_validate(d)).capture_sizes == (1, 2, 3, 4)


def test_size_limits_apply_only_when_the_constants_exist(spec_mapping: Callable[[], Mapping]) -> None:
    d = spec_mapping()
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        del d["constants"][name]
    _buf(d, "query_start_loc")["max"] = 1000
    d["capture"]["sizes"] = [2, 512]
    assert graphbuf.plan(GraphSpec.model_validate(d)).capture_sizes == (2, 512)


def test_size_at_the_limits_is_allowed(spec_mapping: Callable[[], Mapping]) -> None:
    d = spec_mapping()
    d["constants"].update(max_num_seqs=4, max_num_batched_tokens=8)
    d["capture"]["sizes"] = [8]
    assert graphbuf.plan(GraphSpec.model_validate(d)).capture_sizes == (8,)


def test_shape_fields_may_use_capture_variables_and_functions(spec_mapping: Callable[[], Mapping]) -> None:
    d = spec_mapping()
    _buf(d, "block_table")["cols"] = "min(max_blocks, requests + 1)"
    _buf(d, "slot_mapping")["rows"] = "max(tokens, requests * 2)"
    p = graphbuf.plan(GraphSpec.model_validate(d))
    assert p.shape_at(p["block_table.a"], 2) == (1, 2)
    assert p.shape_at(p["block_table.a"], 8) == (4, 4)
    assert p["block_table.a"].shape == (4, 4)


def test_constants_are_expressions_over_constants_above(spec_mapping: Callable[[], Mapping]) -> None:
    d = spec_mapping()
    d["constants"].update(twice="max_blocks * 2", later="twice + num_blocks")
    spec = GraphSpec.model_validate(d)
    values = spec.constants_with()
    assert values["max_blocks"] == 4
    assert values["twice"] == 8
    assert values["later"] == 40
    assert list(values) == list(d["constants"])


def test_null_constants_stay_unset_until_overridden(spec_mapping: Callable[[], Mapping]) -> None:
    d = spec_mapping()
    d["constants"].update(num_blocks=None, derived="num_blocks * 2")
    spec = GraphSpec.model_validate(d)
    assert spec.constants_with()["num_blocks"] is None
    assert spec.constants_with()["derived"] is None
    assert graphbuf.plan(spec)["block_table.a"].max is None
    set_ = spec.constants_with({"num_blocks": 10})
    assert set_["num_blocks"] == 10
    assert set_["derived"] == 20
    assert graphbuf.plan(spec, overrides={"num_blocks": 10})["block_table.a"].max == 9


def test_override_replaces_a_derived_constant(spec_mapping: Callable[[], Mapping]) -> None:
    spec = GraphSpec.model_validate(spec_mapping())
    assert spec.constants_with({"max_blocks": 2})["max_blocks"] == 2
    assert graphbuf.plan(spec, overrides={"max_blocks": 2})["block_table.a"].shape == (4, 2)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"nope": 1}, "overrides.nope: unknown constant; declared: max_num_seqs, max_num_batched_tokens"),
        ({"num_blocks": True}, "overrides.num_blocks: expected an integer, got True"),
        ({"num_blocks": "3"}, "overrides.num_blocks: expected an integer, got '3'"),
        ({"num_blocks": 1.5}, "overrides.num_blocks: expected an integer, got 1.5"),
    ],
)
def test_bad_overrides_are_spec_errors(
    spec_mapping: Callable[[], Mapping], write_yaml: Callable[..., Path], overrides: dict, fragment: str
) -> None:
    path = write_yaml(spec_mapping())
    with pytest.raises(SpecError) as info:
        load_spec(path, overrides=overrides)
    assert str(info.value).startswith(f"{path}: ")
    assert fragment in str(info.value)
    spec = GraphSpec.model_validate(spec_mapping())
    with pytest.raises(SpecError, match=r"overrides\.(num_blocks|nope): "):
        spec.constants_with(overrides)
    with pytest.raises(SpecError, match=r"overrides\.(num_blocks|nope): "):
        graphbuf.plan(spec, overrides=overrides)
    with pytest.raises(SpecError, match=r"overrides\.(num_blocks|nope): "):
        GraphSpec.model_validate(spec_mapping(), overrides=overrides)


def test_overrides_are_validated_like_the_spec(
    spec_mapping: Callable[[], Mapping], write_yaml: Callable
) -> None:
    path = write_yaml(spec_mapping())
    with pytest.raises(SpecError) as info:
        load_spec(path, overrides={"max_num_seqs": 2})
    assert f"{path}: capture.sizes[0]: size 8 implies 4 requests, above max_num_seqs (2)" in str(info.value)
    with pytest.raises(SpecError, match=r"buffers.block_table.max: max -1 is below min 0"):
        graphbuf.plan(GraphSpec.model_validate(spec_mapping()), overrides={"num_blocks": 0})


# ----------------------------------------------------------------------------------------------------------
# Byte limit (checked at plan time, before anything is allocated).


def test_plan_above_spec_limit_is_plan_too_large(
    spec_mapping: Callable[[], Mapping], write_yaml: Callable[..., Path]
) -> None:
    d = spec_mapping()
    d["limits"] = {"max_bytes": 1024}
    path = write_yaml(d)
    with pytest.raises(PlanTooLargeError) as info:
        graphbuf.plan(str(path))
    msg = str(info.value)
    assert isinstance(info.value, SpecError)
    assert msg.startswith(f"{path}: limits.max_bytes: the plan needs ")
    assert "above the limit of 1024 bytes" in msg
    assert "needs 3072 bytes" in msg
    assert "largest buffer: block_table.a, 64 bytes, shape [4, 4]" in msg


def test_default_limit_is_one_gib(spec_mapping: Callable[[], Mapping]) -> None:
    d = spec_mapping()
    # 4 rows x 2**26 cols of int32 = exactly 1 GiB: fits; one more column does not.
    d["buffers"] = {"big": {"dtype": "int32", "rows": "requests", "cols": 2**26}}
    assert graphbuf.plan(GraphSpec.model_validate(d)).total_bytes == 1 << 30
    d["buffers"]["big"]["cols"] = 2**26 + 1
    with pytest.raises(PlanTooLargeError, match=r"^small: limits.max_bytes: .*limit of 1073741824 bytes"):
        graphbuf.plan(GraphSpec.model_validate(d))


def test_plan_max_bytes_argument_overrides_the_spec_limit(spec_mapping: Callable[[], Mapping]) -> None:
    d = spec_mapping()
    d["limits"] = {"max_bytes": 1024}
    spec = GraphSpec.model_validate(d)
    p = graphbuf.plan(spec, max_bytes=1 << 20)
    assert p.max_bytes == 1 << 20
    with pytest.raises(PlanTooLargeError, match=f"above the limit of {p.total_bytes - 1} bytes"):
        graphbuf.plan(GraphSpec.model_validate(spec_mapping()), max_bytes=p.total_bytes - 1)
    assert graphbuf.plan(GraphSpec.model_validate(spec_mapping()), max_bytes=p.total_bytes).total_bytes == (
        p.total_bytes
    )


def test_override_growing_the_plan_past_the_limit(spec_mapping: Callable[[], Mapping]) -> None:
    spec = GraphSpec.model_validate(spec_mapping())
    with pytest.raises(PlanTooLargeError, match=r"largest buffer: block_table\.a"):
        graphbuf.plan(spec, overrides={"max_blocks": 2**40})


# ----------------------------------------------------------------------------------------------------------
# YAML: safe loading, duplicate keys, syntax errors.


@pytest.mark.parametrize(
    "tag",
    [
        "!!python/object/apply:os.system ['touch {marker}']",
        "!!python/object/new:os.system ['touch {marker}']",
        "!!python/name:os.system",
        "!!python/object:builtins.object {{}}",
    ],
)
def test_python_object_tags_are_rejected(write_yaml: Callable[..., Path], tmp_path: Path, tag: str) -> None:
    marker = tmp_path / "pwned"
    text = f"version: 1\nname: {tag.format(marker=marker)}\n"
    path = write_yaml(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value).startswith(
        f"{path}: line 2, column 7: invalid YAML: could not determine a constructor"
    )
    assert not marker.exists()


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("version: 1\nname: a\nname: b\n", "line 3, column 1: invalid YAML: duplicate key 'name'"),
        (
            "version: 1\nbuffers:\n  x: {dtype: int8, rows: 1, dtype: int32}\n",
            "line 3, column 29: invalid YAML: duplicate key 'dtype'",
        ),
        (
            "version: 1\nbuffers:\n  x: {dtype: int8, rows: 1}\n  x: {dtype: int8, rows: 2}\n",
            "line 4, column 3: invalid YAML: duplicate key 'x'",
        ),
        ("version: 1\nname: [a\n", "expected ',' or ']'"),
        ("version: 1\n  name: x\n", "line 2, column 7: invalid YAML: mapping values are not allowed"),
    ],
)
def test_duplicate_keys_and_syntax_errors_name_file_and_line(
    write_yaml: Callable[..., Path], text: str, fragment: str
) -> None:
    path = write_yaml(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}: ")
    assert fragment in str(info.value)


@pytest.mark.parametrize(("text", "kind"), [("- 1\n- 2\n", "list"), ("", "NoneType"), ("42\n", "int")])
def test_non_mapping_yaml_is_a_spec_error(write_yaml: Callable[..., Path], text: str, kind: str) -> None:
    path = write_yaml(text)
    with pytest.raises(SpecError, match=f"expected a mapping of spec fields, got {kind}") as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}: (top level): ")


def test_missing_file_or_unknown_name_lists_shipped_specs(tmp_path: Path) -> None:
    for missing in (tmp_path / "absent.yaml", "no-such-spec"):
        with pytest.raises(SpecError) as info:
            load_spec(missing)
        assert str(info.value).startswith(f"{missing}: no such spec file and no shipped spec of that name")
        assert "gemma4-31b-it-mtp" in str(info.value)


# ----------------------------------------------------------------------------------------------------------
# Shipped specs and the JSON Schema.


def test_shipped_specs_load_by_name_with_or_without_suffix() -> None:
    shipped = shipped_specs()
    assert "gemma4-31b-it-mtp" in shipped
    for name, path in shipped.items():
        assert path.is_file()
        by_name = load_spec(name)
        assert by_name == load_spec(f"{name}.yaml") == load_spec(path)
        assert by_name.name == name


def test_shipped_specs_start_with_the_schema_modeline() -> None:
    for path in shipped_specs().values():
        first = path.read_text(encoding="utf-8").splitlines()[0]
        assert first.startswith("# yaml-language-server: $schema="), path
        target = first.split("$schema=", 1)[1].strip()
        schema = (path.parent / target).resolve()  # the schema shipped beside the specs, wherever installed
        assert schema == (path.parent / "graphbuf.schema.json").resolve() and schema.is_file(), path


def test_committed_schema_equals_the_model_schema() -> None:
    committed = json.loads((REPO / "specs" / "graphbuf.schema.json").read_text(encoding="utf-8"))
    assert committed == GraphSpec.model_json_schema()


def test_shipped_gemma_spec_resolves_its_constants() -> None:
    spec = load_spec("gemma4-31b-it-mtp")
    values = spec.constants_with({"num_blocks": 1000})
    assert values["max_blocks_per_seq"] == 43
    assert values["num_full_layers"] == 10
    assert values["sliding_kv_heads_per_rank"] == 8
    assert values["full_kv_heads_per_rank"] == 2
    assert spec.constants_with()["num_blocks"] is None
    assert spec.groups == ["sliding", "full"]
