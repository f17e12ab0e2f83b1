"""Shared fixtures for the core tests: a small valid spec mapping, a YAML writer, a slab snapshot helper; and
the Hypothesis profiles: ``ci`` (derandomized, each test's own example count; the default, used by .ci/run)
and ``deep`` (random, ten times the examples): ``pytest --hypothesis-profile=deep``."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import settings

from graphbuf import StaticBuffers
from graphbuf.testing import register_profiles

# Helper modules the tests import by name.
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
# The shipped planted-bug example (README, "A drill that shrinks") is the tests' planted_tasks module.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "planted"))

#: The fake vllm-ascend fixtures (av1, fake_tree, kernels) of the adapter's patch, routing and plugin tests.
#: The buffers suite's two backends (``backend``: native and numpy, every test under tests/unit/buffers).
pytest_plugins = ["vllm_plugin_harness", "backends"]

register_profiles()
settings.load_profile("ci")  # Hypothesis' plugin loads --hypothesis-profile=NAME over it

# A small spec with one buffer of every kind the refresh rules distinguish. Capacities at sizes 2, 4, 8
# (tokens_per_request 2): 1, 2, 4 requests; block tables are 4 columns wide (cdiv(64, 16)).
SMALL_SPEC: dict[str, Any] = {
    "version": 1,
    "name": "small",
    "constants": {
        "max_num_seqs": 4,
        "max_num_batched_tokens": 8,
        "block_size": 16,
        "max_model_len": 64,
        "max_blocks": "cdiv(max_model_len, block_size)",
        "num_blocks": 32,
    },
    "capture": {"tokens_per_request": 2, "sizes": [8, 2, 4]},
    "groups": ["a", "b"],
    "buffers": {
        "scratch": {"dtype": "float32", "rows": 3, "keep": True, "pad": 0.5},
        "block_table": {
            "dtype": "int32",
            "rows": "requests",
            "cols": "max_blocks",
            "per_group": True,
            "pad": 0,
            "min": 0,
            "max": "num_blocks - 1",
        },
        "seq_lens": {"dtype": "int32", "rows": "requests", "pad": 0, "min": 0, "max": "max_model_len"},
        "query_start_loc": {
            "dtype": "int32",
            "rows": "requests + 1",
            "pad": "repeat_last",
            "min": 0,
            "max": "max_num_batched_tokens",
        },
        "slot_mapping": {"dtype": "int64", "rows": "tokens", "pad": -1, "min": -1},
    },
}


def _slab_bytes(buffers: StaticBuffers) -> bytes:
    """Every byte of ``buffers``' slab, copied to the host."""
    return buffers.slab.cpu().numpy().tobytes()


@pytest.fixture
def spec_mapping() -> Callable[[], dict[str, Any]]:
    """A factory returning a fresh deep copy of :data:`SMALL_SPEC` (valid; mutate freely)."""
    return lambda: copy.deepcopy(SMALL_SPEC)


@pytest.fixture
def write_yaml(tmp_path: Path) -> Callable[..., Path]:
    """``write_yaml(content, name="spec.yaml") -> Path``: a mapping (as YAML) or raw text, under tmp_path."""

    def write(content: Mapping[str, Any] | str, name: str = "spec.yaml") -> Path:
        path = tmp_path / name
        text = content if isinstance(content, str) else yaml.safe_dump(dict(content), sort_keys=False)
        path.write_text(text, encoding="utf-8")
        return path

    return write


@pytest.fixture
def slab_bytes() -> Callable[[StaticBuffers], bytes]:
    """``slab_bytes(buffers) -> bytes``: ``buffers.slab.cpu().numpy().tobytes()``."""
    return _slab_bytes
