"""Pins for ``graphbuf/planning/planner.py`` (issue 24 §1): each test fails on the mutant its docstring names
(line
numbers of main b2b8a44)."""

from __future__ import annotations

import json
import math

import pytest

from graphbuf import GraphSpec
from graphbuf.planning.planner import Plan, json_number, plan


def _plan(buffers: dict, sizes: list[int]) -> Plan:
    return plan(
        GraphSpec.model_validate(
            {
                "version": 1,
                "name": "planner-pins",
                "constants": {},
                "capture": {"tokens_per_request": 1, "sizes": sizes},
                "buffers": buffers,
            }
        )
    )


def test_bisection_past_the_table_finds_a_slowly_growing_rule() -> None:
    """planner.py:167 ``hi = (rows + 1) * max(1, largest requests)``: past the table, rows of a rule that
    grows slower than one row per request (``requests // 5 + 1``, largest capture 4 requests) are found
    at ``5 * (rows - 1)``, for ``rows = 9`` exactly that upper end (mutants ``rows * ...``, ``rows - 1``: the
    search stops short and answers None). Rows no count reaches answer None."""
    p = _plan({"slow": {"dtype": "int32", "rows": "requests // 5 + 1"}}, [1, 2, 4])
    # the table covers 0..4 requests: all 1 row
    assert p.requests_for_rows("slow", 1) == 0
    assert [p.requests_for_rows("slow", r) for r in (2, 5, 6, 9)] == [5, 20, 25, 40]  # 40 == (9 + 1) * 4
    r = _plan({"even": {"dtype": "int32", "rows": "2 * requests"}}, [1, 2, 4])
    assert r.requests_for_rows("even", 9) is None  # odd rows: no count has them
    assert r.requests_for_rows("even", 10) == 5
    assert r.requests_for_rows("even", 8) == 4  # within the table


@pytest.mark.parametrize(("pad", "want"), [
    (math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf"), (0.5, 0.5), (-0.0, -0.0), (3, 3),
])  # fmt: skip
def test_to_dict_writes_non_finite_pads_as_strings(pad: float, want: object) -> None:
    """planner.py:283 ``json_number``: NaN and ±inf pads become ``"nan"``/``"inf"``/``"-inf"`` in
    ``Plan.to_dict`` (strict JSON), finite ones stay numbers (mutants: the sign test flipped, ``"inf"`` for
    both, ``or`` for ``and``)."""
    p = _plan({"x": {"dtype": "float32", "rows": "requests", "pad": pad}}, [2])
    d = p.to_dict()
    got = d["buffers"][0]["pad"]
    assert got == want and type(got) is type(want)
    json.dumps(d, allow_nan=False)  # strict JSON
    assert json_number(pad) == want


# ---------------------------------------------------------------------------------------------------------
# Survivors of tools/mutation.py (mutmut names: build/mutation/planner)


def test_memory_per_size_counts_each_buffers_captured_rows() -> None:
    """``Plan.memory_at`` and ``_memory_dict`` (``memory_at__mutmut_2``: a start of 1 byte,
    ``memory_at__mutmut_9``: ``n /= d``; ``x__memory_dict__mutmut_3``: the ``staging`` key), and ``Plan.env``
    (``env__mutmut_5``: ``requests`` as ``tokens / tpr``, a float)."""
    p = plan(
        GraphSpec.model_validate(
            {
                "version": 1,
                "name": "memory",
                "constants": {"max_num_seqs": 4},
                "capture": {"tokens_per_request": 2, "sizes": [2, 8]},
                "buffers": {
                    "bt": {"dtype": "int32", "rows": "requests", "cols": 3},
                    "slots": {"dtype": "int64", "rows": "tokens"},
                },
            }
        )
    )
    env = p.env(6)
    assert env["requests"] == 3 and type(env["requests"]) is int and env["tokens"] == 6
    d = p.to_dict()
    total = p.total_bytes
    assert d["sizes"]["2"]["memory"] == {
        "buffers": 1 * 3 * 4 + 2 * 8,
        "staging": 2 * total,
        "workspaces": 0,
        "unselected_workspaces": 0,
    }
    assert d["sizes"]["8"]["memory"] == {
        "buffers": 4 * 3 * 4 + 8 * 8,
        "staging": 2 * total,
        "workspaces": 0,
        "unselected_workspaces": 0,
    }
    m = p.memory_at(8)
    assert (m.tokens, m.requests, m.buffer_bytes) == (8, 4, 112) and type(m.buffer_bytes) is int


def test_a_plan_above_max_bytes_names_the_need_the_limit_and_the_largest_buffer() -> None:
    """``plan`` (``x_plan__mutmut_139``: the message dropped)."""
    from graphbuf.errors import PlanTooLargeError

    spec = GraphSpec.model_validate(
        {
            "version": 1,
            "name": "big",
            "constants": {},
            "capture": {"tokens_per_request": 1, "sizes": [4]},
            "buffers": {
                "a": {"dtype": "int64", "rows": "requests", "cols": 8},
                "b": {"dtype": "int8", "rows": "requests"},
            },
        }
    )
    with pytest.raises(PlanTooLargeError) as err:
        plan(spec, max_bytes=100)
    assert str(err.value) == (
        f"big: limits.max_bytes: the plan needs {plan(spec).total_bytes} bytes, above the limit of 100 bytes "
        "(largest buffer: a, 256 bytes, shape [4, 8]); shrink the capture envelope or raise limits.max_bytes"
    )


def test_bisection_stops_at_its_documented_bound() -> None:
    """``requests_for_rows`` searches up to ``(rows + 1)`` times the largest capture's requests, as its
    docstring states (``requests_for_rows__mutmut_32``: ``rows + 2`` would search further): rows 10 of
    ``requests // 5 + 1`` need 45 requests, past 11 x 4 = 44, so the answer is None."""
    p = _plan({"slow": {"dtype": "int32", "rows": "requests // 5 + 1"}}, [1, 2, 4])
    assert p.requests_for_rows("slow", 9) == 40
    assert p.requests_for_rows("slow", 10) is None


def test_counts_past_the_table_are_integers() -> None:
    """``requests_for_rows__mutmut_38``: the bisection's bound is an integer, so is its answer."""
    p = _plan({"x": {"dtype": "int32", "rows": "requests // 3"}}, [4])
    found = p.requests_for_rows("x", 5)
    assert found == 15 and type(found) is int


def test_a_single_request_capture_has_a_table() -> None:
    """``requests_for_rows__mutmut_7``: the table spans 0 .. the largest capture's requests (here 0 and 1),
    never an empty range."""
    p = _plan({"x": {"dtype": "int32", "rows": "requests"}}, [1])
    assert p.requests_for_rows("x", 1) == 1 and p.requests_for_rows("x", 0) == 0


def test_to_dict_names_every_part_and_counts_requests_as_integers() -> None:
    """``to_dict__mutmut_3``/``_40``/``_67``: the keys, and ``requests`` per size an integer."""
    spec = {
        "version": 1,
        "name": "planner-pins",
        "constants": {"n": 3},
        "capture": {"tokens_per_request": 2, "sizes": [2, 6]},
        "buffers": {"x": {"dtype": "int32", "rows": "requests"}},
    }
    d = plan(GraphSpec.model_validate(spec)).to_dict()
    assert d["constants"] == {"n": 3} and "memory_totals" in d
    assert [d["sizes"][s]["requests"] for s in ("2", "6")] == [1, 3]
    assert all(type(d["sizes"][s]["requests"]) is int for s in ("2", "6"))
    assert json.loads(json.dumps(d)) == d
