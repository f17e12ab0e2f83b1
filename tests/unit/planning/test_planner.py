"""The memory plan: dtypes, shapes at the largest capture size, bytes, 512-byte aligned offsets, per-group
names, keep buffers last."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import graphbuf
from graphbuf import BufferPlan, GraphSpec, Plan, SpecError
from graphbuf.planning.planner import ALIGNMENT

Mapping = dict[str, Any]


@pytest.fixture
def small_plan(spec_mapping: Callable[[], Mapping]) -> Plan:
    return graphbuf.plan(GraphSpec.model_validate(spec_mapping()))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def test_every_buffer_is_resolved(small_plan: Plan) -> None:
    got = {b.name: (b.dtype, b.shape, b.nbytes) for b in small_plan.buffers}
    assert got == {
        "block_table.a": (torch.int32, (4, 4), 64),
        "block_table.b": (torch.int32, (4, 4), 64),
        "seq_lens": (torch.int32, (4,), 16),
        "query_start_loc": (torch.int32, (5,), 20),
        "slot_mapping": (torch.int64, (8,), 64),
        "scratch": (torch.float32, (3,), 12),
    }
    assert small_plan.tokens_per_request == 2
    assert small_plan.capture_sizes == (2, 4, 8)
    assert small_plan["seq_lens"].min == 0 and small_plan["seq_lens"].max == 64
    assert small_plan["block_table.b"].max == 31
    assert small_plan["slot_mapping"].min == -1 and small_plan["slot_mapping"].max is None
    assert small_plan["query_start_loc"].pad == "repeat_last"
    assert small_plan["block_table.a"].overflow == "reject"
    assert small_plan["scratch"].keep and not small_plan["seq_lens"].keep


def test_offsets_are_aligned_ordered_and_disjoint(small_plan: Plan) -> None:
    assert ALIGNMENT == 512
    end = 0
    for b in small_plan.buffers:
        assert b.offset % ALIGNMENT == 0
        assert b.offset >= end
        assert b.nbytes == math.prod(b.shape) * _itemsize(b.dtype)
        end = b.offset + b.nbytes
    assert small_plan.total_bytes % ALIGNMENT == 0
    assert end <= small_plan.total_bytes < end + ALIGNMENT
    assert [b.offset for b in small_plan.buffers] == [i * 512 for i in range(6)]


def test_per_group_buffers_are_named_by_group_in_group_order(small_plan: Plan) -> None:
    bt = [b for b in small_plan.buffers if b.spec_name == "block_table"]
    assert [(b.name, b.group) for b in bt] == [("block_table.a", "a"), ("block_table.b", "b")]
    assert small_plan["seq_lens"].group is None
    assert "block_table" not in small_plan.names


def test_keep_buffers_are_laid_out_last(spec_mapping: Callable[[], Mapping], small_plan: Plan) -> None:
    assert next(iter(spec_mapping()["buffers"])) == "scratch"
    assert small_plan.names == (
        "block_table.a",
        "block_table.b",
        "seq_lens",
        "query_start_loc",
        "slot_mapping",
        "scratch",
    )
    d = spec_mapping()
    d["buffers"]["seq_lens"]["keep"] = True
    p = graphbuf.plan(GraphSpec.model_validate(d))
    assert p.names[-2:] == ("scratch", "seq_lens")  # declaration order among keep buffers
    assert max(p[n].offset for n in p.names[:-2]) < min(p[n].offset for n in p.names[-2:])


def test_shape_is_the_largest_over_capture_sizes(spec_mapping: Callable[[], Mapping]) -> None:
    d = spec_mapping()
    d["buffers"]["block_table"]["cols"] = "min(max_blocks, requests + 1)"
    p = graphbuf.plan(GraphSpec.model_validate(d))
    assert p["block_table.a"].shape == (4, 4)
    assert [p.shape_at(p["block_table.a"], s) for s in p.capture_sizes] == [(1, 2), (2, 3), (4, 4)]
    assert [p.shape_at(p["query_start_loc"], s) for s in p.capture_sizes] == [(2,), (3,), (5,)]
    for b in p.buffers:
        for s in p.capture_sizes:
            assert all(have >= need for have, need in zip(b.shape, p.shape_at(b, s)))


def test_env_has_constants_tokens_and_requests(small_plan: Plan) -> None:
    env = small_plan.env(8)
    assert env["tokens"] == 8 and env["requests"] == 4
    assert env["max_blocks"] == 4 and env["num_blocks"] == 32


@pytest.mark.parametrize(
    "dtype", ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
)
def test_every_dtype_plans_with_its_torch_dtype(spec_mapping: Callable[[], Mapping], dtype: str) -> None:
    d = spec_mapping()
    d["buffers"] = {"x": {"dtype": dtype, "rows": "tokens", "cols": 3}}
    b = graphbuf.plan(GraphSpec.model_validate(d))["x"]
    assert b.dtype == getattr(torch, dtype)
    assert b.nbytes == 8 * 3 * _itemsize(b.dtype)


def test_plan_accepts_a_spec_a_path_or_a_shipped_name(
    spec_mapping: Callable[[], Mapping], write_yaml: Callable[..., Path]
) -> None:
    path = write_yaml(spec_mapping())
    by_spec = graphbuf.plan(GraphSpec.model_validate(spec_mapping()))
    by_path = graphbuf.plan(str(path))
    assert by_spec.buffers == by_path.buffers
    assert by_spec.total_bytes == by_path.total_bytes
    assert graphbuf.plan("gemma4-31b-it-mtp").spec.name == "gemma4-31b-it-mtp"


def test_overrides_flow_through_every_entry_point(
    spec_mapping: Callable[[], Mapping], write_yaml: Callable[..., Path]
) -> None:
    path = write_yaml(spec_mapping())
    for source in (GraphSpec.model_validate(spec_mapping()), str(path)):
        p = graphbuf.plan(source, overrides={"max_blocks": 7, "num_blocks": 100})
        assert p["block_table.a"].shape == (4, 7)
        assert p["block_table.a"].max == 99
        assert p.constants["max_blocks"] == 7
    with pytest.raises(SpecError, match=r"overrides\.bogus: unknown constant"):
        graphbuf.plan(str(path), overrides={"bogus": 1})


def test_plan_is_read_only(small_plan: Plan) -> None:
    with pytest.raises(TypeError):
        small_plan.constants["num_blocks"] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):
        small_plan.buffers[0].offset = 3  # type: ignore[misc]
    assert isinstance(small_plan.buffers[0], BufferPlan)


def test_to_dict_is_json_with_totals_and_rows_per_size(small_plan: Plan) -> None:
    data = json.loads(json.dumps(small_plan.to_dict()))
    assert data["name"] == "small"
    assert data["total_bytes"] == small_plan.total_bytes == 3072
    assert data["max_bytes"] == 1 << 30
    assert data["capture_sizes"] == [2, 4, 8]
    assert [b["name"] for b in data["buffers"]] == list(small_plan.names)
    assert data["buffers"][0] == {
        "name": "block_table.a",
        "dtype": "int32",
        "shape": [4, 4],
        "bytes": 64,
        "offset": 0,
        "pad": 0,
        "min": 0,
        "max": 31,
    }
    assert data["sizes"]["4"]["requests"] == 2
    assert data["sizes"]["4"]["rows"] == {
        "block_table.a": 2,
        "block_table.b": 2,
        "seq_lens": 2,
        "query_start_loc": 3,
        "slot_mapping": 4,
        "scratch": 3,
    }


def test_workspaces_are_reported_per_size(spec_mapping: Callable[[], Mapping]) -> None:
    d = spec_mapping()
    d["workspaces"] = {"kv": {"dtype": "bfloat16", "shape": [2, "requests", "max_blocks"]}}
    p = graphbuf.plan(GraphSpec.model_validate(d))
    assert [p.workspace_bytes(p.workspaces[0], s) for s in p.capture_sizes] == [16, 32, 64]
    assert p.to_dict()["sizes"]["8"]["workspace_bytes"] == {"kv": 64}
    assert p.total_bytes == graphbuf.plan(GraphSpec.model_validate(spec_mapping())).total_bytes


def test_shipped_gemma_plan() -> None:
    p = graphbuf.plan("gemma4-31b-it-mtp", overrides={"num_blocks": 1000})
    assert p.capture_sizes == tuple(range(4, 65, 4))  # 1..max_num_seqs (16) requests of 4 tokens
    assert p.tokens_per_request == 4
    shapes = {b.name: (str(b.dtype), b.dtype_name, b.itemsize, b.shape) for b in p.buffers}
    assert shapes == {
        "block_table.sliding": ("torch.int32", "int32", 4, (16, 43)),
        "block_table.full": ("torch.int32", "int32", 4, (16, 43)),
        "seq_lens": ("torch.int32", "int32", 4, (16,)),
        "query_start_loc": ("torch.int32", "int32", 4, (17,)),
        "slot_mapping.sliding": ("torch.int64", "int64", 8, (64,)),
        "slot_mapping.full": ("torch.int64", "int64", 8, (64,)),
    }
    assert p["block_table.full"].max == 999
    assert p.total_bytes == 8192
