"""Cost of the per-replay watch check as a share of one replay step's host time, on cpu (the emulator).

Usage: ``python bench/bench_address_check.py [--quick] [--json PATH]``.

A :class:`graphbuf.GraphRunner` over the Gemma4 spec's buffers captures a callable at every size; a step is
``runner.run(sources)`` (concurrency guard, watch check, refresh, task updates, replay, live rows). The
watch covers every tensor the graph uses: the buffers, task tensor arguments and the tensors from before
capture it reads (a KV cache). Measured per size: one check pass (``runner.check_addresses(size)``; a step
makes one, before the refresh, and hands its result to the replay), the runner's non-blocking concurrency
guard (a ``threading.Lock`` acquired without blocking and released), the refresh part of the step
(``runner.stats.refresh_s``) and the whole step; the share is (check + guard) / step. Two callables:

* ``elementwise``: a few cheap ops on the captured ``seq_lens`` and ``block_table.full``. Its replay costs
  about what launching a device graph costs the host, so this share is the one that carries over to a
  device (and is the conservative one).
* ``paged_decode``: graphbuf's built-in :class:`graphbuf.drill.session.PagedDecodeAttention` with small dims
  (4 query heads, 2 KV heads, head dim 64, fp32). On cpu its attention math runs inside the replay, on the
  host, so its share is far smaller than a device would show.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import SPEC, compare, render_table, step_buffers, write_json

from graphbuf.buffers.slab import StaticBuffers
from graphbuf.drill.session import PagedDecodeAttention
from graphbuf.graphs.runner import GraphRunner, Step
from graphbuf.planning.planner import plan
from graphbuf.spec.models import load_spec

__all__ = ["main", "run"]

NUM_BLOCKS = 512  # small KV caches for the paged callable; bounds stay active
TARGET_SHARE = 0.05


def elementwise(step: Step) -> torch.Tensor:
    """Cheap graph-safe callable: ``[requests]`` float32 from the captured lengths and first block ids."""
    lens = step.views["seq_lens"].to(torch.float32)
    first = step.views["block_table.full"][:, 0].to(torch.float32)
    return torch.tanh(lens * 1e-3 + first * 1e-4) * 2.0 + 1.0


def _measure(
    runner: GraphRunner, sources: dict[str, torch.Tensor], size: int, iters: int, warmup: int
) -> dict[str, float]:
    runner.stats.refresh_s.clear()
    lock = threading.Lock()

    def guard() -> None:  # what GraphRunner.run adds for its ConcurrentUseError guard
        if lock.acquire(blocking=False):
            lock.release()

    t = compare(
        {"check": lambda: runner.check_addresses(size), "guard": guard, "run": lambda: runner.run(sources)},
        iters={"check": max(20, iters // 10), "guard": max(20, iters // 10), "run": iters},
        inner={"check": 100, "guard": 100, "run": 1},
        rounds=min(5, iters),
        warmup=warmup,
    )
    refresh_us = statistics.median(runner.stats.refresh_s.recent) * 1e6
    return {"check_us": t["check"], "guard_us": t["guard"], "refresh_us": refresh_us, "run_us": t["run"]}


def run(quick: bool = False, seed: int = 0) -> dict[str, Any]:
    """Measure; return JSON-ready results (one row per callable and size)."""
    spec = load_spec(SPEC)
    p = plan(spec, overrides={"num_blocks": NUM_BLOCKS})
    tpr = p.tokens_per_request
    rng = np.random.default_rng(seed)
    sizes = (p.capture_sizes[0], p.capture_sizes[len(p.capture_sizes) // 2], p.capture_sizes[-1])
    # The paged callable captures only the measured sizes: the emulator's capture of its large gathers
    # takes seconds per size. Allocation and views are those of the full spec (the largest size is kept).
    few = spec.model_copy(update={"capture": spec.capture.model_copy(update={"sizes": list(sizes)})})
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for name in ("elementwise", "paged_decode"):
            if name == "elementwise":
                bufs = StaticBuffers(p, "cpu")
                fn: Any = elementwise
                output_rows, iters, warmup = "requests", (300 if quick else 3000), 10
            else:
                bufs = StaticBuffers(plan(few, overrides={"num_blocks": NUM_BLOCKS}), "cpu")
                task = PagedDecodeAttention(group="full", num_heads=4, num_kv_heads=2, head_dim=64)
                task.bind(bufs, torch.Generator().manual_seed(seed))
                fn = task
                output_rows, iters, warmup = "tokens", (3 if quick else 15), 1
            bufs.refresh(sizes[-1], step_buffers(p, sizes[-1] // tpr, rng).sources)
            runner = GraphRunner(bufs, fn, output_rows=output_rows)
            runner.capture()
            if runner.stats.capture_failures:
                raise RuntimeError(f"{name}: capture failed: {runner.stats.capture_failures}")
            for size in sizes:
                src = step_buffers(p, size // tpr, rng).sources
                m = _measure(runner, src, size, iters, warmup)
                if runner.stats.eager:
                    raise RuntimeError(f"{name}: size {size} ran eagerly: {runner.stats.as_dict()}")
                rows.append(
                    {
                        "callable": name,
                        "size": size,
                        "live_requests": size // tpr,
                        "watched": len(runner.watched(size)),
                        "check_us": round(m["check_us"], 3),
                        "guard_us": round(m["guard_us"], 3),
                        "refresh_us": round(m["refresh_us"], 2),
                        "run_us": round(m["run_us"], 2),
                        "check_share": round((m["check_us"] + m["guard_us"]) / m["run_us"], 5),
                    }
                )
    return {
        "spec": SPEC,
        "overrides": {"num_blocks": NUM_BLOCKS},
        "quick": quick,
        "buffers_checked": len(p.names),
        "rows": rows,
        "summary": {
            "max_check_share": max(r["check_share"] for r in rows),
            "max_check_share_elementwise": max(
                r["check_share"] for r in rows if r["callable"] == "elementwise"
            ),
            "target_share": TARGET_SHARE,
        },
    }


def render(res: dict[str, Any]) -> str:
    """The table of :func:`run`'s results, as printed."""
    rows = [
        [
            r["callable"],
            r["size"],
            r["live_requests"],
            r["watched"],
            r["check_us"],
            r["guard_us"],
            r["refresh_us"],
            r["run_us"],
            f"{100 * r['check_share']:.2f}%",
        ]
        for r in res["rows"]
    ]
    s = res["summary"]
    return "\n".join(
        [
            render_table(
                f"watch check vs replay step, {res['spec']} on cpu, {res['buffers_checked']} buffers "
                "(median µs; step = GraphRunner.run; share = (check + guard) / step)",
                [
                    "callable",
                    "size",
                    "live",
                    "watched",
                    "check µs",
                    "guard µs",
                    "refresh µs",
                    "step µs",
                    "share",
                ],
                rows,
            ),
            f"summary: check share max {100 * s['max_check_share']:.2f}% (elementwise, the device-like step: "
            f"{100 * s['max_check_share_elementwise']:.2f}%); target ≤ {100 * s['target_share']:.0f}%",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--json", type=Path, help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    res = run(quick=args.quick)
    print(render(res))
    if args.json:
        write_json(args.json, "address_check", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
