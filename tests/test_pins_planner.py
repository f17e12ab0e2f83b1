"""Pins for ``graphbuf/planner.py`` (issue 24 §1): each test fails on the mutant its docstring names (line
numbers of main b2b8a44)."""

from __future__ import annotations

import json
import math

import pytest

from graphbuf import GraphSpec
from graphbuf.planner import Plan, json_number, plan


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
