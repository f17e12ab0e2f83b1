"""The restricted expression language of spec fields: grammar, semantics, and everything it refuses."""

from __future__ import annotations

import builtins

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphbuf.spec.expr import ExprError, parse_expr
from graphbuf.testing import examples


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("7", 7),
        ("  7 ", 7),
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("10 - 3 - 2", 5),
        ("2 * 3 % 4", 2),
        ("17 // 5", 3),
        ("17 % 5", 2),
        ("-7 // 2", -4),
        ("-7 % 3", 2),
        ("7 % -3", -2),
        ("--3", 3),
        ("-(2 + 3)", -5),
        ("2 - -3", 5),
        ("min(4, 2, 9)", 2),
        ("max(4, 2, 9)", 9),
        ("cdiv(10, 4)", 3),
        ("cdiv(8, 4)", 2),
        ("cdiv(0, 4)", 0),
        ("max(1, min(3, 2) * 5) + cdiv(5, 2)", 13),
        ("((((1))))", 1),
        ("1234567890123456789 // 10", 123456789012345678),
    ],
)
def test_arithmetic_follows_python_integer_semantics(text: str, value: int) -> None:
    assert parse_expr(text).eval({}) == value


def test_names_come_from_the_environment_and_are_reported() -> None:
    expr = parse_expr("cdiv(max_model_len, block_size) + requests - tokens % 2")
    assert expr.names == frozenset({"max_model_len", "block_size", "requests", "tokens"})
    env = {"max_model_len": 100, "block_size": 16, "requests": 3, "tokens": 5}
    assert expr.eval(env) == 7 + 3 - 1
    assert str(expr) == expr.text == "cdiv(max_model_len, block_size) + requests - tokens % 2"


def test_function_names_are_not_free_variables() -> None:
    assert parse_expr("min(a, 2)").names == frozenset({"a"})


def test_integer_input_is_a_constant_expression() -> None:
    expr = parse_expr(42)
    assert expr.eval({}) == 42
    assert expr.names == frozenset()


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty expression"),
        ("   ", "empty expression"),
        ("2 ** 3", "unexpected '*'"),
        ("4 / 2", "unexpected character '/'"),
        ("1.5", "unexpected character '.'"),
        ("a.b", "unexpected character '.'"),
        ("x[0]", "unexpected character '['"),
        ("'abc'", "unexpected character"),
        ("lambda: 1", "unexpected character ':'"),
        ("1 if 1 else 2", "unexpected 'if'"),
        ("1 2", "unexpected '2'"),
        ("(1 + 2", "ends early"),
        ("1 + 2)", "unexpected ')'"),
        ("1 +", "ends early"),
        ("*3", "unexpected '*'"),
        ("abs(-1)", "unknown function 'abs'"),
        ("__import__('os')", "unexpected character"),
        ("__import__(os)", "unknown function '__import__'"),
        ("eval(1)", "unknown function 'eval'"),
        ("min(1)", "at least 2 arguments, got 1"),
        ("max(3)", "at least 2 arguments, got 1"),
        ("cdiv(1)", "exactly 2 arguments, got 1"),
        ("cdiv(1, 2, 3)", "exactly 2 arguments, got 3"),
        ("min(1, 2", "ends early"),
        ("min 1", "unexpected '1'"),
        ("1 < 2", "unexpected character '<'"),
        ("x = 1", "unexpected character '='"),
    ],
)
def test_malformed_or_unsupported_constructs_are_parse_errors(text: str, fragment: str) -> None:
    with pytest.raises(ExprError) as info:
        parse_expr(text)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_parse_errors_point_at_the_offending_position() -> None:
    with pytest.raises(ExprError) as info:
        parse_expr("1 + ^ 2")
    assert "'^' at position 4 in '1 + ^ 2'" in str(info.value)
    assert "allowed: integers, names" in str(info.value)


@pytest.mark.parametrize("source", [True, False, 1.5, None, [1], b"1"])
def test_non_integer_non_string_sources_are_rejected(source: object) -> None:
    with pytest.raises(ExprError, match="expected an integer"):
        parse_expr(source)  # type: ignore[arg-type]


def test_unknown_name_at_evaluation_lists_the_known_names() -> None:
    with pytest.raises(ExprError, match=r"unknown name 'nope' in 'nope \+ 1'; known: a, b"):
        parse_expr("nope + 1").eval({"b": 1, "a": 2})


def test_unset_name_tells_how_to_set_it() -> None:
    with pytest.raises(ExprError, match=r"'num_blocks' in 'num_blocks - 1' has no value.*--set num_blocks=N"):
        parse_expr("num_blocks - 1").eval({"num_blocks": None})


@pytest.mark.parametrize("text", ["1 // 0", "1 % 0", "cdiv(1, 0)", "5 // (2 - 2)", "cdiv(4, z)"])
def test_division_by_zero_is_an_error(text: str) -> None:
    with pytest.raises(ExprError, match="division by zero"):
        parse_expr(text).eval({"z": 0})


def test_parsing_and_evaluation_never_call_eval_or_exec(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("eval/exec/compile called")

    for name in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, name, forbidden)
    assert parse_expr("max(a, 3) * cdiv(b, 2) - 1 % 7").eval({"a": 2, "b": 5}) == 8
    with pytest.raises(ExprError):
        parse_expr("__import__('os').system('true')")


# Random integer expressions: the evaluator agrees with Python on the same tree.
_leaf = st.integers(-50, 50).map(lambda v: (str(v) if v >= 0 else f"({v})", v))


def _combine(children: st.SearchStrategy[tuple[str, int]]) -> st.SearchStrategy[tuple[str, int]]:
    def binary(op: str) -> st.SearchStrategy[tuple[str, int]]:
        def build(pair: tuple[tuple[str, int], tuple[str, int]]) -> tuple[str, int]:
            (ta, a), (tb, b) = pair
            if op in ("//", "%", "cdiv") and b == 0:
                b, tb = 1, "1"
            value = {
                "+": lambda: a + b,
                "-": lambda: a - b,
                "*": lambda: a * b,
                "//": lambda: a // b,
                "%": lambda: a % b,
                "min": lambda: min(a, b),
                "max": lambda: max(a, b),
                "cdiv": lambda: -(-a // b),
            }[op]()
            text = f"{op}({ta}, {tb})" if op in ("min", "max", "cdiv") else f"({ta} {op} {tb})"
            return text, value

        return st.tuples(children, children).map(build)

    negated = children.map(lambda c: (f"-{c[0]}", -c[1]))
    return st.one_of(negated, *(binary(op) for op in ("+", "-", "*", "//", "%", "min", "max", "cdiv")))


@settings(max_examples=examples(150))
@given(st.recursive(_leaf, _combine, max_leaves=12))
def test_random_expressions_match_python(case: tuple[str, int]) -> None:
    text, value = case
    assert parse_expr(text).eval({}) == value
