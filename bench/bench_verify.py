"""Dense vs blockwise MTP verify attention per rank of Gemma4-31B-it: workspace bytes, time, agreement.

Usage: ``python bench/bench_verify.py [--quick] [--json PATH]``.

At each capture size of the Gemma4 spec (B = size // 4 requests, q_len 4): Nq 16, Nkv 2, head dim 512,
block 128, W 43 blocks (``max_blocks_per_seq``), in bfloat16 and float32 on cpu. Workspace bytes come from
``verify_workspace_bytes`` (dense, and blockwise at the default chunk); time is the median of a few calls
of ``verify_attention`` / ``verify_attention_blockwise`` after one warm-up per path and dtype; the max abs
difference is between the two outputs on the same inputs. Both paths gather the whole allocation whatever
the lengths, so time depends on B, not on the lengths. At the largest size the workspace ratio
dense/blockwise is reported, with the largest chunk that reaches the 8x target when the default does not.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import SPEC, render_table, timed_ms, write_json

from graphbuf.adapters.vllm_ascend.bindings.large_head import (
    DEFAULT_CHUNK_BLOCKS,
    verify_attention,
    verify_attention_blockwise,
    verify_workspace_bytes,
)
from graphbuf.planning.planner import plan

__all__ = ["TARGET_RATIO", "chunk_for_ratio", "main", "run"]

TARGET_RATIO = 8.0
NUM_BLOCKS = 256  # KV blocks in the benchmark's caches; ids repeat across requests, which changes no cost
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def chunk_for_ratio(geom: dict[str, int], dtype: torch.dtype, target: float) -> int | None:
    """The largest ``chunk_blocks`` whose blockwise workspace is at least ``target`` times below dense's."""
    for chunk in range(geom["width"], 0, -1):
        ws = verify_workspace_bytes(**geom, dtype=dtype, chunk_blocks=chunk)
        if ws["dense"] / ws["blockwise"] >= target:
            return chunk
    return None


def run(quick: bool = False, seed: int = 0) -> dict[str, Any]:
    """Measure; return JSON-ready results (one row per dtype and size, plus the largest-size summary)."""
    p = plan(SPEC, overrides={"num_blocks": NUM_BLOCKS})
    c = p.constants
    q_len = p.tokens_per_request
    num_heads = int(c["num_heads_per_rank"])  # type: ignore[arg-type]
    num_kv_heads = int(c["full_kv_heads_per_rank"])  # type: ignore[arg-type]
    head_dim = int(c["global_head_dim"])  # type: ignore[arg-type]
    block_size = int(c["block_size"])  # type: ignore[arg-type]
    width = int(c["max_blocks_per_seq"])  # type: ignore[arg-type]
    max_len = int(c["max_model_len"])  # type: ignore[arg-type]
    scale = head_dim**-0.5
    sizes = (p.capture_sizes[0], p.capture_sizes[-1]) if quick else p.capture_sizes
    runs = 2 if quick else 3
    g = torch.Generator().manual_seed(seed)
    rows: list[dict[str, Any]] = []
    largest: dict[str, Any] = {}
    with torch.inference_mode():
        for dname, dtype in DTYPES.items():
            cache_shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
            key = torch.randn(cache_shape, generator=g).to(dtype)
            value = torch.randn(cache_shape, generator=g).to(dtype)
            warmed = False
            for size in sizes:
                batch = size // q_len
                query = torch.randn(batch * q_len, num_heads, head_dim, generator=g).to(dtype)
                table = torch.randint(0, NUM_BLOCKS, (batch, width), generator=g, dtype=torch.int32)
                lens = torch.randint(q_len, max_len + 1, (batch,), generator=g, dtype=torch.int32)
                args = (query, key, value, table, lens, q_len, scale)
                if not warmed:  # first calls pay one-off allocator and kernel set-up
                    verify_attention(*args)
                    verify_attention_blockwise(*args)
                    warmed = True
                dense_ms, dense_out = timed_ms(lambda a=args: verify_attention(*a), runs)
                block_ms, block_out = timed_ms(lambda a=args: verify_attention_blockwise(*a), runs)
                geom = {
                    "batch": batch,
                    "q_len": q_len,
                    "width": width,
                    "block_size": block_size,
                    "num_kv_heads": num_kv_heads,
                    "head_dim": head_dim,
                    "num_heads": num_heads,
                }
                ws = verify_workspace_bytes(**geom, dtype=dtype, chunk_blocks=DEFAULT_CHUNK_BLOCKS)
                diff = (dense_out.float() - block_out.float()).abs().max().item()
                rows.append(
                    {
                        "dtype": dname,
                        "size": size,
                        "batch": batch,
                        "dense_workspace_bytes": ws["dense"],
                        "blockwise_workspace_bytes": ws["blockwise"],
                        "workspace_ratio": round(ws["dense"] / ws["blockwise"], 2),
                        "dense_ms": round(dense_ms, 1),
                        "blockwise_ms": round(block_ms, 1),
                        "max_abs_diff": diff,
                    }
                )
                if size == p.capture_sizes[-1]:
                    chunk = chunk_for_ratio(geom, dtype, TARGET_RATIO)
                    entry: dict[str, Any] = {
                        "size": size,
                        "default_chunk_blocks": DEFAULT_CHUNK_BLOCKS,
                        "ratio_at_default_chunk": round(ws["dense"] / ws["blockwise"], 2),
                        "meets_target_at_default_chunk": ws["dense"] / ws["blockwise"] >= TARGET_RATIO,
                        "largest_chunk_meeting_target": chunk,
                    }
                    if chunk is not None and not entry["meets_target_at_default_chunk"]:
                        ws_c = verify_workspace_bytes(**geom, dtype=dtype, chunk_blocks=chunk)
                        ms_c, out_c = timed_ms(
                            lambda a=args, k=chunk: verify_attention_blockwise(*a, chunk_blocks=k), runs
                        )
                        entry.update(
                            {
                                "ratio_at_that_chunk": round(ws_c["dense"] / ws_c["blockwise"], 2),
                                "blockwise_workspace_bytes_at_that_chunk": ws_c["blockwise"],
                                "blockwise_ms_at_that_chunk": round(ms_c, 1),
                                "max_abs_diff_at_that_chunk": (dense_out.float() - out_c.float())
                                .abs()
                                .max()
                                .item(),
                            }
                        )
                    largest[dname] = entry
    return {
        "spec": SPEC,
        "quick": quick,
        "geometry": {
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "block_size": block_size,
            "width": width,
            "q_len": q_len,
            "num_blocks": NUM_BLOCKS,
        },
        "runs_per_timing": runs,
        "rows": rows,
        "largest": largest,
        "target_ratio": TARGET_RATIO,
    }


def _mib(n: int) -> float:
    return n / 2**20


def render(res: dict[str, Any]) -> str:
    """The tables of :func:`run`'s results, as printed."""
    g = res["geometry"]
    rows = [
        [
            r["dtype"],
            r["size"],
            r["batch"],
            _mib(r["dense_workspace_bytes"]),
            _mib(r["blockwise_workspace_bytes"]),
            r["workspace_ratio"],
            r["dense_ms"],
            r["blockwise_ms"],
            f"{r['max_abs_diff']:.3g}",
        ]
        for r in res["rows"]
    ]
    out = [
        render_table(
            f"verify attention per rank on cpu: Nq {g['num_heads']}, Nkv {g['num_kv_heads']}, "
            f"D {g['head_dim']}, block {g['block_size']}, W {g['width']}, q_len {g['q_len']}; "
            f"blockwise chunk {DEFAULT_CHUNK_BLOCKS} blocks (median of {res['runs_per_timing']} calls)",
            [
                "dtype",
                "size",
                "B",
                "dense MiB",
                "blockwise MiB",
                "ratio",
                "dense ms",
                "blockwise ms",
                "max |diff|",
            ],
            rows,
        )
    ]
    for dname, e in res["largest"].items():
        line = (
            f"{dname} at size {e['size']}: workspace dense/blockwise {e['ratio_at_default_chunk']}x "
            f"at the default chunk ({e['default_chunk_blocks']} blocks); target >= {res['target_ratio']:g}x "
            f"{'met' if e['meets_target_at_default_chunk'] else 'NOT met'}"
        )
        if e["largest_chunk_meeting_target"] is None:
            line += "; no chunk reaches it"
        elif "ratio_at_that_chunk" in e:
            line += (
                f"; chunk {e['largest_chunk_meeting_target']} blocks reaches {e['ratio_at_that_chunk']}x "
                f"({_mib(e['blockwise_workspace_bytes_at_that_chunk']):.1f} MiB, "
                f"{e['blockwise_ms_at_that_chunk']} ms, "
                f"max |diff| {e['max_abs_diff_at_that_chunk']:.3g})"
            )
        else:
            line += f"; the largest chunk meeting it is {e['largest_chunk_meeting_target']} blocks"
        out.append(line)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smallest and largest size only, fewer calls")
    parser.add_argument("--json", type=Path, help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    res = run(quick=args.quick)
    print(render(res))
    if args.json:
        write_json(args.json, "verify", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
