"""More pins for ``graphbuf/spec/models.py`` (issue 24 §2): bounds after an unset one, the growth check's
sample and message, huge integers behind recursive aliases, clipped integers, special files named like a
shipped spec; each test names the mutant it kills."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
from conftest import SMALL_SPEC

from graphbuf import GraphSpec, SpecError, load_spec
from graphbuf.spec.models import _short, resolve_spec_path


def _spec(**buffers: object) -> dict:
    spec = copy.deepcopy(SMALL_SPEC)
    spec["buffers"].update(buffers)
    return spec


def test_a_max_is_checked_when_there_is_no_min() -> None:
    """``_check_buffer__mutmut_86`` (``break`` for ``continue``): an unset ``min`` does not skip ``max``."""
    with pytest.raises(SpecError, match=r"buffers\.x\.max"):
        GraphSpec.model_validate(_spec(x={"dtype": "int32", "rows": "requests", "max": "no_such_name"}))


def test_a_rule_negative_only_at_odd_counts_is_found_past_the_sampling_threshold() -> None:
    """``_check_growth__mutmut_30``: above 4096 requests the rule is sampled with step top // 4096, which
    is 1 here: every count is checked, the odd ones too."""
    spec = _spec(x={"dtype": "int8", "rows": "requests - 2 * (requests % 2) * requests"})
    spec["capture"] = {"tokens_per_request": 1, "sizes": [8000]}
    spec["constants"].update(max_num_seqs=8000, max_num_batched_tokens=8000)
    with pytest.raises(SpecError, match=r"is -1 at 1 requests \(1 tokens\); must be ≥ 0"):
        GraphSpec.model_validate(spec)


def test_a_negative_rule_names_its_token_count() -> None:
    """``_check_growth__mutmut_52``: the tokens are requests × tokens_per_request (an integer)."""
    with pytest.raises(SpecError, match=r"'requests - 3' is -3 at 0 requests \(0 tokens\); must be ≥ 0"):
        GraphSpec.model_validate(_spec(x={"dtype": "int32", "rows": "requests - 3"}))


def test_a_huge_literal_behind_a_recursive_alias_is_named(tmp_path: Path) -> None:
    """``_huge_integer_path__mutmut_6``/``_7``: the search visits each node once (a recursive alias does
    not loop) and still reaches the literal."""
    text = (
        "version: 1\nname: big\nmeta:\n  loop: &loop [*loop]\n"
        f"constants:\n  big: {'9' * 5000}\n"
        "capture: {sizes: [2]}\nbuffers:\n  x: {dtype: int32, rows: requests}\n"
    )
    path = tmp_path / "big.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError, match=r"constants\.big"):
        load_spec(path)


def test_integers_are_clipped_above_200_bits() -> None:
    """``_short__mutmut_6``: the bound is 200 bits."""
    assert _short(2**200) == "<integer of 201 bits>"
    assert _short(2**199) == repr(2**199)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_special_file_named_like_a_shipped_spec_is_not_replaced_by_it(tmp_path: Path) -> None:
    """``resolve_spec_path__mutmut_19``: a path that exists but is no file is refused, not swapped for the
    shipped spec of the same name."""
    fifo = tmp_path / "gemma4-31b-it-mtp.yaml"
    os.mkfifo(fifo)
    with pytest.raises(SpecError, match=r"no such spec file"):
        resolve_spec_path(fifo)
    with pytest.raises(SpecError, match=r"a path never names a shipped spec"):  # issue 35 §4
        resolve_spec_path(tmp_path / "nowhere" / "gemma4-31b-it-mtp.yaml")
