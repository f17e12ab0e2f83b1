"""Emulator replay vs eager: median time per call of a few small, realistic functions.

Usage: ``python bench/bench_emulator.py [--json PATH] [--iters N] [--threads T]``. Prints a table (function,
eager µs median, replay µs median, ratio replay/eager) and writes it as JSON when asked. Both sides run
under ``torch.inference_mode()`` (how serving code runs eager); replay is ``Graph("cpu").replay()`` of a
capture of the same function; the two are timed alternately, call by call. On a small shared machine
``--threads 1`` avoids intra-op thread wake-up stalls that swamp µs-scale timings. No assertions: this
measures, the issue tracker judges.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_json

from graphbuf.graphs.graph import Graph


@dataclass
class Case:
    name: str
    fn: Callable[[], object]
    iters_scale: float = 1.0


def paged_decode_case() -> Case:
    """Decode attention over a paged KV cache: gather by block table, GQA expand, masked softmax, matmul."""
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, head_dim = 8, 8, 2, 64
    block_size, num_blocks, max_blocks = 16, 64, 8
    ctx = block_size * max_blocks
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    block_table = torch.randint(0, num_blocks, (batch, max_blocks), generator=g)
    seq_lens = torch.randint(1, ctx + 1, (batch,), generator=g)
    q = torch.randn(batch, heads, head_dim, generator=g)
    out = torch.empty(batch, heads, head_dim)
    positions = torch.arange(ctx)
    scale = head_dim**-0.5
    group = heads // kv_heads

    def fn() -> None:
        k = k_cache[block_table].reshape(batch, ctx, kv_heads, 1, head_dim)
        v = v_cache[block_table].reshape(batch, ctx, kv_heads, 1, head_dim)
        k = k.expand(batch, ctx, kv_heads, group, head_dim).reshape(batch, ctx, heads, head_dim)
        v = v.expand(batch, ctx, kv_heads, group, head_dim).reshape(batch, ctx, heads, head_dim)
        scores = torch.einsum("bhd,bthd->bht", q, k) * scale
        hidden = positions[None, :] >= seq_lens[:, None]
        scores = scores.masked_fill(hidden[:, None, :], -math.inf)
        probs = scores.softmax(-1)
        out.copy_(torch.einsum("bht,bthd->bhd", probs, v))

    return Case("paged_decode_attention", fn)


def elementwise_case() -> Case:
    """A chain of small elementwise ops (activation / residual style), 4096 elements."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=g)
    a = torch.randn(4096, generator=g)
    b = torch.randn(4096, generator=g)
    out = torch.empty(4096)

    def fn() -> None:
        y = x * a + b
        y = torch.sigmoid(y) * y
        y = y.clamp(-3.0, 3.0)
        y = torch.tanh(y) * 0.5 + x
        out.copy_(y * y.rsqrt().nan_to_num(0.0))

    return Case("elementwise_chain", fn)


def rmsnorm_mlp_case() -> Case:
    """RMSNorm then a gated MLP (SiLU(x W_gate) * x W_up) W_down, 8 tokens, hidden 256."""
    g = torch.Generator().manual_seed(2)
    tokens, hidden, inter = 8, 256, 1024
    x = torch.randn(tokens, hidden, generator=g)
    norm_w = torch.randn(hidden, generator=g)
    w_gate_up = torch.randn(hidden, 2 * inter, generator=g) / hidden**0.5
    w_down = torch.randn(inter, hidden, generator=g) / inter**0.5
    out = torch.empty(tokens, hidden)

    def fn() -> None:
        var = x.pow(2).mean(-1, keepdim=True)
        xn = x * torch.rsqrt(var + 1e-6) * norm_w
        gate, up = (xn @ w_gate_up).chunk(2, dim=-1)
        out.copy_((torch.nn.functional.silu(gate) * up) @ w_down + x)

    return Case("rmsnorm_gated_mlp", fn)


def _paired_medians_us(
    eager: Callable[[], object], replay: Callable[[], object], iters: int
) -> tuple[float, float]:
    """Median µs per call of ``eager`` and ``replay``, timed alternately (the order flips every iteration)
    so that drift on a shared machine (clock, other load, thread wake-ups) hits both alike."""
    deadline = time.perf_counter() + 0.5  # warm up by time: thread pools and caches settle slowly
    while time.perf_counter() < deadline:
        eager()
        replay()
    clock = time.perf_counter_ns
    times: dict[int, list[int]] = {0: [], 1: []}
    calls = (eager, replay)
    for i in range(iters):
        for which in (i % 2, 1 - i % 2):
            t0 = clock()
            calls[which]()
            times[which].append(clock() - t0)
    return statistics.median(times[0]) / 1e3, statistics.median(times[1]) / 1e3


def run(iters: int) -> list[dict[str, object]]:
    rows = []
    for case in (paged_decode_case(), elementwise_case(), rmsnorm_mlp_case()):
        with torch.inference_mode():
            graph = Graph("cpu")
            with graph.capture():
                case.fn()
            e, r = _paired_medians_us(case.fn, graph.replay, max(50, int(iters * case.iters_scale)))
        emulator = graph.emulator
        assert emulator is not None
        rows.append(
            {
                "function": case.name,
                "eager_us_median": round(e, 2),
                "replay_us_median": round(r, 2),
                "ratio": round(r / e, 3),
                "replay_steps": emulator.num_steps,
                "strategies": emulator.stats,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results as JSON to this path")
    parser.add_argument("--iters", type=int, default=5000, help="timed calls per side and function")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args.iters)
    header = f"{'function':<24} {'eager µs':>10} {'replay µs':>10} {'ratio':>7}  steps  strategies"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['function']:<24} {row['eager_us_median']:>10.2f} {row['replay_us_median']:>10.2f} "
            f"{row['ratio']:>7.3f}  {row['replay_steps']:>5}  {row['strategies']}"
        )
    if args.json:
        write_json(args.json, "emulator", rows, iters=args.iters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
