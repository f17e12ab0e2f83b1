"""``task_options.py``: the adapter tasks' options, validated strictly (the scale comes from the model and
has no default), registered as factories that name binding, costs and strategy without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from graphbuf.adapters.vllm_ascend.spec.costs import decode_costs, verify_costs
from graphbuf.adapters.vllm_ascend.spec.task_options import (
    DECODE_TASK,
    VERIFY_TASK,
    DecodeTaskOptions,
    VerifyTaskOptions,
)

GEMMA4 = {"num_heads": 16, "num_kv_heads": 2, "head_dim": 512, "scale": 1.0}


def test_gemma4_s_options_and_the_defaults() -> None:
    d, v = DecodeTaskOptions(**GEMMA4), VerifyTaskOptions(**GEMMA4)
    assert (d.layers, d.dtype, d.decode_mode, d.scale) == (2, "float32", "paged", 1.0)
    assert (v.verify_mode, v.chunk_blocks) == ("blockwise", 2)


def test_the_scale_has_no_default_it_comes_from_the_model() -> None:
    with pytest.raises(ValidationError, match="scale"):
        DecodeTaskOptions(**{k: v for k, v in GEMMA4.items() if k != "scale"})


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"scale": 0.0}, "scale"),
        ({"scale": float("nan")}, "scale"),
        ({"scale": float("inf")}, "scale"),
        ({"num_kv_heads": 3}, "num_heads 16 is not a multiple of num_kv_heads 3"),
        ({"head_dim": "512"}, "head_dim"),
        ({"dtype": "float64"}, "dtype"),
        ({"layers": 0}, "layers"),
        ({"decode_mode": "flash"}, "decode_mode"),
        ({"sliding_window": 1024}, "sliding_window"),
    ],
)
def test_bad_decode_options_are_refused_by_field(bad: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        DecodeTaskOptions(**{**GEMMA4, **bad})


@pytest.mark.parametrize(
    ("bad", "named"), [({"verify_mode": "paged"}, "verify_mode"), ({"chunk_blocks": 0}, "chunk")]
)
def test_bad_verify_options_are_refused_by_field(bad: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        VerifyTaskOptions(**{**GEMMA4, **bad})


def test_the_factories_name_binding_costs_and_strategy() -> None:
    assert DECODE_TASK.factory == "graphbuf.adapters.vllm_ascend.bindings.attention_tasks:decode_task"
    assert VERIFY_TASK.factory == "graphbuf.adapters.vllm_ascend.bindings.attention_tasks:verify_task"
    assert (DECODE_TASK.options, DECODE_TASK.costs) == (DecodeTaskOptions, decode_costs)
    assert (VERIFY_TASK.options, VERIFY_TASK.costs) == (VerifyTaskOptions, verify_costs)
    assert (
        DECODE_TASK.strategy
        == VERIFY_TASK.strategy
        == "graphbuf.adapters.vllm_ascend.spec.strategies:vllm_decode_batch"
    )


def test_the_options_import_without_torch() -> None:
    code = "import sys, graphbuf.adapters.vllm_ascend.spec.task_options; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
