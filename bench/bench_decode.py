"""Paged vs dense large-head decode per rank of Gemma4-31B-it: KV bytes gathered, time, agreement.

Usage: ``python bench/bench_decode.py [--quick] [--json PATH]``.

B one-token requests, all at the same live context, Nq 16, Nkv 2, head dim 512, block 128, W 43 blocks, in
bfloat16 on cpu. ``paged`` is ``decode_attention`` with host KV lengths (the software paged decode, the
contract of the NPU's paged fused-infer kernel: only the blocks the lengths need are read); ``dense``
gathers the whole allocation and masks with device lengths. Gathered bytes are counted (every
``index_select`` output, under a dispatch mode) and compared with ``graphbuf plan``'s figure for the same
route (per layer); time is the median of a few calls after one warm-up; the max abs difference is between
the two routes' outputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import SPEC, render_table, timed_ms, write_json

from graphbuf.adapters.vllm_ascend.bindings.large_head import decode_attention
from graphbuf.planning.planner import plan

__all__ = ["main", "run"]

NUM_BLOCKS = 256


class _Gathered(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.index_select.default:
            self.bytes += out.numel() * out.element_size()
        return out


def run(quick: bool = False, seed: int = 0) -> dict[str, Any]:
    """Measure; return JSON-ready results, one row per (batch, context)."""
    p = plan(SPEC, overrides={"num_blocks": NUM_BLOCKS})
    c = p.constants
    num_heads, num_kv_heads = int(c["num_heads_per_rank"]), int(c["full_kv_heads_per_rank"])  # type: ignore[arg-type]
    head_dim, block_size = int(c["global_head_dim"]), int(c["block_size"])  # type: ignore[arg-type]
    width, layers = int(c["max_blocks_per_seq"]), int(c["num_full_layers"])  # type: ignore[arg-type]
    scale = head_dim**-0.5
    batches = (4,) if quick else (4, 16)
    contexts = (256, 5500) if quick else (256, 1024, 2048, 5500)
    runs = 1 if quick else 3
    g = torch.Generator().manual_seed(seed)
    cache_shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    key = torch.randn(cache_shape, generator=g).to(torch.bfloat16)
    value = torch.randn(cache_shape, generator=g).to(torch.bfloat16)
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for batch in batches:
            query = torch.randn(batch, num_heads, head_dim, generator=g).to(torch.bfloat16)
            table = torch.randint(0, NUM_BLOCKS, (batch, width), generator=g, dtype=torch.int32)
            size = batch * p.tokens_per_request  # the capture size whose requests the plan counts
            for context in contexts:
                lens = torch.full((batch,), context, dtype=torch.int32)
                args = (query, key, value, table, lens, scale)
                host = [context] * batch

                def paged(a: tuple[Any, ...] = args, h: list[int] = host) -> torch.Tensor:
                    return decode_attention(*a, seq_lens_host=h)

                def dense(a: tuple[Any, ...] = args) -> torch.Tensor:
                    return decode_attention(*a)

                paged(), dense()  # warm-up
                with _Gathered() as paged_bytes:
                    paged()
                with _Gathered() as dense_bytes:
                    dense()
                paged_ms, paged_out = timed_ms(paged, runs)
                dense_ms, dense_out = timed_ms(dense, runs)
                routes = {(r.route, r.mode): r for _, r in p.route_costs(size, context)}
                rows.append(
                    {
                        "batch": batch,
                        "context": context,
                        "paged_gathered_bytes": paged_bytes.bytes,
                        "dense_gathered_bytes": dense_bytes.bytes,
                        "plan_paged_kv_read_bytes_per_layer": routes["decode", "paged"].kv_read_bytes
                        // layers,
                        "plan_dense_kv_read_bytes_per_layer": routes["decode", "dense"].kv_read_bytes
                        // layers,
                        "read_ratio": round(dense_bytes.bytes / paged_bytes.bytes, 2),
                        "paged_ms": round(paged_ms, 1),
                        "dense_ms": round(dense_ms, 1),
                        "max_abs_diff": (paged_out.float() - dense_out.float()).abs().max().item(),
                    }
                )
    for r in rows:  # what the kernels gathered is what `graphbuf plan` reports for the route
        if (r["paged_gathered_bytes"], r["dense_gathered_bytes"]) != (
            r["plan_paged_kv_read_bytes_per_layer"],
            r["plan_dense_kv_read_bytes_per_layer"],
        ):
            raise RuntimeError(f"gathered bytes differ from graphbuf plan's figures: {r}")
        if r["max_abs_diff"] > 0.015:
            raise RuntimeError(f"paged and dense decode disagree: {r}")
    return {
        "spec": SPEC,
        "quick": quick,
        "dtype": "bfloat16",
        "geometry": {
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "block_size": block_size,
            "width": width,
        },
        "runs_per_timing": runs,
        "rows": rows,
    }


def render(res: dict[str, Any]) -> str:
    """The table of :func:`run`'s results, as printed."""
    g = res["geometry"]
    mib = 2**20
    title = (
        f"decode attention per rank and layer on cpu, bf16: Nq {g['num_heads']}, Nkv {g['num_kv_heads']}, "
        f"D {g['head_dim']}, block {g['block_size']}, W {g['width']} "
        f"(median of {res['runs_per_timing']} calls)"
    )
    headers = ["B", "context", "paged MiB read", "plan", "dense MiB read", "plan", "ratio", "paged ms",
               "dense ms", "max diff"]  # fmt: skip
    rows = [
        [
            r["batch"],
            r["context"],
            r["paged_gathered_bytes"] / mib,
            r["plan_paged_kv_read_bytes_per_layer"] / mib,
            r["dense_gathered_bytes"] / mib,
            r["plan_dense_kv_read_bytes_per_layer"] / mib,
            r["read_ratio"],
            r["paged_ms"],
            r["dense_ms"],
            f"{r['max_abs_diff']:.3g}",
        ]
        for r in res["rows"]
    ]
    return render_table(title, headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    res = run(quick=args.quick)
    print(render(res))
    if args.json is not None:
        write_json(args.json, "decode", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
