"""Pins for ``graphbuf/spec/models.py`` and ``graphbuf/spec/expr.py`` (issue 24 §1): every limit at its exact
edge, so a
mutant that moves a bound by one (``<`` for ``<=``, 65537 for 65536, ...) fails here."""

from __future__ import annotations

from typing import Any

import pytest

from graphbuf import GraphSpec, SpecError
from graphbuf.spec.expr import MAX_EXPR_CHARS, MAX_EXPR_DEPTH, MAX_VALUE, ExprError, parse_expr
from graphbuf.spec.models import MAX_CAPTURE_SIZES, MAX_REQUESTS, parse_yaml


def _spec(max_num_seqs: int = 8, **capture: Any) -> dict[str, Any]:
    return {
        "version": 1,
        "name": "edges",
        "constants": {"max_num_seqs": max_num_seqs},
        "capture": {"tokens_per_request": 1, "sizes": [1, 2, 4], **capture},
        "buffers": {"lens": {"dtype": "int32", "rows": "requests"}},
    }


def _with_buffer(**buf: Any) -> dict[str, Any]:
    s = _spec()
    s["buffers"]["x"] = {"rows": "requests", **buf}
    return s


def test_max_requests_limit_at_its_edge() -> None:
    """spec.py:452 ``if not 1 <= value <= MAX_REQUESTS`` and :382 ``MAX_REQUESTS = 1 << 16``: 65536 is
    accepted, 65537 and 0 are not (mutants ``<``, ``1 << 17``, ``2 <=``)."""
    assert MAX_REQUESTS == 65536
    GraphSpec.model_validate(_spec(max_requests=65536))
    GraphSpec.model_validate(_spec(max_requests=1))
    for bad in (65537, 0):
        with pytest.raises(SpecError, match=rf"capture\.max_requests: must be in 1\.\.65536, got {bad}"):
            GraphSpec.model_validate(_spec(max_requests=bad))


def test_an_out_of_range_max_requests_expression_is_named() -> None:
    """spec.py:447-455: a ``max_requests`` expression is evaluated and range-checked like a literal, and one
    that overflows reports the expression error under ``capture.max_requests`` (mutants: the evaluation or
    the ``except`` dropped)."""
    GraphSpec.model_validate(_spec(max_requests="max_num_seqs * 8192"))  # 65536
    with pytest.raises(SpecError, match=r"capture\.max_requests: must be in 1\.\.65536, got 65544"):
        GraphSpec.model_validate(_spec(max_requests="max_num_seqs * 8193"))
    with pytest.raises(SpecError, match=r"capture\.max_requests: .*overflows"):
        GraphSpec.model_validate(_spec(max_requests="max_num_seqs * 4611686018427387904"))


@pytest.mark.parametrize(("dtype", "good", "bad"), [
    ("uint8", [0, 255], [256, -1]),
    ("int8", [-128, 127], [-129, 128]),
    ("int16", [-32768, 32767], [-32769, 32768]),
    ("bool", [0, 1], [2, -1]),
])  # fmt: skip
def test_integer_pads_at_their_edges(dtype: str, good: list[int], bad: list[int]) -> None:
    """spec.py:408-413 ``pad_fits``: the dtype's extreme values are pads, one past them is not (mutants ``<=``
    for ``<``, ``bits`` for ``bits - 1``)."""
    for pad in good:
        GraphSpec.model_validate(_with_buffer(dtype=dtype, pad=pad))
    for pad in bad:
        with pytest.raises(SpecError, match=rf"buffers\.x\.pad: {pad} is not representable in {dtype}"):
            GraphSpec.model_validate(_with_buffer(dtype=dtype, pad=pad))


def test_capture_sizes_limit_at_its_edge() -> None:
    """spec.py:385 ``MAX_CAPTURE_SIZES = 4096`` and :531/:538: 4096 sizes (listed or as a range) are
    accepted, 4097 are not (mutants ``>``/``>=`` swapped, 4097)."""
    assert MAX_CAPTURE_SIZES == 4096
    GraphSpec.model_validate(_spec(4097, sizes=list(range(1, 4097))))
    GraphSpec.model_validate(_spec(4097, sizes={"start": 1, "stop": 4096, "step": 1}))
    with pytest.raises(SpecError, match=r"capture\.sizes: 4097 sizes; at most 4096"):
        GraphSpec.model_validate(_spec(4097, sizes=list(range(1, 4098))))
    with pytest.raises(SpecError, match=r"capture\.sizes: 4097 sizes; at most 4096"):
        GraphSpec.model_validate(_spec(4097, sizes={"start": 1, "stop": 4097, "step": 1}))


def test_yaml_nested_too_deeply_is_a_spec_error() -> None:
    """spec.py:708: YAML mappings nested past Python's recursion limit is ``<source>: invalid YAML: nested too
    deeply`` (mutants of the message or of the ``except RecursionError``)."""
    depth = 600  # mappings: below the loader's nesting limit (1000), past Python's recursion limit
    with pytest.raises(SpecError, match=r"^deep\.yaml: invalid YAML: nested too deeply$"):
        parse_yaml("{a: " * depth + "1" + "}" * depth, "deep.yaml")
    nested: list = []
    for _ in range(49):
        nested = [nested]
    assert parse_yaml("[" * 50 + "]" * 50, "ok.yaml") == nested


def test_expression_length_limit_at_its_edge() -> None:
    """expr.py:261 ``if len(source) > MAX_EXPR_CHARS`` (1000): 1000 characters parse, 1001 do not (mutants
    ``>=``, 1001)."""
    assert MAX_EXPR_CHARS == 1000
    text = "1" + " " * (MAX_EXPR_CHARS - 1)
    assert len(text) == 1000 and parse_expr(text).eval({}) == 1
    with pytest.raises(ExprError, match=r"is longer than 1000 characters"):
        parse_expr(text + " ")


@pytest.mark.parametrize("make", [
    lambda d: "(" * (d - 1) + "1" + ")" * (d - 1),  # parentheses: one level each
    lambda d: "-" * (d - 1) + "1",  # unary minus: one level each
    lambda d: " + ".join(["1"] * d),  # a chain of additions: one level per term
])  # fmt: skip
def test_expression_depth_limit_at_its_edge(make: Any) -> None:
    """expr.py:117/:123 ``if depth > MAX_EXPR_DEPTH`` (64): nesting 63 and 64 deep parses, 65 does not
    (mutants ``>=``, 63, 65)."""
    assert MAX_EXPR_DEPTH == 64
    for depth in (63, 64):
        parse_expr(make(depth))
    with pytest.raises(ExprError, match=r"is nested deeper than 64 levels"):
        parse_expr(make(65))


def test_int64_edge_reached_by_addition_and_given_as_an_int() -> None:
    """expr.py:221 ``if not -MAX_VALUE <= out <= MAX_VALUE`` and :256: 2**63 - 1 reached by addition is a
    value, one more overflows; ``parse_expr(2**63 - 1)`` parses, ``parse_expr(2**63)`` does not (mutants
    ``<``, ``MAX_VALUE + 1``)."""
    assert MAX_VALUE == 2**63 - 1
    assert parse_expr("4611686018427387904 + 4611686018427387903").eval({}) == 2**63 - 1
    assert parse_expr("-4611686018427387904 - 4611686018427387903").eval({}) == -(2**63 - 1)
    with pytest.raises(ExprError, match=r"overflows: a value exceeds ±\(2\*\*63 - 1\)"):
        parse_expr("4611686018427387904 + 4611686018427387904").eval({})
    with pytest.raises(ExprError, match=r"overflows"):
        parse_expr("-4611686018427387904 - 4611686018427387905").eval({})
    assert parse_expr(2**63 - 1).eval({}) == 2**63 - 1
    assert parse_expr(-(2**63 - 1)).eval({}) == -(2**63 - 1)
    with pytest.raises(ExprError, match=r"^integer of 64 bits is beyond ±\(2\*\*63 - 1\)$"):
        parse_expr(2**63)
    with pytest.raises(ExprError, match=r"^integer of 64 bits is beyond"):
        parse_expr(-(2**63))
    assert parse_expr("x + 1").eval({"x": 2**63 - 2}) == 2**63 - 1
    with pytest.raises(ExprError, match=r"'x' in 'x \+ 1' is beyond"):
        parse_expr("x + 1").eval({"x": 2**63})


def test_an_expression_ending_early_says_what_was_expected() -> None:
    """expr.py:97 ``want = f"{sym!r}" if sym else "a value"`` (mutmut ``xǁ_Parserǁtake__mutmut_4``: the
    closing symbol replaced by "a value")."""
    with pytest.raises(ExprError, match=r"^expression '\(1 \+ 2' ends early; expected '\)'$"):
        parse_expr("(1 + 2")
    with pytest.raises(ExprError, match=r"^expression '1 \+' ends early; expected a value$"):
        parse_expr("1 +")


def test_parenthesis_depth_is_restored_after_a_group_not_reset() -> None:
    """expr.py:131 ``self.depth -= 1`` (mutmut ``xǁ_Parserǁexpr__mutmut_17``, ``self.depth = 1``: after an
    inner group the depth would restart at 1, and a second group inside 30 parentheses could nest 71 deep)."""
    inner = "(" * 10 + "1" + ")" * 10 + " + " + "(" * 40 + "1" + ")" * 40
    with pytest.raises(ExprError, match=r"is nested deeper than 64 levels"):
        parse_expr("(" * 30 + inner + ")" * 30)
    assert parse_expr("(" * 20 + inner + ")" * 20).eval({}) == 2  # 1 + 20 + 40 = 61 levels


def test_a_long_expression_is_quoted_by_its_first_sixty_characters() -> None:
    """expr.py:64 ``_clip`` (mutmut ``x__clip__mutmut_7``: the quoted prefix replaced by ``None``): an error
    about a long expression quotes its first 60 characters and gives its length."""
    with pytest.raises(ExprError, match=r"^expression 'a{60}'\.\.\. \(1072 characters\) is longer"):
        parse_expr("a" * 70 + " +" + " " * 1000)
    with pytest.raises(ExprError, match=r"division by zero in 'a{60}'\.\.\. \(73 characters\)"):
        parse_expr("a" * 68 + " // 0").eval({"a" * 68: 1})
