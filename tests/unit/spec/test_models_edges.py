"""Issue 24 §1 (spec and expr part): every limit at its exact edge, one value inside and one outside, and the
message of the one outside. Two of these found bugs: a 19-digit literal above 2**63 - 1 was accepted
(``9223372036854775808`` evaluated to 2**63), and 4097 capture sizes also reported "no capture sizes".
"""

from __future__ import annotations

from typing import Any

import pytest

from graphbuf.errors import SpecError
from graphbuf.spec.expr import MAX_EXPR_CHARS, MAX_EXPR_DEPTH, MAX_VALUE, ExprError, parse_expr
from graphbuf.spec.models import MAX_CAPTURE_SIZES, MAX_REQUESTS, GraphSpec, parse_yaml


def _doc(**capture: Any) -> dict[str, Any]:
    return {
        "version": 1,
        "name": "edges",
        "capture": {"sizes": [1], **capture},
        "buffers": {"a": {"dtype": "int32", "rows": "tokens"}},
    }


def _error(doc: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as info:
        GraphSpec.model_validate(doc)
    return str(info.value)


def test_max_requests_edges() -> None:
    assert MAX_REQUESTS == 65536
    GraphSpec.model_validate(_doc(max_requests=65536))
    assert _error(_doc(max_requests=65537)) == "<spec>: capture.max_requests: must be in 1..65536, got 65537"
    assert _error(_doc(max_requests=0)) == "<spec>: capture.max_requests: must be in 1..65536, got 0"
    doc = _doc(max_requests="n * 2")
    doc["constants"] = {"n": 32769}
    assert _error(doc) == "<spec>: capture.max_requests: must be in 1..65536, got 65538"
    doc["constants"] = {"n": 32768}
    GraphSpec.model_validate(doc)


@pytest.mark.parametrize(
    ("dtype", "inside", "outside"),
    [
        ("uint8", 255, 256),
        ("uint8", 0, -1),
        ("int8", -128, -129),
        ("int8", 127, 128),
        ("int16", -32768, -32769),
    ],
)
def test_pad_edges(dtype: str, inside: int, outside: int) -> None:
    doc = _doc()
    doc["buffers"]["a"].update(dtype=dtype, pad=inside)
    GraphSpec.model_validate(doc)
    doc["buffers"]["a"]["pad"] = outside
    assert _error(doc) == f"<spec>: buffers.a.pad: {outside} is not representable in {dtype}"


@pytest.mark.parametrize("form", ["list", "range"])
def test_capture_size_count_edges(form: str) -> None:
    def sizes(n: int) -> Any:
        return list(range(1, n + 1)) if form == "list" else {"start": 1, "stop": n}

    assert MAX_CAPTURE_SIZES == 4096
    GraphSpec.model_validate(_doc(sizes=sizes(4096)))
    msg = _error(_doc(sizes=sizes(4097)))
    assert msg == "<spec>: capture.sizes: 4097 sizes; at most 4096 (each size is a captured graph)"


def test_yaml_nesting_edge() -> None:
    head = (
        "version: 1\nname: e\ncapture: {sizes: [1]}\nbuffers: {a: {dtype: int32, rows: tokens}}\nmeta: {x: "
    )
    deep = parse_yaml(head + "[" * 998 + "]" * 998 + "}\n", "f.yaml")
    GraphSpec.model_validate(deep, source="f.yaml")
    with pytest.raises(
        SpecError, match=r"^f\.yaml: line 5, column 1009: invalid YAML: exceeded maximum nesting"
    ):
        parse_yaml(head + "[" * 999 + "]" * 999 + "}\n", "f.yaml")


def test_expression_length_edge() -> None:
    assert MAX_EXPR_CHARS == 1000
    assert parse_expr("1" + " " * 999).eval({}) == 1
    with pytest.raises(ExprError, match=r"\(1001 characters\) is longer than 1000 characters"):
        parse_expr("1" + " " * 1000)


@pytest.mark.parametrize(
    "build",
    [
        lambda d: "(" * (d - 1) + "1" + ")" * (d - 1),  # parentheses
        lambda d: "-" * (d - 1) + "1",  # unary minus
        lambda d: " + ".join(["1"] * d),  # a chain counts one level per term
    ],
    ids=["parens", "negation", "chain"],
)
def test_expression_depth_edges(build: Any) -> None:
    assert MAX_EXPR_DEPTH == 64
    parse_expr(build(63)).eval({})
    parse_expr(build(64)).eval({})
    with pytest.raises(ExprError, match="is nested deeper than 64 levels"):
        parse_expr(build(65))


def test_value_edges() -> None:
    assert parse_expr(f"{2**62} + {2**62 - 1}").eval({}) == MAX_VALUE == 2**63 - 1
    with pytest.raises(ExprError, match=r"overflows: a value exceeds ±\(2\*\*63 - 1\)"):
        parse_expr(f"{2**62} + {2**62}").eval({})
    assert parse_expr(f"-{MAX_VALUE} - 0").eval({}) == -MAX_VALUE
    with pytest.raises(ExprError, match="overflows"):
        parse_expr(f"-{MAX_VALUE} - 1").eval({})
    assert parse_expr(MAX_VALUE).eval({}) == MAX_VALUE
    for value in (2**63, -(2**63)):
        with pytest.raises(ExprError, match=r"integer of 64 bits is beyond ±\(2\*\*63 - 1\)"):
            parse_expr(value)
    assert parse_expr(str(MAX_VALUE)).eval({}) == MAX_VALUE


@pytest.mark.parametrize("text", ["9223372036854775808", "-9223372036854775808", "9999999999999999999 - 1"])
def test_a_19_digit_literal_above_the_bound_is_refused(text: str) -> None:
    """Found here: 19 digits passed the digit limit and evaluated to 2**63 and beyond."""
    with pytest.raises(ExprError, match=r"integer literal \d{19} at position \d is beyond 2\*\*63 - 1"):
        parse_expr(text)
    doc = _doc()
    doc["constants"] = {"big": text}
    assert "constants.big: integer literal" in _error(doc)


def test_mappings_nested_past_the_stack_are_a_spec_error() -> None:
    """Nested mappings are built by recursion: past Python's stack they are "nested too deeply" (a SpecError
    naming the file), never a RecursionError; 50 levels load."""
    head = "version: 1\nname: e\ncapture: {sizes: [1]}\nbuffers: {a: {dtype: int32, rows: tokens}}\nmeta: "
    GraphSpec.model_validate(parse_yaml(head + "{a: " * 50 + "1" + "}" * 50, "f.yaml"), source="f.yaml")
    with pytest.raises(SpecError, match=r"^f\.yaml: invalid YAML: nested too deeply$"):
        parse_yaml(head + "{a: " * 900 + "1" + "}" * 900, "f.yaml")
