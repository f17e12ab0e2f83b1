"""``graphbuf/drill/options.py``: the options of the drill's own paged-decode task, validated strictly and
registered as a task factory that names its class and strategy by path (no torch import)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from graphbuf.drill.options import PAGED_DECODE, PagedDecodeOptions


def test_defaults_and_every_field() -> None:
    o = PagedDecodeOptions()
    assert (o.num_heads, o.num_kv_heads, o.head_dim, o.dtype) == (4, 2, 64, "float32")
    o = PagedDecodeOptions(num_heads=16, num_kv_heads=2, head_dim=512, dtype="bfloat16")
    assert o.head_dim == 512 and o.dtype == "bfloat16"


@pytest.mark.parametrize(
    "bad",
    [
        {"num_heads": 0},
        {"head_dim": -1},
        {"head_dim": "64"},
        {"head_dim": 64.0},
        {"dtype": "int8"},
        {"scale": 1},
    ],
)
def test_bad_options_are_refused_by_field(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError, match=next(iter(bad))):
        PagedDecodeOptions(**bad)


def test_the_factory_names_its_task_and_strategy_by_path() -> None:
    assert PAGED_DECODE.options is PagedDecodeOptions
    assert PAGED_DECODE.factory == "graphbuf.drill.session:PagedDecodeAttention"
    assert PAGED_DECODE.strategy == "graphbuf.testing:paged_kv"


def test_the_options_import_without_torch() -> None:
    code = "import sys, graphbuf.drill.options; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
