"""``graphbuf plan``'s task routes (issue 10, §5): per capture size, what each route of a task reads and
materializes per step, in every mode, from the cost hooks registered factories declare.

The figures of the adapter's hooks are checked against independent arithmetic and against what the software
kernels actually gather (index_select elements counted under a dispatch mode).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import graphbuf
from graphbuf.adapters.vllm_ascend.bindings import large_head as lh
from graphbuf.cli import main
from graphbuf.spec.factories import RouteCost, registered_factories

GEMMA = "gemma4-31b-it-mtp"
DECODE = "graphbuf.adapters.vllm_ascend.bindings.attention_tasks:decode_task"
VERIFY = "graphbuf.adapters.vllm_ascend.bindings.attention_tasks:verify_task"


def _routes(p: graphbuf.Plan, size: int, context: int | None = None) -> dict[tuple[str, str], RouteCost]:
    return {(c.route, c.mode): c for _, c in p.route_costs(size, context)}


def test_the_adapter_factories_declare_cost_hooks() -> None:
    registry = registered_factories()
    assert registry[DECODE].costs is not None and registry[VERIFY].costs is not None


def test_every_route_and_mode_is_reported_per_capture_size_with_the_selected_one_marked() -> None:
    p = graphbuf.plan(GEMMA)
    c = p.constants
    for size in p.capture_sizes:
        routes = _routes(p, size)
        assert set(routes) == {("decode", "paged"), ("decode", "dense"), ("verify", "blockwise"),
                               ("verify", "dense")}  # fmt: skip
        assert [m for (r, m), cost in routes.items() if cost.selected] == ["paged", "blockwise"]
        requests = size // p.tokens_per_request
        capacity = c["max_blocks_per_seq"] * c["block_size"]
        per_key = 2 * c["full_kv_heads_per_rank"] * c["global_head_dim"] * 2  # K and V, bf16
        worst = c["num_full_layers"] * requests * capacity * per_key
        for cost in routes.values():
            assert (cost.layers, cost.context, cost.kv_read_bytes) == (c["num_full_layers"], capacity, worst)
        verify_ws = lh.verify_workspace_bytes(
            requests, p.tokens_per_request, c["max_blocks_per_seq"], c["block_size"],
            c["full_kv_heads_per_rank"], c["global_head_dim"], torch.bfloat16, c["verify_chunk_blocks"],
            num_heads=c["num_heads_per_rank"],
        )  # fmt: skip
        assert routes["verify", "blockwise"].workspace_bytes == verify_ws["blockwise"]
        assert routes["verify", "dense"].workspace_bytes == verify_ws["dense"]
        ws = [
            routes[k].workspace_bytes
            for k in (("decode", "paged"), ("verify", "blockwise"), ("decode", "dense"))
        ]
        assert ws == sorted(ws) and ws[0] * 1000 < ws[1] and ws[1] * 8 < ws[2]


def test_paged_decode_reads_follow_the_context_the_gather_routes_do_not() -> None:
    p = graphbuf.plan(GEMMA)
    at_1000, worst = _routes(p, 64, 1000), _routes(p, 64)
    c = p.constants
    keys = math.ceil(1000 / c["block_size"]) * c["block_size"]
    per_key = 2 * c["full_kv_heads_per_rank"] * c["global_head_dim"] * 2
    assert at_1000["decode", "paged"].kv_read_bytes == c["num_full_layers"] * 16 * keys * per_key
    assert at_1000["decode", "paged"].kv_read_bytes * 5 < worst["decode", "paged"].kv_read_bytes
    for key in (("decode", "dense"), ("verify", "blockwise"), ("verify", "dense")):
        assert at_1000[key].kv_read_bytes == worst[key].kv_read_bytes  # the whole allocation
    assert _routes(p, 64, 10**9)["decode", "paged"].context == c["max_blocks_per_seq"] * c["block_size"]


class _GatherCount(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.index_select.default:
            self.elements += out.numel()
        return out


@pytest.mark.parametrize("context", [1, 130, 300, 512])
def test_reported_kv_reads_are_what_the_software_kernels_gather(context: int) -> None:
    overrides = {"max_model_len": 512, "num_full_layers": 1}
    p = graphbuf.plan(GEMMA, overrides=overrides)
    c = p.constants
    size = 8  # 2 requests of 4 tokens
    routes = _routes(p, size, context)
    requests, q_len = 2, p.tokens_per_request
    bs, width, kv, dim = (
        c["block_size"],
        c["max_blocks_per_seq"],
        c["full_kv_heads_per_rank"],
        c["global_head_dim"],
    )
    gen = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(8, bs, kv, dim, generator=gen).to(torch.bfloat16) for _ in range(2))
    table = torch.arange(requests * width, dtype=torch.int32).view(requests, width) % 8
    lens = torch.full((requests,), context, dtype=torch.int32)
    scale = dim**-0.5
    decode_q = torch.randn(requests, c["num_heads_per_rank"], dim, generator=gen).to(torch.bfloat16)
    verify_q = torch.randn(requests * q_len, c["num_heads_per_rank"], dim, generator=gen).to(torch.bfloat16)
    runs: dict[tuple[str, str], Callable[[], Any]] = {
        ("decode", "paged"): lambda: lh.decode_attention(decode_q, kc, vc, table, lens, scale,
                                                         seq_lens_host=[context] * requests),
        ("decode", "dense"): lambda: lh.decode_attention(decode_q, kc, vc, table, lens, scale),
        ("verify", "blockwise"): lambda: lh.verify_attention_blockwise(verify_q, kc, vc, table, lens, q_len,
                                                                       scale),
        ("verify", "dense"): lambda: lh.verify_attention(verify_q, kc, vc, table, lens, q_len, scale),
    }  # fmt: skip
    for key, run in runs.items():
        with _GatherCount() as gathered:
            run()
        assert gathered.elements * 2 == routes[key].kv_read_bytes, key  # bf16 elements -> bytes


def test_task_options_move_the_selected_mark() -> None:
    spec = graphbuf.load_spec(GEMMA)
    tasks = [
        t.model_copy(update={"options": {**t.options, "decode_mode": "dense"}}) if t.name == "decode"
        else t.model_copy(update={"options": {**t.options, "verify_mode": "dense"}})
        for t in spec.tasks
    ]  # fmt: skip
    p = graphbuf.plan(spec.model_copy(update={"tasks": tasks}))
    assert [m for (r, m), c in _routes(p, 4).items() if c.selected] == ["dense", "dense"]


def test_tasks_without_a_cost_hook_report_no_routes(spec_mapping: Callable[[], dict[str, Any]]) -> None:
    p = graphbuf.plan(graphbuf.GraphSpec.model_validate(spec_mapping()))
    assert all(p.route_costs(s) == [] for s in p.capture_sizes)
    assert all(d["routes"] == [] for d in p.to_dict()["sizes"].values())


def test_cli_plan_prints_the_routes_and_their_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", GEMMA, "--context", "1000"]) == 0
    text = capsys.readouterr().out
    assert "task routes per capture size, per step at 1000 tokens of context per request" in text
    assert "paged*" in text and "blockwise*" in text
    assert main(["plan", GEMMA, "--json", "--context", "1000"]) == 0
    routes = json.loads(capsys.readouterr().out)["sizes"]["64"]["routes"]
    assert {(r["task"], r["mode"], r["selected"]) for r in routes} == {
        ("decode", "paged", True), ("decode", "dense", False), ("verify", "blockwise", True),
        ("verify", "dense", False),
    }  # fmt: skip
    assert all(r["context"] == 1000 for r in routes)
    with pytest.raises(SystemExit):
        main(["plan", GEMMA, "--context", "-1"])
    assert "--context: must be an integer >= 0" in capsys.readouterr().err


def test_core_graphbuf_names_no_engine_in_the_cost_path() -> None:
    import inspect

    import graphbuf.planning.planner
    import graphbuf.spec.factories

    for module in (graphbuf.spec.factories, graphbuf.planning.planner):
        source = inspect.getsource(module).lower()
        assert "vllm" not in source and "gemma" not in source, module.__name__
