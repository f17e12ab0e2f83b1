"""``graphbuf check`` for a vLLM configuration (issue 31 §6): the decode coverage certificate."""

from __future__ import annotations

import json
from typing import Any

import pytest

from graphbuf.cli import main
from graphbuf.planning.sizes import propose_sizes


def _run(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_off_grid_case_prints_the_eager_batch_and_the_sizes_that_cover_it(capsys: Any) -> None:
    code, out, _ = _run(capsys, "check", "--max-num-seqs", "13", "--num-speculative-tokens", "3")
    assert code == 0
    assert "capture sizes: [4, 8, 16, 24, 32, 40, 48]" in out
    assert "13 request (52 tokens) → EAGER" not in out and "13 requests (52 tokens) → EAGER" in out
    fix = list(propose_sizes(4, 13).sizes)
    assert f"cudagraph_capture_sizes={fix}" in out
    assert "vLLM truncates max_cudagraph_capture_size 52 → 48" in out


def test_strict_fails_on_an_eager_batch_and_passes_with_the_proposed_sizes(capsys: Any) -> None:
    code, _, err = _run(capsys, "check", "--max-num-seqs", "13", "--num-speculative-tokens", "3", "--strict")
    assert code == 1 and "check --strict" in err and "EAGERLY" in err
    sizes = ",".join(map(str, propose_sizes(4, 13).sizes))
    code, out, _ = _run(capsys, "check", "--max-num-seqs", "13", "--num-speculative-tokens", "3",
                        "--capture-sizes", sizes, "--strict")  # fmt: skip
    assert code == 0 and "EAGER" not in out


def test_compilation_config_json_and_json_output(capsys: Any) -> None:
    config = json.dumps({"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [4, 8, 52]})
    code, out, _ = _run(capsys, "check", "--max-num-seqs", "13", "--num-speculative-tokens", "3",
                        "--compilation-config", config, "--json")  # fmt: skip
    data = json.loads(out)
    assert code == 0 and data["ok"] is True and data["capture_sizes"] == [4, 8, 52]
    assert data["eager_requests"] == [] and data["serving"]["platform"] == "ascend"


def test_data_parallel_and_token_cap(capsys: Any) -> None:
    code, out, _ = _run(capsys, "check", "--max-num-seqs", "16", "--num-speculative-tokens", "3",
                        "--max-num-batched-tokens", "40", "--data-parallel-size", "2")  # fmt: skip
    assert code == 0 and "data_parallel_size 2" in out and "1..10 requests" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check"], "give a spec, or a vLLM configuration"),
        (["check", "--num-speculative-tokens", "3"], "needs --max-num-seqs"),
        (["check", "gemma4-31b-it-mtp", "--max-num-seqs", "8"], "not both"),
        (["check", "--max-num-seqs", "8", "--capture-sizes", "4", "--compilation-config", "{}"], "give one"),
        (["check", "--max-num-seqs", "8", "--compilation-config", "[1"], "invalid JSON"),
        (
            ["check", "--max-num-seqs", "4", "--num-speculative-tokens", "3", "--capture-sizes", "1,2"],
            "multiples of 4",
        ),
    ],
)
def test_usage_and_config_errors_exit_2(capsys: Any, argv: list[str], message: str) -> None:
    code, _, err = _run(capsys, *argv)
    assert code == 2 and message in err


@pytest.mark.parametrize("value", ["0", "x", "4,,a"])
def test_bad_numbers_are_usage_errors(capsys: Any, value: str) -> None:
    flag = "--capture-sizes" if "," in value else "--max-num-seqs"
    argv = (
        ["check", "--max-num-seqs", "4", flag, value] if flag != "--max-num-seqs" else ["check", flag, value]
    )
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


def test_the_spec_form_still_works(capsys: Any) -> None:
    code, out, _ = _run(capsys, "check", "gemma4-31b-it-mtp")
    assert code == 0 and "coverage:" in out
